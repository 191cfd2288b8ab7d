"""The KV caches behind one interface, and ``make_cache``.

  contiguous  ``ConcatKVCache`` (grows by ``torch.cat``: the write-up's) and ``PreallocKVCache``
              (sized once, written in place: what the one-token steps and CUDA graphs need)
  paged       ``PagedKVCache``: fixed-size blocks of a shared pool, a block table per sequence
  quantized   ``QuantizedKVCache``: rows stored as int8 (a scale per token and head), fp16 or
              bf16, read back in the model's dtype
A cache that reuses what other requests computed (a prefix cache over paged blocks) belongs here
too, beside the paged one it would extend.

``make_cache(kind, model, batch_size, capacity)`` builds any kind of ``CACHE_KINDS`` sized for a
model's shapes, on its device and in its dtype. Every cache exposes what attention uses:
  ``cache.length``              tokens already cached (positions 0..length-1)
  ``cache.update(layer, k, v)`` store the new keys/values (B, n_kv, T_new, hs) after the old
                                 ones and return all keys/values so far, old first
  ``cache.advance(T_new)``      called once per forward, after every layer has updated
  ``cache.crop(length)``        forget everything from ``length`` on (for re-using a prefill)
Time runs along dim 2, oldest first: the mask slice and the positions depend on it. A cache
holds ``cfg.n_kv_head`` heads: GPT-2's every head, a GQA model's fewer (SmolLM2: 3 for its 9
query heads), never copies repeated per query head -- attention reads each K/V head for its
whole group (``engine.models.attention``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..models.config import ModelConfig
from .contiguous import ConcatKVCache, KVCache, PreallocKVCache

# cache kind -> storage dtype of the quantized cache (engine.cache.quantized.QuantizedKVCache)
QUANTIZED_KINDS = {"kv_int8": "int8", "kv_float16": "float16", "kv_bfloat16": "bfloat16"}
CACHE_KINDS = ("prealloc", "concat", "paged", *QUANTIZED_KINDS)


class Shaped(Protocol):
    """What a cache is sized from: a model's shapes, device and dtype (a ``GPT``, a ``Llama``)."""

    @property
    def config(self) -> ModelConfig: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...


def make_cache(kind: str, model: Shaped, batch_size: int = 1,
               capacity: int | None = None) -> KVCache:
    """An empty cache of ``kind`` for ``batch_size`` sequences of ``model``; ``capacity`` tokens
    (default: the model's limit) for the kinds sized once (all but "concat"). Each layer holds
    ``cfg.n_kv_head`` heads (fewer than the query heads under GQA)."""
    cfg = model.config
    cap = cfg.block_size if capacity is None else capacity
    shape = (cfg.n_layer, batch_size, cfg.n_kv_head, cap, cfg.head_dim)
    if kind == "concat":
        return ConcatKVCache(cfg.n_layer)
    if kind == "prealloc":
        return PreallocKVCache(*shape, device=model.device, dtype=model.dtype)
    if kind == "paged":
        from .paged import PagedKVCache  # noqa: PLC0415 (rarely used)

        return PagedKVCache(*shape, device=model.device, dtype=model.dtype)
    if kind in QUANTIZED_KINDS:
        from .quantized import QuantizedKVCache  # noqa: PLC0415 (rarely used)

        return QuantizedKVCache(*shape, storage=QUANTIZED_KINDS[kind],
                                device=model.device, dtype=model.dtype)
    raise ValueError(f"unknown cache kind {kind!r}; allowed: {', '.join(CACHE_KINDS)}")
