"""Requests sharing system prompts and documents, arriving at random, served through the prefix
cache under byte budgets (kind "prefix_workload").

``run(loaded, PrefixWorkloadParams, progress, should_stop)`` -> run with tables
  requests  one row per request and budget: its system prompt and document (or none), prompt
            and cached tokens, ``prefill_ms`` (measured: lookup, admission and prefill to the
            first token's logits), ``service_ms`` (prefill, ``new_tokens`` greedy steps and
            the finish), ``wait_ms`` and ``ttft_ms`` = wait + prefill, the bytes the pool
            held after it, evictions so far
  budgets   one row per budget, and "no reuse" (every prompt computed whole, nothing kept):
            the hit rate (cached / prompt tokens), requests that hit, TTFT and prefill p50 /
            p99 (``instruments.store.stats``: p99 from 100 requests on), the most and the mean
            bytes held, evictions, tokens computed
  tree      the tree at each of the first ``picture_steps`` admissions under budget number
            ``picture_budget``: one row per node (span, blocks, shared blocks, the largest
            reference count, lock = the running request reads it, last use) and one for the
            running request's own blocks (``request``: node -1, under its cached prefix)
  evictions the leaves evicted there, with the step that evicted them
The mix is seeded: ``systems`` system prompts of ``system_tokens``, ``documents`` documents of
``document_tokens`` (a request carries one with probability ``doc_share``), then a question of
its own (``question_min``..``question_max`` tokens); arrivals are a Poisson process of
``rate_per_s``. Requests are served one at a time in arrival order: service times are
measured, the queue is computed from them on a virtual clock (nothing sleeps), so
``wait_ms`` is what a single server of these service times would have made each request wait.
Every budget serves the same stream on a fresh cache; a budget that cannot hold the largest
request is refused before anything runs.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from typing import Any

from engine.models.config import ModelConfig
from instruments.experiments.inputs import whole
from instruments.experiments.prefix.parts import budget_for, load_avg, serve, token_ids
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, no_grad, record
from instruments.store.stats import percentile

MIB = 2**20
BUDGET_TOKENS = (700, 1400, 2800, 5600)  # default budgets, in tokens of K/V


@dataclass
class PrefixWorkloadParams:
    """The mix, its arrivals and the budgets (MiB) it is served under."""

    budgets_mib: list[float]
    requests: int = 100
    systems: int = 2
    system_tokens: int = 192
    documents: int = 4
    document_tokens: int = 384
    doc_share: float = 0.6
    question_min: int = 8
    question_max: int = 40
    new_tokens: int = 4
    rate_per_s: float = 1.0
    block_tokens: int = 16
    picture_budget: int = 0  # the smallest budget: the one that evicts most
    picture_steps: int = 60
    seed: int = 0

    @classmethod
    def defaults(cls, device: str, cfg: ModelConfig) -> PrefixWorkloadParams:
        """Budgets of 700 to 5,600 tokens of this model's K/V (fp32), the mix shrunk to fit
        the model's context."""
        bpt = budget_for(cfg, "float32", 1)
        p = cls([round(t * bpt / MIB, 2) for t in BUDGET_TOKENS])
        fit = cfg.block_size - p.question_max - p.new_tokens
        if p.system_tokens + p.document_tokens > fit:
            p.system_tokens, p.document_tokens = fit // 3, fit // 3 * 2 - 1
        return p

    def largest(self) -> int:
        return self.system_tokens + self.document_tokens + self.question_max + self.new_tokens

    def check(self, cfg: ModelConfig, device: str) -> None:
        for name, value, lo, hi in (("requests", self.requests, 1, 5000),
                                    ("system prompts", self.systems, 1, 64),
                                    ("system prompt tokens", self.system_tokens, 1, None),
                                    ("documents", self.documents, 0, 256),
                                    ("document tokens", self.document_tokens, 1, None),
                                    ("shortest question", self.question_min, 1, None),
                                    ("longest question", self.question_max, self.question_min,
                                     None), ("new tokens", self.new_tokens, 1, 256),
                                    ("block tokens", self.block_tokens, 1, 256),
                                    ("picture steps", self.picture_steps, 0, 1000)):
            whole(name, value, lo, hi)
        if self.largest() > cfg.block_size:
            raise ValueError(f"the largest request ({self.largest()} tokens: system + document "
                             f"+ question + new) is beyond the model's context of "
                             f"{cfg.block_size}; allowed: at most {cfg.block_size}")
        if not 0 <= self.doc_share <= 1 or not self.rate_per_s > 0:
            raise ValueError(f"doc share must be within 0..1 and the rate above 0 requests/s, "
                             f"got {self.doc_share} and {self.rate_per_s}")
        if not self.budgets_mib:
            raise ValueError("no budget given; allowed: one or more sizes in MiB")
        # the engine's own rule (engine.cache.prefix): every block of the request, plus one
        need = (-(-self.largest() // self.block_tokens) + 1) * self.block_tokens
        need_mib = budget_for(cfg, "float32", need) / MIB
        small = [b for b in self.budgets_mib if b < need_mib]
        if small:
            raise ValueError(f"a budget of {small[0]:g} MiB is smaller than one request's "
                             f"blocks ({need} tokens of K/V in float32: {need_mib:.2f} MiB); "
                             "allowed: "
                             f"budgets of at least {need_mib:.2f} MiB")
        whole("picture budget", self.picture_budget, 0, len(self.budgets_mib) - 1)


Params = PrefixWorkloadParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budgets-mib", default=None, help="KV budgets in MiB (default: 700 to "
                   "5,600 tokens of the model's K/V)")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--rate", type=float, default=1.0, help="arrivals per second (Poisson)")
    p.add_argument("--new-tokens", type=int, default=4, help="tokens generated per request")


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> PrefixWorkloadParams:
    p = PrefixWorkloadParams.defaults(args.device, cfg)
    if args.budgets_mib:
        try:
            p.budgets_mib = [float(b) for b in str(args.budgets_mib).split(",") if b.strip()]
        except ValueError:
            raise ValueError(f"--budgets-mib must be numbers separated by commas, got "
                             f"{args.budgets_mib!r}") from None
    p.requests, p.rate_per_s, p.new_tokens, p.seed = (args.requests, args.rate, args.new_tokens,
                                                      args.seed)
    return p


def summary(run: dict[str, Any]) -> list[str]:
    def ms(v: float | None) -> str:
        return "—" if v is None else f"{v:,.0f}"

    return [f"{r['label']:>12s}: hit rate {r['hit_rate']:.0%}, TTFT p50 {ms(r['ttft_p50_ms'])} "
            f"/ p99 {ms(r['ttft_p99_ms'])} ms (prefill p50 {ms(r['prefill_p50_ms'])}), held up "
            f"to {r['bytes_held_max'] / MIB:.1f} MiB, {r['evictions']} evictions"
            for r in run["tables"].get("budgets", [])]


def mix(cfg: ModelConfig, p: PrefixWorkloadParams) -> list[dict[str, Any]]:
    """The seeded stream: per request its arrival (s), system, document and prompt ids."""
    rng = random.Random(p.seed)
    v = cfg.vocab_size
    systems = [token_ids(v, p.system_tokens, p.seed * 7919 + s, first=s) for s in
               range(p.systems)]
    docs = [token_ids(v, p.document_tokens, p.seed * 7919 + 1000 + d) for d in
            range(p.documents)]
    out, clock = [], 0.0
    for i in range(p.requests):
        clock += rng.expovariate(p.rate_per_s)
        s = rng.randrange(p.systems)
        d = rng.randrange(p.documents) if p.documents and rng.random() < p.doc_share else None
        q = token_ids(v, rng.randint(p.question_min, p.question_max), p.seed * 7919 + 5000 + i)
        out.append({"request": i, "arrival_s": clock, "system": s, "document": d,
                    "ids": systems[s] + (docs[d] if d is not None else []) + q})
    return out


def _picture(cache: Any, req: Any, step: int, tr: Tracker, seen: int) -> int:
    """The tree's rows at this step, the running request's own blocks (node -1, under the
    node its cached prefix ends in), and the evictions since the last; the events seen."""
    rows = tr.tables.setdefault("tree", [])
    for n in cache.snapshot():
        refs = n.pop("refs")
        n.pop("blocks")
        rows.append({"step": step, **n, "blocks": len(refs), "max_ref": max(refs),
                     "request": False})
    own = len(req.table) - req.cached // cache.block_tokens
    rows.append({"step": step, "node": -1, "parent": req.node.id, "start": req.cached,
                 "end": req.prompt_len, "tokens": req.prompt_len - req.cached, "blocks": own,
                 "shared_blocks": 0, "lock": 1, "last_used": cache.clock, "max_ref": 1,
                 "request": True})
    for e in cache.events[seen:]:
        tr.tables.setdefault("evictions", []).append({"step": step, **e})
    return len(cache.events)


def _serve_stream(model: Any, stream: list[dict[str, Any]], budget: int, reuse: bool,
                  label: str, picture: int, p: PrefixWorkloadParams, tr: Tracker) -> bool:
    """The stream under one budget: a row per request, one for the budget; True if stopped."""
    from engine.cache import PrefixCache

    cache = PrefixCache(model, budget, block_tokens=p.block_tokens)
    free_at, seen, rows = 0.0, 0, []
    for r in stream:
        if tr.stop():
            return True
        start = time.perf_counter()
        s = serve(model, cache, r["ids"], p.new_tokens, reuse)
        prefill_ms = (time.perf_counter() - start) * 1e3
        held = cache.used_bytes()  # at the first token: the tree's blocks and the request's
        if r["request"] < picture:
            seen = _picture(cache, s.request, r["request"], tr, seen)
        s.request.greedy(model, s.logits, p.new_tokens)
        (cache.finish if reuse else cache.cancel)(s.request)
        service_ms = (time.perf_counter() - start) * 1e3
        begin_s = max(r["arrival_s"], free_at)  # one server, first come first served
        free_at = begin_s + service_ms / 1e3
        wait_ms = (begin_s - r["arrival_s"]) * 1e3
        row = {"label": label, "budget_mib": budget / MIB, "reuse": reuse,
               "request": r["request"], "arrival_s": r["arrival_s"], "system": r["system"],
               "document": r["document"], "prompt_tokens": len(r["ids"]),
               "cached_tokens": s.cached, "lookup_ms": s.lookup_ms, "prefill_ms": prefill_ms,
               "service_ms": service_ms, "wait_ms": wait_ms, "ttft_ms": wait_ms + prefill_ms,
               "bytes_held": held, "evictions": cache.evictions,
               "tree_tokens": cache.tokens_held()}
        rows.append(row)
        tr.work += 1
        tr.row("requests", row, f"{label}: request {r['request'] + 1} of {len(stream)}, "
               f"{s.cached} of {len(r['ids'])} tokens cached", points=0)
    prompt = sum(r["prompt_tokens"] for r in rows)
    tr.row("budgets", {
        "label": label, "budget_mib": budget / MIB, "reuse": reuse, "requests": len(rows),
        "hit_rate": sum(r["cached_tokens"] for r in rows) / prompt,
        "requests_hit": sum(r["cached_tokens"] > 0 for r in rows),
        **{f"{k}_p{q}_ms": percentile([r[f"{k}_ms"] for r in rows], q)
           for k in ("ttft", "prefill") for q in (50, 99)},
        "bytes_held_max": max(r["bytes_held"] for r in rows),
        "bytes_held_mean": sum(r["bytes_held"] for r in rows) / len(rows),
        "evictions": cache.evictions,
        "tokens_computed": prompt - sum(r["cached_tokens"] for r in rows)},
        f"{label}: served {len(rows)} requests")
    return False


@no_grad
def run(loaded: Loaded, params: PrefixWorkloadParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    """The workload under each budget, and without reuse (see the module docstring)."""
    model = loaded.checked(params)
    cfg = model.config
    stream = mix(cfg, params)
    load_start = load_avg()
    budgets = [int(b * MIB) for b in params.budgets_mib]
    runs = [(f"{b / MIB:,.1f} MiB", b, True) for b in budgets]
    runs.append(("no reuse", max(budgets), False))
    tr = Tracker(progress, should_stop, len(runs), unit="budgets",
                 total_work=len(runs) * len(stream))
    from engine.cache import PrefixCache  # warm-up: one short request, untimed

    warm = PrefixCache(model, max(budgets), block_tokens=params.block_tokens)
    warm.cancel(serve(model, warm, stream[0]["ids"][:32], 1).request)
    stopped = False
    for i, (label, budget, reuse) in enumerate(runs):
        picture = params.picture_steps if reuse and i == params.picture_budget else 0
        if _serve_stream(model, stream, budget, reuse, label, picture, params, tr):
            stopped = True
            break
    if stopped:
        tr.note("stopped: what was measured is kept")
    return record(loaded, "prefix_workload", params, tr.tables, partial=stopped,
                  notes=tr.notes, kv_bytes_per_token=budget_for(cfg, model.dtype, 1),
                  picture_label=runs[params.picture_budget][0],
                  load_avg_start=load_start, load_avg_end=load_avg())
