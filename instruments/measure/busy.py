"""Busy time: how long the device itself works on a call, apart from the host that issues it.

``busy_ms(fn, device, repeats, prepare)`` -> ``Busy(ms, samples_ms, kernels)``: ``repeats``
calls of ``fn`` in one ``torch.profiler`` session, each inside a span of its own (``prepare``
runs before each, outside the span; the session ends after a synchronize, so every kernel a
call queued has run and is in the trace). A call's busy time is read off its span
(``span_busy_us``): on CUDA the time of every kernel, copy and set that the span's operators
launched (the profiler ties each to its launch, however late it ran: ``device_time_total``),
``kernels`` their count; on a CPU, where the host runs the operators itself, the time inside
the span's top-level ATen (and ``kvlab::``) operators, ``kernels`` their count. A step's time
on a GPU is its kernels' when the host keeps the queue full, and the host's time to issue it
when it does not: the two ``instruments.costmodel.predict`` compares on cuda.

``split_row(...)`` is the calibration's row of either (``instruments.measure.calibration``): a
real part's "device" row, or a hollow step's "host" row -- the time to issue it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from instruments.measure.timing import synchronize

SPAN = "kvlab::busy"
TOP_OPS = ("aten::", "kvlab::")  # a CPU's operators: ATen's and our C++ kernel's


@dataclass(frozen=True)
class Busy:
    ms: float  # median over the calls
    samples_ms: list[float]
    kernels: float  # device kernels (CUDA) or top-level operators (CPU) per call, median


def _launched(event: Any) -> int:
    """Kernels launched by ``event`` and the operators inside it."""
    return len(event.kernels) + sum(_launched(c) for c in event.cpu_children)


def span_busy_us(span: Any, cuda: bool) -> tuple[float, int]:
    """(µs busy, kernels or operators) of one call's span in a profiler trace."""
    if cuda:
        return float(span.device_time_total), _launched(span)
    ops = [c for c in span.cpu_children if c.name.startswith(TOP_OPS)]
    return float(sum(c.time_range.end - c.time_range.start for c in ops)), len(ops)


def busy_ms(fn: Callable[[], Any], device: Any, repeats: int = 2,
            prepare: Callable[[], Any] | None = None) -> Busy:
    """The device's busy time for a call of ``fn`` (see the module docstring); the caller has
    warmed it up."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(max(1, repeats)):
            if prepare is not None:
                prepare()
            with record_function(SPAN):
                fn()
        synchronize(device)
    cpu = torch.autograd.DeviceType.CPU
    spans = [e for e in prof.events() if e.name == SPAN and e.device_type == cpu]
    if not spans:
        raise RuntimeError("the profiler recorded none of the calls' spans")
    read = [span_busy_us(s, cuda) for s in spans]
    return Busy(statistics.median(us for us, _ in read) / 1e3, [us / 1e3 for us, _ in read],
                statistics.median(n for _, n in read))


Sample = Callable[[Callable[[], Any], Any, int, Callable[[], Any] | None], list[float]]


def split_row(part: str, variant: str, x: int, fn: Callable[[], Any],
              prepare: Callable[[], Any] | None, device: Any, repeats: int, launches: bool,
              sample: Sample) -> dict[str, Any]:
    """A real part's "device" row (its kernels' busy time, their count), or a hollow step's
    "host" row: the time to issue it (a synchronize, then the call, not its kernels: timed by
    the calibration's own ``sample``), its launches counted where ``launches`` (once a mode:
    the context does not change them)."""
    if part != "hollow":
        used = busy_ms(fn, device, repeats, prepare)
        return {"part": part, "variant": variant, "scale": "device", "x": x, "ms": used.ms,
                "samples_ms": used.samples_ms, "kernels": used.kernels}
    kernels = busy_ms(fn, device, 1, prepare).kernels if launches else None

    def issue() -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    samples = sample(issue, device, repeats, prepare)
    return {"part": part, "variant": variant, "scale": "host", "x": x,
            "ms": statistics.median(samples), "samples_ms": samples, "kernels": kernels}
