"""GPT-2's byte-level BPE through tiktoken's ``gpt2`` encoding.

``get_tokenizer()`` returns the encoding or raises ``TokenizerError`` saying how to make the
files available (internet once, or ``TIKTOKEN_CACHE_DIR`` pointing at a folder holding them).
``for_config(cfg)`` is the GPT-2 family's tokenizer object (``engine.families.tokenizer``),
picked by the model's vocabulary: a model of ``BYTE_VOCAB`` (256) tokens reads text as UTF-8
bytes (the small model trained for the tests, ``tests/fixtures/bytes_stdlib``); any other,
GPT-2's BPE. Every family's tokenizer has the same surface: ``encode(text)``, ``decode(ids)``,
``decode_each(ids)`` (one string per token), ``chat(user_text)`` (the prompt with the model's
chat template; ValueError where it has none), ``chat_template``, ``eos_id``, ``name``.
``bpe_table()`` is the BPE as a vocabulary file writes it (tokens, merges): what a GGUF file of
GPT-2 carries for llama.cpp (``engine.models.gpt2.weights.gguf_layout``).
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
VOCAB = 50257  # GPT-2's: 256 bytes, 50,000 merges, <|endoftext|>


class GPT2Tokenizer:
    """GPT-2's byte-level BPE (tiktoken) behind the one tokenizer surface every family offers
    (``engine.families.tokenizer``): ``encode``, ``decode``, ``decode_each``, ``chat``."""

    name = "GPT-2 BPE (tiktoken)"
    eos_id: int | None = 50256
    chat_template = False  # GPT-2 was not trained on chats

    def __init__(self, vocab_size: int = VOCAB) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        ids = encode(text)
        if ids and max(ids) >= self.vocab_size:
            raise ValueError(f"the text has GPT-2 token {max(ids)}, outside this model's "
                             f"vocabulary of {self.vocab_size}; allowed: a GPT-2-vocabulary "
                             f"model, or one of {BYTE_VOCAB} byte tokens")
        return ids

    def decode(self, ids: list[int]) -> str:
        return text_or_ids(ids)

    def decode_each(self, ids: list[int]) -> list[str]:
        return decode_each(ids)

    def chat(self, user_text: str) -> str:
        raise ValueError("GPT-2 has no chat template; allowed: plain prompts")


class ByteTokenizer:
    """Text as its UTF-8 bytes: the 256-token vocabulary of the small model trained for the tests
    (``tests/fixtures/bytes_stdlib``); no files needed."""

    name = "UTF-8 bytes"
    eos_id: int | None = None
    chat_template = False

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def decode_each(self, ids: list[int]) -> list[str]:
        return [bytes([i]).decode("utf-8", errors="replace") for i in ids]

    def chat(self, user_text: str) -> str:
        raise ValueError("a byte-level model has no chat template; allowed: plain prompts")


def for_config(cfg: object) -> GPT2Tokenizer | ByteTokenizer:
    """The GPT-2 family's tokenizer for a model of ``cfg``: bytes for a 256-token vocabulary,
    GPT-2's BPE otherwise (``engine.families``' ``tokenizer`` for GPT-2)."""
    vocab = int(cfg.vocab_size)  # type: ignore[attr-defined]
    return ByteTokenizer() if vocab == BYTE_VOCAB else GPT2Tokenizer(vocab)


EOT = "<|endoftext|>"


def _bpe(ranks: dict[bytes, int], word: bytes, below: int) -> list[bytes]:
    """``word`` merged as BPE would, using only merges of rank < ``below``."""
    parts = [bytes([b]) for b in word]
    while len(parts) > 1:
        pairs = [(ranks.get(parts[i] + parts[i + 1], below), i) for i in range(len(parts) - 1)]
        rank, i = min(pairs)
        if rank >= below:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


@functools.lru_cache(maxsize=1)
def bpe_table() -> tuple[list[str], list[str]] | None:
    """(tokens, merges) of GPT-2's BPE from tiktoken (None without its files). tiktoken keeps
    ranks, not merges: the merge that made token r is the pair BPE reaches using the merges
    ranked below r (one pair for every multi-byte token)."""
    try:
        ranks: dict[bytes, int] = dict(get_tokenizer()._mergeable_ranks)  # tiktoken's own table
    except Exception:  # no tokenizer files: the writer falls back to placeholder tokens
        return None
    if len(ranks) != VOCAB - 1:
        return None
    from ..tokens import byte_chars  # byte-level BPE's spelling of bytes, every family's

    chars = byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    tokens = [text(b) for b, _ in by_rank] + [EOT]
    merges = []
    for word, rank in by_rank:
        if len(word) > 1:
            left, right = _bpe(ranks, word, rank)
            merges.append(f"{text(left)} {text(right)}")
    return tokens, merges
