"""A timed point's row and its arithmetic: FLOPs, bytes, rates, MBU and MFU. Torch-free at import.

``row(model, mode, t, batch, samples_ms, ...)`` is one latency row: the median, every sample,
p50/p90/p99, the formula FLOPs and bytes (the mode's own bytes per weight) and the rates.

  MBU  model bandwidth utilisation: the bytes a step must read (``read_bytes``: the weights
       once, the tied embedding once, in the mode's own weight dtype, plus the K/V rows it
       attends to; ``instruments.costmodel.costs.step_read_bytes``) / the step's time / a peak
       read bandwidth
  MFU  model FLOPs utilisation: the step's formula FLOPs / its time / a peak matmul rate
Against the peaks measured on this device in this run (``mbu``, ``mfu``: the read bandwidth and
matmul rate of ``instruments.measure.device.peaks``) and, where the GPU is listed, against its
datasheet (``mbu_listed``, ``mfu_listed``; fp32 matmuls against TF32 only when TF32 was on).
``add_shares(rows, measured, listed, dtype, tf32)`` fills them in; a row without a number it
needs gets None. ``kv_storage(mode)`` says how a mode stores its K/V ("int8" or None).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from instruments import lineup
from instruments.costmodel import costs
from instruments.store.stats import percentile_fields

if TYPE_CHECKING:
    from engine.models.base import CausalLM


def weight_storage(spec: Any) -> str:
    """Bytes per weight a mode or peer streams, as ``costs.linear_weight_bytes`` names them: a
    weight-only rung's or a GGUF peer's storage, a peer's own precision where the cost model
    knows it ("int8", "bfloat16"), else "" (the model's dtype)."""
    own = getattr(spec, "weight_storage", "") or getattr(spec, "dtype", "") or ""
    return own if own in costs.WEIGHT_STORAGES else ""


def kv_storage(mode: str) -> str | None:
    """How ``mode`` stores its K/V, when not in the model's dtype ("int8" for mode 11)."""
    spec = lineup.mode_spec(mode)
    return spec.kv_storage or None if spec is not None else None


def listed_peaks(device_name: str | None, dtype: Any, tf32: bool, device: str = "cuda"
                 ) -> tuple[float | None, float | None]:
    """(GB/s, TFLOP/s) a datasheet lists for this GPU and dtype; (None, None) if not listed
    or not a GPU (the datasheets are GPUs')."""
    from instruments.measure.specs import lookup_peaks

    spec = lookup_peaks(device_name) if str(device).startswith("cuda") else None
    if spec is None:
        return None, None
    return spec.mem_bandwidth_gbps, spec.peak_tflops(dtype, allow_tf32=tf32)


def add_shares(rows: list[dict[str, Any]], measured: dict[str, Any] | None,
               listed: tuple[float | None, float | None] = (None, None)) -> None:
    """Fill ``mbu``, ``mfu`` (measured peaks) and ``mbu_listed``, ``mfu_listed`` in place."""
    m_gbps = (measured or {}).get("read_gbps")
    m_tflops = (measured or {}).get("matmul_tflops")
    for r in rows:
        seconds = r["latency_ms"] / 1e3 if r.get("latency_ms") else None
        flops, nbytes = r.get("flops"), r.get("read_bytes")
        r["mbu"], r["mfu"] = costs.utilization(flops, nbytes, seconds, m_gbps, m_tflops)
        r["mbu_listed"], r["mfu_listed"] = costs.utilization(flops, nbytes, seconds, *listed)


def row(model: CausalLM, mode: str, t: int, batch: int, samples_ms: list[float], phase: str,
        last_only: bool, compile_s: float, keys: int | None = None,
        quiet: dict[str, Any] | None = None) -> dict[str, Any]:
    """One latency row: the median, every sample, the formula FLOPs/bytes and the rates.

    ``keys``: what a cached step attends to when that is more than its context (a static-shape
    step reads the whole cache): FLOPs and bytes are charged for it. ``quiet``: the samples set
    aside as disturbed (``set_aside_ms``, ``set_aside_why``) and ``disturbed_kept``.
    """
    cfg, spec = model.config, lineup.spec(mode)
    cached = spec.cached and phase == "decode"
    storage = weight_storage(spec)
    keys = keys if cached else None
    median_ms = statistics.median(samples_ms)
    flops = costs.step_flops(cfg, t, cached=cached, batch_size=batch,
                             last_only=last_only or spec.cached, keys=keys)
    nbytes = costs.step_bytes(cfg, model.dtype, t, cached=cached, batch_size=batch,
                              last_only=last_only or spec.cached, keys=keys,
                              storage=storage)  # the mode's own bytes per weight
    read = costs.step_read_bytes(cfg, model.dtype, t, batch, keys=keys if cached else None,
                                 storage=storage, kv_storage=kv_storage(mode))
    seconds = median_ms / 1e3
    return {
        "mode": mode, "mode_label": spec.label, "cached": spec.cached, "phase": phase,
        "context_len": t, "attended_keys": keys or t, "batch_size": batch,
        "dtype": str(model.dtype).removeprefix("torch."),
        "latency_ms": median_ms, "min_ms": min(samples_ms), "samples_ms": list(samples_ms),
        "spread_ms": max(samples_ms) - min(samples_ms),
        "flops": flops, "tflops": flops / seconds / 1e12 if seconds > 0 else None,
        "bytes": nbytes, "gbps": nbytes / seconds / 1e9 if seconds > 0 else None,
        **percentile_fields(samples_ms), "read_bytes": read,  # MBU's numerator
        "compile_s": compile_s,  # set-up (compile / capture) time, never part of a step
        **(quiet or {}),
    }
