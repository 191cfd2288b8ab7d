"""Mistral's shapes: ``MistralConfig``, the Llama's and a sliding window. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import LlamaConfig


@dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    """A Llama's shapes whose attention sees only the last ``window`` tokens (itself included;
    None: every token, as a Llama)."""

    window: int | None = 4096

    family = "mistral"
    # transformers' MistralConfig defaults for a field config.json leaves out
    HF_DEFAULTS = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                   "rope_theta": 10000.0, "tie_word_embeddings": False}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"MistralConfig.window must be a positive integer or None, got "
                             f"{self.window!r}")

    def cache_rows(self, tokens: int) -> int:
        """A cache holds the window's rows at most: memory is flat past it."""
        return tokens if self.window is None else min(tokens, self.window)

    @classmethod
    def from_hf(cls, fields: dict[str, Any], mask: str = "none") -> MistralConfig:
        """The config a ``MistralForCausalLM`` config.json describes (``sliding_window``: the
        window, null for none; transformers' default 4096 where it is absent)."""
        window = fields.get("sliding_window", 4096)
        return cls(**cls.hf_fields(fields, mask), window=None if window is None else int(window))
