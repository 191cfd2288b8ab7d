"""The device checks in the docs (instruments/store/device_checks.py): a check's summary as a
run of the one schema, the README's line per check naming its failed stages, and each mode's
GPU step run by run against its read floor, from committed-style run files."""

from __future__ import annotations

from pathlib import Path

from instruments.store import results
from instruments.store.device_checks import brief_block, check_run, modes_block

SUMMARY = {"command": "scripts/gpu_check.py", "started_utc": "2026-12-04T18:31:22+00:00",
           "device": "cuda", "device_name": "NVIDIA H200", "model": "gpt2",
           "git_rev": "d1ff11f0774f", "versions": {"torch": "2.11.0", "triton": "3.6.0"},
           "budget_s": 345.0, "total_s": 316.5, "finished": True, "failed": ["tests"],
           "stages": [{"name": "tests", "status": "failed", "budget_s": 120, "seconds": 119,
                       "runs": [], "why": None,
                       "error": {"type": "RuntimeError", "message": "2 failed\nFAILED x"}},
                      {"name": "hardware", "status": "ok", "seconds": 3.7, "runs": ["h.json"]}]}


def _sweep(rows: list[tuple[str, int, float]], when: str, path: Path) -> dict:
    meta = results.collect_meta(model="gpt2", device="cuda", device_name="NVIDIA H200",
                                dtype="float32")
    run = results.new_run("latency_sweep", meta, {"latency": [
        {"mode": m, "context_len": t, "latency_ms": ms, "phase": "decode"} for m, t, ms in rows]})
    return {**run, "created_utc": when, "path": str(path)}


def test_a_summary_is_a_valid_run_naming_its_stages() -> None:
    run = check_run(SUMMARY)
    assert results.validate_run(run) == [] and run["kind"] == "device_check"
    assert run["created_utc"] == SUMMARY["started_utc"]  # when it ran
    assert run["meta"]["git_rev"] == "d1ff11f0774f" and run["meta"]["failed"] == ["tests"]
    tests, hardware = run["tables"]["stages"]
    assert (tests["status"], tests["error_type"], tests["error"]) == ("failed", "RuntimeError",
                                                                     "2 failed")
    assert hardware["runs"] == ["h.json"] and hardware["error"] is None


def test_the_blocks_say_what_failed_and_each_mode_run_by_run(tmp_path: Path) -> None:
    runs_dir = tmp_path / "docs" / "runs"
    check = {**check_run(SUMMARY), "path": str(runs_dir / "gpu" / "2026-12-04-h200" / "c.json")}
    first = _sweep([("cuda_graph", 1024, 2.144), ("q8_0_weights", 1024, 48.0)],
                   "2026-12-04T15:47:13+00:00", runs_dir / "gpu-first-light" / "a.json")
    again = _sweep([("cuda_graph", 512, 0.70), ("cuda_graph", 1024, 0.679),
                    ("triton", 1024, 1.677)], "2026-12-04T18:33:48+00:00",
                   runs_dir / "gpu" / "2026-12-04-h200" / "b.json")
    floor = {**results.new_run("floor_summary", results.collect_meta(), {"floor": [
        {"dtype": "float32", "model": "", "mode": "cuda_graph", "ratio": 5.3}]}),
        "created_utc": "2026-12-04T18:36:34+00:00", "path": str(runs_dir / "gpu" / "f.json")}
    line = brief_block([check], tmp_path)
    assert "NVIDIA H200" in line and "1 ok, 1 failed; failed: tests" in line
    table = modes_block([first, again, floor, check], tmp_path).splitlines()
    assert table[0].startswith("| model dtype | mode | first light: ms (context) | "
                               "2026-12-04-h200: ms (context) | newest ÷ read floor")
    rows = {r.split("|")[2].strip(): [c.strip() for c in r.split("|")[3:-1]] for r in table[2:]}
    assert rows["`cuda_graph`"] == ["2.144 (1024)", "0.679 (1024)", "5.3×"]  # the longest
    assert rows["`triton`"] == ["—", "1.677 (1024)", "—"]  # not there at first light
    assert rows["`q8_0_weights`"] == ["48.000 (1024)", "—", "—"]
