"""The step predictor on the Llama family (llama-tiny: 2 layers, 4 query heads over 2 K/V heads,
width 64, SwiGLU of 128, 49,152 tokens): every calibration piece a Llama mode needs is built from
the Llama model's own parts, every predicted mode gets a number whose parts add up, a piece that
cannot be timed is "not calibrated" rather than a crash, and the hollow Llama model runs every
mode's step. Timing is replaced by one call per piece (``one_call``): these tests are about what
is timed, not how long it takes."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from engine import modes
from engine.decoders import make_decoder
from engine.models.config import LlamaConfig
from engine.models.llama import small_ops
from engine.models.llama.model import Llama
from instruments import lineup
from instruments.costmodel import predict
from instruments.measure import calibration


@pytest.fixture(scope="module")
def model() -> Llama:
    return lineup.load_model("llama-tiny", "random").model


def llama_modes() -> list[str]:
    """What the predictor models of the Llama family's choices on a CPU."""
    return predict.predictable(lineup.choices("cpu", "llama")[0])


def one_call(fn: Callable[[], Any], device: torch.device, repeats: int,
             prepare: Callable[[], Any] | None = None) -> list[float]:
    """``calibration._sample`` cut to one timed call (a self-timed piece reports its own ms)."""
    if prepare is not None:
        prepare()
    t0 = time.perf_counter()
    out = fn()
    return [out if isinstance(out, float) else (time.perf_counter() - t0) * 1e3]


@pytest.fixture
def fast_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibration, "_sample", one_call)


def test_the_predicted_llama_modes_are_the_cpu_choices_with_a_recipe() -> None:
    names = llama_modes()
    assert {"uncached", "uncached_last", "concat", "prealloc", "prealloc_fused",
            "paged", "int8_kv"} <= set(names)
    assert all(lineup.available(m, "cpu", "llama")[0] for m in names)


def test_the_llama_plan_times_llama_matrices_heads_and_caches(model: Llama) -> None:
    """Every piece the plan lists for the Llama modes builds on the Llama model and multiplies
    by its own matrices: q, k and v (k and v only n_kv_head heads wide), o, gate, up and down
    per layer, the 49,152-row head; its caches hold n_kv_head heads; its small operators are
    RMSNorm, RoPE and SiLU."""
    cfg = model.config
    d, kv, h = cfg.n_embd, cfg.n_kv_head * cfg.head_dim, cfg.n_hidden
    plan = calibration.plan(llama_modes(), 1, 4)
    layouts = {v for p, v, _ in plan if p == "layers"}
    assert {"out_in"} <= layouts
    parts = calibration._Parts(model, 1, cold=False)
    for layout in layouts:
        outs = parts.linears(layout, 3)()
        assert [o.shape[-1] for o in outs] == [d, kv, kv, d, h, h, d] * cfg.n_layer, layout
        assert all(o.numel() // o.shape[-1] == 3 for o in outs), layout
        assert parts.head(layout, 3)().shape[-1] == cfg.vocab_size == 49152
    attention = {v for p, v, _ in plan if p == "attention"}
    assert {"concat_seed", "prealloc_seed", "prealloc_fused", "paged_fused"} <= attention


def test_llama_attention_pieces_fill_caches_of_n_kv_heads(model: Llama,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Any] = []
    real_make = calibration.make_cache

    def spy(*args: Any, **kwargs: Any) -> Any:
        made.append(real_make(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(calibration, "make_cache", spy)
    parts = calibration._Parts(model, 2, cold=False)
    cfg = model.config
    for variant in ("concat_seed", "prealloc_fused", "prealloc_step", "paged_fused",
                    "kv_int8_fused"):
        parts.attention(variant, 5)()
    concat = made[0]
    assert concat.kind == "concat"
    assert all(k.shape == (2, cfg.n_kv_head, 4, cfg.head_dim) for k in concat.k)
    parts.attention_full(6)()  # GQA: n_head queries over n_kv_head keys, no crash


def test_llama_small_operators_are_rmsnorm_rope_and_silu(model: Llama,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = model.config
    calls = {"norm": 0, "rope": 0, "silu": 0}
    hooks = [m.register_forward_hook(lambda *_: calls.__setitem__("norm", calls["norm"] + 1))
             for m in model.modules() if type(m).__name__ == "RMSNorm"]
    real_rope, real_silu = small_ops.apply_rope, small_ops.F.silu

    def rope(*a: Any) -> Any:
        calls["rope"] += 1
        return real_rope(*a)

    def silu(*a: Any, **k: Any) -> Any:
        calls["silu"] += 1
        return real_silu(*a, **k)

    monkeypatch.setattr(small_ops, "apply_rope", rope)
    monkeypatch.setattr(small_ops.F, "silu", silu)
    try:
        calibration._Parts(model, 1, cold=False).small(3)()
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == {"norm": 2 * cfg.n_layer + 1, "rope": 2 * cfg.n_layer, "silu": cfg.n_layer}


def test_the_hollow_llama_model_keeps_its_shapes_legal_and_runs_every_mode(
        model: Llama) -> None:
    hollow = calibration.hollow_model(model)
    cfg = hollow.config
    assert isinstance(hollow, Llama) and isinstance(cfg, LlamaConfig)
    assert (cfg.n_layer, cfg.block_size, cfg.rope_theta, cfg.tied) == (
        model.config.n_layer, model.config.block_size, model.config.rope_theta,
        model.config.tied)
    assert (cfg.n_embd, cfg.n_hidden, cfg.vocab_size) == (4, 4, 8)
    assert (cfg.n_head, cfg.n_kv_head, cfg.head_dim) == (2, 1, 2)  # still grouped-query
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for mode in llama_modes():
        dec = make_decoder(hollow, mode, batch_size=2, capacity=8)
        assert dec.prefill(idx).shape == (2, 8), mode
        if lineup.spec(mode).cached:
            assert dec.step(idx[:, :1]).shape == (2, 8), mode


@pytest.fixture(scope="module")
def rows(model: Llama) -> list[dict]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibration, "_sample", one_call)
        return calibration.calibrate(model, llama_modes(), 1, 4, repeats=1)


def test_every_predicted_llama_mode_gets_a_number_and_its_parts_add_up(rows: list[dict]) -> None:
    assert {r["scale"] for r in rows} == {"real", "hollow"}
    cal = predict.Calibration(rows)
    for mode in llama_modes():
        for t in (1, 3, 4):
            p = predict.predict_point(cal, mode, t)
            assert p["why"] == "" and p["predicted_ms"] is not None, (mode, p["why"])
            assert p["predicted_ms"] == pytest.approx(sum(p[k] for k in predict.PARTS))
            assert all(p[k] >= 0 for k in predict.PARTS)


def test_a_missing_part_is_not_calibrated_not_a_crash(rows: list[dict]) -> None:
    cal = predict.Calibration([r for r in rows if r["part"] != "small"])
    p = predict.predict_point(cal, "prealloc_fused", 3)
    assert p["predicted_ms"] is None and p["why"].startswith("not calibrated: ")
    assert "small" in p["why"]


@pytest.fixture
def block_rung() -> Iterator[str]:
    """A Llama rung over a weight storage the calibration has no way to time."""
    spec = dataclasses.replace(modes.MODES["int8_weights"], name="toy_blocks", rung=99,
                               weight_storage="toy_q4", families=("llama",),
                               why_not="a test's rung")
    modes.register(spec)
    try:
        yield spec.name
    finally:
        modes.MODES.pop(spec.name, None)


def test_a_weight_storage_it_cannot_time_is_said_not_calibrated(
        model: Llama, block_rung: str, fast_sampling: None) -> None:
    missing: list[str] = []
    rows = calibration.calibrate(model, [block_rung], 1, 2, repeats=1, missing=missing)
    assert missing and "toy_q4" in missing[0]
    assert {r["part"] for r in rows} == {"attention", "small", "hollow"}  # the rest is timed
    p = predict.predict_point(predict.Calibration(rows), block_rung, 2)
    assert p["predicted_ms"] is None and p["why"].startswith("not calibrated: ")
    assert "toy_q4" in p["why"]
