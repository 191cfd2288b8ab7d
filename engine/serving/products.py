"""The batched step's products: per role of matrix, whichever way multiplies B rows fastest here,
chosen for each B.

Mode 8's products (``engine.decoders.fast.FastWeights``) are chosen by timing one row. A
batched step multiplies up to 64 rows, and there the order changes. On the 2-core Zen 4 EPYC,
for SmolLM2's 49,152 x 576 head, mode 8's chunked copy took 8.8 ms at 8 rows against 4.8 ms for
the C++ kernel. At 64 rows, ``F.linear`` over 8-row kernel calls is 35.5 ms against 28.3.

``batch_weights(model, rows=ROWS)`` -> ``BatchWeights`` (kept in the model's ``ModelState``):
per role (the family step's ``ROLES``), and for each row count in ``rows``, the fastest of
  "mode8"   mode 8's chosen product for that matrix
  "kernel"  the C++ kernel over the model's own weight, 8 rows a call (``kernels.MAX_ROWS``):
            each call streams the weight once for its 8 rows
  "linear"  ``F.linear`` over the model's own weight (one GEMM over all the rows)
Each way goes through every layer's matrix of the role, timed in interleaved rounds, and the
best of three counts. ``RowsLinear`` calls, for x of n rows, the way chosen at the smallest
tuned count >= n (the largest past them). ``step`` is the family's step weights over these
products. ``choice[role]`` is (rows, way) ascending, and ``tune_s`` the seconds it took:
set-up, never part of a step. It applies where mode 8's kernel does: a CPU in fp32 with the C++
kernel built.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .. import families
from ..kernels import cpu as kernels
from ..models.state import ModelState, weights_version

ROWS = (1, 2, 4, 8, 16, 32, 64)
Fn = Callable[[torch.Tensor], torch.Tensor]


def kernel_rows(weight: torch.Tensor, bias: torch.Tensor | None) -> Fn:
    """x (n, in) -> (n, out) by the C++ kernel, ``kernels.MAX_ROWS`` rows a call."""
    step = kernels.MAX_ROWS

    def product(x: torch.Tensor) -> torch.Tensor:
        if x.size(0) <= step:
            return kernels.linear(x.contiguous(), weight, None, bias)
        return torch.cat([kernels.linear(x[i:i + step].contiguous(), weight, None, bias)
                          for i in range(0, x.size(0), step)])

    return product


def own_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Fn:
    """x (n, in) -> (n, out) by ``F.linear`` over the model's own weight: one GEMM."""
    return lambda x: F.linear(x, weight, bias)


class RowsLinear:
    """One matrix's product, the way chosen by the rows it is given (module docstring)."""

    def __init__(self, ways: dict[str, Fn], choice: list[tuple[int, str]]) -> None:
        self.ways, self.choice = ways, choice

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        how = next((w for rows, w in self.choice if n <= rows), self.choice[-1][1])
        return self.ways[how](x)


def _pass_ms(fns: list[Fn], x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    for f in fns:
        f(x)
    return (time.perf_counter() - t0) * 1e3


class BatchWeights:
    """The batched step's weights (module docstring)."""

    def __init__(self, model: Any, rows: tuple[int, ...] = ROWS) -> None:
        from ..decoders.fast import fast_weights  # noqa: PLC0415 (mode 8's, one candidate)

        t0 = time.perf_counter()
        self.version, self.rows = weights_version(model), tuple(sorted(rows))
        mode8 = fast_weights(model)
        family_step = families.step_of(model)
        own = family_step.role_modules(model)
        self.choice: dict[str, list[tuple[int, str]]] = {}
        self.tuned_ms: dict[str, dict[int, dict[str, float]]] = {}
        products: dict[str, list[RowsLinear]] = {}
        gen = torch.Generator().manual_seed(0)
        for role in family_step.ROLES:
            mods = own[role]
            bias = [None if m.bias is None else m.bias.detach() for m in mods]
            ways = {"mode8": list(mode8.linears[role]),
                    "kernel": [kernel_rows(m.weight.detach(), b) for m, b in zip(mods, bias,
                                                                                 strict=True)],
                    "linear": [own_linear(m.weight.detach(), b) for m, b in zip(mods, bias,
                                                                                  strict=True)]}
            table: dict[int, dict[str, float]] = {}
            for n in self.rows:
                x = torch.randn(n, mods[0].in_features, generator=gen).to(mods[0].weight)
                ms = {how: float("inf") for how in ways}
                for i in range(4):  # an untimed pass each, then three interleaved
                    for how, fns in ways.items():
                        t = _pass_ms(fns, x)
                        ms[how] = min(ms[how], t) if i else ms[how]
                table[n] = ms
            self.tuned_ms[role] = table
            self.choice[role] = [(n, min(ms, key=lambda h: ms[h])) for n, ms in table.items()]
            products[role] = [RowsLinear({h: fns[i] for h, fns in ways.items()},
                                         self.choice[role]) for i in range(len(mods))]
        self.step = family_step.step_weights(model, products)
        self.tune_s = time.perf_counter() - t0


@torch.no_grad()
def batch_weights(model: Any, rows: tuple[int, ...] = ROWS) -> BatchWeights:
    """``BatchWeights`` of ``model``, kept in its state while its weights are current."""
    state = ModelState.of(model)
    return state.cached(("serving-products",), lambda: BatchWeights(state.model, rows),
                        keep=lambda w: w.rows == tuple(sorted(rows))
                        and w.version == weights_version(state.model))
