"""How attention is done: the causal-mask variants a forward is given (``engine.models.config``'s
``MASK_KINDS``), and the ways a one-token step meets a preallocated cache.

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
hold. The buffers belong to whoever holds the variant (``engine.models.state.ModelState`` keeps
one per kind for its model, so every decoder of modes 1-4 shares one set), never to the model.

A one-token step (``engine.models.gpt2.step``, ``engine.models.llama.step``) is given
``attend(layer, q, k, v) -> y`` instead, q, k, v (B, nh | n_kv, hs) the new token's, y
(B, nh, [1,] hs); it owns the KV cache:
  ``attend_filled``     writes the new row at int ``pos``, attends over rows 0..pos (modes 8,
                        12-15: no mask needed; the C++ kernel on a CPU, ``kernel_attends``)
  ``attend_static``     writes it at tensor ``pos``, attends with fixed shapes (mode 6): the
                        Triton decode kernel over rows 0..pos, or SDPA over every slot under a
                        mask computed from ``pos``
  ``attend_read_only``  only reads the cache and keeps the new rows for the caller to write
                        (modes 7 and 9: a compiled step that writes the cache recompiles per
                        position or copies the whole cache)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..kernels import cpu as kernels
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


def through_cache(attend: Attention, cache: Any, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, layer: int, offset: int) -> torch.Tensor:
    """y (B, nh, T, hs) for a forward's new q, k, v (B, nh | n_kv, T, hs), as every family's
    attention module meets its KV cache: the cache takes the new rows (``update``) and the
    variant attends over what it returns -- unless the cache reads itself in place
    (``cache.attends(q)``: the paged cache on a GPU), which then takes the attention whole
    (``cache.attend``: causal by position, so every mask variant's result). No cache: the
    variant over the new tokens alone."""
    if cache is None:
        return attend(q, k, v, layer, offset)
    attends = getattr(cache, "attends", None)
    if attends is not None and attends(q):
        return cache.attend(layer, q, k, v)
    k, v = cache.update(layer, k, v)  # (B, n_kv, S, hs), S = cached + T, oldest first
    return attend(q, k, v, layer, offset)


def make_attention(kind: str, cfg: ModelConfig, device: torch.device | str) -> Attention:
    """The variant ``kind`` for a model of shape ``cfg`` on ``device`` (buffers built now)."""
    if kind == "none":
        return FUSED
    if kind == "shared_bool":
        return SharedBoolMask(cfg, device)
    if kind == "seed":
        return ExplicitMask(cfg, device)
    raise ValueError(f"unknown mask kind {kind!r}; allowed: {', '.join(MASK_KINDS)}")


# ------------------------------------------------------- one new token over a preallocated cache
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def kernel_attends(device: torch.device, dtype: torch.dtype) -> bool:
    """Does ``engine.kernels.cpu``' attention (cache write + one query's attention in one call) take
    a cache of this device and dtype: fp32 on a CPU, the kernel built (``KVLAB_NO_KERNEL``
    unset)? It records no gradient: ``attend_filled`` uses it only under ``no_grad``."""
    return device.type == "cpu" and dtype == torch.float32 and kernels.available()[0]


def attend_filled(k_buf: torch.Tensor, v_buf: torch.Tensor, pos: int) -> Attend:
    """Write the new K/V row at ``pos`` of the (L, B, n_kv, T_max, hs) buffers (n_kv = nh for
    GPT-2; fewer K/V heads for the Llama family's grouped-query attention), then attend over
    rows 0..pos: one new token sees every key, itself included, so no mask. On a CPU in fp32 the
    C++ kernel does both in one call (SDPA's flash kernel pays a set-up per call meant for many
    queries: 1.3-1.5 ms for 12 layers at 128 tokens against 0.4 ms, measured here); elsewhere
    SDPA over 4-D views."""
    if kernel_attends(k_buf.device, k_buf.dtype) and not torch.is_grad_enabled():
        def attend_kernel(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                          ) -> torch.Tensor:
            return kernels.attend(q, k, v, k_buf[i], v_buf[i], pos)  # (B, nh, hs)

        return attend_kernel

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_buf[i, :, :, pos] = k
        v_buf[i, :, :, pos] = v
        # SDPA's fused kernels need 4-D: (B, nh, 1, hs) against (B, n_kv, pos + 1, hs); fewer
        # K/V heads than query heads (the Llama family's GQA): query head h reads K/V head
        # h // (nh / n_kv). Multi-head calls pass no enable_gqa at all, as before.
        return sdpa(q.unsqueeze(2), k_buf[i, :, :, : pos + 1], v_buf[i, :, :, : pos + 1])

    return attend


def attend_static(k_buf: torch.Tensor, v_buf: torch.Tensor, pos: torch.Tensor,
                  triton: bool = False) -> Attend:
    """Write the new K/V row at ``pos`` (a (1,) tensor) and attend with fixed shapes, whatever
    the position: with ``triton``, the decode kernel (``engine.kernels.gpu.decode_attention``)
    reads rows 0..pos only, the length taken from ``pos`` on the device; else SDPA over all
    T_max slots, masking those after ``pos``."""
    t_max = k_buf.size(3)
    if triton:
        from ..kernels.gpu.decode_attention import decode_attention

        lengths = (pos + 1).to(torch.int32).repeat(k_buf.size(1))  # (B,), on the device

        def attend_kernel(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                          ) -> torch.Tensor:
            k_buf[i].index_copy_(2, pos, k.unsqueeze(2))
            v_buf[i].index_copy_(2, pos, v.unsqueeze(2))
            return decode_attention(q.contiguous(), k_buf[i], v_buf[i], lengths)  # (B, nh, hs)

        return attend_kernel
    allowed = (torch.arange(t_max, device=pos.device) <= pos).view(1, 1, 1, t_max)

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_buf[i].index_copy_(2, pos, k.unsqueeze(2))
        v_buf[i].index_copy_(2, pos, v.unsqueeze(2))
        return sdpa(q.unsqueeze(2), k_buf[i], v_buf[i], attn_mask=allowed)

    return attend


def attend_read_only(k_past: torch.Tensor, v_past: torch.Tensor, pos: torch.Tensor | None,
                     new_k: list[torch.Tensor], new_v: list[torch.Tensor]) -> Attend:
    """Attend over the cache without writing it; the new rows are appended to ``new_k`` and
    ``new_v`` for the caller to write. ``k_past``/``v_past`` (L, B, n_kv, P, hs): with ``pos``
    None all P rows are the past; otherwise rows >= ``pos`` are masked out (static shapes).
    Past and new key share one softmax over the concatenated scores: the same sum as attending
    over a cache that already holds the new row. Grouped-query heads (n_kv < nh): each K/V
    head's group of queries is a (groups, hs) block against its keys, never repeated; with
    n_kv = nh (GPT-2) a group is one query and the arithmetic is what it always was."""
    p_len = k_past.size(3)
    scale = 1.0 / math.sqrt(k_past.size(4))
    masked = None if pos is None else torch.arange(p_len, device=pos.device) >= pos

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        new_k.append(k)
        new_v.append(v)
        B, nh, hs = q.shape
        n_kv = k.size(1)
        qg = q.view(B, n_kv, nh // n_kv, hs)  # (B, n_kv, groups, hs): head h in group h // g
        s_past = (qg @ k_past[i].transpose(-1, -2)) * scale  # (B, n_kv, groups, P)
        if masked is not None:
            s_past = s_past.masked_fill(masked, float("-inf"))
        s_new = (qg * k.unsqueeze(2)).sum(-1, keepdim=True) * scale  # (B, n_kv, groups, 1)
        att = torch.softmax(torch.cat([s_past, s_new], dim=-1), dim=-1)
        y = att[..., :p_len] @ v_past[i] + att[..., p_len:] * v.unsqueeze(2)
        return y.view(B, nh, 1, hs)

    return attend
