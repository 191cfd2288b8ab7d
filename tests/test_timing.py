"""The timing harness on a fake clock: exact samples, warm-up never counted, sync around regions."""

from __future__ import annotations

import time

import pytest

from instruments.measure import sampler, timing
from instruments.measure.sampler import time_call
from instruments.measure.timing import StepClock


class FakeClock:
    """A clock that only moves when the code under test calls `advance` (seconds)."""

    def __init__(self) -> None:
        self.now_s = 100.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def make_fn(clock: FakeClock, durations_s: list[float]):
    calls = []

    def fn():
        calls.append(len(calls))
        clock.advance(durations_s[len(calls) - 1])

    return fn, calls


def test_samples_are_exact_and_warmup_is_not_counted():
    clock = FakeClock()
    # Two slow warm-up calls (e.g. first-call compilation) then five timed ones.
    durations = [5.0, 3.0, 0.010, 0.030, 0.020, 0.050, 0.040]
    fn, calls = make_fn(clock, durations)
    result = time_call(fn, warmup=2, repeats=5, clock=clock)
    assert len(calls) == 7
    assert result.samples_ms == pytest.approx([10, 30, 20, 50, 40])
    assert result.median_ms == pytest.approx(30)
    assert (result.warmup, result.repeats) == (2, 5)
    assert clock.reads == 10  # two reads per timed call, none for warm-up


def test_even_number_of_samples_median_is_the_middle_mean():
    clock = FakeClock()
    fn, _ = make_fn(clock, [0.001, 0.002, 0.003, 0.010])
    result = time_call(fn, warmup=0, repeats=4, clock=clock)
    assert result.median_ms == pytest.approx(2.5)


def test_sync_brackets_every_timed_region(monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(sampler, "synchronize",
                        lambda device="cpu": events.append(f"sync:{device}"))

    def clock():
        events.append("clock")
        return 0.0

    time_call(lambda: events.append("fn"), warmup=1, repeats=2, device="cuda:0", clock=clock)
    region = ["sync:cuda:0", "clock", "fn", "sync:cuda:0", "clock"]
    # warm-up call, a sync so warm-up work can't spill into sample 1, then two timed regions.
    assert events == ["fn", "sync:cuda:0"] + region + region


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(warmup=-1, repeats=3), "warmup must be an integer >= 0"),
        (dict(warmup=0, repeats=0), "repeats must be an integer >= 1"),
        (dict(warmup=1.5, repeats=3), "warmup must be an integer >= 0"),
        (dict(warmup=True, repeats=3), "warmup must be an integer >= 0"),
    ],
)
def test_invalid_counts_are_rejected_with_what_is_allowed(kwargs, message):
    calls = []
    with pytest.raises(ValueError, match=message):
        time_call(lambda: calls.append(1), **kwargs)
    assert calls == []  # validation happens before anything runs


def test_real_clock_times_the_call_in_milliseconds():
    # A 5 ms sleep takes at least 5 ms: a sample in seconds (0.005), or a clock read that does
    # not bracket the call, comes out below; the generous ceiling only catches a wrong unit.
    result = time_call(lambda: time.sleep(0.005), warmup=1, repeats=3)
    assert len(result.samples_ms) == 3
    assert all(5.0 <= s < 1000.0 for s in result.samples_ms), result.samples_ms


def test_step_clock_times_each_call_and_skips_the_first():
    clock = FakeClock()
    steps = StepClock(clock=clock, skip=1)
    for seconds in (0.100, 0.004, 0.006):  # a slow prefill, then two decode steps
        steps.start()
        clock.advance(seconds)
        steps.stop()
    assert steps.samples_ms == pytest.approx([4, 6])  # the prefill was not a sample


def test_step_clock_syncs_at_both_ends(monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(timing, "synchronize", lambda device="cpu": events.append("sync"))
    steps = StepClock(device="cuda", clock=lambda: events.append("clock") or 0.0)
    steps.start()
    events.append("work")
    steps.stop()
    assert events == ["sync", "clock", "work", "sync", "clock"]


def test_step_clock_misuse():
    steps = StepClock(clock=FakeClock())
    with pytest.raises(RuntimeError, match="without start"):
        steps.stop()
    steps.start()
    with pytest.raises(RuntimeError, match="twice"):
        steps.start()


def test_synchronize_on_cpu_does_not_touch_cuda():
    import torch

    timing.synchronize("cpu")
    assert not torch.cuda.is_initialized()
