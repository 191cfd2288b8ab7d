"""Modes 7 and 9 (torch.compile): the one decode step, compiled.

Shares the family's one-token step with modes 6 and 8 and the eager ``Decoder``'s prefill.
Contract: ``CompiledDecoder`` is a ``Decoder`` (``prefill(idx) -> (B, vocab)``, ``step(token) ->
(B, vocab)``) that gives mode 1's greedy tokens in fp32, for every family with a one-token step.
``decoder.compile_s`` is the one-off compilation, never inside a timed step. It runs the
family's step over the model's own modules (``captured.own_step``; the family's ``tables`` --
RoPE's -- buffers of the compiled module) with a position that is a tensor, because the
models' ``forward`` takes positions as Python ints (a new graph per token). How the step meets
the KV cache (mode 6, ``engine.decoders.captured``, writes it inside its graph instead):

- modes 7 and 9 (``_ReadOnlyStep``): ``attend_read_only`` only *reads* the cache and returns the
  new K/V rows; the caller writes them in place. Compiling a step that writes the cache either
  recompiles per position or copies the whole cache every step (measured, see the notes). On a
  CPU the cache is passed as a view of the filled length (one dynamic-shape graph); on a GPU as
  the full capacity with a mask (static shapes, so ``reduce-overhead`` can replay it as a CUDA
  graph).

Compiled steps are built once per (model, variant, batch size) and kept in the model's
``engine.models.state.ModelState``, with a static cache of ``block_size`` tokens that every
decoder of that key shares (one live sequence per key: a new prefill takes the buffers over; an
older decoder then refuses to step).
"""

from __future__ import annotations

import importlib
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .. import families
from ..cache import PreallocKVCache
from ..models.attention import attend_read_only
from ..models.base import CausalLM
from ..models.state import ModelState
from .captured import own_step
from .eager import Decoder

VARIANTS = ("compiled", "fast_compiled", "eager")  # "eager": the same step, not compiled (tests)


class _ReadOnlyStep(nn.Module):
    """Modes 7/9's step as a module, so torch.compile sees the weights as parameters:
    (logits (B, vocab), new keys, new values (L, B, n_kv, hs)); the cache is only read."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        self.model = model
        tables = families.step_of(model).tables(model)  # made once: RoPE's angles
        self.table_names = tuple(tables)
        for name, table in tables.items():
            self.register_buffer(name, table, persistent=False)

    def weights(self) -> tuple[Callable[..., torch.Tensor], Any]:
        """The family's step and its weights (``own_step``), built inside the compiled call (the
        compiler reaches every module from the model it was given, as a forward would)."""
        return own_step(self.model, {name: getattr(self, name) for name in self.table_names})

    def forward(self, token: torch.Tensor, k_past: torch.Tensor, v_past: torch.Tensor,
                pos: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        new_k: list[torch.Tensor] = []
        new_v: list[torch.Tensor] = []
        attend = attend_read_only(k_past, v_past, pos, new_k, new_v)
        # pos None: every row given is the past, so the new token sits right after them
        at = k_past.size(3) if pos is None else pos
        step, weights = self.weights()
        logits = step(weights, token, at, attend)
        return logits, torch.stack(new_k), torch.stack(new_v)


def linear_weight_bytes(model: CausalLM) -> int:
    """Bytes of every Linear weight, the tied output projection included (gpt2 fp32: 494 MB)."""
    return sum(m.weight.numel() * m.weight.element_size()
               for m in model.modules() if isinstance(m, nn.Linear))


def _cache_over(k_buf: torch.Tensor, v_buf: torch.Tensor) -> PreallocKVCache:
    """A PreallocKVCache view of existing buffers (no new allocation)."""
    cache = PreallocKVCache.__new__(PreallocKVCache)
    cache.k_buf, cache.v_buf = k_buf, v_buf
    cache.n_layer, cache.capacity, cache.length = k_buf.size(0), k_buf.size(3), 0
    return cache


# ---------------------------------------------------------------------------- compiled runner
class _Runner:
    """One compiled step + its static cache, per (model, variant, batch size)."""

    def __init__(self, model: CausalLM, variant: str, batch_size: int) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; allowed: {', '.join(VARIANTS)}")
        cfg = model.config
        self.device = model.device
        self.static = self.device.type == "cuda"  # GPU: full capacity + mask (CUDA graphs)
        shape = (cfg.n_layer, batch_size, cfg.n_kv_head, cfg.block_size, cfg.head_dim)
        self.k_buf = torch.zeros(shape, device=self.device, dtype=model.dtype)
        self.v_buf = torch.zeros(shape, device=self.device, dtype=model.dtype)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.owner: Callable[[], object] = lambda: None  # weakref to the decoder in charge
        self.compile_s = 0.0
        self.warm_lengths: set[int] = set()
        module = _ReadOnlyStep(model).eval()
        self.fn: Any = module
        if variant != "eager":
            importlib.import_module("torch._dynamo")  # slow import: only when compiling

            if self.static:
                torch._dynamo.mark_static_address(self.k_buf)  # no copy-in before each replay
                torch._dynamo.mark_static_address(self.v_buf)
            kwargs: dict[str, Any] = {}
            if variant == "fast_compiled":
                # Freezing packs the weights; max_autotune picks generated GEMV kernels.
                kwargs["options"] = {"freezing": True, "max_autotune": True}
                if self.static:
                    kwargs["options"]["triton.cudagraphs"] = True
            elif self.static:
                kwargs["mode"] = "reduce-overhead"
            self.fn = torch.compile(module, **kwargs)

    @torch.no_grad()
    def warm(self, length: int, batch: int) -> None:
        """Run the step untimed at ``length`` cached tokens so every compile happens here."""
        key = 0 if self.static else min(length, 2)  # CPU: P=1 specialises, P>=2 is one graph
        if key in self.warm_lengths or isinstance(self.fn, _ReadOnlyStep):
            return  # warm already, or nothing to compile (the eager variant)
        start = time.perf_counter()
        token = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        for _ in range(3 if self.static else 1):  # cudagraph trees record on a later call
            self._call(token, max(length, 1))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.compile_s += time.perf_counter() - start
        self.warm_lengths.add(key)

    def _call(self, token: torch.Tensor, pos: int) -> tuple[torch.Tensor, ...]:
        if self.static:
            self.pos.fill_(pos)
            return self.fn(token, self.k_buf, self.v_buf, self.pos)
        k_past, v_past = self.k_buf[:, :, :, :pos], self.v_buf[:, :, :, :pos]
        if not isinstance(self.fn, _ReadOnlyStep):
            torch._dynamo.maybe_mark_dynamic(k_past, 3)  # one graph for every length >= 2
            torch._dynamo.maybe_mark_dynamic(v_past, 3)
        return self.fn(token, k_past, v_past)

    @torch.no_grad()
    def step(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        logits, k_new, v_new = self._call(token, pos)
        if self.static:  # write after the replay: the compiled graph never mutates the cache
            self.k_buf.index_copy_(3, self.pos, k_new.unsqueeze(3))
            self.v_buf.index_copy_(3, self.pos, v_new.unsqueeze(3))
            return logits.clone()  # a CUDA-graph output is overwritten by the next replay
        self.k_buf[:, :, :, pos] = k_new
        self.v_buf[:, :, :, pos] = v_new
        return logits


def _runner(state: ModelState, variant: str, batch_size: int) -> _Runner:
    """The compiled step of ``variant`` at ``batch_size``, built once per model state."""
    return state.cached(("compiled", variant, batch_size),
                        lambda: _Runner(state.model, variant, batch_size))


class CompiledDecoder(Decoder):
    """Modes 7 ("compiled") and 9 ("fast_compiled"): prefill eagerly, then the compiled step."""

    appends = False  # its step is its own, not the model's forward

    def attended_keys(self, length: int) -> int:
        # On a GPU the step is static-shaped: it attends over the whole cache under a mask.
        return self.runner.k_buf.size(3) if self.runner.static else length

    def __init__(self, model: CausalLM | ModelState, *, batch_size: int = 1,
                 capacity: int | None = None, variant: str = "compiled") -> None:
        super().__init__(model, batch_size=batch_size, capacity=capacity,
                         cache_kind="prealloc", mask="none", logits="last")
        self.variant = variant
        self.runner = _runner(self.state, variant, batch_size)
        self.runner.warm(2, batch_size)  # compile now, outside any timed step
        self.compile_s = self.runner.compile_s
        if variant == "fast_compiled":
            # Freezing keeps packed copies of the Linear weights inside the compiled graph
            # (~494 MB for gpt2 in fp32, measured): an estimate, torch does not report it.
            self.extra_bytes = linear_weight_bytes(self.model)

    def holds_sequence(self) -> bool:
        return self.runner.owner() is self

    @torch.no_grad()
    def prefill(self, idx: torch.Tensor) -> torch.Tensor:
        self._check_batch(idx)  # the shared buffers are this batch size's
        self._start_seq(idx)
        self.cache = _cache_over(self.runner.k_buf, self.runner.v_buf)
        self.runner.owner = weakref.ref(self)  # weak: the model must not keep decoders alive
        out, _ = self.model(idx, self.cache, logits="last")
        if idx.size(1) == 1:  # the first step sees one cached token: its own graph on a CPU
            self.runner.warm(1, idx.size(0))
            self.compile_s = self.runner.compile_s
        return out[:, -1, :]

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        assert self.cache is not None, "prefill first"
        if not self.holds_sequence():
            raise RuntimeError("another decoder of this mode and batch size has started a "
                               "sequence on this model; prefill again to continue")
        pos = self._next_position()
        return self._stepped(token, self.runner.step(token, pos))
