"""What every family's model is built on: ``CausalLM``, the construction and the forward written
once; a family's model (``engine.models.gpt2.model.GPT``, ``engine.models.llama.model.Llama``)
adds only its modules and what differs.

``logits, cache = model(idx)`` runs a prefill and returns a cache holding every key/value so
far; ``logits, cache = model(idx_new, cache)`` appends any number of new tokens to it. Positions
are ``input_pos`` when given (a (T,) long tensor, gpt-fast style: a captured step can take them
from a tensor), else they continue the cache (``cache.length + arange(T)``); either way the new
keys are written at ``cache.length`` and attention is told how many tokens were cached before
the new ones, so one call covers prefill, single-token decode and multi-token append.

A family's model says what differs, nothing else (its blocks are ``PreNormBlock``s naming their
four parts):
  ``embed(idx, pos) -> (x, extra)``  the tokens' vectors (B, T, C) at positions ``pos``, and what
                                     every block takes besides (RoPE's cos, sin; GPT-2: nothing)
  ``trunk() -> (blocks, norm)``      its list of blocks, each called as
                                     ``block(x, layer, cache, attend, offset, *extra)``, and the
                                     norm before ``lm_head``
  ``init_weights(std, generator)``   its random initialisation (in place, under ``no_grad``)

The model holds its weights and nothing else: the caches are ``engine.cache``'s, the causal-mask
variants ``engine.models.attention``'s (``forward(..., attention=...)``; fused attention with no
stored mask by default), and what is built on a model -- packed copies, compiled steps, mask
buffers, where the weights came from -- lives in ``engine.models.state.ModelState``.
"""

from __future__ import annotations

from typing import Any, Self

import torch
import torch.nn as nn

from ..cache.contiguous import ConcatKVCache, KVCache
from .attention import FUSED, Attention
from .config import ModelConfig


def embedding(num: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(num, dim)``; built on the meta device (``CausalLM.empty``) without its
    default init: ``normal_`` on a meta tensor runs a Python decomposition that imports
    torch._dynamo, 1.7 s of every measuring process's start on a 2-core CPU, for values nobody
    keeps."""
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


class PreNormBlock(nn.Module):
    """A block as every family builds it: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``.
    A family's block passes its four modules under its checkpoints' names, in that order (norm
    before attention, attention, norm before the MLP, MLP); the attention takes
    ``(x, layer, cache, attend, offset, *extra)``."""

    def __init__(self, **parts: nn.Module) -> None:
        super().__init__()
        for name, module in parts.items():  # registered in order: named_parameters() keeps it
            self.add_module(name, module)
        self.parts = tuple(parts)

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache | None, attend: Attention,
                offset: int, *extra: Any) -> torch.Tensor:
        norm_1, attn, norm_2, mlp = (self._modules[name] for name in self.parts)
        x = x + attn(norm_1(x), layer, cache, attend, offset, *extra)  # type: ignore[misc]
        return x + mlp(norm_2(x))  # type: ignore[misc]


class CausalLM(nn.Module):
    """A from-scratch decoder-only model: see the module docstring."""

    lm_head: nn.Linear

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg

    # -- what a family says ----------------------------------------------------------------------
    def trunk(self) -> tuple[nn.ModuleList, nn.Module]:
        raise NotImplementedError

    def embed(self, idx: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...]]:
        raise NotImplementedError

    def init_weights(self, std: float, generator: torch.Generator) -> None:
        raise NotImplementedError

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def empty(cls, cfg: Any, device: torch.device | str, dtype: torch.dtype) -> Self:
        """Parameters allocated but not initialised (no wasted default init on big shapes)."""
        with torch.device("meta"):
            model = cls(cfg)
        return materialise(model, device, dtype)  # type: ignore[return-value]  # ties kept

    @classmethod
    def random(
        cls,
        cfg: Any,
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        std: float = 0.02,
    ) -> Self:
        """Seeded random weights with the real shapes, drawn by the family's ``init_weights``.

        ``std`` is the family's 0.02; tests raise it so that a tiny random model's predictions
        are peaked and varied enough for a wrong cache to change the tokens.
        """
        model = cls.empty(cfg, device, dtype)
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            model.init_weights(std, gen)
        return model.eval()

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # a tied weight counted once

    # -- forward -------------------------------------------------------------------------------
    def forward(
        self,
        idx: torch.Tensor,
        cache: KVCache | None = None,
        *,
        use_cache: bool = True,
        logits: str | torch.Tensor = "all",
        attention: Attention | None = None,
        input_pos: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KVCache | None]:
        """Logits for the tokens in ``idx`` (B, T), and the cache holding everything so far.

        Positions: ``input_pos`` (T,) when given; otherwise the new tokens follow the cache:
        ``cache.length + arange(T)`` (0..T-1 without a cache). The new keys and values are
        appended at ``cache.length`` either way.
        ``use_cache=False`` with no cache runs a plain forward and returns ``None`` for the cache.
        ``logits="last"`` applies the output projection to the last position only; a (R,) long
        tensor, to those rows of the T (a batched step of several sequences laid end to end:
        each sequence's last token).
        ``attention`` is the causal-mask variant (``engine.models.attention``; default: fused,
        no mask).
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must be a (batch, tokens) tensor, got shape {tuple(idx.shape)}")
        B, T = idx.shape
        past = cache.length if cache is not None else 0
        limit = self.config.block_size
        if T == 0:
            raise ValueError("idx holds no tokens; pass at least one token per sequence")
        if input_pos is None and past + T > limit:  # (given positions are checked one by one)
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

        blocks, final_norm = self.trunk()
        x, extra = self.embed(idx, pos)  # (B, T, C)
        for layer, block in enumerate(blocks):
            x = block(x, layer, cache, attend, past, *extra)
        if cache is not None:
            cache.advance(T)
        x = final_norm(x)
        if isinstance(logits, torch.Tensor):
            x = x[:, logits]  # (B, R, C): the rows whose next token is wanted
        elif logits == "last":
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
