"""The one Sampler: the timed samples of one point, the quiet watch and retakes.

``Sampler(device, repeats=3, min_repeats=2, spread=0.10, retakes=3)`` then
``sampler.point(step, prepare=None, predicted_ms=None, error=None) -> Point | None`` takes
samples of ``step`` until ``min_repeats`` of them agree within ``spread`` (max - min over the
median) or ``repeats`` are taken; None when ``should_stop`` asked to stop. Each sample is

    prepare()  (untimed: move a decoder to its context, empty a cache)
    sync -> watch.begin -> clock -> step() -> sync -> clock -> watch.end

and with ``self_timed=True`` a ``step()`` that times a part of itself returns that part's ms
(a float; anything else: the whole call counts). ``warmup`` untimed calls of ``prepare(); step()``
precede the first point only.

On a CPU the watch (``timing.CpuWatch``) flags a sample another process may have disturbed. A
flagged sample is judged by its effect: it is *out of line* when it lies outside the point's
other samples' range widened by ``spread`` of their median, or -- when the point has a prediction
-- off ``predicted_ms`` by more than the prediction's measured ``error`` (a share). An out-of-line
sample is set aside and taken again once the machine is quiet (at most ``retakes`` a point, and
only while the shared ``RetakeBudget`` allows; if no quiet moment comes within 2 s, what comes next
is kept); a flagged sample in line is kept and counted ``flagged_consistent``; one kept out of line
(no retake or budget left) is counted ``disturbed_kept``. A flagged sample with nothing to judge it
by (the first, without a prediction) waits for the next sample, or is retaken when no other
sample will come. A prediction also stands in for one sample: samples within ``error`` of it need
one agreeing sample fewer (``confirmed_by`` "prediction"; "samples" when two or more agreeing
samples ended the point; None when they never agreed). ``rounds`` instead interleaves several
steps' samples round by round, for ratios measured side by side. Every experiment, the
calibration and the scripts take their samples here; ``time_call`` below is this with a fixed
count.

A cheap point buys more samples: with ``point_ms`` > 0 a point keeps sampling, past ``repeats``
if need be, until its kept samples add up to ``point_ms`` or there are ``cheap_repeats`` of them
(a cached step of a few tens of ms: its median then stands on five samples, not two, for a
fraction of a second; a multi-second forward is unaffected). One disturbed sample of two moves a
median of two by half its excess; of five, not at all.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from instruments.measure.timing import Clock, CpuWatch, synchronize

Step = Callable[[], Any]  # the timed call
QUIET_WAIT_S = 2.0  # the longest wait for a quiet moment before a retake


class RetakeBudget:
    """Retakes and quiet-waits may use at most ``share`` of the seconds since the budget began
    (a sweep's start), counted as at least ``floor_s`` so that a disturbance of the first, cheap
    points can still be retaken (a sweep shorter than ``floor_s`` may spend ``share`` of
    ``floor_s``). ``on_spent`` is called once, the first time a retake is refused."""

    def __init__(self, share: float, clock: Clock = time.perf_counter,
                 on_spent: Callable[[float], None] | None = None, floor_s: float = 10.0) -> None:
        self.share, self._clock, self.on_spent, self.floor_s = share, clock, on_spent, floor_s
        self.start_s = clock()
        self.spent_s = 0.0
        self.refused = 0  # retakes the budget refused

    def left_s(self) -> float:
        return self.share * max(self._clock() - self.start_s, self.floor_s) - self.spent_s

    def allows(self, cost_s: float) -> bool:
        """Whether a retake whose set-aside sample took ``cost_s`` fits; counts a refusal."""
        if cost_s <= self.left_s():
            return True
        self.refused += 1
        if self.refused == 1 and self.on_spent is not None:
            self.on_spent(self.spent_s)
        return False


@dataclass
class Point:
    """The samples one point kept (ms), and what the watch made of them."""

    samples_ms: list[float]
    set_aside_ms: list[float] = field(default_factory=list)  # out of line, taken again
    set_aside_why: list[str] = field(default_factory=list)
    disturbed_kept: int = 0  # flagged, kept out of line (no retake or budget left, never quiet)
    flagged_consistent: int = 0  # flagged, kept: in line with the other samples / prediction
    retake_s: float = 0.0  # seconds spent on set-aside samples and waiting for quiet
    confirmed_by: str | None = None  # "samples" | "prediction" | None (never agreed)
    predicted_ms: float | None = None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    def quiet(self) -> dict[str, Any]:
        """The watch's fields as a latency row carries them."""
        out = {"set_aside_ms": list(self.set_aside_ms), "set_aside_why": list(self.set_aside_why),
               "disturbed_kept": self.disturbed_kept,
               "flagged_consistent": self.flagged_consistent, "retake_s": self.retake_s,
               "confirmed_by": self.confirmed_by}
        if self.predicted_ms is not None:
            out["predicted_ms"] = self.predicted_ms
        return out


class Sampler:
    """Samples points on one device (see the module docstring)."""

    def __init__(self, device: Any = "cpu", *, repeats: int = 3, min_repeats: int = 2,
                 spread: float = 0.10, retakes: int = 3, warmup: int = 0,
                 watch: CpuWatch | None | str = "auto", clock: Clock = time.perf_counter,
                 should_stop: Callable[[], bool] | None = None,
                 on_set_aside: Callable[[float, str], None] | None = None,
                 budget: RetakeBudget | None = None, point_ms: float = 0.0,
                 cheap_repeats: int = 5) -> None:
        for name, value, lo in (("repeats", repeats, 1), ("min_repeats", min_repeats, 1),
                                ("retakes", retakes, 0), ("warmup", warmup, 0),
                                ("cheap_repeats", cheap_repeats, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
        self.device, self.repeats, self.spread = device, repeats, spread
        self.min_repeats, self.retakes, self.warmup = min(min_repeats, repeats), retakes, warmup
        self.watch = CpuWatch.for_device(device) if watch == "auto" else watch
        self._clock, self.should_stop, self.on_set_aside = clock, should_stop, on_set_aside
        self.budget = budget
        if isinstance(point_ms, bool) or not isinstance(point_ms, int | float) or point_ms < 0:
            raise ValueError(f"point_ms must be a number of ms >= 0, got {point_ms!r}")
        self.point_ms, self.cheap_repeats = float(point_ms), cheap_repeats
        self._warm = warmup == 0

    def cheap(self, samples_ms: list[float]) -> bool:
        """Does a cheap point want another sample (module docstring)?"""
        return (self.point_ms > 0 and sum(samples_ms) < self.point_ms
                and len(samples_ms) < self.cheap_repeats)

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
              self_timed: bool = False, on_sample: Callable[[float], None] | None = None,
              predicted_ms: float | None = None, error: float | None = None) -> Point | None:
        """The samples of one point (see the module docstring); None when asked to stop."""
        if not self._warm:
            for _ in range(self.warmup):
                if prepare is not None:
                    prepare()
                step()
            synchronize(self.device)
            self._warm = True
        pred = predicted_ms if predicted_ms and error is not None and error >= 0 else None
        out = _Judged(Point([], predicted_ms=pred), self.spread, pred, error or 0.0)
        retakes = self.retakes
        while len(out.samples) < self.repeats or self.cheap(out.samples):
            if self.should_stop is not None and self.should_stop():
                return None
            ms, why = self.take(step, prepare, self_timed)
            if on_sample is not None:
                on_sample(ms)
            out.add(ms, why)
            retaken = False
            room = len(out.samples) < self.repeats or self.cheap(out.samples)
            while (i := out.out_of_line(room=room)) is not None:
                if retakes > 0 and self._retake_allowed(out.samples[i]):
                    retakes -= 1
                    if not self._set_aside(out, i):
                        retakes = 0  # never quiet in 2 s: keep what comes
                    retaken = True
                    break
                out.keep_disturbed(i)  # no retake or budget left: kept, counted
            if not retaken and out.done(self.min_repeats) and not self.cheap(out.samples):
                break
        out.finish()
        return out.point

    def rounds(self, steps: dict[str, tuple[Step, Callable[[], Any] | None]],
               rounds: int) -> dict[str, Point] | None:
        """``rounds`` samples of each named ``(step, prepare)``, interleaved: round r takes one
        sample of every step, their order rotated by r, so a host that drifts slows them alike
        and their ratios are measured side by side. No retakes (a retake would not be beside
        the others): a flagged sample is kept and counted ``disturbed_kept``. None when asked
        to stop."""
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
        names = list(steps)
        if not self._warm:
            for _ in range(self.warmup):
                for step, prepare in steps.values():
                    if prepare is not None:
                        prepare()
                    step()
            synchronize(self.device)
            self._warm = True
        out = {name: Point([], confirmed_by="rounds") for name in names}
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                if self.should_stop is not None and self.should_stop():
                    return None
                ms, why = self.take(*steps[name])
                out[name].samples_ms.append(ms)
                out[name].disturbed_kept += why is not None
        return out

    def _retake_allowed(self, ms: float) -> bool:
        return self.watch is not None and (self.budget is None or self.budget.allows(ms / 1e3))

    def _set_aside(self, out: _Judged, i: int) -> bool:
        """Set sample ``i`` aside and wait for a quiet moment; whether quiet came."""
        assert self.watch is not None
        ms, why = out.remove(i)
        if self.on_set_aside is not None:
            self.on_set_aside(ms, why or "")
        wait_s = QUIET_WAIT_S
        if self.budget is not None:  # the sample and the wait come out of the sweep's budget
            self.budget.spent_s += ms / 1e3
            wait_s = max(0.0, min(wait_s, self.budget.left_s()))
        t0 = self._clock()
        quiet = self.watch.wait_quiet(ms, max_s=wait_s)
        waited_s = self._clock() - t0
        if self.budget is not None:
            self.budget.spent_s += waited_s
        out.point.retake_s += ms / 1e3 + waited_s
        return quiet


class _Judged:
    """A point's samples while they are taken: which were flagged and how they were judged."""

    def __init__(self, point: Point, spread: float, pred: float | None, error: float) -> None:
        self.point, self.pred, self.error = point, pred, error
        self.spread = spread  # the stop rule's (time_call's -1: never agree early)
        self.margin = max(spread, 0.0)  # what "in line" allows beyond the others' range
        self.samples = point.samples_ms
        self.why: list[str | None] = []
        self.state: list[str] = []  # "quiet" | "pending" | "consistent" | "disturbed"

    def add(self, ms: float, why: str | None) -> None:
        self.samples.append(ms)
        self.why.append(why)
        self.state.append("quiet" if why is None else "pending")

    def remove(self, i: int) -> tuple[float, str | None]:
        ms, why = self.samples.pop(i), self.why.pop(i)
        self.state.pop(i)
        self.point.set_aside_ms.append(ms)
        self.point.set_aside_why.append(why or "")
        return ms, why

    def near_prediction(self, ms: float) -> bool:
        return self.pred is not None and abs(ms - self.pred) <= self.error * self.pred

    def in_line(self, i: int) -> bool | None:
        """Whether sample i agrees with the others and the prediction; None: nothing to judge
        it by."""
        others = [s for j, s in enumerate(self.samples) if j != i]
        x = self.samples[i]
        if others:
            margin = self.margin * statistics.median(others)
            if not min(others) - margin <= x <= max(others) + margin:
                return False
        if self.pred is not None:
            return self.near_prediction(x)
        return True if others else None

    def out_of_line(self, room: bool) -> int | None:
        """The newest flagged sample found out of line (to set aside), judging every pending
        one; a pending sample with no reference stays pending while another sample may come."""
        for i in reversed(range(len(self.samples))):
            if self.state[i] != "pending":
                continue
            verdict = self.in_line(i)
            if verdict is None and room:
                continue
            if verdict:
                self.state[i] = "consistent"
                continue
            return i
        return None

    def keep_disturbed(self, i: int) -> None:
        self.state[i] = "disturbed"

    def done(self, min_repeats: int) -> bool:
        """The samples agree within the spread and are enough (the prediction, when they all
        agree with it, counting as one more)."""
        s = self.samples
        if not s or "pending" in self.state or max(s) - min(s) > self.spread * statistics.median(s):
            return False
        if len(s) >= min_repeats:
            self.point.confirmed_by = "samples" if len(s) >= 2 else None
            return True
        if len(s) + 1 >= min_repeats and all(self.near_prediction(x) for x in s):
            self.point.confirmed_by = "prediction"
            return True
        return False

    def finish(self) -> None:
        """Counts, once the point is over (the repeats ran out, or it agreed)."""
        p = self.point
        p.flagged_consistent = self.state.count("consistent")
        p.disturbed_kept = self.state.count("disturbed") + self.state.count("pending")
        if p.confirmed_by is None and self.samples:
            s = self.samples
            if len(s) >= 2 and max(s) - min(s) <= self.spread * statistics.median(s):
                p.confirmed_by = "samples"
            elif all(self.near_prediction(x) for x in s):
                p.confirmed_by = "prediction"


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
