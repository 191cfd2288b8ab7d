"""The measuring process and its client: requests, streams, Stop, faults, model switches.

The ``Worker`` is driven in this process for the cases a real process cannot be made to hit on
demand (out of memory); everything else runs through ``instruments.process.client`` against a real
``python -m instruments.process.worker`` subprocess, as the dashboard does.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from instruments import experiments
from instruments.experiments import Experiment, to_dict
from instruments.experiments.latency import LatencyParams
from instruments.process import client, protocol
from instruments.process.worker import Channel, Worker, classify, same_random
from instruments.spine import ModelSpec
from instruments.store.results import load_runs

from .held import frozen_at, until

pytestmark = pytest.mark.timeout(240)
TINY = ModelSpec("tiny")


def small_sweep(**kw: object) -> dict:
    base = dict(contexts=[4, 8, 16], modes=["uncached", "concat"], repeats=1, warmup=0,
                measure_peaks=False)
    return to_dict(LatencyParams(**{**base, **kw}))


def wait(job: client.Job, timeout_s: float = 120.0) -> client.Job:
    end = time.monotonic() + timeout_s
    while not job.finished and time.monotonic() < end:
        time.sleep(0.05)
    assert job.finished, f"job still {job.state}: {job.message}"
    return job


# ------------------------------------------------------------------------- in this process
def _worker() -> tuple[Worker, io.StringIO]:
    out = io.StringIO()
    return Worker("cpu", Channel(out)), out


def _messages(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def _oom(loaded, params, progress, should_stop):  # an experiment that runs out of memory
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")


def test_out_of_memory_is_reported_and_the_next_request_works(monkeypatch) -> None:
    import sys
    import types

    fake = types.ModuleType("instruments.experiments.fake_oom")
    fake.run = _oom
    fake.Params = LatencyParams
    monkeypatch.setitem(sys.modules, "instruments.experiments.fake_oom", fake)
    monkeypatch.setitem(experiments.EXPERIMENTS, "fake_oom", Experiment(
        "fake_oom", "latency_sweep", "oom"))
    worker, out = _worker()
    worker.handle({"type": "run", "id": "a", "experiment": "fake_oom", "model": TINY.to_dict(),
                   "params": small_sweep()})
    error = _messages(out)[-1]
    assert error["type"] == "error" and error["category"] == "oom"
    assert "Out of memory" in error["message"] and "smaller batch" in error["message"]
    worker.handle({"type": "run", "id": "b", "experiment": "latency", "model": TINY.to_dict(),
                   "params": small_sweep()})
    result = _messages(out)[-1]
    assert result["type"] == "result" and len(result["run"]["tables"]["latency"]) == 6


def test_random_after_auto_that_fell_back_is_not_loaded_again(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network: "auto" falls back to random
    monkeypatch.setenv("HF_HUB_CACHE", "/nonexistent-hf-cache")
    worker, out = _worker()
    auto, random = ModelSpec("gpt2", weights="auto"), ModelSpec("gpt2", weights="random")
    held = worker.ensure(auto)
    assert held.info["weights_fallback"] and held.info["weights_label"] == "random (seed 0)"
    again = worker.ensure(random)
    assert again.model is held.model and again.spec == random  # the same weights, kept
    assert again.info["weights_fallback"] is None and again.info["weights_label"] == \
        "random (seed 0)"
    assert not same_random(held, ModelSpec("gpt2", weights="random", seed=1))
    assert not same_random(held, ModelSpec("gpt2", weights="random", dtype="bfloat16"))
    assert not same_random(again, auto)  # "auto" may find pretrained weights: load it


def test_bad_requests_say_what_is_allowed() -> None:
    worker, out = _worker()
    worker.handle({"type": "run", "id": "a", "experiment": "warp", "model": TINY.to_dict()})
    worker.handle({"type": "run", "id": "b", "experiment": "latency", "model": TINY.to_dict(),
                   "params": small_sweep(contexts=[4, 999])})
    worker.handle({"type": "run", "id": "c", "experiment": "latency", "model": TINY.to_dict(),
                   "params": {"contexts": [4], "modes": ["concat"], "bogus": 1}})
    worker.handle({"type": "load", "id": "d",
                   "model": ModelSpec("tiny", device="cuda").to_dict()})
    errors = [m for m in _messages(out) if m["type"] == "error"]
    assert [e["category"] for e in errors] == ["input"] * 4
    text = [e["message"] for e in errors]
    assert "unknown experiment 'warp'" in text[0] and "allowed" in text[0]
    assert "outside 1..128" in text[1] and "unknown parameter 'bogus'" in text[2]
    assert "holds cpu" in text[3]  # one process per device: never another device's model


def test_a_stop_that_arrives_first_still_stops_its_request() -> None:
    worker, out = _worker()
    worker.read(io.StringIO(protocol.encode({"type": "stop", "id": "x"})))
    worker.handle({"type": "run", "id": "x", "experiment": "latency", "model": TINY.to_dict(),
                   "params": small_sweep(contexts=list(range(4, 64, 4)))})
    run = _messages(out)[-1]["run"]
    assert run["meta"]["partial"] and len(run["tables"]["latency"]) < 30


def test_crashes_and_input_errors_are_told_apart() -> None:
    assert classify(ValueError("context 0 is outside 1..128"))[0] == "input"
    assert classify(RuntimeError("DefaultCPUAllocator: can't allocate memory: 9 GB"))[0] == "oom"
    category, message = classify(ZeroDivisionError("division by zero"))
    assert category == "crash" and message == "ZeroDivisionError: division by zero"


def test_protocol_round_trip_and_junk() -> None:
    line = protocol.encode({"type": "event", "row": {"x": float("nan"), "t": torch.tensor(3)}})
    assert protocol.decode(line) == {"type": "event", "row": {"x": None, "t": 3}}
    assert protocol.decode("Warning: something printed\n") is None
    assert protocol.decode("[1, 2]") is None


# ------------------------------------------------------------------------- a real process
def test_a_sweep_streams_rows_and_is_saved(tmp_path: Path) -> None:
    job = wait(client.submit("latency", small_sweep(), TINY, results_dir=tmp_path))
    assert job.state == "done", job.error
    assert job.info["weights_label"].startswith("random") and job.pid != os.getpid()
    assert len(job.tables["latency"]) == 6 == len(job.run["tables"]["latency"])
    (saved,) = load_runs(tmp_path).runs
    assert saved["run_id"] == job.run["run_id"] and saved["meta"]["partial"] is False


def test_stop_ends_it_after_the_current_step(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop is asked while the process is frozen after its second row, so the request is in its
    input before it can measure on: the sweep ends before its first mode's 63 contexts, however
    fast this host measures them (it had 61 left)."""
    contexts = list(range(2, 128, 2))
    with frozen_at(2, monkeypatch) as held:
        job = client.submit("latency", small_sweep(contexts=contexts, repeats=3), TINY,
                            results_dir=tmp_path)
        until(lambda: bool(held.pids) or job.finished, "the second row")
        assert not job.finished, job.state
        job.request_stop()
        until(lambda: "stop" in held.sent, "the stop sent")
    wait(job)
    assert job.state == "stopped" and job.run["meta"]["partial"]
    (saved,) = load_runs(tmp_path).runs
    assert len(saved["tables"]["latency"]) == len(job.tables["latency"]) >= 2
    assert len(job.tables["latency"]) < len(contexts)  # not even the first mode measured out


def test_a_killed_process_keeps_its_rows_and_the_next_run_starts_afresh(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with frozen_at(3, monkeypatch) as held:  # killed mid-sweep, however fast the host
        job = client.submit("latency", small_sweep(contexts=list(range(2, 128, 2)), repeats=3),
                            TINY, results_dir=tmp_path)
        until(lambda: bool(held.pids) or job.finished, "the third row")
        assert not job.finished, job.state
        os.kill(job.pid, signal.SIGKILL)
    wait(job)
    assert job.state == "failed" and "SIGKILL" in job.error and "kept" in job.error
    (saved,) = load_runs(tmp_path).runs
    assert saved["meta"]["partial"] and len(saved["tables"]["latency"]) >= 3
    assert saved["meta"]["contexts"] == list(range(2, 128, 2))  # the meta sent at the start
    again = wait(client.submit("latency", small_sweep(), TINY))
    assert again.state == "done" and again.pid != job.pid and again.saved_path is None


def test_prestart_starts_one_process_ahead_and_the_next_job_uses_it() -> None:
    running = client.running_pid("cpu")
    if running is not None:  # an earlier test's process: end it, so one has to be started
        os.kill(running, signal.SIGKILL)
        end = time.monotonic() + 10
        while client.running_pid("cpu") is not None and time.monotonic() < end:
            time.sleep(0.05)
    client.prestart("cpu")
    client.prestart("cpu")  # a second call while the first is on its way starts nothing
    end = time.monotonic() + 120
    while client.running_pid("cpu") is None and time.monotonic() < end:
        time.sleep(0.05)
    pid = client.running_pid("cpu")
    assert pid is not None and pid != running
    client.prestart("cpu")  # alive: nothing to do
    job = wait(client.submit("load", {}, TINY))
    assert job.state == "done" and job.pid == pid


def test_a_process_that_ends_with_an_empty_log_leaves_no_file() -> None:
    proc = client.MeasuringProcess("cpu")
    log = Path(proc.log_path)
    assert log.exists()
    proc.send({"type": "exit"})
    end = time.monotonic() + 30
    while log.exists() and time.monotonic() < end:
        time.sleep(0.05)
    assert not proc.alive() and not log.exists()


def test_a_prestart_that_fails_is_not_tried_again(monkeypatch) -> None:
    from instruments.process import processes

    tries = []

    def fails(device: str) -> None:
        tries.append(device)
        raise RuntimeError("the measuring process for cuda could not start")

    monkeypatch.setattr(processes, "process", fails)
    monkeypatch.setattr(processes, "_PRESTART_FAILED", set())
    for _ in range(3):  # as every page run calls it
        processes.prestart("cuda")
        end = time.monotonic() + 5
        while "cuda" in processes._PRESTARTING and time.monotonic() < end:
            time.sleep(0.01)
    assert tries == ["cuda"]


def test_a_model_switch_reaches_the_process() -> None:
    small = ModelSpec("tiny", seed=1)
    a = wait(client.submit("latency", small_sweep(contexts=[4]), small))
    b = wait(client.submit("load", {}, ModelSpec("tiny", seed=2)))
    assert a.pid == b.pid  # one process per device, holding one model at a time
    assert a.info["weights_label"] == "random (seed 1, test shape)"
    assert b.info["weights_label"] == "random (seed 2, test shape)"
    assert client.model_info(ModelSpec("tiny", seed=2)) == b.info  # known: no new request


def test_the_queue_runs_one_measurement_per_device_in_order() -> None:
    """The process is frozen while the jobs are queued: the first cannot end before the others
    are seen waiting behind it, however fast this host runs it."""
    pid = client.process("cpu").pid
    os.kill(pid, signal.SIGSTOP)
    try:
        first = client.submit("latency", small_sweep(contexts=list(range(2, 64, 2))), TINY)
        second = client.submit("latency", small_sweep(contexts=[4]), TINY)
        third = client.submit("latency", small_sweep(), TINY)
        until(lambda: "position 2" in third.message and "position 1" in second.message,
              "the second and third queued")
        assert first.state == "running" and first.pid == pid
        assert second.state == "queued" == third.state
        assert client.model_info(ModelSpec("tiny", seed=9)) is None  # never queued behind a run
        third.request_stop()  # leaves the queue without running
    finally:
        os.kill(pid, signal.SIGCONT)
    wait(first)
    wait(second)
    wait(third)
    assert first.state == "done" == second.state
    assert second.started_s >= first.ended_s - 0.01
    assert third.state == "stopped" and third.run is None and third.pid is None


def _rss() -> int:
    import ctypes
    import gc

    import psutil

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss


@pytest.mark.slow
def test_a_model_switch_returns_the_memory_of_the_last_one() -> None:
    """gpt2's weights and the fast mode's packed copies (up to ~1 GB) go with the model."""
    worker, out = _worker()
    base = _rss()
    gpt2 = ModelSpec("gpt2", "random")
    worker.handle({"type": "run", "id": "a", "experiment": "latency", "model": gpt2.to_dict(),
                   "params": small_sweep(contexts=[4], modes=["uncached", "fast"])})
    assert _messages(out)[-1]["type"] == "result"
    held = _rss() - base
    # 475 MiB of weights + mode 8's packed copies of the roles it did not give to the C++
    # kernel (how many depends on what it timed faster on this host: 0 to 475 MiB more), so
    # only the weights are counted on: most of their 124,439,808 float32s
    assert held > 0.8 * 124_439_808 * 4
    worker.handle({"type": "load", "id": "b", "model": TINY.to_dict()})
    assert _rss() - base < 0.1 * held  # back to the baseline, give or take
