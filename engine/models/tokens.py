"""A checkpoint's own tokenizer: a Hugging Face folder's ``tokenizer.json``, or the one a GGUF file
stores, behind the surface every family's tokenizer has (``engine.families.tokenizer``).

  of_checkpoint(path, vocab_size)  the tokenizer the checkpoint at ``path`` holds (a folder's
                                   tokenizer.json + tokenizer_config.json; a GGUF file's
                                   tokenizer.ggml.*), or None where it holds none; read once
                                   per change of its files (``stamp``)
  folder_tokenizer(folder)         a folder's, as transformers' AutoTokenizer reads it;
                                   ``chat_template_in(folder)`` its chat template alone
  gguf_tokenizer(path, name)       a GGUF file's, built once and cached on disk (``build``)
  byte_chars()                     byte-level BPE's printable spelling of the 256 bytes
  TextTokenizer                    the object: ``encode(text)``, ``decode(ids)``,
                                   ``decode_each(ids)`` (one string per token), ``chat(user)``,
                                   ``chat_messages(messages)``, ``chat_template``, ``eos_id``,
                                   ``name``, ``vocab_size``

A folder's tokenizer encodes as ``tokenizer(text)`` does in transformers: the tokenizer.json's
post-processor adds what it adds (a Llama-3's BOS; nothing for Qwen2). A text that already opens
with the BOS token -- a chat template's rendering -- gets no second one, as ``apply_chat_template``
encodes it. Its chat template comes from tokenizer_config.json (or chat_template.jinja) and is
rendered in jinja2's sandbox with transformers' settings. A GGUF file's tokenizer is rebuilt
from its vocabulary and merges: byte-level BPE (``tokenizer.ggml.model`` "gpt2") with the
pre-tokenizers we know (``PRE``: SmolLM2's, GPT-2's, Qwen2's, Llama 3's, as llama.cpp splits
them); it adds BOS where the file says ``add_bos_token``.

Building a GGUF file's tokenizer (98k strings for SmolLM2) takes about a second, so the result is
cached: ``tokenizer.json`` + ``meta.json`` under ``$KVLAB_CACHE_DIR``, else
``$XDG_CACHE_HOME/kvlab``, else ``~/.cache/kvlab``, in a folder named by the file's name, size
and mtime (a changed file is rebuilt). An unwritable cache only costs the build next time.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

CACHE_FORMAT = 2  # bump when what is built changes: older caches are then ignored
_CONTROL = 3  # tokenizer.ggml.token_type of a control token
# GGUF pre-tokenizers rebuilt here (llama.cpp's ``tokenizer.ggml.pre`` names, its regexes): a
# split before the byte-level step, or none (GPT-2's own regex, in ByteLevel)
_DIGITS = "digits"  # every digit on its own, then GPT-2's regex (SmolLM2's, llama.cpp "\\p{N}")
_WORDS = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|NUMBERS| ?[^\s\p{L}\p{N}]+"
          r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE: dict[str, str | None] = {
    "smollm": _DIGITS, "starcoder": _DIGITS, "gpt-2": None,
    "qwen2": _WORDS.replace("NUMBERS", r"\p{N}"),  # one digit a piece
    "llama-bpe": _WORDS.replace("NUMBERS", r"\p{N}{1,3}"),  # Llama 3's: up to three digits
}


def cache_root() -> Path:
    if os.environ.get("KVLAB_CACHE_DIR"):
        return Path(os.environ["KVLAB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvlab"


def byte_chars() -> dict[int, str]:
    """GPT-2's printable spelling of bytes (byte-level BPE's): byte -> the character a vocabulary
    file writes for it."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def build(path: str | Path) -> tuple[Tokenizer, dict[str, Any]]:
    """The tokenizer the GGUF file at ``path`` describes, and its facts (special ids, template)."""
    from .gguf import GGUFFile
    from .loader import WeightsError

    with GGUFFile(path) as f:
        meta = f.metadata
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if kind != "gpt2" or pre not in PRE:
        raise WeightsError(f"{path}: tokenizer {kind!r} with pre-tokenizer {pre!r}; allowed: "
                           f"'gpt2' (byte-level BPE) with {', '.join(map(repr, PRE))}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    split = PRE[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                          use_regex=split in (None, _DIGITS))
    first = [] if split is None else [pre_tokenizers.Digits(individual_digits=True)] \
        if split == _DIGITS else [pre_tokenizers.Split(Regex(split), "isolated")]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*first, byte_level])
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
        "name": f"{os.path.basename(str(path))}'s byte-level BPE",
    }
    return tok, facts


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` and its facts behind the surface every family's tokenizer has.
    ``facts``: bos_id, eos_id, add_bos (GGUF: add BOS by hand), post_process (a folder's: its
    tokenizer.json adds what it adds), chat_template, special (the control tokens' strings),
    vocab_size, name."""

    def __init__(self, tok: Tokenizer, facts: dict[str, Any]) -> None:
        self.tokenizer = tok
        self.facts = facts
        self.name: str = facts.get("name") or "byte-level BPE"
        self.eos_id: int | None = facts.get("eos_id")
        self.bos_id: int | None = facts.get("bos_id")
        self.chat_template: str | bool = facts.get("chat_template") or False
        self.vocab_size = int(facts["vocab_size"])
        self._special = set(facts.get("special", []))
        # byte-level BPE spells each byte as one character; else SentencePiece's pieces
        self._bytes = {c: b for b, c in byte_chars().items()} \
            if facts.get("byte_level", True) else None

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; control tokens written in it (<|im_start|>) are matched whole, and a
        text opening with the BOS token gets no second one."""
        bos = self._piece(self.bos_id)
        opens = bool(bos) and text.startswith(bos)
        if self.facts.get("post_process"):
            return self.tokenizer.encode(text, add_special_tokens=not opens).ids
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        add = self.facts.get("add_bos") and self.bos_id is not None and not opens
        return [self.bos_id, *ids] if add else ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, i: int) -> bytes:
        piece = self.tokenizer.id_to_token(int(i))
        if piece is None:
            raise ValueError(f"token id {i} is outside the vocabulary; allowed: "
                             f"0..{self.vocab_size - 1}")
        if piece in self._special:
            return piece.encode("utf-8")
        if self._bytes is not None:  # byte-level BPE: each character spells one byte
            return bytes(self._bytes[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # a SentencePiece byte-fallback token
        return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece's word marker

    def decode_each(self, ids: list[int]) -> list[str]:
        """One string per token (partial UTF-8 bytes shown with replacement characters)."""
        return [self.token_bytes(i).decode("utf-8", errors="replace") for i in ids]

    def chat(self, user_text: str) -> str:
        """``user_text`` as one user turn of the stored chat template, ready for the reply."""
        return self.chat_messages([{"role": "user", "content": user_text}])

    chat_prompt = chat

    def chat_messages(self, messages: list[dict[str, str]]) -> str:
        """A whole conversation (``{"role", "content"}`` dicts: system, user, assistant turns)
        in the stored chat template, ready for the next assistant turn."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer holds no chat template; allowed: plain "
                             "prompts")
        return _template(str(self.chat_template)).render(
            messages=messages, add_generation_prompt=True,
            bos_token=self._piece(self.bos_id), eos_token=self._piece(self.eos_id))

    def _piece(self, i: int | None) -> str:
        return "" if i is None else (self.tokenizer.id_to_token(i) or "")


def _byte_level(decoder: dict[str, Any] | None) -> bool:
    """Does a tokenizer.json's decoder read byte-level (GPT-2's spelling of bytes), rather than
    SentencePiece's pieces?"""
    dec = decoder or {}
    parts = dec.get("decoders", [dec]) if dec.get("type") == "Sequence" else [dec]
    return any(p.get("type") == "ByteLevel" for p in parts)


def _raise(message: str) -> None:
    raise ValueError(f"the chat template refused the conversation: {message}")


@functools.lru_cache(maxsize=8)
def _template(source: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # transformers' settings: the template's block tags eat their own line breaks
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def _special_id(tok: Tokenizer, value: Any) -> int | None:
    """A tokenizer_config.json special token ("<s>", or {"content": "<s>", ...}) as its id."""
    content = value.get("content") if isinstance(value, dict) else value
    return tok.token_to_id(content) if isinstance(content, str) else None


def chat_template_in(folder: str | Path) -> str | None:
    """The chat template a Hugging Face folder's tokenizer files hold: tokenizer_config.json's
    (the default one of named templates), else chat_template.jinja's (where transformers 5
    saves it); None. ValueError naming the file when tokenizer_config.json is not JSON."""
    folder = Path(folder)
    config = _json_file(folder / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"),
                        None)
    jinja = folder / "chat_template.jinja"
    if not template and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    return template or None


def _json_file(path: Path) -> dict[str, Any]:
    """A JSON object file's fields ({} when there is no file); ValueError naming it otherwise."""
    if not path.is_file():
        return {}
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not readable JSON ({exc})") from exc
    if not isinstance(fields, dict):
        raise ValueError(f"{path} holds no object of fields")
    return fields


def folder_tokenizer(folder: str | Path) -> TextTokenizer:
    """The tokenizer of a Hugging Face folder (tokenizer.json; its special tokens from
    tokenizer_config.json, its chat template from ``chat_template_in``), as AutoTokenizer reads
    it. ValueError naming the file when one is not readable."""
    folder = Path(folder)
    try:
        text = (folder / "tokenizer.json").read_text(encoding="utf-8")
        tok, spec = Tokenizer.from_str(text), json.loads(text)  # one read: the decoder, specials
        config = _json_file(folder / "tokenizer_config.json")
        template = chat_template_in(folder)
    except Exception as exc:  # tokenizers raises Exception for a damaged file
        raise ValueError(f"{folder}: its tokenizer is not readable ({exc}); allowed: a "
                         "tokenizer.json written by tokenizers or save_pretrained") from exc
    return TextTokenizer(tok, {
        "bos_id": _special_id(tok, config.get("bos_token")),
        "eos_id": _special_id(tok, config.get("eos_token")),
        "post_process": True,
        "byte_level": _byte_level(spec.get("decoder")),
        "chat_template": template,
        "special": [t["content"] for t in spec.get("added_tokens", []) if t.get("special")],
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "name": f"{folder.name}/tokenizer.json",
    })


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
def _load(path: Path, folder: Path) -> TextTokenizer:
    try:
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        facts = json.loads((folder / "meta.json").read_text())
    except Exception:  # no cache yet, or a damaged one (tokenizers raises Exception): build
        tok, facts = build(path)
        _write_cache(folder, tok, facts)
    return TextTokenizer(tok, facts)


def gguf_tokenizer(path: str | Path, name: str | None = None) -> TextTokenizer:
    """The tokenizer the GGUF file at ``path`` stores, from the disk cache when it holds it,
    built (and cached) otherwise, under ``name`` when given (a copy: the cached one is shared);
    WeightsError where its kind is not rebuilt here."""
    path = Path(path).resolve()
    tok = _load(path, _cache_folder(path))
    if name is None:
        return tok
    named = copy.copy(tok)
    named.name = name
    return named


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def stamp(path: str | Path) -> tuple[int, ...]:
    """When a checkpoint's tokenizer last changed (a folder's ``TOKENIZER_FILES``, or the GGUF
    file): what a tokenizer read from it is cached under."""
    path = Path(path)
    files = [path / n for n in TOKENIZER_FILES] if path.is_dir() else [path]
    return tuple(f.stat().st_mtime_ns if f.exists() else 0 for f in files)


def of_checkpoint(path: str | Path, vocab_size: int) -> TextTokenizer | None:
    """The tokenizer the checkpoint at ``path`` holds (a folder's tokenizer.json; a GGUF file's
    vocabulary), or None where it holds none; read once per change of its files (``stamp``).
    ValueError where it holds more tokens than the model's ``vocab_size`` (a model may have
    more rows than its tokenizer has tokens)."""
    path = Path(path).resolve()
    tok = _of_checkpoint(path, stamp(path))
    if tok is not None and tok.vocab_size > vocab_size:
        raise ValueError(f"{path}: its tokenizer has {tok.vocab_size} tokens, the model "
                         f"{vocab_size} rows; allowed: a tokenizer of at most the model's rows")
    return tok


@functools.lru_cache(maxsize=8)
def _of_checkpoint(path: Path, stamp: tuple[int, ...]) -> TextTokenizer | None:
    if path.is_dir():
        return folder_tokenizer(path) if (path / "tokenizer.json").is_file() else None
    from .gguf import GGUFFile

    with GGUFFile(path) as f:
        if f.metadata.get("tokenizer.ggml.model") in (None, "none"):
            return None
    return gguf_tokenizer(path)
