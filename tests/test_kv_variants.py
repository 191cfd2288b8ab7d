"""The paged and the int8 KV caches (modes 10 and 11): the paged one is exact against mode 1 at
every mask variant and batch 2, hands out blocks on demand and takes them back on crop; the int8
one is lossy by a measured, bounded amount, and the gate still refuses a broken one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import GPT, families, make_decoder
from engine.cache import make_cache
from engine.cache.paged import PagedKVCache
from engine.cache.quantized import QuantizedKVCache
from engine.models.config import MASK_KINDS
from engine.modes import MODES
from instruments.checks.bugs import private_view
from instruments.checks.gate import Gate

from .conftest import random_prompt, small_model

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def gpt2() -> GPT:
    return GPT.random(families.config("gpt2"))


@pytest.mark.parametrize("mask", MASK_KINDS)
def test_paged_mode_passes_the_gate_at_every_mask_with_batch_2(
        mask: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = MODES["paged"]
    monkeypatch.setitem(MODES, "paged", dataclasses.replace(
        spec, options={**spec.options, "mask": mask}))
    model = small_model()
    gate = Gate(model, batch=2)
    check = gate.check("paged")
    assert check.passed, check.detail
    assert check.tolerance == pytest.approx(1e-4 * gate.reference()["scale"])  # fp32's: exact
    dec = make_decoder(model, "paged", batch_size=2)
    assert dec.mask == mask


def test_paged_cache_holds_the_same_values_as_the_preallocated_one() -> None:
    model = small_model()
    idx = random_prompt(40, batch=2)
    want, _ = model(idx, use_cache=False, logits="all")
    cache = make_cache("paged", model, 2, 64)
    got = [model(idx[:, :5], cache, logits="all")[0]]
    assert cache.allocated == 1  # 5 tokens: one 16-token block per sequence
    got += [model(idx[:, i : i + 1], cache, logits="last")[0] for i in range(5, 40)]
    assert cache.allocated == 3  # blocks were taken only as positions needed them
    torch.testing.assert_close(torch.cat(got, 1), want, atol=1e-5, rtol=1e-5)
    # the two sequences got different blocks, and the pool kept the rest free
    assert len(set(cache.table[:, :3].flatten().tolist())) == 6
    assert len(cache.free) == cache.table.numel() - 6
    cache.crop(10)  # blocks past position 10 go back to the pool ...
    assert cache.allocated == 1 and len(cache.free) == cache.table.numel() - 2
    again, _ = model(idx[:, 10:20], cache, logits="all")  # ... and are taken again on demand
    torch.testing.assert_close(again, want[:, 10:20], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="at most 64 tokens"):
        model(random_prompt(60, batch=2), cache, logits="last")


def test_paged_cache_bytes() -> None:
    cache = PagedKVCache(2, 3, 4, 40, 8, block_tokens=16)  # 3 blocks per sequence
    per_block = 2 * 4 * 16 * 8 * 4  # layers x heads x tokens x head dim x fp32 bytes, per K or V
    assert cache.nbytes() == 2 * per_block * 3 * 3
    for seq in range(3):
        cache.reserve(seq, 17)
    assert cache.used_nbytes() == 2 * per_block * 2 * 3


def test_int8_error_is_measured_nonzero_and_bounded_on_gpt2(gpt2: GPT) -> None:
    """On gpt2 with random weights: int8 keys/values move the logits (it is not exact), by
    about half a percent of the largest logit (0.52% measured by this gate, batch 2); the mode's
    registered tolerance, 5%, is its contract with the gate and stays as it is."""
    gate = Gate(private_view(gpt2), batch=2)
    check = gate.check("int8_kv")
    assert check.passed, check.detail
    scale = gate.reference()["scale"]
    assert check.tolerance == pytest.approx(MODES["int8_kv"].tolerance * scale)
    # near the 0.52% measured: an error twice as large fails here, long before the 5% would
    assert 0.003 * scale < check.max_diff < 0.01 * scale, check.max_diff / scale
    # fp16 storage is much closer than int8, and still not the fp32 values themselves
    idx = random_prompt(64, batch=1, vocab=50257)
    errors = {}
    with torch.no_grad():
        ref, _ = gpt2(idx, use_cache=False, logits="all")
    for kind in ("prealloc", "kv_float16", "kv_int8"):
        with torch.no_grad():
            out, _ = gpt2(idx, make_cache(kind, gpt2, 1, 64), logits="all")
        errors[kind] = float((out - ref).abs().max())
    assert errors["prealloc"] < errors["kv_float16"] < errors["kv_int8"]


def test_the_gate_refuses_an_int8_cache_that_drops_its_scales(
        gpt2: GPT, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(private_view(gpt2))
    gate.reference()
    monkeypatch.setattr(QuantizedKVCache, "_read",
                        lambda self, q, scale, end: q[:, :, :end].to(self.dtype) / 127)
    check = gate.check("int8_kv")
    assert not check.passed and check.max_diff > check.tolerance


def test_int8_cache_stores_a_quarter_of_fp32_plus_scales() -> None:
    cache = QuantizedKVCache(2, 1, 4, 10, 64, storage="int8")
    fp32 = 2 * (2 * 4 * 10 * 64 * 4)
    scales = 2 * (2 * 4 * 10 * 4)
    assert cache.nbytes() == fp32 // 4 + scales
    with pytest.raises(ValueError, match="storage must be"):
        QuantizedKVCache(2, 1, 4, 10, 64, storage="int4")
