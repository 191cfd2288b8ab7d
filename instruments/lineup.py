"""The lineup: our decode modes and the peers, one namespace for everything a sweep can time.

``spec(name)`` is a ``engine.modes.ModeSpec`` or an ``instruments.peers.PeerSpec`` (both carry
rung, label, colour, cached, tolerance, slow_setup); ``label``, ``color``, ``ordered`` (our
ladder first, then the peers, by rung), ``available(name, device)``, ``choices(device)`` (what
can run there, and why each other one cannot), ``defaults(device)`` (our cheap modes only: a
peer is always opted into), ``is_peer(name)`` and ``make_decoder(model, name, **kw)``, which
builds a mode through ``engine.decoders.make_decoder`` or a peer through ``peers.make``. Pages,
inputs, the gate and the experiments ask here instead of ``engine.modes``, so a peer is
selectable, gated and timed wherever a mode is. Torch-free at import.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from engine import modes
from instruments import peers


def names() -> list[str]:
    return [*modes.MODES, *peers.PEERS]


def is_peer(name: str) -> bool:
    return name in peers.PEERS


def spec(name: str) -> Any:
    """The mode's or the peer's spec (ValueError naming what is allowed)."""
    name = modes.ALIASES.get(name, name)
    if name in modes.MODES:
        return modes.MODES[name]
    if name in peers.PEERS:
        return peers.PEERS[name]
    raise ValueError(f"unknown mode {name!r}; allowed: {', '.join(names())}")


def label(name: str) -> str:
    return peers.PEERS[name].label if is_peer(name) else modes.label(name)


def color(name: str) -> str:
    return peers.PEERS[name].color if is_peer(name) else modes.color(name)


def ordered(items: Iterable[str]) -> list[str]:
    """Names by rung (our ladder, then the peers), unknown ones after in their order, unique."""
    seen = list(dict.fromkeys(str(m) for m in items))

    def rank(m: str) -> tuple[int, int]:
        known = modes.MODES.get(modes.ALIASES.get(m, m)) or peers.PEERS.get(m)
        return (known.rung if known else 10**6, seen.index(m))

    return sorted(seen, key=rank)


def available(name: str, device: str) -> tuple[bool, str]:
    """(can ``name`` run on ``device``, why not). Torch-free."""
    if is_peer(name):
        return peers.available(name, device)
    if name not in modes.MODES:
        return False, f"unknown mode {name!r}; allowed: {', '.join(names())}"
    return modes.available(name, device)


def choices(device: str, *, with_peers: bool = True) -> tuple[list[str], dict[str, str]]:
    """What can run on ``device`` (in order: our ladder, then the peers), and why each other one
    cannot."""
    usable, missing = modes.choices(device)
    for name in peers.PEERS if with_peers else ():
        ok, why = peers.available(name, device)
        if ok:
            usable.append(name)
        else:
            missing[name] = why
    return usable, missing


def peer_choices(device: str) -> tuple[list[str], dict[str, str]]:
    """The peers alone: those that can run on ``device``, and why each other one cannot."""
    usable, missing = choices(device)
    return ([n for n in usable if is_peer(n)],
            {n: why for n, why in missing.items() if is_peer(n)})


def defaults(device: str) -> list[str]:
    """Our modes available on ``device`` that are cheap to set up (peers are opted into)."""
    return modes.defaults(device)


def make_decoder(model: Any, name: str, **kwargs: Any) -> Any:
    """A decoder of mode ``name``, or the adapter of peer ``name`` (ValueError / PeerUnavailable
    when it cannot run here)."""
    if is_peer(name):
        model = getattr(model, "model", model)  # an engine.state.ModelState: its GPT
        return peers.make(model, name, batch_size=int(kwargs.get("batch_size", 1)),
                          capacity=kwargs.get("capacity"), threads=kwargs.get("threads"))
    from engine.decoders import make_decoder as make_mode

    kwargs.pop("threads", None)  # our modes run on the process's torch threads
    return make_mode(model, name, **kwargs)
