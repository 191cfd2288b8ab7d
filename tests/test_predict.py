"""The step predictor: interpolation, parts, residuals and verdicts on synthetic calibration data,
and one real calibration + prediction run on the tiny model."""

from __future__ import annotations

import math

import pytest

from instruments import lineup
from instruments.costmodel import predict
from instruments.costmodel.predict import Calibration, compare, interpolate, predict_point, verdicts

GRID = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def test_interpolation_is_exact_on_power_laws_and_linear_where_logs_fail() -> None:
    pts = [(x, 3.0 * x**1.5) for x in GRID]
    for x in (3, 100, 700):
        assert interpolate(pts, x) == pytest.approx(3.0 * x**1.5, rel=1e-9)
    assert interpolate([(5, 2.0)], 100) == 2.0
    assert interpolate([(1, 0.0), (3, 2.0)], 2) == pytest.approx(1.0)  # a zero: linear
    assert interpolate(pts, 2048) == pytest.approx(3.0 * 2048**1.5, rel=1e-9)  # extrapolated
    with pytest.raises(ValueError):
        interpolate([], 1)


def synthetic(attention_per_token_ms: float = 0.01, weights_ms: float = 30.0,
              host_ms: float = 1.0) -> list[dict]:
    """A calibration with known parts: real - hollow is what the predictor must charge."""
    rows = []

    def add(part: str, variant: str, x: int, real: float, hollow: float | None) -> None:
        rows.append({"part": part, "variant": variant, "scale": "real", "x": x, "ms": real})
        if hollow is not None:
            rows.append({"part": part, "variant": variant, "scale": "hollow", "x": x,
                         "ms": hollow})

    for x in GRID:
        add("layers", "out_in", x, weights_ms + 0.1 * x, 0.2)  # per row once compute-bound
        add("head", "out_in", x, 10.0 + 0.05 * x, 0.01)
        add("small", "", x, 0.5 + 0.001 * x, 0.3)
        add("attention", "prealloc_fused", x, 0.05 + attention_per_token_ms * x, 0.05)
        add("attention_full", "seed", x, 0.05 + 1e-4 * x * x, 0.05)
        for mode in ("prealloc_fused", "uncached"):
            add("hollow", mode, x, 0.0, host_ms)
    return [r for r in rows if not (r["part"] == "hollow" and r["scale"] == "real")]


def test_a_cached_step_is_the_sum_of_real_minus_hollow_parts_plus_the_hollow_step() -> None:
    cal = Calibration(synthetic())
    p = predict_point(cal, "prealloc_fused", 128)  # a calibrated point: no interpolation
    assert p["weights_ms"] == pytest.approx((30.1 - 0.2) + (10.05 - 0.01))  # one row each
    assert p["attention_ms"] == pytest.approx(0.01 * 128)
    assert p["small_ops_ms"] == pytest.approx(0.5 + 0.001 - 0.3)
    assert p["dispatch_host_ms"] == pytest.approx(1.0)
    assert p["predicted_ms"] == pytest.approx(sum(p[k] for k in predict.PARTS))


def test_an_uncached_forward_multiplies_every_position_and_mode_2_projects_one() -> None:
    cal = Calibration(synthetic())
    full = predict_point(cal, "uncached", 128)
    assert full["weights_ms"] == pytest.approx((30 + 12.8 - 0.2) + (10 + 6.4 - 0.01))
    assert full["attention_ms"] == pytest.approx(1e-4 * 128 * 128)
    last = predict_point(Calibration(synthetic() + [
        {"part": "hollow", "variant": "uncached_last", "scale": "hollow", "x": 1, "ms": 1.0}]),
        "uncached_last", 128)
    assert last["weights_ms"] == pytest.approx((30 + 12.8 - 0.2) + (10.05 - 0.01))


def test_compiled_modes_and_missing_calibration_say_why() -> None:
    cal = Calibration(synthetic())
    why = predict_point(cal, "compiled", 8)["why"]
    assert why and why == predict.why_not("compiled") == lineup.mode_spec("compiled").predicted
    missing = predict_point(cal, "concat", 8)
    assert missing["predicted_ms"] is None and "concat_seed" in missing["why"]


def _measured(mode: str, scale_of: dict[int, float], cal: Calibration) -> list[dict]:
    return [{"mode": mode, "context_len": t, "cached": mode != "uncached",
             "latency_ms": predict_point(cal, mode, t)["predicted_ms"] * f}
            for t, f in scale_of.items()]


def test_verdicts_hold_within_the_goal_and_fail_outside_it() -> None:
    cal = Calibration(synthetic())
    close = compare(cal, _measured("prealloc_fused", {8: 1.10, 100: 0.92, 1000: 1.05}, cal))
    far = compare(cal, _measured("prealloc_fused", {8: 1.0, 100: 1.0, 1000: 1.30}, cal))
    v_close, v_far = verdicts(close)[0], verdicts(far)[0]
    assert v_close["within"] is True and v_close["worst_share"] == pytest.approx(0.10 / 1.10)
    assert v_far["within"] is False and v_far["worst_context"] == 1000
    assert "outside the goal" in v_far["sentence"]
    # Uncached modes get 25%: a 20% miss passes there and fails a cached mode.
    unc = compare(cal, _measured("uncached", {8: 1.25, 64: 1.25}, cal))
    assert verdicts(unc)[0]["within"] is True
    cached = compare(cal, _measured("prealloc_fused", {8: 1.25, 64: 1.25}, cal))
    assert verdicts(cached)[0]["within"] is False


def _steps_as_predicted_by(truth: Calibration) -> list[dict]:
    """Mode 5's measured rows as if the machine behaved as ``truth`` says."""
    return [{"mode": "prealloc_fused", "context_len": t, "cached": True,
             "latency_ms": predict_point(truth, "prealloc_fused", t)["predicted_ms"]}
            for t in (8, 64, 256, 512, 1024)]


def test_the_part_that_is_off_is_named() -> None:
    """Attention that really costs 3x its calibration: the residual follows attention. A host
    loop 10 ms slower than calibrated: a constant residual."""
    base = Calibration(synthetic())
    slow_attention = Calibration(synthetic(attention_per_token_ms=0.03))
    v = verdicts(compare(base, _steps_as_predicted_by(slow_attention)))[0]
    assert v["within"] is False and v["off_part"] == "attention_ms"
    assert "3.00x" in v["sentence"]
    slow_host = Calibration(synthetic(host_ms=11.0))
    v = verdicts(compare(base, _steps_as_predicted_by(slow_host)))[0]
    assert v["within"] is False and v["off_part"] == "constant"
    assert "+10.00 ms" in v["sentence"]


def test_not_predicted_modes_get_a_verdict_without_a_number() -> None:
    rows = compare(Calibration(synthetic()),
                   [{"mode": "compiled", "context_len": 8, "cached": True, "latency_ms": 5.0}])
    v = verdicts(rows)[0]
    assert v["within"] is None and v["worst_share"] is None and "not predicted" in v["sentence"]


def test_a_generation_is_a_prompt_forward_then_one_step_per_token() -> None:
    cal = Calibration(synthetic() + [
        {"part": "hollow", "variant": "uncached_last", "scale": "hollow", "x": 1, "ms": 1.0}])
    total = predict.predict_generation(cal, "prealloc_fused", 8, 4)
    expect = predict_point(cal, "uncached_last", 8)["predicted_ms"] + sum(
        predict_point(cal, "prealloc_fused", t)["predicted_ms"] for t in (9, 10, 11))
    assert total == pytest.approx(expect)


def test_the_grid_and_the_plan_cover_what_the_modes_need() -> None:
    from instruments.measure import calibration

    assert calibration.grid(16) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert calibration.grid(100)[-1] == 100
    plan = calibration.plan(["prealloc_fused", "compiled"], 1, 16)
    parts = {(p, v) for p, v, _ in plan}
    assert ("attention", "prealloc_fused") in parts and ("hollow", "prealloc_fused") in parts
    assert not any(p == "attention_full" for p, _ in parts)  # no uncached mode asked for
    assert not any(v == "compiled" for _, v in parts)


def test_gpt2_parts_are_the_four_matrices_its_head_and_the_old_hollow_model() -> None:
    """The family-agnostic calibration times what GPT-2's always did: per layer c_attn, the
    attention's c_proj, c_fc and the MLP's c_proj, in every layout; the 50,257-row head; a
    hollow GPT of one head of 4 and a vocabulary of 8."""
    from engine.models.config import GPTConfig
    from instruments.measure import calibration

    model = lineup.load_model("tiny", "random").model
    cfg, d = model.config, model.config.n_embd
    parts = calibration._Parts(model, 1, cold=False)
    for layout in ("out_in", "packed", "int8", "bfloat16"):
        outs = parts.linears(layout, 2)()
        assert [o.shape[-1] for o in outs] == [3 * d, d, 4 * d, d] * cfg.n_layer, layout
        assert parts.head(layout, 2)().shape[-1] == 50257
    hollow = calibration.hollow_model(model)
    assert hollow.config == GPTConfig(n_layer=cfg.n_layer, n_head=1, n_embd=4,
                                      block_size=cfg.block_size, vocab_size=8, mask=cfg.mask)
    assert type(hollow) is type(model)


def test_a_real_prediction_run_on_the_tiny_model() -> None:
    from instruments.experiments import prediction
    from instruments.experiments.prediction import PredictionParams
    from instruments.spine import ModelSpec, load

    loaded = load(ModelSpec("tiny"))
    params = PredictionParams(["uncached_last", "prealloc_fused", "fast"], [4, 16, 32],
                              repeats=2, calibration_repeats=1)
    run = prediction.run(loaded, params)
    t = run["tables"]
    assert run["kind"] == "step_prediction" and not run["meta"]["partial"]
    assert {r["scale"] for r in t["calibration"]} == {"real", "hollow"}
    assert all(r["ms"] > 0 and r["samples_ms"] for r in t["calibration"])
    assert len(t["prediction"]) == len(t["latency"]) == 9
    for p in t["prediction"]:
        assert p["predicted_ms"] > 0
        assert p["predicted_ms"] == pytest.approx(sum(p[k] for k in predict.PARTS))
        assert p["residual_ms"] == pytest.approx(p["measured_ms"] - p["predicted_ms"])
        assert math.isfinite(p["residual_share"])
    assert {v["mode"] for v in t["verdicts"]} == set(params.modes)
    # The parts that do not grow with the context, timed again beside each of the 3 passes.
    again = {(r["variant"], r.get("pass")) for r in t["calibration"] if r["part"] == "layers"}
    assert {p for v, p in again if v == "out_in"} == {None, 1, 2, 3}
    assert not any(r.get("pass") for r in t["calibration"] if r["part"] == "attention")
    # The calibration is reused by the next run in the same process.
    again = prediction.run(loaded, params)
    assert "calibration reused" in " ".join(again["meta"]["notes"])


def test_passes_pool_their_samples_into_one_median() -> None:
    from instruments.experiments.prediction import pooled

    row = {"mode": "concat", "context_len": 8, "flops": 2e9, "bytes": 4e8}
    first = [{**row, "samples_ms": [40.0, 41.0], "latency_ms": 40.5}]
    burst = [{**row, "samples_ms": [90.0, 95.0], "latency_ms": 92.5}]  # a noisy pass
    third = [{**row, "samples_ms": [40.5, 41.5], "latency_ms": 41.0}]
    (merged,) = pooled([first, burst, third])
    assert merged["samples_ms"] == [40.0, 41.0, 90.0, 95.0, 40.5, 41.5]
    assert merged["latency_ms"] == pytest.approx(41.25) and merged["passes"] == 3
    assert merged["spread_ms"] == pytest.approx(55.0)
    assert merged["tflops"] == pytest.approx(2e9 / 0.04125 / 1e12)


def test_the_passes_notes_say_each_kind_once_with_its_counts_summed() -> None:
    """Three passes that each retook samples: one line saying 6, not three saying 1, 2, 3."""
    from instruments.experiments.latency_retakes import merged

    retaken = "sample(s) set aside and taken again: another process used the CPU"
    kept = "sample(s) were flagged as disturbed but agreed with their point's other samples"
    notes = [f"1 {retaken}", "stopped early", f"2 {retaken}", f"4 {kept}", f"3 {retaken}",
             "stopped early"]
    assert merged(notes) == [f"6 {retaken}", "stopped early", f"4 {kept}"]


def test_a_part_too_small_to_matter_is_never_blamed() -> None:
    """A residual that grows with the context while attention is a few µs: no part is blamed
    (a slope on that part would read 1000x); the sum is missing something context-dependent."""
    cal = Calibration(synthetic(attention_per_token_ms=1e-5))
    rows = [{"mode": "prealloc_fused", "context_len": t, "cached": True,
             "latency_ms": predict_point(cal, "prealloc_fused", t)["predicted_ms"] + 0.01 * t}
            for t in (8, 64, 256, 512, 1024)]
    v = verdicts(compare(cal, rows))[0]
    assert v["within"] is False and v["off_part"] == "context"
    assert "missing from the sum" in v["sentence"]


def split_rows(host_ms: float, per_token_ms: float) -> list[dict]:
    """A GPU-like calibration: each real part's kernels ("device") and the hollow step's issue
    time ("host"), besides the CPU's real and hollow rows (which the split must not use)."""
    rows = synthetic()
    for x in GRID:
        for part, variant, ms in (("layers", "out_in", 0.08), ("head", "out_in", 0.02),
                                  ("small", "", 0.01),
                                  ("attention", "prealloc_fused", per_token_ms * x)):
            rows.append({"part": part, "variant": variant, "scale": "device", "x": x, "ms": ms})
        rows.append({"part": "hollow", "variant": "prealloc_fused", "scale": "host", "x": x,
                     "ms": host_ms})
    return rows


def test_on_a_gpu_the_step_is_the_larger_of_the_hosts_issue_and_the_kernels() -> None:
    host_bound = predict_point(Calibration(split_rows(2.0, 1e-4)), "prealloc_fused", 128)
    assert host_bound["weights_ms"] == pytest.approx(0.10)  # the kernels, not real - hollow
    assert host_bound["attention_ms"] == pytest.approx(0.0128)
    assert host_bound["dispatch_host_ms"] == pytest.approx(2.0)
    assert host_bound["predicted_ms"] == pytest.approx(2.0) and host_bound["bound"] == "host"
    device_bound = predict_point(Calibration(split_rows(0.05, 1e-3)), "prealloc_fused", 1024)
    assert device_bound["predicted_ms"] == pytest.approx(0.08 + 0.02 + 0.01 + 1.024)
    assert device_bound["bound"] == "device"
    assert predict_point(Calibration(synthetic()), "prealloc_fused", 128)["bound"] is None
    rows = compare(Calibration(split_rows(2.0, 1e-4)),
                   [{"mode": "prealloc_fused", "context_len": 128, "latency_ms": 2.2}])
    assert rows[0]["bound"] == "host" and rows[0]["residual_ms"] == pytest.approx(0.2)


def test_a_split_calibration_runs_its_busy_and_issue_rows_on_a_cpu() -> None:
    """What a GPU's calibration adds (busy time of each real part, issue time of each hollow
    step), run here through the CPU's profiler: the same code that runs on cuda."""
    from engine.models.gpt2.model import GPT, GPTConfig
    from instruments.measure.calibration import calibrate

    model = GPT.random(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64,
                                 vocab_size=256), seed=0)
    rows = calibrate(model, ["prealloc_fused"], batch=1, max_context=8, repeats=1, busy=True)
    by = {(r["part"], r["scale"]) for r in rows}
    assert {("layers", "device"), ("head", "device"), ("small", "device"),
            ("attention", "device"), ("hollow", "host")} <= by
    for r in rows:
        if r["scale"] == "device":
            assert r["ms"] > 0 and r["kernels"] >= 1
    hosts = [r for r in rows if r["scale"] == "host"]
    assert all(r["ms"] > 0 for r in hosts)
    assert hosts[0]["kernels"] >= 10  # a hollow step of 2 layers issues dozens of operators
    assert all(r["kernels"] is None for r in hosts[1:])  # counted once a mode
    layers = next(r for r in rows if r["part"] == "layers" and r["scale"] == "device")
    assert layers["kernels"] == 2 * 4  # one top-level operator per Linear: q|k|v, o, up, down
    p = predict_point(Calibration(rows), "prealloc_fused", 8)
    assert p["bound"] in ("host", "device") and p["predicted_ms"] == pytest.approx(
        max(p["dispatch_host_ms"], p["weights_ms"] + p["attention_ms"] + p["small_ops_ms"]))
    assert not any(r["scale"] in ("device", "host") for r in calibrate(
        model, ["prealloc_fused"], batch=1, max_context=2, repeats=1))  # a CPU's default


def test_a_cuda_spans_kernels_are_counted_through_its_nested_operators() -> None:
    """On CUDA the kernels hang off the operators that launched them, nested (aten::linear ->
    aten::addmm -> the GEMM): every level counts; a CPU span counts its top-level operators."""
    from types import SimpleNamespace as Ev

    from instruments.measure.busy import span_busy_us

    def op(name: str, kernels: int = 0, children: tuple = (), us: float = 0.0) -> Ev:
        return Ev(name=name, kernels=[object()] * kernels, cpu_children=list(children),
                  time_range=Ev(start=0.0, end=us))

    linear = op("aten::linear", 0, (op("aten::t"), op("aten::addmm", 1, (), 5.0)), 7.0)
    span = op("kvlab::busy", 0, (linear, op("aten::add", 1, (), 1.0)))
    span.device_time_total = 4.5
    assert span_busy_us(span, cuda=True) == (4.5, 2)
    assert span_busy_us(span, cuda=False) == (8.0, 2)


def test_a_profiler_that_fails_costs_the_split_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the profiler cannot time a part (CUPTI missing on a GPU node), the calibration
    keeps its real and hollow rows, drops the split and says why: the predictor sums."""
    from engine.models.gpt2.model import GPT, GPTConfig
    from instruments.measure import busy, calibration

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    monkeypatch.setattr(busy, "busy_ms", broken)
    model = GPT.random(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16,
                                 vocab_size=64), seed=0)
    missing: list[str] = []
    rows = calibration.calibrate(model, ["prealloc_fused"], batch=1, max_context=4, repeats=1,
                                 busy=True, missing=missing)
    assert {r["scale"] for r in rows} == {"real", "hollow"}
    assert any("host and kernels apart" in m and "CUPTI" in m for m in missing)
    assert predict_point(Calibration(rows), "prealloc_fused", 4)["bound"] is None


def test_a_part_timed_again_counts_by_the_median_of_its_timings() -> None:
    """The re-timings beside each pass pool with the calibration, as the passes' samples do:
    one drifted timing moves nothing."""
    rows = [{"part": "layers", "variant": "out_in", "scale": s, "x": 1, "ms": ms}
            for s, ms in (("real", 10.0), ("real", 12.0), ("real", 30.0), ("hollow", 1.0))]
    cal = Calibration(rows)
    assert cal.at("layers", "out_in", "real", 1) == 12.0
    assert cal.size_part("layers", "out_in", 1) == 11.0
