"""The Triton decode attention (engine/kernels/gpu/decode_attention.py) against torch on a CPU,
under TRITON_INTERPRET=1: multi-head and grouped-query heads, a context of 1, the last slot,
lengths that differ across the batch, tiles and splits cut at ragged edges, fp32 and bf16; and
each check fails on a planted bug (a mask edge off by one, a wrong GQA group, a split's start)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from .triton_util import DEVICE, planted

pytestmark = pytest.mark.triton

da = pytest.importorskip("engine.kernels.gpu.decode_attention")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
              ) -> torch.Tensor:
    """Softmax attention of each sequence's query over its first ``lengths[b]`` rows, in fp64."""
    B, nh, hs = q.shape
    group = nh // k.size(1)
    out = []
    for b in range(B):
        n = int(lengths[b])
        kb = k[b, :, :n].double().repeat_interleave(group, 0)  # (nh, n, hs)
        vb = v[b, :, :n].double().repeat_interleave(group, 0)
        w = torch.softmax(torch.einsum("hd,hnd->hn", q[b].double(), kb) / hs ** 0.5, -1)
        out.append(torch.einsum("hn,hnd->hd", w, vb))
    return torch.stack(out).cpu()


def case(n_kv: int, lengths: list[int], t_max: int = 80, nh: int = 4, hs: int = 16,
         dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)
    q = torch.randn(B, nh, hs, generator=gen).to(dtype)
    k = torch.randn(B, n_kv, t_max, hs, generator=gen).to(dtype)
    v = torch.randn(B, n_kv, t_max, hs, generator=gen).to(dtype)
    for b, n in enumerate(lengths):  # rows past the length hold garbage a kernel must not read
        k[b, :, n:] = 50.0
        v[b, :, n:] = 1e4
    return (q.to(DEVICE), k.to(DEVICE), v.to(DEVICE),
            torch.tensor(lengths, dtype=torch.int32, device=DEVICE))


CASES = [  # (K/V heads of 4 query heads, lengths of the batch, cache rows)
    (4, [1], 80), (4, [80], 80), (4, [37, 64], 80), (2, [33, 1], 80), (1, [65, 80], 80),
    (2, [5], 7), (4, [300], 300),
]


def worst_error(mod: ModuleType, n_kv: int, lengths: list[int], t_max: int,
                dtype: torch.dtype = torch.float32) -> float:
    q, k, v, lens = case(n_kv, lengths, t_max, dtype=dtype)
    got = mod.decode_attention(q, k, v, lens)
    assert got.shape == q.shape and got.dtype == dtype
    return float((got.double().cpu() - reference(q, k, v, lens)).abs().max())


@pytest.mark.parametrize(("n_kv", "lengths", "t_max"), CASES)
def test_decode_attention_matches_torch(n_kv: int, lengths: list[int], t_max: int) -> None:
    assert worst_error(da, n_kv, lengths, t_max) < 1e-5


def test_decode_attention_in_bf16_is_within_bf16_rounding() -> None:
    assert worst_error(da, 2, [37, 80], 80, torch.bfloat16) < 2e-2


def test_the_grid_depends_on_the_capacity_only() -> None:
    """A CUDA graph replays one grid at every position: splits come from T_max, not lengths."""
    assert da.splits_for(1024, 12) == da.splits_for(1024, 12)
    split_t, n = da.splits_for(1024, 12)
    assert split_t % da.BLOCK_T == 0 and split_t * n >= 1024 > split_t * (n - 1)
    assert n * 12 >= da.MIN_PROGRAMS // 2  # whole tiles per split: within 2x of the aim
    assert da.splits_for(8192, 256 * 12)[1] == 1  # a large batch needs no split


def test_bad_shapes_say_what_is_allowed() -> None:
    q, k, v, lens = case(3, [4], 16, nh=4)
    with pytest.raises(ValueError, match="n_kv dividing nh"):
        da.decode_attention(q, k, v, lens)


@pytest.mark.parametrize(("old", "new", "bug"), [
    ("tmask = t < end", "tmask = t <= end", "reads the row past the length"),
    ("heads = g * GROUP + j", "heads = g + j * N_KV", "wrong GQA group"),
    ("start = split * split_t", "start = split * split_t + 1", "a split skips its first row"),
    ("w = tl.exp(lse - tl.max(lse, axis=0))", "w = tl.exp(lse - tl.max(lse, axis=0)) * 0 + 1",
     "splits merged unweighted"),
])
def test_each_check_fails_on_a_planted_bug(old: str, new: str, bug: str,
                                           tmp_path: Path) -> None:
    mod = planted(da, old, new, tmp_path)
    worst = max(worst_error(mod, n_kv, lengths, t_max) for n_kv, lengths, t_max in CASES)
    assert not worst < 1e-3, f"the checks missed a planted bug: {bug}"  # NaN counts as caught


def test_mode_6_with_the_kernel_gives_mode_1s_tokens() -> None:
    """Mode 6's step with the decode kernel (its GPU attention), run eagerly: mode 1's tokens."""
    from engine import decode, make_decoder
    from engine.decoders.captured import CudaGraphDecoder

    from .conftest import random_prompt, small_model

    model = small_model(n_layer=2, block_size=64).to(DEVICE)
    prompt = random_prompt(5).to(DEVICE)
    want = decode(make_decoder(model, "uncached"), prompt, 12).tokens
    dec = CudaGraphDecoder(model, capture=DEVICE == "cuda", triton=True)
    assert dec.attended_keys(9) == 9  # it reads the filled rows, not the capacity
    assert torch.equal(decode(dec, prompt, 12).tokens, want)
