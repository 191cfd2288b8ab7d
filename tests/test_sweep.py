"""Timed sweeps on a tiny model: shape of the rows, progress, stopping, refusing a wrong mode."""

from __future__ import annotations

import pytest
import torch

from engine import Decoder, families
from engine.models.config import GPTConfig
from engine.models.gpt2.model import GPT
from engine.modes import MODES, ModeSpec
from instruments.checks.bugs import inject_bug
from instruments.costmodel import costs
from instruments.experiments import get
from instruments.experiments.end_to_end import EndToEndParams
from instruments.experiments.inputs import (
    CONTEXT_PRESETS,
    parse_contexts,
    preset_contexts,
    spread_order,
)
from instruments.experiments.latency import LatencyParams
from instruments.spine import Event, Loaded
from instruments.store.tables import format_summary, summary_table

from .conftest import loaded_model

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=128, vocab_size=256)


@pytest.fixture(scope="module")
def tiny() -> Loaded:
    # std 0.2: peaked, varied predictions, so a wrong cache changes the greedy tokens
    return loaded_model(GPT.random(TINY, seed=3, std=0.2))


def sweep(tiny: Loaded, params: LatencyParams, progress=None, should_stop=None) -> dict:
    params.measure_peaks = False  # measured once per process elsewhere: not the point here
    return get("latency").run(tiny, params, progress, should_stop)


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
def test_params_validation(change: dict, match: str) -> None:
    params = LatencyParams(**{**dict(contexts=[8], modes=["uncached"]), **change})
    with pytest.raises(ValueError, match=match):
        params.check(TINY, "cpu")


def test_default_params_are_quick_on_cpu_and_thorough_on_cuda() -> None:
    gpt2 = families.config("gpt2")
    cpu, gpu = LatencyParams.defaults("cpu", gpt2), LatencyParams.defaults("cuda", gpt2)
    assert cpu.contexts == CONTEXT_PRESETS["log-spaced (16)"]
    assert cpu.repeats == 3 and cpu.warmup_steps is not None
    assert gpu.repeats == 5 and gpu.warmup_steps is None
    assert LatencyParams.defaults("cpu", families.config("tiny")).contexts[-1] == 128
    # the write-up's pair everywhere; on a CPU also our fastest exact step (issue 22)
    assert cpu.modes == ["uncached", "concat", "fast"] and gpu.modes == ["uncached", "concat"]


# --------------------------------------------------------------------------------- sweep
def test_sweep_rows_one_per_mode_and_context(tiny: Loaded) -> None:
    contexts = [1, 4, 9, 16]
    modes = ["uncached", "uncached_last", "concat"]
    seen: list[Event] = []
    run = sweep(tiny, LatencyParams(contexts, modes, repeats=2, warmup=1),
                seen.append)
    rows = run["tables"]["latency"]
    assert run["kind"] == "latency_sweep" and run["meta"]["partial"] is False
    assert all(c["passed"] for c in run["tables"]["checks"])
    assert len(rows) == len(contexts) * len(modes)
    for mode in modes:
        mode_rows = [r for r in rows if r["mode"] == mode]
        assert [r["context_len"] for r in mode_rows] == contexts  # monotone, one per length
        for r in mode_rows:
            # repeats=2, but every tiny point is cheap: samples up to 250 ms, at most 5
            assert r["latency_ms"] > 0 and 2 <= len(r["samples_ms"]) <= 5
            assert all(s > 0 for s in r["samples_ms"]) and r["tflops"] > 0 and r["gbps"] > 0
            assert r["cached"] == MODES[mode].cached and r["dtype"] == "float32"
            assert r["mode_label"] == MODES[mode].label
    by = {(r["mode"], r["context_len"]): r for r in rows}
    assert by["uncached", 9]["flops"] == costs.step_flops(TINY, 9, cached=False)
    assert by["uncached_last", 9]["flops"] == costs.step_flops(TINY, 9, False, last_only=True)
    assert by["concat", 9]["flops"] == costs.step_flops(TINY, 9, cached=True)
    assert by["concat", 1]["phase"] == "prefill"  # nothing cached yet at one token
    assert by["concat", 9]["bytes"] == costs.step_bytes(TINY, "float32", 9, cached=True)
    assert by["uncached_last", 9]["bytes"] == costs.step_bytes(TINY, "float32", 9, False,
                                                                last_only=True)
    rows_seen = [p.row for p in seen if p.table == "latency"]
    assert sorted(rows_seen, key=str) == sorted(rows, key=str)
    # Context by context, every mode at a context before the next: the chart fills evenly.
    assert [r["context_len"] for r in rows_seen] == [t for t in contexts for _ in modes]
    assert seen[-1].done == seen[-1].total == len(rows)
    assert all(p.eta_s is None or p.eta_s >= 0 for p in seen)
    assert run["meta"]["contexts"] == contexts and run["meta"]["repeats"] == 2


@pytest.mark.parametrize("mode", ["uncached", "concat"])
def test_stop_keeps_rows_done(tiny: Loaded, mode: str) -> None:
    got: list[dict] = []

    def on_progress(p: Event) -> None:
        if p.table == "latency":
            got.append(p.row)

    params = LatencyParams([4, 8, 12, 16, 20, 24], [mode], repeats=1, warmup=0)
    run = sweep(tiny, params, on_progress, should_stop=lambda: len(got) >= 3)
    assert run["meta"]["partial"] is True and "stopped" in run["meta"]["note"]
    assert run["tables"]["latency"] == got and len(got) == 3
    assert [r["context_len"] for r in got] == [4, 8, 12]


def test_a_spread_sweep_stopped_early_still_spans_short_to_long(tiny: Loaded) -> None:
    """Order "spread" (the device check's sweeps): the shortest, the longest, then between, so
    a sweep stopped after a few points has timed both ends (ascending, it had 4 and 8 only)."""
    got: list[dict] = []

    def on_progress(p: Event) -> None:
        if p.table == "latency":
            got.append(p.row)

    params = LatencyParams([4, 8, 16, 32, 64, 128], ["uncached", "concat"], repeats=1,
                           warmup=0, order="spread")
    run = sweep(tiny, params, on_progress, should_stop=lambda: len(got) >= 6)
    assert run["meta"]["partial"] is True
    assert [(r["context_len"], r["mode"]) for r in got] == [
        (4, "uncached"), (4, "concat"), (128, "uncached"), (128, "concat"), (16, "uncached"),
        (16, "concat")]
    assert [r["context_len"] for r in run["tables"]["latency"]] == [4, 16, 128, 4, 16, 128]
    assert spread_order([5, 1, 3, 2, 4, 4]) == [1, 5, 3, 2, 4]


def test_a_mode_that_disagrees_is_not_timed(tiny: Loaded) -> None:
    with inject_bug(tiny.model, "positions"):
        run = sweep(tiny, LatencyParams([8, 16], ["uncached", "prealloc"], repeats=1))
    assert {r["mode"] for r in run["tables"]["latency"]} == {"uncached"}
    check = {c["mode"]: c for c in run["tables"]["checks"]}["prealloc"]
    assert not check["passed"] and "differ from mode 1" in check["detail"]
    assert "prealloc not timed" in run["meta"]["note"]


class Broken(Decoder):
    def step(self, token: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


def test_a_registered_mode_that_crashes_is_refused(tiny: Loaded,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(MODES, "test_broken", ModeSpec(
        "test_broken", 99, "99 · broken", "#000000", "always fails", "tests.test_sweep:Broken"))
    run = sweep(tiny, LatencyParams([8], ["test_broken", "concat"], repeats=1))
    assert [r["mode"] for r in run["tables"]["latency"]] == ["concat"]
    assert "boom" in run["meta"]["note"]


def test_a_sweep_that_cannot_fit_is_refused_before_it_starts(tiny: Loaded,
                                                             monkeypatch) -> None:
    from instruments.measure import memory

    monkeypatch.setattr(memory, "free_bytes", lambda device: 1024)
    with pytest.raises(ValueError, match="would not fit in memory"):
        sweep(tiny, LatencyParams([8, 128], ["uncached", "concat"]))


# ---------------------------------------------------------------------------- end to end
def test_end_to_end_totals_and_cumulative(tiny: Loaded) -> None:
    run = get("end_to_end").run(tiny, EndToEndParams(["uncached", "concat"], prompt_len=4,
                                                     new_tokens=10, repeats=2))
    totals, cumulative = run["tables"]["end_to_end"], run["tables"]["cumulative"]
    assert not run["meta"]["partial"] and [r["mode"] for r in totals] == ["uncached", "concat"]
    for row in totals:
        assert len(row["samples_s"]) == 2 and row["total_s"] > 0
        assert row["flops_total"] == costs.generation_flops(
            TINY, 4, 10, cached=row["cached"], last_only=row["cached"])
        curve = [c for c in cumulative if c["mode"] == row["mode"]]
        assert [c["step"] for c in curve] == list(range(10))
        assert [c["context_len"] for c in curve] == list(range(4, 14))
        cum = [c["cumulative_s"] for c in curve]
        assert cum == sorted(cum) and cum[-1] == pytest.approx(
            sum(c["step_ms"] for c in curve) / 1e3)


def test_end_to_end_rejects_too_long_and_stops(tiny: Loaded) -> None:
    with pytest.raises(ValueError, match="1..128"):
        get("end_to_end").run(tiny, EndToEndParams(["concat"], prompt_len=8, new_tokens=200))
    run = get("end_to_end").run(tiny, EndToEndParams(["concat"], 4, 50),
                                should_stop=lambda: True)
    assert run["meta"]["partial"] and run["tables"]["end_to_end"] == []


def test_a_sweep_with_end_to_end_holds_both_in_one_run(tiny: Loaded) -> None:
    run = sweep(tiny, LatencyParams([4, 8], ["uncached", "concat"], repeats=1,
                                    e2e_new_tokens=6, e2e_prompt_len=4))
    assert len(run["tables"]["latency"]) == 4
    assert [r["new_tokens"] for r in run["tables"]["end_to_end"]] == [6, 6]
    assert len(run["tables"]["cumulative"]) == 12 and run["tables"]["summary"]


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


@pytest.mark.parametrize("mode", ["concat", "prealloc_fused", "fast"])
def test_a_cropped_cache_steps_exactly_like_a_fresh_one(tiny: Loaded, mode: str) -> None:
    """The crop method's step at t (cache filled to the longest context, then cropped to t-1)
    computes what a decoder prefilled to exactly t-1 tokens computes."""
    from engine import make_decoder
    from instruments.experiments.latency import _Mode

    model = tiny.model
    idx = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(5))
    st = _Mode(model, mode, LatencyParams([4, 64], [mode]), 64)
    for t in (8, 40, 64, 12, 33):  # grows, then crops back, then grows again
        prepare, step, phase = st.calls(idx, t)
        assert phase == "decode"
        prepare()
        step()
        fresh = make_decoder(model, mode, capacity=64)
        fresh.prefill(idx[:, : t - 1])
        want = fresh.step(idx[:, t - 1 : t])
        st.dec.rewind(t - 1)
        got = st.dec.step(idx[:, t - 1 : t])
        assert torch.allclose(got, want, atol=1e-5), (mode, t)


def test_samples_are_added_while_they_disagree(tiny: Loaded, monkeypatch) -> None:
    from instruments.measure import sampler

    durations = iter([10.0, 20.0, 10.5, 10.4] + [5.0] * 400)
    now = [0.0]
    calls = [0]

    def clock() -> float:  # every other read ends a sample that took the next duration
        calls[0] += 1
        if calls[0] % 2 == 0:
            now[0] += next(durations) / 1e3
        return now[0]

    real = sampler.Sampler.__init__
    monkeypatch.setattr(sampler.Sampler, "__init__",
                        lambda self, *a, **k: real(self, *a,
                                                   **{**k, "clock": clock, "watch": None}))
    run = sweep(tiny, LatencyParams([8, 16], ["uncached"], repeats=4, warmup=0, spread=0.1,
                                    point_ms=0.0))  # this rule alone: cheap points off
    first, second = run["tables"]["latency"]
    assert first["samples_ms"] == pytest.approx([10.0, 20.0, 10.5, 10.4])  # disagree: up to 4
    assert first["spread_ms"] == pytest.approx(10.0)
    assert first["latency_ms"] == pytest.approx(10.45)
    assert second["samples_ms"] == pytest.approx([5.0, 5.0])  # agree at once: the fewest, 2


def test_the_write_ups_method_still_runs(tiny: Loaded) -> None:
    run = sweep(tiny, LatencyParams([4, 8, 16], ["uncached", "concat"], repeats=1,
                                    method="generate", warmup_steps=4))
    rows = run["tables"]["latency"]
    assert [(r["mode"], r["context_len"]) for r in rows] == [
        ("uncached", 4), ("uncached", 8), ("uncached", 16), ("concat", 4), ("concat", 8),
        ("concat", 16)]
    assert run["meta"]["method"] == "generate" and run["meta"]["timings"]["total_s"] > 0


def test_a_mode_that_fails_the_long_gate_has_no_points_in_the_run(tiny: Loaded,
                                                                 monkeypatch) -> None:
    """The gate's short half runs before the first point, its long half after the first
    context; a mode that fails the long half loses the points it had (here: concat's logits
    are made wrong at the long context only)."""
    from instruments.checks import gate

    real, order = gate._forced, []

    def forced(model, tokens, start, name):
        logits = real(model, tokens, start, name)
        if start > 8:  # the long context
            order.append(("long gate", name))
            return logits + 1.0 if name == "concat" else logits
        return logits

    def progress(e: Event) -> None:
        if e.table == "latency":
            order.append((e.row["mode"], e.row["context_len"]))
            assert "· retakes" in e.message  # the progress line says what retakes cost

    monkeypatch.setattr(gate, "_forced", forced)
    run = sweep(tiny, LatencyParams([8, 16, 32], ["uncached", "concat"], repeats=1), progress)
    assert order.index(("concat", 8)) < order.index(("long gate", "concat"))  # first point first
    assert order.index(("long gate", "concat")) < order.index(("uncached", 16))
    assert [(r["mode"], r["context_len"]) for r in run["tables"]["latency"]] == [
        ("uncached", 8), ("uncached", 16), ("uncached", 32)]
    check = {c["mode"]: c for c in run["tables"]["checks"]}["concat"]
    assert not check["passed"] and "at 124 tokens" in check["detail"]
    assert any("concat: its 1 point(s) withheld" in n for n in run["meta"]["notes"])
    assert len(run["tables"]["checks"]) == 2  # one row per mode, the long half's replacing
