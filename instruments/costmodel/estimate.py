"""How long a latency sweep will take, from steps already measured and the cost model. Torch-free.

``fit(rows)`` fits, per mode, a step's time against its formula cost: an uncached forward as
a + b x FLOPs, a cached step as a + b x bytes (``statistics.linear_regression`` over the row
medians; one row: proportional). ``sweep_seconds(params, cfg, dtype, fits, overhead_s)`` then
sums what a sweep will run: warm-up calls, the fewest samples per point, the cache a cached mode
fills up to its longest context, the end-to-end part, and the fixed costs a run recorded (the
gate, the peaks). ``from_run(run)`` takes all that from a saved sweep; the page shows the
estimate before Run when a sweep of the same model, device, dtype and threads exists.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from engine import modes
from engine.config import GPTConfig
from instruments.costmodel import costs


@dataclass(frozen=True)
class Fit:
    """ms = intercept + slope x cost (cost: FLOPs for uncached modes, bytes for cached ones)."""

    intercept_ms: float
    slope_ms: float

    def ms(self, cost: float) -> float:
        return max(0.0, self.intercept_ms + self.slope_ms * cost)


def cost_of(cfg: GPTConfig, dtype: Any, mode: str, t: int, batch: int = 1) -> float:
    """The formula cost a mode's step time is fitted against at context ``t``."""
    spec = modes.MODES[mode]
    if spec.cached:
        return float(costs.step_bytes(cfg, dtype, t, cached=True, batch_size=batch,
                                      storage=spec.weight_storage))
    return float(costs.step_flops(cfg, t, cached=False, batch_size=batch,
                                  last_only=mode == "uncached_last"))


def fit(rows: list[dict[str, Any]], cfg: GPTConfig, dtype: Any) -> dict[str, Fit]:
    """One ``Fit`` per mode from latency rows (decode and forward phases)."""
    out: dict[str, Fit] = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        if mode not in modes.MODES:
            continue
        pts = [(cost_of(cfg, dtype, mode, int(r["context_len"]), int(r.get("batch_size") or 1)),
                float(r["latency_ms"])) for r in rows
               if r["mode"] == mode and r.get("phase") != "prefill"]
        xs = [x for x, _ in pts]
        if len(set(xs)) >= 2:
            slope, intercept = statistics.linear_regression(xs, [y for _, y in pts])
            if slope < 0:  # flat in practice (a cached step): its mean, whatever the cost
                slope, intercept = 0.0, statistics.fmean(y for _, y in pts)
            out[mode] = Fit(intercept, slope)
        elif pts:
            out[mode] = Fit(0.0, pts[0][1] / pts[0][0])
    return out


def point_ms(fits: dict[str, Fit], cfg: GPTConfig, dtype: Any, mode: str, t: int,
             batch: int = 1) -> float | None:
    f = fits.get(mode)
    return None if f is None else f.ms(cost_of(cfg, dtype, mode, t, batch))


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
        total_ms += sum(per) * params.min_repeats + per[0] * params.warmup
        if modes.MODES[mode].cached and fill is not None:
            total_ms += fill.ms(cost_of(cfg, dtype, "uncached_last", contexts[-1],
                                        params.batch_size))
    if params.e2e_new_tokens:
        total_ms += 1e3 * end_to_end_seconds(params, cfg, dtype, fits) or 0.0
    return total_ms / 1e3 + overhead_s


def end_to_end_seconds(params: Any, cfg: GPTConfig, dtype: Any,
                       fits: dict[str, Fit]) -> float:
    """One generation of ``e2e_new_tokens`` per mode, plus its short warm-up generation."""
    total = 0.0
    p, n = params.e2e_prompt_len, params.e2e_new_tokens
    for mode in params.modes:
        steps = [point_ms(fits, cfg, dtype, mode, p + k, params.batch_size) or 0.0
                 for k in range(n)]
        total += sum(steps) + sum(steps[:8])
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
        cfg = GPTConfig(**config)
    except (TypeError, ValueError):
        return None
    fixed = meta.get("timings") or {}
    seconds = float(fixed.get("gate_s") or 0.0) + float(fixed.get("peaks_s") or 0.0)
    return fit(rows, cfg, meta.get("dtype") or "float32"), seconds
