"""Qwen2's tokenizer: none here yet (its vocabulary of ~151k byte-level BPE tokens ships with
each checkpoint, not with the lab); prompts are token ids."""

from __future__ import annotations


def for_config(cfg: object) -> object:
    raise ValueError("a Qwen2 model has no tokenizer here; allowed: token-id prompts (the "
                     "latency, memory and gate experiments draw random ones)")
