"""The dashboard through Streamlit's AppTest: every page renders, a tiny sweep runs in the
measuring process, is saved, can be stopped, survives the process being killed, and reappears
on the Results page; bad input gives a message, not a traceback.

Runs on the "tiny" preset (KVLAB_TINY=1) with results written to a temporary folder
(KVLAB_RESULTS_DIR), so it takes seconds on a CPU.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from instruments.store.results import collect_meta, load_runs, new_run, save_run
from ui.apptest import APP, charts, configure_sweep, no_traceback, open_page, wait_job

from .held import frozen_at, until

PAGES = ["overview", "generate", "sweep", "flops", "floor", "memory", "planner", "prefix",
         "serving", "correctness", "results"]
pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVLAB_TINY", "1")
    monkeypatch.setenv("KVLAB_RESULTS_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders(results: Path, page: str) -> None:
    at = open_page(page)
    assert at.title[0].value
    assert at.session_state["choice"].model == "tiny"


def test_the_overview_guides_to_every_page() -> None:
    """Each page the router offers has its line on the Overview (the Peers page once had none)."""
    import re

    root = Path(APP).parent
    routed = set(re.findall(r'st\.Page\("(views/\w+\.py)"', (root / "app.py").read_text()))
    guided = set(re.findall(r'\("(views/\w+\.py)", "', (root / "views/overview.py").read_text()))
    assert routed - {"views/overview.py"} == guided


def test_tiny_sweep_draws_and_saves(results: Path) -> None:
    at = open_page("sweep")
    configure_sweep(at, "4, 8, 16", e2e=True)
    at.button[0].click().run()
    job = wait_job(at, "sweep_job")
    assert job.state == "done", job.error
    # the defaults on a CPU: the write-up's pair and our fastest exact step
    assert {r["mode"] for r in job.tables["latency"]} == {"uncached", "concat", "fast"}
    assert len(charts(at)) == 2  # latency + end to end
    assert any("Finished" in s.value for s in at.success)
    runs = load_runs(results).runs
    assert len(runs) == 1 and runs[0]["kind"] == "latency_sweep"
    assert runs[0]["meta"]["partial"] is False
    saved = f"Saved to `$KVLAB_RESULTS_DIR/{Path(runs[0]['path']).name}`"  # no absolute path
    assert any(saved in s.value for s in at.success), [s.value for s in at.success]
    assert len(runs[0]["tables"]["latency"]) == 9 and runs[0]["tables"]["cumulative"]
    # The field's terms: percentiles per point, TTFT / TPOT and pp / tg per generation.
    frames = [d.value for d in at.dataframe]
    assert any({"p50_ms", "p90_ms", "p99_ms", "samples_n"} <= set(f.columns) for f in frames)
    assert any({"ttft_ms", "tpot_ms", "tpot_p90_ms", "output_tokens_per_s",
                "decode_tokens_per_s"} <= set(f.columns) for f in frames)
    assert any("In llama-bench's terms" in c.value and "tg5" in c.value for c in at.caption)
    # A chart option only redraws: no new job, no new file.
    at.toggle(key="sweep_logy").set_value(True).run()
    assert at.session_state["sweep_job"] is job and len(list(results.glob("*.json"))) == 1
    # The FLOPs page works from this session's sweep.
    at.switch_page("views/flops.py").run()
    no_traceback(at)
    assert at.selectbox(key="flops_source").value.startswith("this session")
    assert len(charts(at)) >= 2


def test_stop_keeps_a_partial_run(results: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop is pressed while the measuring process is held after its second row: the sweep
    cannot end first, however fast this host runs it."""
    at = open_page("sweep")
    configure_sweep(at, "2-128:2", repeats=3)
    with frozen_at(2, monkeypatch) as held:
        at.button[0].click().run()
        job = at.session_state["sweep_job"]
        until(lambda: bool(held.pids) or job.finished, "the second row")
        at.run()
        at.button(key="sweep_job_stop").click().run()
        until(lambda: "stop" in held.sent, "the stop sent")
    job = wait_job(at, "sweep_job")
    assert job.state == "stopped"
    rows = job.tables["latency"]
    assert 0 < len(rows) < job.total
    saved = load_runs(results).runs
    assert len(saved) == 1 and saved[0]["meta"]["partial"] is True
    assert len(saved[0]["tables"]["latency"]) == len(rows)
    assert any("Stopped" in w.value for w in at.warning)


def test_a_killed_measuring_process_keeps_what_it_measured(
        results: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page("sweep")
    configure_sweep(at, "2-128:2", repeats=3)
    with frozen_at(2, monkeypatch) as held:  # killed mid-sweep, however fast the host
        at.button[0].click().run()
        job = at.session_state["sweep_job"]
        until(lambda: bool(held.pids) or job.finished, "the second row")
        assert not job.finished, job.state
        os.kill(job.pid, signal.SIGKILL)  # a crash, the OOM killer, a kill -9
    job = wait_job(at, "sweep_job")
    assert job.state == "failed" and "measuring process died" in job.error
    assert any("measuring process died" in e.value for e in at.error)
    (saved,) = load_runs(results).runs
    assert saved["meta"]["partial"] is True and len(saved["tables"]["latency"]) >= 2
    assert saved["meta"]["model"] == "tiny" and "died" in saved["meta"]["note"]
    # The next run starts a fresh process and completes.
    configure_sweep(at, "4, 8", repeats=1)
    at.button[0].click().run()
    again = wait_job(at, "sweep_job")
    assert again.state == "done" and again.pid != job.pid


@pytest.mark.parametrize("text, says", [("abc", "cannot read"), ("0, 5", "outside 1..128"),
                                        ("4, 500", "outside 1..128"), (" , ", "no context")])
def test_sweep_rejects_bad_contexts(results: Path, text: str, says: str) -> None:
    at = open_page("sweep")
    configure_sweep(at, text)
    at.button[0].click().run()
    no_traceback(at)
    assert any(says in e.value for e in at.error), [e.value for e in at.error]
    assert "sweep_job" not in at.session_state


def test_generate_shows_identical_verdict(results: Path) -> None:
    at = open_page("generate")
    at.number_input(key="gen_new").set_value(8)
    at.button[0].click().run()
    job = wait_job(at, "gen_job")
    assert job.state == "done", job.error
    assert len(job.tables["tokens"]) == 16  # streamed token by token, both sides
    assert any(s.value.startswith("Identical: all 8 tokens") for s in at.success)
    assert len(charts(at)) == 1
    at.text_area(key="gen_prompt").set_value("").run()
    at.button[0].click().run()
    no_traceback(at)
    assert any("empty" in e.value for e in at.error)


def test_results_lists_runs_and_reports_corrupt_file(results: Path) -> None:
    rows = [{"mode": m, "context_len": t, "latency_ms": 1.0 + t / 100}
            for m in ("uncached", "concat") for t in (8, 64)]
    meta = collect_meta(model="gpt2", device="cpu", device_name="Test CPU", dtype="float32",
                        batch_size=1)
    save_run(new_run("latency_sweep", meta, {"latency": rows}), results)
    (results / "broken.json").write_text('{"schema_version": 1, "run_id": ')
    (results / "future.json").write_text(json.dumps({
        "schema_version": 99, "run_id": "x", "kind": "latency_sweep",
        "created_utc": "2026-01-01T00:00:00+00:00", "meta": {}, "tables": {}}))
    at = open_page("results")
    listed = at.dataframe[0].value  # newest first: the run above, then the 4 shipped examples
    assert list(listed["device"]) == ["Test CPU"] + ["AMD EPYC"] * 4
    assert listed["modes"][0] == "uncached, concat"
    skipped = at.dataframe[-1].value
    assert sorted(skipped["file"]) == ["broken.json", "future.json"]
    reasons = " ".join(skipped["reason"])
    assert "truncated" in reasons and "newer" in reasons
    chart = charts(at)[0]
    assert len(chart.proto.spec) > 0
    # The reference can be switched off; the chart then holds the saved run only.
    at.toggle(key="results_ref").set_value(False).run()
    no_traceback(at)
    assert len(charts(at)) == 1


def test_results_compares_two_runs_and_exports_one(results: Path) -> None:
    from tests.test_exports import BASE, slowed, sweep_run

    old = sweep_run(BASE)
    save_run(old, results)
    save_run(slowed(old, "concat", 2.0), results)
    at = open_page("results")
    assert any("2 point(s) regressed beyond their noise" in e.value for e in at.error), \
        [e.value for e in at.error]
    assert len(charts(at)) == 2  # the overlay and the comparison
    compared = next(d.value for d in at.dataframe if "verdict" in d.value.columns)
    verdicts = dict(zip(compared["point"], compared["verdict"], strict=True))
    assert verdicts["concat @ 8"] == verdicts["concat @ 16"] == "regression"
    assert verdicts["uncached @ 8"] == "within noise"
    labels = {b.proto.label for b in at.get("download_button")}
    assert {"CSV", "JSON Lines", "Markdown"} <= labels
    # The other way round, the same points improved.
    new_label = at.selectbox(key="compare_new_latency_sweep").value
    old_label = at.selectbox(key="compare_old_latency_sweep").value
    at.selectbox(key="compare_old_latency_sweep").set_value(new_label)
    at.selectbox(key="compare_new_latency_sweep").set_value(old_label).run()
    no_traceback(at)
    assert any("2 point(s) improved" in s.value for s in at.success)


def test_correctness_lab_catches_each_bug(results: Path) -> None:
    at = open_page("correctness")
    at.number_input(key="correct_new").set_value(12)
    at.button[0].click().run()
    job = wait_job(at, "correct_job")
    assert job.state == "done", job.error
    failed = {(r["bug"], r["check"].split(" ")[0]) for r in job.tables["checks"]
              if r["passed"] is False}
    assert ("no bug", "logits") not in failed and not any(b == "no bug" for b, _ in failed)
    assert ("cache_order", "multi-token") in failed and ("cache_order", "cached") not in failed
    assert ("positions", "cached") in failed and ("mask_offset", "cached") in failed
    assert len(charts(at)) == 1


def test_memory_measurement_runs_and_saves(results: Path) -> None:
    at = open_page("memory")
    at.text_input(key="mem_points").set_value("8, 64, 128")
    at.button[0].click().run()
    job = wait_job(at, "memory_job")
    assert job.state == "done", job.error
    assert {r["baseline"] for r in job.tables["kv_memory"]} == {"after warm-up",
                                                                 "before warm-up"}
    assert len(charts(at)) == 4
    at.radio(key="mem_baseline").set_value("before warm-up").run()
    no_traceback(at)
    assert [r["kind"] for r in load_runs(results).runs] == ["memory"]


def test_planner_allocates_what_its_formula_says_and_saves(results: Path) -> None:
    at = open_page("planner")
    assert len(charts(at)) == 3  # by formula before any run: layouts, waste, storage
    at.number_input(key="plan_cap").set_value(8)
    at.button[0].click().run()
    job = wait_job(at, "planner_job")
    assert job.state == "done", job.error
    fit = job.run["tables"]["fit"]
    assert fit and all(r["tensor_bytes"] == r["formula_bytes"] for r in fit)
    assert all(r["capped"] and r["formula_bytes"] <= 8 * 2**20 for r in fit)
    assert {r["storage"] for r in job.run["tables"]["storages"]} >= {"float32", "int8"}
    assert len(charts(at)) == 4  # + the what-if bars, now that the budget is known
    assert [r["kind"] for r in load_runs(results).runs] == ["kv_planner"]
    at.button[1].click().run()  # the paged and int8 modes timed beside mode 5
    steps = wait_job(at, "planner_steps_job")
    assert steps.state == "done", steps.error
    assert {r["mode"] for r in steps.run["tables"]["latency"]} == {"prealloc_fused", "paged",
                                                                   "int8_kv"}
    assert any("against mode 5: mode 10" in c.value for c in at.caption)


def test_bug_switch_never_touches_the_shared_model() -> None:
    import torch

    from instruments.checks.bugs import inject_bug, private_view
    from tests.conftest import small_model

    shared = small_model()
    idx = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))

    def step_logits(model: object) -> torch.Tensor:  # a decode step after a cached prefill
        with torch.no_grad():
            _, cache = model(idx[:, :8])
            return model(idx[:, 8:], cache)[0]

    before = step_logits(shared)
    view = private_view(shared)
    for bug in ("cache_order", "positions", "mask_offset"):
        with inject_bug(view, bug):
            assert not torch.allclose(step_logits(view), before)  # the bug is on in the view
            assert torch.equal(step_logits(shared), before)  # and nowhere else
    assert torch.equal(step_logits(view), before)  # off again after the block
    assert view.lm_head.weight is shared.lm_head.weight  # no copy of the weights


def test_closed_tab_stops_a_job(monkeypatch: pytest.MonkeyPatch) -> None:
    from instruments.process import client
    from instruments.spine import ModelSpec

    job = client.Job("latency", {}, ModelSpec("tiny"), keep_alive=lambda: False)
    monkeypatch.setattr(client, "ORPHAN_GRACE_S", 0.0)
    assert not job.should_stop()  # first sighting starts the grace period
    time.sleep(0.01)
    assert job.should_stop() and "went away" in job.message


def test_generate_compares_any_two_modes(results: Path) -> None:
    at = open_page("generate")
    at.number_input(key="gen_new").set_value(6)
    at.selectbox(key="gen_left").set_value("fast")
    at.selectbox(key="gen_right").set_value("concat")
    at.button[0].click().run()
    wait_job(at, "gen_job")
    assert any(s.value.startswith("Identical: all 6 tokens match, fast vs concat")
               for s in at.success), [s.value for s in at.success]
    at.selectbox(key="gen_right").set_value("fast")
    at.button[0].click().run()
    assert any("two different modes" in e.value for e in at.error)


def test_results_page_lists_shipped_examples(results: Path) -> None:
    # An empty results folder: the four runs listed are the example run in docs/runs/examples/.
    at = open_page("results")
    heads = [h.value for h in [*at.header, *at.subheader, *at.markdown]]
    assert any("Saved runs (4)" in h for h in heads), heads


def test_floor_lab_predicts_the_step_and_saves(results: Path) -> None:
    at = open_page("floor")
    at.multiselect(key="floor_pred_modes").set_value(["uncached_last", "prealloc_fused"])
    at.text_input(key="floor_pred_ctx").set_value("4, 16")
    at.number_input(key="floor_pred_rep").set_value(2)
    at.run()
    at.button(key="floor_pred_go").click().run()
    job = wait_job(at, "floor_pred_job", 150)
    assert job.state == "done", job.error
    assert {v["mode"] for v in job.run["tables"]["verdicts"]} == {"uncached_last",
                                                                  "prealloc_fused"}
    assert len(charts(at)) == 3  # predicted vs measured, residual, parts
    assert sum("worst miss" in m.value for m in at.markdown) == 2
    assert [r["kind"] for r in load_runs(results).runs] == ["step_prediction"]
    # A later sweep of a calibrated mode on the same machine draws the prediction over its curve.
    at.switch_page("views/sweep.py").run()
    configure_sweep(at, "4, 16", repeats=2, e2e=True)
    at.multiselect(key="sweep_modes").set_value(["uncached_last", "prealloc_fused", "concat"])
    at.run()
    at.button[0].click().run()
    sweep = wait_job(at, "sweep_job")
    assert sweep.state == "done", sweep.error
    # The sweep was handed the predicted steps of the modes the calibration met its goal for,
    # and each row says what confirmed it.
    within = {v["mode"]: v["worst_share"] for v in job.run["tables"]["verdicts"] if v["within"]}
    assert (sweep.params["prediction_error"] or {}) == within
    assert set(sweep.params["predicted_ms"] or {}) == set(within)
    assert {r["confirmed_by"] for r in sweep.run["tables"]["latency"]} <= {
        "samples", "prediction", None}
    assert all(("predicted_ms" in r) == (r["mode"] in within)
               for r in sweep.run["tables"]["latency"])
    said = [c.value for c in at.caption if "Dashed: the step predicted" in c.value]
    assert len(said) == 1, [c.value for c in at.caption]
    names = [t.get("name") for t in json.loads(charts(at)[0].proto.spec)["data"]]
    assert "prealloc_fused predicted" in names  # its dashed line
    assert "concat predicted" not in names  # never calibrated: no line, rather than a wrong one
    e2e = next(d.value for d in at.dataframe if "predicted_s" in d.value.columns)
    by_mode = dict(zip(e2e["mode"], e2e["predicted_s"], strict=True))
    assert by_mode["prealloc_fused"] > 0 and by_mode["uncached_last"] > 0
    assert by_mode["concat"] is None or by_mode["concat"] != by_mode["concat"]  # not calibrated
    # The FLOPs page draws the predicted time reduction beside the measured one (Figure 4).
    at.switch_page("views/flops.py").run()
    no_traceback(at)
    names = [t.get("name") for t in json.loads(charts(at)[0].proto.spec)["data"]]
    predicted = [n for n in names if n.endswith("time (predicted)")]
    assert len(predicted) == 1 and predicted[0].startswith("5 ·")  # prealloc_fused; concat none
    assert any("Dotted: the same ratio" in c.value for c in at.caption)


# ------------------------------------------------------------- the first page never waits
def _values(at: AppTest) -> list[str]:
    return [str(e.value) for e in [*at.metric, *at.caption, *at.sidebar.caption, *at.markdown]]


def test_the_first_page_draws_while_the_probe_and_the_load_run(
        results: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Overview of a fresh server: a device probe that has not answered and a model still
    loading hold nothing up. "probing…" stands where the facts go, the model card is the
    preset's shapes, and both fill in on the rerun that follows (the probe's fragment reruns the
    page when it lands)."""
    import threading

    from instruments import lineup
    from instruments.process import client, devices, probe
    from instruments.spine import ModelSpec

    gate = threading.Event()
    facts = {"name": "Test CPU", "kind": "cpu", "device": "cpu", "cores": 2, "threads": 2,
             "total_memory_bytes": 8 * 2**30, "capability": "avx2",
             "dtypes": list(probe.CPU_DTYPES)}
    monkeypatch.setattr(devices, "_PROBE", devices.DeviceProbe(
        lambda: gate.wait(60) and {"torch": "9.9", "devices": {"cpu": facts}}))
    held: dict[ModelSpec, client.Job] = {}  # the load: on its way until the test says
    monkeypatch.setattr(client, "_INFO", {})  # as on a fresh server: nothing loaded yet
    monkeypatch.setattr(client, "_LOADS", {})
    monkeypatch.setattr(client, "_load", lambda spec: held.setdefault(
        spec, client.Job("load", {}, spec)))
    at = AppTest.from_file(APP, default_timeout=20)
    at.run()
    no_traceback(at)
    assert at.title[0].value == "KV Cache Lab"
    lab = at.caption[0].value  # what the lab is: every family it runs, not one model
    titles = lineup.family_titles()  # every family of the table, named in the table's order
    assert len(titles) > 1 and lab.startswith(
        f"Language models written from scratch ({', '.join(titles[:-1])} and {titles[-1]} "
        "families)"), lab
    said = _values(at)
    assert said.count("probing…") >= 2, said  # memory, cores / threads
    assert "Device facts: probing… (the CPU is ready)" in said, said  # the sidebar's foot
    assert at.selectbox(key="device").options == ["cpu"]  # the CPU at once
    assert at.selectbox(key="dtype").options == ["float32", "bfloat16"]
    params = next(m.value for m in at.metric if m.label == "Parameters")
    assert params.endswith(" M")  # the card drawn from the preset's config, torch-free
    assert any("Loading tiny" in s and "in the measuring process…" in s for s in said), said
    (job,) = held.values()  # the load was started, not waited for
    gate.set()  # the probe lands; the model is loaded
    devices._PROBE.wait(10)
    cfg = lineup.config(job.model.name)
    monkeypatch.setitem(client._INFO, job.model, {
        "weights_label": "random (seed 0, test shape)", "weights_fallback": None,
        "config": cfg.to_dict(), "family": cfg.family})
    job.state, job.ended_s = "done", time.monotonic()
    at.run()
    no_traceback(at)
    said = _values(at)
    assert not any("probing…" in s for s in said), said
    assert "8.0 GiB" in said and "2 / 2" in said and "Vector extensions: avx2" in said
    assert not any("in the measuring process…" in s for s in said), said
    assert any("Random weights" in w.value for w in at.warning)  # what was loaded, said


def test_a_gpu_joins_the_device_list_when_the_probe_finds_it(
        results: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch could drive a GPU, the sidebar offers the CPU at once and its Device label
    says "probing…"; when the probe finds one it joins the list and becomes the choice of a
    session that has not picked a device itself."""
    import threading

    from instruments.process import client, devices, probe

    gate = threading.Event()
    cpu = {"name": "Test CPU", "kind": "cpu", "dtypes": list(probe.CPU_DTYPES)}
    gpu = {"name": "Test GPU", "kind": "cuda", "dtypes": ["float32", "bfloat16", "float16"]}
    monkeypatch.setattr(probe, "gpu_build", lambda: True)
    monkeypatch.setattr(devices, "_PROBE", devices.DeviceProbe(
        lambda: gate.wait(60) and {"torch": "9.9", "devices": {"cpu": cpu, "cuda": gpu}}))
    monkeypatch.setattr(client, "_INFO", {})
    monkeypatch.setattr(client, "_LOADS", {})
    monkeypatch.setattr(client, "_load", lambda spec: client.Job("load", {}, spec))  # never ends
    at = AppTest.from_file(APP, default_timeout=20)
    at.run()
    no_traceback(at)
    picker = at.selectbox(key="device")
    assert picker.options == ["cpu"] and picker.label == "Device (GPU: probing…)"
    gate.set()
    devices._PROBE.wait(10)
    at.run()
    no_traceback(at)
    assert at.selectbox(key="device").options == ["cuda", "cpu"]
    assert at.selectbox(key="device").label == "Device"
    assert at.session_state["choice"].device == "cuda"
    assert not any("probing…" in c.value for c in at.sidebar.caption)
    at.run()  # AppTest gives the sidebar's widgets new ids after its first runs: let it
    assert at.session_state["choice"].device == "cuda"
    at.selectbox(key="device").set_value("cpu").run()  # a choice of the user's own stays
    at.run()
    assert at.session_state["choice"].device == "cpu"


def test_run_pressed_while_the_model_loads_times_mode_1_before_any_other_gate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Run pressed the moment the page appears on a fresh server: the measuring process is
    still starting and the page's background load is on its way. The sweep queues behind that
    load, and the first row it streams is mode 1's (the reference, gated by nothing), before
    any other mode's gate has begun; each other mode's rows come after its gate (the order of
    the stream, not its times)."""
    from instruments.experiments import to_dict
    from instruments.experiments.latency import LatencyParams
    from instruments.process import client
    from instruments.spine import ModelSpec

    stream: list[tuple[str | None, str | None, str]] = []
    add = client.Job.add

    def recorded(job: client.Job, event) -> None:  # noqa: ANN001
        if job.experiment == "latency":
            stream.append((event.table, (event.row or {}).get("mode"), event.message))
        add(job, event)

    monkeypatch.setattr(client.Job, "add", recorded)
    monkeypatch.setattr(client, "_LOADS", {})
    running = client.running_pid("cpu")
    if running is not None:  # a fresh process, as on a fresh server
        os.kill(running, signal.SIGKILL)
        end = time.monotonic() + 10
        while client.running_pid("cpu") is not None and time.monotonic() < end:
            time.sleep(0.05)
    spec = ModelSpec("tiny", seed=31)
    client.load_soon(spec)  # what the first page does
    params = LatencyParams([4, 8, 16], ["uncached", "concat", "fast"], warmup=0, repeats=1,
                           min_repeats=1, retakes=0, measure_peaks=False)
    job = client.submit("latency", to_dict(params), spec)  # Run, pressed at once
    assert client.loading(spec) and client.known_info(spec) is None  # before it was loaded
    end = time.monotonic() + 120
    while not job.finished and time.monotonic() < end:
        time.sleep(0.05)
    assert job.state == "done", job.error
    rows = [(i, mode) for i, (table, mode, _) in enumerate(stream) if table == "latency"]
    gate = {mode: min(i for i, (_, _, said) in enumerate(stream)
                      if said.startswith(f"{mode}: checking its logits"))
            for mode in ("concat", "fast")}
    assert rows[0][1] == "uncached" and rows[0][0] < min(gate.values()), stream
    for mode, began in gate.items():
        assert began < min(i for i, m in rows if m == mode), stream  # withheld until gated


def test_make_run_starts_the_process_and_the_first_model_before_any_page(
        results: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m ui.serve`` (what ``make run`` runs): before Streamlit's server is handed the
    app, the measuring process is on its way and the sidebar's first model is loading in it, so
    the first page finds it loaded rather than starting the load itself."""
    from streamlit.web import cli as streamlit_cli

    from instruments.process import client
    from ui import serve
    from ui.state import first_choice

    monkeypatch.setattr(client, "_INFO", {})  # as on a fresh server: nothing loaded yet
    monkeypatch.setattr(client, "_LOADS", {})
    spec = first_choice("cpu").spec()
    handed: list[list[str]] = []

    def streamlit_main() -> int:  # the server would start here
        import sys

        handed.append(list(sys.argv))
        assert client.loading(spec) or client.known_info(spec) is not None
        return 0

    monkeypatch.setattr(streamlit_cli, "main", streamlit_main)
    monkeypatch.setattr(client, "likely_device", lambda: "cpu")
    monkeypatch.setattr("sys.argv", ["serve"])
    assert serve.main(["--server.port", "1"]) == 0
    assert handed == [["streamlit", "run", str(serve.APP), "--server.port", "1"]]
    assert client.model_info(spec, timeout_s=60)["weights_label"].startswith("random")
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    no_traceback(at)
    assert not any("in the measuring process…" in s for s in _values(at))  # no "Loading…"
