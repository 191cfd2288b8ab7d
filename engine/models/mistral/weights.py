"""Getting weights into our Mistral: a checkpoint's (its folder, read by
``engine.models.checkpoint`` under the Llama's names), or random; and the reference.

  checkpoint_names / from_checkpoint   the Llama family's (transformers' names, as stored)
  to_transformers(model)          a ``MistralForCausalLM`` holding our weights (the reference),
                                  its sliding window ours
"""

from __future__ import annotations

import torch.nn as nn

from ..llama.weights import checkpoint_names, from_checkpoint, hf_copy

__all__ = ["checkpoint_names", "from_checkpoint", "to_transformers"]


def to_transformers(model: nn.Module) -> nn.Module:
    """A ``transformers`` ``MistralForCausalLM`` holding our model's weights, on the CPU in the
    model's dtype, with eager attention and our sliding window."""
    from transformers import MistralConfig as HFConfig
    from transformers import MistralForCausalLM

    return hf_copy(model, HFConfig, MistralForCausalLM, sliding_window=model.config.window)
