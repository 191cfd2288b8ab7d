"""The Sampler judges a flagged sample by its effect, within a retake budget, and lets a prediction
stand in for a second sample -- on a fake clock and a fake watch, so every verdict is exact.

Each test fails when its rule is taken out: a flagged sample in line retaken anyway, an outlier
kept, the budget ignored, or the prediction not counted.
"""

from __future__ import annotations

from pytest import approx

from instruments.measure.sampler import RetakeBudget, Sampler

WHY = "other processes used 40.0 ms of CPU"


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class Watch:
    """Flags the samples whose index is in ``flagged``; a quiet moment after 0.1 s of waiting."""

    def __init__(self, clock: Clock, flagged: set[int]) -> None:
        self.clock, self.flagged = clock, flagged
        self.samples = self.waits = 0

    def begin(self) -> None:
        pass

    def end(self, wall_ms: float) -> str | None:
        self.samples += 1
        return WHY if self.samples - 1 in self.flagged else None

    def wait_quiet(self, window_ms: float, max_s: float = 2.0) -> bool:
        self.waits += 1
        self.clock.now_s += min(0.1, max_s)
        return True


def point(durations_ms: list[float], flagged: set[int] = frozenset(), *, repeats: int = 3,
          budget: RetakeBudget | None = None, clock: Clock | None = None, **kw):
    """One point of a step whose samples take ``durations_ms`` in turn."""
    clock = clock or Clock()
    times = iter(durations_ms)
    watch = Watch(clock, set(flagged))

    def step() -> None:
        clock.now_s += next(times) / 1e3

    cheap = {k: kw.pop(k) for k in ("point_ms", "cheap_repeats") if k in kw}
    sampler = Sampler("cpu", repeats=repeats, min_repeats=2, spread=0.10, retakes=3,
                      watch=watch, clock=clock, budget=budget, **cheap)  # type: ignore[arg-type]
    return sampler.point(step, **kw), watch


def test_a_flagged_sample_in_line_with_the_others_is_kept() -> None:
    got, watch = point([100.0, 102.0, 101.0, 101.0], flagged={0})
    assert got.samples_ms == approx([100.0, 102.0])  # the flagged first agreed with the second
    assert got.set_aside_ms == [] and watch.waits == 0
    assert (got.flagged_consistent, got.disturbed_kept) == (1, 0)
    assert got.confirmed_by == "samples"


def test_a_flagged_outlier_is_set_aside_and_taken_again() -> None:
    got, watch = point([100.0, 150.0, 101.0], flagged={1})
    assert got.samples_ms == approx([100.0, 101.0]) and got.set_aside_ms == approx([150.0])
    assert got.set_aside_why == [WHY] and watch.waits == 1
    assert got.retake_s == approx(0.150 + 0.1)  # the sample and the wait for quiet
    first, watch = point([150.0, 100.0, 101.0], flagged={0})  # judged once a reference came
    assert first.samples_ms == approx([100.0, 101.0])
    assert first.set_aside_ms == approx([150.0])
    assert first.flagged_consistent == 0


def test_the_budget_stops_retakes_and_says_so_once() -> None:
    clock, said = Clock(), []
    budget = RetakeBudget(0.15, clock=clock, on_spent=said.append, floor_s=0.0)
    clock.now_s += 0.1  # 0.1 s into the sweep: 15 ms of retakes allowed, the outlier took 150
    got, watch = point([100.0, 150.0, 101.0], flagged={1}, budget=budget, clock=clock)
    assert got.set_aside_ms == [] and watch.waits == 0
    assert got.samples_ms == approx([100.0, 150.0, 101.0]) and got.disturbed_kept == 1
    again, _ = point([100.0, 150.0, 101.0], flagged={1}, budget=budget, clock=clock)
    assert again.disturbed_kept == 1 and len(said) == 1 and budget.refused == 2
    clock.now_s += 100.0  # later in a long sweep the same outlier fits the budget
    later, _ = point([100.0, 150.0, 101.0], flagged={1}, budget=budget, clock=clock)
    assert later.set_aside_ms == approx([150.0]) and later.disturbed_kept == 0
    assert budget.spent_s == approx(0.150 + 0.1)


def test_a_first_sample_the_prediction_confirms_stands_alone() -> None:
    got, _ = point([100.0, 100.0, 100.0], predicted_ms=95.0, error=0.1)
    assert got.samples_ms == approx([100.0]) and got.confirmed_by == "prediction"
    assert got.predicted_ms == 95.0


def test_without_a_prediction_the_same_point_takes_two_samples() -> None:
    got, _ = point([100.0, 100.0, 100.0])
    assert got.samples_ms == approx([100.0, 100.0]) and got.confirmed_by == "samples"
    off, _ = point([100.0, 100.0, 100.0], predicted_ms=80.0, error=0.1)  # 25% off: not confirmed
    assert off.samples_ms == approx([100.0, 100.0]) and off.confirmed_by == "samples"


def test_a_flagged_sample_is_judged_against_the_prediction() -> None:
    kept, watch = point([100.0, 100.0], flagged={0}, predicted_ms=95.0, error=0.1)
    assert kept.samples_ms == approx([100.0])
    assert kept.flagged_consistent == 1 and watch.waits == 0
    off, watch = point([140.0, 100.0, 100.0], flagged={0}, predicted_ms=95.0, error=0.1)
    assert off.set_aside_ms == approx([140.0]) and off.samples_ms == approx([100.0])
    assert watch.waits == 1


def test_a_lone_flagged_sample_with_no_room_is_retaken_as_before() -> None:
    got, watch = point([150.0, 100.0], flagged={0}, repeats=1)
    assert got.samples_ms == approx([100.0]) and got.set_aside_ms == approx([150.0])
    assert watch.waits == 1


def test_a_cheap_point_takes_samples_until_they_add_up_to_point_ms() -> None:
    """Two agreeing 40 ms samples would end the point; with point_ms 250 it takes five (the cap),
    so one slow sample among them no longer moves the median."""
    steps = [40.0, 41.0, 60.0, 40.5, 40.2, 40.1, 40.3]
    plain, _ = point(steps)
    assert plain.samples_ms == approx([40.0, 41.0])
    got, _ = point(steps, point_ms=250.0, cheap_repeats=5)
    assert got.samples_ms == approx(steps[:5]) and got.median_ms == approx(40.5)
    assert got.confirmed_by == "samples"
    fewer, _ = point(steps, point_ms=120.0, cheap_repeats=5)  # 40 + 41 + 60 >= 120: three
    assert fewer.samples_ms == approx(steps[:3])
    slow, _ = point([300.0, 301.0, 302.0], point_ms=250.0, cheap_repeats=5)
    assert slow.samples_ms == approx([300.0, 301.0])  # an expensive point: unchanged


def test_rounds_interleave_the_steps_so_a_drift_falls_on_each_alike() -> None:
    """Three steps of equal cost on a host that slows by 1 ms every sample: interleaved, their
    medians stay within one round's drift of each other, and every round takes each step once
    (rotated); one step timed after another would put the whole drift between them."""
    clock, order = Clock(), []
    watch = Watch(clock, {4})
    slow = iter(range(1000))

    def step(name: str):
        def run() -> None:
            order.append(name)
            clock.now_s += (10.0 + next(slow)) / 1e3
        return run

    sampler = Sampler("cpu", watch=watch, clock=clock)  # type: ignore[arg-type]
    got = sampler.rounds({n: (step(n), None) for n in "abc"}, 5)
    assert order == list("abc" "bca" "cab" "abc" "bca")
    medians = [got[n].median_ms for n in "abc"]
    assert max(medians) - min(medians) <= 3.0  # sequential points: 5 ms apart each
    assert [got[n].disturbed_kept for n in "abc"] == [0, 0, 1]  # the 5th sample: c's second
    assert all(len(got[n].samples_ms) == 5 and got[n].confirmed_by == "rounds" for n in "abc")
