"""The KV memory planner: its formulas at gpt2's shapes, the caches it allocates holding exactly
the bytes the formulas say, the int8 storage's measured error, and clear messages for bad input."""

from __future__ import annotations

import pytest
import torch

from engine import GPT, GPTConfig, families
from engine.cache import make_cache
from engine.cache.paged import PagedKVCache
from instruments.costmodel import kv_plan
from instruments.experiments import EXPERIMENTS
from instruments.experiments.planner import PlannerParams
from instruments.measure import memory

from .conftest import loaded_model

GPT2 = families.config("gpt2")
pytestmark = pytest.mark.timeout(600)


def test_bytes_per_token_at_gpt2_shapes_match_the_caches() -> None:
    assert kv_plan.kv_bytes_per_token(GPT2, "float32") == 73_728
    assert kv_plan.kv_bytes_per_token(GPT2, "float32", "bfloat16") == 36_864
    assert kv_plan.kv_bytes_per_token(GPT2, "float32", "int8") == 18_432 + 1_152  # + fp32 scales
    assert kv_plan.kv_bytes_per_token(GPT2, "float32", kv_heads=1) == 6_144  # multi-query
    small = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=64)
    model = GPT.random(small)
    for kind, storage in (("prealloc", None), ("kv_int8", "int8"), ("kv_float16", "float16")):
        cache = make_cache(kind, model, 3, 32)
        assert cache.nbytes() == 3 * 32 * kv_plan.kv_bytes_per_token(small, "float32", storage)


def test_lengths_are_seeded_bounded_and_extend_as_a_prefix() -> None:
    for dist in kv_plan.DISTRIBUTIONS:
        few = kv_plan.draw_lengths(dist, 16, 256, 1024, seed=3)
        many = kv_plan.draw_lengths(dist, 4096, 256, 1024, seed=3)
        assert many[:16] == few  # the page's batch is the start of the curve's draw
        assert all(1 <= n <= 1024 for n in many)
    assert set(kv_plan.draw_lengths("fixed", 5, 100, 1024)) == {100}
    tail = kv_plan.draw_lengths("long-tailed", 4096, 256, 1024)
    assert sorted(tail)[len(tail) // 2] < 256 < max(tail)  # most are short, some are long
    with pytest.raises(ValueError, match="distribution must be one of"):
        kv_plan.draw_lengths("zipf", 4, 10, 100)


def test_layouts_reserve_what_each_scheme_holds() -> None:
    lengths = [1, 16, 17, 100]
    rows = {r["layout"]: r for r in kv_plan.layouts(lengths, 128, 16, 10, budget_bytes=10_000)}
    assert rows["contiguous"]["reserved_bytes"] == 4 * 128 * 10
    assert rows["exact"]["reserved_bytes"] == rows["exact"]["used_bytes"] == 134 * 10
    assert rows["exact"]["wasted_bytes"] == 0
    assert rows["paged"]["reserved_bytes"] == (1 + 1 + 2 + 7) * 16 * 10
    assert rows["contiguous"]["fits_sequences"] == 10_000 // (128 * 10)
    assert rows["paged"]["fits_sequences"] > rows["contiguous"]["fits_sequences"]


def test_a_paged_pool_hands_out_exactly_the_blocks_mixed_lengths_need() -> None:
    cache = PagedKVCache(2, 3, 4, 64, 8, block_tokens=16, pool_blocks=1 + 2 + 4)
    for seq, n in enumerate([5, 20, 64]):
        cache.reserve(seq, n)
    assert cache.free == [] and cache.held == [1, 2, 4]
    with pytest.raises(ValueError, match="out of blocks"):
        cache.reserve(0, 17)


def test_an_allocation_that_does_not_fit_is_reported_not_raised() -> None:
    def too_big() -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB")

    row = memory.allocation("cpu", too_big)
    assert row["fits"] is False and "80 GiB" in row["error"]


def test_planner_on_gpt2_allocates_exactly_its_formulas() -> None:
    model = GPT.random(GPT2)
    params = PlannerParams("long-tailed", 4, 64, 16, contexts=[64, 1024], max_alloc_mib=320)
    run = EXPERIMENTS["planner"].run(loaded_model(model, "gpt2"), params)
    meta, tables = run["meta"], run["tables"]
    assert meta["budget_bytes"] < meta["free_bytes"]
    for row in tables["fit"]:  # capped at 320 MiB: 4 x 1024 tokens or 71 x 64 tokens of gpt2
        assert row["fits"] and row["capped"]
        assert row["tensor_bytes"] == row["formula_bytes"] == \
            row["allocated_batch"] * row["context_len"] * 73_728
        assert abs(row["rss_delta_bytes"] - row["tensor_bytes"]) < 0.05 * row["tensor_bytes"]
    layouts = {r["layout"]: r for r in tables["layouts"]}
    assert layouts.keys() == {"contiguous", "exact", "paged"}
    for row in layouts.values():
        assert row["tensor_bytes"] == row["reserved_bytes"], row
    assert layouts["contiguous"]["waste_share"] > layouts["paged"]["waste_share"] >= 0
    storages = {r["storage"]: r for r in tables["storages"]}
    for row in storages.values():
        assert row["measured_bytes_per_token"] == row["bytes_per_token"]
    assert storages["float32"]["rel_error"] < 1e-5
    assert 2e-3 < storages["int8"]["rel_error"] < 5e-3  # lossy, near the 0.32% measured
    assert storages["float16"]["rel_error"] < storages["int8"]["rel_error"]
    heads = tables["kv_heads"]
    assert [h["kv_heads"] for h in heads] == [12, 6, 4, 3, 2, 1]
    assert all(h["kind"].endswith("(what-if)") for h in heads[1:])


@pytest.mark.parametrize(("change", "says"), [
    ({"distribution": "zipf"}, "distribution must be one of"),
    ({"block_tokens": 0}, "block size (tokens) must be a whole number"),
    ({"mean_len": 5000}, "mean length must be a whole number 1..1024"),
    ({"sequences": 0}, "sequences must be a whole number"),
])
def test_bad_planner_input_says_what_is_allowed(change: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        PlannerParams(**change).check(GPT2, "cpu")
