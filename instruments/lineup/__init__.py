"""The lineup: our decode modes, the peers and the model families -- the one way, outside
``engine/``, to list or look anything of them up (``tests/test_registry.py`` holds this).

Modes and peers, one namespace for everything a sweep can time:
  ``spec(name)``        an ``engine.modes.ModeSpec`` or a ``lineup.peers.PeerSpec`` (both carry
                        rung, label, colour, cached, tolerance, slow_setup)
  ``label``, ``color``, ``ordered`` (our ladder first, then the peers, by rung)
  ``available(name, device, family=None)``, ``choices(device, family=None)`` (what can run
                        there, and why each other one cannot), ``peer_choices``
  ``defaults(device, family=None)`` our cheap modes only (a peer is always opted into)
  ``with_role(role)``, ``fastest_exact(device)``, ``uncached()``, ``seed_pair()``, ``is_peer``
  ``make_decoder(model, name, **kw)`` a mode through ``engine.decoders.make_decoder`` or a peer
                        through its adapter (``PeerSpec.factory``, imported on first use)
Model families and their presets (``engine.families``):
  ``models(tests=False)``, ``preset(name)`` (a name, or a checkpoint's path: ``is_path``),
  ``offline_weights(name)``, ``config(name)``, ``config_from_dict(fields)``,
  ``family_of(name_or_config)``, ``load_model(name, weights, ...)``, ``model_class(cfg)``,
  ``tokenizer(model)``, ``reference(model)``, ``gguf_layout(model)``, ``block_linears(model)``,
  ``head_linear(model)``, ``make_cache(kind, model, batch, capacity)`` (the family's own cache
  where it has one)
Pages, inputs, the gate, the cost model and the experiments ask here, so a mode, a peer or a
model family registered once is selectable, gated, predicted and timed wherever the others are.
Torch-free at import; lowest of the instrument parts but the store, so the cost model and the
calibration can ask it too.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from engine import families, modes
from engine.modes import ModeSpec

from .peers import PEERS, PeerSpec, PeerUnavailable
from .peers import available as peer_available
from .peers import converts as peer_converts

__all__ = ["PEERS", "ModeSpec", "PeerSpec", "PeerUnavailable", "available", "choices", "color",
           "config", "defaults", "family_of", "fastest_exact", "is_peer", "label",
           "make_decoder", "models", "names", "ordered", "peer_choices", "peer_converts", "preset",
           "seed_pair", "spec", "uncached", "with_role"]

# ------------------------------------------------------------------------ modes and peers


def names() -> list[str]:
    return [*modes.ordered(modes.MODES), *PEERS]


def mode_names() -> list[str]:
    """Our modes alone, in ladder order."""
    return modes.ordered(modes.MODES)


def is_peer(name: str) -> bool:
    return name in PEERS


def is_mode(name: str) -> bool:
    return modes.ALIASES.get(name, name) in modes.MODES


def spec(name: str) -> Any:
    """The mode's or the peer's spec (ValueError naming what is allowed)."""
    name = modes.ALIASES.get(name, name)
    if name in modes.MODES:
        return modes.MODES[name]
    if name in PEERS:
        return PEERS[name]
    raise ValueError(f"unknown mode {name!r}; allowed: {', '.join(names())}")


def mode_spec(name: str) -> ModeSpec | None:
    """Our mode's spec, or None for a peer or an unknown name (saved runs may name either)."""
    return modes.MODES.get(modes.ALIASES.get(name, name))


def label(name: str) -> str:
    return PEERS[name].label if is_peer(name) else modes.label(name)


def color(name: str) -> str:
    return PEERS[name].color if is_peer(name) else modes.color(name)


def ordered(items: Iterable[str]) -> list[str]:
    """Names by rung (our ladder, then the peers), unknown ones after in their order, unique."""
    seen = list(dict.fromkeys(str(m) for m in items))

    def rank(m: str) -> tuple[int, int]:
        known = modes.MODES.get(modes.ALIASES.get(m, m)) or PEERS.get(m)
        return (known.rung if known else 10**6, seen.index(m))

    return sorted(seen, key=rank)


def available(name: str, device: str, family: str | None = None) -> tuple[bool, str]:
    """(can ``name`` run on ``device`` -- and a model of ``family``, when given -- why not)."""
    if is_peer(name):
        return peer_available(name, device, family)
    if name not in modes.MODES:
        return False, f"unknown mode {name!r}; allowed: {', '.join(names())}"
    return modes.available(name, device, family)


def choices(device: str, family: str | None = None, *, with_peers: bool = True
            ) -> tuple[list[str], dict[str, str]]:
    """What can run on ``device`` (and ``family``), in order: our ladder, then the peers; and
    why each other one cannot."""
    usable, missing = modes.choices(device, family)
    for name in PEERS if with_peers else ():
        ok, why = peer_available(name, device, family)
        if ok:
            usable.append(name)
        else:
            missing[name] = why
    return usable, missing


def peer_choices(device: str, family: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The peers alone: those that can run on ``device`` (and ``family``), and why each other
    one cannot."""
    usable, missing = choices(device, family)
    return ([n for n in usable if is_peer(n)],
            {n: why for n, why in missing.items() if is_peer(n)})


def defaults(device: str, family: str | None = None) -> list[str]:
    """Our modes available on ``device`` that are cheap to set up (peers are opted into)."""
    return modes.defaults(device, family)


def with_role(role: str, device: str | None = None, family: str | None = None) -> list[str]:
    """Our modes holding ``role`` (``engine.modes.ROLES``), those that can run on ``device``
    and ``family`` when given."""
    found = modes.with_role(role)
    if device is None:
        return found
    return [m for m in found if modes.available(m, device, family)[0]]


fastest_exact = modes.fastest_exact
uncached = modes.uncached
seed_pair = modes.seed_pair


def make_decoder(model: Any, name: str, **kwargs: Any) -> Any:
    """A decoder of mode ``name``, or the adapter of peer ``name`` (ValueError / PeerUnavailable
    when it cannot run here)."""
    if is_peer(name):
        from engine.models.state import ModelState

        if isinstance(model, ModelState):  # (a Llama's own ``.model`` is its module dict)
            model = model.model
        ok, why = peer_available(name, str(model.device), model.config.family)
        if not ok:
            raise PeerUnavailable(f"{name}: {why}")
        p = PEERS[name]
        module, attr = p.factory.split(":")
        factory = getattr(importlib.import_module(module), attr)
        return factory(model, batch_size=int(kwargs.get("batch_size", 1)),
                       capacity=kwargs.get("capacity"), threads=kwargs.get("threads"),
                       **p.options)
    from engine.decoders import make_decoder as make_mode

    kwargs.pop("threads", None)  # our modes run on the process's torch threads
    return make_mode(model, name, **kwargs)


# ------------------------------------------------------------------------- model families

def models(*, tests: bool = False) -> list[str]:
    """The presets a user can pick (``--model``, the sidebar), real models first."""
    return families.names(tests=tests)


def family_titles() -> list[str]:
    """The titles of the model families the lab runs ("GPT-2", "Llama", any registered later)."""
    return [f.title for f in families.FAMILIES.values()]


preset = families.preset
installed = families.installed  # (are a preset's real weights installed, how to install them)
offline_weights = families.offline_weights  # what a run loads when no weights are asked for
is_path = families.is_path  # a checkpoint's path rather than a preset's name
config = families.config
config_from_dict = families.config_from_dict
family_of = families.family_of
load_model = families.load  # a preset with its weights: an engine.models.state.ModelState
model_class = families.model_class
tokenizer = families.tokenizer  # a model's tokenizer: encode, decode, decode_each, chat
small_ops = families.small_ops  # a model's non-matmul, non-attention operators, to time
TokenizerError = families.TokenizerError  # what a tokenizer raises when its files are missing
reference = families.reference  # the family's transformers model holding a model's weights
gguf_layout = families.gguf_layout  # a model's weights in llama.cpp's layout (a GGUF file's)
block_linears = families.block_linears  # every block's Linears, in cfg.matrices() order
head_linear = families.head_linear
make_cache = families.make_cache  # a KV cache of a kind: the family's own, else the engine's
