"""Timing harness: synchronise, warm up, repeat, and keep every raw sample.

Contract: every timed region is a device sync + clock read before and after, so queued GPU work
lands inside the region that launched it; samples are in milliseconds. The samples of a point
are taken by ``instruments.measure.sampler.Sampler`` (and ``time_call``, a fixed count of
them). `StepClock` times the steps of a loop the caller drives (the engine's decode loop takes it
as its timer; ``skip`` leaves the first calls untimed, e.g. a prefill and warm-up steps). `Spans`
marks each timed call as a profiler span instead. The clock is injectable for tests. CUDA is
touched only when a CUDA device is named.

`CpuWatch` says whether a timed region on a CPU ran on a quiet machine: the timing thread lost
its core (wall time minus the thread's CPU time), or other processes used the CPU meanwhile
(the cgroup's CPU time minus this process's; on a 2-core machine a page rendering on the other
core slowed a gpt2 decode step from 44 to 72 ms through shared memory bandwidth, with no
preemption at all). A caller sets such a sample aside and takes it again (``retake``);
`StepClock` records the watch's verdict beside each sample.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

Clock = Callable[[], float]  # returns seconds


def _is_cuda(device: Any) -> bool:
    return str(device).startswith("cuda")


def synchronize(device: Any = "cpu") -> None:
    """Block until all queued work on `device` is done; a no-op for CPU (it runs eagerly)."""
    if _is_cuda(device):
        import torch  # local: CPU-only callers never import or initialise CUDA through here

        torch.cuda.synchronize(device)


# Where the CPU time of everything this machine (or container) runs can be read, finest first:
# (path, key or None for a bare number, nanoseconds per unit, resolution in ms).
_USAGE_SOURCES = (
    ("/sys/fs/cgroup/cpu.stat", "usage_usec", 1_000, 0.001),  # cgroup v2 (the container's root)
    ("/sys/fs/cgroup/cpuacct/cpuacct.usage", None, 1, 0.001),  # cgroup v1
    ("/sys/fs/cgroup/cpu,cpuacct/cpuacct.usage", None, 1, 0.001),
)
PREEMPTED_SHARE = 0.10  # the timing thread was off its core for a tenth of the sample
OTHERS_SHARE = 0.25  # other processes ran a quarter of the sample on some core
QUIET_SHARE = 0.10  # "quiet": others used under a tenth of one core over a window


def _usage_reader() -> tuple[Callable[[], int] | None, float]:
    """A reader of the machine's used CPU time (ns) and its resolution (ms); (None, 0) if none."""
    for path, key, scale, resolution_ms in _USAGE_SOURCES:
        def read(path: str = path, key: str | None = key, scale: int = scale) -> int:
            with open(path, encoding="ascii") as f:
                text = f.read()
            if key is None:
                return int(text.strip()) * scale
            for line in text.splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value) * scale
            raise OSError(f"{key} not in {path}")
        try:
            read()
        except (OSError, ValueError):
            continue
        return read, resolution_ms
    return None, 0.0


class CpuWatch:
    """Did a timed region on a CPU run undisturbed? ``begin()``; the region; ``end(wall_ms)``.

    ``end`` returns None for a quiet sample, else why not ("lost its core for 12.3 ms",
    "other processes used 41.0 ms of CPU"). ``usage_ns`` reads the CPU time everything here
    has used (None: only preemption is seen); the clocks are injectable for tests.
    """

    def __init__(self, usage_ns: Callable[[], int] | None = None, resolution_ms: float = 0.0,
                 process_ns: Callable[[], int] = time.process_time_ns,
                 thread_ns: Callable[[], int] = time.thread_time_ns,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Clock = time.perf_counter) -> None:
        self._usage, self.resolution_ms = usage_ns, resolution_ms
        self._process, self._thread, self._sleep, self._clock = process_ns, thread_ns, sleep, clock
        self._marks: tuple[int, int, int] | None = None

    @classmethod
    def for_device(cls, device: Any) -> CpuWatch | None:
        """A watch for a CPU device (None on a GPU: a host thread waiting on the device may
        sleep, so wall minus CPU time is not lost time there)."""
        if str(device) != "cpu":
            return None
        usage, resolution_ms = _usage_reader()
        return cls(usage, resolution_ms)

    def _read(self) -> tuple[int, int, int]:
        return (self._usage() if self._usage else 0), self._process(), self._thread()

    def begin(self) -> None:
        self._marks = self._read()

    def others_ms(self) -> float:
        """CPU time other processes used since ``begin`` (0 when it cannot be read)."""
        if self._marks is None or self._usage is None:
            return 0.0
        usage, process, _ = self._read()
        return max(0.0, ((usage - self._marks[0]) - (process - self._marks[1])) / 1e6)

    def end(self, wall_ms: float) -> str | None:
        if self._marks is None:
            raise RuntimeError("CpuWatch.end() called without begin()")
        usage, process, thread = self._read()
        u0, p0, t0 = self._marks
        self._marks = None
        lost_ms = wall_ms - (thread - t0) / 1e6
        if lost_ms > max(0.5, PREEMPTED_SHARE * wall_ms):
            return f"lost its core for {lost_ms:.1f} ms"
        if self._usage is not None:
            others_ms = ((usage - u0) - (process - p0)) / 1e6
            if others_ms > max(2 * self.resolution_ms, 0.5, OTHERS_SHARE * wall_ms):
                return f"other processes used {others_ms:.1f} ms of CPU"
        return None

    def wait_quiet(self, window_ms: float, max_s: float = 2.0) -> bool:
        """Wait until other processes used under a tenth of a core over ``window_ms``
        (at most ``max_s``); True when quiet came. Without a usage reader it waits one window."""
        deadline = self._clock() + max_s
        window_s = min(max(window_ms, 20.0), 200.0) / 1e3
        while True:
            self.begin()
            self._sleep(window_s)
            busy_ms = self.others_ms()
            self._marks = None
            if busy_ms < QUIET_SHARE * window_s * 1e3:
                return True
            if self._clock() >= deadline:
                return False


class StepClock:
    """Times the steps of a caller-driven loop, syncing the device at each boundary.

    `clock.start(); ...; elapsed_ms = clock.stop()`, or hand it to the decode loop as its timer.
    `samples_ms` holds one entry per finished step, in order (so index i is step i); with a
    ``watch``, `disturbed` holds the watch's verdict on each (None: quiet).
    """

    def __init__(self, device: Any = "cpu", clock: Clock = time.perf_counter,
                 skip: int = 0, watch: CpuWatch | None = None) -> None:
        self.device = device
        self._clock = clock
        self._start_s: float | None = None
        self.samples_ms: list[float] = []
        self.disturbed: list[str | None] = []
        self.watch = watch
        self.skip = skip  # the first `skip` start/stop pairs are not samples
        self._calls = 0

    def start(self) -> None:
        if self._start_s is not None:
            raise RuntimeError("StepClock.start() called twice without stop()")
        self._calls += 1
        synchronize(self.device)
        if self.watch is not None:
            self.watch.begin()
        self._start_s = self._clock()

    def stop(self) -> float | None:
        """The step's time in ms (None for a skipped call, which is not a sample)."""
        if self._start_s is None:
            raise RuntimeError("StepClock.stop() called without start()")
        synchronize(self.device)
        elapsed_ms = (self._clock() - self._start_s) * 1000.0
        self._start_s = None
        why = self.watch.end(elapsed_ms) if self.watch is not None else None
        if self._calls <= self.skip:
            return None
        self.samples_ms.append(elapsed_ms)
        self.disturbed.append(why)
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
