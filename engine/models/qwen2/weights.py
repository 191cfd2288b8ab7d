"""Getting weights into our Qwen2: a checkpoint's (its folder, read by
``engine.models.checkpoint`` under the Llama's names), or random; and the reference.

  read(preset, weights, ...)      WeightsError: Qwen2 has no weights of its own to fetch
                                  (a checkpoint's path is the model, or random weights)
  checkpoint_names / from_checkpoint   the Llama family's (transformers' names, as stored)
  to_transformers(model)          a ``Qwen2ForCausalLM`` holding our weights (the reference)
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..llama.weights import checkpoint_names, from_checkpoint, hf_copy
from ..loader import WeightsError

__all__ = ["checkpoint_names", "from_checkpoint", "read", "to_transformers"]


def read(preset: Any, weights: str, **_: Any) -> tuple[nn.Module, str, None]:
    raise WeightsError(f"Qwen2 has no weights {weights!r} to fetch; allowed: a checkpoint's "
                       "path as the model, or random weights")


def to_transformers(model: nn.Module) -> nn.Module:
    """A ``transformers`` ``Qwen2ForCausalLM`` holding our model's weights, on the CPU in the
    model's dtype, with eager attention."""
    from transformers import Qwen2Config as HFConfig
    from transformers import Qwen2ForCausalLM

    return hf_copy(model, HFConfig, Qwen2ForCausalLM, use_sliding_window=False)

