"""GPT-2, written from scratch: ``GPT``, its modules and what differs from the other families.

Read it beside nanoGPT's ``model.py``. The construction, the forward's checks and positions,
the loop over the blocks and the KV cache passed through ``forward`` are every family's
(``engine.models.base.CausalLM``); here: LayerNorm, learned absolute positions added to the
token embedding, one fused q|k|v product (every head caching its own K and V), a 4x GELU MLP,
GPT-2's initialisation. Parameter names follow the GPT-2 checkpoints (wte wpe h ln_1
attn.c_attn attn.c_proj mlp.c_fc mlp.c_proj ln_f lm_head), with ``lm_head`` tied to ``wte``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...cache.contiguous import KVCache
from ..attention import Attention, through_cache
from ..base import CausalLM, PreNormBlock, embedding
from ..config import GPTConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache | None, attend: Attention,
                offset: int) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = through_cache(attend, cache, q, k, v, layer, offset)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads side by side
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(PreNormBlock):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(ln_1=nn.LayerNorm(cfg.n_embd, eps=1e-5), attn=CausalSelfAttention(cfg),
                         ln_2=nn.LayerNorm(cfg.n_embd, eps=1e-5), mlp=MLP(cfg))


class GPT(CausalLM):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.transformer = nn.ModuleDict(dict(
            wte=embedding(cfg.vocab_size, cfg.n_embd),
            wpe=embedding(cfg.block_size, cfg.n_embd),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=nn.LayerNorm(cfg.n_embd, eps=1e-5),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as in GPT-2

    # -- what differs from the Llama family ---------------------------------------------------
    def trunk(self) -> tuple[nn.ModuleList, nn.Module]:
        return self.transformer.h, self.transformer.ln_f

    def embed(self, idx: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, tuple[()]]:
        """Token and learned position embeddings (B, T, C); a block takes nothing more."""
        return self.transformer.wte(idx) + self.transformer.wpe(pos), ()

    def init_weights(self, std: float, generator: torch.Generator) -> None:
        """GPT-2's initialisation scheme: matrices N(0, std), the residual projections scaled
        down by sqrt(2 n_layer), LayerNorms 1, biases 0, positions N(0, std / 2)."""
        proj_std = std / math.sqrt(2 * self.config.n_layer)  # residual projections, as in GPT-2
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                p.normal_(0.0, proj_std, generator=generator)
            elif name.endswith(".weight") and p.dim() == 2:
                p.normal_(0.0, std, generator=generator)
            elif "ln_" in name and name.endswith(".weight"):
                p.fill_(1.0)
            else:
                p.zero_()
        self.transformer.wpe.weight.normal_(0.0, std / 2, generator=generator)
