"""Time to first token against the cached prefix: a prompt of N tokens whose first P the prefix
cache holds, served side by side with what it should cost (kind "prefix_ttft").

``run(loaded, PrefixTtftParams, progress, should_stop)`` -> run with tables
  ttft     one row per prompt length N and cached share (P = share x N; the lookup leaves the
           last token to compute, so "the whole prompt" is N - 1): ``ttft_ms`` (median of the
           served request's samples: the lookup, the admission -- shared blocks, the copy of the
           block where it diverges, the cached rows copied in -- and the prefill of the N - P
           new tokens, to their logits), ``lookup_ms`` (the tree walk alone, timed inside each
           sample) and its share of the TTFT, ``alone_ms`` (a cold prefill of the N - P new
           tokens by themselves: the issue's prediction is ``alone_ms + lookup_ms``,
           ``predicted_ms``), ``extend_ms`` (the same N - P tokens appended after the P cached
           rows in a contiguous cache: what computing them really costs, attention over the
           prefix included), ``over_predicted`` and ``over_extend`` (TTFT over each + the
           lookup), ``tree_tokens`` held when looked up, and the served logits against one full
           prefill of the prompt (``max_abs_logit_diff`` within ``logit_tolerance``, fp32's)
  checks   one row per prompt length: the largest drift and whether every point was exact
Before the points, ``tree_tokens`` tokens of other prompts are served into the tree, so each
lookup walks a tree of that size. Each point's prompt is its own (seeded); its first P tokens
were served before as the start of another prompt, so the tree holds exactly P of them. A timed
request is cancelled after each sample: the tree stays as it was. The served request, the
extend and the cold prefill are timed in ``repeats`` interleaved rounds (``Sampler.rounds``), so
their ratios are measured side by side.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from typing import Any

from engine.models.config import ModelConfig
from instruments.experiments.inputs import contexts_within, parse_contexts, whole
from instruments.experiments.prefix.parts import (
    budget_for,
    drift,
    full_logits,
    load_avg,
    serve,
    token_ids,
)
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, no_grad, record

SHARES = [0.0, 0.25, 0.5, 0.75, 0.875, 0.96875, 1.0]
TAIL = 16  # the other prompt's own tokens after the shared P


@dataclass
class PrefixTtftParams:
    """Prompt lengths N, the shares of each held in the tree, the tree's other tokens."""

    prompt_lens: list[int]
    cached_shares: list[float] = field(default_factory=lambda: list(SHARES))
    tree_tokens: int = 8192
    block_tokens: int = 16
    repeats: int = 3
    seed: int = 0

    @classmethod
    def defaults(cls, device: str, cfg: ModelConfig) -> PrefixTtftParams:
        """256 and 1,024 tokens on a CPU (a 1,024-token prefill of SmolLM2 takes seconds
        there), up to the model's whole context on a GPU."""
        wanted = (256, 1024) if not str(device).startswith("cuda") else (1024, 4096, 8192)
        return cls(sorted({min(n, cfg.block_size) for n in wanted}))

    def check(self, cfg: ModelConfig, device: str) -> None:
        contexts_within("prompt lengths", self.prompt_lens, 2, cfg.block_size)
        if not self.cached_shares or any(not 0 <= s <= 1 for s in self.cached_shares):
            raise ValueError(f"cached shares must be within 0..1, got {self.cached_shares}")
        whole("tokens held in the tree", self.tree_tokens, 0, 1_000_000)
        whole("block tokens", self.block_tokens, 1, 256)
        whole("repeats", self.repeats, 1, 50)


Params = PrefixTtftParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-lens", default=None, help="prompt lengths N (default: per device)")
    p.add_argument("--shares", default=",".join(f"{s:g}" for s in SHARES),
                   help="shares of each prompt held in the tree, 0..1")
    p.add_argument("--tree-tokens", type=int, default=8192,
                   help="tokens of other prompts held in the tree while timing")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> PrefixTtftParams:
    base = PrefixTtftParams.defaults(args.device, cfg)
    try:
        shares = sorted({float(s) for s in str(args.shares).split(",") if s.strip()})
    except ValueError:
        raise ValueError(f"--shares must be numbers 0..1 separated by commas, got "
                         f"{args.shares!r}") from None
    lens = parse_contexts(args.prompt_lens, cfg.block_size, "prompt length") if args.prompt_lens \
        else base.prompt_lens
    return PrefixTtftParams(lens, shares, args.tree_tokens, args.block_tokens, args.repeats,
                            args.seed)


def summary(run: dict[str, Any]) -> list[str]:
    lines = []
    for r in run["tables"].get("ttft", []):
        lines.append(f"N {r['prompt_len']:5d}, {r['cached_tokens']:5d} cached: TTFT "
                     f"{r['ttft_ms']:9.2f} ms = {r['over_predicted']:.2f}x (alone "
                     f"{r['alone_ms']:.2f} + lookup {r['lookup_ms']:.3f}), "
                     f"{r['over_extend']:.2f}x the extend; lookup {r['lookup_share']:.2%} "
                     f"with {r['tree_tokens']:,} tokens in the tree; drift "
                     f"{r['max_abs_logit_diff']:.2g}" + ("" if r["exact"] else "  NOT EXACT"))
    return lines


def _point(model: Any, cache: Any, n: int, share: float, p: PrefixTtftParams,
           sampler: Any, tr: Tracker) -> bool:
    """One (N, share) row; True if stopped."""
    from engine.cache import make_cache

    vocab = model.config.vocab_size
    want = min(round(share * n), n)
    ids = token_ids(vocab, n, p.seed * 1_000_003 + n * 1_009 + want)
    if want:  # another prompt starting with the same `want` tokens, served into the tree
        # (its own tail shortened where the model's context ends: N may be the whole context)
        tail = token_ids(vocab, min(TAIL, model.config.block_size - want), p.seed + want,
                         first=(ids[want] + 1) if want < n else None)
        warm = serve(model, cache, ids[:want] + tail, 0)
        cache.finish(warm.request)
    full = full_logits(model, ids)
    hit = cache.lookup(ids)
    ref = make_cache("prealloc", model, 1, n)  # the same rows, contiguous
    if hit.length:
        cache.pool.read_into(cache.path_blocks(hit.node), hit.length, ref.k_buf[:, 0],
                             ref.v_buf[:, 0])
    ref.length = cached = hit.length
    new_ids = ids_tensor(model, ids[cached:])
    held, served, lookups = cache.tokens_held(), [], []

    def drop() -> None:
        while served:
            cache.cancel(served.pop().request)

    def one() -> None:
        s = serve(model, cache, ids, 0)
        served.append(s)
        lookups.append(s.lookup_ms)

    def extend() -> None:
        ref.crop(cached)
        model(new_ids, ref, logits="last")

    kept: list[Any] = []

    def keep() -> None:  # the last served request kept for its logits, then nothing held
        kept[:] = served[-1:] or kept
        drop()

    # Interleaved, so the ratios between them are taken side by side on a drifting host.
    points = sampler.rounds({"served": (one, keep), "extend": (extend, keep),
                             "alone": (lambda: model(new_ids, use_cache=False, logits="last"),
                                       keep)}, p.repeats)
    keep()
    if points is None or not kept:
        return True
    got, ext, alone = points["served"], points["extend"], points["alone"]
    last = kept[0]
    lookup_ms = statistics.median(lookups)
    ttft = got.median_ms
    row = {"prompt_len": n, "cached_share": share, "cached_tokens": cached,
           "new_tokens": n - cached, "ttft_ms": ttft, "samples_ms": got.samples_ms,
           "lookup_ms": lookup_ms, "lookup_samples_ms": lookups, "lookup_share": lookup_ms / ttft,
           "alone_ms": alone.median_ms, "alone_samples_ms": alone.samples_ms,
           "extend_ms": ext.median_ms, "extend_samples_ms": ext.samples_ms,
           "predicted_ms": alone.median_ms + lookup_ms,
           "over_predicted": ttft / (alone.median_ms + lookup_ms),
           "over_extend": ttft / (ext.median_ms + lookup_ms),
           "tree_tokens": held, "tree_nodes": len(cache.nodes),
           **drift(last.logits, full), **got.quiet()}
    tr.row("ttft", row, f"N {n}, {cached} cached: {ttft:.1f} ms "
           f"({row['over_predicted']:.2f}x the prediction)")
    return False


def ids_tensor(model: Any, ids: list[int]) -> Any:
    import torch

    return torch.tensor([ids], dtype=torch.long, device=model.device)


@no_grad
def run(loaded: Loaded, params: PrefixTtftParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    """TTFT against the cached prefix (see the module docstring)."""
    from engine.cache import PrefixCache
    from instruments.measure.sampler import Sampler

    model = loaded.checked(params)
    cfg = model.config
    lens, shares = sorted(set(params.prompt_lens)), sorted(set(params.cached_shares))
    load_start = load_avg()
    held = params.tree_tokens + sum(n + TAIL for n in lens) * len(shares) + 4096
    budget = budget_for(cfg, model.dtype, held)
    cache = PrefixCache(model, budget, block_tokens=params.block_tokens)
    tr = Tracker(progress, should_stop, len(lens) * len(shares))
    piece = min(1024, cfg.block_size)
    for i in range(-(-params.tree_tokens // piece)):  # the other prompts the tree holds
        if tr.stop():
            break
        filler = token_ids(cfg.vocab_size, min(piece, params.tree_tokens - i * piece),
                           params.seed + 10_000 + i)
        cache.finish(serve(model, cache, filler, 0).request)
        tr.emit(f"the tree holds {cache.tokens_held():,} tokens of other prompts")
    sampler = Sampler(model.device, repeats=params.repeats, warmup=1, should_stop=tr.stop)
    stopped = tr.stop()
    for n in lens:
        for share in shares:
            if stopped or _point(model, cache, n, share, params, sampler, tr):
                stopped = True
                break
            tr.work += 1
    for n in lens:
        rows = [r for r in tr.tables.get("ttft", []) if r["prompt_len"] == n]
        if rows:
            tr.tables.setdefault("checks", []).append({
                "prompt_len": n, "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
                "exact": all(r["exact"] for r in rows), "points": len(rows)})
    if stopped:
        tr.note("stopped: what was measured is kept")
    return record(loaded, "prefix_ttft", params, tr.tables, partial=stopped, notes=tr.notes,
                  budget_bytes=budget, block_bytes=cache.pool.block_bytes,
                  kv_bytes_per_token=budget_for(cfg, model.dtype, 1),
                  load_avg_start=load_start, load_avg_end=load_avg())
