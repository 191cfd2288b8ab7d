"""Modes 6 (CUDA graph) and 7/9 (torch.compile): the one decode step, captured or compiled.

Contract: ``CudaGraphDecoder`` and ``CompiledDecoder`` are ``Decoder``s (``prefill(idx) -> (B,
vocab)``, ``step(token) -> (B, vocab)``) that give mode 1's greedy tokens in fp32.
``decoder.compile_s`` is the one-off cost (graph capture, or compilation) and is never inside a
timed step. Both run ``engine.step.decode_step`` over the model's own modules, with a position
that is a tensor, because ``GPT.forward`` takes positions as Python ints (a new graph per
token); they differ only in how the step meets the KV cache:

- mode 6 (``graph_step``): ``attend_static`` writes the new K/V row into the preallocated
  buffers with ``index_copy_`` and attends over the whole capacity under a mask computed from
  the position. Captured once per decoder, replayed every step.
- modes 7 and 9 (``_ReadOnlyStep``): ``attend_read_only`` only *reads* the cache and returns the
  new K/V rows; the caller writes them in place. Compiling a step that writes the cache either
  recompiles per position or copies the whole cache every step (measured, see the notes). On a
  CPU the cache is passed as a view of the filled length (one dynamic-shape graph); on a GPU as
  the full capacity with a mask (static shapes, so ``reduce-overhead`` can replay it as a CUDA
  graph).

Compiled steps are built once per (model, variant, batch size) and kept in the model's
``engine.state.ModelState``, with a static cache of ``block_size`` tokens that every decoder of
that key shares (one live sequence per key: a new prefill takes the buffers over; an older
decoder then refuses to step).
"""

from __future__ import annotations

import importlib
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .decoders import Decoder
from .kv_cache import PreallocKVCache, make_cache
from .model import GPT
from .state import ModelState
from .step import attend_read_only, attend_static, decode_step, model_weights

VARIANTS = ("compiled", "fast_compiled", "eager")  # "eager": the same step, not compiled (tests)


def graph_step(model: GPT, k_buf: torch.Tensor, v_buf: torch.Tensor, token: torch.Tensor,
               pos: torch.Tensor) -> torch.Tensor:
    """Mode 6's step: logits (B, vocab) for ``token`` (B, 1) at ``pos`` (a (1,) long tensor),
    its K/V rows written into ``k_buf``/``v_buf`` (L, B, nh, T_max, hs); every shape fixed."""
    return decode_step(model_weights(model), token, pos, attend_static(k_buf, v_buf, pos))


class _ReadOnlyStep(nn.Module):
    """Modes 7/9's step as a module, so torch.compile sees the weights as parameters:
    (logits (B, vocab), new keys, new values (L, B, nh, hs)); the cache is only read."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, token: torch.Tensor, k_past: torch.Tensor, v_past: torch.Tensor,
                pos: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        new_k: list[torch.Tensor] = []
        new_v: list[torch.Tensor] = []
        attend = attend_read_only(k_past, v_past, pos, new_k, new_v)
        # pos None: every row given is the past, so the new token sits right after them
        at = k_past.size(3) if pos is None else pos
        logits = decode_step(model_weights(self.model), token, at, attend)
        return logits, torch.stack(new_k), torch.stack(new_v)


def linear_weight_bytes(model: GPT) -> int:
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

    def __init__(self, model: GPT, variant: str, batch_size: int) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; allowed: {', '.join(VARIANTS)}")
        cfg = model.config
        self.device = model.device
        self.static = self.device.type == "cuda"  # GPU: full capacity + mask (CUDA graphs)
        shape = (cfg.n_layer, batch_size, cfg.n_head, cfg.block_size, cfg.head_dim)
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

    appends = False  # its step is its own, not GPT.forward

    def attended_keys(self, length: int) -> int:
        # On a GPU the step is static-shaped: it attends over the whole cache under a mask.
        return self.runner.k_buf.size(3) if self.runner.static else length

    def __init__(self, model: GPT | ModelState, *, batch_size: int = 1,
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

    @torch.no_grad()
    def prefill(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.size(0) != self.runner.k_buf.size(1):
            raise ValueError(f"this decoder was built for batch size {self.runner.k_buf.size(1)}"
                             f", got a prompt of {idx.size(0)} sequences")
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
        if self.runner.owner() is not self:
            raise RuntimeError("another decoder of this mode and batch size has started a "
                               "sequence on this model; prefill again to continue")
        pos = self.cache.length
        if pos + 1 > self.cache.capacity:
            raise ValueError(f"KV cache holds at most {self.cache.capacity} tokens; "
                             f"this step would need {pos + 1}")
        logits = self.runner.step(token, pos)
        self.cache.advance(1)
        self._push(token)
        return logits


def capture_and_upload(graph: Any, step: Callable[[], torch.Tensor],
                       capture: Callable[..., Any]) -> torch.Tensor:
    """Capture ``step`` into ``graph``, then replay it once so the graph is uploaded now.

    The first replay of a fresh graph uploads it to the device: left to the first timed step,
    it inflates the sweep's first point. Capture uses the thread-local mode, so CUDA work that
    another thread of this process issues meanwhile cannot break it (the global mode would).
    """
    with capture(graph, capture_error_mode="thread_local"):
        out = step()
    graph.replay()
    return out


class CudaGraphDecoder(Decoder):
    """Mode 6: ``graph_step`` captured once per decoder and replayed every step.

    ``capture=False`` runs the same step eagerly (how the tests check it on a CPU).
    """

    appends = False  # its step is its own, not GPT.forward

    def attended_keys(self, length: int) -> int:
        return self.capacity  # every slot of the cache, masked: the shapes never change

    def __init__(self, model: GPT | ModelState, *, batch_size: int = 1,
                 capacity: int | None = None, capture: bool = True) -> None:
        super().__init__(model, batch_size=batch_size, capacity=capacity,
                         cache_kind="prealloc", mask="none", logits="last")
        dev = self.model.device
        self.capture = capture and dev.type == "cuda"
        if capture and not self.capture:
            raise ValueError("CUDA graphs need a CUDA GPU; the model is on " + str(dev))
        self.cache = make_cache("prealloc", self.model, batch_size, self.capacity)
        self.static_token = torch.zeros(batch_size, 1, dtype=torch.long, device=dev)
        self.static_pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.graph: Any = None
        if self.capture:
            self._capture()

    @torch.no_grad()
    def _capture(self) -> None:
        start = time.perf_counter()
        cache = self.cache
        args = (self.model, cache.k_buf, cache.v_buf, self.static_token, self.static_pos)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
            for _ in range(3):
                graph_step(*args)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        self.static_logits = capture_and_upload(self.graph, lambda: graph_step(*args),
                                                torch.cuda.graph)
        torch.cuda.synchronize()
        self.compile_s = time.perf_counter() - start  # rows written here are overwritten later

    @torch.no_grad()
    def prefill(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.size(0) != self.static_token.size(0):
            raise ValueError(f"this decoder was built for batch size "
                             f"{self.static_token.size(0)}, got {idx.size(0)} sequences")
        self._start_seq(idx)
        self.cache.crop(0)  # re-use the captured buffers: prefill overwrites rows 0..T-1
        out, _ = self.model(idx, self.cache, logits="last")
        return out[:, -1, :]

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        assert self.seq is not None, "prefill first"
        pos = self.cache.length
        if pos + 1 > self.cache.capacity:
            raise ValueError(f"KV cache holds at most {self.cache.capacity} tokens; "
                             f"this step would need {pos + 1}")
        self.static_token.copy_(token)
        self.static_pos.fill_(pos)
        if self.graph is not None:
            self.graph.replay()
            logits = self.static_logits.clone()  # the next replay overwrites static_logits
        else:
            logits = graph_step(self.model, self.cache.k_buf, self.cache.v_buf,
                                self.static_token, self.static_pos)
        self.cache.advance(1)
        self._push(token)
        return logits
