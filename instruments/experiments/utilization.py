"""MBU and MFU of timed points, once a run knows its device's peaks. Torch-free at import.

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

from typing import Any

from engine import modes
from instruments.costmodel import costs


def kv_storage(mode: str) -> str | None:
    """How ``mode`` stores its K/V, when not in the model's dtype ("int8" for mode 11)."""
    spec = modes.MODES.get(mode)
    return "int8" if spec is not None and spec.options.get("cache_kind") == "kv_int8" else None


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
