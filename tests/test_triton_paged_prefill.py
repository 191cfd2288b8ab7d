"""The Triton prefill over a paged cache (engine/kernels/gpu/paged_prefill.py) against torch on a
CPU under TRITON_INTERPRET=1: a prefill from position 0, appends after cached rows, grouped-query
and multi-query heads, a batch, blocks in a shuffled order among spare garbage blocks, tiles cut
at ragged edges; and each check fails on a planted bug (the causal edge off by one, a wrong GQA
group, the first sequence's table read by all)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from .triton_util import DEVICE, planted

pytestmark = pytest.mark.triton

pp = pytest.importorskip("engine.kernels.gpu.paged_prefill")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """Causal attention in fp64: q (B, nh, T, hs) at positions offset.., k/v (B, n_kv, S, hs)."""
    B, nh, T, hs = q.shape
    group = nh // k.size(1)
    kk = k[:, :, : offset + T].double().repeat_interleave(group, 1)
    vv = v[:, :, : offset + T].double().repeat_interleave(group, 1)
    s = q.double() @ kk.transpose(-1, -2) / hs ** 0.5  # (B, nh, T, S)
    pos = offset + torch.arange(T)[:, None]
    s = s.masked_fill(torch.arange(offset + T)[None, :] > pos, float("-inf"))
    return torch.softmax(s, -1) @ vv


def case(n_kv: int, B: int, T: int, offset: int, bt: int, nh: int = 4, hs: int = 16,
         seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, the contiguous k/v (B, n_kv, S, hs), and the same rows in a shuffled pool: k_pool,
    v_pool, table. Rows past offset + T hold garbage a kernel must not read."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-(offset + T + 5) // bt)
    S = per_seq * bt
    q = torch.randn(B, nh, T, hs, generator=gen)
    k = torch.randn(B, n_kv, S, hs, generator=gen)
    v = torch.randn(B, n_kv, S, hs, generator=gen)
    k[:, :, offset + T :], v[:, :, offset + T :] = 50.0, 1e4
    n_blocks = B * per_seq + 3  # three blocks nobody holds
    table = torch.randperm(n_blocks, generator=gen)[: B * per_seq].view(B, per_seq)
    pools = []
    for src, junk in ((k, 50.0), (v, 1e4)):
        pool = torch.full((n_blocks, n_kv, bt, hs), junk)
        pool[table.flatten()] = src.view(B, n_kv, per_seq, bt, hs).transpose(1, 2).reshape(
            B * per_seq, n_kv, bt, hs)
        pools.append(pool.to(DEVICE))
    return q.to(DEVICE), k, v, pools[0], pools[1], table.to(DEVICE)


CASES = [  # (K/V heads of 4 query heads, batch, new tokens, cached before, block rows)
    (4, 1, 5, 0, 16), (2, 2, 7, 20, 16), (1, 2, 33, 40, 8), (2, 1, 40, 0, 16), (4, 2, 1, 17, 16),
    (2, 1, 3, 29, 4),
]


def worst_error(mod: ModuleType, n_kv: int, B: int, T: int, offset: int, bt: int) -> float:
    q, k, v, k_pool, v_pool, table = case(n_kv, B, T, offset, bt)
    got = mod.paged_prefill(q, k_pool, v_pool, table, offset)
    assert got.shape == q.shape
    return float((got.double().cpu() - reference(q.cpu(), k, v, offset)).abs().max())


@pytest.mark.parametrize(("n_kv", "B", "T", "offset", "bt"), CASES)
def test_paged_prefill_matches_torch(n_kv: int, B: int, T: int, offset: int, bt: int) -> None:
    assert worst_error(pp, n_kv, B, T, offset, bt) < 1e-5


def test_a_cache_too_short_for_the_tokens_says_what_is_allowed() -> None:
    q, _, _, k_pool, v_pool, table = case(2, 1, 4, 0, 16)
    with pytest.raises(ValueError, match="holding offset \\+ T rows"):
        pp.paged_prefill(q, k_pool, v_pool, table, table.size(1) * 16)


@pytest.mark.parametrize(("old", "new", "bug"), [
    ("seen = (p[None, :] <= pos[:, None])", "seen = (p[None, :] < pos[:, None])",
     "a token does not see itself"),
    ("heads = g * GROUP + j", "heads = g + j * N_KV", "wrong GQA group"),
    ("tab_ptr + b * st_b", "tab_ptr + 0 * st_b", "every sequence reads the first one's table"),
])
def test_each_check_fails_on_a_planted_bug(old: str, new: str, bug: str,
                                           tmp_path: Path) -> None:
    mod = planted(pp, old, new, tmp_path)
    worst = max(worst_error(mod, *c) for c in CASES)
    assert not worst < 1e-3, f"the checks missed a planted bug: {bug}"  # NaN counts as caught


# --------------------------------------------------------------- the prefix cache read in place
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("p", [0, 7, 8, 9, 39])
def test_a_request_read_in_place_equals_its_full_prefill(family: str, p: int) -> None:
    """The prefix cache's GPU path: no copy at admission, each forward's rows written into the
    request's own blocks and attended through its table -- a full prefill's logits and greedy
    tokens at hit lengths around the block edges (tests/test_prefix_exact.py's comparison)."""
    from tests.test_prefix_exact import reuse_at, tiny

    reuse_at(tiny(family).to(DEVICE), p, reads="in_place")


def test_in_place_stays_exact_under_eviction_pressure() -> None:
    from tests.test_prefix_exact import pressure, tiny

    cache = pressure(tiny("llama").to(DEVICE), reads="in_place")
    assert cache.in_place and cache.evictions > 0 and cache.scratch_bytes() == 0  # no buffers


def test_the_in_place_comparison_fails_when_a_layers_rows_are_not_written(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.cache.blocks import BlockPool
    from tests.test_prefix_exact import reuse_at, tiny

    real = BlockPool.write

    def forgetful(self: BlockPool, ids: list[int], start: int, k: torch.Tensor,
                  v: torch.Tensor, layer: int | None = None) -> None:
        if layer != 1:  # the second layer's new rows never reach their blocks
            real(self, ids, start, k, v, layer)

    monkeypatch.setattr(BlockPool, "write", forgetful)
    with pytest.raises(AssertionError):
        reuse_at(tiny("llama").to(DEVICE), 9, reads="in_place")
