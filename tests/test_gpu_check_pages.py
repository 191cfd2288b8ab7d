"""The device check's pages stage on a CPU (the tiny shape): every page the router offers is
drawn on the check's device and model, the cheap Runs are pressed and their runs saved under
OUT/pages, and a page that raises fails the stage by name while the other pages still run.
Needs streamlit and plotly (not collected where they are missing, like the other page tests).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from instruments.store.results import load_runs
from ui import header
from ui.apptest import routed_pages

from .test_gpu_check import check_module, last_line, stage

pytestmark = pytest.mark.timeout(300)


def test_the_pages_stage_runs_every_page_and_names_the_one_that_raises(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    real = header.page

    def page(title: str, caption: str):  # noqa: ANN202
        if title == "Memory":
            raise RuntimeError("planted: the Memory page broke")
        return real(title, caption)

    monkeypatch.setattr(header, "page", page)
    gpu_check = check_module(monkeypatch)
    status = gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path),
                             "--total-s", "200", "--stages", "pages"])
    assert status == 1 and last_line(capsys.readouterr().out) == "failed stages: pages"
    got = stage(tmp_path, "pages")
    said = got["error"]["message"]
    assert said.startswith("1 page(s) failed: memory (PageError: ") and "Memory page broke" in said
    rows = {r["page"]: r for r in got["details"]["pages"]}
    assert list(rows) == routed_pages() and got["details"]["device"] == "cpu"
    assert [p for p, r in rows.items() if r["error"]] == ["memory"]
    pressed = {p: r["job"] for p, r in rows.items() if r["ran"]}
    assert pressed == {"overview": "done", "generate": "done", "sweep": "done",
                       "planner": "done", "correctness": "done"}  # memory raised first
    kinds = sorted(r["kind"] for r in load_runs(tmp_path / "pages").runs)
    assert kinds == ["correctness", "generation", "hardware", "kv_planner", "latency_sweep"]
    assert all(r["meta"]["model"] == "tiny" for r in load_runs(tmp_path / "pages").runs)
    assert json.loads((tmp_path / "summary.json").read_text())["failed"] == ["pages"]
