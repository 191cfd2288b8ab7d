"""The Serving page's figure builders alone, on synthetic rows whose every number is known and on
a real serving run of llama-tiny (concurrency and budget, no peers): each point's steps laid end
to end, the batch and the pool read from their own columns (own + shared + tree + free = the
pool, at every real step), the curves on the experiment's own x with p50 and p99 apart, the
decode step against its floor from the rows labelled "all", and the host named on every figure.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from ui.figures_serving import (
    axis,
    batch_figure,
    experiment_of,
    host,
    latency_figure,
    points_table,
    pool_figure,
    step_figure,
    throughput_figure,
    timeline,
)
from ui.figures_serving_runs import (
    budget_figure,
    budget_timeline_figure,
    overlay_figure,
    schedule_figure,
)
from ui.state import REPO_ROOT, shown_path

META = {"model": "llama-tiny", "dtype": "float32", "device": "cpu", "device_name": "Test CPU 9",
        "threads": 2, "platform": "Linux-test-x86_64", "block_tokens": 16}


def _step(label: str, t: float, running: int, waiting: int, preempted: int = 0, *,
          held: int = 4, shared: int = 1, tree: int = 2, blocks: int = 10) -> dict:
    return dict(label=label, step=0, t_s=t, schedule_ms=0.1, step_ms=5.0, batch=running + 1,
                decodes=running, tokens=running, prefill_tokens=0, emitted=running,
                contexts=[], preempted=preempted, running=running, waiting=waiting,
                blocks_running=held, blocks_shared=shared, blocks_tree=tree,
                blocks_free=blocks - held - tree, blocks=blocks)


def steps() -> pd.DataFrame:
    return pd.DataFrame([_step("C=1", 0.5, 1, 0), _step("C=1", 1.0, 1, 0),
                         _step("C=4", 0.2, 3, 1, held=6), _step("C=4", 0.4, 4, 2, 1, held=8),
                         _step("C=4", 0.7, 0, 0, held=0, shared=0, tree=5)])


def points(**cols: list) -> pd.DataFrame:
    n = len(next(iter(cols.values())))
    base = dict(label=[f"p{i}" for i in range(n)], requests=[100] * n,
                output_tok_s=[10.0 * (i + 1) for i in range(n)], requests_s=[1.0] * n,
                batch_mean=[1.5] * n, batch_max=[2] * n, preemptions=[i for i in range(n)],
                ttft_mean_ms=[999.0] * n, ttft_p50_ms=[100.0 + i for i in range(n)],
                ttft_p99_ms=[300.0 + i for i in range(n)], ttft_n=[100] * n,
                tpot_mean_ms=[999.0] * n, tpot_p50_ms=[20.0 + i for i in range(n)],
                tpot_p99_ms=[None] * n, tpot_n=[100] * n, hit_rate=[0.25 * i for i in range(n)])
    return pd.DataFrame({**base, **cols})


def named(fig, name: str):  # noqa: ANN001, ANN201 (plotly objects)
    found = [t for t in fig.data if t.name == name]
    assert len(found) == 1, [t.name for t in fig.data]
    return found[0]


def test_each_point_is_laid_after_the_last() -> None:
    df = timeline(steps())
    assert list(df["clock_s"]) == pytest.approx([0.5, 1.0, 1.2, 1.4, 1.7])
    assert list(df["first"]) == [True, False, True, False, False]


def test_the_batch_is_read_from_its_own_columns() -> None:
    fig = batch_figure(steps(), META)
    assert list(named(fig, "running").y) == [1, 1, 3, 4, 0]
    assert list(named(fig, "waiting (arrived, not running)").y) == [0, 0, 1, 2, 0]
    crosses = named(fig, "preempted (recomputed later)")
    assert list(crosses.x) == pytest.approx([1.4]) and list(crosses.y) == [4]
    assert [a.text for a in fig.layout.annotations] == ["C=1", "C=4"]  # where each began


def test_the_pool_stacks_to_its_size_and_counts_blocks_per_request() -> None:
    fig = pool_figure(steps(), META)
    stacked = [t for t in fig.data if t.stackgroup == "pool"]
    assert [t.name for t in stacked] == ["held by running requests alone",
                                         "shared by several holders",
                                         "held by the prefix tree alone", "free"]
    assert list(stacked[0].y) == [3, 3, 5, 7, 0]  # own = held - shared
    assert list(stacked[2].y) == [2, 2, 2, 2, 5]
    total = np.sum([np.asarray(t.y, float) for t in stacked], axis=0)
    assert list(total) == [10] * 5
    per = named(fig, "held blocks per running request (right)").y
    assert list(per[:4]) == [4, 4, 2, 2] and math.isnan(per[4])  # none running: no ratio
    assert "blocks of 16 tokens" in fig.layout.yaxis.title.text


@pytest.mark.parametrize("exp, cols, x", [
    ("concurrency", dict(concurrency=[1, 4, 16]), [1, 4, 16]),
    ("budget", dict(budget_tokens=[48, 96, 480]), [48, 96, 480]),
])
def test_the_curves_run_along_the_experiments_x(exp: str, cols: dict, x: list) -> None:
    df = points(**cols)
    assert experiment_of(df) == exp
    tput = throughput_figure(df, META)
    assert list(tput.data[0].x) == x and list(tput.data[0].y) == [10.0, 20.0, 30.0]
    lat = latency_figure(df, META)
    ttfts = {t.name: list(t.y) for t in lat.data if t.yaxis == "y"}
    assert ttfts == {"measured p50": [100.0, 101.0, 102.0], "measured p99": [300.0, 301.0, 302.0]}
    tpots = {t.name: list(t.y) for t in lat.data if t.yaxis == "y2"}
    assert tpots == {"measured p50": [20.0, 21.0, 22.0]}  # no TPOT p99: below 100 samples
    assert "TTFT" in lat.layout.yaxis.title.text and "TPOT" in lat.layout.yaxis2.title.text


def test_load_draws_one_line_per_way_and_peers_only_where_they_ran() -> None:
    df = points(way=["single", "continuous"] * 2, rate_per_s=[1.0, 1.0, 4.0, 4.0])
    assert experiment_of(df) == "load"
    peers = pd.DataFrame([dict(peer="hf", concurrency=4, ok=True, why="", output_tok_s=7.0,
                               tokens_equal=True),
                          dict(peer="ct2", concurrency=4, ok=False, why="missing",
                               output_tok_s=None, tokens_equal=None)])
    fig = throughput_figure(df, META, peers)
    assert [t.name for t in fig.data] == ["single", "continuous", "peer: hf"]
    assert list(named(fig, "continuous").y) == [20.0, 40.0]
    assert "arrival rate (requests/s" in fig.layout.xaxis.title.text


def test_the_step_is_drawn_beside_its_floor_and_the_overtaking_batch_marked() -> None:
    rows = [dict(label=lab, batch=b, steps=3, step_ms=ms, step_samples_ms=[ms, ms * 1.1],
                 floor_ms=fl, weights_read_ms=0.5, kv_read_ms=kv, compute_ms=0.1,
                 over_floor=ms / fl)
            for lab, b, ms, fl, kv in (("all", 1, 2.0, 0.6, 0.1), ("all", 8, 3.0, 1.4, 0.9),
                                       ("C=8", 8, 50.0, 9.0, 9.0))]
    fig = step_figure(pd.DataFrame(rows), {**META, "kv_overtakes_batch": 8})
    assert list(named(fig, "median step (measured)").y) == [2.0, 3.0]  # "all" alone
    floor = [t for t in fig.data if str(t.name).startswith("floor")]
    assert list(floor[0].y) == [0.6, 1.4]
    assert list(named(fig, "K/V read (computed)").y) == [0.1, 0.9]
    assert fig.layout.shapes[0].x0 == 8
    assert "batch 8" in fig.layout.annotations[0].text


def test_budget_and_schedule_figures_read_their_columns() -> None:
    df = points(budget_tokens=[480, 48, 96])
    fig = budget_figure(df, META)
    assert list(fig.data[0].x) == ["48", "96", "480"]  # sorted by budget
    assert list(fig.data[0].y) == [1, 2, 0]  # the preemptions follow their budget
    timeline_fig = budget_timeline_figure(steps(), META)
    assert [t.name for t in timeline_fig.data if t.showlegend is not False] == ["C=1", "C=4"]
    (cross,) = [t for t in timeline_fig.data if t.mode == "markers"]
    assert list(cross.x) == [0.4] and list(cross.y) == [4]  # C=4's preemption, on its clock
    pol = points(policy=["fcfs", "lpm"], budget_tokens=[256, 256], evictions=[3, 1])
    assert experiment_of(pol) == "schedule"
    sched = schedule_figure(pol, META)
    assert list(sched.data[0].y) == [0.0, 0.25]
    assert list(named(sched, "TTFT p50 (ms, right)").y) == [100.0, 101.0]


def test_saved_runs_overlay_one_colour_per_run_one_dash_per_way() -> None:
    one = points(way=["single", "continuous"], rate_per_s=[2.0, 2.0]).assign(run="A · host 1")
    two = points(way=["single", "continuous"], rate_per_s=[2.0, 2.0]).assign(run="B · host 2")
    fig = overlay_figure(pd.concat([one, two]), "output_tok_s", "output tokens/s", "load")
    assert [t.name for t in fig.data] == ["A · host 1 · single", "A · host 1 · continuous",
                                          "B · host 2 · single", "B · host 2 · continuous"]
    assert fig.data[0].line.color == fig.data[1].line.color != fig.data[2].line.color
    assert fig.data[0].line.dash != fig.data[1].line.dash


def test_every_figure_names_its_host_and_the_table_its_units() -> None:
    said = host(META)
    assert said == "llama-tiny, float32 on Test CPU 9 (cpu, 2 threads), Linux-test-x86_64"
    df = points(concurrency=[1, 2, 4])
    for fig in (batch_figure(steps(), META), pool_figure(steps(), META),
                throughput_figure(df, META), latency_figure(df, META),
                step_figure(pd.DataFrame(columns=["label"]), META),
                budget_figure(points(budget_tokens=[48, 96, 480]), META),
                budget_timeline_figure(steps(), META), schedule_figure(pd.DataFrame(), META)):
        assert said in fig.layout.title.text
        axes = fig.layout.to_plotly_json()
        assert any(axes[k].get("title", {}).get("text") for k in axes if k.startswith("xaxis"))
        assert all(axes[k].get("title", {}).get("text") for k in axes if k.startswith("yaxis"))
    table = points_table(df)
    assert "output tok/s (measured)" in table and "TTFT p99 (ms)" in table
    assert "ttft_mean_ms" not in table  # the page lists p50 and p99


def test_a_run_saved_inside_the_project_is_named_from_its_root() -> None:
    assert shown_path(REPO_ROOT / "results" / "a.json") == "results/a.json"
    assert shown_path("/elsewhere/a.json") == "a.json"  # never the machine's absolute path


# ------------------------------------------------------------------------- a real tiny run
@pytest.fixture(scope="module")
def real_runs() -> dict[str, dict]:
    from instruments import experiments
    from instruments.experiments.serving import ServingParams
    from instruments.spine import ModelSpec, load

    loaded = load(ModelSpec("llama-tiny", "random", "cpu", "float32"))
    out = {}
    for exp in ("concurrency", "budget"):
        p = ServingParams.defaults("cpu", loaded.model.config)
        p.experiment, p.peers, p.rounds, p.requests = exp, False, 1, 6
        out[exp] = experiments.get("serving").run(loaded, p)
    return out


@pytest.mark.timeout(300)
def test_a_real_run_draws_every_step_and_its_pool_adds_up(real_runs: dict[str, dict]) -> None:
    for exp, run in real_runs.items():
        meta, tables = run["meta"], run["tables"]
        s, pts = pd.DataFrame(tables["steps"]), pd.DataFrame(tables["points"])
        assert experiment_of(pts) == exp  # the meta says "serving", the points say which
        batch = batch_figure(s, meta)
        assert list(named(batch, "running").y) == list(s["running"])
        pool = pool_figure(s, meta)
        total = np.sum([np.asarray(t.y, float) for t in pool.data if t.stackgroup], axis=0)
        assert list(total) == list(s["blocks"])  # own + shared + tree + free, every step
        assert meta["device_name"] in batch.layout.title.text
        tput = throughput_figure(pts, meta)
        x = axis(pts, meta)[0]
        if exp == "budget":  # a line per K/V dtype, the model's own first
            first = pts[pts["kv_dtype"] == pts["kv_dtype"].iloc[0]].sort_values(x)
            assert len(tput.data) == pts["kv_dtype"].nunique() == 2
        else:  # bars (schedule) in the points' order; lines sorted along x
            first = pts if exp == "schedule" else pts.sort_values(x)
        assert list(tput.data[0].y) == list(first["output_tok_s"])
    conc = real_runs["concurrency"]
    steps_all = pd.DataFrame(conc["tables"]["batch_steps"])
    fig = step_figure(steps_all, conc["meta"])
    alone = steps_all[steps_all["label"] == "all"]
    assert list(named(fig, "median step (measured)").x) == list(alone["batch"])
    budget = real_runs["budget"]
    bfig = budget_figure(pd.DataFrame(budget["tables"]["points"]), budget["meta"])
    assert sum(bfig.data[0].y) == sum(r["preemptions"] for r in budget["tables"]["points"])
