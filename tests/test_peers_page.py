"""The Peers page and its figures: it renders in a server that never imports torch, its chart
draws every engine in its registry colour with the read floor, its table is one context's rows
fastest first; the benchmark script runs the experiment per thread count and prints the table.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from instruments import lineup
from instruments.lineup import peers
from ui.figures_peers import not_run, peers_figure, peers_table

ROOT = Path(__file__).resolve().parents[1]
SERVER = """
import os, sys
os.environ["KVLAB_TINY"] = "1"
os.environ["KVLAB_RESULTS_DIR"] = sys.argv[1]
from streamlit.testing.v1 import AppTest
at = AppTest.from_file("app.py", default_timeout=120)
at.run()
at.switch_page("views/peers.py")
at.run()
assert not at.exception, [e.message for e in at.exception]
print("title:", at.title[0].value)
print("button:", [b.label for b in at.button])
print("torch loaded:", "torch" in sys.modules)
"""


@pytest.mark.timeout(300)
def test_the_peers_page_renders_without_torch_in_the_server(tmp_path: Path) -> None:
    pytest.importorskip("streamlit")
    out = subprocess.run([sys.executable, "-c", SERVER, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "title: Peers" in out.stdout and "Time the peers" in out.stdout
    assert "torch loaded: False" in out.stdout, out.stdout


def _rows() -> pd.DataFrame:
    base = {"precision": "float32", "p90_ms": None, "x_fastest_exact": 1.0, "version": "v",
            "weight_bytes": 5e8, "logits_max_abs_diff": 1e-6, "conversion_s": 1.0}
    rows = [{**base, "engine": e, "kind": k, "context_len": t, "latency_ms": ms * (t / 128),
             "rounds_ms": [ms, ms * 1.1], "floor_ms": 10.0 * (1 + t / 1024), "x_floor": 2.0}
            for e, k, ms in (("fast", "mode", 30.0), ("ct2_float32", "peer", 25.0))
            for t in (128, 512)]
    rows.append({"engine": "ort_float32", "latency_ms": None, "available": False,
                 "why": "pip install onnxruntime==1.32.0 onnx==1.23.2"})
    return pd.DataFrame(rows)


def test_the_figure_draws_each_engine_in_its_colour_and_the_read_floor() -> None:
    fig = peers_figure(_rows())
    lines = {t.name: t for t in fig.data if t.mode == "lines+markers"}
    assert set(lines) == {lineup.label("fast"), peers.PEERS["ct2_float32"].label,
                          "read floor (measured)"}
    assert lines[lineup.label("fast")].line.color == lineup.color("fast")
    assert lines[peers.PEERS["ct2_float32"].label].line.dash == "dot"  # peers dotted
    assert list(lines["read floor (measured)"].y) == [11.25, 15.0]
    assert fig.layout.xaxis.title.text == "context length (tokens)"
    assert fig.layout.yaxis.title.text == "time per token (ms)"
    assert len(peers_figure(pd.DataFrame()).data) == 0


def test_the_table_is_one_context_fastest_first_and_the_skipped_are_listed() -> None:
    table = peers_table(_rows(), 512)
    assert list(table["engine"]) == ["ct2_float32", "fast"]
    assert {"median (ms)", "× read floor", "× our fastest exact", "weights held (MB)",
            "logits max |Δ| vs mode 1", "version"} <= set(table.columns)
    assert table["weights held (MB)"].iloc[0] == 500
    skipped = not_run(_rows())
    assert list(skipped["engine"]) == ["ort_float32"] and "pip install" in skipped["why"][0]
    assert list(skipped["status"]) == ["unavailable"]


@pytest.mark.timeout(600)
def test_the_bench_script_runs_the_experiment_and_prints_the_table(tmp_path: Path) -> None:
    name = next((n for n in ("ct2_float32", "hf_dynamic") if peers.available(n, "cpu")[0]),
                None)
    if name is None:
        pytest.skip("no peer package installed")
    out = subprocess.run([sys.executable, "scripts/bench_peers.py", "--tiny", "--threads", "1",
                          "--contexts", "32", "--peers", name, "--modes", "concat", "--out",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=580)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "## 1 thread (`peers --model tiny" in out.stdout
    assert "| engine | precision | context | median (ms) |" in out.stdout
    assert f"| {name} | float32 | 32 |" in out.stdout and "At 32 tokens, float32:" in out.stdout
    assert len(list(tmp_path.glob("*_peers_*.json"))) == 1
