"""Memory accounting: weights, KV cache (formula / tensors / allocator), masks, cuBLAS workspace.

Contract: every function returns plain dicts with byte counts in `*_bytes` fields, so the app and
the CLI can store and plot them. Formulas come from instruments.costmodel.costs; measurements come
from the tensors themselves, from torch's CUDA allocator (allocated / requested / reserved) on a
GPU, and from the process's resident set size (psutil) on a CPU, where torch keeps no allocator
counts. A measurement is a difference against a baseline; which baseline was used is recorded per
row, because the write-up's first attempt was skewed by a cuBLAS workspace allocated after it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Sequence
from typing import Any

import torch

from engine.loop import random_prompt
from engine.models.attention import Attention
from engine.models.base import CausalLM
from engine.models.state import ModelState
from instruments import lineup
from instruments.costmodel import costs

MIB = 2**20
STEP_SPAN = "kv_lab.decode_step"


def _is_cuda(device: Any) -> bool:
    return torch.device(device).type == "cuda"


def malloc_trim() -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim; nothing elsewhere), so RSS
    deltas track live tensors and a finished experiment leaves no freed heap behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _sync_and_collect(device: Any, full: bool = False) -> None:
    if full:  # ~0.2 s with torch loaded; caches hold no reference cycles, so only at baselines
        gc.collect()
    malloc_trim()
    if _is_cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _rss_bytes() -> int | None:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a requirement
        return None
    return int(psutil.Process().memory_info().rss)


def _snapshot(device: Any) -> dict[str, int | None]:
    """Allocator counters now (CUDA), or the process RSS (CPU)."""
    if _is_cuda(device):
        torch.cuda.synchronize(device)
        stats = torch.cuda.memory_stats(device)
        return {"allocated": torch.cuda.memory_allocated(device),
                "reserved": torch.cuda.memory_reserved(device),
                "requested": stats.get("requested_bytes.all.current"), "rss": _rss_bytes()}
    return {"allocated": None, "reserved": None, "requested": None, "rss": _rss_bytes()}


def _delta(after: dict, before: dict, key: str) -> int | None:
    if after.get(key) is None or before.get(key) is None:
        return None
    return int(after[key] - before[key])


def weights_bytes(model: CausalLM) -> int:
    """Parameter bytes, each storage counted once (the tied wte / lm_head weight once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        ptr = p.data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += p.numel() * p.element_size()
    return total


def model_memory(model: CausalLM) -> dict[str, Any]:
    """Weights (measured tensors and formula) and causal-mask buffers (held now by the model's
    state, for the modes that ran, and per kind)."""
    cfg = model.config
    return {
        "weights_bytes": weights_bytes(model),
        "weights_formula_bytes": costs.weight_bytes(cfg, model.dtype),
        "mask_bytes": ModelState.of(model).mask_nbytes(),
        "mask_bytes_by_kind": {k: costs.mask_bytes(cfg, k) for k in costs.MASK_BYTE_KINDS},
    }


def clear_cublas_workspaces() -> bool:
    """Free cuBLAS workspaces so the next matmul allocates them again (private torch API)."""
    fn = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if fn is None or not torch.cuda.is_available():
        return False
    try:
        fn()
    except RuntimeError:
        return False
    return True


def cublas_workspace(device: Any) -> tuple[int | None, str]:
    """(bytes the first matmul allocates besides its output, how it was measured)."""
    if not _is_cuda(device):
        return None, "no cuBLAS on a CPU: matmuls there need no lazily allocated workspace"
    if not torch.cuda.is_available():
        return None, "no CUDA device visible"
    dev = torch.device(device)
    a = torch.ones(64, 64, device=dev)
    cleared = clear_cublas_workspaces()
    _sync_and_collect(dev)
    before = torch.cuda.memory_allocated(dev)
    out = a @ a
    torch.cuda.synchronize(dev)
    after = torch.cuda.memory_allocated(dev)
    out_bytes = out.numel() * out.element_size()
    del out
    how = ("workspaces cleared, then memory_allocated around one 64x64 matmul" if cleared else
           "torch cannot clear its workspaces here: 0 means it was allocated earlier")
    return max(0, after - before - out_bytes), how


@torch.no_grad()
def _warm_up(model: CausalLM, batch_size: int = 1, tokens: int = 2) -> None:
    """One forward at the largest shape to come: CPU kernels keep scratch sized by the biggest
    problem seen, and CUDA allocates the cuBLAS workspace on the first matmul."""
    idx = torch.zeros(batch_size, tokens, dtype=torch.long, device=model.device)
    model(idx, lineup.make_cache("prealloc", model, batch_size, tokens), logits="last")


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a view keeps its whole base alive)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def allocation(device: Any, build: Any) -> dict[str, Any]:
    """Allocate what ``build()`` returns (tensors, or objects with ``tensors()``), read what the
    allocator (CUDA) or the process (CPU) gained, free it. ``fits`` False on out-of-memory."""
    _sync_and_collect(device, full=True)
    before = _snapshot(device)
    try:
        made = build()
    except torch.OutOfMemoryError as exc:
        _sync_and_collect(device, full=True)
        return {"fits": False, "error": str(exc).splitlines()[0]}
    parts = made if isinstance(made, (list, tuple)) else [made]
    tensors = [t for p in parts for t in (p.tensors() if hasattr(p, "tensors") else [p])]
    after = _snapshot(device)
    row = {"fits": True, "error": None, "tensor_bytes": storage_bytes(tensors),
           "tensors": len(tensors), **{f"{k}_delta_bytes": _delta(after, before, k)
                                       for k in ("allocated", "reserved", "rss")}}
    del made, parts, tensors
    _sync_and_collect(device, full=True)
    return row


@torch.no_grad()
def measure_kv_memory(model: CausalLM, contexts: Sequence[int], batch_size: int = 1,
                      cache_kind: str = "concat", warmup_first: bool = True,
                      fill: str = "prefill") -> list[dict]:
    """The cache's bytes three ways (formula, tensors, allocator/RSS delta) at each context.

    fill="prefill": a fresh cache per point, filled by one prefill of that many tokens, freed
    before the next point. fill="decode": one generation run (teacher-forced tokens) read as it
    passes each point, as the write-up measured. One baseline is taken before the first point.
    warmup_first=False takes it before any matmul (cuBLAS workspaces cleared first on CUDA):
    that reproduces the write-up's first attempt, where the lazily allocated workspace showed
    up as a constant offset. A CPU has no such workspace, but the first forward's one-time
    allocations (allocator arenas, thread pools) land in the first points' RSS deltas instead.
    """
    if fill not in ("prefill", "decode"):
        raise ValueError(f"fill must be 'prefill' or 'decode', got {fill!r}")
    points = sorted(set(contexts))
    device, cfg = model.device, model.config
    if warmup_first:
        _warm_up(model, batch_size, points[-1])
    elif _is_cuda(device):
        clear_cublas_workspaces()
    idx = random_prompt(model, batch_size, points[-1])
    _sync_and_collect(device, full=True)
    base = _snapshot(device)
    rows: list[dict] = []

    def record(cache: Any, t: int) -> None:
        _sync_and_collect(device)
        now = _snapshot(device)
        used = cache.used_nbytes() if hasattr(cache, "used_nbytes") else cache.nbytes()
        rows.append({
            "context_len": t, "batch_size": batch_size, "cache_kind": cache_kind, "fill": fill,
            "kv_formula_bytes": costs.kv_bytes(cfg, model.dtype, batch_size, t),
            # the same cache if every query head kept its own K/V (GQA's saving; = formula
            # for GPT-2)
            "kv_mha_formula_bytes": costs.kv_bytes(cfg, model.dtype, batch_size, t)
            * cfg.n_head // cfg.n_kv_head,
            "kv_tensor_bytes": cache.nbytes(), "kv_used_bytes": used,
            "kv_storage_bytes": storage_bytes(cache.tensors()),
            "allocated_delta_bytes": _delta(now, base, "allocated"),
            "requested_delta_bytes": _delta(now, base, "requested"),
            "reserved_delta_bytes": _delta(now, base, "reserved"),
            "rss_delta_bytes": _delta(now, base, "rss"),
            "baseline": "after warm-up" if warmup_first else "before warm-up",
        })

    if fill == "prefill":
        for t in points:
            cache = lineup.make_cache(cache_kind, model, batch_size, t)
            out, _ = model(idx[:, :t], cache, logits="last")
            del out  # only the cache should stay alive when the counters are read
            record(cache, t)
            del cache
            _sync_and_collect(device)
        return rows
    cache = lineup.make_cache(cache_kind, model, batch_size, points[-1])
    out, _ = model(idx[:, : points[0]], cache, logits="last")
    del out
    record(cache, points[0])
    for t in range(points[0] + 1, points[-1] + 1):
        out, _ = model(idx[:, t - 1 : t], cache, logits="last")
        del out
        if t in points:
            record(cache, t)
    del cache
    _sync_and_collect(device)
    return rows


@torch.no_grad()
def memory_breakdown(model: CausalLM, batch_size: int, context_len: int,
                     cache_kind: str = "prealloc", mask: str | None = None) -> list[dict]:
    """Rows (component, bytes, source, note) for a stacked bar of one run's memory, measured.

    Fills a cache of `context_len` tokens through the attention of mask variant `mask` (default:
    the model's own) and reads tensors and counters; the last row is what the device holds
    beyond the listed parts (CUDA: reserved - allocated; CPU: RSS minus everything above).
    Only that variant's mask buffers are counted -- not others an earlier mode built -- and
    buffers built here for it are freed afterwards: measuring leaves the model's state as it
    found it. The formula bar is ``instruments.costmodel.costs.breakdown_formula``.
    """
    state = ModelState.of(model)
    mask = mask or model.config.mask
    built_here = not state.holds_attention(mask)
    try:
        return _measured_breakdown(model, batch_size, context_len, cache_kind,
                                   state.attention(mask))
    finally:
        if built_here:
            state.drop(("attention", mask))
            _sync_and_collect(model.device)


def _measured_breakdown(model: CausalLM, batch_size: int, context_len: int, cache_kind: str,
                        attention: Attention) -> list[dict]:
    cfg, device, dtype = model.config, model.device, model.dtype
    kv_formula = costs.kv_bytes(cfg, dtype, batch_size, context_len)
    rows = [
        {"component": "weights", "bytes": weights_bytes(model), "source": "measured",
         "note": "parameters, tied embedding counted once"},
        {"component": "causal-mask buffers", "bytes": attention.nbytes(),
         "source": "measured", "note": f"{attention.kind} variant, as the measured path uses "
         f"it; per kind: { {k: costs.mask_bytes(cfg, k) for k in costs.MASK_BYTE_KINDS} }"},
    ]
    ws_bytes, ws_how = cublas_workspace(device)
    _warm_up(model, batch_size, context_len)
    _sync_and_collect(device, full=True)
    cache = lineup.make_cache(cache_kind, model, batch_size, context_len)
    idx = random_prompt(model, batch_size, context_len)
    if _is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)
    logits, _ = model(idx, cache, logits="last", attention=attention)
    del logits
    snap = _snapshot(device)
    rows.append({"component": "KV cache", "bytes": storage_bytes(cache.tensors()),
                 "source": "measured", "note": f"storage held by the {cache_kind} cache; "
                 f"tensors {cache.nbytes()} B, formula {kv_formula} B"})
    rows.append({"component": "cuBLAS workspace", "bytes": ws_bytes or 0,
                 "source": "measured" if ws_bytes is not None else "formula", "note": ws_how})
    accounted = sum(r["bytes"] for r in rows)
    if _is_cuda(device):
        peak = torch.cuda.max_memory_allocated(device)
        rows.append({"component": "activations (transient peak)",
                     "bytes": max(0, peak - (snap["allocated"] or 0)), "source": "measured",
                     "note": "max_memory_allocated during the prefill minus allocated after"})
        rows.append({"component": "allocator slack", "bytes": max(0, (snap["reserved"] or 0)
                     - (snap["allocated"] or 0)), "source": "measured",
                     "note": "memory_reserved - memory_allocated: cached, not in use"})
    elif snap["rss"] is not None:
        rows.append({"component": "process, not accounted above", "bytes":
                     max(0, snap["rss"] - accounted), "source": "measured",
                     "note": "resident set size minus the rows above: Python, torch libraries, "
                     "allocator arenas, activations freed but not returned"})
    del cache
    _sync_and_collect(device)
    return rows


def free_bytes(device: Any) -> int | None:
    """Bytes that could still be allocated: free GPU memory, or available system memory."""
    if _is_cuda(device):
        if not torch.cuda.is_available():
            return None
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        # The caching allocator can reuse what it reserved but is not using.
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return None
    return int(psutil.virtual_memory().available)


def fits(device: Any, estimate: dict[str, int], resident_bytes: int = 0,
         headroom: float = 0.9) -> tuple[bool, str]:
    """Whether an estimate fits in what `device` has free (keeping 10% spare), and a message.

    `resident_bytes`: parts of the estimate already allocated (e.g. the loaded weights).
    """
    need = max(0, estimate["total_bytes"] - resident_bytes)
    free = free_bytes(device)
    parts = ", ".join(f"{k.removesuffix('_bytes')} {v / MIB:,.0f} MiB"
                      for k, v in estimate.items() if k != "total_bytes" and v)
    if free is None:
        return True, f"needs ~{need / MIB:,.0f} MiB ({parts}); free memory unknown"
    ok = need <= headroom * free
    verdict = "fits" if ok else "does not fit"
    return ok, (f"{verdict}: needs ~{need / MIB:,.0f} MiB more ({parts}); "
                f"{free / MIB:,.0f} MiB free on {device}")


@torch.no_grad()
def step_memory_growth(decoder: Any, prompt: torch.Tensor, n_steps: int = 100) -> dict[str, Any]:
    """Bytes a decoder keeps per decode step (net growth) and allocates per step (churn).

    Runs ``n_steps`` greedy steps under ``torch.profiler(profile_memory=True)``, reads the
    allocator's running total at the end of each step from the trace, and returns
    ``net_bytes_per_step`` = (total after the last step - total after the first) / (n - 1):
    0 when a step frees everything it allocates (a preallocated cache), ~the K/V row when the
    cache grows by concatenation. ``churn_bytes_per_step`` counts every allocation, freed or
    not. ``decoder`` needs room for ``prompt`` and ``n_steps`` more tokens; the prefill is not
    counted.
    """
    import json
    import os
    import tempfile

    if n_steps < 2:
        raise ValueError(f"n_steps must be >= 2, got {n_steps}")
    from torch.profiler import ProfilerActivity, profile

    from engine.loop import decode
    from instruments.measure.timing import Spans

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        decode(decoder, prompt, 1 + n_steps, timer=Spans(STEP_SPAN, prompt.device, skip=1))
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as fh:
            trace = json.load(fh)["traceEvents"]
    finally:
        os.unlink(path)
    bounds = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace if e.get("name") == STEP_SPAN)
    spans = [end for _, end in bounds]
    mem = sorted((e["ts"], e["args"]) for e in trace if e.get("name") == "[memory]"
                 and int(e["args"].get("Device Type", 0)) == 0)  # 0 = CPU
    if len(spans) < 2 or not mem:
        return {"n_steps": n_steps, "net_bytes_per_step": None, "churn_bytes_per_step": None}

    def total_at(t: float) -> int:
        before = [a["Total Allocated"] for ts, a in mem if ts <= t]
        return int(before[-1]) if before else int(mem[0][1]["Total Allocated"])

    churn = sum(int(a["Bytes"]) for ts, a in mem if int(a["Bytes"]) > 0
                and any(lo <= ts <= hi for lo, hi in bounds))  # the steps only, not the prefill
    return {"n_steps": n_steps,
            "net_bytes_per_step": (total_at(spans[-1]) - total_at(spans[0])) / (len(spans) - 1),
            "churn_bytes_per_step": churn / n_steps}
