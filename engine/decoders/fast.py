"""Mode 8: the fastest exact cached decode step we know for a CPU, in eager PyTorch.

Contract: ``FastDecoder(model, batch_size=1, capacity=None, chunks=None)`` is a ``Decoder``
(``prefill(idx) -> (B, vocab)``, ``step(token) -> (B, vocab)``) that gives mode 1's greedy
tokens in fp32; its logits match the model's ``forward`` (and so ``transformers``) to ~1e-5.
``decoder.extra_bytes`` is the memory of the weight copies it holds besides the model. Any
family with a one-token step (``engine.families.step_of``): ``FastWeights`` chooses one of four
ways per role of its step (GPT-2: q|k|v, o, MLP up, down, head; the Llama family: q, k, v, o,
gate, up, down, head), and the step is the family's, fused into one C++ call on a CPU.

Why it is faster (see the measured notes): at batch 1 a decode step is a chain of
matrix-vector products that must stream all 494 MB of gpt2's Linear weights. The ``[out, in]``
``nn.Linear`` layout and the tied output projection stream slowly, and the default kernel uses
one core. Here every weight is copied once to ``[in, out]`` and split column-wise into one
chunk per core, ``(chunks, in, out/chunks)``: one ``baddbmm`` then runs the chunks on different
cores, each streaming its own contiguous slab. The output projection gets the same treatment
(a transposed, padded copy of ``wte``). Each output is still one full dot product over ``in``,
so results differ from ``F.linear`` by float32 rounding only. With one thread, ``chunks=1``
falls back to ``torch.addmm`` on the ``[in, out]`` copy. ``PackedLinear.__call__`` is the one
place that multiplies by the packed weights. Where the C++ matrix-vector kernel is built
(``engine.kernels.cpu``), each role of matrix (q|k|v, attention projection, MLP up, MLP down, output
projection) is timed four ways when the copies are made -- the packed copies, ``F.linear`` over
the model's own ``[out, in]`` weights (``OwnLinear``, no copy: fastest for some roles on an
AVX-512 Xeon), the kernel over them (no copy), the kernel over an interleaved copy in which
every four rows are one contiguous stream (``InterleavedLinear``) -- and takes the fastest
(``FastWeights.choice``; ``scripts/bench_kernels.py`` times them per role). The step itself is
the family's ``decode_step`` (the one modes 6, 7 and 9 run too) over these copies, with
``attend_filled`` over a preallocated cache, with no mask, the new token seeing every cached key:
on a CPU in fp32 the C++ kernel writes the new row and attends in one call
(``engine.kernels.cpu.attend``), elsewhere SDPA on 4-D views. There, with the kernel built, the
whole step after the embedding is ONE call into C++ (the family's ``fused_step``: the
same ops, the same logits bit for bit, without the Python around ~160 calls; in 24-step loops side
by side on the 2-core Xeon it took 2.1-2.4 ms off gpt2's fp32 step and 1.3-1.4 ms off int8's).

The copies are built once per model (and chunk count) and kept in its ``engine.models.state.
ModelState``; an in-place write to a parameter makes them stale, and they are built again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .. import families
from ..kernels import cpu as kernels
from ..kernels.cpu import CHUNKED, INTERLEAVED, KERNEL, LINEAR, PACKED, Fused, Product
from ..models.attention import attend_filled, kernel_attends
from ..models.base import CausalLM
from ..models.state import ModelState, weights_version
from .eager import Decoder

MAX_CHUNKS = 8  # beyond this the per-chunk slabs get too thin to stream well


def default_chunks(device: torch.device) -> int:
    """One chunk per intra-op thread on a CPU (capped); a GPU needs no manual split."""
    if device.type != "cpu":
        return 1
    return max(1, min(torch.get_num_threads(), MAX_CHUNKS))


@dataclass
class PackedLinear:
    """y = x @ W + b for x (B, in), with W stored [in, out], optionally split into chunks."""

    weight: torch.Tensor  # (in, out) when chunks == 1, else (chunks, in, out_padded/chunks)
    bias: torch.Tensor | None  # (out,) or (chunks, 1, out_padded/chunks)
    out_features: int
    chunks: int

    @classmethod
    def from_out_in(cls, w: torch.Tensor, b: torch.Tensor | None, chunks: int) -> PackedLinear:
        """Pack an ``nn.Linear``-layout weight (out, in) and bias (out,)."""
        out_f, in_f = w.shape
        wt = w.detach().t()  # (in, out), a view: the copy below makes it contiguous
        if chunks <= 1:
            bias = None if b is None else b.detach().clone()
            return cls(wt.contiguous(), bias, out_f, 1)
        padded = -(-out_f // chunks) * chunks  # pad so every chunk has the same width
        pad = padded - out_f
        if pad:
            wt = torch.cat([wt, wt.new_zeros(in_f, pad)], dim=1)
        w3 = wt.reshape(in_f, chunks, padded // chunks).permute(1, 0, 2).contiguous()
        bias = None
        if b is not None:
            bias = torch.cat([b.detach(), b.new_zeros(pad)]).view(chunks, 1, padded // chunks)
        return cls(w3, bias, out_f, chunks)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, in) @ the packed weight (+ bias) -> (B, out): every packed product is here."""
        if self.chunks == 1:
            if self.bias is None:
                return torch.mm(x, self.weight)
            return torch.addmm(self.bias, x, self.weight)
        batch = x.size(0)
        xs = x.unsqueeze(0).expand(self.chunks, batch, x.size(1))  # no copy: stride 0
        if self.bias is None:
            y = torch.bmm(xs, self.weight)
        else:
            y = torch.baddbmm(self.bias, xs, self.weight)  # (chunks, B, width)
        # Chunk-major is already the right column order for one row; B > 1 needs a transpose.
        y = y.view(1, -1) if batch == 1 else y.transpose(0, 1).reshape(batch, -1)
        return y if y.size(1) == self.out_features else y[:, : self.out_features]

    @property
    def product(self) -> Product:
        kind = PACKED if self.chunks == 1 else CHUNKED
        return Product(kind, self.weight, None, self.bias, self.out_features)

    def nbytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() * self.weight.element_size() + extra


@dataclass
class KernelLinear:
    """y = x @ W.T + b through ``engine.kernels.cpu``' C++ matrix-vector product over the model's
    own ``[out, in]`` weight: no copy. More rows than the kernel takes go to ``F.linear``."""

    weight: torch.Tensor  # (out, in), the model's tensor
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(0) > kernels.MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        return kernels.linear(x.contiguous(), self.weight, None, self.bias)

    @property
    def product(self) -> Product:
        return Product(KERNEL, self.weight, None, self.bias, self.weight.size(0))

    def nbytes(self) -> int:
        return 0  # nothing held besides the model


@dataclass
class InterleavedLinear:
    """y = x @ W.T + b through the C++ kernel over an interleaved copy (``kernels.interleave``:
    each group of four rows one contiguous stream, so a thread reads its rows front to back
    in one sequential pass). More rows than the kernel takes go to ``F.linear`` over the
    model's own weight."""

    weight: torch.Tensor  # (out, in), the model's tensor
    packed: torch.Tensor  # (groups, in / 16, 4, 16), the copy
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(0) > kernels.MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        return kernels.linear_interleaved(x.contiguous(), self.packed, self.weight.size(0),
                                          self.bias)

    @property
    def product(self) -> Product:
        return Product(INTERLEAVED, self.packed, None, self.bias, self.weight.size(0))

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


@dataclass
class OwnLinear:
    """y = F.linear(x, W, b) over the model's own ``[out, in]`` weight: no copy. On the 2-core
    Xeon (AVX-512) it streamed like a ``sum()`` of the same bytes (0.90-1.09x at 1 thread,
    bench_kernels); on the 2-core EPYC it lost to every copy (11 vs 21 GB/s)."""

    weight: torch.Tensor  # (out, in), the model's tensor
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def product(self) -> Product:
        return Product(LINEAR, self.weight, None, self.bias, self.weight.size(0))

    def nbytes(self) -> int:
        return 0  # nothing held besides the model


Linear = PackedLinear | KernelLinear | InterleavedLinear | OwnLinear


def _pass_ms(fns: list[Linear], x: torch.Tensor) -> float:
    """One run of ``x`` through every matrix of a role, one after another, as a step reads them."""
    t0 = time.perf_counter()
    for f in fns:
        f(x)
    return (time.perf_counter() - t0) * 1e3


def _choose(packed: list[PackedLinear], own: list[torch.nn.Linear], device: torch.device,
            dtype: torch.dtype) -> tuple[list[Linear], str, dict[str, float]]:
    """Per role, whichever multiplies a token fastest on this machine, timed here: the packed
    copies, ``F.linear`` over the model's own weights (``OwnLinear``), the C++ kernel over them,
    or the kernel over an interleaved copy (``InterleavedLinear``; widths a multiple of 16). A
    way that holds no copy wins a tie within 3% (the kernel first, then ``F.linear``). Without
    the kernel: the packed copies or ``F.linear``; off a CPU or fp32: the packed copies."""
    if device.type != "cpu" or dtype != torch.float32:
        return list(packed), "packed", {}
    bias = [None if m.bias is None else m.bias.detach() for m in own]
    ways: dict[str, list[Linear]] = {
        "packed": list(packed),
        "linear": [OwnLinear(m.weight.detach(), b) for m, b in zip(own, bias, strict=True)]}
    if kernels.available()[0]:
        ways["kernel"] = [KernelLinear(m.weight.detach(), b) for m, b in zip(own, bias,
                                                                              strict=True)]
    if kernels.available()[0] and own[0].in_features % kernels.STRIP == 0:
        ways["interleaved"] = [InterleavedLinear(m.weight.detach(), kernels.interleave(m.weight),
                                                 b) for m, b in zip(own, bias, strict=True)]
    x = torch.randn(1, own[0].in_features,  # host: this choice is made on a CPU only
                    generator=torch.Generator().manual_seed(0))
    ms = {how: float("inf") for how in ways}
    for i in range(4):  # an untimed run each, then three interleaved: a slow moment of the
        for how, fns in ways.items():  # machine hits every way, not one
            t = _pass_ms(fns, x)
            ms[how] = min(ms[how], t) if i else ms[how]
    fastest = min(ms, key=lambda how: ms[how])
    free = [how for how in ("kernel", "linear") if how in ms and ms[how] <= 1.03 * ms[fastest]]
    best = free[0] if free else fastest
    return ways[best], best, ms


class FastWeights:
    """Mode 8's weights (built once per model and chunk count): per role of the family's step
    (``step.ROLES``), the packed copies, ``F.linear`` or the C++ kernel over the model's own
    weights, or the kernel over an interleaved copy, whichever measured fastest here
    (``choice``, ``tuned_ms``; ``tune_s`` the seconds that took, set-up never part of a step);
    norms and the embedding are the model's own. ``step`` is the family's step weights over
    them."""

    def __init__(self, model: CausalLM, chunks: int) -> None:
        self.chunks = chunks
        self.version = weights_version(model)
        t0 = time.perf_counter()
        self.choice: dict[str, str] = {}
        self.tuned_ms: dict[str, dict[str, float]] = {}
        family_step = families.step_of(model)
        own = family_step.role_modules(model)
        self.linears: dict[str, list[Linear]] = {}
        for role in family_step.ROLES:
            packed = [PackedLinear.from_out_in(m.weight, m.bias, chunks) for m in own[role]]
            self.linears[role], self.choice[role], ms = _choose(packed, own[role], model.device,
                                                                model.dtype)
            del packed  # a role's copies not chosen are dropped here
            if ms:
                self.tuned_ms[role] = ms
        self.tune_s = time.perf_counter() - t0
        self.step = family_step.step_weights(model, self.linears)

    @property
    def extra_bytes(self) -> int:
        """Memory of the copies (weights transposed/split or interleaved, padded, biases)."""
        return sum(p.nbytes() for fns in self.linears.values() for p in fns)


@torch.no_grad()
def fast_weights(model: CausalLM | ModelState, chunks: int | None = None) -> FastWeights:
    """Packed copies of the model's weights, kept in its state while they are current (one
    packing per model at a time: each is as big as the weights)."""
    state = ModelState.of(model)
    n = default_chunks(state.model.device) if chunks is None else max(1, int(chunks))
    return state.cached(("packed",), lambda: FastWeights(state.model, n),
                        keep=lambda w: w.chunks == n
                        and w.version == weights_version(state.model))


PythonStep = Callable[..., torch.Tensor]


def steps_of(model: CausalLM, weights: Any) -> tuple[PythonStep, Fused | None]:
    """The family's one-token step over ``weights`` (its ``decode_step``) and its one-call C++
    form (its ``fused_step``; None where it does not apply)."""
    family_step = families.step_of(model)
    return family_step.decode_step, family_step.fused_step(weights)


class FastDecoder(Decoder):
    """Prefill through the model's ``forward`` into a preallocated cache, then the family's
    one-token step (its ``decode_step``) over the chosen copies."""

    appends = False  # its step is its own, not the model's forward

    def __init__(
        self, model: CausalLM | ModelState, *, batch_size: int = 1,
        capacity: int | None = None, chunks: int | None = None,
    ) -> None:
        super().__init__(model, batch_size=batch_size, capacity=capacity,
                         cache_kind="prealloc", mask="none", logits="last")
        self.weights = fast_weights(self.state, chunks)
        self.extra_bytes = self.weights.extra_bytes
        self.step_weights = self.weights.step  # what the family's step multiplies by
        self.python_step, self.fused = steps_of(self.model, self.step_weights)
        model = self.state.model
        attention = "kernel" if kernel_attends(model.device, model.dtype) else "sdpa"
        self.kernel = "; ".join([*(f"{role} {how}" for role, how in self.weights.choice.items()),
                                 f"attention {attention}",
                                 "one C++ call per step" if self.fused else "step in Python"])

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        pos = self._next_position()
        cache = self.cache
        if self.fused is not None and token.size(0) <= kernels.MAX_ROWS:
            logits = self.fused(token, pos, cache.k_buf, cache.v_buf)
        else:
            logits = self.python_step(self.step_weights, token, pos,
                                      attend_filled(cache.k_buf, cache.v_buf, pos))
        return self._stepped(token, logits)
