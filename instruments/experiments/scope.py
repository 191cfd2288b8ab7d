"""Scope: does the cached-vs-uncached speedup move toward the FLOP ratio as work per launch grows?
(kind "scope")

``run(loaded, ScopeParams, progress, should_stop)`` -> run with table ``scope``: one row per
batch size (``grow="batch"``, the loaded model) or per preset (``grow="model"``, each built with
seeded random weights in turn and freed after). ``should_stop()`` is polled between points.

Speedup rows carry ``cached_ms`` (median decode step at ``context_len`` tokens in view),
``uncached_ms`` (median full forward of ``context_len`` tokens, last-position logits = mode 2),
``speedup`` = uncached / cached and ``flop_ratio`` from ``engine.costs``. A point whose memory
estimate exceeds half of what is free, or whose predicted time exceeds ``max_seconds`` per
call, is skipped with the reason in its row (``skipped``).
"""

from __future__ import annotations

import gc
import statistics
from typing import Any

import torch

from engine.config import PRESETS, GPTConfig
from engine.decoders import make_decoder
from engine.loop import decode
from engine.model import GPT
from instruments import costs, gate, memory
from instruments.params import ScopeParams
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, random_prompt, record
from instruments.timing import StepClock, time_call


def step_memory_estimate(cfg: GPTConfig, dtype: Any, batch: int, context_len: int,
                         device: Any) -> int:
    """Bytes a cached and an uncached step at this size need beyond the weights (rough, high)."""
    est = costs.peak_memory_estimate(cfg, dtype, batch, context_len + 16, "prealloc",
                                     logits_all=False, device=str(device), mask="none")
    return est["total_bytes"] - est["weights_bytes"]


@torch.no_grad()
def measure_speedup(model: GPT, batch: int, context_len: int, *, cached_mode: str,
                    uncached_mode: str, steps: int = 6, repeats: int = 3) -> dict[str, Any]:
    """Cached step and uncached forward at ``context_len`` tokens in view, batch ``batch``."""
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


def _name(cfg: GPTConfig) -> str:
    for name, shape in PRESETS.items():
        if all(getattr(cfg, k) == v for k, v in shape.items()):
            return name
    return f"L{cfg.n_layer}-d{cfg.n_embd}"


def _ratio(cfg: GPTConfig, t: int, batch: int) -> float:
    return costs.step_flops(cfg, t, False, batch, True) / costs.step_flops(cfg, t, True, batch)


def _batches(model: GPT, p: ScopeParams, tr: Tracker) -> None:
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


def _models(model: GPT, p: ScopeParams, tr: Tracker) -> None:
    dev, tdtype = model.device, model.dtype
    prev: tuple[int, float] | None = None  # (linear params, uncached ms) of the last model
    for name in p.points:
        if tr.stop():
            return
        cfg = GPTConfig.from_name(name)
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
            other = GPT.random(cfg, seed=0, device=dev, dtype=tdtype)
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


@torch.no_grad()
def run(loaded: Loaded, params: ScopeParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    model = loaded.model
    params.check(model.config, str(model.device))
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
