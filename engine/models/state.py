"""Everything built on one model besides its weights, in one object: ``ModelState``.

  state = ModelState(model, Provenance("pretrained (gpt2)"))
  state.provenance            where the weights came from (a label, and why "auto" fell back)
  state.attention(kind)       the causal-mask variant ``kind`` (``engine.models.attention``),
                              built once and shared by every decoder of the model;
                              ``mask_nbytes()``
  state.cached(key, build)    anything else built once per model: mode 8's packed weight copies
                              (``engine.decoders.fast``), modes 7/9's compiled steps
                              (``engine.decoders.compiled``)
  state.clear()               drop all of it now

The measuring process holds one (``instruments.spine.Loaded``) and drops it when a request names
another model: the packed copies, compiled steps and mask buffers go with it. Decoders take a
model or its state (``engine.decoders.make_decoder``); given the bare model, they use the state
that holds it while one is alive (``ModelState.of``), so code handed only the model shares what
was built, and a fresh state otherwise. The index behind ``of`` holds states weakly: it never
keeps a state, or its model, alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .attention import Attention, make_attention
from .base import CausalLM

T = TypeVar("T")


@dataclass(frozen=True)
class Provenance:
    """Where a model's weights came from, as shown wherever the model is."""

    label: str = "not recorded"  # "random (seed 0)", "pretrained (gpt2)", ...
    fallback: str | None = None  # why "auto" fell back to random weights (None: it did not)
    file: str | None = None  # the GGUF file the weights were read from (rungs 14-15 read its
    # blocks as stored where they still are the model's weights)
    checkpoint: str | None = None  # the checkpoint path the model is (its own tokenizer's)


# id(model) -> the live state holding it (a state keeps its model alive, so the id is its own)
_LIVE: weakref.WeakValueDictionary[int, ModelState] = weakref.WeakValueDictionary()


def weights_version(model: CausalLM) -> tuple[int, ...]:
    """Changes with any in-place write to a parameter: what was built from the weights (packed
    or quantized copies, a peer's converted engine) is stale when it differs."""
    return tuple(p._version for p in model.parameters())


class ModelState:
    """One model and what is built on it: see the module docstring."""

    def __init__(self, model: CausalLM, provenance: Provenance | None = None) -> None:
        self.model = model
        self.provenance = provenance or Provenance()
        self._built: dict[tuple[Any, ...], Any] = {}
        self._releases: dict[tuple[Any, ...], Callable[[], None]] = {}
        weakref.finalize(self, _release_all, self._releases)  # holds the dict, not the state
        _LIVE[id(model)] = self  # the newest state of a model is the one ``of`` finds

    @classmethod
    def of(cls, model: CausalLM | ModelState) -> ModelState:
        """``model`` itself if it is a state; else the live state holding it, or a new one."""
        if isinstance(model, ModelState):
            return model
        state = _LIVE.get(id(model))
        return state if state is not None and state.model is model else cls(model)

    def cached(self, key: tuple[Any, ...], build: Callable[[], T],
               keep: Callable[[T], bool] | None = None,
               release: Callable[[T], None] | None = None) -> T:
        """What ``build()`` returns, built once for this model under ``key`` (a tuple whose
        first item names what it is: "attention", "packed", "compiled", "peer"); built again
        (the old one dropped first: it may be as big as the weights) when ``keep(old)`` says
        it is stale. ``release(value)`` runs when the value is dropped -- replaced, ``drop``,
        ``clear``, or the state itself garbage-collected (a peer's engine: its files, its
        paused generation)."""
        old = self._built.get(key)
        if old is not None and (keep is None or keep(old)):
            return old
        self.drop(key)
        del old
        value = self._built[key] = build()
        if release is not None:
            self._releases[key] = lambda: release(value)
        return value

    def drop(self, key: tuple[Any, ...]) -> None:
        """Forget what was built under ``key`` (nothing if there is none)."""
        self._built.pop(key, None)
        done = self._releases.pop(key, None)
        if done is not None:
            done()

    def attention(self, kind: str | None = None) -> Attention:
        """The causal-mask variant ``kind`` (None: the model config's), buffers built once."""
        kind = self.model.config.mask if kind is None else kind
        return self.cached(("attention", kind),
                           lambda: make_attention(kind, self.model.config, self.model.device))

    def holds_attention(self, kind: str) -> bool:
        return ("attention", kind) in self._built

    def mask_nbytes(self, kind: str | None = None) -> int:
        """Bytes of the causal-mask buffers built so far: of variant ``kind``, or of all."""
        return sum(a.nbytes() for key, a in self._built.items()
                   if key[:1] == ("attention",) and kind in (None, key[1]))

    def clear(self) -> None:
        """Drop everything built on the model (its weights stay)."""
        self._built.clear()
        _release_all(self._releases)


def _release_all(releases: dict[tuple[Any, ...], Callable[[], None]]) -> None:
    while releases:
        releases.popitem()[1]()
