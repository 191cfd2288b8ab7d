"""The Prefix cache page through Streamlit's AppTest on the test shapes: each of its three
experiments runs in the measuring process, is saved, and draws (TTFT against P with its
prediction; the chat with and without reuse; the workload's budgets and its tree, step by step);
bad input gives a message, not a run. And its figure builders alone: the tree's lanes, the
evictions beneath, the prediction beside the measurement."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from instruments.store.results import load_runs
from ui.apptest import charts, no_traceback, open_page, wait_job
from ui.figures_prefix import lanes, tree_figure, ttft_figure

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVLAB_TINY", "1")
    monkeypatch.setenv("KVLAB_RESULTS_DIR", str(tmp_path))
    return tmp_path


def test_ttft_against_the_cached_prefix_runs_and_draws(results: Path) -> None:
    at = open_page("prefix")
    at.text_input(key="prefix_lens").set_value("16, 48")
    at.text_input(key="prefix_shares").set_value("0, 0.5, 1")
    at.number_input(key="prefix_tree").set_value(64)
    at.number_input(key="prefix_repeats").set_value(1)
    at.button(key="prefix_ttft_go").click().run()
    job = wait_job(at, "prefix_ttft_job", 240)
    assert job.state == "done", job.error
    rows = job.run["tables"]["ttft"]
    assert [r["cached_tokens"] for r in rows] == [0, 8, 15, 0, 24, 47]
    assert all(r["exact"] for r in rows) and rows[0]["tree_tokens"] >= 64
    assert any("Lookup: at most" in c.value for c in at.caption)
    assert len(charts(at)) >= 1
    (run,) = load_runs(results).runs
    assert run["kind"] == "prefix_ttft"


def test_the_workload_draws_its_budgets_and_its_tree(results: Path) -> None:
    at = open_page("prefix")
    at.text_input(key="load_budgets").set_value("0.4, 1.5")
    at.number_input(key="load_requests").set_value(10)
    at.number_input(key="load_new").set_value(2)
    at.button(key="prefix_load_go").click().run()
    job = wait_job(at, "prefix_load_job", 240)
    assert job.state == "done", job.error
    labels = [r["label"] for r in job.run["tables"]["budgets"]]
    assert labels == ["0.4 MiB", "1.5 MiB", "no reuse"]
    assert {r["step"] for r in job.run["tables"]["tree"]} == set(range(10))
    steps = at.select_slider(key="load_step")
    evicting = [e["step"] for e in job.run["tables"].get("evictions", [])]
    assert steps.value == (max(evicting) if evicting else 9)  # the last step that evicted
    steps.set_value(3).run()
    no_traceback(at)
    assert len(charts(at)) == 3  # budgets, bytes held, the tree


def test_the_chat_runs_on_a_llama(results: Path) -> None:
    at = open_page("prefix", {"model": "llama-tiny"})
    at.number_input(key="chat_turns").set_value(2)
    at.number_input(key="chat_answer").set_value(4)
    at.number_input(key="chat_repeats").set_value(1)
    at.button(key="prefix_chat_go").click().run()
    job = wait_job(at, "prefix_chat_job", 240)
    assert job.state == "done", job.error
    turns = job.run["tables"]["turns"]
    assert [(r["turn"], r["mode"]) for r in turns] == [(1, "no reuse"), (1, "reuse"),
                                                      (2, "no reuse"), (2, "reuse")]
    assert turns[3]["cached_tokens"] > turns[1]["prompt_tokens"] - 2  # turn one came back
    assert all(r["identical"] for r in turns)


@pytest.mark.parametrize("key, text, says", [
    ("load_budgets", "0.01", "smaller than one request's blocks"),
    ("load_budgets", "a lot", "cannot read the budgets"),
    ("prefix_lens", "1, 5", "prompt length 1 is outside 2..128"),
    ("prefix_shares", "0.5, 2", "within 0..1")])
def test_bad_input_says_what_is_allowed(results: Path, key: str, text: str, says: str) -> None:
    at = open_page("prefix")
    at.text_input(key=key).set_value(text).run()
    at.button(key="prefix_load_go" if key.startswith("load") else "prefix_ttft_go").click().run()
    no_traceback(at)
    assert any(says in e.value for e in at.error), [e.value for e in at.error]
    assert "prefix_load_job" not in at.session_state and "prefix_ttft_job" not in at.session_state


def _tree() -> tuple[pd.DataFrame, pd.DataFrame]:
    rows = [dict(node=1, parent=0, start=0, end=20, tokens=20, blocks=2, shared_blocks=1,
                 max_ref=3, lock=1, last_used=5),
            dict(node=2, parent=1, start=20, end=30, tokens=10, blocks=2, shared_blocks=1,
                 max_ref=2, lock=0, last_used=4),
            dict(node=3, parent=1, start=20, end=26, tokens=6, blocks=1, shared_blocks=0,
                 max_ref=1, lock=1, last_used=5),
            dict(node=4, parent=0, start=0, end=9, tokens=9, blocks=1, shared_blocks=0,
                 max_ref=1, lock=0, last_used=2)]
    tree = pd.DataFrame([{**r, "step": 7} for r in rows])
    gone = pd.DataFrame([dict(step=7, node=9, parent=0, start=0, end=12, blocks=1,
                              blocks_freed=1, last_used=1, clock=6)])
    return tree, gone


def test_the_tree_stacks_each_node_over_its_leaves() -> None:
    tree, gone = _tree()
    span = lanes(tree)
    assert span == {2: (0.0, 1.0), 3: (1.0, 2.0), 1: (0.0, 2.0), 4: (2.0, 3.0)}
    fig = tree_figure(tree, gone, 7)
    boxes = [t for t in fig.data if t.fill == "toself"]
    assert len(boxes) == 4
    in_use = [t for t in boxes if t.line.width == 3]
    assert len(in_use) == 2  # nodes 1 and 3: the running request's path
    evicted = [t for t in fig.data if t.name == "evicted at this step"]
    assert len(evicted) == 1 and list(evicted[0].x) == [0, 12]
    assert not [t for t in tree_figure(tree, gone, 8).data if t.fill == "toself"]


def test_ttft_draws_the_prediction_beside_the_measurement() -> None:
    df = pd.DataFrame([dict(prompt_len=64, cached_tokens=p, new_tokens=64 - p, ttft_ms=t,
                            predicted_ms=t * 0.95, extend_ms=t * 0.97, lookup_ms=0.02,
                            tree_tokens=8192) for p, t in ((0, 40.0), (32, 21.0), (63, 2.0))])
    names = [t.name for t in ttft_figure(df).data]
    assert names == ["N = 64: measured", "N = 64: prefill of the N − P new tokens alone + lookup",
                     "N = 64: the new tokens after the prefix, contiguous cache",
                     "N = 64: the lookup"]
