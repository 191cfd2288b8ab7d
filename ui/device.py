"""Device peaks for the pages: listed (datasheet) and measured (the hardware experiment).

Contract: ``PEAKS_KEY`` is the session key of the hardware job (Overview and FLOPs pages start
it through ``ui.jobs``; it runs ``instruments.measure.device.measure_peaks`` in the measuring
process). ``bench(device, dtype)`` is the measured peaks of this session's last finished hardware
job for that device and dtype, or None. Torch-free.
"""

from __future__ import annotations

from typing import Any

from engine import dtypes
from ui import jobs

PEAKS_KEY = "peaks_job"


def start_peaks() -> None:
    jobs.start(PEAKS_KEY, "hardware", {}, "peak microbenchmarks", estimate_s=10.0)


def bench(device: str, dtype: str) -> dict[str, Any] | None:
    job = jobs.get(PEAKS_KEY)
    if job is None or job.run is None or job.model.device != device:
        return None
    measured = (job.run["meta"].get("peaks") or {}).get("measured")
    if measured and dtypes.canonical(measured["dtype"]) == dtypes.canonical(dtype):
        return measured
    return None
