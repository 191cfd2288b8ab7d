"""Small operators, per model family: what a forward runs that is no matmul and no attention.

``SMALL_OPS``: (model class, builder) pairs; ``builder(model, randn, rows)`` returns a call that
runs, over all the model's layers, the family's element-wise and bookkeeping operators at their
real widths on ``rows`` rows (``randn(*shape)`` makes inputs on the model's device and dtype).
``instruments.measure.calibration`` times it as the "small" part; a family missing here is
"not calibrated" there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from engine.models.gpt2.model import GPT
from engine.models.llama.model import Llama, apply_rope, rope_angles

Randn = Callable[..., torch.Tensor]
SmallOps = Callable[[Any, Randn, int], Callable[[], Any]]


def _gpt2_small(m: GPT, randn: Randn, rows: int) -> Callable[[], Any]:
    """Layer norms, GELU, residual adds, the heads' re-assembly copy, token + position
    embeddings (``GPT.forward``'s)."""
    cfg, dev = m.config, m.device
    d, nh, hs = cfg.n_embd, cfg.n_head, cfg.head_dim
    x, h4 = randn(1, rows, d), randn(1, rows, 4 * d)
    heads = randn(1, nh, rows, hs)
    idx = torch.zeros(1, rows, dtype=torch.long, device=dev)
    pos = torch.arange(rows, device=dev)
    tr = m.transformer

    def run() -> None:
        e = tr.wte(idx) + tr.wpe(pos)
        for blk in tr.h:
            a = blk.ln_1(x)
            y = heads.transpose(1, 2).contiguous().view(1, rows, d)
            e = x + y
            a = blk.ln_2(e)
            F.gelu(h4, approximate="tanh")
            e = e + a
        tr.ln_f(e)

    return run


def _llama_small(m: Llama, randn: Randn, rows: int) -> Callable[[], Any]:
    """RMSNorms (fp32), RoPE's angles (once per forward) and its rotation of q (n_head heads)
    and k (n_kv_head heads), the heads' re-assembly copy, SiLU(gate) x up, residual adds, the
    embedding lookup (``Llama.forward``'s)."""
    cfg, dev = m.config, m.device
    d, nh, nkv, hs = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim
    x = randn(1, rows, d)
    gate, up = randn(1, rows, cfg.n_hidden), randn(1, rows, cfg.n_hidden)
    q, k = randn(1, nh, rows, hs), randn(1, nkv, rows, hs)
    idx = torch.zeros(1, rows, dtype=torch.long, device=dev)
    pos = torch.arange(rows, device=dev)
    tr = m.model

    def run() -> None:
        cos, sin = rope_angles(pos, hs, cfg.rope_theta, m.dtype)
        e = tr.embed_tokens(idx)
        for blk in tr.layers:
            a = blk.input_layernorm(x)
            apply_rope(q, cos, sin)
            apply_rope(k, cos, sin)
            y = q.transpose(1, 2).contiguous().view(1, rows, nh * hs)
            e = x + y
            a = blk.post_attention_layernorm(e)
            F.silu(gate) * up
            e = e + a
        tr.norm(e)

    return run


SMALL_OPS: tuple[tuple[type, SmallOps], ...] = ((GPT, _gpt2_small), (Llama, _llama_small))
