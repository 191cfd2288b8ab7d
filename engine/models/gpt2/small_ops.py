"""GPT-2's small operators: what a forward runs that is no matmul and no attention.

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

from .model import GPT


def small_ops(m: GPT, randn: Callable[..., torch.Tensor], rows: int) -> Callable[[], Any]:
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
