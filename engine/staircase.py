"""The staircase experiment: time the uncached step's matrix multiplies alone, T by T.

The write-up's uncached latency curve jumps at a few context lengths; its hypothesis is tile
quantisation / kernel switching in the matmul library. This times each Linear shape of an
uncached step in isolation, ``(T x in) @ (in x out)`` through ``F.linear`` with the model's own
``[out, in]`` layout, for every T in a list:

  qkv        T x d  @ d x 3d        attn_proj  T x d  @ d x d
  mlp_up     T x d  @ d x 4d        mlp_down   T x 4d @ 4d x d
  head       T x d  @ d x V  (the output projection on every position, as mode 1 does)

Contract: ``run_staircase(cfg, device, dtype, ts, ...) -> StaircaseResult`` with
``rows`` (T, shape, m, k, n, latency_ms, samples_ms, tflops) and ``totals`` (one per T:
``total_ms`` = n_layer x the four layer matmuls + the head on T rows; ``total_last_ms`` the same
with the head on one row, as mode 2 does; and, with ``model`` given, ``forward_ms``: the whole
uncached forward at T, measured in the same run for the overlay, at every ``forward_every``-th
T). Each sample runs ``inner`` calls back to back (calibrated to ~``min_sample_ms``) so launch
and clock overheads on a GPU do not drown a microsecond kernel. ``should_stop()`` is polled
between T values; ``on_row`` gets each T's totals as they are measured.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .config import GPTConfig
from .hardware import to_torch_dtype
from .model import GPT
from .timing import time_call

SHAPES = ("qkv", "attn_proj", "mlp_up", "mlp_down", "head")
LAYER_SHAPES = SHAPES[:4]
ProgressFn = Callable[[int, int, str], None]
StopFn = Callable[[], bool]


def shape_dims(cfg: GPTConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each Linear of one layer, and of the output projection."""
    d = cfg.n_embd
    return {"qkv": (d, 3 * d), "attn_proj": (d, d), "mlp_up": (d, 4 * d),
            "mlp_down": (4 * d, d), "head": (d, cfg.vocab_size)}


def default_ts(block_size: int, device: Any) -> list[int]:
    """Every T on a GPU (the steps are narrow); a stride of 32 on a CPU (each T costs more)."""
    if torch.device(device).type == "cuda":
        return list(range(1, block_size + 1))
    return sorted({1, *range(32, block_size + 1, 32), block_size})


@dataclass
class StaircaseResult:
    rows: list[dict[str, Any]]
    totals: list[dict[str, Any]]
    cancelled: bool = False
    notes: list[str] = field(default_factory=list)


def _weights(cfg: GPTConfig, device: torch.device, dtype: torch.dtype,
             model: GPT | None) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    if model is not None:  # the real tensors: same layout, same memory placement
        blk = model.transformer.h[0]
        return {"qkv": (blk.attn.c_attn.weight, blk.attn.c_attn.bias),
                "attn_proj": (blk.attn.c_proj.weight, blk.attn.c_proj.bias),
                "mlp_up": (blk.mlp.c_fc.weight, blk.mlp.c_fc.bias),
                "mlp_down": (blk.mlp.c_proj.weight, blk.mlp.c_proj.bias),
                "head": (model.lm_head.weight, None)}
    gen = torch.Generator(device="cpu").manual_seed(0)
    out = {}
    for name, (k, n) in shape_dims(cfg).items():
        # Small normal values: timings do not depend on them, but denormals would slow a CPU.
        w = (torch.randn(n, k, generator=gen) * 0.02).to(device, dtype)
        b = None if name == "head" else torch.zeros(n, device=device, dtype=dtype)
        out[name] = (w, b)
    return out


def _time(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int,
          min_sample_ms: float) -> tuple[float, list[float], int]:
    """(median ms per call, per-call samples, calls per sample)."""
    one = time_call(fn, warmup=warmup, repeats=1, device=device).median_ms
    inner = max(1, min(1000, math.ceil(min_sample_ms / max(one, 1e-6))))

    def batch() -> None:
        for _ in range(inner):
            fn()

    t = time_call(batch, warmup=0, repeats=repeats, device=device)
    samples = [ms / inner for ms in t.samples_ms]
    return statistics.median(samples), samples, inner


@torch.no_grad()
def run_staircase(
    cfg: GPTConfig, device: Any = "cpu", dtype: Any = "float32",
    ts: Sequence[int] | None = None, *, model: GPT | None = None, include_forward: bool = False,
    forward_every: int = 1, repeats: int = 3, warmup: int = 1, min_sample_ms: float | None = None,
    on_progress: ProgressFn | None = None, should_stop: StopFn | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> StaircaseResult:
    """Time each matmul shape at every T in ``ts`` (see the module docstring)."""
    if model is not None:
        cfg, device, dtype = model.config, model.device, model.dtype
    dev, tdtype = torch.device(device), to_torch_dtype(dtype)
    ts = sorted({int(t) for t in (ts or default_ts(cfg.block_size, dev))})
    if not ts or ts[0] < 1 or ts[-1] > cfg.block_size:
        raise ValueError(f"T values must be within 1..{cfg.block_size}, got {ts[:1]}..{ts[-1:]}")
    if include_forward and model is None:
        raise ValueError("include_forward needs the model itself (pass model=...)")
    if min_sample_ms is None:
        min_sample_ms = 2.0 if dev.type == "cuda" else 0.0
    weights = _weights(cfg, dev, tdtype, model)
    dims = shape_dims(cfg)
    gen = torch.Generator(device="cpu").manual_seed(1)
    x_full = {k: torch.randn(ts[-1], k, generator=gen).to(dev, tdtype)
              for k in {k for k, _ in dims.values()}}
    ids = torch.randint(0, cfg.vocab_size, (1, ts[-1]), generator=gen).to(dev)
    result = StaircaseResult([], [])

    def timed(name: str, m: int) -> float:
        w, b = weights[name]
        k, n = dims[name]
        x = x_full[k][:m]
        ms, samples, inner = _time(lambda: F.linear(x, w, b), dev, warmup, repeats,
                                   min_sample_ms)
        result.rows.append({
            "T": m, "context_len": m, "shape": name, "m": m, "k": k, "n": n,
            "latency_ms": ms, "samples_ms": samples, "calls_per_sample": inner,
            "tflops": 2 * m * k * n / (ms / 1e3) / 1e12 if ms > 0 else None,
        })
        return ms

    head_one_ms = timed("head", 1)  # mode 2's head: one row, whatever T is
    result.rows.pop()  # kept only for the totals; T=1 is timed again below if asked for
    for i, t in enumerate(ts):
        if should_stop and should_stop():
            result.cancelled = True
            result.notes.append("cancelled; T values already timed are kept")
            break
        if on_progress:
            on_progress(i, len(ts), f"timing the matmuls at T = {t}")
        per = {name: timed(name, t) for name in SHAPES}
        layer_ms = sum(per[name] for name in LAYER_SHAPES)
        total = {"T": t, "context_len": t, "layer_ms": layer_ms, "head_ms": per["head"],
                 "total_ms": cfg.n_layer * layer_ms + per["head"],
                 "total_last_ms": cfg.n_layer * layer_ms + head_one_ms, "forward_ms": None}
        if include_forward and model is not None and i % max(1, forward_every) == 0:
            idx = ids[:, :t]
            total["forward_ms"], _, _ = _time(
                lambda idx=idx: model(idx, use_cache=False, logits="all", mask="seed"), dev,
                warmup, repeats, min_sample_ms)
        result.totals.append(total)
        if on_row:
            on_row(total)
    if on_progress and not result.cancelled:
        on_progress(len(ts), len(ts), "done")
    return result
