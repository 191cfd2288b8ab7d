"""KV Cache Lab's engine: from-scratch models (GPT-2, the Llama family) with their KV caches, and
the one decode loop.

A plain library: the family table (``families``), the models, the caches, the causal-mask
variants, weights loading, the tokenizers, the decode modes (``modes``: one ``ModeSpec`` each),
the decoders (one module per way of stepping), the one decode step of modes 6-9 and 12-13, the
loop that runs them, and ``ModelState`` (everything built on one model besides its weights). It
measures nothing and imports nothing of ``instruments`` or the UI. The public names below are
loaded on first use, so that the torch-free modules (``config``, ``families``, ``modes``,
``dtypes``, ``tokenizer``) can be imported without importing torch.
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
    "WeightsError": "models.gpt2.weights", "load": "families",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"engine.{_EXPORTS[name]}"), name)
