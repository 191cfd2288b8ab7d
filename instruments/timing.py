"""Timing harness: synchronise, warm up, repeat, and keep every raw sample.

Contract: `time_call(fn, warmup=W, repeats=R)` calls `fn` W + R times; only the last R are timed,
each between a device sync + clock read before and after, so queued GPU work lands inside the
region that launched it. Samples are in milliseconds. `StepClock` does the same for the steps of
a loop the caller drives (the engine's decode loop takes it as its timer; ``skip`` leaves the
first calls untimed, e.g. a prefill and warm-up steps). `Spans` marks each timed call as a
profiler span instead. The clock is injectable for tests. CUDA is touched only when a CUDA
device is named.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Clock = Callable[[], float]  # returns seconds


def _is_cuda(device: Any) -> bool:
    return str(device).startswith("cuda")


def synchronize(device: Any = "cpu") -> None:
    """Block until all queued work on `device` is done; a no-op for CPU (it runs eagerly)."""
    if _is_cuda(device):
        import torch  # local: CPU-only callers never import or initialise CUDA through here

        torch.cuda.synchronize(device)


def _check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class Timing:
    """Raw samples of timed calls (ms) plus their summary; warm-up calls are not in `samples_ms`."""

    samples_ms: list[float]
    warmup: int
    repeats: int

    def __post_init__(self) -> None:
        if not self.samples_ms:
            raise ValueError("a Timing needs at least one sample")

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)


def time_call(
    fn: Callable[[], Any],
    *,
    warmup: int,
    repeats: int,
    device: Any = "cpu",
    clock: Clock = time.perf_counter,
) -> Timing:
    """Run `fn` `warmup` times untimed, then `repeats` times timed; return every timed sample.

    warmup >= 0 and repeats >= 1. Each timed region is sync -> clock -> fn() -> sync -> clock:
    the first sync keeps earlier queued work out, the second keeps this call's work in.
    """
    _check_count("warmup", warmup, 0)
    _check_count("repeats", repeats, 1)
    for _ in range(warmup):
        fn()
    synchronize(device)  # warm-up kernels must not leak into the first sample
    samples_ms: list[float] = []
    for _ in range(repeats):
        synchronize(device)
        start_s = clock()
        fn()
        synchronize(device)
        samples_ms.append((clock() - start_s) * 1000.0)
    return Timing(samples_ms=samples_ms, warmup=warmup, repeats=repeats)


class StepClock:
    """Times the steps of a caller-driven loop, syncing the device at each boundary.

    `clock.start(); ...; elapsed_ms = clock.stop()`, or hand it to the decode loop as its timer.
    `samples_ms` holds one entry per finished step, in order (so index i is step i).
    """

    def __init__(self, device: Any = "cpu", clock: Clock = time.perf_counter,
                 skip: int = 0) -> None:
        self.device = device
        self._clock = clock
        self._start_s: float | None = None
        self.samples_ms: list[float] = []
        self.skip = skip  # the first `skip` start/stop pairs are not samples
        self._calls = 0

    def start(self) -> None:
        if self._start_s is not None:
            raise RuntimeError("StepClock.start() called twice without stop()")
        self._calls += 1
        synchronize(self.device)
        self._start_s = self._clock()

    def stop(self) -> float | None:
        """The step's time in ms (None for a skipped call, which is not a sample)."""
        if self._start_s is None:
            raise RuntimeError("StepClock.stop() called without start()")
        synchronize(self.device)
        elapsed_ms = (self._clock() - self._start_s) * 1000.0
        self._start_s = None
        if self._calls <= self.skip:
            return None
        self.samples_ms.append(elapsed_ms)
        return elapsed_ms


class Spans:
    """A decode-loop timer that marks each call after the first ``skip`` as a profiler span.

    Inside ``torch.profiler.profile``, every timed call becomes one ``record_function(name)``
    span whose end waits for the device, so the span covers the device's work too. ``stop``
    returns None: the profiler, not this object, holds the times.
    """

    def __init__(self, name: str, device: Any = "cpu", skip: int = 0) -> None:
        self.name, self.device, self.skip = name, device, skip
        self._calls = 0
        self._span: Any = None

    def start(self) -> None:
        self._calls += 1
        if self._calls > self.skip:
            from torch.profiler import record_function

            self._span = record_function(self.name)
            self._span.__enter__()

    def stop(self) -> None:
        if self._span is not None:
            synchronize(self.device)
            self._span.__exit__(None, None, None)
            self._span = None
