"""Rungs 12 and 13's decoder: mode 8's over ``engine.quant.weight_only``'s weight-only view of the
model.

Any family with a one-token step: its own (``engine.families.step_of``) over the view's stored
Linears. Shares with ``engine.decoders.fast`` (which it subclasses) the decode step over one-call
products and the fused C++ step; with ``engine.decoders.eager`` the prefill, seek, rewind and
the multi-token ``append`` through the model's ``forward`` over the view (preallocated cache,
fused attention). What the view stores and how one product runs (int8 rows times their scale, bf16
rows widened in registers) is ``engine.quant.weight_only``'s: this file only steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .. import families
from ..kernels import cpu as kernels
from ..kernels.cpu import KERNEL, Product
from ..models.base import CausalLM
from ..models.state import ModelState
from ..quant.weight_only import Int8Linear, WeightOnlyModel, kernel, kernel_takes, weight_only
from .eager import Decoder
from .fast import FastDecoder, steps_of


class _Rows:
    """The view's embedding as ``decode_step`` indexes it: ``rows[token]`` looks the tokens up
    through the weight-only embedding (int8 rows times their scale, or bf16 rows)."""

    def __init__(self, emb: nn.Module, width: int) -> None:
        self.emb, self.width = emb, width

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx)

    def size(self, dim: int) -> int:
        assert dim == 1, "decode_step asks for the embedding's width only"
        return self.width


class _KernelStep:
    """A weight-only Linear as a CPU decode step multiplies by it: its stored rows, scale and
    bias straight into ``engine.kernels.cpu``' one call (no module call, no reshape, no separate
    bias add: 49 of each per gpt2 step); rows the kernel does not take go through the module.
    Where it applies, the decoder's step is the family's ``fused_step`` over ``product``; this
    call is that step's Python form (``decode_step``), which the fused one must equal."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.rows = module.wq if isinstance(module, Int8Linear) else module.weight
        self.scale = module.scale if isinstance(module, Int8Linear) else None
        self.bias = None if module.bias is None else module.bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not kernel_takes(x):
            return self.module(x)
        return kernels.linear(x.contiguous(), self.rows, self.scale, self.bias)

    @property
    def product(self) -> Product:
        return Product(KERNEL, self.rows, self.scale, self.bias, self.rows.size(0))


def _direct(view: WeightOnlyModel) -> bool:
    """Does a decode step of this view multiply through ``engine.kernels.cpu`` directly (fp32 on a
    CPU, the kernel built)?"""
    return view.device.type == "cpu" and view.dtype == torch.float32 and kernels.available()[0]


def step_weights(view: WeightOnlyModel, wrap: Callable[[nn.Module], Any] | None = None) -> Any:
    """The view's modules as its family's one-token step's weights (its ``step_weights``):
    mode 8's step, multiplying by the weight-only Linears (each through ``wrap``: by default
    ``_KernelStep`` where the C++ kernel is built and the view is fp32 on a CPU, else the module
    itself), the embedding looked up through the view's (stored rows when tied)."""
    if wrap is None:
        wrap = _KernelStep if _direct(view) else (lambda m: m)
    family_step = families.step_of(view)
    products = {role: [wrap(m) for m in mods]
                for role, mods in family_step.role_modules(view).items()}
    embed = _Rows(families.embedding(view), view.config.n_embd)
    return family_step.step_weights(view, products, embed)


class WeightOnlyDecoder(FastDecoder):
    """Mode 8's decoder over ``weight_only``: the prefill and multi-token appends through the
    model's ``forward`` into a preallocated cache (fused attention), each decode step through
    its family's one-token step (no per-module Python of a forward), one C++ call on a CPU."""

    appends = True  # the model's forward over the view takes several tokens at once

    def __init__(self, model: CausalLM | ModelState, *, storage: str, batch_size: int = 1,
                 capacity: int | None = None) -> None:
        view = weight_only(model, storage)
        self._start(view, step_weights(view), batch_size, capacity)
        self.storage = storage
        self.kernel = kernel(storage, view.device.type)

    def _start(self, view: WeightOnlyModel, weights: Any,
               batch_size: int, capacity: int | None) -> None:
        """Prefill over ``view``, steps over ``weights`` (what a rung over another storage --
        ``engine.decoders.blocks`` -- shares with this one)."""
        Decoder.__init__(self, view, batch_size=batch_size, capacity=capacity,
                         cache_kind="prealloc", mask="none", logits="last")
        self.step_weights = weights
        self.python_step, self.fused = steps_of(view, weights)
        self.extra_bytes = view.stored_bytes()  # held besides the model's own weights
