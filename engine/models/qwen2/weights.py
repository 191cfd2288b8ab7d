"""Getting weights into our Qwen2: a checkpoint's (its folder, read by
``engine.models.checkpoint`` under the Llama's names), or random; and the reference.

  checkpoint_names / from_checkpoint   the Llama family's (transformers' names, as stored)
  gguf_config / gguf_param / gguf_rows  a ``qwen2`` GGUF file: the Llama's names and keys
                                  (under "qwen2."), its q/k rows as stored
  to_transformers(model)          a ``Qwen2ForCausalLM`` holding our weights (the reference)
  gguf_layout(model)              the Llama's, as llama.cpp's ``qwen2`` architecture: q/k rows
                                  as they are, and the q/k/v biases
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..gguf import GGUFFile, GGUFLayout
from ..llama.weights import checkpoint_names, from_checkpoint, gguf_param, hf_copy
from ..llama.weights import gguf_config as llama_gguf_config
from ..llama.weights import gguf_layout as llama_gguf_layout
from .config import Qwen2Config

__all__ = ["checkpoint_names", "from_checkpoint", "gguf_config", "gguf_layout", "gguf_param",
           "gguf_rows", "to_transformers"]


def gguf_config(f: GGUFFile, mask: str = "none") -> Qwen2Config:
    """The config a ``qwen2`` GGUF file's metadata describes (the Llama's keys under
    "qwen2.")."""
    return llama_gguf_config(f, mask, arch="qwen2", config=Qwen2Config)


def gguf_rows(name: str, value: Any, cfg: Any) -> Any:
    """A GGUF tensor's rows, as they are: llama.cpp's converter keeps Qwen2's q/k in
    transformers' order (its RoPE is NEOX's, rotate_half)."""
    return value


def gguf_layout(model: nn.Module, vocabulary: bool = True) -> GGUFLayout:
    """``model`` as llama.cpp's ``qwen2`` architecture (the inverse of ``gguf_rows``: its q/k
    rows as they are), with the q/k/v biases."""
    return llama_gguf_layout(model, vocabulary, arch="qwen2", qkv_bias=True, permute=False)


def to_transformers(model: nn.Module) -> nn.Module:
    """A ``transformers`` ``Qwen2ForCausalLM`` holding our model's weights, on the CPU in the
    model's dtype, with eager attention."""
    from transformers import Qwen2Config as HFConfig
    from transformers import Qwen2ForCausalLM

    return hf_copy(model, HFConfig, Qwen2ForCausalLM, use_sliding_window=False)

