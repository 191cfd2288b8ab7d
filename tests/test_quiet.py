"""Disturbed samples: the CPU watch's verdicts, retakes in the harness and the sweep, the chart.

The watch runs on injected counters here (exact), and once on this machine against real
busy processes (it must see them). The sweep tests fake the watch's verdicts and would fail
if a disturbed sample entered a median while a retake was left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pandas as pd
import pytest

from engine.models.config import GPTConfig
from engine.models.gpt2.model import GPT
from instruments.experiments import get
from instruments.experiments.latency import LatencyParams
from instruments.measure import timing
from instruments.measure.sampler import time_call
from instruments.measure.timing import CpuWatch
from ui.figures import latency_figure

from .conftest import loaded_model


class Counters:
    """Fake CPU-time counters (ns) that the test moves by hand."""

    def __init__(self) -> None:
        self.usage = self.process = self.thread = 0

    def spend(self, own_ms: float, others_ms: float = 0.0, lost_ms: float = 0.0) -> float:
        """A region where this thread ran own_ms, others ran others_ms: its wall time (ms)."""
        self.thread += int(own_ms * 1e6)
        self.process += int(own_ms * 1e6)
        self.usage += int((own_ms + others_ms) * 1e6)
        return own_ms + lost_ms

    def watch(self, with_usage: bool = True, sleep=lambda s: None) -> CpuWatch:
        return CpuWatch((lambda: self.usage) if with_usage else None, 0.001,
                        lambda: self.process, lambda: self.thread, sleep=sleep)


def test_quiet_sample_passes_and_each_disturbance_is_named() -> None:
    c = Counters()
    w = c.watch()
    w.begin()
    assert w.end(c.spend(40.0, others_ms=2.0)) is None  # a little background: quiet
    w.begin()
    assert w.end(c.spend(40.0, lost_ms=12.0)) == "lost its core for 12.0 ms"
    w.begin()
    assert w.end(c.spend(40.0, others_ms=30.0)) == "other processes used 30.0 ms of CPU"
    w.begin()  # without a usage reader only preemption is seen
    blind = c.watch(with_usage=False)
    blind.begin()
    assert blind.end(c.spend(40.0, others_ms=30.0)) is None
    with pytest.raises(RuntimeError, match="without begin"):
        blind.end(1.0)


def test_wait_quiet_waits_for_a_quiet_window_and_gives_up() -> None:
    c = Counters()
    busy = [30.0, 30.0, 0.0]  # others' ms in each 20 ms window slept

    def sleep(s: float) -> None:
        c.spend(0.0, others_ms=busy.pop(0) if busy else 30.0)

    assert c.watch(sleep=sleep).wait_quiet(5.0, max_s=10.0)
    assert busy == []  # two busy windows waited out, then quiet
    now = [0.0]

    def tick() -> float:
        now[0] += 0.5
        return now[0]

    never = CpuWatch(lambda: c.usage, 0.001, lambda: c.process, lambda: c.thread,
                     sleep=sleep, clock=tick)
    assert not never.wait_quiet(5.0, max_s=2.0)


class FlagFirst:
    """A watch whose first ``n`` verdicts say disturbed."""

    def __init__(self, n: int) -> None:
        self.n, self.waits = n, 0

    def begin(self) -> None:
        pass

    def end(self, wall_ms: float) -> str | None:
        self.n -= 1
        return "other processes used 9.0 ms of CPU" if self.n >= 0 else None

    def wait_quiet(self, window_ms: float, max_s: float = 2.0) -> bool:
        self.waits += 1
        return True


def test_time_call_sets_disturbed_samples_aside_and_retakes_them() -> None:
    durations = iter([50.0, 10.0, 10.0, 10.0])
    now = [0.0]

    def fn() -> None:
        now[0] += next(durations) / 1e3

    watch = FlagFirst(1)
    t = time_call(fn, warmup=0, repeats=3, clock=lambda: now[0], watch=watch,  # type: ignore
                  retakes=2)
    assert t.samples_ms == pytest.approx([10.0, 10.0, 10.0])
    assert t.set_aside_ms == pytest.approx([50.0])
    assert watch.waits == 1


TINY = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=128, vocab_size=256)


@pytest.fixture(scope="module")
def tiny():
    return loaded_model(GPT.random(TINY, seed=3))


def _sweep(tiny, monkeypatch, flagged: int, retakes: int) -> list[dict]:
    watch = FlagFirst(flagged)
    monkeypatch.setattr(CpuWatch, "for_device", classmethod(lambda cls, device: watch))
    params = LatencyParams([8, 16], ["uncached", "concat"], repeats=1, warmup=0,
                           retakes=retakes, measure_peaks=False, point_ms=0.0)  # 1 sample
    return get("latency").run(tiny, params)


def test_sweep_retakes_a_disturbed_sample_and_keeps_it_beside_the_point(tiny,
                                                                        monkeypatch) -> None:
    run = _sweep(tiny, monkeypatch, flagged=1, retakes=3)
    rows = run["tables"]["latency"]
    first = rows[0]  # uncached at 8: its first sample was flagged
    assert len(first["set_aside_ms"]) == 1 and len(first["samples_ms"]) == 1
    assert first["set_aside_why"] == ["other processes used 9.0 ms of CPU"]
    assert first["disturbed_kept"] == 0
    assert all(not r["set_aside_ms"] for r in rows[1:])
    assert any("1 sample(s) set aside" in n for n in run["meta"]["notes"])


def test_sweep_keeps_and_counts_disturbed_samples_when_retakes_run_out(tiny,
                                                                       monkeypatch) -> None:
    run = _sweep(tiny, monkeypatch, flagged=3, retakes=1)
    first = run["tables"]["latency"][0]
    assert len(first["set_aside_ms"]) == 1 and first["disturbed_kept"] == 1
    assert any("disturbed and kept" in n for n in run["meta"]["notes"])
    quiet = _sweep(tiny, monkeypatch, flagged=0, retakes=3)
    assert not any("set aside" in n for n in quiet["meta"]["notes"])


def test_the_chart_draws_what_was_set_aside_with_its_reason() -> None:
    df = pd.DataFrame([
        {"mode": "concat", "context_len": 8, "latency_ms": 1.0, "samples_ms": [1.0],
         "set_aside_ms": [5.0], "set_aside_why": ["lost its core for 4.0 ms"]},
        {"mode": "concat", "context_len": 16, "latency_ms": 1.1, "samples_ms": [1.1],
         "set_aside_ms": [], "set_aside_why": []}])
    fig = latency_figure(df)
    aside = [t for t in fig.data if t.name.startswith("set aside")]
    assert len(aside) == 1 and list(aside[0].y) == [5.0]
    assert aside[0].customdata[0][1] == "lost its core for 4.0 ms"
    old = df.drop(columns=["set_aside_ms", "set_aside_why"])  # a run saved before retakes
    assert not [t for t in latency_figure(old).data if t.name.startswith("set aside")]


def _spin(ms: float) -> float:
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < ms:
        pass
    return (time.perf_counter() - start) * 1e3


def test_the_watch_sees_real_busy_processes_on_this_machine() -> None:
    watch = CpuWatch.for_device("cpu")
    assert watch is not None and CpuWatch.for_device("cuda:0") is None
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.3)
        watch.begin()
        why = watch.end(_spin(300.0))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    # one hog per core and this thread: it lost its core, or (with a usage counter) others ran
    assert why is not None, "the watch saw nothing while every core was busy"
    if timing._usage_reader()[0] is not None:
        assert "other processes" in why or "lost its core" in why


def test_a_generation_counts_its_disturbed_steps(tiny, monkeypatch) -> None:
    from instruments.experiments.end_to_end import EndToEndParams

    for flagged, want in ((10**6, 6), (0, 0)):  # every step disturbed, then none
        watch = FlagFirst(flagged)
        monkeypatch.setattr(CpuWatch, "for_device", classmethod(lambda cls, device, w=watch: w))
        run = get("end_to_end").run(tiny, EndToEndParams(["concat"], prompt_len=4,
                                                         new_tokens=6))
        (row,) = run["tables"]["end_to_end"]
        assert row["disturbed_steps"] == want
