"""The four serving experiments' bodies, each a function of (model, params, peaks, tracker) that
fills the tracker's tables and returns the meta it adds. ``instruments.experiments.serving``
(the experiment module) dispatches to them.

  concurrency  a closed loop of C clients for each C: each client sends its next request when
               the last one finishes. Rows ``points`` (tokens/s, TTFT, TPOT, ITL) and
               ``batch_steps`` (the decode-only step against the batch, beside its floor)
  load         an open loop: seeded Poisson arrivals at each rate, served three ways (one
               request at a time, static batches of ``max_seqs``, continuous batching).
               Rows ``points``, plus the highest rate at which each way held the SLO
  budget       the same requests, all at once, under KV budgets from one request's blocks to
               every request's. Rows ``points`` with the preemptions; ``steps`` holds the
               running batch over time
  schedule     the prefix workload (shared system prompts and documents, Poisson arrivals at
               the highest rate) under a budget of half its working set (every shared part and
               the largest request), FCFS against longest prefix match. Rows ``points`` with
               the hit rate
Every point runs on a fresh engine. A short request is served untimed first, so a point's
first step pays no first-call cost. Each request's ids and times go to ``requests``, and each
step to ``steps``.
"""

from __future__ import annotations

from typing import Any

import instruments.experiments.serving.metrics as metrics
from instruments.experiments.serving.driver import Arrival, drive
from instruments.experiments.serving.workload import poisson, prefix_requests, random_requests
from instruments.spine import Tracker

SLO_SHARE = 0.9  # a rate "holds the SLO" when at least this share of its requests meet it


def engine_for(model: Any, p: Any, budget_tokens: int, kv_storage: str = "model",
               **kw: Any) -> Any:
    """A fresh engine whose pool holds ``budget_tokens`` tokens of K/V in the model's dtype
    (the same bytes hold about four times the tokens in int8)."""
    from engine.serving import ServingEngine, default_step

    bpt = model.config.kv_bytes_per_token(model.dtype.itemsize)
    reads = None if p.reads == "auto" or kv_storage == "int8" else p.reads
    step = p.step if p.step != "auto" else default_step(model.device, model.dtype)
    if kv_storage == "int8" or reads == "gather":
        step = "forward"  # the fast step reads blocks of the model's dtype in place
    return ServingEngine(model, budget_tokens * bpt, block_tokens=p.block_tokens,
                         max_seqs=kw.pop("max_seqs", p.max_seqs), step_tokens=p.step_tokens,
                         reads=reads, step=step, kv_storage=kv_storage, **kw)


def blocks_tokens(arrivals: list[Arrival], block_tokens: int) -> int:
    """Tokens of K/V the pool needs to hold every request at its full length at once (each
    rounded up to whole blocks, plus the one a mid-block hit copies)."""
    return sum((-(-(len(a.prompt) + a.new_tokens) // block_tokens) + 1) * block_tokens
               for a in arrivals)


def warm(model: Any, p: Any) -> None:
    eng = engine_for(model, p, 16 * p.block_tokens)
    eng.submit([1, 2, 3, 4], 2)
    eng.drain()


def _keep(tr: Tracker, served: Any, every_step: bool = True) -> None:
    for r in served.requests:
        tr.tables.setdefault("requests", []).append(r)
    if every_step:
        tr.tables.setdefault("steps", []).extend(served.steps)


def _serve(tr: Tracker, engine: Any, arrivals: list[Arrival], label: str, **kw: Any) -> Any:
    def on_step(row: dict[str, Any]) -> None:
        tr.work += 1
        tr.emit(f"{label}: step {row['step'] + 1}, batch {row['batch']}", table="live",
                row=row, force=False)

    served = drive(engine, arrivals, label=label, should_stop=tr.stop, on_step=on_step, **kw)
    tr.tables.pop("live", None)  # streamed for the page; the run keeps ``steps``
    return served


def concurrency_requests(model: Any, p: Any) -> list[Arrival]:
    """The concurrency experiment's requests, the peers' too: concurrency c serves the first
    max(c x rounds, 2)."""
    return random_requests(max(p.concurrency) * p.rounds, model.config.vocab_size,
                           (p.prompt_min, p.prompt_max), (p.output_min, p.output_max), p.seed)


def concurrency(model: Any, p: Any, peaks: dict[str, float], tr: Tracker) -> dict[str, Any]:
    cfg, dtype = model.config, str(model.dtype).removeprefix("torch.")
    every = concurrency_requests(model, p)
    curves: list[dict[str, Any]] = []
    for c in p.concurrency:
        arrivals = every[: max(c * p.rounds, 2)]
        engine = engine_for(model, p, blocks_tokens(arrivals[:c], p.block_tokens) * 2,
                            max_seqs=max(c, 1))
        served = _serve(tr, engine, arrivals, f"C={c}", clients=c)
        _keep(tr, served)
        row = metrics.point(served, slo_ttft_ms=p.slo_ttft_ms, slo_tpot_ms=p.slo_tpot_ms,
                            label=f"C={c}", concurrency=c, reads=engine.reads)
        tr.row("points", row, f"concurrency {c}: {row['output_tok_s']:.1f} output tok/s")
        curves.extend(metrics.by_batch(served.steps, cfg, dtype, peaks, label=f"C={c}",
                                       concurrency=c))
        if served.stopped:
            return {"partial": True}
    merged = metrics.by_batch([s for s in tr.tables.get("steps", [])], cfg, dtype, peaks,
                              label="all")
    tr.tables["batch_steps"] = merged + curves
    return {"kv_overtakes_batch": metrics.kv_overtakes(merged)}


def load(model: Any, p: Any, peaks: dict[str, float], tr: Tracker) -> dict[str, Any]:
    cfg = model.config
    base = random_requests(p.requests, cfg.vocab_size, (p.prompt_min, p.prompt_max),
                           (p.output_min, p.output_max), p.seed)
    budget = blocks_tokens(base[: p.max_seqs], p.block_tokens) * 2
    held: dict[str, float | None] = {}
    for rate in p.rates:
        arrivals = poisson(base, rate, p.seed)
        for way in p.ways:
            engine = engine_for(model, p, budget)
            label = f"{way} @ {rate:g}/s"
            served = _serve(tr, engine, arrivals, label, mode=way, static_batch=p.max_seqs)
            _keep(tr, served)
            row = metrics.point(served, slo_ttft_ms=p.slo_ttft_ms, slo_tpot_ms=p.slo_tpot_ms,
                                label=label, way=way, rate_per_s=rate)
            tr.row("points", row, f"{label}: TTFT p50 {row['ttft_p50_ms'] or 0:,.0f} ms, "
                   f"{row['output_tok_s']:.1f} tok/s")
            if (row["slo_met"] or 0) >= SLO_SHARE:
                held[way] = max(held.get(way) or 0.0, rate)
            else:
                held.setdefault(way, None)
            if served.stopped:
                return {"partial": True, "slo_max_rate": held}
    return {"slo_max_rate": held, "slo_share": SLO_SHARE}


def budget(model: Any, p: Any, peaks: dict[str, float], tr: Tracker) -> dict[str, Any]:
    cfg = model.config
    arrivals = random_requests(p.requests, cfg.vocab_size, (p.prompt_min, p.prompt_max),
                               (p.output_min, p.output_max), p.seed)
    one = max(blocks_tokens([a], p.block_tokens) for a in arrivals)
    everything = blocks_tokens(arrivals, p.block_tokens)
    budgets = p.budgets_tokens or _spread(one, everything)
    tr.total = len(budgets) * len(p.kv_storages)
    for storage in p.kv_storages:
        for tokens in budgets:
            engine = engine_for(model, p, tokens, kv_storage=storage)
            kv = "int8" if storage == "int8" else str(model.dtype).removeprefix("torch.")
            label = f"{kv}, {tokens:,} tokens' bytes"
            served = _serve(tr, engine, arrivals, label)
            _keep(tr, served)
            row = metrics.point(served, slo_ttft_ms=p.slo_ttft_ms, slo_tpot_ms=p.slo_tpot_ms,
                                label=label, budget_tokens=tokens, kv_dtype=kv,
                                budget_bytes=engine.cache.pool.nbytes(),
                                pool_tokens=engine.cache.pool.n_blocks * p.block_tokens)
            tr.row("points", row, f"budget {label}: {row['preemptions']} preemptions, "
                   f"{row['output_tok_s']:.1f} tok/s")
            if served.stopped:
                return {"partial": True}
            if p.recheck and storage == "model" and tokens == budgets[0]:  # the tightest
                tr.row("recheck", recheck(model, served, p.recheck, label),
                       f"{label}: {p.recheck} requests served again alone", points=0)
    return {"one_request_tokens": one, "all_requests_tokens": everything}


def recheck(model: Any, served: Any, limit: int, label: str) -> dict[str, Any]:
    """Up to ``limit`` of a point's requests served again alone, through the one decode loop
    (``engine.loop.generate``, a preallocated cache, greedy): how many requests and tokens
    differ from what they got served together."""
    from engine.loop import generate

    reqs = [r for r in served.requests if r["generated_ids"]][:limit]
    tokens = requests = 0
    for r in reqs:
        want = generate(model, [r["prompt_ids"]], len(r["generated_ids"]), logits="last")
        diff = sum(a != b for a, b in zip(want[0].tolist(), r["generated_ids"], strict=True))
        tokens += diff
        requests += diff > 0
    return {"label": label, "requests": len(reqs), "requests_differing": requests,
            "tokens_differing": tokens,
            "tokens": sum(len(r["generated_ids"]) for r in reqs),
            "preemptions": sum(r["preemptions"] for r in reqs)}


def _spread(lo: int, hi: int, n: int = 5) -> list[int]:
    """``n`` budgets from ``lo`` to ``hi`` tokens, spaced evenly in log."""
    if hi <= lo:
        return [lo]
    return sorted({round(lo * (hi / lo) ** (i / (n - 1))) for i in range(n)})


def schedule(model: Any, p: Any, peaks: dict[str, float], tr: Tracker) -> dict[str, Any]:
    cfg = model.config
    rate = max(p.rates)  # arrivals faster than service: a queue for the policy to order
    arrivals = prefix_requests(cfg, p.requests, rate, p.output_max,
                               systems=p.systems, system_tokens=p.system_tokens,
                               documents=p.documents, document_tokens=p.document_tokens,
                               seed=p.seed)
    # the working set: every shared part (system prompts, documents) and the largest request;
    # the budget holds half of it (at least two of the largest requests), so parts are evicted
    # and the order of admission decides which stay
    largest = blocks_tokens([max(arrivals, key=lambda a: len(a.prompt) + a.new_tokens)],
                            p.block_tokens)
    working = p.systems * p.system_tokens + p.documents * p.document_tokens + largest
    tokens = p.budgets_tokens[0] if p.budgets_tokens else max(2 * largest, working // 2)
    for policy in p.policies:
        engine = engine_for(model, p, tokens, policy=policy)
        served = _serve(tr, engine, arrivals, policy)
        _keep(tr, served)
        row = metrics.point(served, slo_ttft_ms=p.slo_ttft_ms, slo_tpot_ms=p.slo_tpot_ms,
                            label=policy, policy=policy, budget_tokens=tokens,
                            evictions=engine.cache.evictions)
        tr.row("points", row, f"{policy}: hit rate {row['hit_rate']:.0%}, TTFT p50 "
               f"{row['ttft_p50_ms'] or 0:,.0f} ms")
        if served.stopped:
            return {"partial": True}
    return {"budget_tokens": tokens, "working_set_tokens": working,
            "groups": len({a.group for a in arrivals}), "rate_per_s": rate}
