"""GPT-2's byte-level BPE through tiktoken's ``gpt2`` encoding.

``get_tokenizer()`` returns the encoding or raises ``TokenizerError`` saying how to make the
files available (internet once, or ``TIKTOKEN_CACHE_DIR`` pointing at a folder holding them).
``encode_for(text, vocab_size)`` / ``decode_for(ids, vocab_size)`` pick by the model's
vocabulary: a model of ``BYTE_VOCAB`` (256) tokens reads text as UTF-8 bytes (the small model
trained for the tests, ``tests/fixtures/bytes_stdlib``); any other, GPT-2's BPE.
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


BYTE_VOCAB = 256  # a vocabulary of bytes: text is its UTF-8 encoding, no tokenizer files


def encode_for(text: str, vocab_size: int) -> list[int]:
    """``text`` as the ids a model of ``vocab_size`` tokens reads (bytes, or GPT-2's BPE)."""
    if vocab_size == BYTE_VOCAB:
        return list(text.encode("utf-8"))
    ids = encode(text)
    if ids and max(ids) >= vocab_size:
        raise ValueError(f"the text has GPT-2 token {max(ids)}, outside this model's "
                         f"vocabulary of {vocab_size}; allowed: a GPT-2-vocabulary model, or "
                         f"one of {BYTE_VOCAB} byte tokens")
    return ids


def decode_for(ids: list[int], vocab_size: int) -> str:
    """The text of ``ids`` for a model of ``vocab_size`` tokens (see ``encode_for``)."""
    if vocab_size == BYTE_VOCAB:
        return bytes(ids).decode("utf-8", errors="replace")
    return text_or_ids(ids)
