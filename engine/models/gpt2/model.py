"""GPT-2, written from scratch, with a KV cache passed through ``forward``.

``logits, cache = model(idx)`` runs a prefill and returns a cache holding every key/value so
far; ``logits, cache = model(idx_new, cache)`` appends any number of new tokens to it. Positions
start where the cache ends, and attention is told how many tokens were cached before the new
ones, so one call covers prefill, single-token decode and multi-token append. Parameter names
follow the GPT-2 checkpoints (wte wpe h ln_1 attn.c_attn attn.c_proj mlp.c_fc mlp.c_proj ln_f
lm_head), with ``lm_head`` tied to ``wte``.

The model holds its weights and nothing else: the caches are ``engine.cache``'s, the causal
mask variants ``engine.models.attention``'s (``forward(..., attention=...)``; fused attention with
no stored mask by default), and what is built on a model -- packed copies, compiled steps, mask
buffers, where the weights came from -- lives in ``engine.models.state.ModelState``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...cache import ConcatKVCache, KVCache
from ..attention import FUSED, Attention
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
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, nh, S, hs), S = cached + T, oldest first
        y = attend(q, k, v, layer, offset)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads side by side
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache | None, attend: Attention,
                offset: int) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), layer, cache, attend, offset)
        return x + self.mlp(self.ln_2(x))


def _embedding(num: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(num, dim)``; built on the meta device (``GPT.empty``) without its default
    init: ``normal_`` on a meta tensor runs a Python decomposition that imports torch._dynamo,
    1.7 s of every measuring process's start on a 2-core CPU, for values nobody keeps."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim, device="meta"))
    return nn.Embedding(num, dim)


def materialise(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """``model`` (built on the meta device) with every parameter allocated on ``device``,
    uninitialised, floating ones in ``dtype``; a parameter shared by two modules (a tied
    embedding) stays shared. ``to_empty`` does the same through ``torch._refs``, which imports
    sympy: 0.5 s of every measuring process's first model on a 2-core CPU."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) not in made:
                kind = dtype if p.is_floating_point() else p.dtype
                made[id(p)] = nn.Parameter(torch.empty(p.shape, device=device, dtype=kind),
                                           requires_grad=p.requires_grad)
            if p is not None:
                module._parameters[name] = made[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                kind = dtype if b.is_floating_point() else b.dtype
                module._buffers[name] = torch.empty(b.shape, device=device, dtype=kind)
    return model


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=_embedding(cfg.vocab_size, cfg.n_embd),
                wpe=_embedding(cfg.block_size, cfg.n_embd),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, eps=1e-5),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as in GPT-2

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def empty(cls, cfg: GPTConfig, device: torch.device | str, dtype: torch.dtype) -> GPT:
        """Parameters allocated but not initialised (no wasted default init on big shapes)."""
        with torch.device("meta"):
            model = cls(cfg)
        return materialise(model, device, dtype)  # the tie to lm_head kept

    @classmethod
    def random(
        cls,
        cfg: GPTConfig,
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        std: float = 0.02,
    ) -> GPT:
        """Seeded random weights with GPT-2's initialisation scheme and the real shapes.

        ``std`` is GPT-2's 0.02; tests raise it so that a tiny random model's predictions are
        peaked and varied enough for a wrong cache to change the tokens.
        """
        model = cls.empty(cfg, device, dtype)
        gen = torch.Generator(device=device).manual_seed(seed)
        proj_std = std / math.sqrt(2 * cfg.n_layer)  # residual projections, as in GPT-2
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("c_proj.weight"):
                    p.normal_(0.0, proj_std, generator=gen)
                elif name.endswith(".weight") and p.dim() == 2:
                    p.normal_(0.0, std, generator=gen)
                elif "ln_" in name and name.endswith(".weight"):
                    p.fill_(1.0)
                else:
                    p.zero_()
            model.transformer.wpe.weight.normal_(0.0, std / 2, generator=gen)
        return model.eval()

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    # -- forward -------------------------------------------------------------------------------
    def forward(
        self,
        idx: torch.Tensor,
        cache: KVCache | None = None,
        *,
        use_cache: bool = True,
        logits: str = "all",
        attention: Attention | None = None,
    ) -> tuple[torch.Tensor, KVCache | None]:
        """Logits for the positions in ``idx`` (B, T), and the cache holding everything so far.

        ``use_cache=False`` with no cache runs a plain forward and returns ``None`` for the cache.
        ``logits="last"`` applies the output projection to the last position only.
        ``attention`` is the causal-mask variant (``engine.models.attention``; default: fused, no
        mask).
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must be a (batch, tokens) tensor, got shape {tuple(idx.shape)}")
        B, T = idx.shape
        past = cache.length if cache is not None else 0
        limit = self.config.block_size
        if T == 0:
            raise ValueError("idx holds no tokens; pass at least one token per sequence")
        if past + T > limit:
            raise ValueError(
                f"context of {past + T} tokens ({past} cached + {T} new) is beyond the model's "
                f"limit of {limit}; allowed: at most {limit} tokens in total"
            )
        if idx.device.type == "cpu":  # cheap here; on a GPU it would force a sync every step
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(
                    f"token id {lo if lo < 0 else hi} is outside the vocabulary; "
                    f"allowed: 0..{self.config.vocab_size - 1}"
                )
        if cache is None and use_cache:
            cache = ConcatKVCache(self.config.n_layer)
        attend = FUSED if attention is None else attention

        pos = torch.arange(past, past + T, device=idx.device)  # positions continue the cache
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        for layer, block in enumerate(self.transformer.h):
            x = block(x, layer, cache, attend, past)
        if cache is not None:
            cache.advance(T)
        x = self.transformer.ln_f(x)
        if logits == "last":
            x = x[:, -1:, :]  # generation only needs the next token's prediction
        elif logits != "all":
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        return self.lm_head(x), cache  # (B, T or 1, vocab)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weight counted once
