"""The Llama family's small operators (Qwen2's and Mistral's too): what a forward runs that is
no matmul and no attention.

``small_ops(model, randn, rows)`` returns a call that runs, over all the model's layers, these
operators at their real widths on ``rows`` rows (``randn(*shape)`` makes inputs on the model's
device and dtype); the calibration (``instruments.measure.calibration``) times it as the
"small" part, reached through the family table (``engine.families.small_ops``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .model import Llama, apply_rope, rope_angles


def small_ops(m: Llama, randn: Callable[..., torch.Tensor], rows: int) -> Callable[[], Any]:
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
        cos, sin = rope_angles(pos, hs, cfg.rope_theta, m.dtype, cfg.rope_scaling)
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
