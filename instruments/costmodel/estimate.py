"""How long a latency sweep will take, from steps already measured and the cost model. Torch-free.

``fit(rows)`` keeps, per mode, a step's measured median against its formula cost (FLOPs for an
uncached forward, bytes for a cached step) and reads a cost between two measured ones on the
straight line between them, below the cheapest at the cheapest's time, above the dearest in
proportion to the cost (one row: proportional). Not one straight line through all of them: a
forward's time per FLOP grows with the context on a CPU (gpt2 here: 137 ms at 8 tokens, 6 s at
1,000), so a line fitted to every point crossed zero near 8 tokens, called the short forwards of
an end-to-end part free, and chose 89 new tokens for 25 s that took 31 s.
``sweep_seconds(params, cfg, dtype, fits, overhead_s)`` then sums what a sweep will run: warm-up
calls, the fewest samples per point, the cache a cached mode fills up to its longest context,
the end-to-end part (a cached mode's first call is the prompt's forward), and the fixed costs a
run recorded (the gate, the peaks). ``from_run(run)`` takes all that from a saved sweep; the page
shows the estimate before Run when a sweep of the same model, device, dtype and threads exists.
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass
from typing import Any

from engine.models.config import GPTConfig
from instruments import lineup
from instruments.costmodel import costs


@dataclass(frozen=True)
class Fit:
    """Measured (cost, ms) points of one mode, sorted by cost, one per cost (cost: FLOPs for
    uncached modes, bytes for cached ones); ``ms(cost)`` reads between them."""

    points: tuple[tuple[float, float], ...]

    def ms(self, cost: float) -> float:
        pts = self.points
        if len(pts) == 1 or cost > pts[-1][0]:  # beyond what was measured: in proportion
            x, y = pts[-1]
            return y * cost / x if x > 0 else y
        if cost <= pts[0][0]:  # a shorter step costs no more than the shortest measured
            return pts[0][1]
        i = bisect.bisect_left([x for x, _ in pts], cost)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (y1 - y0) * (cost - x0) / (x1 - x0)


def cost_of(cfg: GPTConfig, dtype: Any, mode: str, t: int, batch: int = 1) -> float:
    """The formula cost a mode's step time is fitted against at context ``t``."""
    spec = lineup.spec(mode)
    if spec.cached:
        return float(costs.step_bytes(cfg, dtype, t, cached=True, batch_size=batch,
                                      storage=spec.weight_storage))
    return float(costs.step_flops(cfg, t, cached=False, batch_size=batch,
                                  last_only=not spec.logits_all))


def fit(rows: list[dict[str, Any]], cfg: GPTConfig, dtype: Any) -> dict[str, Fit]:
    """One ``Fit`` per mode from latency rows (decode and forward phases)."""
    out: dict[str, Fit] = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        if not lineup.is_mode(mode):
            continue
        by_cost: dict[float, list[float]] = {}
        for r in rows:
            if r["mode"] == mode and r.get("phase") != "prefill":
                cost = cost_of(cfg, dtype, mode, int(r["context_len"]),
                               int(r.get("batch_size") or 1))
                by_cost.setdefault(cost, []).append(float(r["latency_ms"]))
        if by_cost:
            out[mode] = Fit(tuple(sorted((x, statistics.fmean(ys))
                                         for x, ys in by_cost.items())))
    return out


def point_ms(fits: dict[str, Fit], cfg: GPTConfig, dtype: Any, mode: str, t: int,
             batch: int = 1) -> float | None:
    f = fits.get(mode)
    return None if f is None else f.ms(cost_of(cfg, dtype, mode, t, batch))


def samples(params: Any, sample_ms: float) -> int:
    """The fewest samples the Sampler takes of a point whose samples cost ``sample_ms``: the
    sweep's ``min_repeats``, or as many as add up to its ``point_ms`` (at most
    ``cheap_repeats``; ``LatencyParams``)."""
    point_ms = getattr(params, "point_ms", 0.0) or 0.0
    cheap = min(params.cheap_repeats, math.ceil(point_ms / sample_ms)) \
        if sample_ms > 0 and point_ms else 0
    return max(min(params.min_repeats, params.repeats), cheap)


def sweep_seconds(params: Any, cfg: GPTConfig, dtype: Any, fits: dict[str, Fit],
                  overhead_s: float = 0.0) -> float | None:
    """Seconds a sweep with ``params`` (``LatencyParams``) should take; None if a mode has no
    fit. Assumes the fewest samples per point (noisy points take more)."""
    contexts = sorted(set(params.contexts))
    total_ms = 0.0
    fill = fits.get("uncached") or fits.get("uncached_last")  # a cache fill ~ a forward
    for mode in params.modes:
        if mode not in fits:
            return None
        per = [point_ms(fits, cfg, dtype, mode, t, params.batch_size) or 0.0 for t in contexts]
        total_ms += sum(x * samples(params, x) for x in per) + per[0] * params.warmup
        if lineup.spec(mode).cached and fill is not None:
            total_ms += fill.ms(cost_of(cfg, dtype, "uncached_last", contexts[-1],
                                        params.batch_size))
    if params.e2e_new_tokens:
        total_ms += 1e3 * end_to_end_seconds(params, cfg, dtype, fits) or 0.0
    return total_ms / 1e3 + overhead_s


def end_to_end_seconds(params: Any, cfg: GPTConfig, dtype: Any,
                       fits: dict[str, Fit]) -> float:
    """One generation of ``e2e_new_tokens`` per mode, plus its short warm-up generation: call
    k >= 1 at context p + k (an uncached mode's forward grows with it), call 0 the prompt's
    forward (a cached mode's prefill: read off an uncached mode's fit when there is one)."""
    total = 0.0
    p, n, b = params.e2e_prompt_len, params.e2e_new_tokens, params.batch_size
    fill = fits.get("uncached") or fits.get("uncached_last")
    for mode in params.modes:
        steps = [point_ms(fits, cfg, dtype, mode, p + k, b) or 0.0 for k in range(n)]
        if lineup.spec(mode).cached and fill is not None:
            steps[0] = fill.ms(cost_of(cfg, dtype, "uncached_last", p, b))
        total += sum(steps) + sum(steps[:8])  # the warm-up: the first 8 calls again
    return total / 1e3


def tokens_that_fit(params: Any, cfg: GPTConfig, dtype: Any, fits: dict[str, Fit],
                    budget_s: float) -> int | None:
    """The most new tokens whose end-to-end part fits ``budget_s`` (None without fits)."""
    if any(m not in fits for m in params.modes):
        return None
    limit = cfg.block_size - params.e2e_prompt_len + 1
    lo, hi = 1, limit
    while lo < hi:  # the time grows with the tokens: bisect
        mid = (lo + hi + 1) // 2
        trial = type(params)(**{**vars(params), "e2e_new_tokens": mid})
        if end_to_end_seconds(trial, cfg, dtype, fits) <= budget_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def from_run(run: dict[str, Any]) -> tuple[dict[str, Fit], float] | None:
    """(fits, fixed seconds) from a saved sweep: its rows and the gate and peaks time it
    recorded (the peaks are measured once per measuring process: a later run may skip them)."""
    meta = run.get("meta") or {}
    rows = (run.get("tables") or {}).get("latency") or []
    config = meta.get("config")
    if not rows or not config:
        return None
    try:
        cfg = lineup.config_from_dict(config)
    except (TypeError, ValueError):
        return None
    fixed = meta.get("timings") or {}
    seconds = float(fixed.get("gate_s") or 0.0) + float(fixed.get("peaks_s") or 0.0)
    return fit(rows, cfg, meta.get("dtype") or "float32"), seconds
