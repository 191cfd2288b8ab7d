"""Exports and comparisons of saved runs, torch-free: JSON Lines one record per timed sample,
CSV and Markdown round trips, ``compare`` flagging a slowed mode and passing an unchanged one,
and the CLI's ``export`` / ``compare`` (exit code 1 on a regression, 2 on bad input)."""

from __future__ import annotations

import copy
import csv
import io
import json
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from instruments import cli
from instruments.store import compare, exports
from instruments.store.results import collect_meta, find_run, new_run, save_run


def sweep_run(samples: dict[str, dict[int, list[float]]], device: str = "cpu",
              aside: tuple[float, str] | None = None) -> dict:
    """A latency sweep run with these samples per mode and context (the first point of the
    first mode with one set-aside sample when ``aside``)."""
    rows = []
    for mode, points in samples.items():
        for t, ms in points.items():
            rows.append({"mode": mode, "context_len": t, "batch_size": 1, "phase": "decode",
                         "latency_ms": sorted(ms)[len(ms) // 2], "samples_ms": list(ms),
                         "set_aside_ms": [], "set_aside_why": [], "disturbed_kept": 0})
    if aside is not None:
        rows[0].update(set_aside_ms=[aside[0]], set_aside_why=[aside[1]])
    meta = collect_meta(model="tiny", device=device, device_name="test cpu", dtype="float32",
                        batch_size=1, experiment="latency_sweep")
    e2e = [{"mode": m, "prompt_len": 8, "new_tokens": 4, "batch_size": 1, "total_s": 0.1,
            "samples_s": [0.1, 0.1]} for m in samples]
    return new_run("latency_sweep", meta, {"latency": rows, "end_to_end": e2e,
                                           "cumulative": [{"mode": "concat", "step": 0,
                                                           "step_ms": 3.5}]})


def slowed(run: dict, mode: str, factor: float) -> dict:
    """A copy of a sweep run (a new id, a later time) whose ``mode`` took ``factor`` times as
    long: the regression made on purpose."""
    out = copy.deepcopy({k: v for k, v in run.items() if k != "path"})
    out["run_id"] = uuid.uuid4().hex
    later = max(datetime.now(timezone.utc),  # newer than any run saved before it
                datetime.fromisoformat(out["created_utc"]) + timedelta(seconds=1))
    out["created_utc"] = later.isoformat(timespec="seconds")
    out["meta"]["label"] = f"{mode} slowed ×{factor:g} (synthetic)"
    for r in out["tables"].get("latency", []):
        if r["mode"] == mode:
            r["latency_ms"] *= factor
            r["samples_ms"] = [x * factor for x in r["samples_ms"]]
    return out


BASE = {"uncached": {8: [10.0, 10.5, 10.2], 16: [20.0, 20.4]},
        "concat": {8: [2.0, 2.1, 2.05], 16: [2.2, 2.3]}}


# ---------------------------------------------------------------------------------- exports
def test_jsonl_has_one_record_per_timed_sample() -> None:
    run = sweep_run(BASE, aside=(55.0, "another process used 0.8 of a core"))
    records = exports.read_jsonl(exports.samples_jsonl(run))
    latency = [r for r in records if r["table"] == "latency"]
    kept = sum(len(p) for m in BASE.values() for p in m.values())
    assert len([r for r in latency if not r["set_aside"]]) == kept
    assert sorted(r["sample_ms"] for r in latency if not r["set_aside"]) == sorted(
        x for m in BASE.values() for p in m.values() for x in p)
    (aside,) = [r for r in latency if r["set_aside"]]
    assert aside["disturbed"] is True and aside["sample_ms"] == 55.0 and "another" in aside["why"]
    assert aside["mode"] == "uncached" and aside["context_len"] == 8
    first = latency[0]
    assert first["run_id"] == run["run_id"] and first["experiment"] == "latency_sweep"
    assert first["disturbed"] is False  # a CPU watch ran and kept nothing disturbed
    e2e = [r for r in records if r["table"] == "end_to_end"]
    assert len(e2e) == 4 and e2e[0]["sample_ms"] == pytest.approx(100.0)
    assert [r["sample_ms"] for r in records if r["table"] == "cumulative"] == [3.5]
    assert len(records) == len(exports.samples_jsonl(run).splitlines())


def test_disturbed_is_unknown_where_no_watch_said() -> None:
    gpu = sweep_run(BASE, device="cuda")
    assert {r["disturbed"] for r in exports.sample_records(gpu)} == {None}
    cpu = sweep_run(BASE)
    cpu["tables"]["latency"][0]["disturbed_kept"] = 1  # kept one, which is not recorded
    by_point = {(r["mode"], r["context_len"]): r["disturbed"]
                for r in exports.sample_records(cpu) if r["table"] == "latency"}
    assert by_point[("uncached", 8)] is None and by_point[("uncached", 16)] is False


def test_csv_round_trips_every_field() -> None:
    run = sweep_run(BASE)
    back = list(csv.DictReader(io.StringIO(exports.table_csv(run))))
    rows = run["tables"]["latency"]
    assert len(back) == len(rows)
    for got, want in zip(back, rows, strict=True):
        assert got["mode"] == want["mode"] and int(got["context_len"]) == want["context_len"]
        assert float(got["latency_ms"]) == want["latency_ms"]
        assert json.loads(got["samples_ms"]) == want["samples_ms"]


def test_markdown_is_a_pipe_table_that_says_why_a_percentile_is_missing() -> None:
    run = sweep_run(BASE)
    for r in run["tables"]["latency"]:
        r.update(p50_ms=r["latency_ms"], p90_ms=None, p99_ms=None, samples_n=3)
    text = exports.table_markdown(run)
    lines = text.splitlines()
    assert lines[0].startswith("| mode | context_len | latency_ms | p50_ms | p90_ms | p99_ms |")
    assert all(line.count("|") == lines[0].count("|") for line in lines[1:6])
    assert "samples_ms" not in lines[0]  # lists stay in the CSV and JSON Lines
    assert "too few samples" in text and "p99 at least 100" in text


def test_exports_refuse_what_the_run_does_not_have() -> None:
    run = sweep_run(BASE)
    with pytest.raises(exports.ExportError, match="it has: latency, end_to_end, cumulative"):
        exports.export(run, "csv", "nope")
    with pytest.raises(exports.ExportError, match="allowed: csv, jsonl, md"):
        exports.export(run, "xml")


# ---------------------------------------------------------------------------------- compare
def test_compare_flags_a_slowed_mode_and_nothing_else() -> None:
    old = sweep_run(BASE)
    got = compare.compare(old, slowed(old, "concat", 1.5))
    verdicts = {r["point"]: r["verdict"] for r in got.rows}
    assert verdicts["concat @ 8"] == verdicts["concat @ 16"] == "regression"
    assert verdicts["uncached @ 8"] == verdicts["uncached @ 16"] == "within noise"
    assert {r["point"] for r in got.regressions} == {"concat @ 8", "concat @ 16"}
    (row,) = [r for r in got.rows if r["point"] == "concat @ 8"]
    assert row["ratio"] == pytest.approx(1.5) and row["noise"] == pytest.approx(0.1 / 2.05)
    faster = compare.compare(old, slowed(old, "concat", 0.5))
    assert not faster.regressions and len(faster.improvements) == 2


def test_compare_passes_an_unchanged_run_and_respects_each_points_noise() -> None:
    old = sweep_run(BASE)
    assert not compare.compare(old, slowed(old, "concat", 1.0)).regressions
    noisy = sweep_run({"concat": {8: [2.0, 3.0, 4.0]}})  # a spread of 67%
    within = compare.compare(noisy, slowed(noisy, "concat", 1.5))
    assert within.rows[0]["verdict"] == "within noise"
    one = sweep_run({"concat": {8: [2.0], 16: [2.0, 2.5]}})  # one sample: its run's spread
    got = compare.compare(one, slowed(one, "concat", 1.2))
    assert got.rows[0]["noise"] == pytest.approx(0.5 / 2.25)
    assert got.rows[0]["verdict"] == "within noise"


def test_compare_reads_bench_as_higher_is_better() -> None:
    meta = collect_meta(model="tiny", device="cpu", dtype="float32", batch_size=1)

    def bench(ts: list[float]) -> dict:
        row = {"mode": "concat", "test": "tg16", "label": "tg16", "depth": 0, "batch_size": 1,
               "tokens_per_s": sum(ts) / len(ts), "samples_tokens_per_s": ts}
        return new_run("bench", meta, {"bench": [row]})

    got = compare.compare(bench([100.0, 101.0]), bench([70.0, 71.0]))
    assert got.rows[0]["verdict"] == "regression" and got.rows[0]["point"] == "concat tg16"


def test_compare_refuses_two_kinds_and_says_when_set_ups_differ() -> None:
    old = sweep_run(BASE)
    with pytest.raises(ValueError, match="same experiment"):
        compare.compare(old, new_run("memory", old["meta"], {}))
    other = slowed(old, "concat", 1.0)
    other["meta"]["device_name"] = "another cpu"
    assert any("different devices" in n for n in compare.compare(old, other).notes)
    extra = slowed(old, "concat", 1.0)
    extra["tables"]["latency"].append({"mode": "fast", "context_len": 8, "batch_size": 1,
                                       "latency_ms": 1.0, "samples_ms": [1.0]})
    assert compare.compare(old, extra).rows[-3]["verdict"] == "only in new"
    assert "regression" in compare.markdown(compare.compare(old, slowed(old, "concat", 2)))


# -------------------------------------------------------------------------------------- CLI
def test_cli_export_and_compare(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    old = sweep_run(BASE)
    path_old = save_run(old, tmp_path)
    path_new = save_run(slowed(old, "concat", 2.0), tmp_path)
    same = save_run(slowed(old, "concat", 1.0), tmp_path / "again")
    assert find_run(old["run_id"][:8], tmp_path)["run_id"] == old["run_id"]
    assert cli.main(["export", str(path_old), "--format", "jsonl"]) == 0
    out = capsys.readouterr().out
    assert len(exports.read_jsonl(out)) == len(exports.sample_records(old))
    target = tmp_path / "t.md"
    assert cli.main(["export", old["run_id"][:10], "--format", "md", "--results-dir",
                     str(tmp_path), "--out", str(target)]) == 0
    assert target.read_text().startswith("| mode |")
    assert cli.main(["compare", str(path_old), str(path_new)]) == 1
    assert "**regression**" in capsys.readouterr().out
    assert cli.main(["compare", str(path_old), str(same)]) == 0
    assert cli.main(["compare", str(path_old), "nope", "--results-dir", str(tmp_path)]) == 2
    assert "no run file or run id 'nope'" in capsys.readouterr().err
    assert cli.main(["export", str(path_old), "--format", "xml"]) == 2
