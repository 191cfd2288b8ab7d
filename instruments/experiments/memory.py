"""Memory: the KV cache three ways, where the bytes go, and the formulas (kind "memory").

``run(loaded, MemoryParams, progress, should_stop)`` -> run with tables
  kv_memory          per context and baseline ("before warm-up" first, then "after warm-up"):
                     formula, tensor, storage bytes and the allocator / RSS deltas
  breakdown          measured components at one batch x context (``instruments.measure.memory``)
  breakdown_formula  the same components by formula (``instruments.costmodel.costs``)
  model, masks, crossover   weights and mask bytes, and KV-vs-weights for each batch x context
A request that would not fit in the free memory is refused before anything is allocated.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.models.config import GPTConfig, ModelConfig
from instruments.costmodel import costs
from instruments.experiments.inputs import (
    MAX_BATCH,
    contexts_within,
    parse_contexts,
    whole,
)
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, no_grad, record

if TYPE_CHECKING:
    pass

# A memory measurement's two baselines, as the page offers them; the run measures the second
# first (before any warm-up of its own), as the write-up's first attempt did.
MEMORY_BASELINES = ("after warm-up", "before warm-up")
CROSSOVER_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the KV-vs-weights map's batch sizes


@dataclass
class MemoryParams:
    """The KV cache three ways at each context, both baselines; a breakdown; the formulas."""
    contexts: list[int]
    batch_size: int = 1
    cache_kind: str = "concat"
    fill: str = "prefill"  # a fresh cache per point | "decode": one generation passing them
    breakdown_context: int | None = None  # None: the largest context
    breakdown_mask: str = "seed"
    breakdown_cache: str = "prealloc"
    crossover_batches: list[int] = field(default_factory=lambda: list(CROSSOVER_BATCHES))

    @classmethod
    def defaults(cls, device: str, cfg: ModelConfig) -> MemoryParams:
        """Every 64 tokens, decoded through as the write-up did, on a GPU; seven contexts,
        each prefilled afresh, on a CPU (faster)."""
        block_size = cfg.block_size
        if str(device).startswith("cuda"):
            every = [t for t in range(64, block_size + 1, 64)] or [block_size]
            return cls(every, fill="decode")
        seven = {t for t in (64, 128, 256, 384, 512, 768, 1024) if t <= block_size}
        return cls(sorted(seven | {block_size}), fill="prefill")

    def check(self, cfg: GPTConfig, device: str) -> None:
        contexts_within("context lengths", self.contexts, 1, cfg.block_size)
        whole("batch size", self.batch_size, 1, MAX_BATCH)
        for name, value, allowed in (("cache kind", self.cache_kind, ("concat", "prealloc")),
                                     ("breakdown cache", self.breakdown_cache,
                                      ("concat", "prealloc")),
                                     ("fill", self.fill, ("prefill", "decode")),
                                     ("mask", self.breakdown_mask,
                                      ("none", "shared_bool", "seed"))):
            if value not in allowed:
                raise ValueError(f"{name} {value!r} is not one of {', '.join(allowed)}")
        if self.breakdown_context is not None:
            whole("breakdown context", self.breakdown_context, 1, cfg.block_size)
        contexts_within("batch sizes", self.crossover_batches, 1, MAX_BATCH)


Params = MemoryParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-contexts", default=None,
                   help="default: every 64 tokens on CUDA, 64,128,256,384,512,768,1024 on CPU")
    p.add_argument("--cache-kind", default="concat", choices=["concat", "prealloc"])
    p.add_argument("--fill", default=None, choices=["prefill", "decode"],
                   help="default: decode on CUDA (as the write-up), prefill on CPU (faster)")
    p.add_argument("--crossover-batches", default=",".join(map(str, CROSSOVER_BATCHES)))


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> MemoryParams:
    block_size = cfg.block_size
    base = MemoryParams.defaults(args.device, cfg)
    try:
        batches = parse_contexts(args.crossover_batches, MAX_BATCH, "batch size")
    except ValueError as exc:
        raise ValueError(f"--crossover-batches: {exc}") from exc
    contexts = (parse_contexts(args.memory_contexts, block_size) if args.memory_contexts
                else base.contexts)
    return MemoryParams(contexts, args.batch, args.cache_kind, args.fill or base.fill,
                        crossover_batches=batches)


def summary(run: dict[str, Any]) -> list[str]:
    return [f"KV cache at {r['context_len']} tokens: formula {r['kv_formula_bytes']:,} B, "
            f"tensors {r['kv_tensor_bytes']:,} B" for r in run["tables"].get("kv_memory", [])[-1:]]


BASELINES = MEMORY_BASELINES[::-1]  # "before warm-up" first


@no_grad
def run(loaded: Loaded, params: MemoryParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    from instruments.measure import memory

    model = loaded.model
    cfg, dtype, device = model.config, model.dtype, str(model.device)
    params.check(cfg, device)
    points = sorted(set(params.contexts))
    est = costs.peak_memory_estimate(cfg, dtype, params.batch_size, points[-1],
                                     params.cache_kind, device=device)
    ok, why = memory.fits(device, est, resident_bytes=est["weights_bytes"])
    if not ok:
        raise ValueError(f"This measurement would not fit in memory ({why}). Use a smaller "
                         "batch size or shorter contexts.")
    tr = Tracker(progress, should_stop, len(points) * len(BASELINES) + 1)
    stopped = False
    for base in BASELINES:
        chunks = [points] if params.fill == "decode" else [[t] for t in points]
        for chunk in chunks:
            if tr.stop():
                stopped = True
                break
            for r in memory.measure_kv_memory(model, chunk, params.batch_size, params.cache_kind,
                                              warmup_first=base == "after warm-up",
                                              fill=params.fill):
                tr.work += 1
                tr.row("kv_memory", r, f"{base}: {r['context_len']} tokens")
    context = params.breakdown_context or points[-1]
    if not (stopped or tr.stop()):
        tr.emit(f"breakdown at batch {params.batch_size} × {context} tokens")
        tr.tables["breakdown"] = memory.memory_breakdown(
            model, params.batch_size, context, params.breakdown_cache, params.breakdown_mask)
        tr.work += 1
        tr.emit("breakdown measured", points=1)
    else:
        stopped = True
        tr.note("stopped: what was measured is kept")
    mm = memory.model_memory(model)
    tables = {
        "kv_memory": tr.tables.get("kv_memory", []),
        "breakdown": tr.tables.get("breakdown", []),
        "breakdown_formula": costs.breakdown_formula(cfg, dtype, params.batch_size, context,
                                                     params.breakdown_mask, device),
        "model": [{k: v for k, v in mm.items() if k != "mask_bytes_by_kind"}],
        "masks": [{"kind": k, "bytes": v} for k, v in mm["mask_bytes_by_kind"].items()],
        "crossover": costs.crossover_grid(cfg, dtype, params.crossover_batches, points),
    }
    return record(loaded, "memory", params, tables, partial=stopped, notes=tr.notes,
                  cublas_workspace_bytes=memory.cublas_workspace(device)[0])
