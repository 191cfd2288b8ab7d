"""Scope: does the cached-vs-uncached speedup move toward the FLOP ratio as work per launch grows?
(kind "scope")

``run(loaded, ScopeParams, progress, should_stop)`` -> run with table ``scope``: one row per
batch size (``grow="batch"``, the loaded model) or per preset (``grow="model"``, each built with
seeded random weights in turn and freed after). ``should_stop()`` is polled between points.

Speedup rows carry ``cached_ms`` (median decode step at ``context_len`` tokens in view),
``uncached_ms`` (median full forward of ``context_len`` tokens, last-position logits = mode 2),
``speedup`` = uncached / cached and ``flop_ratio`` from ``instruments.costmodel.costs``. A point
whose memory estimate exceeds half of what is free, or whose predicted time exceeds
``max_seconds`` per call, is skipped with the reason in its row (``skipped``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.models.config import GPTConfig, ModelConfig
from instruments import lineup
from instruments.costmodel import costs
from instruments.experiments.inputs import (
    MAX_BATCH,
    contexts_within,
    modes_usable,
    parse_contexts,
)
from instruments.measure.sampler import time_call
from instruments.measure.timing import StepClock
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, no_grad, record

if TYPE_CHECKING:

    from engine.models.base import CausalLM

BATCH_POINTS = (1, 2, 4, 8, 16, 32)  # the batch sizes a batch scope sweep grows through


@dataclass
class ScopeParams:
    """Cached vs uncached as the batch (``grow="batch"``) or the model (``"model"``) grows."""
    grow: str = "batch"
    points: list[Any] = field(default_factory=lambda: list(BATCH_POINTS))
    context_len: int = 128
    cached_mode: str = field(default_factory=lambda: lineup.with_role("reference_cached")[0])
    uncached_mode: str = field(
        default_factory=lambda: lineup.with_role("reference_uncached")[0])
    max_seconds: float = 20.0  # a point whose uncached step is predicted longer is skipped
    steps: int = 6
    repeats: int = 3

    def check(self, cfg: GPTConfig, device: str) -> None:
        if self.grow not in ("batch", "model"):
            raise ValueError(f"grow must be 'batch' or 'model', got {self.grow!r}")
        if not self.points:
            raise ValueError("no points given")
        if self.grow == "batch":
            contexts_within("batch sizes", list(self.points), 1, MAX_BATCH)
        else:
            sizes = family_sizes(cfg.family)
            bad = [p for p in self.points if p not in sizes]
            if bad:
                raise ValueError(f"unknown model {bad[0]!r}; allowed: {', '.join(sizes)}")
        modes_usable([self.cached_mode, self.uncached_mode], device, cfg.family)
        if not 4 <= self.context_len <= cfg.block_size - self.steps - 1:
            raise ValueError(f"context length must be within 4..{cfg.block_size - self.steps - 1}")


Params = ScopeParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grow", default="batch", choices=["batch", "model"])
    p.add_argument("--points", default=None, help="batch sizes, or model names")
    p.add_argument("--context", type=int, default=128)


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> ScopeParams:

    if args.grow == "batch":
        points: list[Any] = parse_contexts(args.points or ",".join(map(str, BATCH_POINTS)),
                                           MAX_BATCH, "batch size")
    else:
        default = ",".join(family_sizes(cfg.family))
        points = [p.strip() for p in (args.points or default).split(",")]
    return ScopeParams(args.grow, points, args.context)


def summary(run: dict[str, Any]) -> list[str]:
    return [f"{r.get('point')}: " + (r.get("skipped") or f"{r['speedup']:.1f}x")
            for r in run["tables"].get("scope", [])]



def step_memory_estimate(cfg: GPTConfig, dtype: Any, batch: int, context_len: int,
                         device: Any) -> int:
    """Bytes a cached and an uncached step at this size need beyond the weights (rough, high)."""
    est = costs.peak_memory_estimate(cfg, dtype, batch, context_len + 16, "prealloc",
                                     logits_all=False, device=str(device), mask="none")
    return est["total_bytes"] - est["weights_bytes"]


@no_grad
def measure_speedup(model: CausalLM, batch: int, context_len: int, *, cached_mode: str,
                    uncached_mode: str, steps: int = 6, repeats: int = 3) -> dict[str, Any]:
    """Cached step and uncached forward at ``context_len`` tokens in view, batch ``batch``."""
    from engine.decoders import make_decoder
    from engine.loop import decode, random_prompt

    cfg, dev = model.config, model.device
    warm = 2
    start_len = max(1, context_len - 1 - warm)
    dec = make_decoder(model, cached_mode, batch_size=batch,
                       capacity=min(cfg.block_size, start_len + warm + steps))
    clock = StepClock(dev, skip=1 + warm)  # the prefill and the warm-up steps are not samples
    decode(dec, random_prompt(model, batch, start_len), 1 + warm + steps, timer=clock)
    cached_ms = statistics.median(clock.samples_ms)
    del dec
    full = make_decoder(model, uncached_mode, batch_size=batch)
    idx = random_prompt(model, batch, context_len)
    timing = time_call(lambda: full.prefill(idx), warmup=1, repeats=repeats, device=dev)
    uncached_ms = timing.median_ms
    last_only = getattr(full, "logits", "last") == "last"
    flops_c = costs.step_flops(cfg, context_len, cached=True, batch_size=batch)
    flops_u = costs.step_flops(cfg, context_len, cached=False, batch_size=batch,
                               last_only=last_only)
    return {"batch_size": batch, "context_len": context_len, "cached_mode": cached_mode,
            "uncached_mode": uncached_mode, "cached_ms": cached_ms, "uncached_ms": uncached_ms,
            "speedup": uncached_ms / cached_ms, "flop_ratio": flops_u / flops_c,
            "cached_tflops": flops_c / (cached_ms / 1e3) / 1e12,
            "uncached_tflops": flops_u / (uncached_ms / 1e3) / 1e12,
            "tokens_per_s": batch / (cached_ms / 1e3), "skipped": None}


def _skip(row: dict[str, Any], why: str) -> dict[str, Any]:
    return {**row, "cached_ms": None, "uncached_ms": None, "speedup": None, "skipped": why}


def family_sizes(family: str) -> list[str]:
    """The real presets of ``family``: what a model-size scope grows through."""
    return [m for m in lineup.models() if lineup.family_of(m).name == family]


def _name(cfg: ModelConfig) -> str:
    for name in lineup.models(tests=True):
        if lineup.config(name, mask=cfg.mask) == cfg:
            return name
    return f"L{cfg.n_layer}-d{cfg.n_embd}"


def _ratio(cfg: GPTConfig, t: int, batch: int) -> float:
    return costs.step_flops(cfg, t, False, batch, True) / costs.step_flops(cfg, t, True, batch)


def _batches(model: CausalLM, p: ScopeParams, tr: Tracker) -> None:
    from instruments.measure import memory

    cfg = model.config
    budget = (memory.free_bytes(model.device) or 0) // 2
    per_row_ms: float | None = None  # uncached ms per sequence, to predict the next batch
    for b in sorted(set(p.points)):
        if tr.stop():
            return
        tr.emit(f"batch {b}: timing cached and uncached steps")
        base = {"batch_size": b, "context_len": p.context_len, "model": _name(cfg),
                "flop_ratio": _ratio(cfg, p.context_len, b)}
        need = step_memory_estimate(cfg, model.dtype, b, p.context_len, model.device)
        if need > budget:
            row = _skip(base, f"needs ~{need / 2**20:.0f} MiB, {budget / 2**20:.0f} MiB allowed")
        elif per_row_ms is not None and per_row_ms * b / 1e3 > p.max_seconds:
            row = _skip(base, f"predicted {per_row_ms * b / 1e3:.0f} s per uncached step > "
                              f"{p.max_seconds:.0f} s budget")
        else:
            row = {**base, **measure_speedup(model, b, p.context_len, cached_mode=p.cached_mode,
                                             uncached_mode=p.uncached_mode, steps=p.steps,
                                             repeats=p.repeats)}
            per_row_ms = row["uncached_ms"] / b
        tr.work += 1
        tr.row("scope", row, f"batch {b}: " + (row["skipped"] or f"{row['speedup']:.1f}x"))


def _models(model: CausalLM, p: ScopeParams, tr: Tracker) -> None:
    import torch

    from instruments.measure import memory

    dev, tdtype = model.device, model.dtype
    prev: tuple[int, float] | None = None  # (linear params, uncached ms) of the last model
    for name in p.points:
        if tr.stop():
            return
        cfg = lineup.config(name)
        n = costs.linear_params(cfg)
        base = {"model": name, "params": costs.param_count(cfg), "batch_size": 1,
                "context_len": p.context_len, "flop_ratio": _ratio(cfg, p.context_len, 1)}
        need = 2 * costs.weight_bytes(cfg, tdtype) + step_memory_estimate(cfg, tdtype, 1,
                                                                         p.context_len, dev)
        if need > (memory.free_bytes(dev) or 0) // 2:
            row = _skip(base, f"needs ~{need / 2**30:.1f} GiB; not enough free")
        elif prev is not None and prev[1] * n / prev[0] / 1e3 > p.max_seconds:
            row = _skip(base, "predicted uncached step over the time budget")
        else:
            tr.emit(f"{name}: random weights, then timing")
            other = lineup.model_class(cfg).random(cfg, seed=0, device=dev, dtype=tdtype)
            try:
                row = {**base, **measure_speedup(other, 1, p.context_len,
                                                 cached_mode=p.cached_mode,
                                                 uncached_mode=p.uncached_mode, steps=p.steps,
                                                 repeats=p.repeats)}
            finally:
                del other
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            prev = (n, row["uncached_ms"])
        tr.work += 1
        tr.row("scope", row, f"{name}: " + (row["skipped"] or f"{row['speedup']:.1f}x"))


@no_grad
def run(loaded: Loaded, params: ScopeParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    from instruments.checks import gate

    model = loaded.checked(params)
    tr = Tracker(progress, should_stop, len(params.points))
    # Both modes pass the gate first (on the loaded model: the same code runs at every size).
    checker = gate.Gate(model)
    checks = [checker.check(name) for name in (params.uncached_mode, params.cached_mode)]
    refused = [c for c in checks if not c.passed]
    for c in refused:
        tr.note(f"{c.mode} not timed: {c.detail}")
    if not refused:
        (_batches if params.grow == "batch" else _models)(model, params, tr)
    stopped = not refused and len(tr.tables.get("scope", [])) < len(set(params.points))
    if stopped:
        tr.note("stopped: points already measured are kept")
    return record(loaded, "scope", params, {"scope": tr.tables.get("scope", []),
                                            "checks": [c.to_row() for c in checks]},
                  partial=stopped, notes=tr.notes)
