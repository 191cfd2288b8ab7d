"""Busy time: how long the device itself works on a call, apart from the host that issues it.

``busy_ms(fn, device, repeats, prepare)`` -> ``Busy(ms, samples_ms, kernels)``: each call of
``fn`` in a ``torch.profiler`` session of its own (``prepare`` and a synchronize before it,
outside the session, so no other work is counted), and the time the trace shows the device
busy summed. On CUDA that is every kernel, copy and set the call ran (its device events, the
clock of the GPU), ``kernels`` their count; on a CPU, where the host runs the operators
itself, the time inside the call's top-level ATen (and ``kvlab::``) operators, ``kernels``
their count. A step's device time on a GPU is the sum of its kernels when the host keeps the
queue full; when it does not, the step takes the host's issue time instead -- the two
``instruments.costmodel.predict`` compares on cuda.

``trace_busy_us(events, cuda)`` is the sum over a trace's events (µs, count), apart so it can be
read on any trace.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from instruments.measure.timing import synchronize

TOP_OPS = ("aten::", "kvlab::")  # a CPU's operators: ATen's and our C++ kernel's


@dataclass(frozen=True)
class Busy:
    ms: float  # median over the calls
    samples_ms: list[float]
    kernels: float  # device kernels (CUDA) or top-level operators (CPU) per call, median


def trace_busy_us(events: Iterable[Any], cuda: bool) -> tuple[float, int]:
    """(µs busy, count) over a profiler trace's events: device events on CUDA (annotations of
    ``record_function`` spans, mirrored on the GPU, are no work and are left out); top-level
    operators on a CPU (nested ones are inside their parent's time)."""
    import torch

    total_us, count = 0.0, 0
    for e in events:
        if cuda:
            if (e.device_type != torch.autograd.DeviceType.CUDA
                    or getattr(e, "is_user_annotation", False)):
                continue
        elif (e.device_type != torch.autograd.DeviceType.CPU or e.cpu_parent is not None
              or not e.name.startswith(TOP_OPS)):
            continue
        total_us += e.time_range.end - e.time_range.start
        count += 1
    return total_us, count


def busy_ms(fn: Callable[[], Any], device: Any, repeats: int = 3,
            prepare: Callable[[], Any] | None = None) -> Busy:
    """The device's busy time for one call of ``fn`` (see the module docstring), after one
    untraced warm-up call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if prepare is not None:
        prepare()
    fn()
    samples, counts = [], []
    for _ in range(max(1, repeats)):
        if prepare is not None:
            prepare()
        synchronize(device)
        with profile(activities=activities) as prof:
            fn()
            synchronize(device)
        us, n = trace_busy_us(prof.events(), cuda)
        samples.append(us / 1e3)
        counts.append(n)
    return Busy(statistics.median(samples), samples, statistics.median(counts))
