"""Past the fp32 floor, drawn: the speculative-decoding figures (``ui.figures_speculate``: the
verify curve between its two bounds, measured against predicted speedup, acceptance against
break-even) and the Floor lab's second floor for a weight-only rung (``ui.floor_figures``)."""

from __future__ import annotations

import pandas as pd
import pytest

from engine import families

pytest.importorskip("plotly")

from types import SimpleNamespace  # noqa: E402

from instruments.costmodel import costs  # noqa: E402
from instruments.experiments.attribution import with_floors  # noqa: E402
from ui import figures_speculate as fs  # noqa: E402
from ui.floor_figures import attribution_figure, explained_sentence  # noqa: E402

VERIFY = pd.DataFrame([{"context_len": c, "k": k, "latency_ms": 10 + k * c / 100,
                        "t_ratio": (10 + k * c / 100) / (10 + c / 100),
                        "speedup_vs_steps": k * (10 + c / 100) / (10 + k * c / 100)}
                       for c in (128, 512) for k in (1, 2, 4, 8)])
SPEC = pd.DataFrame([
    {"k": 2, "acceptance": 0.6, "break_even_acceptance": 0.1, "tokens_per_forward": 1.9,
     "accepted": 30, "drafted": 50, "speedup_measured": 1.6, "speedup_predicted": 1.8,
     "speedup_predicted_drafts": 1.7, "latency_ms": 50.0, "plain_ms": 80.0, "identical": True},
    {"k": 8, "acceptance": 0.3, "break_even_acceptance": None, "tokens_per_forward": 1.4,
     "accepted": 30, "drafted": 100, "speedup_measured": 0.9, "speedup_predicted": 0.8,
     "speedup_predicted_drafts": 0.85, "latency_ms": 89.0, "plain_ms": 80.0, "identical": True},
])


def test_the_verify_curve_sits_between_the_ideal_and_the_compute_bound_line() -> None:
    fig = fs.verify_figure(VERIFY)
    names = [t.name for t in fig.data]
    assert sum(n.startswith("measured after") for n in names) == 2
    ideal = next(t for t in fig.data if t.name.startswith("memory-bound"))
    bound = next(t for t in fig.data if t.name.startswith("compute-bound"))
    assert list(ideal.y) == [1, 1, 1, 1] and list(bound.y) == [1, 2, 4, 8]
    assert fig.layout.xaxis.title.text and fig.layout.yaxis.title.text == "t(k) / t(1)"
    assert not fs.verify_figure(pd.DataFrame()).data


def test_speedups_and_acceptance_against_break_even() -> None:
    fig = fs.speedup_figure(SPEC)
    assert [round(v, 2) for v in fig.data[0].y] == [1.6, 0.9]  # measured bars, k order
    assert {t.name.split(":")[0] for t in fig.data[1:]} == {"predicted"}
    acc = fs.acceptance_figure(SPEC)
    names = [t.name for t in acc.data]
    assert "never breaks even" in names  # k = 8: a forward costs more than its tokens
    never = acc.data[names.index("never breaks even")]
    assert list(never.x) == ["k = 8"]
    assert "%" in acc.layout.yaxis.tickformat


def test_the_sentence_names_the_best_k_the_miss_and_exactness() -> None:
    text = fs.speculation_sentence(SPEC)
    assert "drafts of 2 tokens, 1.60×" in text and "+6%" in text and "token for token" in text
    bad = SPEC.assign(identical=[True, False])
    assert "DIFFERED" in fs.speculation_sentence(bad)
    assert list(fs.speculative_table(SPEC)["k"]) == [2, 8]


def test_a_weight_only_rung_is_set_against_its_own_floor_and_the_fp32_one() -> None:
    cfg = families.config("gpt2")
    peaks = SimpleNamespace(matmul_tflops=1.0, read_gbps=20.0)

    def row(mode: str, storage: str, step_ms: float) -> dict:
        nbytes = costs.step_bytes(cfg, "float32", 128, cached=True, storage=storage)
        return with_floors({
            "mode": mode, "mode_label": mode, "context_len": 128, "dtype": "float32",
            "step_ms": step_ms, "busy_ms": step_ms * 0.9, "idle_ms": step_ms * 0.1,
            "spread_ms": 0.1, "flops": 2.5e8,
            "bytes": nbytes, "weight_storage": storage,
            "model_dtype_bytes": costs.step_bytes(cfg, "float32", 128, cached=True)}, peaks)

    int8 = pd.DataFrame([row("int8_weights", "int8", 15.0)])
    saved = costs.linear_weight_bytes(cfg, "float32") - costs.linear_weight_bytes(
        cfg, "float32", "int8")  # only the weights shrink: K/V and activations stay
    gap_ms = int8["model_dtype_floor_ms"][0] - int8["byte_floor_ms"][0]
    assert gap_ms == pytest.approx(saved / 20e9 * 1e3)
    own, fp32_floor = 15.0 / int8["byte_floor_ms"][0], 15.0 / int8["model_dtype_floor_ms"][0]
    text = explained_sentence(int8, "int8_weights")
    assert "weights in int8" in text and "float32 weights" in text
    assert f"{own:.2f}–{own:.2f}× its own" in text and f"{fp32_floor:.2f}–" in text
    assert fp32_floor < 1 < own
    assert len(attribution_figure(int8).data) == 8  # + the fp32 weights' floor
    fp32 = pd.DataFrame([row("prealloc_fused", "", 30.0)])
    assert "weights in" not in explained_sentence(fp32, "prealloc_fused")
    assert len(attribution_figure(fp32).data) == 7


def test_the_k_plus_one_points_are_drawn_but_only_powers_of_two_labelled() -> None:
    drafts = VERIFY[VERIFY["k"] > 1]  # what drafts of 2, 4, 8 tokens append: 3, 5, 9
    with_next = pd.concat([VERIFY, drafts.assign(k=drafts["k"] + 1)], ignore_index=True)
    fig = fs.verify_figure(with_next)
    measured = [t for t in fig.data if t.name.startswith("measured after")]
    assert all(sorted(t.x) == [1, 2, 3, 4, 5, 8, 9] for t in measured)
    assert list(fig.layout.xaxis.tickvals) == [1, 2, 4, 8]
