"""The embedding of a decode step in Triton: each sequence's token row of the table (dense, or GGUF
blocks dequantized as they are read), plus GPT-2's learned position at the position read on
the device.

  embed(tokens, table, out, positions=None, pos=None)
      out (M, C) = table's rows ``tokens`` (M,) (+ ``positions[pos]``, ``pos`` a (1,) long
      tensor on the device)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .linear import FMTS, Weight, _check, _load_w, _row_stride

BLOCK_C = 256  # channels per program


@triton.jit
def _embed_kernel(tok_ptr, table_ptr, pe_ptr, pos_ptr, out_ptr, C, st, spe, so,
                  FMT: tl.constexpr, HAS_POS: tl.constexpr, BC: tl.constexpr):
    m = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = c < C
    tok = tl.load(tok_ptr + m).to(tl.int64)
    row = tl.full([1], 0, tl.int64) + tok * st
    x = tl.sum(_load_w(table_ptr + row, c, cmask[None, :], FMT), axis=0)  # (BC,)
    if HAS_POS:
        x += tl.load(pe_ptr + tl.load(pos_ptr) * spe + c, mask=cmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * so + c, x.to(out_ptr.dtype.element_ty), mask=cmask)



def embed(tokens: torch.Tensor, table: Weight, out: torch.Tensor,
          positions: torch.Tensor | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
    """out (M, C) = table's rows ``tokens`` (M,) (+ ``positions[pos]``, GPT-2's learned
    positions, ``pos`` a (1,) device tensor)."""
    M, C = out.shape
    _check(table, C)
    _embed_kernel[(M, triton.cdiv(C, BLOCK_C))](
        tokens, table.data, positions if positions is not None else out,
        pos if pos is not None else tokens, out, C, _row_stride(table),
        positions.stride(0) if positions is not None else 0, out.stride(0),
        FMT=FMTS[table.fmt], HAS_POS=positions is not None, BC=BLOCK_C)
    return out
