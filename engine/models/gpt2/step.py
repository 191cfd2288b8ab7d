"""GPT-2's decode step (modes 6-9, 12-15 on GPT-2), written once: one new token per sequence
through every layer. The Llama family's is ``engine.models.llama.step`` (modes 6-9, 12-15 on a
Llama): the same ways of meeting the cache and the same product kinds, its own blocks.

  decode_step(weights, token, pos, attend) -> logits (B, vocab)
      token (B, 1); pos its position: an int, or a (1,) long tensor when the shapes must not
      change with the position (a captured or compiled step), or (B,) when each sequence has
      its own (the serving engine's batched step)

What differs between the modes is passed in, never re-written:
  weights  ``StepWeights``: the embeddings, and per layer the callables a block is made of --
           the model's own modules (``model_weights``: modes 6, 7, 9) or mode 8's packed copies
           (``engine.decoders.fast``)
  attend   ``attend(layer, q, k, v) -> y``: how the step meets its KV cache
           (``engine.models.attention``: ``attend_filled`` for modes 8 and 12-15,
           ``attend_static`` for mode 6, ``attend_read_only`` for modes 7 and 9)

This is ``GPT.forward``'s arithmetic for one token, without its Python per call: the same
embeddings, layer norms, fused q|k|v projection, GELU and residual adds, the attention
computed from the same keys (``tests/test_fast.py`` holds every mode to mode 1's tokens).

  fused_step(weights) -> fn(token, pos, k_buf, v_buf) -> logits, or None
      the same step after the embedding as ONE call into the C++ kernels
      (``torch.ops.kvlab.decode_layers``): on a CPU in fp32 with the kernel built, when every
      product of ``weights`` says how (a ``product`` attribute: an ``engine.kernels.cpu.
      Product``) and every norm is a plain ``F.layer_norm`` partial. Equal to ``decode_step``
      with ``attend_filled`` bit for bit, without the ~1 ms of Python and dispatch around a
      step's ~160 calls (modes 8, 12-15).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...kernels import cpu as kernels
from ...kernels.cpu import Fused, Product
from ..attention import Attend, kernel_attends
from .model import GPT

Fn = Callable[[torch.Tensor], torch.Tensor]


class StepWeights(NamedTuple):
    wte: torch.Tensor  # (vocab, C) token embeddings
    wpe: torch.Tensor  # (block_size, C) position embeddings
    layers: Sequence[tuple[Fn, Fn, Fn, Fn, Fn, Fn]]  # ln_1, c_attn, c_proj, ln_2, c_fc, mlp proj
    ln_f: Fn
    head: Fn  # the output projection onto the vocabulary
    n_head: int


def model_weights(model: GPT) -> StepWeights:
    """The model's own modules as a step's weights (built inside a compiled step, so the
    compiler reaches every module from the model it was given, as a forward would)."""
    tr = model.transformer
    layers = [(b.ln_1, b.attn.c_attn, b.attn.c_proj, b.ln_2, b.mlp.c_fc, b.mlp.c_proj)
              for b in tr.h]
    return StepWeights(tr.wte.weight, tr.wpe.weight, layers, tr.ln_f, model.lm_head,
                       model.config.n_head)


def decode_step(w: StepWeights, token: torch.Tensor, pos: int | torch.Tensor,
                attend: Attend) -> torch.Tensor:
    """Logits (B, vocab) for ``token`` (B, 1) at position ``pos``; see the module docstring."""
    batch, n_embd = token.size(0), w.wte.size(1)
    nh = w.n_head
    hs = n_embd // nh
    x = w.wte[token[:, 0]] + w.wpe[pos]  # (B, C)
    for i, (ln_1, c_attn, c_proj, ln_2, c_fc, mlp_proj) in enumerate(w.layers):
        q, k, v = c_attn(ln_1(x)).view(batch, 3, nh, hs).unbind(1)  # (B, nh, hs) each
        y = attend(i, q, k, v)
        x = x + c_proj(y.reshape(batch, n_embd))  # heads side by side again
        x = x + mlp_proj(F.gelu(c_fc(ln_2(x)), approximate="tanh"))
    return w.head(w.ln_f(x))


def layer_norm_call(ln: torch.nn.LayerNorm) -> functools.partial[torch.Tensor]:
    """``ln`` as a plain ``F.layer_norm`` call over its (detached) weight and bias."""
    return functools.partial(F.layer_norm, normalized_shape=ln.normalized_shape,
                             weight=ln.weight.detach(), bias=ln.bias.detach(), eps=ln.eps)


def fused_step(w: StepWeights) -> Fused | None:
    """``decode_step`` with ``attend_filled`` as one call into the C++ kernels (module
    docstring), or None where it does not apply: off a CPU or fp32, kernel not built, or a part
    without a fused form. The returned ``fn(token, pos, k_buf, v_buf)`` takes 1 to
    ``kernels.MAX_ROWS`` sequences, under ``torch.no_grad`` (the kernels record no gradient;
    the decoders' ``step`` is decorated so); the caller sends more through ``decode_step``."""
    if not kernel_attends(w.wpe.device, w.wpe.dtype):
        return None
    norms = [f for layer in w.layers for f in (layer[0], layer[3])] + [w.ln_f]
    fns = [f for layer in w.layers for f in (layer[1], layer[2], layer[4], layer[5])] + [w.head]
    if not all(isinstance(f, functools.partial) and f.func is F.layer_norm for f in norms) or \
            not all(isinstance(getattr(f, "product", None), Product) for f in fns):
        return None
    ln_w = [f.keywords["weight"] for f in norms]
    ln_b = [f.keywords["bias"] for f in norms]
    eps = norms[0].keywords["eps"]
    products: list[Product] = [f.product for f in fns]
    args = kernels.product_lists(products)
    wte, wpe, n_head = w.wte, w.wpe, w.n_head

    def step(token: torch.Tensor, pos: int, k_buf: torch.Tensor, v_buf: torch.Tensor
             ) -> torch.Tensor:
        x = wte[token[:, 0]] + wpe[pos]  # (B, C), as decode_step embeds
        return kernels.decode_layers(x, ln_w, ln_b, *args, k_buf, v_buf, pos, n_head, eps)

    return step
