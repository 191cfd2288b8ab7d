"""Qwen2's shapes: ``Qwen2Config``, the Llama's with biases on q, k and v. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import LlamaConfig


@dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    """A Llama's shapes whose q, k and v projections carry biases (Qwen2's)."""

    family = "qwen2"
    # transformers' Qwen2Config defaults for a field config.json leaves out
    HF_DEFAULTS = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                   "rope_theta": 10000.0, "tie_word_embeddings": False}

    def matrices(self) -> list[tuple[str, int, int, bool]]:
        """The Llama's Linears, q, k and v with a bias."""
        return [(role, out, inn, role.split(".")[-1] in ("q_proj", "k_proj", "v_proj"))
                for role, out, inn, _ in super().matrices()]

    def other_params(self) -> int:
        """The Llama's, and the q, k, v biases of every layer."""
        biases = sum(out for _, out, _, bias in self.matrices() if bias)
        return super().other_params() + self.n_layer * biases

    @classmethod
    def from_hf(cls, fields: dict[str, Any], mask: str = "none") -> Qwen2Config:
        """The config a ``Qwen2ForCausalLM`` config.json describes; ValueError for its sliding
        window, which our Qwen2 does not apply."""
        if fields.get("use_sliding_window", False):
            raise ValueError("use_sliding_window true; allowed: false (full attention)")
        return cls(**cls.hf_fields(fields, mask))
