"""Soak: 20 small sweeps back to back must not grow the process's memory.

Resident memory is read after a first sweep (allocator pools and lazily built kernels are then
in place) and again after twenty more. The bound is 40 MiB: the model is ~2.6 MB, and one
sweep's caches and rows are well under 1 MiB, so steady growth of even 2 MiB per sweep fails it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc

import psutil
import pytest
import torch

from engine.results import collect_meta, load_runs, new_run, save_run
from engine.runner import RUNNER
from engine.sweep import SweepSpec, run_latency_sweep

from .conftest import small_model

GROWTH_BOUND_BYTES = 40 * 2**20


def _rss() -> int:
    gc.collect()
    # Return freed heap pages to the OS so RSS reflects live memory (glibc only).
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


@pytest.mark.soak
def test_twenty_sweeps_do_not_grow_memory(tmp_path) -> None:
    model = small_model()
    spec = SweepSpec(contexts=[4, 16, 32], modes=["uncached", "concat", "prealloc"],
                     warmup=1, repeats=1, check_tokens=4, warmup_steps=4)

    def one_sweep(i: int) -> None:
        with RUNNER.turn("cpu", owner="soak", what=f"sweep {i}"):
            result = run_latency_sweep(model, spec)
        assert len(result.rows) == 9 and not result.cancelled
        save_run(new_run("latency_sweep", collect_meta(model="small"), {"latency": result.rows}),
                 tmp_path)

    one_sweep(0)
    before = _rss()
    alloc_before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    for i in range(1, 21):
        one_sweep(i)
    growth = _rss() - before
    print(f"resident memory growth over 20 sweeps: {growth / 2**20:.2f} MiB")
    assert growth < GROWTH_BOUND_BYTES, f"resident memory grew by {growth / 2**20:.1f} MiB"
    if torch.cuda.is_available():
        assert torch.cuda.memory_allocated() == alloc_before
    loaded = load_runs(tmp_path)
    assert len(loaded.runs) == 21 and not loaded.skipped
