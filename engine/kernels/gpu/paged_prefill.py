"""Several new queries per sequence over a paged KV cache read in place, causally: a prefill, or
an append of a few tokens (speculative decoding's verify), without gathering the blocks.

  paged_prefill(q, k_pool, v_pool, table, offset) -> y (B, nh, T, hs)
      q (B, nh, T, hs) the new tokens' queries, token t at position offset + t; k_pool, v_pool
      (n_blocks, n_kv, bt, hs) with n_kv dividing nh (query head h reads K/V head
      h // (nh / n_kv)); table (B, blocks) integer block ids: row p of sequence b is row
      p % bt of block table[b, p // bt]. The new tokens' rows are in the pool already; token t
      attends over rows 0..offset + t and never reads a row past them.

One kernel (grid: B * n_kv programs x tiles of ``BLOCK_Q`` new tokens): a program holds its
tokens' queries for the whole group of one K/V head as ``BLOCK_Q * GROUP_P`` rows, walks the key
rows in tiles of ``BLOCK_K`` through the table up to its last token's position, and keeps an
online softmax in fp32 (FlashAttention's forward). Products in IEEE fp32 (``tl.dot`` with
``input_precision="ieee"``: no TF32, so fp32 logits stay within the gate's tolerance). The
result is cast to q's dtype. The one-query case is ``decode_attention``'s split kernel.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_Q = 16  # new tokens a program takes
BLOCK_K = 32  # cache rows a tile


# A request's token count and offset change from call to call: specialising on them (== 1, a
# multiple of 16) would compile again inside a timed prefill.
@triton.jit(do_not_specialize=["T", "offset"])
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, tab_ptr, y_ptr, T, offset,
                          sq_b, sq_h, sq_t, sk_n, sk_h, sk_t, sv_n, sv_h, sv_t, st_b,
                          sy_b, sy_h, sy_t, scale,
                          N_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                          HS: tl.constexpr, HS_P: tl.constexpr, PAGE: tl.constexpr,
                          BQ: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // N_KV
    g = pid % N_KV  # this program's K/V head; its queries are heads g * GROUP .. + GROUP - 1
    r = tl.arange(0, BQ * GROUP_P)  # row r: new token t0 + r // GROUP_P, head r % GROUP_P
    t = tl.program_id(1) * BQ + r // GROUP_P
    j = r % GROUP_P
    rmask = (t < T) & (j < GROUP)
    pos = offset + t  # each row's position: it sees keys 0..pos
    d = tl.arange(0, HS_P)
    dmask = d < HS
    heads = g * GROUP + j
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + t[:, None] * sq_t + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)  # (M, HS)
    m_i = tl.full([BQ * GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([BQ * GROUP_P], tl.float32)
    acc = tl.zeros([BQ * GROUP_P, HS_P], tl.float32)
    last = tl.minimum(offset + tl.program_id(1) * BQ + BQ, offset + T)  # rows 0..last - 1
    for k0 in range(0, last, BK):
        p = k0 + tl.arange(0, BK)
        pmask = p < last
        blk = tl.load(tab_ptr + b * st_b + p // PAGE, mask=pmask, other=0).to(tl.int64)
        kv_mask = pmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + blk[:, None] * sk_n + g * sk_h + (p % PAGE)[:, None] * sk_t
                    + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)  # (BK, HS)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # (M, BK)
        seen = (p[None, :] <= pos[:, None]) & pmask[None, :]  # causal, and inside the cache
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padding row sees nothing
        alpha = tl.exp(m_i - m_safe)
        w = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(w, axis=1)
        v = tl.load(v_ptr + blk[:, None] * sv_n + g * sv_h + (p % PAGE)[:, None] * sv_t
                    + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(w, v, input_precision="ieee")
        m_i = m_new
    y = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(y_ptr + b * sy_b + heads[:, None] * sy_h + t[:, None] * sy_t + d[None, :],
             y.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def paged_prefill(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  table: torch.Tensor, offset: int) -> torch.Tensor:
    """y (B, nh, T, hs): each new token's query over rows 0..its position (module docstring)."""
    B, nh, T, hs = q.shape
    n_kv, bt = k_pool.size(1), k_pool.size(2)
    if nh % n_kv or k_pool.shape != v_pool.shape or k_pool.dim() != 4 or k_pool.size(3) != hs \
            or table.dim() != 2 or table.size(0) != B or table.is_floating_point() \
            or offset < 0 or offset + T > table.size(1) * bt:
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k_pool.shape)}, "
                         f"v {tuple(v_pool.shape)}, table {tuple(table.shape)}, offset "
                         f"{offset}; allowed: q (B, nh, T, hs), k/v pools (n_blocks, n_kv, bt, "
                         "hs) with n_kv dividing nh, table (B, blocks) of block ids holding "
                         "offset + T rows")
    if k_pool.stride(3) != 1 or v_pool.stride(3) != 1 or q.stride(3) != 1:
        raise ValueError("q, k and v need their last dimension contiguous")
    y = torch.empty_like(q)
    group = nh // n_kv
    group_p = triton.next_power_of_2(group)
    bq = max(1, BLOCK_Q // group_p)  # rows a program: BLOCK_Q in all, whatever the group
    _paged_prefill_kernel[(B * n_kv, triton.cdiv(T, bq))](
        q, k_pool, v_pool, table, y, T, offset,
        q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(1),
        k_pool.stride(2), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), table.stride(0),
        y.stride(0), y.stride(1), y.stride(2), 1.0 / math.sqrt(hs),
        N_KV=n_kv, GROUP=group, GROUP_P=group_p, HS=hs, HS_P=triton.next_power_of_2(hs),
        PAGE=bt, BQ=bq, BK=BLOCK_K)
    return y
