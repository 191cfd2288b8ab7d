"""KV Cache Lab's engine: from-scratch models (four families, each behind one door) with their KV
caches, and the one decode loop.

A plain library, one room per kind of thing, in the order a token meets them:
  models/    the families (``gpt2/``, ``llama/``, ``qwen2/``, ``mistral/``: model, weights, one-
             token step, ...) and what they share (the model skeleton, loading, checkpoints and
             GGUF files, attention, ``ModelState``)
  cache/     the KV caches (contiguous, paged, quantized) behind one interface; the prefix cache
             (a radix tree over reference-counted blocks, shared across requests)
  decoders/  one module per way of stepping, all with the same calls; speculative decoding
  quant/     the weight formats of the lossy rungs (int8 / bf16 rows, GGUF blocks)
  kernels/   ours: ``cpu/`` (C++, built once per machine) and ``gpu/`` (Triton)
and the spine: ``families`` (the family table) with ``checkpoints`` (a path as a model),
``modes`` (the mode table: one ``ModeSpec``
each), ``loop`` (the one decode loop), ``dtypes``. It measures nothing and imports nothing of
``instruments`` or the UI. The public names below are loaded on first use, so that the
torch-free modules (``families``, ``modes``, ``dtypes``, ``models.config``,
``models.gpt2.tokenizer``) can be imported without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "GPTConfig": "models.config", "LlamaConfig": "models.config",
    "Decoder": "decoders", "make_decoder": "decoders",
    "Generation": "loop", "Step": "loop", "decode": "loop", "generate": "loop",
    "ConcatKVCache": "cache", "PreallocKVCache": "cache", "make_cache": "cache",
    "make_attention": "models.attention",
    "GPT": "models.gpt2.model",
    "ModelState": "models.state", "Provenance": "models.state",
    "WeightsError": "models.loader", "load": "families",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"engine.{_EXPORTS[name]}"), name)
