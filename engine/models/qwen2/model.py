"""Qwen2, written from scratch: ``Qwen2``, the Llama (``engine.models.llama.model``) with biases
on its q, k and v projections. Parameter names are ``Qwen2ForCausalLM``'s (the Llama's, plus
``self_attn.{q,k,v}_proj.bias``)."""

from __future__ import annotations

import torch.nn as nn

from ..llama.model import Llama
from .config import Qwen2Config


class Qwen2(Llama):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__(cfg)
        for block in self.model.layers:  # each in its own place: parameter order kept
            attn = block.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(attn, name)
                setattr(attn, name, nn.Linear(old.in_features, old.out_features, bias=True))
