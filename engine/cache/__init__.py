"""KV reuse across requests: a prefix cache of reference-counted KV blocks under a radix tree.

Contract: ``PrefixCache(model, budget_bytes, block_tokens=16)`` (``engine.cache.prefix``) holds
the K/V rows of prompts it has seen in a ``BlockPool`` (``engine.cache.blocks``) of
``budget_bytes // block_bytes`` blocks, on the model's device and in its dtype, for any family
whose ``forward(idx, cache, logits=...)`` writes a cache through ``length`` / ``update`` /
``advance`` (GPT-2, the Llama family). Serving one request:

  hit = cache.lookup(ids)                  longest cached prefix (at most len(ids) - 1 tokens)
  req = cache.admit(ids, max_new, hit)     shares the hit's blocks, copies the block where it
                                           diverges, takes its own for the rest (LRU leaves are
                                           evicted to make room; ``BudgetError`` / ValueError
                                           before anything is touched when it cannot fit)
  logits = req.prefill(model)              computes only the uncached tokens (exact: the same
                                           logits as a full prefill within fp32 rounding)
  tokens = req.greedy(model, logits, n)    or ``req.step(model, token)``
  cache.finish(req) | cache.cancel(req)    leave its rows to the tree | drop them

``cache.check()`` raises ``InvariantError`` on any inconsistency (``engine.cache.invariants``);
``cache.snapshot()`` and ``cache.events`` are the tree and its evictions as rows. The engine
measures nothing: ``instruments/experiments/prefix_*.py`` time it. Names load on first use, so
importing this package does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BlockPool": "blocks", "PoolExhausted": "blocks",
    "PrefixCache": "prefix", "Hit": "prefix", "Node": "prefix", "BudgetError": "prefix",
    "InvariantError": "invariants",
    "Request": "request", "RequestCancelled": "request",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine.cache' has no attribute {name!r}")
    return getattr(importlib.import_module(f"engine.cache.{_EXPORTS[name]}"), name)
