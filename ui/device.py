"""Device peaks for the pages: listed (datasheet) and measured here (microbenchmarks).

Contract: ``run_bench(device, dtype)`` times ``engine.hardware.measure_matmul_tflops`` and
``measure_read_bandwidth_gbps`` while holding the device (one measurement at a time), and keeps
the result in ``st.session_state["bench"]`` keyed by (device, dtype): pages reuse it and never
re-measure on a rerun. ``ceilings(...)`` turns listed and measured peaks into roofline
``Ceiling``s for ``ui.figures_perf``.
"""

from __future__ import annotations

from typing import Any

import streamlit as st

from engine.hardware import lookup_peaks, measure_matmul_tflops, measure_read_bandwidth_gbps
from engine.runner import RUNNER, Cancelled
from ui.figures_perf import Ceiling


def get_bench(device: str, dtype: str) -> dict[str, Any] | None:
    return (st.session_state.get("bench") or {}).get((device, dtype))


def run_bench(device: str, dtype: str) -> dict[str, Any] | None:
    """Measure matmul TFLOP/s and read bandwidth (about 2 s) and remember them in the session."""
    note = st.empty()

    def waiting(position: int, running: Any) -> None:
        who = running.describe() if running is not None else "another run"
        note.info(f"Waiting for {device} (position {position}): {who}")

    try:
        with st.status(f"Measuring {device} peaks…", expanded=False) as status, \
                RUNNER.turn(device, "overview", "peak microbenchmarks", 3.0,
                            on_wait=waiting):
            note.empty()
            status.write("matmul 1024×1024×1024…")
            mm = measure_matmul_tflops(device, dtype, n=1024, min_seconds=0.4)
            status.write("reading a 256 MiB tensor…")
            bw = measure_read_bandwidth_gbps(device, nbytes=256 * 2**20)
            status.update(label=f"Measured {device} peaks", state="complete")
    except (RuntimeError, ValueError, Cancelled) as exc:
        st.error(f"The microbenchmark could not run: {exc}")
        return None
    result = {
        "matmul_tflops": mm.median_tflops, "matmul_n": mm.n, "dtype": mm.dtype,
        "matmul_samples": mm.samples_tflops, "read_gbps": bw.read_median_gbps,
        "copy_gbps": bw.copy_median_gbps, "bytes": bw.nbytes,
    }
    st.session_state.setdefault("bench", {})[(device, dtype)] = result
    return result


def ceilings(device_name: str | None, dtype: str, bench: dict[str, Any] | None,
             listed_tflops: float | None = None) -> list[Ceiling]:
    """Roofs to draw: the datasheet's (when the device is listed) and the measured ones."""
    out: list[Ceiling] = []
    spec = lookup_peaks(device_name)
    if spec is not None:
        peak = spec.peak_tflops(dtype) or spec.fp32_tflops
        out.append(Ceiling("listed", float(peak), float(spec.mem_bandwidth_gbps)))
    elif listed_tflops:
        out.append(Ceiling("listed", float(listed_tflops), None))
    if bench:
        out.append(Ceiling("measured here", float(bench["matmul_tflops"]),
                           float(bench["read_gbps"])))
    return out
