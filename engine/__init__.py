"""KV Cache Lab's engine: a from-scratch GPT-2 with a KV cache, and the instruments around it.

A plain library (no streamlit). The public names other code relies on are exported here.
"""

from .config import PRESETS, GPTConfig
from .generate import Generation, TokenEvent, generate, generate_detailed
from .kv_cache import ConcatKVCache, PreallocKVCache
from .model import GPT
from .weights import WeightsError, load_model

__all__ = [
    "PRESETS",
    "ConcatKVCache",
    "GPT",
    "GPTConfig",
    "Generation",
    "PreallocKVCache",
    "TokenEvent",
    "WeightsError",
    "generate",
    "generate_detailed",
    "load_model",
]
