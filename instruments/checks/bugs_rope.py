"""The silent bugs of a model with rotary positions (the family table's ``positions="rope"``:
the Llama family's, Qwen2's, Mistral's), for the checks to catch: RoPE's and GQA's (every such
family shares K/V heads). (The write-up's three, in every family, and how any bug is switched
on: ``instruments.checks.bugs``.)

Each is a ``Wrap`` of ``instruments.checks.bugs`` -- ``wrap(cfg, attn, cache, attend, offset)
-> (cache, attend, offset)``, what every block's ``self_attn`` then sees around the engine's own
``forward`` (a RoPE family's attention module, e.g. the Llama family's):

  rope_twice   the keys read back from the cache are rotated again, as if the cache held them
               unrotated -- every cached key turned a second time
  gqa_mapping  query head h reads K/V head h % n_kv_head (the cache tiled with ``repeat``)
               instead of h // groups (``repeat_interleave``: each K/V head serves a run of
               consecutive query heads)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from engine.cache import KVCache
from engine.models.attention import Attention
from engine.models.rope import apply_rope, rope_angles


class _RotatedAgain:
    """A cache whose keys come back rotated once more, at positions 0..S-1."""

    def __init__(self, cache: KVCache, theta: float) -> None:
        self.cache, self.theta = cache, theta

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.cache.update(layer, k, v)
        pos = torch.arange(keys.size(2), device=keys.device)
        cos, sin = rope_angles(pos, keys.size(-1), self.theta, keys.dtype)
        return apply_rope(keys, cos, sin), values


def rotated_twice(cfg: Any, attn: nn.Module, cache: KVCache | None, attend: Attention,
                  offset: int) -> tuple[KVCache | None, Attention, int]:
    """rope_twice: every key read back from the cache is turned by RoPE once more."""
    return (None if cache is None else _RotatedAgain(cache, cfg.rope_theta),  # type: ignore
            attend, offset)


def tiled_heads(cfg: Any, attn: nn.Module, cache: KVCache | None, attend: Attention,
                offset: int) -> tuple[KVCache | None, Attention, int]:
    """gqa_mapping: the K/V heads tiled (``repeat``), so query head h reads K/V head
    h % n_kv_head."""
    groups = cfg.n_head // cfg.n_kv_head

    def tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
              offset: int) -> torch.Tensor:
        # (B, n_kv, S, hs) -> (B, nh, S, hs) with head h = K/V head h % n_kv
        return attend(q, k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1), layer, offset)

    return cache, tiled, offset  # type: ignore[return-value]


WRAPS = {"rope_twice": rotated_twice, "gqa_mapping": tiled_heads}
