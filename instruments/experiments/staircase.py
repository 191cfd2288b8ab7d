"""The staircase experiment: time the uncached step's matrix multiplies alone, T by T.

The write-up's uncached latency curve jumps at a few context lengths; its hypothesis is tile
quantisation / kernel switching in the matmul library. This times each Linear shape of an
uncached step in isolation, ``(T x in) @ (in x out)`` through ``F.linear`` with the model's own
``[out, in]`` layout, for every T in a list:

  qkv        T x d  @ d x 3d        attn_proj  T x d  @ d x d
  mlp_up     T x d  @ d x 4d        mlp_down   T x 4d @ 4d x d
  head       T x d  @ d x V  (the output projection on every position, as mode 1 does)

Contract: ``run(loaded, StaircaseParams, progress, should_stop)`` -> run (kind "staircase")
with tables ``staircase`` (T, shape, m, k, n, latency_ms, samples_ms, tflops) and ``totals``
(one per T:
``total_ms`` = n_layer x the four layer matmuls + the head on T rows; ``total_last_ms`` the same
with the head on one row, as mode 2 does; and, with ``include_forward``, ``forward_ms``: the whole
uncached forward at T, measured in the same run for the overlay, at every ``forward_every``-th
T). Each sample runs ``inner`` calls back to back (calibrated to ~``min_sample_ms``); on a GPU
the matmuls are replayed from a CUDA graph, so what is timed is the kernels, not their launches
(the whole forward is timed as the mode runs it, launches included). ``should_stop()`` is polled
between T values; each T's totals are streamed as they are measured.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.models.config import GPTConfig, ModelConfig
from instruments.experiments.inputs import (
    contexts_within,
    parse_contexts,
    whole,
)
from instruments.measure.sampler import time_call
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, no_grad, record

if TYPE_CHECKING:
    import torch

    from engine.models.base import CausalLM


@dataclass
class StaircaseParams:
    """The uncached step's matmuls timed alone at each T."""
    ts: list[int] | None = None  # None: every T on a GPU, a stride of 32 on a CPU
    repeats: int = 3
    include_forward: bool = False
    forward_every: int = 1

    def check(self, cfg: GPTConfig, device: str) -> None:
        if self.ts is not None:
            contexts_within("T values", self.ts, 1, cfg.block_size)
        whole("repeats", self.repeats, 1, 50)
        whole("forward every", self.forward_every, 1)


Params = StaircaseParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ts", default=None, help="T values (default: every T on a GPU, 32 apart "
                   "on a CPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--with-forward", action="store_true", help="time the whole forward too")


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> StaircaseParams:
    block_size = cfg.block_size
    ts = parse_contexts(args.ts, block_size, "token count") if args.ts else None
    return StaircaseParams(ts, args.repeats, args.with_forward)


def summary(run: dict[str, Any]) -> list[str]:
    return [f"T = {r['t']:>5}: {r['total_ms']:.2f} ms of matmuls"
            for r in run["tables"].get("totals", [])[-3:]]


SHAPES = ("qkv", "attn_proj", "mlp_up", "mlp_down", "head")
LAYER_SHAPES = SHAPES[:4]


def shape_dims(cfg: GPTConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each Linear of one layer, and of the output projection."""
    d = cfg.n_embd
    return {"qkv": (d, 3 * d), "attn_proj": (d, d), "mlp_up": (d, 4 * d),
            "mlp_down": (4 * d, d), "head": (d, cfg.vocab_size)}


def default_ts(block_size: int, device: Any) -> list[int]:
    """Every T on a GPU (the steps are narrow); a stride of 32 on a CPU (each T costs more)."""
    import torch

    if torch.device(device).type == "cuda":
        return list(range(1, block_size + 1))
    return sorted({1, *range(32, block_size + 1, 32), block_size})


def _weights(model: CausalLM) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """The real tensors of layer 0 and the head: same layout, same memory placement."""
    blk = model.transformer.h[0]
    return {"qkv": (blk.attn.c_attn.weight, blk.attn.c_attn.bias),
            "attn_proj": (blk.attn.c_proj.weight, blk.attn.c_proj.bias),
            "mlp_up": (blk.mlp.c_fc.weight, blk.mlp.c_fc.bias),
            "mlp_down": (blk.mlp.c_proj.weight, blk.mlp.c_proj.bias),
            "head": (model.lm_head.weight, None)}


def _time(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int,
          min_sample_ms: float, kernels_only: bool = False) -> tuple[float, list[float], int]:
    """(median ms per call, per-call samples, calls per sample).

    ``kernels_only`` on a GPU replays the calls from a CUDA graph: a host loop of small matmuls
    would time their launches (microseconds each) rather than the matmuls themselves.
    """
    one = time_call(fn, warmup=warmup, repeats=1, device=device).median_ms
    inner = max(1, min(1000, math.ceil(min_sample_ms / max(one, 1e-6))))

    def batch() -> None:
        for _ in range(inner):
            fn()

    if kernels_only and device.type == "cuda":
        batch = _graphed(batch, device)
    t = time_call(batch, warmup=1, repeats=repeats, device=device)
    samples = [ms / inner for ms in t.samples_ms]
    return statistics.median(samples), samples, inner


def _graphed(fn: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """``fn`` captured once into a CUDA graph; the returned call replays it."""
    import torch

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    return graph.replay


@no_grad
def run(loaded: Loaded, params: StaircaseParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    """Time each matmul shape at every T (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    from engine.loop import random_prompt

    model = loaded.model
    cfg, dev, tdtype = model.config, model.device, model.dtype
    params.check(cfg, str(dev))
    seed_mask = loaded.state.attention("seed")  # mode 1's attention, as the forward below runs
    ts = sorted(set(params.ts or default_ts(cfg.block_size, dev)))
    min_sample_ms = 2.0 if dev.type == "cuda" else 0.0
    weights = _weights(model)
    dims = shape_dims(cfg)
    gen = torch.Generator(device="cpu").manual_seed(1)
    x_full = {k: torch.randn(ts[-1], k, generator=gen).to(dev, tdtype)
              for k in {k for k, _ in dims.values()}}
    ids = random_prompt(model, 1, ts[-1], seed=1)
    tr = Tracker(progress, should_stop, len(ts), unit="T values")
    shapes: list[dict[str, Any]] = []

    def timed(name: str, m: int) -> float:
        w, b = weights[name]
        k, n = dims[name]
        x = x_full[k][:m]
        ms, samples, inner = _time(lambda: F.linear(x, w, b), dev, 1, params.repeats,
                                   min_sample_ms, kernels_only=True)
        shapes.append({
            "T": m, "context_len": m, "shape": name, "m": m, "k": k, "n": n,
            "latency_ms": ms, "samples_ms": samples, "calls_per_sample": inner,
            "tflops": 2 * m * k * n / (ms / 1e3) / 1e12 if ms > 0 else None,
        })
        return ms

    head_one_ms = timed("head", 1)  # mode 2's head: one row, whatever T is
    shapes.pop()  # kept only for the totals; T=1 is timed again below if asked for
    stopped = False
    for i, t in enumerate(ts):
        if tr.stop():
            stopped = True
            tr.note("stopped: T values already timed are kept")
            break
        tr.emit(f"timing the matmuls at T = {t}")
        per = {name: timed(name, t) for name in SHAPES}
        layer_ms = sum(per[name] for name in LAYER_SHAPES)
        total = {"T": t, "context_len": t, "layer_ms": layer_ms, "head_ms": per["head"],
                 "total_ms": cfg.n_layer * layer_ms + per["head"],
                 "total_last_ms": cfg.n_layer * layer_ms + head_one_ms, "forward_ms": None}
        if params.include_forward and i % params.forward_every == 0:
            idx = ids[:, :t]
            total["forward_ms"], _, _ = _time(
                lambda idx=idx: model(idx, use_cache=False, logits="all",
                                     attention=seed_mask), dev,
                1, params.repeats, min_sample_ms)
        tr.work += 1
        tr.row("totals", total, f"T = {t}: {total['total_ms']:.2f} ms of matmuls")
    return record(loaded, "staircase", params,
                  {"staircase": shapes, "totals": tr.tables.get("totals", [])},
                  partial=stopped, notes=tr.notes)
