"""Memory: the KV cache three ways, where the bytes go, and the formulas (kind "memory").

``run(loaded, MemoryParams, progress, should_stop)`` -> run with tables
  kv_memory          per context and baseline ("before warm-up" first, then "after warm-up"):
                     formula, tensor, storage bytes and the allocator / RSS deltas
  breakdown          measured components at one batch x context (``instruments.memory``)
  breakdown_formula  the same components by formula (``instruments.costs``)
  model, masks, crossover   weights and mask bytes, and KV-vs-weights for each batch x context
A request that would not fit in the free memory is refused before anything is allocated.
"""

from __future__ import annotations

from typing import Any

import torch

from instruments import costs, memory
from instruments.params import MEMORY_BASELINES, MemoryParams
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, record

BASELINES = MEMORY_BASELINES[::-1]  # "before warm-up" first


@torch.no_grad()
def run(loaded: Loaded, params: MemoryParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
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
                  cublas_workspace_bytes=memory.cublas_workspace_bytes(device))
