"""The CPU matrix-vector kernel (``engine.kernels``) against ``F.linear``.

fp32 weights: equal up to float32 summation order (~1e-6 of the output's scale); bf16 and int8
weights: equal to ``F.linear`` over the same weights dequantized to fp32 (the kernel converts in
registers and adds nothing of its own). Odd sizes cover the kernel's tails (rows not a multiple
of 4, widths not a multiple of the vector length); bad input is refused with what is allowed.
The attention against SDPA, multi-head and grouped-query (``enable_gqa``).
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import torch.nn.functional as F

from engine import kernels


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler on this machine: the kernel cannot be built (the modes "
                    "then run on torch's kernels)")
    ok, why = kernels.build()
    assert ok, why  # with a compiler, a failed build is a bug


def _int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("out, inn", [(64, 768), (2305, 768), (7, 37), (130, 3072)])
def test_every_weight_type_matches_f_linear(batch: int, out: int, inn: int) -> None:
    gen = torch.Generator().manual_seed(out * inn + batch)
    x = torch.randn(batch, inn, generator=gen)
    w = torch.randn(out, inn, generator=gen) * 0.02
    b = torch.randn(out, generator=gen)
    ref = F.linear(x, w, b)
    got = kernels.linear(x, w, None, b)
    assert (got - ref).abs().max() <= 2e-6 * max(1.0, ref.abs().max().item())
    wb = w.to(torch.bfloat16)
    ref_b = F.linear(x, wb.float(), b)
    assert (kernels.linear(x, wb, None, b) - ref_b).abs().max() <= 2e-6 * ref_b.abs().max()
    wq, scale = _int8(w)
    ref_q = F.linear(x, wq.float() * scale[:, None], b)
    got_q = kernels.linear(x, wq, scale, b)
    assert (got_q - ref_q).abs().max() <= 2e-6 * ref_q.abs().max()
    assert (kernels.linear(x, wq, scale, None) - (ref_q - b)).abs().max() <= 2e-5


def test_a_wrong_result_would_be_seen() -> None:
    """The tolerance above is tight enough to see one weight dropped from a row."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 768, generator=gen), torch.randn(64, 768, generator=gen)
    dropped = w.clone()
    dropped[3, 700] = 0
    got = kernels.linear(x, dropped, None, None)
    ref = F.linear(x, w)
    assert (got - ref).abs().max() > 2e-6 * ref.abs().max()


@pytest.mark.parametrize("args, message", [
    ((torch.randn(1, 8), torch.randn(4, 8, dtype=torch.float64)), "float32, bfloat16 or int8"),
    ((torch.randn(1, 8), torch.randn(4, 9)), "contiguous (out, in)"),
    ((torch.randn(9, 8), torch.randn(4, 8)), "1 to 8 rows"),
    ((torch.randn(1, 8), torch.zeros(4, 8, dtype=torch.int8)), "int8 weights need"),
    ((torch.randn(1, 8).double(), torch.randn(4, 8)), "contiguous fp32"),
])
def test_bad_input_says_what_is_allowed(args: tuple, message: str) -> None:
    with pytest.raises(RuntimeError, match=re.escape(message)):
        kernels.linear(*args)


def test_a_library_built_from_another_source_is_not_loaded(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Whether the built library is current is judged by the source's hash, not file times (a
    fresh checkout makes the source look newer than a library built from the same text)."""
    monkeypatch.setenv("KVLAB_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_state", {"loaded": False, "why": "not built yet"})
    where = kernels._build_dir()  # tmp_path, or a folder in it for a KVLAB_KERNEL_ISA build
    kernels._library(where).write_bytes(b"not a library")
    kernels._stamp(where).write_text("0" * 64)  # another source
    ok, why = kernels.available()
    assert not ok and "not built" in why
    kernels._stamp(where).write_text(kernels._source_hash())
    assert kernels.available() == (False, "not built yet")  # asked once per process
    monkeypatch.setattr(kernels, "_state", {"loaded": False, "why": ""})
    ok, why = kernels.available()  # now it matches: it tries to load it, and says why not
    assert not ok and "did not load" in why


def _sdpa_reference(q, k, v, k_buf, v_buf, pos):  # noqa: ANN001, ANN202
    kb, vb = k_buf.clone(), v_buf.clone()
    kb[:, :, pos], vb[:, :, pos] = k, v
    y = F.scaled_dot_product_attention(q.unsqueeze(2), kb[:, :, : pos + 1], vb[:, :, : pos + 1])
    return y.squeeze(2), kb, vb


@pytest.mark.parametrize("batch, nh, hs, t_max, pos", [
    (1, 12, 64, 600, 511), (1, 12, 64, 1024, 1023), (2, 3, 20, 40, 0), (3, 4, 16, 33, 17),
    (1, 2, 8, 9, 6),
    # an odd number of rows (the single-pass value sum's last row), the widest head it takes
    # (8 vectors with AVX-512), and one wider (the lane-group loop)
    (1, 4, 64, 300, 128), (1, 2, 128, 200, 128), (1, 1, 160, 50, 30),
])
def test_attend_matches_sdpa_and_writes_the_cache(batch: int, nh: int, hs: int, t_max: int,
                                                  pos: int) -> None:
    """One query over rows 0..pos after writing row ``pos``: SDPA's result to float32 rounding,
    the cache written at ``pos`` and nowhere else. q, k, v are views of one fused q|k|v output,
    as a step passes them; odd head sizes and lengths cover the kernel's scalar tails."""
    gen = torch.Generator().manual_seed(batch * 1000 + pos)
    q, k, v = torch.randn(batch, 3, nh, hs, generator=gen).unbind(1)
    k_buf = torch.randn(batch, nh, t_max, hs, generator=gen) * 3  # large scores: exp's range
    v_buf = torch.randn(batch, nh, t_max, hs, generator=gen)
    ref, kb, vb = _sdpa_reference(q, k, v, k_buf, v_buf, pos)
    got = kernels.attend(q, k, v, k_buf, v_buf, pos)
    assert got.shape == (batch, nh, hs)
    assert (got - ref).abs().max() <= 2e-6 * ref.abs().max()
    assert torch.equal(k_buf, kb) and torch.equal(v_buf, vb)


def test_attend_would_show_a_missed_key() -> None:
    """The tolerance above sees the attention stop one row short (the new token's own key)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 3, 12, 64, generator=gen).unbind(1)
    k_buf, v_buf = torch.randn(1, 12, 200, 64, generator=gen), torch.randn(1, 12, 200, 64,
                                                                          generator=gen)
    ref, _, _ = _sdpa_reference(q, k, v, k_buf, v_buf, 128)
    short, _, _ = _sdpa_reference(q, k_buf[:, :, 127], v_buf[:, :, 127], k_buf, v_buf, 127)
    assert (short - ref).abs().max() > 2e-6 * ref.abs().max()
    assert (kernels.attend(q, k, v, k_buf, v_buf, 128) - ref).abs().max() <= 2e-6 * ref.abs().max()


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "pos": 9}, "0 <= pos < T"),
    (lambda a: {**a, "k_buf": a["k_buf"].transpose(2, 3).contiguous().transpose(2, 3)},
     "contiguous (T, hs) rows"),
    (lambda a: {**a, "v": a["v"][:, :1]}, "v must be (B, n_kv, hs) like k"),
    (lambda a: {**a, "k": a["k"][:, :1], "v": a["v"][:, :1]}, "(B, n_kv, T, hs) like k"),
    (lambda a: {**a, "q": torch.randn(1, 3, 8)}, "must divide q's (3)"),
    (lambda a: {**a, "q": a["q"].double()}, "must be fp32 on the CPU"),
])
def test_attend_bad_input_says_what_is_allowed(change, message: str) -> None:  # noqa: ANN001
    args = {"q": torch.randn(1, 2, 8), "k": torch.randn(1, 2, 8), "v": torch.randn(1, 2, 8),
            "k_buf": torch.zeros(1, 2, 9, 8), "v_buf": torch.zeros(1, 2, 9, 8), "pos": 3}
    with pytest.raises(RuntimeError, match=re.escape(message)):
        kernels.attend(**change(args))


@pytest.mark.parametrize("batch, nh, nkv, hs, t_max, pos", [
    (1, 9, 3, 64, 300, 127),   # SmolLM2-135M: 9 query heads over 3 K/V heads of 64
    (2, 9, 3, 64, 40, 0), (3, 4, 2, 16, 33, 17), (1, 6, 1, 64, 200, 150),  # one K/V head: MQA
    (2, 8, 2, 20, 50, 31),  # a head size off the vector width
])
def test_grouped_query_attend_matches_sdpa(batch: int, nh: int, nkv: int, hs: int, t_max: int,
                                           pos: int) -> None:
    """Query head h reads K/V head h // (nh / n_kv): SDPA with ``enable_gqa`` (which repeats
    each K/V head for its group), the (B, n_kv, T, hs) cache written at ``pos`` only."""
    gen = torch.Generator().manual_seed(nh * 100 + nkv * 10 + pos)
    q = torch.randn(batch, nh, hs, generator=gen)
    k, v = torch.randn(batch, 2, nkv, hs, generator=gen).unbind(1)
    k_buf = torch.randn(batch, nkv, t_max, hs, generator=gen) * 3
    v_buf = torch.randn(batch, nkv, t_max, hs, generator=gen)
    kb, vb = k_buf.clone(), v_buf.clone()
    kb[:, :, pos], vb[:, :, pos] = k, v
    ref = F.scaled_dot_product_attention(q.unsqueeze(2), kb[:, :, : pos + 1],
                                         vb[:, :, : pos + 1], enable_gqa=True).squeeze(2)
    rep = nh // nkv  # the same by hand: each K/V head repeated for its group
    ref2 = F.scaled_dot_product_attention(
        q.unsqueeze(2), kb[:, :, : pos + 1].repeat_interleave(rep, 1),
        vb[:, :, : pos + 1].repeat_interleave(rep, 1)).squeeze(2)
    assert torch.allclose(ref, ref2, rtol=0, atol=1e-6)
    got = kernels.attend(q, k, v, k_buf, v_buf, pos)
    assert got.shape == (batch, nh, hs)
    assert (got - ref).abs().max() <= 2e-6 * ref.abs().max()
    assert torch.equal(k_buf, kb) and torch.equal(v_buf, vb)
    if nkv > 1:  # the tolerance sees heads paired the other way (h % n_kv)
        wrong = F.scaled_dot_product_attention(
            q.unsqueeze(2), kb[:, :, : pos + 1].repeat(1, rep, 1, 1),
            vb[:, :, : pos + 1].repeat(1, rep, 1, 1)).squeeze(2)
        assert (wrong - ref).abs().max() > 1e-3


@pytest.mark.parametrize("batch, out, inn", [(1, 37, 48), (3, 2304, 768), (8, 130, 3072),
                                             (1, 50257, 768)])
def test_interleaved_weights_give_the_same_product(batch: int, out: int, inn: int) -> None:
    """``interleave`` + ``linear_interleaved``: F.linear's result to float32 summation order,
    rows not a multiple of 4 included (padded with zero rows that are never returned)."""
    gen = torch.Generator().manual_seed(out + inn)
    x, w = torch.randn(batch, inn, generator=gen), torch.randn(out, inn, generator=gen) * 0.02
    b = torch.randn(out, generator=gen)
    wi = kernels.interleave(w)
    assert wi.shape == (-(-out // 4), inn // 16, 4, 16)
    ref = F.linear(x, w, b)
    got = kernels.linear_interleaved(x, wi, out, b)
    assert got.shape == ref.shape
    assert (got - ref).abs().max() <= 2e-6 * max(1.0, ref.abs().max().item())
    swapped = kernels.interleave(torch.cat([w[1:2], w[:1], w[2:]]))  # two rows' order lost
    assert (kernels.linear_interleaved(x, swapped, out, b) - ref).abs().max() > 1e-3
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.interleave(torch.randn(4, 20))

