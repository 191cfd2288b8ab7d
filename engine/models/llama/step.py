"""The Llama family's one-token decode step (modes 6-9, 12-16 on a Llama), written once: the
family's step module (``engine.models.steps`` says what every family's offers: ``ROLES``,
``role_modules``, ``tables``, ``step_weights``, ``decode_step``, ``fused_step``,
``kernel_layout``). A family built on the Llama's blocks (Qwen2: q/k/v biases) uses it as it
is: every product carries its own bias.

  decode_step(weights, token, pos, attend) -> logits (B, vocab)
      token (B, 1) at position ``pos``: an int, or a (1,) long tensor when the shapes must not
      change with the position (mode 6's captured step), or (B,) when each sequence has its
      own (the serving engine's batched step); ``attend`` is
      ``engine.models.attention.attend_filled`` over the preallocated (L, B, n_kv_head, T, hs)
      cache (the C++ kernel on a CPU in fp32, SDPA with ``enable_gqa=True`` elsewhere; mode 6:
      ``attend_static``; modes 7 and 9: ``attend_read_only``, which leaves the write to the
      caller): it writes the new K/V row at ``pos`` and attends the n_head query heads over rows
      0..pos, query head h reading K/V head h // groups

``engine.models.llama.model.Llama.forward``'s arithmetic for one token, without its Python per
module: the embedding row, per block RMSNorm (fp32, as the model's), the q, k, v products, RoPE at
``pos`` from a cos/sin table precomputed once (``rope_table``: the model's own ``rope_angles``, so
the same angles bit for bit), grouped-query attention, o, residual, RMSNorm, SwiGLU
(down(silu(gate) * up)), residual; then the final RMSNorm and the head. What differs between
the modes is the products (``LlamaStepWeights``: mode 8's chosen copies, the weight-only int8 /
bf16 rows, GGUF blocks), never the step.

  fused_step(weights) -> fn(token, pos, k_buf, v_buf) -> logits, or None
      the same step after the embedding as ONE call into the C++ kernels
      (``torch.ops.kvlab.decode_layers_llama``): on a CPU in fp32 with the kernel built, when
      every product says how (a ``product`` attribute: an ``engine.kernels.cpu.Product``). Its
      products and attention are the very kernels the Python step calls, so they are bit for bit the
      same; its RMSNorm (a double sum of squares), RoPE and SiLU are short C++ loops whose
      float32 rounding differs from torch's ops by an ulp here and there. So the fused step
      equals this one to float32 rounding, not bit for bit: on llama-tiny the logits differ by
      at most ~1e-6 of the largest logit, and the greedy tokens are the same
      (tests/test_fast_llama.py measures and bounds both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from ...kernels import cpu as kernels
from ...kernels.cpu import Fused, Product
from ..attention import Attend, kernel_attends
from ..steps import Fn, KernelLayout, Products
from .model import Llama, rope_angles


class LlamaLayer(NamedTuple):
    attn_norm: torch.Tensor  # (C,) RMSNorm weight before attention
    q: Fn  # (B, C) -> (B, n_head * hs)
    k: Fn  # (B, C) -> (B, n_kv_head * hs)
    v: Fn
    o: Fn  # (B, n_head * hs) -> (B, C)
    mlp_norm: torch.Tensor  # (C,) RMSNorm weight before the MLP
    gate: Fn  # (B, C) -> (B, n_hidden)
    up: Fn
    down: Fn  # (B, n_hidden) -> (B, C)


class LlamaStepWeights(NamedTuple):
    embed: Any  # ``embed[token_ids]`` -> (B, C): the embedding's rows (a tensor or a lookup)
    layers: Sequence[LlamaLayer]
    norm: torch.Tensor  # (C,) the final RMSNorm's weight
    head: Fn  # the output projection onto the vocabulary
    n_head: int
    n_kv_head: int
    eps: float
    cos: torch.Tensor  # (T, hs) fp32: row p holds position p's angles (rope_table)
    sin: torch.Tensor


ROLES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def role_modules(model: Llama) -> dict[str, list[torch.nn.Module]]:
    """The model's Linears by role (``ROLES``), one per layer, the head alone."""
    layers = model.model.layers
    out: dict[str, list[torch.nn.Module]] = {
        r: [getattr(b.self_attn if r[0] in "qkvo" else b.mlp, r) for b in layers]
        for r in ROLES[:-1]}
    out["lm_head"] = [model.lm_head]
    return out


def rope_table(model: Llama, positions: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, hs) in fp32 for positions 0..T-1 (default: every position the model holds),
    from the model's own ``rope_angles``: the angles its forward uses, bit for bit (each row
    depends on its position alone)."""
    cfg = model.config
    n = cfg.block_size if positions is None else positions
    pos = torch.arange(n, device=model.device)
    cos, sin = rope_angles(pos, cfg.head_dim, cfg.rope_theta, torch.float32, cfg.rope_scaling)
    return cos.contiguous(), sin.contiguous()


def tables(model: Llama) -> dict[str, torch.Tensor]:
    """RoPE's cos, sin for every position the model holds (``rope_table``), made once."""
    cos, sin = rope_table(model)
    return {"cos": cos, "sin": sin}


def step_weights(model: Any, products: Products, embed: Any = None,
                 tables: dict[str, torch.Tensor] | None = None) -> LlamaStepWeights:
    """A Llama (or a weight-only view of one: its norms and config are the model's) with the
    per-role products ``products`` (``ROLES`` -> one callable per layer, the head's list of
    one) as ``decode_step``'s weights; ``embed`` defaults to the embedding's weight,
    ``tables`` to ``rope_table`` of the model (a step built per call passes its own, made
    once)."""
    cfg = model.config
    blocks = model.model.layers
    layers = [LlamaLayer(b.input_layernorm.weight.detach(), products["q_proj"][i],
                         products["k_proj"][i], products["v_proj"][i], products["o_proj"][i],
                         b.post_attention_layernorm.weight.detach(), products["gate_proj"][i],
                         products["up_proj"][i], products["down_proj"][i])
              for i, b in enumerate(blocks)]
    if embed is None:
        embed = model.model.embed_tokens.weight.detach()
    if tables is None:
        cos, sin = rope_table(getattr(model, "base", model))  # a view: the model behind it
    else:
        cos, sin = tables["cos"], tables["sin"]
    return LlamaStepWeights(embed, layers, model.model.norm.weight.detach(),
                            products["lm_head"][0], cfg.n_head, cfg.n_kv_head, cfg.norm_eps,
                            cos, sin)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``engine.models.llama.model.RMSNorm``'s arithmetic: x / sqrt(mean(x^2) + eps) * weight, in
    fp32."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, hs) turned by one position's angles (cos, sin (hs,)): channel i pairs with
    i + hs/2 (``engine.models.llama.model.apply_rope``'s rotate_half)."""
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def decode_step(w: LlamaStepWeights, token: torch.Tensor, pos: int | torch.Tensor,
                      attend: Attend) -> torch.Tensor:
    """Logits (B, vocab) for ``token`` (B, 1) at position ``pos``; see the module docstring."""
    batch = token.size(0)
    nh, nkv = w.n_head, w.n_kv_head
    x = w.embed[token[:, 0]]  # (B, C)
    hs = x.size(1) // nh
    cos, sin = w.cos[pos].to(x.dtype), w.sin[pos].to(x.dtype)  # (hs,), or (P, hs) for a tensor
    if cos.dim() == 2:  # P positions: one for all (a (1,) tensor) or one per sequence (B,)
        cos, sin = cos[:, None], sin[:, None]  # (P, 1, hs): the same angles for every head
    for i, layer in enumerate(w.layers):
        h = rms_norm(x, layer.attn_norm, w.eps)
        q = rope(layer.q(h).view(batch, nh, hs), cos, sin)
        k = rope(layer.k(h).view(batch, nkv, hs), cos, sin)
        v = layer.v(h).view(batch, nkv, hs)
        y = attend(i, q, k, v)  # (B, nh, [1,] hs)
        x = x + layer.o(y.reshape(batch, nh * hs))
        h = rms_norm(x, layer.mlp_norm, w.eps)
        x = x + layer.down(F.silu(layer.gate(h)) * layer.up(h))
    return w.head(rms_norm(x, w.norm, w.eps))


def fused_step(w: LlamaStepWeights) -> Fused | None:
    """``decode_step`` with ``attend_filled`` as one ``decode_layers_llama`` call (module
    docstring), or None where it does not apply: off a CPU or fp32, the kernel not built, or a
    product without a fused form. ``fn(token, pos, k_buf, v_buf)`` takes 1 to
    ``kernels.MAX_ROWS`` sequences, under ``torch.no_grad``."""
    if not kernel_attends(w.norm.device, w.norm.dtype):
        return None
    fns = [f for layer in w.layers for f in (layer.q, layer.k, layer.v, layer.o, layer.gate,
                                             layer.up, layer.down)] + [w.head]
    if not all(isinstance(getattr(f, "product", None), Product) for f in fns):
        return None
    products: list[Product] = [f.product for f in fns]
    norms = [t.contiguous() for layer in w.layers for t in (layer.attn_norm, layer.mlp_norm)]
    norms.append(w.norm.contiguous())
    args = kernels.product_lists(products)
    embed, cos, sin = w.embed, w.cos, w.sin
    nh, nkv, eps = w.n_head, w.n_kv_head, w.eps

    def step(token: torch.Tensor, pos: int, k_buf: torch.Tensor, v_buf: torch.Tensor
             ) -> torch.Tensor:
        x = embed[token[:, 0]]  # (B, C), as decode_step embeds
        return kernels.decode_layers_llama(x, norms, *args, k_buf, v_buf, cos, sin, pos, nh,
                                           nkv, eps)

    return step


def kernel_layout(model: Llama, head: Any) -> KernelLayout:
    """The step as the Triton kernels take it (``engine.decoders.triton_step``): the
    embedding is the head's rows when tied, RoPE's table, q, k, v apart (their biases, where a
    family has them, ride along), SwiGLU's gate and up in one pass."""
    from ...kernels.gpu.linear import Weight

    inner = model.model

    def rms(norm: torch.nn.Module) -> tuple:
        return ("rms", norm.weight.detach(), norm.eps)

    blocks = [(rms(b.input_layernorm), Weight.of(b.self_attn.q_proj),
               Weight.of(b.self_attn.k_proj), Weight.of(b.self_attn.v_proj),
               Weight.of(b.self_attn.o_proj), rms(b.post_attention_layernorm),
               Weight.of(b.mlp.gate_proj), Weight.of(b.mlp.up_proj), Weight.of(b.mlp.down_proj))
              for b in inner.layers]
    table = head if model.config.tied else Weight.of(inner.embed_tokens)
    return KernelLayout(table, None, rope_table(model), rms(inner.norm), blocks,
                        model.config.n_hidden)
