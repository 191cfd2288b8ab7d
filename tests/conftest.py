"""Shared fixtures: small lively models, and the offline tokenizer cache when it exists."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine import GPT, GPTConfig
from instruments.spine import Loaded, ModelSpec

_SHARED_TOKENIZER = Path(__file__).resolve().parents[2] / "shared/gpt2_tokenizer/tiktoken_cache"
if "TIKTOKEN_CACHE_DIR" not in os.environ and _SHARED_TOKENIZER.is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(_SHARED_TOKENIZER)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

SMALL = dict(n_layer=2, n_head=4, n_embd=64, block_size=256, vocab_size=512)


def small_model(mask: str = "none", seed: int = 1, **shape: int) -> GPT:
    """A tiny model whose random weights are large enough to give varied greedy tokens."""
    cfg = GPTConfig(**{**SMALL, **shape, "mask": mask})
    return GPT.random(cfg, seed=seed, std=0.2)


def random_prompt(n: int, batch: int = 1, vocab: int = 512, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def model() -> GPT:
    return small_model()


def loaded_model(model: GPT, name: str = "tiny") -> Loaded:
    """A model as the measuring process holds it (what every experiment's run takes)."""
    dtype = str(model.dtype).removeprefix("torch.")
    return Loaded(model, ModelSpec(name, "random", str(model.device), dtype),
                  {"weights_label": model.weights_label})
