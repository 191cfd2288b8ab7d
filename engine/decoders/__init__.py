"""The decoders: one file per way of stepping, all with the same two calls, and ``make_decoder``.

  eager        ``Decoder``: every step through the model's ``forward`` with a cache kind, a
               causal-mask variant and a logits choice (modes 1-5, 10, 11); the base class the
               others share ``seek``, ``rewind``, ``extend`` and the token buffer with
  captured     ``GraphDecoder``: a one-token step over static inputs captured into a CUDA graph
               (what mode 6 and rung 16 share); ``CudaGraphDecoder``: the family's step so
               (mode 6)
  compiled     ``CompiledDecoder``: the same step through torch.compile, reading the cache only
               (modes 7, 9)
  fast         ``FastDecoder``: the family's step over per-role weight copies, one C++ call on a
               CPU (mode 8)
  weight_only  ``WeightOnlyDecoder``: mode 8's over ``engine.quant.weight_only``'s int8 / bf16
               view (12, 13)
  blocks       the same over ``engine.quant.blocks``' GGUF Q8_0 / Q4_1 blocks, multiplied as
               stored (14, 15)
  triton_step  ``TritonDecoder``: the whole step as our Triton kernels in one CUDA graph (16;
               14-15 on a GPU)
  speculative  not a decoder: speculative decoding over any decoder that appends several
               tokens at once (drafts by prompt lookup, one verify forward)

``make_decoder(model, name, **kw)`` builds the decoder ``engine.modes.MODES[name]`` names
(``factory``, ``options``; an eager decoder also gets the mode's ``cache`` kind), after checking
that the mode runs on the model's device and family (ValueError saying why not). Its module is
imported on first use: modes 6, 7 and 9 pull in ``torch._dynamo``, slow to import.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from .. import modes
from ..models.state import ModelState
from .eager import Decoder

__all__ = ["Decoder", "make_decoder"]


def make_decoder(model: Any, name: str, **kwargs: object) -> Decoder:
    """A decoder of mode ``name`` for ``model`` (a model or its ``ModelState``; ValueError if
    the mode cannot run there)."""
    bare = model.model if isinstance(model, ModelState) else model
    ok, why = modes.available(name, str(bare.device), bare.config.family)
    if not ok:
        raise ValueError(f"mode {name!r} cannot run here: {why}")
    spec = modes.spec(name)
    module, attr = spec.factory.split(":")
    factory = getattr(importlib.import_module(module), attr)
    if "cache_kind" in inspect.signature(factory).parameters:
        kwargs = {"cache_kind": spec.cache, **kwargs}
    return factory(model, **spec.options, **kwargs)
