"""A decode step's products in Triton, each with what surrounds it folded in: the norm before
it, the bias, activation and residual after it, the attention's merge before the output
projection. Weights dense (fp32, bf16) or GGUF blocks (Q8_0, Q4_1) read as stored, dequantized
in registers. (q|k|v with RoPE and the cache write: ``qkv``; the embedding: ``embed``; both
load weights and normalise inputs with the helpers here.)

  Weight.of(module)                  a Linear's weight as the kernels read it: nn.Linear's
                                     (out, in) rows, or a BlockLinear's GGUF bytes (out, in/32*34
                                     for Q8_0, in/32*20 for Q4_1), its bias, its format
  linear(x, w, out, norm=, act=, residual=, merge=, w2=)
      out (M, N) = act(norm(x) @ w.T + bias) [+ residual]; with ``merge`` (the attention's split
      outputs and log-sum-exps) the input x is their merge, computed on the fly; act "gelu"
      (tanh approximation), "swiglu" (silu(norm(x) @ w.T) * (norm(x) @ w2.T)) or None

Norm: ("layer", weight, bias, eps) or ("rms", weight, eps). Each program computes its rows'
statistics over the whole input (a few KiB, from cache) and normalises tiles as it loads them,
in fp32; every product accumulates in fp32 and stores in ``out``'s dtype. A program covers
``BN`` outputs of up to ``MAX_BM`` rows (the batch's rows share each weight tile), ``BK``
inputs a tile; rows and columns are masked at every edge. ``blocks(M, N, K)`` picks them from
the shape alone (one compile per kind of product, nothing timed at first use): enough programs
to fill the GPU (``MIN_PROGRAMS``), tiles long enough for few loop trips, within ``TILE``
elements in registers. Why folded: at batch 1 a GPU
step is bound by the count of kernels (first light on an H200: 150-210 launches, 2-5 ms,
against a 0.11 ms read of gpt2's weights), so a block is five kernels here: q|k|v, attention,
output projection, MLP up, down.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_BM = 4  # batch rows a program multiplies at once
TILE = 8192  # the most elements of a (rows, outputs, inputs[, splits]) tile in registers
# Two programs per SM of an H200 (132): enough loads in flight to stream the weights. Triton's
# CPU interpreter runs programs one after another, so there the widest tiles (the fewest
# programs) keep the tests quick; the tests pick ragged tiles themselves (``tiles=``).
MIN_PROGRAMS = 1 if os.environ.get("TRITON_INTERPRET") == "1" else 264
MAX_BN = 16  # outputs per program at the most (a wide product has programs enough)
MAX_BK = 1024  # inputs per tile at the most
QK = 32  # weights per GGUF block
FMTS = {"dense": 0, "Q8_0": 1, "Q4_1": 2}
BLOCK_BYTES = {"Q8_0": 34, "Q4_1": 20}
NORMS = {None: 0, "layer": 1, "rms": 2}
ACTS = {None: 0, "gelu": 1, "swiglu": 2}


@dataclass(frozen=True)
class Weight:
    """A product's weight as the kernels read it: ``data`` (out, in) dense, or (out, in/32 *
    bytes) uint8 GGUF blocks; ``fmt`` "dense" | "Q8_0" | "Q4_1"; ``bias`` (out,) or None."""

    data: torch.Tensor
    fmt: str
    out: int
    inn: int
    bias: torch.Tensor | None = None

    @classmethod
    def of(cls, module: torch.nn.Module) -> Weight:
        bias = getattr(module, "bias", None)
        bias = None if bias is None else bias.detach()
        blocks = getattr(module, "blocks", None)
        if blocks is not None:  # engine.quant.blocks.BlockLinear
            return cls(blocks, module.ggml_type, blocks.size(0), module.in_features, bias)
        w = module.weight.detach()
        return cls(w, "dense", w.size(0), w.size(1), bias)

    def rows(self, start: int, stop: int) -> Weight:
        """Rows start..stop-1 (a view: no copy), with their bias."""
        return Weight(self.data[start:stop], self.fmt, stop - start, self.inn,
                      None if self.bias is None else self.bias[start:stop])


@triton.jit
def _f16_at(ptr, mask):
    """The little-endian fp16 at byte ``ptr``, in fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _load_w(row_ptr, k, mask, FMT: tl.constexpr):
    """A (rows, k) tile in fp32 from rows starting at ``row_ptr`` (rows,): dense elements, or
    GGUF blocks read as stored (Q8_0: fp16 d + 32 int8; Q4_1: fp16 d, fp16 m + 16 bytes whose
    low nibbles are weights 0-15 and high nibbles 16-31)."""
    if FMT == 0:
        return tl.load(row_ptr[:, None] + k[None, :], mask=mask, other=0.0).to(tl.float32)
    blk = k // 32
    idx = k % 32
    if FMT == 1:
        base = row_ptr[:, None] + blk[None, :] * 34
        q = tl.load(base + 2 + idx[None, :], mask=mask, other=0).to(tl.int8, bitcast=True)
        return q.to(tl.float32) * _f16_at(base, mask)
    base = row_ptr[:, None] + blk[None, :] * 20
    byte = tl.load(base + 4 + (idx % 16)[None, :], mask=mask, other=0).to(tl.int32)
    q = tl.where(idx[None, :] < 16, byte & 15, byte >> 4)
    return q.to(tl.float32) * _f16_at(base, mask) + _f16_at(base + 2, mask)


@triton.jit
def _row_stats(x_ptr, m, mmask, K, sx, eps, NORM: tl.constexpr, BM: tl.constexpr,
               BK: tl.constexpr):
    """(mean, 1 / std) of each row m over its K inputs: LayerNorm's (two passes: exact enough
    for fp32 logits) or RMSNorm's (mean 0)."""
    mean = tl.zeros([BM], tl.float32)
    if NORM == 1:
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + m[:, None] * sx + k[None, :],
                        mask=mmask[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
            mean += tl.sum(x, axis=1)
        mean = mean / K
    var = tl.zeros([BM], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        msk = mmask[:, None] & (k < K)[None, :]
        x = tl.load(x_ptr + m[:, None] * sx + k[None, :], mask=msk, other=0.0).to(tl.float32)
        x = tl.where(msk, x - mean[:, None], 0.0)
        var += tl.sum(x * x, axis=1)
    return mean, 1.0 / tl.sqrt(var / K + eps)


@triton.jit
def _input_tile(x_ptr, m, mmask, k, kmask, sx, mean, rstd, nw_ptr, nb_ptr,
                NORM: tl.constexpr):
    """Rows m, inputs k of x, normalised (LayerNorm / RMSNorm) when NORM; zero outside."""
    msk = mmask[:, None] & kmask[None, :]
    x = tl.load(x_ptr + m[:, None] * sx + k[None, :], mask=msk, other=0.0).to(tl.float32)
    if NORM != 0:
        x = (x - mean[:, None]) * rstd[:, None]
        x = x * tl.load(nw_ptr + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
    if NORM == 1:
        x = x + tl.load(nb_ptr + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
    return tl.where(msk, x, 0.0)


@triton.jit
def _merged_tile(part_ptr, lse_ptr, m, mmask, k, kmask, n_splits, sp_m, sp_h, sp_s, sl_m, sl_h,
                 HS: tl.constexpr, NS_P: tl.constexpr):
    """Inputs k of rows m where the input is the attention's output, merged from its splits:
    head k // HS, channel k % HS, the splits weighed by their log-sum-exp."""
    h = k // HS
    d = k % HS
    s = tl.arange(0, NS_P)
    msk = mmask[:, None, None] & kmask[None, :, None] & (s < n_splits)[None, None, :]
    lse = tl.load(lse_ptr + m[:, None, None] * sl_m + h[None, :, None] * sl_h + s[None, None, :],
                  mask=msk, other=float("-inf"))
    top = tl.max(lse, axis=2)
    w = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top)[:, :, None])
    o = tl.load(part_ptr + m[:, None, None] * sp_m + h[None, :, None] * sp_h
                + s[None, None, :] * sp_s + d[None, :, None], mask=msk, other=0.0)
    total = tl.sum(w, axis=2)
    return tl.sum(w * o, axis=2) / tl.where(total > 0, total, 1.0)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, w2_ptr, b_ptr, out_ptr, res_ptr, nw_ptr, nb_ptr,
                   part_ptr, lse_ptr,
                   M, N, K, sx, sw, so, sr, eps, n_splits, sp_m, sp_h, sp_s, sl_m, sl_h,
                   FMT: tl.constexpr, NORM: tl.constexpr, MERGE: tl.constexpr,
                   HS: tl.constexpr, NS_P: tl.constexpr, ACT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    nmask = n < N
    mmask = m < M
    mean = tl.zeros([BM], tl.float32)
    rstd = tl.zeros([BM], tl.float32)
    if NORM != 0:
        mean, rstd = _row_stats(x_ptr, m, mmask, K, sx, eps, NORM, BM, BK)
    rows = w_ptr + n.to(tl.int64) * sw
    rows2 = w2_ptr + n.to(tl.int64) * sw
    acc = tl.zeros([BM, BN], tl.float32)
    acc2 = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < K
        if MERGE:
            x = _merged_tile(part_ptr, lse_ptr, m, mmask, k, kmask, n_splits, sp_m, sp_h, sp_s,
                             sl_m, sl_h, HS, NS_P)
        else:
            x = _input_tile(x_ptr, m, mmask, k, kmask, sx, mean, rstd, nw_ptr, nb_ptr, NORM)
        wmask = nmask[:, None] & kmask[None, :]
        w = _load_w(rows, k, wmask, FMT)  # (BN, BK)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        if ACT == 2:
            acc2 += tl.sum(x[:, None, :] * _load_w(rows2, k, wmask, FMT)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if ACT == 1:  # GELU, tanh approximation (GPT-2's); tanh from exp(-2|z|): no overflow
        z = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        e = tl.exp(-2.0 * tl.abs(z))
        t = (1.0 - e) / (1.0 + e)
        acc = 0.5 * acc * (1.0 + tl.where(z < 0, -t, t))
    if ACT == 2:  # SwiGLU: silu(gate) * up
        acc = acc / (1.0 + tl.exp(-acc)) * acc2
    omask = mmask[:, None] & nmask[None, :]
    if RESIDUAL:
        acc += tl.load(res_ptr + m[:, None] * sr + n[None, :], mask=omask, other=0.0
                       ).to(tl.float32)
    tl.store(out_ptr + m[:, None] * so + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=omask)


def blocks(m: int, n: int, k: int, spread: int = 1) -> tuple[int, int, int]:
    """(rows, outputs, inputs) a program covers for an (m, k) @ (k, n) product: the batch's
    rows up to ``MAX_BM``; as many outputs as leave ``MIN_PROGRAMS`` programs (at most
    ``MAX_BN``); inputs up to the whole width within ``TILE`` (a tile merged from ``spread``
    attention splits holds each input that many times)."""
    bm = min(MAX_BM, triton.next_power_of_2(m))
    bn = MAX_BN
    while bn > 1 and triton.cdiv(n, bn) < MIN_PROGRAMS:
        bn //= 2
    bk = min(MAX_BK, triton.next_power_of_2(k), max(16, TILE // (bm * max(bn, spread))))
    return bm, bn, bk


def _row_stride(w: Weight) -> int:
    return w.data.stride(0)


def _check(w: Weight, x_width: int) -> None:
    if w.inn != x_width:
        raise ValueError(f"a weight of {w.inn} inputs cannot multiply rows of {x_width}")
    if w.fmt not in FMTS:
        raise ValueError(f"weight format {w.fmt!r}; allowed: {', '.join(FMTS)}")
    if w.data.stride(-1) != 1 or (w.fmt != "dense" and w.inn % QK):
        raise ValueError("weights need contiguous rows (blocks: a width that is a multiple of 32)")


def linear(x: torch.Tensor | None, w: Weight, out: torch.Tensor, *,
           norm: tuple | None = None, act: str | None = None,
           residual: torch.Tensor | None = None, w2: Weight | None = None,
           merge: tuple[torch.Tensor, torch.Tensor] | None = None,
           tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """out (M, N) = act(norm(x) @ w.T + bias) [+ residual] (see the module docstring); with
    ``merge`` = (partial outputs (M, nh, splits, hs), log-sum-exps (M, nh, splits)) the input is
    their merge and ``x`` is None. ``residual`` may be ``out`` itself (added in place).
    ``tiles`` (rows, outputs, inputs a program) replaces ``blocks``' pick: tests, benchmarks."""
    M, N = out.shape
    if merge is not None:
        part, lse = merge
        K, hs, n_splits = part.size(1) * part.size(3), part.size(3), part.size(2)
        x_arg, sx = part, 0
    else:
        assert x is not None
        part = lse = x  # unused
        K, hs, n_splits = x.size(1), 1, 1
        x_arg, sx = x, x.stride(0)
    _check(w, K)
    if w.out != N or (w2 is not None and (w2.out != N or w2.fmt != w.fmt)):
        raise ValueError(f"weights of {w.out} outputs cannot fill {N} columns")
    kind = NORMS[norm[0] if norm else None]
    nw = norm[1] if norm else out
    nb = norm[2] if norm and kind == 1 else out
    eps = float(norm[-1]) if norm else 0.0
    bm, bn, bk = tiles or blocks(M, N, K,
                                 triton.next_power_of_2(n_splits) if merge is not None else 1)
    _linear_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm))](
        x_arg, w.data, (w2 or w).data, w.bias if w.bias is not None else out, out,
        residual if residual is not None else out, nw, nb, part, lse,
        M, N, K, sx, _row_stride(w), out.stride(0),
        residual.stride(0) if residual is not None else 0, eps, n_splits,
        part.stride(0), part.stride(1), part.stride(2) if merge else 0,
        lse.stride(0), lse.stride(1),
        FMT=FMTS[w.fmt], NORM=kind, MERGE=merge is not None, HS=hs,
        NS_P=triton.next_power_of_2(n_splits), ACT=ACTS[act], HAS_BIAS=w.bias is not None,
        RESIDUAL=residual is not None, BM=bm, BN=bn, BK=bk)
    return out
