"""q|k|v of a block in one Triton kernel: the norm before it, the bias, RoPE's rotation of q and
k, and the new K/V row written into the cache at the position read on the device.

  qkv(x, wq, wk, wv, norm, q_out, k_cache, v_cache, pos, rope=None)
      q|k|v of norm(x) (x (M, C)): q into q_out (M, nh, hs); k and v written into the caches
      (M, n_kv, T_max, hs) at row ``pos`` (a (1,) long tensor on the device); with ``rope``
      (cos, sin (T, hs) tables, each angle twice) q and k turn by their position's angles:
      channel i pairs with i + hs/2 (transformers' rotate_half)

A program computes ``BP`` rotating pairs: channel d and its partner d + hs/2 of a head, from two
rows of the weights, so the rotation needs nothing another program holds; v's pairs are computed
alike and not turned. Heads are numbered across q, k and v (n_q + 2 n_kv of them); the weights
are three (GPT-2's one q|k|v matrix passes its three row ranges, as views). ``BP`` and ``BK``
come from ``linear.blocks`` (two weight tiles a trip: half its outputs per tile). Norms,
weight formats and the tile budget are ``engine.kernels.gpu.linear``'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .linear import (
    FMTS,
    NORMS,
    Weight,
    _check,
    _input_tile,
    _load_w,
    _row_stats,
    _row_stride,
    blocks,
)


@triton.jit
def _qkv_kernel(x_ptr, wq_ptr, wk_ptr, wv_ptr, bq_ptr, bk_ptr, bv_ptr, nw_ptr, nb_ptr,
                q_ptr, kc_ptr, vc_ptr, pos_ptr, cos_ptr, sin_ptr,
                M, K, sx, sw, sq_m, sq_h, sc_m, sc_h, sc_t, eps,
                NQ: tl.constexpr, NKV: tl.constexpr, HS: tl.constexpr, FMT: tl.constexpr,
                NORM: tl.constexpr, HAS_BIAS: tl.constexpr, ROPE: tl.constexpr,
                BM: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr):
    HALF: tl.constexpr = HS // 2
    p = tl.program_id(0) * BP + tl.arange(0, BP)  # pair index over q's, k's and v's heads
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    pmask = p < (NQ + 2 * NKV) * HALF
    mmask = m < M
    head = p // HALF  # 0..NQ-1 q, NQ..NQ+NKV-1 k, then v
    d = p % HALF
    is_q = head < NQ
    is_k = (head >= NQ) & (head < NQ + NKV)
    local = tl.where(is_q, head, tl.where(is_k, head - NQ, head - NQ - NKV))
    row1 = (local * HS + d).to(tl.int64)  # channel d and its partner d + HS / 2
    base = tl.where(is_q, wq_ptr, tl.where(is_k, wk_ptr, wv_ptr))
    rows1 = base + row1 * sw
    rows2 = base + (row1 + HALF) * sw
    mean = tl.zeros([BM], tl.float32)
    rstd = tl.zeros([BM], tl.float32)
    if NORM != 0:
        mean, rstd = _row_stats(x_ptr, m, mmask, K, sx, eps, NORM, BM, BK)
    acc1 = tl.zeros([BM, BP], tl.float32)
    acc2 = tl.zeros([BM, BP], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < K
        x = _input_tile(x_ptr, m, mmask, k, kmask, sx, mean, rstd, nw_ptr, nb_ptr, NORM)
        wmask = pmask[:, None] & kmask[None, :]
        acc1 += tl.sum(x[:, None, :] * _load_w(rows1, k, wmask, FMT)[None, :, :], axis=2)
        acc2 += tl.sum(x[:, None, :] * _load_w(rows2, k, wmask, FMT)[None, :, :], axis=2)
    if HAS_BIAS:
        bias = tl.where(is_q, bq_ptr, tl.where(is_k, bk_ptr, bv_ptr))
        acc1 += tl.load(bias + row1, mask=pmask, other=0.0).to(tl.float32)[None, :]
        acc2 += tl.load(bias + row1 + HALF, mask=pmask, other=0.0).to(tl.float32)[None, :]
    pos = tl.load(pos_ptr)
    if ROPE:  # q and k turn by their position's angles; cos/sin rows hold each angle twice
        c = tl.load(cos_ptr + pos * HS + d, mask=pmask, other=1.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + pos * HS + d, mask=pmask, other=0.0).to(tl.float32)[None, :]
        turn = (is_q | is_k)[None, :]
        r1 = tl.where(turn, acc1 * c - acc2 * s, acc1)
        acc2 = tl.where(turn, acc2 * c + acc1 * s, acc2)
        acc1 = r1
    omask = mmask[:, None] & pmask[None, :]
    qa = q_ptr + m[:, None] * sq_m + (local * sq_h + d)[None, :]
    qmask = omask & is_q[None, :]
    tl.store(qa, acc1.to(q_ptr.dtype.element_ty), mask=qmask)
    tl.store(qa + HALF, acc2.to(q_ptr.dtype.element_ty), mask=qmask)
    ca = m[:, None] * sc_m + (local * sc_h + pos * sc_t + d)[None, :]
    kmask = omask & is_k[None, :]
    tl.store(kc_ptr + ca, acc1.to(kc_ptr.dtype.element_ty), mask=kmask)
    tl.store(kc_ptr + ca + HALF, acc2.to(kc_ptr.dtype.element_ty), mask=kmask)
    vmask = omask & (~is_q & ~is_k)[None, :]
    tl.store(vc_ptr + ca, acc1.to(vc_ptr.dtype.element_ty), mask=vmask)
    tl.store(vc_ptr + ca + HALF, acc2.to(vc_ptr.dtype.element_ty), mask=vmask)



def qkv(x: torch.Tensor, wq: Weight, wk: Weight, wv: Weight, norm: tuple | None,
        q_out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        tiles: tuple[int, int, int] | None = None) -> None:
    """q|k|v of norm(x) (see the module docstring): q_out (M, nh, hs); k_cache, v_cache (M,
    n_kv, T_max, hs), written at row ``pos`` ((1,) long, on the device)."""
    M, K = x.shape
    nq, hs = q_out.size(1), q_out.size(2)
    nkv = k_cache.size(1)
    for w, rows in ((wq, nq * hs), (wk, nkv * hs), (wv, nkv * hs)):
        _check(w, K)
        if w.out != rows or w.fmt != wq.fmt or _row_stride(w) != _row_stride(wq):
            raise ValueError(f"q, k, v weights must be ({nq * hs}, {K}), ({nkv * hs}, {K}) "
                             f"twice, in one format; got {w.out} rows of {w.fmt}")
    if hs % 2 or k_cache.stride() != v_cache.stride() or q_out.stride(2) != 1 \
            or k_cache.stride(3) != 1:
        raise ValueError("head size must be even, the caches alike, channels contiguous")
    kind = NORMS[norm[0] if norm else None]
    nw = norm[1] if norm else x
    nb = norm[2] if norm and kind == 1 else x
    has_bias = wq.bias is not None
    cos, sin = rope if rope is not None else (x, x)
    pairs = (nq + 2 * nkv) * hs // 2
    bm, bp, bk = tiles or blocks(M, pairs, K)
    if tiles is None:
        bk = max(16, bk // 2)  # two weight tiles a trip
    _qkv_kernel[(triton.cdiv(pairs, bp), triton.cdiv(M, bm))](
        x, wq.data, wk.data, wv.data, wq.bias if has_bias else x, wk.bias if has_bias else x,
        wv.bias if has_bias else x, nw, nb, q_out, k_cache, v_cache, pos, cos, sin,
        M, K, x.stride(0), _row_stride(wq), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        float(norm[-1]) if norm else 0.0,
        NQ=nq, NKV=nkv, HS=hs, FMT=FMTS[wq.fmt], NORM=kind, HAS_BIAS=has_bias,
        ROPE=rope is not None, BM=bm, BP=bp, BK=bk)
