"""What every family's one-token step module offers: the step half of a family's door.

A family's row in ``engine.families`` names its step module (``Family.step``:
``engine.models.gpt2.step``, ``engine.models.llama.step``); the decoders reach it only through
``engine.families.step_of(model)``, so none of them names a family or tests a model's class.
The module defines:

  ROLES                         the roles of the Linears a step multiplies by, the output
                                projection last ("lm_head")
  role_modules(model)           role -> that role's module in every layer (the head: a list of
                                one); a weight-only view has the model's paths, so its stored
                                Linears come back the same way
  tables(model)                 name -> a tensor a step needs computed once besides the weights
                                (RoPE's cos / sin for every position; GPT-2: none). A compiled
                                step keeps them as buffers and passes them back to
                                ``step_weights``
  step_weights(model, products, embed=None, tables=None)
                                the step's weights: ``products`` (role -> one callable per
                                layer: the model's own modules for modes 6, 7, 9, mode 8's
                                chosen copies, a weight-only view's stored rows), the norms,
                                the embedding's rows (``embed``: a lookup ``embed[ids]``; default
                                the model's own weight)
  decode_step(weights, token, pos, attend) -> logits (B, vocab)
                                one new token per sequence through every layer; ``attend`` is
                                how the step meets its KV cache (``engine.models.attention``)
  fused_step(weights)           the same step as one call into the C++ kernels, or None where
                                it does not apply (``engine.kernels.cpu.Fused``)
  kernel_layout(model, head)    the step as the Triton kernels take it (``KernelLayout``)

A family whose attention a one-token step over a full preallocated cache cannot express (a
sliding window) has no step module: its row says why, and the modes that need one
(``engine.modes.ModeSpec.steps``) are not offered for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

Fn = Callable[[torch.Tensor], torch.Tensor]
Products = dict[str, Sequence[Fn]]  # role -> one callable per layer (the head's: a list of one)


class KernelLayout(NamedTuple):
    """A model's decode step as ``engine.decoders.triton_step`` launches it."""

    table: Any  # the embedding's rows (a ``kernels.gpu.linear.Weight``; the tied head's own)
    positions: torch.Tensor | None  # (block_size, C) learned positions added to it, or None
    rope: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin (T, hs) fp32, or None
    final: tuple  # the final norm: ("layer", weight, bias, eps) | ("rms", weight, eps)
    # per block: (norm 1, q, k, v, o, norm 2, up, up2 (SwiGLU's second, else None), down)
    blocks: list[tuple]
    width: int  # the MLP's hidden width
