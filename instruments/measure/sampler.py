"""The one Sampler: the timed samples of one point, the quiet watch and retakes.

``Sampler(device, repeats=3, min_repeats=2, spread=0.10, retakes=3)`` then
``sampler.point(step, prepare=None) -> Point | None`` takes samples of ``step`` until
``min_repeats`` of them agree within ``spread`` (max - min over the median) or ``repeats`` are
taken; None when ``should_stop`` asked to stop. Each sample is

    prepare()  (untimed: move a decoder to its context, empty a cache)
    sync -> watch.begin -> clock -> step() -> sync -> clock -> watch.end

and with ``self_timed=True`` a ``step()`` that times a part of itself returns that part's ms
(a float; anything else: the whole call counts). ``warmup``
untimed calls of ``prepare(); step()`` precede the first point only. On a CPU the watch
(``timing.CpuWatch``) says whether another process disturbed a sample; a disturbed sample is set
aside and taken again once the machine is quiet, at most ``retakes`` times a point (if no quiet
moment comes within 2 s, what comes next is kept, marked disturbed). Every experiment, the
calibration and the scripts take their samples here; ``time_call`` below is this with a fixed
count.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from instruments.measure.timing import Clock, CpuWatch, synchronize

Step = Callable[[], Any]  # the timed call


@dataclass
class Point:
    """The samples one point kept (ms), and what the watch made of them."""

    samples_ms: list[float]
    set_aside_ms: list[float] = field(default_factory=list)  # disturbed, taken again
    set_aside_why: list[str] = field(default_factory=list)
    disturbed_kept: int = 0  # disturbed samples kept (the retakes ran out, or never quiet)
    retake_s: float = 0.0  # seconds spent on set-aside samples and waiting for quiet

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    def quiet(self) -> dict[str, Any]:
        """The watch's fields as a latency row carries them."""
        return {"set_aside_ms": list(self.set_aside_ms), "set_aside_why": list(self.set_aside_why),
                "disturbed_kept": self.disturbed_kept}


class Sampler:
    """Samples points on one device (see the module docstring)."""

    def __init__(self, device: Any = "cpu", *, repeats: int = 3, min_repeats: int = 2,
                 spread: float = 0.10, retakes: int = 3, warmup: int = 0,
                 watch: CpuWatch | None | str = "auto", clock: Clock = time.perf_counter,
                 should_stop: Callable[[], bool] | None = None,
                 on_set_aside: Callable[[float, str], None] | None = None) -> None:
        for name, value, lo in (("repeats", repeats, 1), ("min_repeats", min_repeats, 1),
                                ("retakes", retakes, 0), ("warmup", warmup, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
        self.device, self.repeats, self.spread = device, repeats, spread
        self.min_repeats, self.retakes, self.warmup = min(min_repeats, repeats), retakes, warmup
        self.watch = CpuWatch.for_device(device) if watch == "auto" else watch
        self._clock, self.should_stop, self.on_set_aside = clock, should_stop, on_set_aside
        self._warm = warmup == 0

    def take(self, step: Step, prepare: Callable[[], Any] | None = None,
             self_timed: bool = False) -> tuple[float, str | None]:
        """One sample: (ms, why the watch found it disturbed, or None)."""
        if prepare is not None:
            prepare()
        synchronize(self.device)
        watch = self.watch
        if watch is not None:
            watch.begin()
        start_s = self._clock()
        own = step()
        synchronize(self.device)
        whole_ms = (self._clock() - start_s) * 1e3
        why = watch.end(whole_ms) if watch is not None else None
        return (own if self_timed and isinstance(own, float) else whole_ms), why

    def point(self, step: Step, prepare: Callable[[], Any] | None = None, *,
              self_timed: bool = False, on_sample: Callable[[float], None] | None = None
              ) -> Point | None:
        """The samples of one point (see the module docstring); None when asked to stop."""
        if not self._warm:
            for _ in range(self.warmup):
                if prepare is not None:
                    prepare()
                step()
            synchronize(self.device)
            self._warm = True
        out = Point([])
        retakes = self.retakes
        while len(out.samples_ms) < self.repeats:
            if self.should_stop is not None and self.should_stop():
                return None
            ms, why = self.take(step, prepare, self_timed)
            if on_sample is not None:
                on_sample(ms)
            if why and self.watch is not None and len(out.set_aside_ms) < retakes:
                t0 = self._clock()
                out.set_aside_ms.append(ms)
                out.set_aside_why.append(why)
                if self.on_set_aside is not None:
                    self.on_set_aside(ms, why)
                if not self.watch.wait_quiet(ms):
                    retakes = len(out.set_aside_ms)  # never quiet in 2 s: keep what comes
                out.retake_s += ms / 1e3 + (self._clock() - t0)
                continue
            out.samples_ms.append(ms)
            out.disturbed_kept += why is not None
            s = out.samples_ms
            if len(s) >= self.min_repeats and max(s) - min(s) <= self.spread * statistics.median(s):
                break
        return out


@dataclass(frozen=True)
class Timing:
    """Raw samples of timed calls (ms) plus their summary; warm-up calls are not in `samples_ms`.

    ``set_aside_ms``: samples a `CpuWatch` found disturbed and that were taken again."""

    samples_ms: list[float]
    warmup: int
    repeats: int
    set_aside_ms: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.samples_ms:
            raise ValueError("a Timing needs at least one sample")

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)


def time_call(fn: Step, *, warmup: int, repeats: int, device: Any = "cpu",
              clock: Clock = time.perf_counter, watch: CpuWatch | None = None,
              retakes: int = 0) -> Timing:
    """``warmup`` untimed calls of ``fn``, then exactly ``repeats`` timed ones (a ``Sampler``
    that never stops early); with a ``watch``, up to ``retakes`` disturbed samples are set aside
    and taken again once it is quiet."""
    sampler = Sampler(device, repeats=repeats, min_repeats=repeats, spread=-1.0,
                      retakes=retakes, warmup=warmup, watch=watch, clock=clock)
    point = sampler.point(fn)
    assert point is not None  # no should_stop: it always finishes
    return Timing(point.samples_ms, warmup, repeats, point.set_aside_ms)
