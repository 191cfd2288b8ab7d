"""What a peer builds once per model and reuses: the converted engine, its set-up time and bytes.

``engine_for(model, key, build)`` returns the ``Built`` for ``key`` (the peer, its precision,
threads and device), calling ``build()`` only the first time -- or again after the model's
weights were written in place. The gate alone builds a peer's adapter four times, and a
conversion of gpt2 takes seconds, so adapters share one engine per model: it is kept in the
model's ``engine.models.state.ModelState`` (what the measuring process holds while the model is
loaded), and released with it -- its paused generation stopped, its temporary folder removed.
``hf_copy(model)`` is the one ``transformers`` copy of the weights every peer starts from (the
family's reference, ``lineup.reference``).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.models.base import CausalLM
from engine.models.state import ModelState, weights_version  # bumped by in-place writes
from instruments import lineup


@dataclass
class Built:
    handle: Any  # the engine: a transformers model, a ctranslate2.Generator, an ORT session
    compile_s: float  # conversion / export / load, never part of a step
    weight_bytes: int  # bytes of the weights the engine holds
    version: str  # the package's version
    folder: Path | None = None  # temporary files (removed with the entry)
    state: dict[str, Any] = field(default_factory=dict)  # per-engine extras (ct2's live stream)
    weights_version: tuple[int, ...] = ()  # the model's weights it was built from


def engine_for(model: CausalLM, key: tuple, build: Callable[[], Built]) -> Built:
    """The engine for ``key`` over ``model``'s current weights, built on first use (timed)."""
    version = weights_version(model)

    def timed() -> Built:
        t0 = time.perf_counter()
        built = build()
        built.compile_s = time.perf_counter() - t0
        built.weights_version = version
        return built

    return ModelState.of(model).cached(("peer", *key), timed,
                                       keep=lambda b: b.weights_version == version,
                                       release=_release)


def _release(built: Built) -> None:
    closer = built.state.get("close")
    if closer is not None:
        closer()
    if built.folder is not None:
        shutil.rmtree(built.folder, ignore_errors=True)


def temp_folder(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"kvlab_{prefix}_"))


def hf_copy(model: CausalLM) -> Any:
    """The family's ``transformers`` model holding a copy of ``model``'s weights, on the
    model's device."""
    return lineup.reference(model).to(model.device)


def tensor_bytes(module: Any) -> int:
    """Bytes of a torch module's parameters and buffers, shared storage counted once."""
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
