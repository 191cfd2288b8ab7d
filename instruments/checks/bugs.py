"""The write-up's silent bugs, switched on in a model for the checks to catch (the engine has
none of them, and no switch for them). GPT-2's are here; a Llama-family model's -- the same three
through rotary positions, and RoPE's and GQA's own -- in ``instruments.checks.bugs_llama``.

  view = private_view(model)        a GPT of its own over the same weight tensors
  with inject_bug(view, "positions"): ...   the bug is on inside the block, off after

Each bug is a subclass of the engine module it lives in, overriding ``forward`` only; switching
it on swaps the class of that module in ``model`` (and back afterwards):

  positions    ``transformer.wpe``: positions restart at 0 on every call instead of continuing
               after the cache
  mask_offset  every ``attn``: the causal mask is not offset by the cached length (attention is
               told that nothing was cached)
  cache_order  every ``attn``: a concatenating cache puts the new keys/values *before* the
               cached ones (the write-up's first cache); single-token decode cannot see it

They break what runs through ``GPT.forward`` -- prefill, modes 1-5, 10 and 11, multi-token
appends -- and not the shared decode step of modes 6-9, which reads the position embeddings and
writes its cache itself. Switch bugs on in a ``private_view``: its modules are its own, so the
model other requests use never sees them; its weights are the same tensors, so it costs no
memory (a deep copy of gpt2 would cost 500 MB).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Iterator

import torch
import torch.nn as nn

from engine.cache import ConcatKVCache, KVCache
from engine.models.attention import Attention
from engine.models.gpt2.model import GPT, CausalSelfAttention
from instruments.checks import BUG_KINDS, bugs_for


class RestartedPositions(nn.Embedding):
    """positions: every call embeds its tokens at positions 0, 1, ... whatever was cached."""

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return super().forward(pos - pos[:1])


class UnshiftedMask(CausalSelfAttention):
    """mask_offset: attention is told no token was cached, so the mask is not offset."""

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache | None, attend: Attention,
                offset: int) -> torch.Tensor:
        return super().forward(x, layer, cache, attend, 0)


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


class NewKeysFirst(CausalSelfAttention):
    """cache_order: a concatenating cache gets the new keys/values before the cached ones."""

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache | None, attend: Attention,
                offset: int) -> torch.Tensor:
        if isinstance(cache, ConcatKVCache):
            cache = _NewFirst(cache)  # type: ignore[assignment]
        return super().forward(x, layer, cache, attend, offset)


def _modules(model: GPT, kind: str) -> tuple[list[nn.Module], type[nn.Module]]:
    """The modules bug ``kind`` lives in, and the broken class they take (a Llama-family
    model's: ``instruments.checks.bugs_llama``)."""
    family = model.config.family
    if kind not in bugs_for(family):
        raise ValueError(f"bug {kind!r} does not apply to {family} models; allowed: "
                         f"{', '.join(bugs_for(family))}")
    if family == "llama":
        from instruments.checks import bugs_llama

        return bugs_llama.modules(model, kind)  # type: ignore[arg-type]
    if kind == "positions":
        return [model.transformer.wpe], RestartedPositions
    attn = [block.attn for block in model.transformer.h]
    return attn, UnshiftedMask if kind == "mask_offset" else NewKeysFirst


def private_view(model: GPT) -> GPT:
    """A GPT of its own -- its own module objects -- over the very same weight tensors.

    A bug switched on in the view stays in the view: requests using ``model`` see none of it.
    """
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, memo=shared)


@contextlib.contextmanager
def inject_bug(model: GPT, kind: str | None) -> Iterator[GPT]:
    """Run the block with one silent bug switched on in ``model`` (None: no bug)."""
    if kind is None:
        yield model
        return
    if kind not in BUG_KINDS:
        raise ValueError(f"unknown bug {kind!r}; allowed: {', '.join(BUG_KINDS)}")
    modules, broken = _modules(model, kind)
    saved = [m.__class__ for m in modules]
    for m in modules:
        m.__class__ = broken
    try:
        yield model
    finally:
        for m, cls in zip(modules, saved, strict=True):
            m.__class__ = cls
