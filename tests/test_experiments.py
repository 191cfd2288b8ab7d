"""The headless CLI: a tiny run end to end, plots from saved files, bad input, Ctrl-C."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from instruments import cli
from instruments.store import frames, results
from ui import plots

TINY_ALL = ["--model", "tiny", "--contexts", "4,8,16", "--repeats", "1", "--new-tokens", "6",
            "--memory-contexts", "16,32", "--crossover-batches", "1,4", "--no-progress"]


@pytest.fixture(scope="module")
def all_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("results")
    assert cli.main(["all", *TINY_ALL, "--results-dir", str(folder)]) == 0
    return folder


def test_all_writes_one_loadable_file_per_experiment(all_dir: Path) -> None:
    loaded = results.load_runs(all_dir)
    assert loaded.skipped == []
    kinds = sorted(r["kind"] for r in loaded.runs)
    assert kinds == ["hardware", "latency_sweep", "memory"]
    assert len({r["meta"]["group"] for r in loaded.runs}) == 1
    sweep_run = next(r for r in loaded.runs if r["kind"] == "latency_sweep")
    meta = sweep_run["meta"]
    assert meta["model"] == "tiny" and meta["repeats"] == 1 and meta["partial"] is False
    assert meta["device"] == "cpu" and meta["dtype"] == "float32" and meta["batch_size"] == 1
    hardware = next(r for r in loaded.runs if r["kind"] == "hardware")
    # The sweep carries the peaks the hardware step measured in the same process.
    assert meta["peaks"]["measured"] == hardware["meta"]["peaks"]["measured"]
    assert meta["peaks"]["measured"]["matmul_tflops"] > 0
    df = frames.table_frame(loaded.runs, "latency")
    assert len(df) == 9 and set(df["mode"]) == {"uncached", "concat", "fast"}  # CPU defaults
    assert set(df["context_len"]) == {4, 8, 16} and (df["latency_ms"] > 0).all()
    e2e = frames.table_frame(loaded.runs, "end_to_end")  # the sweep's end-to-end part
    assert list(e2e["new_tokens"]) == [6, 6, 6]
    assert len(frames.table_frame(loaded.runs, "cumulative")) == 18
    kv = frames.table_frame(loaded.runs, "kv_memory")
    assert (kv["kv_tensor_bytes"] == kv["kv_formula_bytes"]).all()
    assert not frames.table_frame(loaded.runs, "crossover").empty


def test_plots_write_html(all_dir: Path, tmp_path: Path) -> None:
    assert plots.main(["--results-dir", str(all_dir), "--figures-dir", str(tmp_path)]) == 0
    names = {p.name for p in tmp_path.glob("*.html")}
    assert "latency_overlay.html" in names
    for part in ("_latency.html", "_cumulative.html", "_kv_memory.html", "_breakdown.html"):
        assert any(n.endswith(part) for n in names), part
    assert (tmp_path / "plotly.min.js").exists()  # figures work offline
    assert plots.main(["--results-dir", str(all_dir)]) == 0
    assert list((all_dir / "figures").glob("*.html"))


@pytest.mark.parametrize("argv", [
    [], ["sweep", "--bogus"], ["sweep", "--model", "nope"],
    ["sweep", "--model", "tiny", "--contexts", "abc"],
    ["sweep", "--model", "tiny", "--contexts", "500"],
    ["sweep", "--model", "tiny", "--batch", "0"],
    ["sweep", "--model", "tiny", "--repeats", "0"],
    ["sweep", "--model", "tiny", "--modes", "nope"],
    ["sweep", "--model", "tiny", "--device", "tpu"],
    ["sweep", "--model", "tiny", "--dtype", "int4"],
    ["sweep", "--model", "tiny", "--weights", "pretrained"],
    ["e2e", "--model", "tiny", "--new-tokens", "500"],
    ["memory", "--model", "tiny", "--memory-contexts", "0"],
])
def test_bad_arguments_exit_2_with_one_line(argv: list[str], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*argv, "--results-dir", str(tmp_path)] if argv else argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("instruments: error:") and "\n" not in err
    assert not list(tmp_path.glob("*.json"))


def test_ctrl_c_saves_a_partial_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = cli._Progress.__call__
    sent: list[int] = []

    def interrupt_after_two_rows(self: cli._Progress, p: object) -> None:
        original(self, p)
        if len(self.rows.tables.get("latency", [])) == 2 and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends, once

    monkeypatch.setattr(cli._Progress, "__call__", interrupt_after_two_rows)
    rc = cli.main(["sweep", "--model", "tiny", "--contexts", "4-40:4", "--repeats", "1",
                   "--modes", "uncached", "--no-progress", "--no-peaks", "--new-tokens", "0",
                   "--results-dir", str(tmp_path)])
    assert rc == 130
    (run,) = results.load_runs(tmp_path).runs
    assert run["meta"]["partial"] is True and "stopped" in run["meta"]["note"]
    assert 2 <= len(run["tables"]["latency"]) < 10


def test_the_cli_saves_the_run_the_page_would(tmp_path: Path) -> None:
    """One spine: the CLI's sweep run has the tables and meta a page's sweep run has."""
    from instruments.experiments.latency import LatencyParams

    assert cli.main(["sweep", "--model", "tiny", "--contexts", "4,8", "--repeats", "1",
                     "--new-tokens", "4", "--no-progress", "--no-peaks",
                     "--results-dir", str(tmp_path)]) == 0
    (run,) = results.load_runs(tmp_path).runs
    assert set(run["tables"]) == {"latency", "checks", "summary", "end_to_end", "cumulative"}
    fields = set(LatencyParams.__dataclass_fields__)
    assert fields <= set(run["meta"])  # every parameter recorded, as a page's run records it
    assert run["meta"]["experiment"] == "latency_sweep" and run["meta"]["e2e_new_tokens"] == 4
