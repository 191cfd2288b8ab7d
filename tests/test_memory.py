"""Memory accounting: formula vs tensors vs process memory, crossover, estimates."""

from __future__ import annotations

import pytest
import torch

from engine import families
from engine.decoders import make_decoder
from engine.models.config import GPTConfig
from engine.models.gpt2.model import GPT
from engine.models.state import ModelState
from instruments.costmodel import costs
from instruments.costmodel.costs import breakdown_formula, crossover_grid, peak_memory_estimate
from instruments.measure.memory import (
    cublas_workspace,
    fits,
    measure_kv_memory,
    memory_breakdown,
    model_memory,
    storage_bytes,
)

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=128, vocab_size=256)
GPT2 = families.config("gpt2")


@pytest.fixture(scope="module")
def tiny() -> GPT:
    return GPT.random(TINY, seed=0)


def kv_per_token(cfg: GPTConfig) -> int:
    return 2 * cfg.n_layer * cfg.n_embd * 4  # K and V, every layer, fp32


def test_model_memory(tiny: GPT) -> None:
    mm = model_memory(tiny)
    n_params = sum(p.numel() for p in tiny.parameters())  # tied weight once
    assert mm["weights_bytes"] == 4 * n_params == mm["weights_formula_bytes"]
    assert mm["mask_bytes_by_kind"] == {"seed": 2 * 128 * 128 * 4, "shared_bool": 128 * 128,
                                        "none": 0}
    assert mm["mask_bytes"] == 0  # no mode has run: nothing built
    state = ModelState.of(tiny)  # while a state holds the model, what it built counts
    state.attention("seed")
    assert model_memory(tiny)["mask_bytes"] == 2 * 128 * 128 * 4
    del state
    assert model_memory(tiny)["mask_bytes"] == 0  # gone with the state


@pytest.mark.parametrize("fill", ["prefill", "decode"])
def test_concat_cache_tensor_bytes_equal_the_formula(tiny: GPT, fill: str) -> None:
    rows = measure_kv_memory(tiny, [16, 48, 32], batch_size=2, cache_kind="concat", fill=fill)
    assert [r["context_len"] for r in rows] == [16, 32, 48]
    for r in rows:
        want = kv_per_token(TINY) * 2 * r["context_len"]
        assert r["kv_formula_bytes"] == r["kv_tensor_bytes"] == r["kv_used_bytes"] == want
        assert r["allocated_delta_bytes"] is None and r["reserved_delta_bytes"] is None  # CPU
        assert isinstance(r["rss_delta_bytes"], int) and r["baseline"] == "after warm-up"
    # The cache owns its storage: no views into the fused q|k|v projection keep it alive.
    for r in rows:
        assert r["kv_storage_bytes"] == r["kv_tensor_bytes"]


def test_prealloc_rows_and_baseline_label(tiny: GPT) -> None:
    rows = measure_kv_memory(tiny, [8, 24], cache_kind="prealloc", fill="decode",
                             warmup_first=False)
    assert all(r["baseline"] == "before warm-up" for r in rows)
    assert [r["kv_used_bytes"] for r in rows] == [kv_per_token(TINY) * t for t in (8, 24)]
    assert all(r["kv_tensor_bytes"] == kv_per_token(TINY) * 24 for r in rows)  # capacity
    with pytest.raises(ValueError, match="fill"):
        measure_kv_memory(tiny, [8], fill="sideways")


def test_storage_bytes_counts_shared_storage_once() -> None:
    base = torch.zeros(10, 6)
    assert storage_bytes([base[:, :2], base[:, 2:4]]) == 240


def test_breakdown_rows(tiny: GPT) -> None:
    formula = breakdown_formula(TINY, "float32", 1, 64)
    assert {r["source"] for r in formula} <= {"formula", "measured"}
    comp = {r["component"]: r for r in formula}
    assert comp["KV cache"]["bytes"] == kv_per_token(TINY) * 64
    assert comp["weights"]["bytes"] == costs.weight_bytes(TINY, "float32")
    seed_formula = {r["component"]: r for r in breakdown_formula(TINY, "float32", 1, 8, "seed")}
    assert seed_formula["causal-mask buffers"]["bytes"] == 2 * 128 * 128 * 4
    measured = {r["component"]: r for r in memory_breakdown(tiny, 2, 64, mask="seed")}
    assert measured["causal-mask buffers"]["bytes"] == 2 * 128 * 128 * 4
    assert measured["KV cache"]["bytes"] == kv_per_token(TINY) * 2 * 64
    assert measured["cuBLAS workspace"]["bytes"] == 0
    assert measured["process, not accounted above"]["bytes"] > 0
    assert all(r["bytes"] >= 0 for r in measured.values())


def test_no_cublas_workspace_on_cpu() -> None:
    assert cublas_workspace("cpu")[0] is None
    assert "CPU" in cublas_workspace("cpu")[1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cublas_workspace_measured_on_cuda() -> None:
    assert cublas_workspace("cuda")[0] > 0


def test_crossover_for_gpt2_is_about_6750_tokens() -> None:
    # Independently: GPT-2 small has 124,439,808 parameters; fp32 weights / 72 KiB per token.
    want = 124_439_808 * 4 / (2 * 12 * 768 * 4)
    rows = crossover_grid(GPT2, "float32", [1, 7, 64], [1024])
    assert rows[0]["crossover_tokens"] == pytest.approx(want) == pytest.approx(6750, rel=0.01)
    assert rows[0]["kv_bytes"] == 73_728 * 1024
    assert rows[1]["kv_over_weights"] == pytest.approx(7 * 1024 / want)
    assert rows[2]["kv_bytes"] == 64 * 72 * 2**20  # 4.5 GiB for 64 full-length sequences


def test_peak_estimate_and_fits() -> None:
    cached = peak_memory_estimate(GPT2, "float32", 1, 1024, "prealloc", device="cpu")
    uncached = peak_memory_estimate(GPT2, "float32", 1, 1024, None, device="cpu")
    assert cached["total_bytes"] == sum(v for k, v in cached.items() if k != "total_bytes")
    assert cached["kv_bytes"] == 73_728 * 1024 and uncached["kv_bytes"] == 0
    assert uncached["activation_bytes"] >= 1024 * 50257 * 4  # the logits at every position
    assert cached["workspace_bytes"] == 0
    assert peak_memory_estimate(GPT2, "float32", 1, 8, device="cuda")["workspace_bytes"] > 0
    ok, msg = fits("cpu", peak_memory_estimate(TINY, "float32", 1, 128, device="cpu"))
    assert ok and "fits" in msg
    huge = peak_memory_estimate(GPT2, "float32", 256, 1024, "concat", device="cpu")
    huge = {**huge, "total_bytes": huge["total_bytes"] * 1000}
    ok, msg = fits("cpu", huge)
    assert not ok and "does not fit" in msg and "\n" not in msg


def test_mask_rows_count_what_the_measured_path_used_and_leave_the_model_alone() -> None:
    state = ModelState(GPT.random(TINY, seed=0))  # its own variant: "none", no buffers
    model = state.model
    assert state.mask_nbytes() == 0
    seed = {r["component"]: r for r in memory_breakdown(model, 1, 16, mask="seed")}
    assert seed["causal-mask buffers"]["bytes"] == 2 * 128 * 128 * 4
    assert state.mask_nbytes() == 0  # measuring built them and freed them again
    make_decoder(model, "uncached").prefill(torch.zeros(1, 4, dtype=torch.long))  # mode 1 runs
    assert state.mask_nbytes() == 2 * 128 * 128 * 4
    none = {r["component"]: r for r in memory_breakdown(model, 1, 16, mask="none")}
    assert none["causal-mask buffers"]["bytes"] == 0  # not the buffers mode 1 left behind
    assert state.mask_nbytes("seed") == 2 * 128 * 128 * 4  # and those are still there
