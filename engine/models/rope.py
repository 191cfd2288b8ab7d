"""Rotary positions (RoPE): a kind of positions (the family table's ``positions="rope"``), shared
by every family that has them, so no one family's folder owns them.

  rope_angles(pos, head_dim, theta, dtype) -> cos, sin (T, hs): pair i of a head turns by
                                              pos * theta^(-2i/hs)
  apply_rope(x, cos, sin) -> x turned      x (B, h, T, hs); channels i and i + hs/2 form one
                                              rotating pair (``transformers``' "rotate_half" /
                                              NEOX layout; llama.cpp's GGUF files store q/k rows
                                              interleaved, and the families' GGUF readers
                                              un-permute them on load)

The angles are computed in fp32 whatever the model's dtype (as ``transformers`` does) and only
then cast: a bf16 ``pos * inv_freq`` is off by whole radians at positions in the thousands.
"""

from __future__ import annotations

import torch


def rope_angles(pos: torch.Tensor, head_dim: int, theta: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, hs) for positions ``pos`` (T,): pair i of a head turns by
    pos * theta^(-2i/hs); channel i and channel i + hs/2 share that angle (rotate_half layout)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=pos.device).float()
    inv_freq = 1.0 / (theta ** (exponents / head_dim))  # (hs/2,) in fp32, as transformers
    freqs = pos.float()[:, None] * inv_freq[None, :]  # (T, hs/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, h, T, hs) rotated: each pair (x_i, x_{i+hs/2}) turns by its position's angle."""
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # rotate_half
    return x * cos + rotated * sin
