"""The Llama family (SmolLM2), written from scratch: ``Llama``, its modules and what differs from
GPT-2.

The construction, the forward's checks and positions, the loop over the blocks and the KV cache
passed through ``forward`` are every family's (``engine.models.base.CausalLM``), so every eager
decoder runs it unchanged. What differs from GPT-2:

  RMSNorm      x / rms(x) * weight, computed in fp32 (no mean subtracted, no bias)
  RoPE         no position embedding: q and k are rotated by their token's absolute position,
               before k enters the cache (a cached key keeps the rotation of its own position).
               Channels i and i + hs/2 of a head form one rotating pair (the "rotate_half" / NEOX
               layout of ``transformers``; llama.cpp's GGUF files store q/k rows interleaved,
               and ``engine.models.llama.weights`` un-permutes them on load); shared by every
               family with rotary positions (``engine.models.rope``)
  SwiGLU MLP   down(silu(gate(x)) * up(x)), width ``n_hidden``
  GQA          ``n_head`` query heads share ``n_kv_head`` K/V heads; the cache holds the K/V
               heads only, never repeated copies. Query head h reads K/V head h // groups
               (groups = n_head / n_kv_head): the fused attention passes ``enable_gqa=True`` to
               scaled_dot_product_attention, the explicit one views q as
               (B, n_kv_head, groups, T, hs) against k (B, n_kv_head, 1, S, hs)
               (``engine.models.attention``)
  tied output  ``lm_head`` shares the embedding's weight when ``cfg.tied`` (SmolLM2 does)

Parameter names are ``transformers``' ``LlamaForCausalLM``'s (model.embed_tokens,
model.layers.N.self_attn.{q,k,v,o}_proj, .mlp.{gate,up,down}_proj, .input_layernorm,
.post_attention_layernorm, model.norm, lm_head), so the reference copy is one
``load_state_dict``; q, k and v stay separate projections, as the GGUF file stores them (each
with its own quantized blocks). No biases anywhere, and no buffers: RoPE's angles are computed
per forward from the positions (a few hundred numbers), so ``empty``/``to(dtype)`` never touch
them and they stay fp32 until they meet q and k.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...cache.contiguous import KVCache
from ..attention import Attention, through_cache
from ..base import CausalLM, PreNormBlock, embedding
from ..config import LlamaConfig
from ..rope import apply_rope, rope_angles  # a kind of positions, shared by the RoPE families


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))  # host: module init; materialise places it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32 whatever the model dtype (as transformers does): a bf16 mean of squares loses
        # the small channels.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, nh, T, hs), k, v (B, n_kv, T, hs) of x (B, T, C), q and k turned by RoPE."""
        B, T, _ = x.shape
        hs = self.head_dim
        q = self.q_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, n_kv, T, hs)
        v = self.v_proj(x).view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, n_kv, T, hs)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v  # at their own positions

    def output(self, y: torch.Tensor) -> torch.Tensor:
        """The heads (B, nh, T, hs) side by side again, through o_proj: (B, T, C)."""
        B, _, T, hs = y.shape
        return self.o_proj(y.transpose(1, 2).contiguous().view(B, T, self.n_head * hs))

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache | None, attend: Attention,
                offset: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        # (B, nh, T, hs): head h reads K/V head h // groups
        return self.output(through_cache(attend, cache, q, k, v, layer, offset))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.n_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.n_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.n_hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(PreNormBlock):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(input_layernorm=RMSNorm(cfg.n_embd, cfg.norm_eps),
                         self_attn=LlamaAttention(cfg),
                         post_attention_layernorm=RMSNorm(cfg.n_embd, cfg.norm_eps),
                         mlp=LlamaMLP(cfg))


class Llama(CausalLM):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(cfg)
        self.model = nn.ModuleDict(dict(
            embed_tokens=embedding(cfg.vocab_size, cfg.n_embd),
            layers=nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer)),
            norm=RMSNorm(cfg.n_embd, cfg.norm_eps),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tied:
            self.model.embed_tokens.weight = self.lm_head.weight

    # -- what differs from GPT-2 ----------------------------------------------------------------
    def trunk(self) -> tuple[nn.ModuleList, nn.Module]:
        return self.model.layers, self.model.norm

    def embed(self, idx: torch.Tensor, pos: torch.Tensor
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The tokens' embeddings (B, T, C) -- no position embedding, RoPE instead -- and RoPE's
        cos, sin (T, hs) at ``pos``, which every block's attention takes."""
        cfg = self.config
        cos, sin = rope_angles(pos, cfg.head_dim, cfg.rope_theta, self.dtype,
                               cfg.rope_scaling)  # (T, hs) each
        return self.model.embed_tokens(idx), (cos, sin)

    def init_weights(self, std: float, generator: torch.Generator) -> None:
        """Every matrix N(0, std) (transformers' Llama initialisation, std 0.02), norms 1."""
        for name, p in self.named_parameters():  # a tied weight is listed once
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=generator)
