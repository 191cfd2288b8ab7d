"""The KV cache is exact: cached == uncached, and multi-token appends equal a full forward.

These are the tests that must go red on the write-up's silent bugs; ``test_bug_is_caught``
switches each bug on and asserts that at least the named check fails.
"""

from __future__ import annotations

import pytest
import torch

from engine import generate
from engine.cache import CACHE_KINDS, QUANTIZED_KINDS, make_cache
from engine.models.attention import make_attention
from engine.models.config import MASK_KINDS
from instruments.checks.bugs import inject_bug
from instruments.checks.correctness import cached_equals_uncached, multi_token_append

from .conftest import random_prompt, small_model

# the quantized caches are lossy by design: bounded in tests/test_kv_variants.py, not exact
EXACT = [k for k in CACHE_KINDS if k not in QUANTIZED_KINDS]


@pytest.mark.parametrize("mask", MASK_KINDS)
@pytest.mark.parametrize("cache_kind", EXACT)
@pytest.mark.parametrize("batch", [1, 3])
def test_cached_equals_uncached_200_tokens(mask: str, cache_kind: str, batch: int) -> None:
    model = small_model(mask)
    prompt = random_prompt(8, batch)
    cached = generate(model, prompt, 200, use_cache=True, cache_kind=cache_kind)
    uncached = generate(model, prompt, 200, use_cache=False)
    assert cached.shape == (batch, 200)
    assert torch.equal(cached, uncached)
    # The sequences are not degenerate (a model repeating one token would hide bugs).
    assert len(set(cached[0].tolist())) > 20


@pytest.mark.parametrize("mask", MASK_KINDS)
@pytest.mark.parametrize("cache_kind", EXACT)
@pytest.mark.parametrize("n_new", [1, 2, 3, 7])
def test_multi_token_append_matches_full_forward(mask: str, cache_kind: str, n_new: int) -> None:
    model = small_model(mask)
    attn = make_attention(mask, model.config, model.device)
    idx = random_prompt(40, batch=2)
    k = 30
    full, _ = model(idx[:, : k + n_new], use_cache=False, attention=attn)
    cache = make_cache(cache_kind, model, 2)
    _, cache = model(idx[:, :k], cache, attention=attn)
    got, cache = model(idx[:, k : k + n_new], cache, attention=attn)
    assert cache.length == k + n_new
    assert got.shape == (2, n_new, 512)
    torch.testing.assert_close(got, full[:, k : k + n_new], atol=1e-5, rtol=0)


def test_default_forward_returns_cache_that_continues(model) -> None:
    idx = random_prompt(20)
    logits, cache = model(idx[:, :12])
    assert logits.shape == (1, 12, 512) and cache.length == 12
    more, cache = model(idx[:, 12:], cache)
    full, _ = model(idx, use_cache=False)
    torch.testing.assert_close(more, full[:, 12:], atol=1e-5, rtol=0)


def test_crop_reuses_prefill(model) -> None:
    idx = random_prompt(20)
    cache = make_cache("concat", model, 1)
    model(idx[:, :10], cache)
    first, _ = model(idx[:, 10:13], cache)
    cache.crop(10)
    again, _ = model(idx[:, 10:13], cache)
    torch.testing.assert_close(first, again)


# Which check catches which bug. The cache-order bug is invisible to single-token decode
# (attention is a weighted sum, so order does not matter there) and is caught only by a
# multi-token append; it lives in the concatenating cache.
CATCHES = {
    "cache_order": ["append"],
    "positions": ["generate", "append"],
    "mask_offset": ["generate", "append"],
}


@pytest.mark.parametrize("bug", list(CATCHES))
def test_bug_is_caught(bug: str) -> None:
    model = small_model("seed" if bug == "mask_offset" else "none")
    prompt = random_prompt(20)
    with inject_bug(model, bug):
        gen = cached_equals_uncached(model, prompt[:, :8], 60, cache_kind="concat")
        app = multi_token_append(model, prompt, 10, (2, 3, 7), cache_kind="concat")
    results = {"generate": gen.passed, "append": app.passed}
    for check in CATCHES[bug]:
        assert not results[check], f"{check} check missed the {bug} bug"
    if bug == "cache_order":
        assert gen.passed, "single-token decode is order-blind; the write-up's point"
    # And without the bug both pass again.
    assert cached_equals_uncached(model, prompt[:, :8], 60, cache_kind="concat").passed
    assert multi_token_append(model, prompt, 10, (2, 3, 7), cache_kind="concat").passed


@pytest.mark.parametrize("mask", MASK_KINDS)
def test_mask_offset_bug_caught_for_every_mask(mask: str) -> None:
    model = small_model(mask)
    prompt = random_prompt(20)
    with inject_bug(model, "mask_offset"):
        assert not multi_token_append(model, prompt, 10, (2, 3)).passed
        assert not cached_equals_uncached(model, prompt[:, :8], 40).passed
