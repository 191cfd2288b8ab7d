"""Soak: 20 small sweeps back to back through the measuring process must not grow memory.

Anonymous resident memory (heap, tensors: what a leak grows) of the measuring process and of this
one (the server's side) is read after a first sweep (allocator pools and lazily built kernels are
then in place) and again after twenty more. File-backed pages are left out: they are the shared
libraries' code, which the kernel drops under memory pressure and pages back in when a kernel runs
again, so they say nothing about a leak. A CI run (and later one full run here) saw 50 MiB more:
freed heap that glibc kept, none of it live -- the measuring process now trims its heap after
each run (``instruments.process.worker.return_freed_heap``), and the same sequence then grew 0.02
MiB. The bound is 40 MiB: the model is a few MB, and one sweep's caches and rows are well under 1
MiB, so steady growth of even 2 MiB per sweep fails it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import time
from pathlib import Path

import psutil
import pytest

from instruments.experiments import to_dict
from instruments.experiments.latency import LatencyParams
from instruments.process import client
from instruments.spine import ModelSpec
from instruments.store.results import load_runs

GROWTH_BOUND_BYTES = 40 * 2**20


def _status_kib(pid: int, field: str) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def _rss(pid: int) -> int:
    """Anonymous resident bytes of ``pid`` (Linux); total RSS where /proc has no RssAnon."""
    if pid == psutil.Process().pid:
        gc.collect()
        # Return freed heap pages to the OS so RSS reflects live memory (glibc only).
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    anon_kib = _status_kib(pid, "RssAnon")
    return anon_kib * 1024 if anon_kib is not None else psutil.Process(pid).memory_info().rss


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
    file_before = _status_kib(pid, "RssFile")
    for _ in range(20):
        assert one_sweep() == pid  # the same measuring process holds the model throughout
    growth = _rss(pid) - before
    server_growth = _rss(psutil.Process().pid) - server_before
    file_after = _status_kib(pid, "RssFile")
    file_note = (f" (its file-backed pages {(file_after - file_before) / 1024:+.2f} MiB)"
                 if file_before is not None and file_after is not None else "")
    print(f"anonymous resident memory growth over 20 sweeps: measuring process "
          f"{growth / 2**20:.2f} MiB{file_note}, this process {server_growth / 2**20:.2f} MiB")
    assert growth < GROWTH_BOUND_BYTES, (f"the measuring process's anonymous memory grew by "
                                         f"{growth / 2**20:.1f} MiB{file_note}")
    assert server_growth < GROWTH_BOUND_BYTES, f"this process grew by {server_growth / 2**20:.1f}"
    loaded = load_runs(tmp_path)
    assert len(loaded.runs) == 21 and not loaded.skipped
