"""Results store: round trip, tolerant loading, atomic writes, safe names, clear errors."""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from instruments.store import results
from instruments.store.frames import RUN_COLUMNS, run_label, table_frame
from instruments.store.results import (
    META_FIELDS,
    SCHEMA_VERSION,
    ResultsError,
    collect_meta,
    load_runs,
    new_run,
    reference_run,
    save_run,
)


def make_run(device_name="NVIDIA H200", dtype="float32", rows=None, **meta):
    meta = collect_meta(
        model="gpt2",
        weights="random",
        device="cuda",
        device_name=device_name,
        dtype=dtype,
        batch_size=1,
        warmup=2,
        repeats=5,
        **meta,
    )
    rows = (
        rows
        if rows is not None
        else [
            {"mode": "cached", "context_len": 10, "latency_ms": 4.9, "samples_ms": [4.8, 4.9, 5.0]},
            {"mode": "uncached", "context_len": 10, "latency_ms": 5.1, "samples_ms": [5.1]},
        ]
    )
    return new_run("latency_sweep", meta, {"latency": rows})


def files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_collect_meta_fills_every_field():
    meta = collect_meta(model="gpt2", note="hi", extra_field=3)
    assert set(META_FIELDS) <= set(meta)
    assert meta["model"] == "gpt2" and meta["note"] == "hi" and meta["extra_field"] == 3
    assert meta["python_version"] and meta["platform"] and meta["torch_version"]
    assert meta["partial"] is False
    assert meta["git_rev"] is None or isinstance(meta["git_rev"], str)


def test_round_trip(tmp_path):
    run = make_run()
    path = save_run(run, tmp_path)
    assert path.parent == tmp_path
    assert path.name.endswith(f"_latency_sweep_{run['run_id'][:8]}.json")
    loaded = load_runs(tmp_path)
    assert loaded.skipped == []
    assert len(loaded.runs) == 1
    got = loaded.runs[0]
    assert got.pop("path") == str(path)
    assert got == run
    assert got["schema_version"] == SCHEMA_VERSION


def test_numpy_values_and_nan_are_stored_as_plain_json(tmp_path):
    rows = [
        {
            "context_len": np.int64(8),
            "latency_ms": np.float32(1.5),
            "bad_ms": float("nan"),
            "samples_ms": np.array([1.0, 2.0]),
        }
    ]
    path = save_run(make_run(rows=rows), tmp_path)
    row = json.loads(path.read_text())["tables"]["latency"][0]
    assert row == {"context_len": 8, "latency_ms": 1.5, "bad_ms": None, "samples_ms": [1.0, 2.0]}


@pytest.mark.parametrize(
    "content, reason",
    [
        ('{"schema_version": 1, "run_id": ', "truncated"),
        ("{not json at all} trailing", "not valid JSON"),
        ("", "empty file"),
        ("   \n", "empty file"),
        ("[1, 2, 3]", "expected an object"),
        ('{"schema_version": 1, "kind": "x"}', "missing field(s): run_id"),
        (b"\xff\xfe\x00garbage", "not UTF-8"),
    ],
)
def test_bad_files_are_skipped_with_a_reason(tmp_path, content, reason):
    good = save_run(make_run(), tmp_path)
    bad = tmp_path / "bad.json"
    if isinstance(content, bytes):
        bad.write_bytes(content)
    else:
        bad.write_text(content)
    loaded = load_runs(tmp_path)
    assert [r["path"] for r in loaded.runs] == [str(good)]
    assert len(loaded.skipped) == 1
    path, why = loaded.skipped[0]
    assert path == str(bad) and reason in why


def test_future_schema_version_is_skipped(tmp_path):
    run = make_run()
    run["schema_version"] = SCHEMA_VERSION + 1
    (tmp_path / "future.json").write_text(json.dumps(run))
    loaded = load_runs(tmp_path)
    assert loaded.runs == []
    assert "newer than this app reads" in loaded.skipped[0][1]


def test_missing_folder_and_temp_leftovers_are_quietly_empty(tmp_path):
    assert load_runs(tmp_path / "nope").runs == []
    (tmp_path / ".tmp-abc.json").write_text("{")  # a crashed writer's leftover
    assert load_runs(tmp_path).skipped == []


def test_interrupted_replace_keeps_previous_file(tmp_path, monkeypatch):
    run = make_run()
    path = save_run(run, tmp_path, name="sweep")
    before = path.read_bytes()
    run["meta"]["note"] = "second version"

    def failing_replace(src, dst):
        raise OSError(errno.EIO, "simulated crash during rename")

    monkeypatch.setattr(results.os, "replace", failing_replace)
    with pytest.raises(ResultsError, match="Nothing was overwritten"):
        save_run(run, tmp_path, name="sweep")
    assert path.read_bytes() == before
    assert files_in(tmp_path) == ["sweep.json"]  # no temp file left behind


def test_interrupt_midway_through_write_keeps_previous_file(tmp_path, monkeypatch):
    run = make_run()
    path = save_run(run, tmp_path, name="sweep")
    before = path.read_bytes()

    def interrupted(fd):
        raise KeyboardInterrupt  # the user pressed Ctrl-C mid-save

    monkeypatch.setattr(results.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_run(run, tmp_path, name="sweep")
    assert path.read_bytes() == before and files_in(tmp_path) == ["sweep.json"]


def test_disk_full_gives_a_clear_error(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results.os, "fsync", full)
    with pytest.raises(ResultsError, match="disk is full"):
        save_run(make_run(), tmp_path)
    assert files_in(tmp_path) == []


def test_read_only_folder_gives_results_error(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(results.tempfile, "mkstemp", read_only)
    with pytest.raises(ResultsError, match="read-only"):
        save_run(make_run(), tmp_path)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores permissions")
def test_unwritable_folder_gives_results_error(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(ResultsError, match="permission denied"):
            save_run(make_run(), folder)
    finally:
        folder.chmod(0o700)


def test_file_that_fails_to_load_is_never_overwritten(tmp_path):
    corrupt = tmp_path / "mine.json"
    corrupt.write_text('{"half a file')
    path = save_run(make_run(), tmp_path, name="mine")
    assert path.name == "mine-2.json"
    assert corrupt.read_text() == '{"half a file'


def test_same_run_updates_in_place_other_run_gets_new_name(tmp_path):
    run = make_run(partial=True)
    first = save_run(run, tmp_path, name="sweep")
    run["meta"]["partial"] = False
    assert save_run(run, tmp_path, name="sweep") == first  # a sweep re-saving as rows arrive
    assert json.loads(first.read_text())["meta"]["partial"] is False
    other = save_run(make_run(), tmp_path, name="sweep")
    assert other.name == "sweep-2.json"
    assert len(load_runs(tmp_path).runs) == 2


@pytest.mark.parametrize(
    "name",
    [
        "../evil",
        "../../etc/passwd",
        "/tmp/abs",
        "a/b/c",
        "..\\..\\win",
        "sub/../../x.json",
        "...hidden",
        "ok name: v2",
    ],
)
def test_names_cannot_escape_results_dir(tmp_path, name):
    folder = tmp_path / "results"
    path = save_run(make_run(), folder, name=name)
    assert path.resolve().parent == folder.resolve()
    assert not path.name.startswith(".") and ".." not in path.name and path.suffix == ".json"
    assert files_in(tmp_path) == ["results"]


@pytest.mark.parametrize("name", ["..", "/", "", "../.."])
def test_names_with_nothing_left_are_rejected(tmp_path, name):
    with pytest.raises(ResultsError, match="cannot be used as a file name"):
        save_run(make_run(), tmp_path, name=name)


def test_invalid_runs_are_refused_on_save(tmp_path):
    run = make_run()
    run["kind"] = "../escape"
    with pytest.raises(ResultsError, match="kind"):
        save_run(run, tmp_path)
    with pytest.raises(ResultsError, match="list of row objects"):
        new_run("memory", {}, {"t": [1, 2]})
    with pytest.raises(ResultsError, match="cannot store"):
        save_run(make_run(rows=[{"x": object()}]), tmp_path)
    assert files_in(tmp_path) == []


def test_table_frame_combines_runs_from_different_machines(tmp_path):
    save_run(make_run(device_name="NVIDIA H200"), tmp_path)
    save_run(make_run(device_name="AMD EPYC", dtype="bfloat16"), tmp_path)
    batch_rows = [{"batch_size": 8, "latency_ms": 7.0}, {"batch_size": None, "latency_ms": 6.0}]
    save_run(make_run(rows=batch_rows), tmp_path)
    runs = load_runs(tmp_path).runs
    frame = table_frame(runs, "latency")
    assert len(frame) == 6
    assert set(RUN_COLUMNS) <= set(frame.columns)
    assert set(frame["device_name"]) == {"NVIDIA H200", "AMD EPYC"}
    assert set(frame["dtype"]) == {"float32", "bfloat16"}
    # A row's own batch_size wins; the run's fills the gap.
    assert sorted(frame["batch_size"].dropna().astype(int)) == [1, 1, 1, 1, 1, 8]
    assert frame["label"].str.contains("AMD EPYC").any()
    empty = table_frame(runs, "no_such_table")
    assert empty.empty and set(RUN_COLUMNS) <= set(empty.columns)
    assert table_frame([], "latency").empty


def test_run_label():
    run = make_run(partial=True)
    label = run_label(run)
    assert "NVIDIA H200" in label and "gpt2" in label and "batch 1" in label
    assert label.endswith("(partial)")
    run["meta"]["label"] = "my label"
    assert run_label(run) == "my label"


def test_reference_run_is_shipped_in_our_schema():
    assert results.REFERENCE_PATH.is_relative_to(results.REPO_ROOT)
    ref = reference_run()
    assert ref["kind"] == "reference" and ref["meta"]["device_name"] == "NVIDIA A40 (published)"
    assert ref["meta"]["weights"] == "pretrained" and ref["meta"]["source"]
    assert {"latency", "achieved", "end_to_end", "memory_first_attempt"} <= set(ref["tables"])
    latency = table_frame([ref], "latency").set_index(["mode", "context_len"])["latency_ms"]
    assert latency[("cached", 1000)] == 4.95 and latency[("uncached", 1000)] == 29.69
    e2e = table_frame([ref], "end_to_end").set_index("mode")
    assert e2e.loc["uncached", "total_s"] == 14.66 and e2e.loc["cached", "total_s"] == 5.03
    assert e2e.loc["cached", "new_tokens"] == 1016
    memory = table_frame([ref], "memory_first_attempt")
    # Published "formula" column is the KV payload: 72 KiB per token.
    assert all(math.isclose(r.formula_mib, r.context_len * 72 / 1024) for r in memory.itertuples())


def test_reference_folder_is_loaded_only_when_asked():
    folder = results.REFERENCE_PATH.parent.parent
    assert all(r["kind"] != "reference" for r in load_runs(folder).runs)
    assert any(r["kind"] == "reference" for r in load_runs(folder, recursive=True).runs)


def test_a_copy_inside_another_repository_does_not_take_its_commit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """First light: the tree copied to the GPU machine sat inside another git repository, and
    every run carried that repository's commit. Such a copy says KVLAB_GIT_REV, or nothing."""
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args],
                       cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    git("commit", "-q", "--allow-empty", "-m", "another project")
    (tmp_path / "copy").mkdir()
    monkeypatch.setattr(results, "REPO_ROOT", tmp_path / "copy")
    monkeypatch.delenv("KVLAB_GIT_REV", raising=False)
    assert results._git_rev() is None
    monkeypatch.setattr(results, "REPO_ROOT", tmp_path)  # the repository's own root: its commit
    own = results._git_rev()
    assert own is not None and len(own) == 12
    monkeypatch.setenv("KVLAB_GIT_REV", "d1ff11f0774f")  # a copy's caller knows better (run 1)
    assert results._git_rev() == "d1ff11f0774f"


def test_a_page_names_a_saved_run_relative_to_the_project(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Never this machine's absolute path: it ends up in screenshots and shared pages."""
    from ui.state import REPO_ROOT, shown_path

    monkeypatch.delenv("KVLAB_RESULTS_DIR", raising=False)
    assert shown_path(REPO_ROOT / "results" / "a.json") == "results/a.json"
    monkeypatch.setenv("KVLAB_RESULTS_DIR", str(tmp_path / "runs"))
    assert shown_path(tmp_path / "runs" / "b.json") == "$KVLAB_RESULTS_DIR/b.json"
    assert shown_path(Path.home() / "c.json") == "~/c.json"
