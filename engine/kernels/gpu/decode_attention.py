"""Decode attention in Triton: one new query per sequence over the filled rows of a preallocated
KV cache, split over the cache (flash-decoding), grouped-query heads reading their K/V once.

  decode_attention(q, k_cache, v_cache, lengths) -> y (B, nh, hs)
      q (B, nh, hs); k_cache, v_cache (B, n_kv, T_max, hs) with n_kv dividing nh (query head h
      reads K/V head h // (nh / n_kv)); lengths (B,) an integer tensor on the same device:
      sequence b attends over rows [0, lengths[b]), and never reads a row past them.
  decode_attention(q, k_pool, v_pool, lengths, table=table)   the same over a paged cache,
      read in place (vLLM's paged attention): k_pool, v_pool (n_blocks, n_kv, bt, hs), table
      (B, blocks_per_seq) integer block ids: row t of sequence b is row t % bt of block
      table[b, t // bt]. No gather: the copy ``engine.cache.paged`` makes without it.
  decode_attention(q, k_q, v_q, lengths, scales=(k_scale, v_scale))   the same over int8 rows
      (B, n_kv, T_max, hs) with one scale per token and head (B, n_kv, T_max), dequantized in
      registers: no fp32 copy (``engine.cache.quantized`` makes one without it)
  split_attention(...) / merge(...)   its two stages, for a caller that folds the merge into
      what follows it (the fused rungs merge inside the output projection's product);
      ``split_buffers`` makes the first stage's outputs once, for a captured step
  splits_for(t_max, n_seq_heads)      how many splits a cache of T_max rows is cut into

Two kernels. ``_split_kernel`` (grid: B * n_kv programs x n_splits) attends one K/V head's group
of queries over its split of ``SPLIT_T`` rows with an online softmax and writes the split's
partial output and log-sum-exp; ``_merge_kernel`` (grid: B * nh) weighs the splits by their
log-sum-exp. The grid and every shape depend on the cache's capacity only, never on the lengths,
which are read on the device: a CUDA graph captured once replays at any position, and a split
past the length stops at once (the whole cost of a short context is a few empty programs). A
paged cache is the same kernel with each tile's rows addressed through the block table
(``PAGE`` = bt, a compile-time constant; 0 for a contiguous cache). Why:
first light on an H200 measured SDPA over the whole static cache of mode 6 (1,024 slots, masked)
at 126 us per layer, 74% of the step.

Accumulation is in fp32 whatever the cache's dtype; the result is cast to q's dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_T = 32  # cache rows per tile inside a split
MIN_PROGRAMS = 256  # enough split programs to keep an H200's 132 SMs streaming the cache


def splits_for(t_max: int, n_seq_heads: int) -> tuple[int, int]:
    """(rows per split, number of splits) for a cache of ``t_max`` rows read by
    ``n_seq_heads`` = batch x K/V heads programs per split: splits of at least one tile, as
    many as it takes to reach ``MIN_PROGRAMS`` programs, and no more than there are tiles."""
    tiles = triton.cdiv(t_max, BLOCK_T)
    n_splits = max(1, min(tiles, triton.cdiv(MIN_PROGRAMS, max(1, n_seq_heads))))
    split_t = triton.cdiv(tiles, n_splits) * BLOCK_T
    return split_t, triton.cdiv(t_max, split_t)


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, tab_ptr, ks_ptr, vs_ptr, o_ptr, lse_ptr,
                  sq_b, sq_h, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, st_b, ss_b, ss_h,
                  so_b, so_h, so_s, sl_b, sl_h, scale, split_t,
                  N_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                  HS: tl.constexpr, HS_P: tl.constexpr, BLOCK: tl.constexpr,
                  PAGE: tl.constexpr, SCALED: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // N_KV
    g = pid % N_KV  # this program's K/V head; its queries are heads g * GROUP .. + GROUP - 1
    length = tl.load(len_ptr + b).to(tl.int32)
    start = split * split_t
    end = tl.minimum(start + split_t, length)
    j = tl.arange(0, GROUP_P)
    heads = g * GROUP + j
    hmask = j < GROUP
    d = tl.arange(0, HS_P)
    dmask = d < HS
    q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)  # (G, HS)
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HS_P], tl.float32)
    for t0 in range(start, end, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        tmask = t < end  # rows past the length are never read
        kv_mask = tmask[:, None] & dmask[None, :]
        if PAGE > 0:  # row t: row t % PAGE of block table[b, t // PAGE] of the pool
            blk = tl.load(tab_ptr + b * st_b + t // PAGE, mask=tmask, other=0).to(tl.int64)
            k_rows = blk * sk_b + (t % PAGE) * sk_t
            v_rows = blk * sv_b + (t % PAGE) * sv_t
        else:  # row t of sequence b's own rows
            k_rows = b * sk_b + t * sk_t
            v_rows = b * sv_b + t * sv_t
        k = tl.load(k_ptr + k_rows[:, None] + g * sk_h + d[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)  # (T, HS)
        if SCALED:  # int8 rows: one scale per token and head (both caches' rows: b, g, t)
            s_rows = b * ss_b + g * ss_h + t
            k = k * tl.load(ks_ptr + s_rows, mask=tmask, other=0.0).to(tl.float32)[:, None]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # (G, T)
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + v_rows[:, None] + g * sv_h + d[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)
        if SCALED:
            v = v * tl.load(vs_ptr + s_rows, mask=tmask, other=0.0).to(tl.float32)[:, None]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    filled = l_i > 0  # an empty split (past the length) leaves lse = -inf, out = 0
    out = acc / tl.where(filled, l_i, 1.0)[:, None]
    lse = tl.where(filled, m_i + tl.log(tl.where(filled, l_i, 1.0)), float("-inf"))
    tl.store(o_ptr + b * so_b + heads[:, None] * so_h + split * so_s + d[None, :], out,
             mask=hmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + b * sl_b + heads * sl_h + split, lse, mask=hmask)


@triton.jit
def _merge_kernel(o_ptr, lse_ptr, y_ptr, n_splits, so_b, so_h, so_s, sl_b, sl_h, sy_b, sy_h,
                  NH: tl.constexpr, HS: tl.constexpr, HS_P: tl.constexpr, NS_P: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // NH
    h = pid % NH
    s = tl.arange(0, NS_P)
    smask = s < n_splits
    d = tl.arange(0, HS_P)
    dmask = d < HS
    lse = tl.load(lse_ptr + b * sl_b + h * sl_h + s, mask=smask, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))  # split 0 always holds row 0: the max is finite
    o = tl.load(o_ptr + b * so_b + h * so_h + s[:, None] * so_s + d[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)
    y = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    tl.store(y_ptr + b * sy_b + h * sy_h + d, y.to(y_ptr.dtype.element_ty), mask=dmask)


def split_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    lengths: torch.Tensor, part: torch.Tensor | None = None,
                    lse: torch.Tensor | None = None, table: torch.Tensor | None = None,
                    scales: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage one: (partial outputs (B, nh, n_splits, hs) fp32, log-sum-exps (B, nh, n_splits)),
    into ``part`` and ``lse`` when given (``split_buffers``: a captured step's own). With
    ``table``, k/v are a pool of blocks read through it; with ``scales``, int8 rows scaled per
    token and head (the module docstring)."""
    B, nh, hs = q.shape
    n_kv = k_cache.size(1)
    if table is None:
        t_max, page, rows = k_cache.size(2), 0, k_cache.size(0) == B
        allowed = "k/v (B, n_kv, T_max, hs)"
    else:  # a pool (n_blocks, n_kv, bt, hs): a sequence holds at most its table's blocks
        t_max, page = table.size(1) * k_cache.size(2), k_cache.size(2)
        rows = table.dim() == 2 and table.size(0) == B and not table.is_floating_point()
        allowed = "k/v pools (n_blocks, n_kv, bt, hs), table (B, blocks) of block ids"
    if nh % n_kv or k_cache.shape != v_cache.shape or not rows or k_cache.dim() != 4 \
            or k_cache.size(3) != hs or lengths.shape != (B,):
        raise ValueError(f"shapes do not fit: q {tuple(q.shape)}, k {tuple(k_cache.shape)}, "
                         f"v {tuple(v_cache.shape)}, lengths {tuple(lengths.shape)}"
                         + ("" if table is None else f", table {tuple(table.shape)}")
                         + f"; allowed: q (B, nh, hs), {allowed} with n_kv dividing nh, "
                         "lengths (B,)")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("q, k and v need their last dimension contiguous")
    if scales is not None and (table is not None or scales[0].shape != k_cache.shape[:3]
                               or scales[1].shape != k_cache.shape[:3]
                               or scales[0].stride() != scales[1].stride()
                               or scales[0].stride(2) != 1):
        raise ValueError(f"scales {[tuple(s.shape) for s in scales]} do not fit k "
                         f"{tuple(k_cache.shape)}; allowed: two (B, n_kv, T_max) tensors alike, "
                         "one scale per token and head, for a contiguous cache")
    split_t, n_splits = splits_for(t_max, B * n_kv)
    if part is None or lse is None:
        part, lse = split_buffers(q, t_max, n_kv)
    group = nh // n_kv
    tab = lengths if table is None else table  # never read without a table (PAGE = 0)
    ks, vs = (lengths, lengths) if scales is None else scales  # never read unscaled
    _split_kernel[(B * n_kv, n_splits)](
        q, k_cache, v_cache, lengths, tab, ks, vs, part, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), tab.stride(0),
        ks.stride(0), ks.stride(1) if ks.dim() > 1 else 0,
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        1.0 / math.sqrt(hs), split_t,
        N_KV=n_kv, GROUP=group, GROUP_P=triton.next_power_of_2(group),
        HS=hs, HS_P=triton.next_power_of_2(hs), BLOCK=BLOCK_T, PAGE=page,
        SCALED=scales is not None)
    return part, lse


def split_buffers(q: torch.Tensor, t_max: int, n_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (partial outputs, log-sum-exps) for queries like ``q`` over a cache of ``t_max``
    rows and ``n_kv`` K/V heads, fp32 on q's device."""
    B, nh, hs = q.shape
    n_splits = splits_for(t_max, B * n_kv)[1]
    return (torch.empty(B, nh, n_splits, hs, device=q.device, dtype=torch.float32),
            torch.empty(B, nh, n_splits, device=q.device, dtype=torch.float32))


def merge(part: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stage two: the splits weighed by their log-sum-exp, (B, nh, hs) in ``dtype``."""
    B, nh, n_splits, hs = part.shape
    y = torch.empty(B, nh, hs, device=part.device, dtype=dtype)
    _merge_kernel[(B * nh,)](
        part, lse, y, n_splits, part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1), y.stride(0), y.stride(1),
        NH=nh, HS=hs, HS_P=triton.next_power_of_2(hs), NS_P=triton.next_power_of_2(n_splits))
    return y


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lengths: torch.Tensor, table: torch.Tensor | None = None,
                     scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """y (B, nh, hs): each sequence's one query over rows [0, lengths[b]) of its cache (of its
    blocks, in the order of ``table``; int8 rows times ``scales``, when given)."""
    part, lse = split_attention(q, k_cache, v_cache, lengths, table=table, scales=scales)
    return merge(part, lse, q.dtype)
