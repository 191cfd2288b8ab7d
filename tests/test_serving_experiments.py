"""The serving experiments on llama-tiny: each of the four runs and saves what the docs and the
page draw; every request's ids and times are kept, so a saved run can be checked again (its
tokens against the model's own loop); the metrics are the field's definitions (checked on a
stream whose times are known); static batching admits nothing while a batch runs; bad input is
refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from instruments.experiments import get
from instruments.experiments.serving import metrics
from instruments.experiments.serving.driver import Arrival, Served, drive
from instruments.spine import ModelSpec, load
from tests.test_serving import alone

pytestmark = pytest.mark.timeout(900)
_LOADED = {}


def tiny() -> object:
    if "m" not in _LOADED:
        _LOADED["m"] = load(ModelSpec("llama-tiny", "random", "cpu", "float32"))
    return _LOADED["m"]


def run(experiment: str, **kw: object) -> dict:
    loaded = tiny()
    exp = get("serving")
    p = exp.defaults("cpu", loaded.model.config)
    p.experiment, p.peers = experiment, False
    for k, v in kw.items():
        setattr(p, k, v)
    return exp.run(loaded, p)


def test_concurrency_keeps_every_request_and_checks_again() -> None:
    r = run("concurrency", concurrency=[1, 3], rounds=2)
    pts = r["tables"]["points"]
    assert [p["concurrency"] for p in pts] == [1, 3]
    assert all(p["requests"] == max(2 * p["concurrency"], 2) for p in pts)
    reqs = r["tables"]["requests"]
    assert {q["label"] for q in reqs} == {"C=1", "C=3"}
    model = tiny().model
    for q in reqs:
        assert q["arrival_s"] <= q["first_token_s"] <= q["finish_s"] == q["token_s"][-1]
        assert q["generated_ids"] == alone(model, q["prompt_ids"], len(q["generated_ids"]))[0]
    steps = [s for s in r["tables"]["steps"] if s["label"] == "C=3"]
    assert max(s["batch"] for s in steps) == 3 and all(s["blocks"] > 0 for s in steps)
    curve = [b for b in r["tables"]["batch_steps"] if b["label"] == "all"]
    assert curve and all(b["floor_ms"] == max(b["compute_ms"], b["weights_read_ms"]
                                               + b["kv_read_ms"]) for b in curve)
    assert r["meta"]["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # L * n_kv * hs, K and V
    assert r["meta"]["peaks"]["measured"]["read_gbps"] > 0


@pytest.mark.parametrize("experiment, labels", [
    ("load", {"single @ 50/s", "static @ 50/s", "continuous @ 50/s"}),
    ("schedule", {"fcfs", "lpm"})])
def test_load_and_schedule_serve_each_way(experiment: str, labels: set[str]) -> None:
    r = run(experiment, rates=[50.0], requests=10)
    assert {p["label"] for p in r["tables"]["points"]} == labels
    if experiment == "schedule":
        assert all(p["hit_rate"] > 0 for p in r["tables"]["points"])  # shared prefixes hit
        assert r["meta"]["budget_tokens"] < r["meta"]["working_set_tokens"]


def test_budget_spans_one_request_to_all_in_fp32_and_int8() -> None:
    r = run("budget", requests=10)
    pts = r["tables"]["points"]
    fp32 = [p for p in pts if p["kv_dtype"] == "float32"]
    int8 = [p for p in pts if p["kv_dtype"] == "int8"]
    assert len(fp32) == len(int8) >= 2
    assert fp32[0]["preemptions"] > 0 or fp32[0]["batch_max"] == 1  # the smallest is tight
    assert fp32[-1]["preemptions"] == 0
    for a, b in zip(fp32, int8, strict=True):  # the same bytes hold ~4x the tokens in int8
        assert b["pool_tokens"] >= 3 * a["pool_tokens"]
        assert b["batch_max"] >= a["batch_max"]


def test_metrics_are_the_fields_definitions() -> None:
    """Two requests with known times: TTFT = first - arrival, TPOT = (last - first) / (n - 1),
    ITL the gaps, goodput the requests within both SLOs per second."""
    def req(arrival: float, times: list[float]) -> dict:
        return {"arrival_s": arrival, "first_token_s": times[0], "finish_s": times[-1],
                "token_s": times, "generated_ids": [0] * len(times), "prompt_tokens": 4,
                "cached_tokens": 1}

    served = Served([req(0.0, [0.1, 0.2, 0.3]), req(0.5, [1.5, 1.6, 2.1])], [], 2.5)
    p = metrics.point(served, slo_ttft_ms=500, slo_tpot_ms=200)
    assert p["ttft_p50_ms"] == pytest.approx(550.0)  # (100 + 1000) / 2
    assert p["tpot_mean_ms"] == pytest.approx((100 + 300) / 2)
    assert p["itl_p50_ms"] == pytest.approx(100.0)  # gaps 100, 100, 100, 500
    assert p["output_tok_s"] == pytest.approx(6 / 2.5)
    assert p["goodput_requests_s"] == pytest.approx(1 / 2.5) and p["slo_met"] == 0.5
    assert p["hit_rate"] == pytest.approx(2 / 8) and p["ttft_p99_ms"] is None  # too few


def test_static_batches_admit_nothing_while_a_batch_runs() -> None:
    from instruments.experiments.serving.runs import engine_for

    loaded = tiny()
    p = get("serving").defaults("cpu", loaded.model.config)
    arrivals = [Arrival(0.001 * i, [5 + i] * (3 + i), 4 + i % 3) for i in range(9)]
    served = drive(engine_for(loaded.model, p, 4096), arrivals, "static", static_batch=4)
    running = [s["running"] for s in served.steps]
    starts = [i for i, s in enumerate(served.steps) if i == 0 or running[i - 1] == 0
              or s["running"] > running[i - 1]]
    assert all(running[i - 1] == 0 for i in starts[1:])  # a batch starts only when empty
    assert len(served.requests) == 9 and all(r["finish_s"] for r in served.requests)
    single = drive(engine_for(loaded.model, p, 4096), arrivals, "single")
    assert max(s["batch"] for s in single.steps) == 1


@pytest.mark.parametrize("argv, says", [
    (["--prompt", "9-2"], "longest prompt must be a whole number"),
    (["--concurrency", "0"], "outside 1..1024"),
    (["--rates", "0"], "above 0"),
    (["--budgets-tokens", "2"], "outside 16.."),
    (["--prompt", "x"], "MIN-MAX")])
def test_the_cli_refuses_bad_input_in_one_line(argv: list[str], says: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    from instruments import cli

    code = cli.main(["serving", "--model", "llama-tiny", "--no-peers", *argv,
                     "--results-dir", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and says in err and len(err.splitlines()) == 1, err
    assert not list(tmp_path.glob("*.json"))
