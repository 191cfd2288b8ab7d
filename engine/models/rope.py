"""Rotary positions (RoPE): a kind of positions (the family table's ``positions="rope"``), shared
by every family that has them, so no one family's folder owns them.

  rope_angles(pos, head_dim, theta, dtype, scaling=None) -> cos, sin (T, hs): pair i of a head
                                              turns by pos * theta^(-2i/hs) (its frequency
                                              rescaled by ``scaling``: ``llama3_frequencies``)
  apply_rope(x, cos, sin) -> x turned      x (B, h, T, hs); channels i and i + hs/2 form one
                                              rotating pair (``transformers``' "rotate_half" /
                                              NEOX layout; llama.cpp's GGUF files store q/k rows
                                              interleaved, and the families' GGUF readers
                                              un-permute them on load)

The angles are computed in fp32 whatever the model's dtype (as ``transformers`` does) and only
then cast: a bf16 ``pos * inv_freq`` is off by whole radians at positions in the thousands.
"""

from __future__ import annotations

import math

import torch


def rope_angles(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                scaling: tuple[float, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, hs) for positions ``pos`` (T,): pair i of a head turns by
    pos * theta^(-2i/hs); channel i and channel i + hs/2 share that angle (rotate_half layout).
    ``scaling``: Llama 3's (factor, low_freq_factor, high_freq_factor, original context)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=pos.device).float()
    inv_freq = 1.0 / (theta ** (exponents / head_dim))  # (hs/2,) in fp32, as transformers
    if scaling is not None:
        inv_freq = llama3_frequencies(inv_freq, *scaling)
    freqs = pos.float()[:, None] * inv_freq[None, :]  # (T, hs/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, h, T, hs) rotated: each pair (x_i, x_{i+hs/2}) turns by its position's angle."""
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # rotate_half
    return x * cos + rotated * sin


def llama3_frequencies(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                       high_freq_factor: float, original_context: float) -> torch.Tensor:
    """Llama 3's RoPE scaling (transformers' rope_type "llama3"): a pair whose wavelength is
    longer than ``original_context / low_freq_factor`` turns ``factor`` times slower, one shorter
    than ``original_context / high_freq_factor`` as before, and those between blend the two."""
    wavelen = 2 * math.pi / inv_freq  # (hs/2,) tokens a pair takes to turn once
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    slow = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * slow / factor + smooth * slow
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, slow)
