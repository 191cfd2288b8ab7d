"""The silent bugs of a KV cache, switched on in a model for the checks to catch (the engine has
none of them, and no switch for them): the write-up's three, in every family, and a family's
own (RoPE's and GQA's where positions are rotary: ``instruments.checks.bugs_rope``).

  view = private_view(model)        a model of its own over the same weight tensors
  with inject_bug(view, "positions"): ...   the bug is on inside the block, off after

Each bug is a subclass of the engine module it lives in, overriding ``forward`` only; switching
it on swaps the class of those modules in ``model`` (and back afterwards):

  positions    the model: every call is given positions 0, 1, ... (``input_pos``) whatever was
               cached -- GPT-2 reads the position table there, the Llama family turns RoPE
  mask_offset  every block's attention: the causal mask is not offset by the cached length
               (attention is told that nothing was cached)
  cache_order  every block's attention: a concatenating cache puts the new keys/values *before*
               the cached ones (the write-up's first cache); single-token decode cannot see it
An attention's bug is a ``Wrap``: ``wrap(cfg, attn, cache, attend, offset) -> (cache, attend,
offset)``, what that block's attention then sees; the broken class calls it around the engine's
own ``forward`` (``_Hooked``). A family's own bugs are its module's ``WRAPS``.

They break what runs through the model's ``forward`` -- prefill, modes 1-5, 10 and 11,
multi-token appends -- and not the one-token steps of modes 6-9 and 12-15, which embed, turn and
write their cache themselves. Switch bugs on in a ``private_view``: its modules are its own, so
the model other requests use never sees them; its weights are the same tensors, so it costs no
memory (a deep copy of gpt2 would cost 500 MB).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from engine.cache import ConcatKVCache, KVCache
from engine.models.attention import Attention
from engine.models.base import CausalLM
from instruments import lineup
from instruments.checks import BUG_KINDS, bugs_for, bugs_rope

Wrap = Callable[[Any, nn.Module, "KVCache | None", Attention, int],
                tuple["KVCache | None", Attention, int]]


class _NewFirst:
    """A concatenating cache seen through the write-up's first ``update``: new before old."""

    def __init__(self, cache: ConcatKVCache) -> None:
        self.cache = cache

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        old_k, old_v = c.k[layer], c.v[layer]
        if old_k is None or old_v is None:
            return c.update(layer, k, v)
        c.k[layer], c.v[layer] = torch.cat([k, old_k], dim=2), torch.cat([v, old_v], dim=2)
        return c.k[layer], c.v[layer]


def unshifted_mask(cfg: Any, attn: nn.Module, cache: KVCache | None, attend: Attention,
                   offset: int) -> tuple[KVCache | None, Attention, int]:
    """mask_offset: attention is told no token was cached, so the mask is not offset."""
    return cache, attend, 0


def new_keys_first(cfg: Any, attn: nn.Module, cache: KVCache | None, attend: Attention,
                   offset: int) -> tuple[KVCache | None, Attention, int]:
    """cache_order: a concatenating cache gets the new keys/values before the cached ones."""
    if isinstance(cache, ConcatKVCache):
        cache = _NewFirst(cache)  # type: ignore[assignment]
    return cache, attend, offset


WRAPS: dict[str, dict[str, Wrap]] = {  # positions -> bug -> how attention sees the cache
    positions: {"mask_offset": unshifted_mask, "cache_order": new_keys_first, **own}
    for positions, own in (("learned", {}), ("rope", bugs_rope.WRAPS))}


class _Hooked:
    """An attention module whose cache, attention and offset go through its bug's ``Wrap``
    (``bug_wrap``: the wrap with the model's config, set on the module when the bug is switched
    on)."""

    bug_wrap: Callable[..., tuple[Any, Any, int]]

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache | None, attend: Attention,
                offset: int, *extra: Any) -> torch.Tensor:
        cache, attend, offset = self.bug_wrap(self, cache, attend, offset)
        return super().forward(x, layer, cache, attend, offset, *extra)  # type: ignore[misc]


class _RestartedPositions:
    """positions: the new tokens are given positions 0..T-1, whatever the cache holds."""

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, **kw: Any
                ) -> tuple[torch.Tensor, KVCache | None]:
        if kw.get("input_pos") is None:
            kw["input_pos"] = torch.arange(idx.size(1), device=idx.device)
        return super().forward(idx, cache, **kw)  # type: ignore[misc]


_BROKEN: dict[tuple[type, type], type] = {}  # (engine class, bug mixin) -> the broken class


def _broken(own: type, mixin: type) -> type:
    """``own`` with ``mixin``'s ``forward`` in front (one class per pair, made once)."""
    if (own, mixin) not in _BROKEN:
        _BROKEN[own, mixin] = type(f"{mixin.__name__.strip('_')}{own.__name__}", (mixin, own), {})
    return _BROKEN[own, mixin]


def _modules(model: CausalLM, kind: str) -> list[nn.Module]:
    """The modules bug ``kind`` lives in: the model itself, or every block's attention."""
    family = model.config.family
    if kind not in bugs_for(family):
        raise ValueError(f"bug {kind!r} does not apply to {family} models; allowed: "
                         f"{', '.join(bugs_for(family))}")
    if kind == "positions":
        return [model]
    blocks, _ = model.trunk()
    return [getattr(block, block.parts[1]) for block in blocks]  # parts: norm, attention, ...


def private_view(model: CausalLM) -> CausalLM:
    """A model of its own -- its own module objects -- over the very same weight tensors.

    A bug switched on in the view stays in the view: requests using ``model`` see none of it.
    """
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo=shared)


@contextlib.contextmanager
def inject_bug(model: CausalLM, kind: str | None) -> Iterator[CausalLM]:
    """Run the block with one silent bug switched on in ``model`` (None: no bug)."""
    if kind is None:
        yield model
        return
    if kind not in BUG_KINDS:
        raise ValueError(f"unknown bug {kind!r}; allowed: {', '.join(BUG_KINDS)}")
    modules = _modules(model, kind)
    positions = lineup.family_of(model.config).positions  # which attention bugs it has
    saved = [m.__class__ for m in modules]
    for m in modules:
        if kind == "positions":
            m.__class__ = _broken(m.__class__, _RestartedPositions)
        else:
            m.__dict__["bug_wrap"] = functools.partial(WRAPS[positions][kind],
                                                       model.config)
            m.__class__ = _broken(m.__class__, _Hooked)
    try:
        yield model
    finally:
        for m, cls in zip(modules, saved, strict=True):
            m.__class__ = cls
            m.__dict__.pop("bug_wrap", None)
