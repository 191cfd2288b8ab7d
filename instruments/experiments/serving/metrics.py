"""What a served stream measured, in the field's terms (``vllm bench serve``'s), and the floor a
batched step cannot beat. Torch-free.

``point(served, ...)`` -> one row: requests served, output tokens/s, requests/s, and TTFT
(first token - arrival), TPOT ((finish - first token) / (output tokens - 1), per request) and
ITL (the gaps between a request's successive tokens, pooled). Each is given as mean, p50 and
p99 (``instruments.store.stats``: p99 from 100 samples on, else None with a note). Goodput is
the requests/s that met the SLO (TTFT <= ``slo_ttft_ms`` and TPOT <= ``slo_tpot_ms``). The
row also holds the most and the mean running batch, the preemptions, and the prefix tree's
share of prompt tokens (hit rate).

``step_floor_ms(cfg, dtype, contexts, prefill_tokens, peaks)`` is one step's floor:
max(FLOPs / the measured matmul peak, bytes / the measured read bandwidth). The FLOPs are each
decoding sequence's cached step at its context plus 2 x N per prefilled token. The bytes are
the weights, read once for the whole batch, plus each decoding sequence's own K/V rows.
``by_batch(steps, ...)`` gives, for the decode-only steps, the median step at each batch beside
that floor, and the K/V and weight reads that make it up. ``kv_overtakes(rows)`` is the
smallest batch whose K/V reads exceed the weights'.
"""

from __future__ import annotations

import statistics
from typing import Any

from instruments.costmodel import costs
from instruments.store.stats import percentile


def _pct(xs: list[float], prefix: str) -> dict[str, Any]:
    return {f"{prefix}_mean_ms": statistics.fmean(xs) if xs else None,
            f"{prefix}_p50_ms": percentile(xs, 50), f"{prefix}_p99_ms": percentile(xs, 99),
            f"{prefix}_n": len(xs)}


def request_times(r: dict[str, Any]) -> tuple[float | None, float | None, list[float]]:
    """(TTFT ms, TPOT ms, ITLs ms) of one request row (None where it produced too little)."""
    if r["first_token_s"] is None:
        return None, None, []
    ttft = (r["first_token_s"] - r["arrival_s"]) * 1e3
    ts = r["token_s"]
    itl = [(b - a) * 1e3 for a, b in zip(ts, ts[1:], strict=False)]
    tpot = (ts[-1] - ts[0]) * 1e3 / (len(ts) - 1) if len(ts) > 1 else None
    return ttft, tpot, itl


def point(served: Any, *, slo_ttft_ms: float, slo_tpot_ms: float, **labels: Any
          ) -> dict[str, Any]:
    """One row for a served stream (the module docstring); ``labels`` lead the row."""
    done = [r for r in served.requests if r["finish_s"] is not None]
    ttfts, tpots, itls, good = [], [], [], 0
    for r in done:
        ttft, tpot, itl = request_times(r)
        if ttft is None:
            continue
        ttfts.append(ttft)
        itls.extend(itl)
        if tpot is not None:
            tpots.append(tpot)
        good += ttft <= slo_ttft_ms and (tpot is None or tpot <= slo_tpot_ms)
    dur = max(served.duration_s, 1e-12)
    out_tokens = sum(len(r["generated_ids"]) for r in done)
    prompt = sum(r["prompt_tokens"] for r in done)
    batches = [s["batch"] for s in served.steps]
    return {**labels, "requests": len(done), "duration_s": served.duration_s,
            "output_tokens": out_tokens, "output_tok_s": out_tokens / dur,
            "requests_s": len(done) / dur, "goodput_requests_s": good / dur,
            "slo_met": good / len(done) if done else None,
            **_pct(ttfts, "ttft"), **_pct(tpots, "tpot"), **_pct(itls, "itl"),
            "batch_max": max(batches, default=0),
            "batch_mean": statistics.fmean(batches) if batches else 0.0,
            "preemptions": sum(s["preempted"] for s in served.steps),
            "hit_rate": sum(r["cached_tokens"] for r in done) / prompt if prompt else 0.0,
            "steps": len(served.steps),
            "schedule_share": (sum(s["schedule_ms"] for s in served.steps)
                               / max(sum(s["schedule_ms"] + s["step_ms"]
                                         for s in served.steps), 1e-12)),
            "stopped": served.stopped}


def step_floor_ms(cfg: Any, dtype: str, contexts: list[int], prefill_tokens: int,
                  peaks: dict[str, float]) -> dict[str, float]:
    """One step's floor and its parts (the module docstring), in ms."""
    flops = sum(costs.step_flops(cfg, c, True) for c in contexts)
    flops += 2 * costs.linear_params(cfg) * prefill_tokens
    weights = costs.linear_weight_bytes(cfg, dtype)
    kv = sum(contexts) * costs.kv_bytes_per_token(cfg, dtype)
    bw = peaks["read_gbps"] * 1e9
    compute_ms = flops / (peaks["matmul_tflops"] * 1e12) * 1e3
    weights_ms, kv_ms = weights / bw * 1e3, kv / bw * 1e3
    return {"floor_ms": max(compute_ms, weights_ms + kv_ms), "compute_ms": compute_ms,
            "weights_read_ms": weights_ms, "kv_read_ms": kv_ms, "flops": flops,
            "read_bytes": weights + kv}


def by_batch(steps: list[dict[str, Any]], cfg: Any, dtype: str, peaks: dict[str, float],
             **labels: Any) -> list[dict[str, Any]]:
    """Per batch of the decode-only steps: the median step, its floor (the parts of one step's:
    the step whose floor is the median, the lower of two, so that floor_ms is still the max of
    its compute and its reads) and the step over its floor."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for s in steps:
        if s["batch"] and s["prefill_tokens"] == 0:
            groups.setdefault(s["batch"], []).append(s)
    rows = []
    for batch, ss in sorted(groups.items()):
        floors = [step_floor_ms(cfg, dtype, s["contexts"], 0, peaks) for s in ss]
        step_ms = statistics.median(s["step_ms"] for s in ss)
        floor = sorted(floors, key=lambda f: f["floor_ms"])[(len(floors) - 1) // 2]
        rows.append({**labels, "batch": batch, "steps": len(ss), "step_ms": step_ms,
                     "step_samples_ms": [s["step_ms"] for s in ss],
                     "schedule_ms": statistics.median(s["schedule_ms"] for s in ss),
                     "context_mean": statistics.fmean(c for s in ss for c in s["contexts"]),
                     "tok_s": batch / step_ms * 1e3, **floor,
                     "over_floor": step_ms / floor["floor_ms"]})
    return rows


def kv_overtakes(rows: list[dict[str, Any]]) -> int | None:
    """The smallest batch whose steps' K/V reads exceed the weights' read (None: none)."""
    return next((r["batch"] for r in rows if r["kv_read_ms"] > r["weights_read_ms"]), None)
