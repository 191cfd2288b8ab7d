"""The Serving page through Streamlit's AppTest on the test shapes: each of the four serving
experiments runs from it in the measuring process (no peers), is saved, and draws the batch and
the pool over time beside the curves, and its own figures; bad input gives the check's message
and starts nothing; saved runs of the chosen experiment are overlaid, each naming its host.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from instruments.store.results import collect_meta, load_runs, new_run, save_run
from ui.apptest import charts, no_traceback, open_page, wait_job

pytestmark = pytest.mark.timeout(300)
KEY = "serving_job"


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVLAB_TINY", "1")
    monkeypatch.setenv("KVLAB_RESULTS_DIR", str(tmp_path))
    return tmp_path


def _spec(chart) -> dict:  # noqa: ANN001 (an AppTest element)
    return json.loads(chart.proto.spec)


def _values(a: list | dict) -> list[float]:
    """A trace's values as the browser gets them (plotly sends arrays as typed base64)."""
    if isinstance(a, dict):
        return np.frombuffer(base64.b64decode(a["bdata"]), dtype=a["dtype"]).tolist()
    return list(a)


def _titles(at) -> list[str]:  # noqa: ANN001 (an AppTest)
    return [_spec(c)["layout"]["title"]["text"] for c in charts(at)]


# experiment -> (inputs set before Serve, the figures drawn once it ends, the points' labels)
CASES = {
    "concurrency": ({"serving_conc": "1, 3"}, ["Batch over time", "The block pool",
                                               "Throughput", "Time to first token",
                                               "The decode step"], ["C=1", "C=3"]),
    "load": ({"serving_rates": "100", "serving_requests": 4},
             ["Batch over time", "The block pool", "Throughput", "Time to first token"],
             ["single @ 100/s", "static @ 100/s", "continuous @ 100/s"]),
    "budget": ({"serving_budgets": "48, 480", "serving_requests": 4},
               ["Batch over time", "The block pool", "Throughput", "Time to first token",
                "Preemptions and the batch", "The running batch over time"],
               ["float32, 48 tokens' bytes", "float32, 480 tokens' bytes",
                "int8, 48 tokens' bytes", "int8, 480 tokens' bytes"]),
    "schedule": ({"serving_requests": 4}, ["Batch over time", "The block pool", "Throughput",
                                           "Time to first token", "Prefix hits"],
                 ["fcfs", "lpm"]),
}


@pytest.mark.parametrize("experiment", list(CASES))
def test_each_experiment_runs_draws_and_is_overlaid(results: Path, experiment: str) -> None:
    inputs, figures, labels = CASES[experiment]
    at = open_page("serving", {"model": "llama-tiny"})
    at.radio(key="serving_experiment").set_value(experiment).run()
    for key, value in inputs.items():
        widget = at.text_input(key=key) if isinstance(value, str) else at.number_input(key=key)
        widget.set_value(value)
    at.run()
    at.button(key="serving_go").click().run()
    no_traceback(at)
    job = wait_job(at, KEY, 240)
    assert job.state == "done", job.error
    assert [r["label"] for r in job.run["tables"]["points"]] == labels
    assert job.params["peers"] is False
    (run,) = load_runs(results).runs
    assert run["kind"] == "serving" and run["tables"]["steps"]
    host = run["meta"]["device_name"]
    titles = _titles(at)
    drawn = [t for t in titles if "Saved runs" not in t]
    assert len(drawn) == len(figures) and all(
        t.startswith(f) for t, f in zip(drawn, figures, strict=True)), drawn
    assert all(host in t for t in drawn)  # every figure names its host
    running = _spec(charts(at)[0])["data"][0]
    assert running["name"] == "running"  # every step of the run, not the few streamed live
    assert _values(running["y"]) == [s["running"] for s in run["tables"]["steps"]]
    assert len(titles) - len(drawn) == 2  # the saved run overlaid: tokens/s and TTFT
    assert any("Finished" in s.value and run["path"].rsplit("/", 1)[-1] in s.value
               for s in at.success)
    (table,) = [d.value for d in at.dataframe]
    assert {"output tok/s (measured)", "TTFT p50 (ms)", "TPOT p99 (ms)"} <= set(table.columns)


@pytest.mark.parametrize("experiment, key, value, says", [
    ("concurrency", "serving_conc", "1, x", "cannot read the concurrencies '1, x'"),
    ("concurrency", "serving_conc", "0, 4", "concurrency 0 is outside 1..1024"),
    ("load", "serving_rates", "0", "arrival rates must be above 0 requests/s"),
    ("load", "serving_ways", [], "allowed ways: single, static, continuous"),
    ("budget", "serving_budgets", "8", "KV budget (tokens) 8 is outside 16..1000000000"),
    ("budget", "serving_pmin", 30, "longest prompt must be a whole number >= 30, got 24"),
    ("schedule", "serving_omax", 255, "beyond the model's context of 256"),
])
def test_bad_input_says_what_is_allowed(results: Path, experiment: str, key: str,
                                        value: object, says: str) -> None:
    at = open_page("serving", {"model": "llama-tiny"})
    at.radio(key="serving_experiment").set_value(experiment).run()
    if isinstance(value, list):
        at.multiselect(key=key).set_value(value)
    elif isinstance(value, str):
        at.text_input(key=key).set_value(value)
    else:
        at.number_input(key=key).set_value(value)
    at.run()
    at.button(key="serving_go").click().run()
    no_traceback(at)
    assert any(says in e.value for e in at.error), [e.value for e in at.error]
    assert KEY not in at.session_state


def _saved(results: Path, device: str, rate_tok_s: float, day: int) -> None:
    meta = collect_meta(model="llama-tiny", device="cpu", device_name=device, dtype="float32",
                        experiment="serving", threads=2)
    rows = [dict(label=f"{way} @ {r:g}/s", way=way, rate_per_s=r, requests=4,
                 output_tok_s=rate_tok_s * r, ttft_p50_ms=10.0 * r, ttft_p99_ms=None)
            for r in (1.0, 4.0) for way in ("single", "continuous")]
    run = new_run("serving", meta, {"points": rows})
    run["created_utc"] = f"2026-01-0{day}T12:00:00+00:00"
    save_run(run, results)


def _overlay(at):  # noqa: ANN001, ANN202 (AppTest objects)
    (picker,) = [m for m in at.multiselect if m.label == "Runs to overlay"]
    return picker


def test_saved_runs_of_the_chosen_experiment_are_overlaid(results: Path) -> None:
    _saved(results, "Host A", 10.0, 1)
    _saved(results, "Host B", 20.0, 2)
    at = open_page("serving")
    assert not charts(at)  # the concurrency runs: none saved
    assert any("No saved concurrency" in c.value for c in at.caption)
    at.radio(key="serving_experiment").set_value("load").run()
    no_traceback(at)
    picked = _overlay(at).value
    assert [p.split(" · ")[0] for p in picked] == ["Host B", "Host A"]  # newest first
    tput, ttft = (_spec(c)["data"] for c in charts(at))
    assert [t["name"] for t in tput] == [f"{p} · {w}" for p in picked
                                         for w in ("single", "continuous")]
    assert _values(tput[0]["y"]) == [20.0, 80.0]  # Host B's single, at 1 and 4 requests/s
    assert _values(tput[2]["y"]) == [10.0, 40.0]  # then Host A's
    assert _values(ttft[0]["y"]) == [10.0, 40.0]
    _overlay(at).set_value(picked[1:]).run()
    assert len(_spec(charts(at)[0])["data"]) == 2
    _saved(results, "Host C", 30.0, 3)  # a run ends while the page is open: it is drawn
    at.run()
    assert [p.split(" · ")[0] for p in _overlay(at).value] == ["Host C", "Host B", "Host A"]


def test_guidellms_runs_are_drawn_beside_the_harness(results: Path) -> None:
    meta = collect_meta(model="llama-tiny", device="cpu", device_name="Host H", dtype="float32",
                        threads=2, server="kvlab")
    save_run(new_run("serving_http", meta, {"points": [
        dict(rate_per_s=r, output_tok_s=5.0 * r, ttft_p50_ms=3.0) for r in (1.0, 4.0)]}),
        results)
    _saved(results, "Host A", 10.0, 1)
    at = open_page("serving")
    at.radio(key="serving_experiment").set_value("load").run()
    no_traceback(at)
    assert any("Over HTTP" in s.value for s in at.subheader)
    tput = [_spec(c) for c in charts(at) if "guidellm" in _spec(c)["layout"]["title"]["text"]]
    names = [t["name"] for t in tput[0]["data"]]
    assert any(n.startswith("ours over HTTP · Host H") for n in names)
    assert any(n.startswith("our harness · Host A") for n in names)
