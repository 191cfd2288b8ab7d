"""Figure builders: pure functions, DataFrame in, plotly Figure out, titled axes, right traces."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import pytest

from engine import GPTConfig
from instruments.costmodel import costs
from instruments.costmodel.costs import crossover_grid
from ui.figures import (
    cumulative_figure,
    latency_figure,
    mode_color,
    ordered_modes,
    overlay_figure,
    step_latency_figure,
)
from ui.figures_memory import (
    breakdown_figure,
    check_matrix_figure,
    crossover_figure,
    kv_memory_figure,
    mask_figure,
)
from ui.figures_perf import (
    Ceiling,
    achieved_table,
    reduction_figure,
    reductions,
    roofline_figure,
    throughput_figure,
)

CFG = GPTConfig()
CONTEXTS = [10, 100, 500, 1000]


def sweep_rows() -> pd.DataFrame:
    rows = []
    for mode, cached, base in (("uncached", False, 5.0), ("concat", True, 4.9)):
        for t in CONTEXTS:
            ms = base + (t / 40 if not cached else 0.0)
            flops = costs.step_flops(CFG, t, cached=cached)
            nbytes = costs.step_bytes(CFG, "float32", t, cached=cached)
            rows.append({"mode": mode, "mode_label": f"label {mode}", "cached": cached,
                         "context_len": t, "latency_ms": ms, "samples_ms": [ms, ms * 1.1],
                         "flops": flops, "tflops": flops / (ms / 1e3) / 1e12, "bytes": nbytes})
    return pd.DataFrame(rows)


def titles(fig: go.Figure) -> tuple[str, str]:
    return fig.layout.xaxis.title.text or "", fig.layout.yaxis.title.text or ""


def assert_titled(fig: go.Figure, x_unit: str, y_unit: str) -> None:
    x, y = titles(fig)
    assert x_unit in x, x
    assert y_unit in y, y
    assert all(t.hovertemplate or t.hoverinfo == "skip" for t in fig.data)


def test_every_ladder_mode_has_its_own_colour() -> None:
    from engine.modes import MODES

    colours = [mode_color(m) for m in MODES]
    assert len(set(colours)) == len(colours) and mode_color("zzz") not in colours
    assert mode_color("cached") == mode_color("concat")
    assert ordered_modes(["concat", "x", "uncached"]) == ["uncached", "concat", "x"]


def test_latency_figure_lines_samples_and_speedup_label() -> None:
    fig = latency_figure(sweep_rows(), log_y=True)
    assert_titled(fig, "tokens", "ms")
    lines = [t for t in fig.data if t.mode == "lines+markers"]
    assert [t.name for t in lines] == ["label uncached", "label concat"]
    assert lines[0].line.color == mode_color("uncached")
    faint = [t for t in fig.data if t.mode == "markers"]
    assert len(faint) == 2 and len(faint[0].x) == 2 * len(CONTEXTS)
    assert fig.layout.yaxis.type == "log"
    assert "×" in fig.layout.annotations[0].text
    only = latency_figure(sweep_rows(), show_samples=False, modes=["concat"])
    assert [t.name for t in only.data] == ["label concat"]
    assert latency_figure(pd.DataFrame()).data == ()


def test_step_and_cumulative_figures() -> None:
    steps = pd.DataFrame({"mode": ["cached"] * 3 + ["uncached"] * 3, "step": [0, 1, 2] * 2,
                          "context_len": [5, 6, 7] * 2, "step_ms": [3.0, 1, 1, 3, 3.2, 3.4],
                          "cumulative_s": [0.003, 0.004, 0.005, 0.003, 0.0062, 0.0096]})
    fig = step_latency_figure(steps)
    assert_titled(fig, "tokens", "ms")
    assert {t.name for t in fig.data} == {"cached", "uncached"}
    cum = cumulative_figure(steps)
    assert_titled(cum, "tokens", "(s)")
    assert list(cum.data[0].x) == [1, 2, 3]


def test_overlay_figure_one_trace_per_run_and_mode() -> None:
    a = sweep_rows().assign(label="run A")
    b = sweep_rows().assign(label="run B")
    fig = overlay_figure(pd.concat([a, b]), log_y=True)
    assert_titled(fig, "tokens", "ms")
    assert len(fig.data) == 4
    assert fig.data[0].line.dash != fig.data[2].line.dash  # runs told apart by dash
    assert fig.data[0].line.color == fig.data[2].line.color  # same mode, same colour


def test_reductions_and_figure_4() -> None:
    red = reductions(sweep_rows(), "uncached")
    assert list(red["context_len"]) == CONTEXTS
    # The uncached step does t times the cached step's FLOPs (the write-up's identity).
    assert red["flop_reduction"].iloc[-1] == pytest.approx(1000, rel=0.01)
    fig = reduction_figure(sweep_rows())
    assert_titled(fig, "tokens", "×")
    assert fig.layout.yaxis.type == "log"
    assert [t.line.dash for t in fig.data] == ["dash", None]  # FLOPs dashed, time solid
    assert [t.line.color for t in fig.data] == [mode_color("concat")] * 2
    assert reductions(sweep_rows(), "missing").empty


def test_throughput_table_and_roofline() -> None:
    roofs = [Ceiling("listed", 37.4, 696.0), Ceiling("measured here", 20.0, 400.0)]
    fig = throughput_figure(sweep_rows(), roofs)
    assert_titled(fig, "tokens", "TFLOP/s")
    assert [t.name for t in fig.data] == ["label uncached", "label concat", "peak, listed",
                                          "peak, measured here"]
    assert list(fig.data[2].y) == [37.4, 37.4]
    pct = throughput_figure(sweep_rows(), roofs, percent_of=roofs[0])
    assert "%" in titles(pct)[1]
    assert pct.data[0].y[0] == pytest.approx(sweep_rows()["tflops"][0] * 100 / 37.4)
    table = achieved_table(sweep_rows(), roofs[0])
    assert list(table.columns) == ["context_len", "uncached TFLOP/s", "uncached % of peak",
                                   "concat TFLOP/s", "concat % of peak"]
    roof = roofline_figure(sweep_rows(), roofs)
    assert_titled(roof, "FLOP per byte", "TFLOP/s")
    assert roof.layout.xaxis.type == "log" and roof.layout.yaxis.type == "log"
    assert sum(1 for t in roof.data if t.name.startswith("roof")) == 2
    # The roof is min(peak, bandwidth x intensity): flat at the peak on the far right.
    assert max(roof.data[-2].y) == pytest.approx(37.4)


def test_memory_figures() -> None:
    parts = pd.DataFrame([{"component": "weights", "bytes": 475 * 2**20, "source": "formula"},
                          {"component": "KV cache", "bytes": 72 * 2**20, "source": "formula"}])
    fig = breakdown_figure(pd.concat([parts.assign(bar="formula"),
                                      parts.assign(bar="measured")]))
    assert "MiB" in titles(fig)[0]
    assert [t.name for t in fig.data] == ["weights", "KV cache"]
    assert list(fig.data[0].y) == ["formula", "measured"]
    kv = pd.DataFrame({"context_len": [64, 128, 64, 128], "kv_formula_bytes": [1, 2, 1, 2],
                       "kv_tensor_bytes": [1, 2, 1, 2], "allocated_delta_bytes": [None] * 4,
                       "rss_delta_bytes": [3, 4, 5, 6],
                       "baseline": ["after warm-up"] * 2 + ["before warm-up"] * 2})
    fig = kv_memory_figure(kv, "before warm-up")
    assert_titled(fig, "tokens", "MiB")
    names = [t.name for t in fig.data]
    assert names[0].startswith("formula") and len(names) == 3  # no allocator trace on CPU
    assert list(fig.data[-1].y) == pytest.approx([5 / 2**20, 6 / 2**20])
    grid = pd.DataFrame(crossover_grid(CFG, "float32", [1, 8, 64], [128, 1024]))
    fig = crossover_figure(grid)
    assert_titled(fig, "tokens", "batch")
    assert isinstance(fig.data[0], go.Heatmap) and isinstance(fig.data[1], go.Contour)
    masks = pd.DataFrame({"kind": ["seed", "shared_bool", "none"],
                          "bytes": [costs.mask_bytes(CFG, k) for k in
                                    ("seed", "shared_bool", "none")]})
    fig = mask_figure(masks, costs.kv_bytes(CFG, "float32", 1, 1024))
    assert_titled(fig, "mask", "MiB")
    assert fig.data[0].y[0] == pytest.approx(48.0)


def test_check_matrix() -> None:
    rows = pd.DataFrame([
        {"bug": b, "check": c, "passed": not (b == "cache_order" and c == "append"),
         "detail": "d"} for b in ("no bug", "cache_order") for c in ("logits", "append")])
    fig = check_matrix_figure(rows)
    assert_titled(fig, "check", "bug")
    assert fig.data[0].z.tolist() == [[0.0, 0.0], [0.0, 1.0]]
    assert fig.data[0].text[1][1] == "FAILS"


def test_a_check_that_could_not_run_is_grey_not_caught() -> None:
    rows = pd.DataFrame([
        {"bug": "positions", "check": "logits", "passed": None,
         "detail": "could not run: ImportError: no transformers"},
        {"bug": "positions", "check": "append", "passed": False, "detail": "differs"}])
    fig = check_matrix_figure(rows)
    assert fig.data[0].z.tolist() == [[0.5, 1.0]]
    assert fig.data[0].text[0] == ["could not run", "FAILS"]


def test_latency_tooltips_give_percentiles_only_with_enough_samples() -> None:
    df = sweep_rows()
    df.loc[0, "samples_ms"] = [float(x) for x in range(1, 13)]  # 12 samples: a p90, no p99
    fig = latency_figure(df, show_samples=False)
    (line,) = [t for t in fig.data if t.name == "label uncached"]
    assert "%{text}" in line.hovertemplate
    assert line.text[0].startswith("12 samples<br>median 6.5 ms") and "p90 " in line.text[0]
    assert "p99: too few samples (p99 needs 100)" in line.text[0]
    assert "p90, p99: too few samples" in line.text[1]  # two samples: a median only
    overlay = overlay_figure(df.assign(label="run"))
    assert all("%{text}" in t.hovertemplate for t in overlay.data)


def test_comparison_figure_draws_each_points_band_and_verdict() -> None:
    from ui.figures import compare_figure

    rows = pd.DataFrame([
        {"point": "concat @ 8", "mode": "concat", "context_len": 8, "ratio": 1.5,
         "noise": 0.05, "verdict": "regression"},
        {"point": "uncached @ 8", "mode": "uncached", "context_len": 8, "ratio": 1.01,
         "noise": 0.05, "verdict": "within noise"},
        {"point": "fast @ 8", "mode": "fast", "context_len": 8, "ratio": None, "noise": None,
         "verdict": "only in new"}])
    fig = compare_figure(rows)
    assert_titled(fig, "context length (tokens)", "new ÷ old")
    band, *marks = fig.data
    assert list(band.y) == [1.0, 1.0] and list(band.error_y.array) == [0.05, 0.05]
    assert {t.name: t.marker.symbol for t in marks} == {"uncached · within noise": "circle",
                                                        "concat · regression": "x"}
    assert {t.marker.color for t in marks} == {mode_color("concat"), mode_color("uncached")}
    named = compare_figure(rows.drop(columns="context_len"))
    assert titles(named)[0] == "point" and list(named.data[1].x) == ["uncached @ 8"]
    assert len(compare_figure(rows.iloc[2:]).data) == 0


def test_serving_and_point_tables_speak_the_fields_names() -> None:
    from ui.metrics import point_table, pp_tg_sentence, serving_table

    points = point_table(sweep_rows())  # saved before rows carried percentiles: derived
    assert {"p50_ms", "p90_ms", "p99_ms", "samples_n"} <= set(points.columns)
    assert points["samples_n"].tolist() == [2] * 8 and points["p90_ms"].isna().all()
    e2e = pd.DataFrame([{"mode": "concat", "prompt_len": 8, "new_tokens": 64, "ttft_ms": 4.0,
                         "tpot_ms": 2.0, "e2e_ms": 130.0, "output_tokens_per_s": 492.3,
                         "prefill_tokens_per_s": 2000.0, "decode_tokens_per_s": 500.0,
                         "joules_per_token": None, "avg_watts": None}])
    assert "joules_per_token" not in serving_table(e2e).columns  # no counter: no column
    assert pp_tg_sentence(e2e) == "concat: pp8 2,000.0, tg63 500.0 tokens/s"
    assert serving_table(e2e.drop(columns="ttft_ms")).empty  # an older run


def test_a_gpus_prediction_parts_are_two_bars_host_beside_the_stacked_kernels() -> None:
    from ui.figures_predict import parts_figure

    row = {"mode": "prealloc_fused", "context_len": 128, "measured_ms": 2.2, "predicted_ms": 2.0,
           "weights_ms": 0.1, "attention_ms": 0.3, "small_ops_ms": 0.05,
           "dispatch_host_ms": 2.0}
    gpu = parts_figure(pd.DataFrame([{**row, "bound": "host"}]), "prealloc_fused")
    bars = [t for t in gpu.data if t.type == "bar"]
    assert gpu.layout.barmode == "group"
    assert {t.offsetgroup for t in bars} == {"host", "device"}
    device = [t for t in bars if t.offsetgroup == "device"]
    assert [float(t.base[0]) for t in device] == pytest.approx([0.0, 0.1, 0.4])  # stacked
    cpu = parts_figure(pd.DataFrame([{**row, "bound": None}]), "prealloc_fused")
    assert cpu.layout.barmode == "stack" and all(t.offsetgroup is None for t in cpu.data)
