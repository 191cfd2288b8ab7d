"""The batch curve (instruments/experiments/batch_curve.py) on a CPU: every (mode, context,
batch) point timed or skipped saying why, the floors from the formulas (the weights' read
constant, the cache's read growing with batch x context), the crossover where the cache's read
overtakes the weights', a batch over the memory budget skipped, bad input refused."""

from __future__ import annotations

import pytest

from engine import GPT, GPTConfig
from instruments.costmodel import costs
from instruments.experiments import get
from instruments.experiments.batch_curve import BatchCurveParams, floors

from .conftest import loaded_model

CFG = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=256)


@pytest.fixture(scope="module")
def run() -> dict:
    model = GPT.random(GPTConfig(**CFG), seed=0, std=0.2)
    params = BatchCurveParams(["prealloc_fused", "int8_kv"], [8, 32], [1, 2, 4], repeats=2,
                              warmup=1)
    return get("batch_curve").run(loaded_model(model), params)


def test_every_point_is_timed_with_its_floors(run: dict) -> None:
    rows = run["tables"]["curve"]
    assert {(r["mode"], r["context_len"], r["batch_size"]) for r in rows} == {
        (m, t, b) for m in ("prealloc_fused", "int8_kv") for t in (8, 32) for b in (1, 2, 4)}
    gbps = run["meta"]["read_gbps"]
    cfg = GPTConfig(**CFG)
    for r in rows:
        assert len(r["samples_ms"]) >= 2 and r["latency_ms"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch_size"] / r["latency_ms"] * 1e3)
        weights_ms = costs.linear_weight_bytes(cfg, "float32") / (gbps * 1e6)
        assert r["weights_read_ms"] == pytest.approx(weights_ms)
        kv_one = costs.kv_bytes_per_token(cfg, "float32") / (gbps * 1e6)
        if r["mode"] == "prealloc_fused":  # one fp32 row per cached token and sequence
            assert r["kv_read_ms"] == pytest.approx(kv_one * r["context_len"] * r["batch_size"])
        assert r["floor_ms"] == pytest.approx(r["weights_read_ms"] + r["kv_read_ms"])
    int8 = {(r["context_len"], r["batch_size"]): r["kv_read_ms"] for r in rows
            if r["mode"] == "int8_kv"}
    fp32 = {(r["context_len"], r["batch_size"]): r["kv_read_ms"] for r in rows
            if r["mode"] == "prealloc_fused"}
    assert all(int8[k] < 0.5 * fp32[k] for k in fp32)  # a quarter of the bytes, plus scales
    cross = {(c["mode"], c["context_len"]): c["batch_crossover"]
             for c in run["tables"]["crossover"]}
    w_ms, kv_ms = floors(cfg, "float32", "prealloc_fused", 32, 1, gbps)
    assert cross["prealloc_fused", 32] == pytest.approx(w_ms / kv_ms)
    assert cross["prealloc_fused", 8] == pytest.approx(4 * cross["prealloc_fused", 32])


def test_a_batch_over_the_memory_budget_is_skipped_saying_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from instruments.measure import memory

    monkeypatch.setattr(memory, "fits", lambda dev, est, resident_bytes=0: (
        est["kv_bytes"] < 2 * costs.kv_bytes(GPTConfig(**CFG), "float32", 1, 32) if "kv_bytes"
        in est else True, "does not fit: a test's budget"))
    model = GPT.random(GPTConfig(**CFG), seed=0, std=0.2)
    params = BatchCurveParams(["prealloc_fused"], [32], [1, 4], repeats=1, warmup=0)
    out = get("batch_curve").run(loaded_model(model), params)
    assert [r["batch_size"] for r in out["tables"]["curve"]] == [1]
    assert out["tables"]["skipped"] == [{"mode": "prealloc_fused", "context_len": 32,
                                         "batch_size": 4, "why": "does not fit: a test's budget"}]


@pytest.mark.parametrize(("change", "says"), [
    ({"modes": ["uncached"]}, "cached modes only"),
    ({"batches": [0]}, "batch size 0 is outside 1..256"),
    ({"contexts": [64]}, r"context length 64 is outside 2..63"),
])
def test_bad_input_says_what_is_allowed(change: dict, says: str) -> None:
    params = BatchCurveParams(**{"modes": ["prealloc_fused"], "contexts": [8], **change})
    with pytest.raises(ValueError, match=says):
        params.check(GPTConfig(**CFG), "cpu")
