"""GPT-2's byte-level BPE through tiktoken's ``gpt2`` encoding.

``get_tokenizer()`` returns the encoding or raises ``TokenizerError`` saying how to make the
files available (internet once, or ``TIKTOKEN_CACHE_DIR`` pointing at a folder holding them).
"""

from __future__ import annotations

import functools
import os


class TokenizerError(RuntimeError):
    """The GPT-2 tokenizer files could not be found or downloaded."""


@functools.lru_cache(maxsize=1)
def get_tokenizer():  # -> tiktoken.Encoding
    try:
        import tiktoken

        return tiktoken.get_encoding("gpt2")
    except Exception as exc:  # tiktoken raises requests/OS/value errors depending on the cause
        where = os.environ.get("TIKTOKEN_CACHE_DIR", "(TIKTOKEN_CACHE_DIR not set)")
        raise TokenizerError(
            "The GPT-2 tokenizer files (encoder.json, vocab.bpe) could not be loaded: "
            f"{type(exc).__name__}: {exc}. tiktoken downloads them once when online; offline, "
            "set TIKTOKEN_CACHE_DIR to a folder that holds its cached copies "
            f"(currently {where})."
        ) from exc


def encode(text: str) -> list[int]:
    return get_tokenizer().encode(text, allowed_special={"<|endoftext|>"})


def decode(ids: list[int]) -> str:
    return get_tokenizer().decode(ids)


def text_or_ids(ids: list[int]) -> str:
    """The decoded text, or the ids themselves when the tokenizer files are unavailable."""
    try:
        return decode(ids)
    except TokenizerError:
        return " ".join(map(str, ids))


def decode_each(ids: list[int]) -> list[str]:
    """One string per token (partial UTF-8 bytes shown with replacement characters)."""
    enc = get_tokenizer()
    return [enc.decode_single_token_bytes(i).decode("utf-8", errors="replace") for i in ids]
