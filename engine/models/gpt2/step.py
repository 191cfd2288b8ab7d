"""GPT-2's decode step (modes 6-9, 12-16 on GPT-2), written once: one new token per sequence
through every layer. It is the family's step module (``engine.models.steps`` says what every
family's offers; the decoders reach it only through ``engine.families.step_of``): ``ROLES``,
``role_modules``, ``tables``, ``step_weights``, ``decode_step``, ``fused_step``,
``kernel_layout``.

  decode_step(weights, token, pos, attend) -> logits (B, vocab)
      token (B, 1); pos its position: an int, or a (1,) long tensor when the shapes must not
      change with the position (a captured or compiled step), or (B,) when each sequence has
      its own (the serving engine's batched step)

What differs between the modes is passed in, never re-written:
  weights  ``StepWeights``: the embeddings, and per layer the callables a block is made of --
           ``step_weights(model, products)`` over the model's own Linears (``role_modules``:
           modes 6, 7, 9), mode 8's chosen copies (``engine.decoders.fast``) or a weight-only
           view's stored rows
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
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ...kernels import cpu as kernels
from ...kernels.cpu import Fused, Product
from ..attention import Attend, kernel_attends
from ..steps import KernelLayout, Products
from .model import GPT

Fn = Callable[[torch.Tensor], torch.Tensor]


class StepWeights(NamedTuple):
    wte: Any  # (vocab, C) token embeddings: ``wte[ids]`` and ``wte.size(1)``
    wpe: torch.Tensor  # (block_size, C) position embeddings
    layers: Sequence[tuple[Fn, Fn, Fn, Fn, Fn, Fn]]  # ln_1, c_attn, c_proj, ln_2, c_fc, mlp proj
    ln_f: Fn
    head: Fn  # the output projection onto the vocabulary
    n_head: int


# The Linears a step multiplies by, by role: a block's paths (as ``cfg.matrices()`` names them,
# the first two shortened as mode 8 reports them) and the output projection.
ROLES = ("c_attn", "attn.c_proj", "c_fc", "mlp.c_proj", "lm_head")
_PATHS = {"c_attn": "attn.c_attn", "attn.c_proj": "attn.c_proj", "c_fc": "mlp.c_fc",
          "mlp.c_proj": "mlp.c_proj"}


def role_modules(model: GPT) -> dict[str, list[torch.nn.Module]]:
    """The model's Linears by role (``ROLES``), one per layer, the head alone (a weight-only
    view's stored Linears likewise: it has the model's paths)."""
    out: dict[str, list[torch.nn.Module]] = {
        role: [b.get_submodule(path) for b in model.transformer.h]
        for role, path in _PATHS.items()}
    out["lm_head"] = [model.lm_head]
    return out


def tables(model: GPT) -> dict[str, torch.Tensor]:
    """What a step needs computed once besides the weights: nothing (the learned positions
    are a weight)."""
    return {}


def step_weights(model: GPT, products: Products, embed: object = None,
                 tables: dict[str, torch.Tensor] | None = None) -> StepWeights:
    """``decode_step``'s weights: the per-role ``products`` (``ROLES`` -> one callable per
    layer, the head's list of one), the LayerNorms as plain ``F.layer_norm`` calls, the
    embedding's rows (``embed``: default the model's ``wte`` weight; a weight-only view passes
    a lookup) and the position table."""
    tr = model.transformer
    layers = [(layer_norm_call(b.ln_1), products["c_attn"][i], products["attn.c_proj"][i],
               layer_norm_call(b.ln_2), products["c_fc"][i], products["mlp.c_proj"][i])
              for i, b in enumerate(tr.h)]
    wte = tr.wte.weight.detach() if embed is None else embed
    return StepWeights(wte, tr.wpe.weight.detach(), layers,  # type: ignore[arg-type]
                       layer_norm_call(tr.ln_f), products["lm_head"][0], model.config.n_head)


def model_weights(model: GPT) -> StepWeights:
    """The model's own modules as a step's weights."""
    return step_weights(model, role_modules(model))


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


def _norm(ln: torch.nn.LayerNorm) -> tuple:
    return ("layer", ln.weight.detach(), ln.bias.detach(), ln.eps)


def kernel_layout(model: GPT, head: Any) -> KernelLayout:
    """GPT-2's step as the Triton kernels take it (``engine.decoders.triton_step``): the
    embedding is the tied head, the learned positions added to it, one q|k|v weight split
    into its three row ranges (views), a GELU MLP of 4 x n_embd."""
    from ...kernels.gpu.linear import Weight

    tr, C = model.transformer, model.config.n_embd
    blocks = []
    for b in tr.h:
        qkv = Weight.of(b.attn.c_attn)
        blocks.append((_norm(b.ln_1), qkv.rows(0, C), qkv.rows(C, 2 * C), qkv.rows(2 * C, 3 * C),
                       Weight.of(b.attn.c_proj), _norm(b.ln_2), Weight.of(b.mlp.c_fc), None,
                       Weight.of(b.mlp.c_proj)))
    return KernelLayout(head, tr.wpe.weight.detach(), None, _norm(tr.ln_f), blocks, 4 * C)
