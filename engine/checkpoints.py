"""A checkpoint at a path as a preset of the family table: ``checkpoint(path)``, ``resolve``.

A user's model is a path: a folder holding ``config.json`` (and its weights, or none), or a GGUF
file. ``engine.families.preset`` hands a path here; what comes back is a ``Preset`` of the family
its architecture names (``Family.architectures``: ``architectures`` then ``model_type`` in a
config.json), its shapes read by the family's config class (``from_hf``), its weights
("checkpoint", then "random"; "random" alone for a config without weights). Torch-free for a
folder (config.json is JSON): the planner plans a model too big to load from its config alone.
Every bad path is one ValueError naming what was found and what is allowed.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from .families import CHECKPOINT, CHECKPOINTS, FAMILIES, Family, Preset, is_path


def checkpoint(path: str) -> Preset:
    """The checkpoint at ``path`` (a folder with ``config.json``; a GGUF file) as a preset: its
    family resolved from the architecture it names (``Family.architectures``), its shapes from
    its config, its weights ("checkpoint", or "random" alone for a config without weights).
    Torch-free for a folder (config.json is read as JSON): the planner plans a model too big to
    load from its config alone. ValueError naming what was found and what is allowed."""
    full = os.path.abspath(os.path.expanduser(path))
    folder = os.path.isdir(full)
    marker = os.path.join(full, "config.json") if folder else full
    if not os.path.exists(full):
        raise ValueError(f"{path}: no such file or folder; allowed: {CHECKPOINTS}")
    if folder and not os.path.isfile(marker):
        found = ", ".join(sorted(os.listdir(full))[:5]) or "nothing"
        raise ValueError(f"{path} holds no config.json (found: {found}); allowed: "
                         f"{CHECKPOINTS}")
    from .models.tokens import stamp  # its tokenizer's files: Preset.chat reads them

    return _checkpoint(full, (os.stat(marker).st_mtime_ns, *(stamp(full) if folder else ())))


@functools.lru_cache(maxsize=32)
def _checkpoint(path: str, stamp: tuple[int, ...]) -> Preset:
    """``checkpoint`` of an absolute path, read once per modification of its config or
    tokenizer files (``stamp``)."""
    if not os.path.isdir(path):
        return _gguf(path)
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            fields = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}/config.json is not readable JSON ({exc}); allowed: a "
                         "config.json written by save_pretrained") from exc
    if not isinstance(fields, dict):
        raise ValueError(f"{path}/config.json holds no object of fields")
    named = [str(a) for a in fields.get("architectures") or []] + \
        ([str(fields["model_type"])] if "model_type" in fields else [])
    fam = resolve(named, f"{path}/config.json")
    try:
        cfg = fam.config.from_hf(fields)
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{path}/config.json: {type(exc).__name__}: {exc}; allowed: the "
                         f"fields of a {fam.title} config") from exc
    shapes = {k: v for k, v in cfg.to_dict().items() if k != "mask"}
    has = any(n.endswith(".safetensors") or (n.startswith("pytorch_model") and n.endswith(".bin"))
              for n in os.listdir(path))
    return Preset(path, fam.name, shapes, (CHECKPOINT, "random") if has else ("random",),
                  f"the checkpoint at {path}" if has else f"the config at {path} (no weights)",
                  chat=_has_chat_template(path))


def _has_chat_template(folder: str) -> bool:
    """Does the folder's own tokenizer hold a chat template (``engine.models.tokens`` reads it)?"""
    from .models.tokens import chat_template_in

    try:
        return os.path.isfile(os.path.join(folder, "tokenizer.json")) and \
            chat_template_in(folder) is not None
    except ValueError:  # an unreadable tokenizer_config.json: reading the tokenizer says so
        return False


def resolve(named: list[str], where: str) -> Family:
    """The family a checkpoint's architecture names pick (the first name any family knows)."""
    for name in named:
        for fam in FAMILIES.values():
            if name in fam.architectures:
                return fam
    known = sorted(a for fam in FAMILIES.values() for a in fam.architectures)
    raise ValueError(f"{where}: architecture {', '.join(named) or '(none named)'}; allowed: "
                     f"{', '.join(known)}")


def _gguf(path: str) -> Preset:
    """A GGUF file as a preset: its ``general.architecture`` resolved, its config read by the
    family's reader (``gguf_config``) from its metadata (this imports torch: the file's
    reader is the engine's, ``engine.models.gguf``)."""
    if not path.endswith(".gguf"):
        raise ValueError(f"{path}: a file that is no .gguf; allowed: {CHECKPOINTS}")
    from .families import _resolve
    from .models.gguf import GGUFFile

    with GGUFFile(path) as f:
        fam = resolve([str(f.metadata.get("general.architecture"))], path)
        cfg = _resolve(fam.weights).gguf_config(f)
        chat = f.metadata.get("tokenizer.ggml.model") not in (None, "none") and \
            bool(f.metadata.get("tokenizer.chat_template"))
    shapes = {k: v for k, v in cfg.to_dict().items() if k != "mask"}
    return Preset(path, fam.name, shapes, (CHECKPOINT, "random"), f"the GGUF file at {path}",
                  chat=chat)


def own_tokenizer(what: Any, source: str | None = None) -> tuple[Any, Any]:
    """(the config of ``what`` -- a model, its state or a config --, the tokenizer its checkpoint
    holds, or None): the checkpoint at ``source``, else the one the model was loaded from (its
    provenance); ``engine.models.tokens.of_checkpoint`` reads it."""
    from .models.config import ModelConfig

    cfg = what
    if not isinstance(what, ModelConfig):
        from .models.state import ModelState

        state = ModelState.of(what)
        cfg, source = state.model.config, source or state.provenance.checkpoint
    if not source or not is_path(source):
        return cfg, None
    from .models.tokens import of_checkpoint

    return cfg, of_checkpoint(source, cfg.vocab_size)
