"""The KV caches behind one interface, and ``make_cache``; the prefix cache that reuses KV rows
across requests.

  contiguous  ``ConcatKVCache`` (grows by ``torch.cat``: the write-up's) and ``PreallocKVCache``
              (sized once, written in place: what the one-token steps and CUDA graphs need)
  paged       ``PagedKVCache``: fixed-size blocks of a shared pool, a block table per sequence
  quantized   ``QuantizedKVCache``: rows stored as int8 (a scale per token and head), fp16 or
              bf16, read back in the model's dtype
  prefix      ``PrefixCache``: a radix tree of token ids over reference-counted blocks of a
              ``BlockPool`` (``blocks``), serving ``Request`` objects (``request``), checked by
              ``invariants``

``make_cache(kind, model, batch_size, capacity, reads=None)`` builds any kind of ``CACHE_KINDS``
sized for a model's shapes, on its device and in its dtype. Every cache exposes what attention uses:
  ``cache.length``              tokens already cached (positions 0..length-1)
  ``cache.update(layer, k, v)`` store the new keys/values (B, n_kv, T_new, hs) after the old
                                 ones and return all keys/values so far, old first
  ``cache.advance(T_new)``      called once per forward, after every layer has updated
  ``cache.crop(length)``        forget everything from ``length`` on (for re-using a prefill)
A cache that reads itself in place (the paged cache on a GPU) also has
  ``cache.attends(q)``            whether it takes these queries' attention itself
  ``cache.attend(layer, q, k, v)`` the new rows' write and their attention in one call
(``engine.models.attention.through_cache`` asks the one and calls the other).
Time runs along dim 2, oldest first: the mask slice and the positions depend on it. A cache
holds ``cfg.n_kv_head`` heads: GPT-2's every head, a GQA model's fewer (SmolLM2: 3 for its 9
query heads), never copies repeated per query head -- attention reads each K/V head for its
whole group (``engine.models.attention``).

The prefix cache: ``PrefixCache(model, budget_bytes, block_tokens=16)`` holds the K/V rows of
prompts it has seen in ``budget_bytes // block_bytes`` blocks, on the model's device and in its
dtype, for any family whose ``forward(idx, cache, logits=...)`` writes a cache through
``length`` / ``update`` / ``advance`` (GPT-2, the Llama family). Serving one request:

  hit = cache.lookup(ids)                  longest cached prefix (at most len(ids) - 1 tokens)
  req = cache.admit(ids, max_new, hit)     shares the hit's blocks, copies the block where it
                                           diverges, takes its own for the rest (LRU leaves are
                                           evicted to make room; ``BudgetError`` / ValueError
                                           before anything is touched when it cannot fit)
  logits = req.prefill(model)              computes only the uncached tokens (exact: the same
                                           logits as a full prefill within fp32 rounding)
  tokens = req.greedy(model, logits, n)    or ``req.step(model, token)``
  cache.finish(req) | cache.cancel(req)    leave its rows to the tree | drop them

``cache.check()`` raises ``InvariantError`` on any inconsistency; ``cache.snapshot()`` and
``cache.events`` are the tree and its evictions as rows. The engine measures nothing:
``instruments/experiments/prefix_*.py`` time it. The prefix cache's names load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import torch

from .contiguous import ConcatKVCache, KVCache, PreallocKVCache

# cache kind -> storage dtype of the quantized cache (engine.cache.quantized.QuantizedKVCache)
QUANTIZED_KINDS = {"kv_int8": "int8", "kv_float16": "float16", "kv_bfloat16": "bfloat16"}
CACHE_KINDS = ("prealloc", "concat", "paged", *QUANTIZED_KINDS)

# the prefix cache's names -> their module here, imported on first use
_PREFIX_EXPORTS = {
    "BlockPool": "blocks", "PoolExhausted": "blocks",
    "PrefixCache": "prefix", "Hit": "prefix", "Node": "prefix", "BudgetError": "prefix",
    "InvariantError": "invariants",
    "Request": "request", "RequestCancelled": "request",
}


class Shaped(Protocol):
    """What a cache is sized from: a model's shapes, device and dtype (a ``GPT``, a ``Llama``)."""

    @property
    def config(self) -> Any: ...  # shapes only; a ModelConfig (the model room, above this one)
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...


def make_cache(kind: str, model: Shaped, batch_size: int = 1,
               capacity: int | None = None, *, reads: str | None = None) -> KVCache:
    """An empty cache of ``kind`` for ``batch_size`` sequences of ``model``; ``capacity`` tokens
    (default: the model's limit) for the kinds sized once (all but "concat"). Each layer holds
    ``cfg.n_kv_head`` heads (fewer than the query heads under GQA). ``reads``: how a paged or
    quantized cache is read ("gather" | "in_place", ``engine.cache.paged``; None: its device's
    default)."""
    if reads is not None and kind != "paged" and kind not in QUANTIZED_KINDS:
        raise ValueError(f"only a paged or quantized cache is read in more than one way; "
                         f"{kind!r} is not")
    cfg = model.config
    cap = cfg.block_size if capacity is None else capacity
    shape = (cfg.n_layer, batch_size, cfg.n_kv_head, cap, cfg.head_dim)
    if kind == "concat":
        return ConcatKVCache(cfg.n_layer)
    if kind == "prealloc":
        return PreallocKVCache(*shape, device=model.device, dtype=model.dtype)
    if kind == "paged":
        from .paged import PagedKVCache  # noqa: PLC0415 (rarely used)

        return PagedKVCache(*shape, device=model.device, dtype=model.dtype, reads=reads)
    if kind in QUANTIZED_KINDS:
        from .quantized import QuantizedKVCache  # noqa: PLC0415 (rarely used)

        return QuantizedKVCache(*shape, storage=QUANTIZED_KINDS[kind],
                                device=model.device, dtype=model.dtype, reads=reads)
    raise ValueError(f"unknown cache kind {kind!r}; allowed: {', '.join(CACHE_KINDS)}")


def __getattr__(name: str) -> Any:
    if name not in _PREFIX_EXPORTS:
        raise AttributeError(f"module 'engine.cache' has no attribute {name!r}")
    return getattr(importlib.import_module(f"engine.cache.{_PREFIX_EXPORTS[name]}"), name)
