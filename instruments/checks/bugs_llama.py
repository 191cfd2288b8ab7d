"""The silent bugs of a Llama-family KV cache, switched on for the checks to catch: the write-up's
three as they look in a model with rotary positions, and two of its own (RoPE and GQA).

Each is a subclass of an ``engine.models.llama.model`` module overriding ``forward`` only, swapped
into a ``instruments.checks.bugs.private_view`` of the model (``modules(model, kind)`` says which
modules take which broken class; ``instruments.checks.bugs.inject_bug`` does the swap):

  positions    ``Llama``: every call rotates its tokens as positions 0, 1, ... whatever was
               cached (RoPE restarted at 0 for the new token)
  mask_offset  every ``self_attn``: attention is told no token was cached
  cache_order  every ``self_attn``: a concatenating cache gets the new keys/values first
  rope_twice   every ``self_attn``: the keys read back from the cache are rotated again, as if
               the cache held them unrotated -- every cached key turned a second time
  gqa_mapping  every ``self_attn``: query head h reads K/V head h % n_kv_head (the cache tiled
               with ``repeat``) instead of h // groups (``repeat_interleave``: each K/V head
               serves a run of consecutive query heads)
"""

from __future__ import annotations

import torch
import torch.nn as nn

from engine.cache import ConcatKVCache, KVCache
from engine.models.attention import Attention
from engine.models.llama.model import Llama, LlamaAttention, apply_rope, rope_angles


class RestartedRope(Llama):
    """positions: the new tokens are rotated as positions 0..T-1, whatever the cache holds."""

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, **kw: object
                ) -> tuple[torch.Tensor, KVCache | None]:
        if kw.get("input_pos") is None:
            kw["input_pos"] = torch.arange(idx.size(1), device=idx.device)
        return super().forward(idx, cache, **kw)  # type: ignore[arg-type]


class _NewFirst:
    """A concatenating cache seen through the write-up's first ``update``: new before old."""

    def __init__(self, cache: ConcatKVCache) -> None:
        self.cache = cache

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        old_k, old_v = c.k[layer], c.v[layer]
        if old_k is None or old_v is None:
            return c.update(layer, k, v)
        c.k[layer], c.v[layer] = torch.cat([k, old_k], dim=2), torch.cat([v, old_v], dim=2)
        return c.k[layer], c.v[layer]


class _Hooked(LlamaAttention):
    """``LlamaAttention.forward`` with the cache and the attention seen through ``wrap``."""

    def wrap(self, cache: KVCache | None, attend: Attention, offset: int
             ) -> tuple[KVCache | None, Attention, int]:
        return cache, attend, offset

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache | None, attend: Attention,
                offset: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cache, attend, offset = self.wrap(cache, attend, offset)
        return super().forward(x, layer, cache, attend, offset, cos, sin)


class UnshiftedMask(_Hooked):
    def wrap(self, cache: KVCache | None, attend: Attention, offset: int
             ) -> tuple[KVCache | None, Attention, int]:
        return cache, attend, 0


class NewKeysFirst(_Hooked):
    def wrap(self, cache: KVCache | None, attend: Attention, offset: int
             ) -> tuple[KVCache | None, Attention, int]:
        return (_NewFirst(cache) if isinstance(cache, ConcatKVCache) else cache,  # type: ignore
                attend, offset)


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


class RotatedTwice(_Hooked):
    theta = 10000.0  # set from the model's config when switched on

    def wrap(self, cache: KVCache | None, attend: Attention, offset: int
             ) -> tuple[KVCache | None, Attention, int]:
        return (None if cache is None else _RotatedAgain(cache, self.theta),  # type: ignore
                attend, offset)


class TiledHeads(_Hooked):
    def wrap(self, cache: KVCache | None, attend: Attention, offset: int
             ) -> tuple[KVCache | None, Attention, int]:
        groups = self.n_head // self.n_kv_head

        def tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                  offset: int) -> torch.Tensor:
            # (B, n_kv, S, hs) -> (B, nh, S, hs) with head h = K/V head h % n_kv
            return attend(q, k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1), layer, offset)

        return cache, tiled, offset  # type: ignore[return-value]


BROKEN: dict[str, type[nn.Module]] = {
    "mask_offset": UnshiftedMask, "cache_order": NewKeysFirst, "rope_twice": RotatedTwice,
    "gqa_mapping": TiledHeads,
}


def modules(model: Llama, kind: str) -> tuple[list[nn.Module], type[nn.Module]]:
    """The modules bug ``kind`` lives in, and the broken class they take."""
    if kind == "positions":
        return [model], RestartedRope
    attn = [block.self_attn for block in model.model.layers]
    if kind == "rope_twice":
        for a in attn:
            a.theta = model.config.rope_theta  # an instance attribute: read by the broken class
    return attn, BROKEN[kind]
