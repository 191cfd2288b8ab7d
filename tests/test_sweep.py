"""Timed sweeps on a tiny model: shape of the rows, progress, cancelling, refusing a wrong mode."""

from __future__ import annotations

import pytest
import torch

from engine import costs
from engine.checks import inject_bug
from engine.config import GPTConfig
from engine.model import GPT
from engine.modes import MODES, Decoder, ModeSpec, register_mode
from engine.sweep import (
    CONTEXT_PRESETS,
    Progress,
    SweepSpec,
    default_spec,
    format_summary,
    parse_contexts,
    preset_contexts,
    run_end_to_end,
    run_latency_sweep,
    summary_table,
)

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=128, vocab_size=256)


@pytest.fixture(scope="module")
def tiny() -> GPT:
    # std 0.2: peaked, varied predictions, so a wrong cache changes the greedy tokens
    return GPT.random(TINY, seed=3, std=0.2)


# ------------------------------------------------------------------------------ contexts
def test_presets_hold_the_write_ups_table_points() -> None:
    log = CONTEXT_PRESETS["log-spaced (16)"]
    assert len(log) == 16 and log == sorted(set(log))
    assert {8, 10, 100, 500, 1000, 1024} <= set(log)
    assert CONTEXT_PRESETS["every length 8..1024"] == list(range(8, 1025))
    clipped = preset_contexts("log-spaced (16)", 128)
    assert clipped[-1] == 128 and all(t <= 128 for t in clipped) and 100 in clipped
    with pytest.raises(ValueError, match="allowed"):
        preset_contexts("nope", 128)


@pytest.mark.parametrize("text, want", [
    ("8, 16, 100", [8, 16, 100]),
    ("8-32:8", [8, 16, 24, 32]),
    ("3-5", [3, 4, 5]),
    ("16, 8-16:8, 16,", [8, 16]),
    (" 128 ,1", [1, 128]),
    ("log-spaced (16)", preset_contexts("log-spaced (16)", 128)),
])
def test_parse_contexts_good(text: str, want: list[int]) -> None:
    assert parse_contexts(text, 128) == want


@pytest.mark.parametrize("text", ["", " , ", "abc", "8, x", "0", "129", "32-8", "8-16:0",
                                  "1.5", "-3", "8-200:8"])
def test_parse_contexts_bad(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_contexts(text, 128)
    msg = str(info.value)
    assert "\n" not in msg and "allowed" in msg and "1..128" in msg


@pytest.mark.parametrize("change, match", [
    (dict(contexts=[]), "no context"), (dict(contexts=[0]), "outside"),
    (dict(contexts=[129]), "outside"), (dict(modes=[]), "no modes"),
    (dict(modes=["nope"]), "cannot run"), (dict(batch_size=0), "batch"),
    (dict(batch_size=257), "batch"), (dict(repeats=0), "repeats"), (dict(warmup=-1), "warmup"),
])
def test_spec_validation(tiny: GPT, change: dict, match: str) -> None:
    spec = SweepSpec(**{**dict(contexts=[8], modes=["uncached"]), **change})
    with pytest.raises(ValueError, match=match):
        spec.validate(tiny)


def test_default_spec_is_quick_on_cpu_and_thorough_on_cuda() -> None:
    cpu, gpu = default_spec("cpu", 1024), default_spec("cuda", 1024)
    assert cpu.contexts == CONTEXT_PRESETS["log-spaced (16)"]
    assert cpu.repeats == 3 and cpu.warmup_steps is not None
    assert gpu.repeats == 5 and gpu.warmup_steps is None
    assert default_spec("cpu", 128).contexts[-1] == 128


# --------------------------------------------------------------------------------- sweep
def test_sweep_rows_one_per_mode_and_context(tiny: GPT) -> None:
    contexts = [1, 4, 9, 16]
    modes = ["uncached", "uncached_last", "concat"]
    seen: list[Progress] = []
    res = run_latency_sweep(tiny, SweepSpec(contexts, modes, repeats=2, warmup=1, check_tokens=8),
                            on_progress=seen.append)
    assert not res.cancelled and all(c.passed for c in res.checks)
    assert len(res.rows) == len(contexts) * len(modes)
    for mode in modes:
        rows = [r for r in res.rows if r["mode"] == mode]
        assert [r["context_len"] for r in rows] == contexts  # monotone, one per length
        for r in rows:
            assert r["latency_ms"] > 0 and len(r["samples_ms"]) == 2
            assert all(s > 0 for s in r["samples_ms"]) and r["tflops"] > 0 and r["gbps"] > 0
            assert r["cached"] == MODES[mode].cached and r["dtype"] == "float32"
            assert r["mode_label"] == MODES[mode].label
    by = {(r["mode"], r["context_len"]): r for r in res.rows}
    assert by["uncached", 9]["flops"] == costs.step_flops(TINY, 9, cached=False)
    assert by["uncached_last", 9]["flops"] == costs.step_flops(TINY, 9, False, last_only=True)
    assert by["concat", 9]["flops"] == costs.step_flops(TINY, 9, cached=True)
    assert by["concat", 1]["phase"] == "prefill"  # nothing cached yet at one token
    assert by["concat", 9]["bytes"] == costs.step_bytes(TINY, "float32", 9, cached=True)
    rows_seen = [p.row for p in seen if p.row is not None]
    assert rows_seen == res.rows
    assert seen[-1].done == seen[-1].total == len(res.rows)
    assert all(p.eta_s is None or p.eta_s >= 0 for p in seen)


@pytest.mark.parametrize("mode", ["uncached", "concat"])
def test_cancel_keeps_rows_done(tiny: GPT, mode: str) -> None:
    got: list[dict] = []

    def on_progress(p: Progress) -> None:
        if p.row is not None:
            got.append(p.row)

    spec = SweepSpec([4, 8, 12, 16, 20, 24], [mode], repeats=1, warmup=0)
    res = run_latency_sweep(tiny, spec, on_progress, should_stop=lambda: len(got) >= 3)
    assert res.cancelled
    assert res.rows == got and len(res.rows) == 3
    assert [r["context_len"] for r in res.rows] == [4, 8, 12]


def test_a_mode_that_disagrees_is_not_timed(tiny: GPT) -> None:
    with inject_bug(tiny, "positions"):
        res = run_latency_sweep(tiny, SweepSpec([8, 16], ["uncached", "prealloc"], repeats=1))
    assert {r["mode"] for r in res.rows} == {"uncached"}
    check = {c.mode: c for c in res.checks}["prealloc"]
    assert not check.passed and "differs from mode 1" in check.detail
    assert any("prealloc not timed" in n for n in res.notes)


def test_a_registered_mode_that_crashes_is_refused(tiny: GPT) -> None:
    class Broken(Decoder):
        def step(self, token: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    register_mode(ModeSpec("test_broken", "x · broken", True, "always fails",
                           lambda m, **kw: Broken(m, cache_kind="prealloc", **kw)))
    try:
        res = run_latency_sweep(tiny, SweepSpec([8], ["test_broken", "concat"], repeats=1))
    finally:
        del MODES["test_broken"]
    assert [r["mode"] for r in res.rows] == ["concat"]
    assert "boom" in res.notes[0]


# ---------------------------------------------------------------------------- end to end
def test_end_to_end_totals_and_cumulative(tiny: GPT) -> None:
    res = run_end_to_end(tiny, ["uncached", "concat"], prompt_len=4, new_tokens=10, repeats=2)
    assert not res.cancelled and [r["mode"] for r in res.totals] == ["uncached", "concat"]
    for row in res.totals:
        assert len(row["samples_s"]) == 2 and row["total_s"] > 0
        assert row["flops_total"] == costs.generation_flops(
            TINY, 4, 10, cached=row["cached"], last_only=row["cached"])
        curve = [c for c in res.cumulative if c["mode"] == row["mode"]]
        assert [c["step"] for c in curve] == list(range(10))
        assert [c["context_len"] for c in curve] == list(range(4, 14))
        cum = [c["cumulative_s"] for c in curve]
        assert cum == sorted(cum) and cum[-1] == pytest.approx(
            sum(c["step_ms"] for c in curve) / 1e3)


def test_end_to_end_rejects_too_long_and_cancels(tiny: GPT) -> None:
    with pytest.raises(ValueError, match="1..128"):
        run_end_to_end(tiny, ["concat"], prompt_len=8, new_tokens=200)
    res = run_end_to_end(tiny, ["concat"], 4, 50, should_stop=lambda: True)
    assert res.cancelled and res.totals == []


# ------------------------------------------------------------------------------- summary
def _fake(mode: str, t: int, ms: float, flops: int) -> dict:
    return {"mode": mode, "context_len": t, "latency_ms": ms, "flops": flops, "tflops": 1.0}


def test_summary_table_nearest_point_and_ratios() -> None:
    rows = [_fake("uncached", 9, 6.0, 900), _fake("concat", 9, 3.0, 100),
            _fake("uncached", 100, 30.0, 10000), _fake("concat", 100, 5.0, 100),
            _fake("uncached", 400, 1.0, 1), _fake("concat", 300, 1.0, 1)]
    table = summary_table(rows, at=(10, 100, 1000))
    assert [r["measured_context_len"] for r in table] == [9, 100]  # 1000: nothing near
    assert table[0]["speedup"] == pytest.approx(2.0)
    assert table[1]["speedup"] == pytest.approx(6.0)
    assert table[1]["flop_reduction"] == pytest.approx(100.0)
    text = format_summary(table)
    assert "6.0x" in text and "100x" in text
    assert "no context" in format_summary([])
