"""How causality is enforced in attention: the variants a forward is given (``engine.config``'s
``MASK_KINDS``).

Every variant is called the same way, once per layer:

  attend(q, k, v, layer, offset) -> y
      q (B, nh, T, hs) the new tokens' queries; k, v (B, n_kv, S, hs) every key/value so far,
      oldest first; ``offset`` the tokens cached before q's first (query i sits at position
      offset + i, so it may see keys 0..offset + i); y (B, nh, T, hs)

Grouped-query attention (the Llama family): k and v may hold fewer heads than q (n_kv divides
nh); query head h reads K/V head h // (nh // n_kv), as ``transformers``' ``repeat_kv`` does.
No variant repeats K/V in memory: the fused ones pass ``enable_gqa=True`` to the kernel, the
explicit one views q as (B, n_kv, groups, T, hs) so each K/V head meets its group by
broadcasting. With as many K/V heads as query heads (GPT-2) every variant takes exactly the
path it always took: GPT-2's results are bit for bit what they were.

  "none"         ``FUSED``: ``scaled_dot_product_attention``, causality from the shapes, no
                 stored mask (the default of ``GPT.forward``)
  "shared_bool"  ``SharedBoolMask``: one bool block_size x block_size triangle for all layers
  "seed"         ``ExplicitMask``: the write-up's -- explicit scores, masked by an fp32 triangle
                 registered once per layer (nanoGPT's path without flash attention); gpt2's
                 twelve copies are the write-up's 48 MiB, which the Memory page measures.
                 A model of more than ``EAGER_POSITIONS`` positions (SmolLM2: 8,192, which
                 would be 30 x 256 MiB) gets triangles of that side first, grown (doubling, up
                 to its limit) when a forward reaches past them; ``nbytes()`` is what is built

``make_attention(kind, cfg, device)`` builds one; ``attention.nbytes()`` is what its buffers
hold. The buffers belong to whoever holds the variant (``engine.state.ModelState`` keeps one
per kind for its model, so every decoder of modes 1-4 shares one set), never to the model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .config import MASK_KINDS, ModelConfig

# Triangles of "seed" are built whole up to this many positions (every GPT-2: 1,024), and
# grown on demand past it: SmolLM2's 8,192 would be 7.5 GiB of fp32 triangles up front.
EAGER_POSITIONS = 1024


# SDPA's backends our calls may use on a GPU: every one but cuDNN's. cuDNN's attention (picked
# first for bf16 on Hopper) builds an execution plan per new sequence length, and a decode step
# is a new length every time: first light on an H200 measured mode 8's bf16 step at 74-76 ms
# (8 ms with the math backend alone), mode 5's first sample at a new length at 149 ms.
GPU_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
    """``scaled_dot_product_attention`` as every attention of the engine calls it: told when
    k/v hold fewer heads than q (GQA; GPT-2's calls pass no ``enable_gqa`` at all), and on a GPU
    kept off cuDNN's backend (``GPU_BACKENDS``). q (B, nh, T, hs), k/v (B, n_kv, S, hs)."""
    if k.size(1) != q.size(1):
        kw["enable_gqa"] = True  # query head h reads K/V head h // (nh // n_kv)
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, **kw)  # type: ignore[arg-type]
    with sdpa_kernel(list(GPU_BACKENDS)):
        return F.scaled_dot_product_attention(q, k, v, **kw)  # type: ignore[arg-type]


class FusedAttention:
    """"none": the fused kernel, told about causality by the shapes alone."""

    kind = "none"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 offset: int) -> torch.Tensor:
        T, S = q.size(2), k.size(2)
        if T == 1 and offset == S - 1:
            # One new token may see every key, itself included: no mask at all.
            return sdpa(q, k, v)
        if T == S or offset == 0:
            # Prefill. (With the write-up's mask-offset bug this is also what a new token
            # wrongly gets: is_causal aligns the triangle to the top-left, an offset of 0.)
            return sdpa(q, k, v, is_causal=True)
        # Several new tokens after a cache: the triangle aligned to the bottom-right.
        if q.device.type == "cpu":
            # What causal_lower_right does on a CPU (no flash or efficient kernel takes it there):
            # the boolean triangle, materialized. Written out because torch.nn.attention.bias
            # imports torch._dynamo: 1.5 s on a 2-core CPU, in the measuring process of every
            # sweep whose gate appends after a cache (tests/test_model.py holds them equal).
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
            return sdpa(q, k, v, attn_mask=mask)
        from torch.nn.attention.bias import causal_lower_right

        return sdpa(q, k, v, attn_mask=causal_lower_right(T, S))

    def nbytes(self) -> int:
        return 0


FUSED = FusedAttention()


class SharedBoolMask:
    """"shared_bool": one bool triangle, sliced at the offset, shared by every layer."""

    kind = "shared_bool"

    def __init__(self, cfg: ModelConfig, device: torch.device | str) -> None:
        ones = torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool, device=device)
        self.mask = torch.tril(ones)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 offset: int) -> torch.Tensor:
        m = self.mask[offset : offset + q.size(2), : k.size(2)]
        return sdpa(q, k, v, attn_mask=m)

    def nbytes(self) -> int:
        return self.mask.numel() * self.mask.element_size()


class ExplicitMask:
    """"seed": the write-up's attention -- explicit scores, an fp32 triangle per layer."""

    kind = "seed"

    def __init__(self, cfg: ModelConfig, device: torch.device | str) -> None:
        self.n_layer, self.limit, self.device = cfg.n_layer, cfg.block_size, device
        self.bias: list[torch.Tensor] = []
        self._build(min(cfg.block_size, EAGER_POSITIONS))

    def _build(self, n: int) -> None:
        # One identical triangle per layer, as the write-up registered them (its 48 MiB).
        self.bias = []  # the old triangles go before the new ones are allocated
        self.bias = [torch.tril(torch.ones(n, n, device=self.device)).view(1, 1, n, n)
                     for _ in range(self.n_layer)]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                 offset: int) -> torch.Tensor:
        T, S = q.size(2), k.size(2)
        side = self.bias[layer].size(-1)
        if side < S:  # only past EAGER_POSITIONS: a longer model's triangles grow on demand
            self._build(min(self.limit, max(S, 2 * side)))
        m = self.bias[layer][:, :, offset : offset + T, :S]
        scale = 1.0 / math.sqrt(q.size(-1))
        if k.size(1) == q.size(1):
            att = (q @ k.transpose(-2, -1)) * scale  # (B, nh, T, S)
            att = att.masked_fill(m == 0, float("-inf"))
            return F.softmax(att, dim=-1) @ v  # (B, nh, T, hs)
        # GQA: query head h = kv * groups + g reads K/V head kv = h // groups, by broadcasting.
        B, nh, _, hs = q.shape
        n_kv = k.size(1)
        qg = q.view(B, n_kv, nh // n_kv, T, hs)  # (B, n_kv, groups, T, hs)
        att = (qg @ k.unsqueeze(2).transpose(-2, -1)) * scale  # (B, n_kv, groups, T, S)
        att = att.masked_fill(m.unsqueeze(0) == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v.unsqueeze(2)  # (B, n_kv, groups, T, hs)
        return y.view(B, nh, T, hs)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bias)


Attention = FusedAttention | SharedBoolMask | ExplicitMask


def make_attention(kind: str, cfg: ModelConfig, device: torch.device | str) -> Attention:
    """The variant ``kind`` for a model of shape ``cfg`` on ``device`` (buffers built now)."""
    if kind == "none":
        return FUSED
    if kind == "shared_bool":
        return SharedBoolMask(cfg, device)
    if kind == "seed":
        return ExplicitMask(cfg, device)
    raise ValueError(f"unknown mask kind {kind!r}; allowed: {', '.join(MASK_KINDS)}")
