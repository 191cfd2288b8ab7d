"""GPT-2, written from scratch, with a KV cache passed through ``forward``.

``logits, cache = model(idx)`` runs a prefill and returns a cache holding every key/value so
far; ``logits, cache = model(idx_new, cache)`` appends any number of new tokens to it. Positions
start where the cache ends, and the causal mask is offset by the cached length, so one call
covers prefill, single-token decode and multi-token append. Parameter names follow the GPT-2
checkpoints (wte wpe h ln_1 attn.c_attn attn.c_proj mlp.c_fc mlp.c_proj ln_f lm_head), with
``lm_head`` tied to ``wte``.

``model.bugs`` can switch on the write-up's silent bugs ("positions", "mask_offset"; the cache
order bug lives in ``ConcatKVCache(new_first=True)``) so the correctness lab can show what
catches them. It is empty unless a caller sets it.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from .config import MASK_KINDS, GPTConfig
from .kv_cache import CACHE_KINDS, QUANTIZED_KINDS, ConcatKVCache, KVCache, PreallocKVCache


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.n_embd = cfg.n_embd
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(
        self,
        x: torch.Tensor,
        layer: int,
        cache: KVCache | None,
        mask_offset: int,
        mask_kind: str,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, nh, S, hs), S = cached + T, oldest first
        S = k.size(2)

        if mask_kind == "seed":
            # The write-up's attention: explicit scores, fp32 mask buffer sliced at the offset.
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, S)
            m = self.bias[:, :, mask_offset : mask_offset + T, :S]
            att = att.masked_fill(m == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v  # (B, nh, T, hs)
        elif mask_kind == "shared_bool":
            m = mask[mask_offset : mask_offset + T, :S]  # type: ignore[index]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        elif T == 1 and mask_offset == S - 1:
            # One new token may see every key, itself included: no mask at all.
            y = F.scaled_dot_product_attention(q, k, v)
        elif T == S or mask_offset == 0:
            # Prefill. (With the mask_offset bug this is also what a new token wrongly gets:
            # is_causal aligns the triangle to the top-left, i.e. an offset of 0.)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # Several new tokens after a cache: the triangle aligned to the bottom-right.
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, S))
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

    def forward(
        self,
        x: torch.Tensor,
        layer: int,
        cache: KVCache | None,
        mask_offset: int,
        mask_kind: str,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), layer, cache, mask_offset, mask_kind, mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, eps=1e-5),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as in GPT-2
        self.bugs: frozenset[str] = frozenset()
        self.weights_label = "random (torch default init)"
        self._build_masks(device)

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def empty(cls, cfg: GPTConfig, device: torch.device | str, dtype: torch.dtype) -> GPT:
        """Parameters allocated but not initialised (no wasted default init on big shapes)."""
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device=device).to(dtype)
        model.lm_head.weight = model.transformer.wte.weight  # keep the tie after to_empty
        model._build_masks(device)
        return model

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
        model.weights_label = f"random (seed {seed})"
        return model.eval()

    def _build_masks(self, device: torch.device | str | None) -> None:
        """Drop every mask buffer, then build the config's variant (others are built on use)."""
        for block in self.transformer.h:
            if hasattr(block.attn, "bias"):
                del block.attn.bias
        self.shared_mask: torch.Tensor | None = None
        self._ensure_mask(self.config.mask, device)

    def _ensure_mask(self, kind: str, device: torch.device | str | None = None) -> None:
        cfg = self.config
        device = self.device if device is None else device
        if kind == "seed" and not hasattr(self.transformer.h[0].attn, "bias"):
            # Twelve identical fp32 triangles in gpt2: the write-up's 48 MiB.
            for block in self.transformer.h:
                tri = torch.tril(torch.ones(cfg.block_size, cfg.block_size, device=device))
                block.attn.register_buffer(
                    "bias", tri.view(1, 1, cfg.block_size, cfg.block_size), persistent=False
                )
        elif kind == "shared_bool" and self.shared_mask is None:
            ones = torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool, device=device)
            self.shared_mask = torch.tril(ones)
        elif kind not in MASK_KINDS:
            raise ValueError(f"unknown mask kind {kind!r}; allowed: {', '.join(MASK_KINDS)}")

    def set_mask(self, kind: str) -> None:
        """Make ``kind`` the default variant and free the buffers of the others."""
        if kind not in MASK_KINDS:
            raise ValueError(f"unknown mask kind {kind!r}; allowed: {', '.join(MASK_KINDS)}")
        self.config = dataclasses.replace(self.config, mask=kind)
        self._build_masks(self.device)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def mask_nbytes(self, kind: str | None = None) -> int:
        """Bytes held by causal-mask buffers: of variant ``kind`` only, or of every variant
        built so far (a mode that runs another variant builds its buffers on first use)."""
        bufs = []
        if kind in (None, "seed"):
            bufs += [b.attn.bias for b in self.transformer.h if hasattr(b.attn, "bias")]
        if kind in (None, "shared_bool") and self.shared_mask is not None:
            bufs.append(self.shared_mask)
        return sum(b.numel() * b.element_size() for b in bufs)

    def release_mask(self, kind: str) -> None:
        """Free the buffers of variant ``kind`` unless it is the config's own (rebuilt on use)."""
        if kind == self.config.mask:
            return
        if kind == "seed":
            for block in self.transformer.h:
                if hasattr(block.attn, "bias"):
                    del block.attn.bias
        elif kind == "shared_bool":
            self.shared_mask = None

    def make_cache(
        self, kind: str = "prealloc", batch_size: int = 1, capacity: int | None = None
    ) -> KVCache:
        cfg = self.config
        if kind == "concat":
            return ConcatKVCache(cfg.n_layer, new_first="cache_order" in self.bugs)
        if kind == "prealloc":
            cap = cfg.block_size if capacity is None else capacity
            return PreallocKVCache(
                cfg.n_layer, batch_size, cfg.n_head, cap, cfg.head_dim,
                device=self.device, dtype=self.dtype,
            )
        if kind == "paged" or kind in QUANTIZED_KINDS:
            from .kv_variants import PagedKVCache, QuantizedKVCache  # noqa: PLC0415 (rarely used)

            cap = cfg.block_size if capacity is None else capacity
            shape = (cfg.n_layer, batch_size, cfg.n_head, cap, cfg.head_dim)
            if kind == "paged":
                return PagedKVCache(*shape, device=self.device, dtype=self.dtype)
            return QuantizedKVCache(*shape, storage=QUANTIZED_KINDS[kind], device=self.device,
                                    dtype=self.dtype)
        raise ValueError(f"unknown cache kind {kind!r}; allowed: {', '.join(CACHE_KINDS)}")

    # -- forward -------------------------------------------------------------------------------
    def forward(
        self,
        idx: torch.Tensor,
        cache: KVCache | None = None,
        *,
        use_cache: bool = True,
        logits: str = "all",
        mask: str | None = None,
    ) -> tuple[torch.Tensor, KVCache | None]:
        """Logits for the positions in ``idx`` (B, T), and the cache holding everything so far.

        ``use_cache=False`` with no cache runs a plain forward and returns ``None`` for the cache.
        ``logits="last"`` applies the output projection to the last position only.
        ``mask`` overrides the config's causal-mask variant for this call (buffers built once).
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
            cache = self.make_cache("concat", B)

        # Positions continue where the cache ends (the "positions" bug restarts them at 0).
        start = 0 if "positions" in self.bugs else past
        pos = torch.arange(start, start + T, device=idx.device)  # (T,)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C)
        mask_offset = 0 if "mask_offset" in self.bugs else past
        kind = self.config.mask if mask is None else mask
        if kind != "none":
            self._ensure_mask(kind)
        for layer, block in enumerate(self.transformer.h):
            x = block(x, layer, cache, mask_offset, kind, self.shared_mask)
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
