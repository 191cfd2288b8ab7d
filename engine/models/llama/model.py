"""The Llama family (SmolLM2), written from scratch, with a KV cache passed through ``forward``.

The same surface as ``engine.models.gpt2.model.GPT``, so every eager decoder runs it unchanged:
``logits, cache = model(idx)`` prefills; ``logits, cache = model(idx_new, cache)`` appends any
number of tokens. What differs from GPT-2:

  RMSNorm      x / rms(x) * weight, computed in fp32 (no mean subtracted, no bias)
  RoPE         no position embedding: q and k are rotated by their token's absolute position,
               before k enters the cache (a cached key keeps the rotation of its own position).
               Positions are ``input_pos`` when given (a (T,) long tensor, gpt-fast style: a
               captured step can take them from a tensor); when None they are
               ``cache.length + arange(T)``: the new tokens follow what the cache holds. Either
               way the new keys are written at ``cache.length``; the caller keeps the two
               consistent. Channels i and i + hs/2 of a head form one rotating pair (the
               "rotate_half" / NEOX layout of ``transformers``; llama.cpp's GGUF files store
               q/k rows interleaved, and ``engine.models.llama.weights`` un-permutes them on load)
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

from ...cache import ConcatKVCache, KVCache
from ..attention import FUSED, Attention
from ..config import LlamaConfig
from ..gpt2.model import _embedding, materialise


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


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache | None, attend: Attention,
                offset: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hs = self.head_dim
        q = self.q_proj(x).view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, n_kv, T, hs)
        v = self.v_proj(x).view(B, T, self.n_kv_head, hs).transpose(1, 2)  # (B, n_kv, T, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # at their absolute positions
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, n_kv, S, hs), S = cached + T, oldest first
        y = attend(q, k, v, layer, offset)  # (B, nh, T, hs): head h read K/V head h // groups
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * hs)
        return self.o_proj(y)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.n_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.n_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.n_hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache | None, attend: Attention,
                offset: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), layer, cache, attend, offset, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = nn.ModuleDict(
            dict(
                embed_tokens=_embedding(cfg.vocab_size, cfg.n_embd),
                layers=nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer)),
                norm=RMSNorm(cfg.n_embd, cfg.norm_eps),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tied:
            self.model.embed_tokens.weight = self.lm_head.weight

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def empty(cls, cfg: LlamaConfig, device: torch.device | str, dtype: torch.dtype) -> Llama:
        """Parameters allocated but not initialised (no wasted default init on big shapes)."""
        with torch.device("meta"):
            model = cls(cfg)
        return materialise(model, device, dtype)  # a tie to lm_head kept

    @classmethod
    def random(
        cls,
        cfg: LlamaConfig,
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        std: float = 0.02,
    ) -> Llama:
        """Seeded random weights with the real shapes: every matrix N(0, std) (transformers'
        Llama initialisation, std 0.02), norms 1. Tests raise ``std`` so that a tiny random
        model's greedy stream is lively enough for a wrong cache to change the tokens."""
        model = cls.empty(cfg, device, dtype)
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():  # a tied weight is listed once
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std, generator=gen)
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
        input_pos: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KVCache | None]:
        """Logits for the tokens in ``idx`` (B, T), and the cache holding everything so far.

        Positions (RoPE's angles): ``input_pos`` (T,) when given; otherwise the new tokens
        follow the cache: ``cache.length + arange(T)`` (0..T-1 without a cache). The new keys
        and values are appended at ``cache.length`` either way.
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
        if input_pos is None:
            pos = torch.arange(past, past + T, device=idx.device)  # positions continue the cache
        else:
            pos = self._checked_positions(input_pos, T)
        if cache is None and use_cache:
            cache = ConcatKVCache(self.config.n_layer)
        attend = FUSED if attention is None else attention

        cfg = self.config
        cos, sin = rope_angles(pos, cfg.head_dim, cfg.rope_theta, self.dtype)  # (T, hs) each
        x = self.model.embed_tokens(idx)  # (B, T, C): no position embedding, RoPE instead
        for layer, block in enumerate(self.model.layers):
            x = block(x, layer, cache, attend, past, cos, sin)
        if cache is not None:
            cache.advance(T)
        x = self.model.norm(x)
        if logits == "last":
            x = x[:, -1:, :]  # generation only needs the next token's prediction
        elif logits != "all":
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        return self.lm_head(x), cache  # (B, T or 1, vocab)

    def _checked_positions(self, input_pos: torch.Tensor, T: int) -> torch.Tensor:
        if input_pos.dim() != 1 or input_pos.size(0) != T:
            raise ValueError(f"input_pos must be a ({T},) tensor, one position per new token; "
                             f"got shape {tuple(input_pos.shape)}")
        if input_pos.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_pos must hold integers (torch.long), got {input_pos.dtype}")
        if input_pos.device.type == "cpu":
            lo, hi = int(input_pos.min()), int(input_pos.max())
            if lo < 0 or hi >= self.config.block_size:
                raise ValueError(f"position {lo if lo < 0 else hi} is outside the model's "
                                 f"positions; allowed: 0..{self.config.block_size - 1}")
        return input_pos

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weight counted once
