"""The CPU matrix-vector kernel (``engine.kernels.cpu``) against ``F.linear``.

fp32 weights: equal up to float32 summation order (~1e-6 of the output's scale); bf16 and int8
weights: equal to ``F.linear`` over the same weights dequantized to fp32 (the kernel converts in
registers and adds nothing of its own). Odd sizes cover the kernel's tails (rows not a multiple
of 4, widths not a multiple of the vector length); bad input is refused with what is allowed.
The attention against SDPA, multi-head and grouped-query (``enable_gqa``); the fused Llama step
(``decode_layers_llama``) against a plain PyTorch reference written here (RMSNorm, rotate_half
RoPE, repeat_interleave GQA, SwiGLU), for every product kind, GGUF blocks included.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu as kernels


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
    (1, 8, 1, 64, 300, 200), (1, 6, 2, 80, 100, 99),  # groups of 8 (3 + 3 + 2); 10 vectors
])
def test_grouped_query_attend_matches_sdpa(batch: int, nh: int, nkv: int, hs: int, t_max: int,
                                           pos: int) -> None:
    """Query head h reads K/V head h // (nh / n_kv): SDPA with ``enable_gqa`` (which repeats
    each K/V head for its group), at 1 and 2 threads, the (B, n_kv, T, hs) cache written at
    ``pos`` only."""
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
    threads = torch.get_num_threads()
    try:  # one thread: one run of rows per K/V head; two: the rows split in runs, then merged
        for n in (1, 2):
            torch.set_num_threads(n)
            got = kernels.attend(q, k, v, k_buf, v_buf, pos)
            assert got.shape == (batch, nh, hs)
            assert (got - ref).abs().max() <= 2e-6 * ref.abs().max(), n
    finally:
        torch.set_num_threads(threads)
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


# ------------------------------------------------------------------ the fused Llama decode step
def _rope_tables(t: int, hs: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = theta ** -(torch.arange(0, hs, 2, dtype=torch.float64) / hs)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
    return ang.cos().float(), ang.sin().float()  # (T, hs/2)


def _llama_reference(x, norms, mats, k_buf, v_buf, cos, sin, pos, nh, nkv, eps,  # noqa: ANN001, ANN202
                     gptj: bool = False):
    """The step in plain PyTorch, fp64: RMSNorm, rotate_half RoPE, GQA by repeat_interleave,
    SwiGLU; ``mats`` the 7L + 1 weight matrices (out, in); the caches written in place.
    ``gptj``: RoPE's pairs taken as neighbouring channels instead (a wrong layout here)."""
    def rms(h, wt):  # noqa: ANN001, ANN202
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * wt

    def rot(t):  # noqa: ANN001, ANN202
        if gptj:
            c, s = cos[pos].double().repeat_interleave(2), sin[pos].double().repeat_interleave(2)
            return t * c + torch.stack([-t[..., 1::2], t[..., ::2]], -1).flatten(-2) * s
        half = t.size(-1) // 2
        c, s = torch.cat([cos[pos]] * 2).double(), torch.cat([sin[pos]] * 2).double()
        return t * c + torch.cat([-t[..., half:], t[..., :half]], -1) * s

    batch, hs = x.size(0), k_buf.size(-1)
    for i in range(k_buf.size(0)):
        wq, wk, wv, wo, wg, wu, wd = mats[7 * i: 7 * i + 7]
        h = rms(x, norms[2 * i])
        q, k = rot((h @ wq.T).view(batch, nh, hs)), rot((h @ wk.T).view(batch, nkv, hs))
        k_buf[i, :, :, pos], v_buf[i, :, :, pos] = k, (h @ wv.T).view(batch, nkv, hs)
        keys = k_buf[i, :, :, : pos + 1].repeat_interleave(nh // nkv, 1)  # (B, nh, n, hs)
        vals = v_buf[i, :, :, : pos + 1].repeat_interleave(nh // nkv, 1)
        att = torch.softmax((q.unsqueeze(2) @ keys.transpose(-1, -2)) / hs ** 0.5, -1)
        x = x + (att @ vals).reshape(batch, nh * hs) @ wo.T
        h = rms(x, norms[2 * i + 1])
        x = x + (F.silu(h @ wg.T) * (h @ wu.T)) @ wd.T
    return rms(x, norms[-1]) @ mats[-1].T


def _llama_case(batch: int, pos: int, layers: int = 2, nh: int = 4, nkv: int = 2, c: int = 64,
                ffn: int = 128, vocab: int = 96, t_max: int = 32) -> dict:
    gen = torch.Generator().manual_seed(batch * 100 + pos)
    hs = c // nh
    shapes = [(nh * hs, c), (nkv * hs, c), (nkv * hs, c), (c, nh * hs), (ffn, c), (ffn, c),
              (c, ffn)] * layers + [(vocab, c)]
    mats = [torch.randn(o, i, generator=gen) / i ** 0.5 for o, i in shapes]
    norms = [1 + 0.1 * torch.randn(c, generator=gen) for _ in range(2 * layers + 1)]
    k_buf = torch.randn(layers, batch, nkv, t_max, hs, generator=gen)
    v_buf = torch.randn(layers, batch, nkv, t_max, hs, generator=gen)
    cos, sin = _rope_tables(t_max, hs)
    x = torch.randn(batch, c, generator=gen)
    return dict(x=x, mats=mats, norms=norms, k_buf=k_buf, v_buf=v_buf, cos=cos, sin=sin,
                nh=nh, nkv=nkv, layers=layers, pos=pos)


def _stored(m: torch.Tensor, kind: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the fused step is given, the fp64 weights it multiplies by) for a product kind."""
    from .test_blocks import dequantize, quantize

    if kind in (0, 4):
        return m, m.double()
    fmt = "Q8_0" if kind in (kernels.Q8_0, kernels.Q8_0_EXACT) else "Q4_1"
    blocks = quantize(m.numpy(), fmt)
    return torch.from_numpy(blocks), torch.from_numpy(dequantize(blocks, fmt)[0])


@pytest.mark.parametrize("kind", [0, 4, kernels.Q8_0_EXACT, kernels.Q4_1_EXACT, kernels.Q8_0,
                                  kernels.Q4_1])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("batch, pos", [(1, 0), (1, 9), (3, 9)])
def test_fused_llama_step_matches_a_pytorch_reference(kind: int, fused: bool, batch: int,
                                                      pos: int) -> None:
    """``decode_layers_llama`` (2 layers, 4 query heads over 2 K/V heads of 16, width 64, MLP
    128) against the fp64 reference: within 1e-5 of its largest |logit| for every exact product
    kind; 3e-2 for the integer block kinds (x rounded to 8 bits in every product). Also with
    q|k|v and gate|up as one product each (``fused``); the caches written at ``pos`` only."""
    case = _llama_case(batch, pos)
    stored = [_stored(m, kind) for m in case["mats"]]
    ref_mats = [m64 for _, m64 in stored]
    k64, v64 = case["k_buf"].double(), case["v_buf"].double()
    want = _llama_reference(case["x"].double(), [n.double() for n in case["norms"]], ref_mats,
                            k64, v64, case["cos"], case["sin"], pos, case["nh"], case["nkv"],
                            1e-5)
    ws = [w for w, _ in stored]
    if fused:  # q|k|v rows and gate|up rows stacked (blocks stack row-wise too)
        ws = [t for i in range(case["layers"]) for t in (
            torch.cat(ws[7 * i: 7 * i + 3]), ws[7 * i + 3], torch.cat(ws[7 * i + 4: 7 * i + 6]),
            ws[7 * i + 6])] + [ws[-1]]
    k_buf, v_buf = case["k_buf"].clone(), case["v_buf"].clone()
    got = kernels.decode_layers_llama(
        case["x"], case["norms"], ws, [None] * len(ws), [None] * len(ws), [kind] * len(ws),
        [w.size(0) for w in ws], k_buf, v_buf, case["cos"], case["sin"], pos, case["nh"],
        case["nkv"], 1e-5)
    assert got.shape == want.shape
    # the integer kinds round x to 8 bits per 32 values in each of the 15 products (up to 1/254
    # of a block's largest |x| per value): 0.8-1.3e-2 of the largest logit on these cases
    tol = (3e-2 if kind in (kernels.Q8_0, kernels.Q4_1) else 1e-5) * want.abs().max()
    assert (got.double() - want).abs().max() <= tol
    assert (k_buf.double() - k64).abs().max() <= tol and (v_buf.double() - v64).abs().max() <= tol
    untouched = torch.ones(k_buf.size(3), dtype=torch.bool)
    untouched[pos] = False
    assert torch.equal(k_buf[:, :, :, untouched], case["k_buf"][:, :, :, untouched])


@pytest.mark.parametrize("nh, nkv, c, ffn", [(6, 2, 96, 100), (3, 1, 96, 36), (9, 3, 576, 64)])
def test_fused_llama_step_other_shapes(nh: int, nkv: int, c: int, ffn: int) -> None:
    """Groups of 3 query heads (SmolLM2's), one K/V head, an MLP width off the vector width."""
    case = _llama_case(2, 5, nh=nh, nkv=nkv, c=c, ffn=ffn)
    n = len(case["mats"])
    want = _llama_reference(case["x"].double(), [t.double() for t in case["norms"]],
                            [m.double() for m in case["mats"]], case["k_buf"].double(),
                            case["v_buf"].double(), case["cos"], case["sin"], 5, nh, nkv, 1e-5)
    got = kernels.decode_layers_llama(
        case["x"], case["norms"], case["mats"], [None] * n, [None] * n, [0] * n,
        [m.size(0) for m in case["mats"]], case["k_buf"].clone(), case["v_buf"].clone(),
        case["cos"], case["sin"], 5, nh, nkv, 1e-5)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_fused_llama_step_pairs_neighbours_for_gguf_rows() -> None:
    """``neox=False``: RoPE's pairs as neighbouring channels (2i, 2i + 1), the layout of q and k
    rows in a GGUF llama file -- the same logits as rotate_half over the rows un-permuted as
    llama.cpp's converter permutes them; and the 1e-5 tolerance tells the two layouts apart."""
    case = _llama_case(1, 9)
    n = len(case["mats"])

    def fused(mats: list, neox: bool, k_buf: torch.Tensor = case["k_buf"]) -> torch.Tensor:
        return kernels.decode_layers_llama(
            case["x"], case["norms"], mats, [None] * n, [None] * n, [0] * n,
            [m.size(0) for m in mats], k_buf.clone(), case["v_buf"].clone(),
            case["cos"], case["sin"], 9, 4, 2, 1e-5, neox)

    def gguf_rows(w: torch.Tensor, heads: int) -> torch.Tensor:  # convert_hf_to_gguf's permute
        return w.reshape(heads, 2, w.size(0) // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)

    hs = case["k_buf"].size(-1)  # the past keys in the permuted channel order as well
    k_gguf = case["k_buf"].reshape(*case["k_buf"].shape[:-1], 2, hs // 2).swapaxes(-1, -2)

    hf = case["mats"]
    gguf = [gguf_rows(m, 4) if i % 7 == 0 and i < n - 1 else gguf_rows(m, 2)
            if i % 7 == 1 and i < n - 1 else m for i, m in enumerate(hf)]
    want = _llama_reference(case["x"].double(), [t.double() for t in case["norms"]],
                            [m.double() for m in hf], case["k_buf"].double(),
                            case["v_buf"].double(), case["cos"], case["sin"], 9, 4, 2, 1e-5)
    got = fused(gguf, False, k_gguf.reshape(case["k_buf"].shape).contiguous())
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert (fused(hf, False).double() - want).abs().max() > 1e-3 * want.abs().max()
    gptj = _llama_reference(case["x"].double(), [t.double() for t in case["norms"]],
                            [m.double() for m in hf], case["k_buf"].double(),
                            case["v_buf"].double(), case["cos"], case["sin"], 9, 4, 2, 1e-5,
                            gptj=True)
    assert (fused(hf, False).double() - gptj).abs().max() <= 1e-5 * gptj.abs().max()
    assert (fused(hf, True).double() - gptj).abs().max() > 1e-3 * gptj.abs().max()


def test_fused_llama_step_bad_input_says_what_is_allowed() -> None:
    case = _llama_case(1, 3)
    args = [case["x"], case["norms"], case["mats"], [None] * 15, [None] * 15, [0] * 15,
            [m.size(0) for m in case["mats"]], case["k_buf"], case["v_buf"], case["cos"],
            case["sin"], 3, 4, 2, 1e-5]
    with pytest.raises(RuntimeError, match=re.escape("7L + 1 products")):
        kernels.decode_layers_llama(*args[:2], case["mats"][:-1], *args[3:])
    with pytest.raises(RuntimeError, match="T > pos"):
        kernels.decode_layers_llama(*args[:11], 32, *args[12:])
    with pytest.raises(RuntimeError, match="n_kv_head must divide n_head"):
        kernels.decode_layers_llama(*args[:12], 4, 3, 1e-5)
    with pytest.raises(RuntimeError, match="unknown product kind 9"):
        kernels.decode_layers_llama(*args[:5], [9] * 15, *args[6:])
