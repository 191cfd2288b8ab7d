"""Mistral, written from scratch: ``Mistral``, the Llama (``engine.models.llama.model``) whose
attention sees only the last ``window`` tokens: query i reads keys j with i - window < j <= i
(transformers' sliding-window mask). Parameter names are ``MistralForCausalLM``'s (the Llama's).

Inside the window a forward attends as every family does (the mask variant it is given, over
whatever the cache returns). Past it, over the keys the cache returns -- the most recent ones,
oldest first: every row for the engine's caches, the window's and the new ones for the ring
(``engine.models.mistral.ring``) -- with a band mask computed from the positions.
"""

from __future__ import annotations

import torch

from ...cache.contiguous import KVCache
from ..attention import Attention, sdpa, through_cache
from ..llama.model import Llama, LlamaAttention
from .config import MistralConfig


def band(offset: int, new: int, keys: int, window: int, device: torch.device) -> torch.Tensor:
    """(new, keys) bool: query i (at position offset + i) may read key j (the keys are the
    last ``keys`` positions up to offset + new - 1, oldest first) when i - window < j <= i."""
    q_pos = torch.arange(offset, offset + new, device=device)[:, None]
    k_pos = torch.arange(offset + new - keys, offset + new, device=device)[None, :]
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


class MistralAttention(LlamaAttention):
    def __init__(self, cfg: MistralConfig) -> None:
        super().__init__(cfg)
        self.window = cfg.window

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache | None, attend: Attention,
                offset: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        T = q.size(2)
        if self.window is None or offset + T <= self.window:  # nothing has left the window
            return self.output(through_cache(attend, cache, q, k, v, layer, offset))
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, n_kv, S, hs): the last S keys, oldest first
        mask = band(offset, T, k.size(2), self.window, q.device)
        return self.output(sdpa(q, k, v, attn_mask=mask))  # (B, nh, T, hs)


class Mistral(Llama):
    def __init__(self, cfg: MistralConfig) -> None:
        super().__init__(cfg)
        for block in self.model.layers:  # in its own place: parameter order kept
            block.self_attn = MistralAttention(cfg)
