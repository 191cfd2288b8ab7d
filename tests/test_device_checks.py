"""The device checks in the docs (instruments/store/device_checks.py): a check's summary as a
run of the one schema, the README's line per check naming its failed stages, and each mode's
GPU step run by run against its read floor, and the GPU path's own stages (tiles, paged reads, SDPA
backends, the batch curve) with their verdicts, from committed-style run files."""

from __future__ import annotations

from pathlib import Path

from instruments.store import results
from instruments.store.device_checks import brief_block, check_run, kernels_block, modes_block

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
    first = _sweep([("cuda_graph", 1024, 2.144), ("q8_0_weights", 600, 48.0)],
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
    assert "first light → 2026-12-04-h200" in table[0]
    assert table[2].startswith("| mode | gpt2 float32 |")  # its contexts differ: in the cells
    rows = {r.split("|")[1].strip(): r.split("|")[2].strip() for r in table[4:]}
    assert rows["`cuda_graph`"] == "2.144 @1024 → 0.679 @1024 (5.3×)"  # the longest
    assert rows["`triton`"] == "— → 1.677 @1024"  # not there at first light
    assert rows["`q8_0_weights`"] == "48.000 @600 → —"
    same = modes_block([again, floor], tmp_path).splitlines()  # one context a sweep: the head
    assert same[2].startswith("| mode | gpt2 float32 @ 1024 |")
    assert "| `cuda_graph` | 0.679 (5.3×) |" in same


def _gpu_run(kind: str, tables: dict, path: Path, device: str = "cuda",
             when: str = "2026-12-06T10:00:00+00:00", **meta: object) -> dict:
    m = results.collect_meta(model="gpt2", device=device, device_name="NVIDIA H200",
                             dtype="float32")
    return {**results.new_run(kind, {**m, **meta}, tables), "created_utc": when,
            "path": str(path)}


def test_the_gpu_paths_own_stages_give_their_verdicts(tmp_path: Path) -> None:
    d = tmp_path / "docs" / "runs" / "gpu" / "2026-12-06-h200"
    tile = {"dtype": "float32", "N": 2304, "K": 768}
    tiles = _gpu_run("triton_tiles", {"products": [
        {**tile, "tiles": [1, 32, 128], "picked": True, "us": 9.0, "read_gbps": 786.0},
        {**tile, "tiles": [1, 8, 256], "picked": False, "us": 6.0, "read_gbps": 1180.0}]},
        d / "t.json")
    point = {"mode": "paged", "batch_size": 1, "context_len": 1023, "logits_rel_diff": 2e-7}
    paged = _gpu_run("cache_reads", {"points": [
        {**point, "gather_ms": 4.9, "in_place_ms": 1.2, "speedup": 4.9 / 1.2},
        {**point, "batch_size": 32, "gather_ms": 9.0, "in_place_ms": 10.0, "speedup": 0.9}]},
        d / "p.json")
    sdpa = _gpu_run("sdpa_backends", {"steps": []}, d / "s.json")  # out of time at once
    curve = _gpu_run("batch_curve", {"curve": [
        {"mode": "triton", "context_len": 128, "batch_size": b, "latency_ms": ms,
         "tokens_per_s": b / ms * 1e3, "over_floor": x} for b, ms, x in
        ((1, 1.745, 15.5), (2, 2.216, 19.4))],
        "crossover": [{"mode": "triton", "context_len": 128, "batch_crossover": 52.4}]},
        d / "c.json", partial=True)
    on_cpu = _gpu_run("cache_reads", {"points": []}, d / "cpu.json", device="cpu",
                      when="2026-12-07T10:00:00+00:00")  # newer, but not a GPU's: ignored
    block = kernels_block([tiles, paged, sdpa, curve, on_cpu], tmp_path)
    assert "the pick was the fastest tile for 0 of 1" in block
    assert "| float32 | 2304×768 | [1, 32, 128]: 9.0 µs, 786 GB/s | [1, 8, 256]: 6.0 µs" in block
    assert "in place faster at 1 of 2 points; logits differ by at most 2.0e-07" in block
    assert "| `paged` | 1 | 1023 | 4.900 | 1.200 | 4.08× |" in block
    assert "`sdpa-backends` ran out of time before its first point" in block
    assert "| `triton` | 128 | 1: 1.745, 573, 15.5× | 2: 2.216, 903, 19.4× | 52.4 |" in block
    assert "Stopped early" in block.split("c.json")[1][:40]
    assert "Not run on a GPU yet" not in block
    assert kernels_block([on_cpu], tmp_path) == ("Not run on a GPU yet: `triton-tiles`, "
                                                 "`cache-reads`, `sdpa-backends`, `batch-curve`.")
