"""The device check (scripts/gpu_check.py) on a CPU, in its --tiny dry run: a stage that raises
or runs far past its budget is recorded and the later stages still run and save their runs;
summary.json says what each stage did; the exit status and the last line name the failed
stages; --stages runs a subset and refuses an unknown name; the Llama family's sweep plans at
least eight contexts that a stopped sweep still spans.

The failures are planted by patching an experiment's ``run`` (no hook in the check itself).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from instruments.store.results import load_runs

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(240)


def check_module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A fresh scripts/gpu_check.py (its stage modules come along through sys.path), with a
    watchdog that never acts: with --total-s 0 every stage is past its budget at once, and how
    long a stage's first point takes is the host's (the hardware stage: 17 s of the watchdog's
    30 on a loaded 2-core EPYC). The watchdog's own tests set its grace themselves."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys.modules["device_check.runner"], "GRACE_S", 3600.0)
    return module


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text(encoding="utf-8"))


def stage(out: Path, name: str) -> dict:
    return next(s for s in summary(out)["stages"] if s["name"] == name)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def dry_run(gpu_check: ModuleType, out: Path, stages: str, *extra: str) -> int:
    return gpu_check.main(["--device", "cpu", "--tiny", "--out", str(out), "--total-s", "0",
                           "--stages", stages, *extra])


def test_a_stage_that_raises_keeps_its_rows_and_the_later_stages_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """As on the first GPU run: GPT-2's fp32 sweep raises after its first point (there, the
    compiled mode did); the check went no further and lost every later stage."""
    from instruments.experiments import latency

    real = latency.run

    def planted(loaded, params, progress=None, should_stop=None):  # noqa: ANN001, ANN202
        if loaded.spec.dtype != "float32" or loaded.model.config.family != "gpt2":
            return real(loaded, params, progress, should_stop)

        def raising(event):  # noqa: ANN001, ANN202
            progress(event)
            if event.table == "latency" and event.row is not None:
                raise RuntimeError("planted: another decoder of this mode has started")
        return real(loaded, params, raising)  # unstopped: its first point streams, then it raises

    monkeypatch.setattr(latency, "run", planted)
    gpu_check = check_module(monkeypatch)
    status = dry_run(gpu_check, tmp_path, "hardware,sweep-float32,sweep-bfloat16,memory,floor")
    out = capsys.readouterr().out
    assert status == 1
    assert last_line(out) == "failed stages: sweep-float32"
    failed = stage(tmp_path, "sweep-float32")
    assert failed["status"] == "failed" and failed["error"]["type"] == "RuntimeError"
    assert "planted" in failed["error"]["message"]
    assert failed["error"]["traceback"][-1].startswith("RuntimeError: planted")
    (kept,) = [json.loads((tmp_path / p).read_text()) for p in failed["runs"]]
    assert kept["meta"]["partial"] and "raised RuntimeError: planted" in kept["meta"]["note"]
    assert len(kept["tables"]["latency"]) == 1  # the row streamed before it raised
    for later in ("sweep-bfloat16", "memory", "floor"):  # ran after it, and saved
        got = stage(tmp_path, later)
        assert got["status"] in ("ok", "partial") and got["runs"], got
        assert all((tmp_path / p).is_file() for p in got["runs"])
    runs = load_runs(tmp_path).runs
    kinds = sorted(r["kind"] for r in runs)
    assert kinds == ["device_check", "floor_summary", "hardware", "latency_sweep",
                     "latency_sweep", "memory"]
    assert summary(tmp_path)["failed"] == ["sweep-float32"]
    assert summary(tmp_path)["finished"] is True
    (check,) = [r for r in runs if r["kind"] == "device_check"]  # the summary as a run too
    rows = {r["stage"]: r for r in check["tables"]["stages"]}
    assert rows["sweep-float32"]["status"] == "failed" and "planted" in rows["sweep-float32"][
        "error"] and check["meta"]["failed"] == ["sweep-float32"]


def test_stages_runs_a_subset_in_table_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    gpu_check = check_module(monkeypatch)
    assert dry_run(gpu_check, tmp_path, "memory,hardware") == 0
    out = capsys.readouterr().out
    assert out.index("== hardware") < out.index("== memory")
    assert last_line(out).startswith("failed stages: none")
    got = summary(tmp_path)
    ran = [s["name"] for s in got["stages"] if s["status"] in ("ok", "partial")]
    assert ran == ["hardware", "memory"]
    assert all(s["why"] == "not selected (--stages)" for s in got["stages"]
               if s["name"] not in ran)
    assert sorted(r["kind"] for r in load_runs(tmp_path).runs) == ["device_check", "hardware",
                                                                   "memory"]
    assert {"torch", "triton", "transformers"} <= set(got["versions"])
    assert got["device"] == "cpu" and got["total_s"] >= 0


def test_an_unknown_stage_is_refused_with_the_allowed_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    gpu_check = check_module(monkeypatch)
    assert dry_run(gpu_check, tmp_path, "planner,nope") == 2
    err = capsys.readouterr().err
    assert "unknown stage 'nope'; allowed: tests, hardware, sweep-float32" in err
    assert "pages" in err and not (tmp_path / "summary.json").exists()
    assert gpu_check.main(["--list-stages"]) == 0
    listed = [ln.split()[0] for ln in capsys.readouterr().out.splitlines()]
    assert listed == [s.name for s in gpu_check.STAGES] and listed[0] == "tests"


def test_a_stage_far_past_its_budget_is_interrupted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A stage that hangs (here: sleeps 120 s) is interrupted once past its budget by the grace
    (1 s here), with every thread's traceback written down; the next stage runs, given the usual
    grace back. Only the hang is timed: a sleep the test set, cut short."""
    from instruments.experiments import memory

    runner_module: list[ModuleType] = []
    hung_s: list[float] = []

    def hanging(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t0 = time.monotonic()
        try:
            time.sleep(120)
        finally:
            hung_s.append(time.monotonic() - t0)
            monkeypatch.setattr(runner_module[0], "GRACE_S", 3600.0)  # for the next stage

    monkeypatch.setattr(memory, "run", hanging)
    gpu_check = check_module(monkeypatch)
    runner_module.append(sys.modules["device_check.runner"])
    monkeypatch.setattr(runner_module[0], "GRACE_S", 1.0)
    assert dry_run(gpu_check, tmp_path, "memory,planner") == 1
    assert len(hung_s) == 1 and hung_s[0] < 60  # cut short, not slept out
    assert last_line(capsys.readouterr().out) == "failed stages: memory"
    hung = stage(tmp_path, "memory")
    assert hung["error"]["type"] == "StageOverrun" and "interrupted" in hung["error"]["message"]
    assert "hanging" in (tmp_path / "memory.hang.txt").read_text()
    assert stage(tmp_path, "planner")["status"] in ("ok", "partial")


HUNG_IN_C = """
import importlib.util, signal, sys, time
from pathlib import Path
root = Path(sys.argv[1])
spec = importlib.util.spec_from_file_location("gpu_check", root / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check
spec.loader.exec_module(gpu_check)
runner = sys.modules["device_check.runner"]
runner.GRACE_S, runner.KILL_AFTER_S = 0.5, 1.0
from instruments.experiments import memory
def stuck(*args, **kwargs):  # as inside C code: the interrupting signal never lands
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    time.sleep(120)
memory.run = stuck
gpu_check.main(["--device", "cpu", "--tiny", "--out", sys.argv[2], "--total-s", "0",
                "--stages", "memory,planner"])
print("not reached")
"""


def test_a_stage_stuck_in_c_code_ends_the_check_with_its_summary(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", HUNG_IN_C, str(ROOT), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1, done.stderr[-2000:]
    assert last_line(done.stdout) == "failed stages: memory", done.stdout[-3000:]
    assert stage(tmp_path, "memory")["error"]["type"] == "StageHung"
    assert stage(tmp_path, "planner")["why"] == "not run: memory hung and the check ended there"
    assert summary(tmp_path)["finished"] is True


def test_the_shell_closes_the_summary_of_a_killed_check(tmp_path: Path) -> None:
    """What gpu_check.sh runs after `timeout` killed the check mid-stage."""
    (tmp_path / "summary.json").write_text(json.dumps({"stages": [
        {"name": "hardware", "status": "ok", "seconds": 3.0},
        {"name": "peers", "status": "running", "seconds": None},
        {"name": "pages", "status": "pending", "seconds": None}]}))
    done = subprocess.run([sys.executable, "scripts/device_check/runner.py", "--close",
                           str(tmp_path), "killed at the 360 s limit"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and last_line(done.stdout) == "failed stages: peers"
    assert stage(tmp_path, "peers")["error"]["message"] == "killed at the 360 s limit"
    assert stage(tmp_path, "pages")["status"] == "skipped"
    (check,) = load_runs(tmp_path).runs  # a killed check is a run too, its stage failed
    assert [r["status"] for r in check["tables"]["stages"]] == ["ok", "failed", "skipped"]


def test_the_llama_sweep_plans_eight_contexts_spanning_short_to_long(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the first GPU run its 16 contexts, up to five samples each, gave one context in its
    share: a stopped sweep kept 8 tokens only."""
    from instruments import lineup
    from instruments.experiments.inputs import spread_order

    check_module(monkeypatch)
    stages = sys.modules["device_check.stages"]
    cfg = lineup.config("smollm2-135m")
    params = stages.sweep_params(cfg, ["uncached", "concat"], True, stages.LLAMA_CONTEXTS)
    assert len(params.contexts) >= 8 and params.order == "spread"
    assert min(params.contexts) == 8 and max(params.contexts) >= 1000
    assert spread_order(params.contexts)[:2] == [8, max(params.contexts)]
    assert params.repeats <= 2 and params.point_ms <= 100  # fewer samples where they are slow


# What a bare GPU node has (the H200 of first light; .ci/run's dry run installs the same, tokenizers
# and Jinja2 coming with transformers and torch): every other package of requirements.txt is made
# absent below, as if it had never been installed.
NODE_PACKAGES = {"torch", "transformers", "safetensors", "pandas", "numpy", "psutil", "tiktoken",
                 "tokenizers", "Jinja2", "pytest", "pytest-timeout"}
IMPORT_NAMES = {"pytest-timeout": "pytest_timeout"}
NODE = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # import raises ModuleNotFoundError, find_spec says None
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-m", "cuda or triton", "-p", "no:cacheprovider",
                      "-p", "pytest_timeout", "tests"]))
"""


def absent_on_a_node() -> list[str]:
    names = []
    for line in (ROOT / "requirements.txt").read_text(encoding="utf-8").splitlines():
        pkg = line.split("#")[0].split("==")[0].strip()
        if pkg and pkg not in NODE_PACKAGES:
            names.append(IMPORT_NAMES.get(pkg, pkg.replace("-", "_")))
    return names


@pytest.mark.timeout(300)
def test_the_tests_collect_on_a_node_with_only_the_node_packages() -> None:
    """The device check's first stage collects every test file on the GPU node: a test file that
    imports a package the node lacks (the dashboard's, hypothesis, a peer's) at its top must be
    left out by conftest, not stop the collection (CI's dry run failed so on hypothesis)."""
    absent = absent_on_a_node()
    assert {"streamlit", "plotly", "hypothesis", "playwright", "gguf"} <= set(absent)
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # the absent ones' plugins too
    out = subprocess.run([sys.executable, "-c", NODE, ",".join(absent)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=280)
    said = (out.stdout + out.stderr)[-3000:]
    assert out.returncode in (0, 5), said  # 5: nothing selected on this machine
    assert "error" not in said.lower().splitlines()[-1], said
