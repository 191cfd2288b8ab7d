"""Soak: 20 small sweeps back to back through the measuring process must not grow memory.

Resident memory of the measuring process (and of this one, the server's side) is read after a
first sweep (allocator pools and lazily built kernels are then in place) and again after twenty
more. The bound is 40 MiB: the model is a few MB, and one sweep's caches and rows are well under
1 MiB, so steady growth of even 2 MiB per sweep fails it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import time
from pathlib import Path

import psutil
import pytest

from instruments import client
from instruments.params import LatencyParams, to_dict
from instruments.results import load_runs
from instruments.spine import ModelSpec

GROWTH_BOUND_BYTES = 40 * 2**20


def _rss(pid: int) -> int:
    gc.collect()
    # Return freed heap pages to the OS so RSS reflects live memory (glibc only).
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process(pid).memory_info().rss


@pytest.mark.soak
@pytest.mark.timeout(600)
def test_twenty_sweeps_do_not_grow_memory(tmp_path: Path) -> None:
    params = to_dict(LatencyParams(contexts=[4, 16, 32], modes=["uncached", "concat", "prealloc"],
                                   warmup=1, repeats=1, warmup_steps=4,
                                   measure_peaks=False))

    def one_sweep() -> int:
        job = client.submit("latency", params, ModelSpec("tiny"), owner="soak",
                            results_dir=tmp_path)
        end = time.monotonic() + 120
        while not job.finished and time.monotonic() < end:
            time.sleep(0.05)
        assert job.state == "done", job.error
        assert len(job.run["tables"]["latency"]) == 9
        return job.pid

    pid = one_sweep()
    before, server_before = _rss(pid), _rss(psutil.Process().pid)
    for _ in range(20):
        assert one_sweep() == pid  # the same measuring process holds the model throughout
    growth = _rss(pid) - before
    server_growth = _rss(psutil.Process().pid) - server_before
    print(f"resident memory growth over 20 sweeps: measuring process {growth / 2**20:.2f} MiB, "
          f"this process {server_growth / 2**20:.2f} MiB")
    assert growth < GROWTH_BOUND_BYTES, f"the measuring process grew by {growth / 2**20:.1f} MiB"
    assert server_growth < GROWTH_BOUND_BYTES, f"this process grew by {server_growth / 2**20:.1f}"
    loaded = load_runs(tmp_path)
    assert len(loaded.runs) == 21 and not loaded.skipped
