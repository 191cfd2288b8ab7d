"""Mode 6: the one decode step captured once into a CUDA graph and replayed every step; and
``GraphDecoder``, what every captured step shares (mode 6's and rung 16's,
``engine.decoders.triton_step``).

``GraphDecoder``: a preallocated cache and static inputs made once for ``batch_size``
sequences, the step over them captured after a few warm-up runs (``compile_s``, never inside a
timed step), the prefill through the model's ``forward`` into the same cache; each step writes
the token and position into the inputs and replays the graph.

Contract: ``CudaGraphDecoder`` is a ``Decoder`` (``prefill(idx) -> (B, vocab)``, ``step(token) ->
(B, vocab)``) that gives mode 1's greedy tokens in fp32, for every family with a one-token step.
It runs the family's step (``own_step``: its ``decode_step`` over its ``role_modules``, reached
through ``engine.families.step_of``) with a position that is a tensor:
``attend_static`` writes the new K/V row into the preallocated buffers with ``index_copy_`` and
attends over the whole capacity under a mask computed from the position, so every shape is fixed
whatever the position. Where Triton compiles for the GPU, the
attention is its decode kernel over rows 0..pos only (``engine.kernels.gpu.decode_attention``:
first light measured SDPA over the whole 1,024-slot cache at 74% of the step); without Triton,
SDPA over every slot under a mask.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .. import families
from ..families import make_cache
from ..kernels.gpu import triton_usable
from ..models.attention import attend_static
from ..models.base import CausalLM
from ..models.state import ModelState
from .eager import Decoder


def own_step(model: CausalLM, tables: dict[str, torch.Tensor] | None = None
             ) -> tuple[Callable[..., torch.Tensor], Any]:
    """(the family's one-token step, the model's own modules as its weights): its
    ``decode_step`` over its Linears by role, with its ``tables`` (RoPE's; else made here: mode
    6 builds its weights once; modes 7 and 9 inside the compiled call, with the tables buffers
    of theirs)."""
    step = families.step_of(model)
    return step.decode_step, step.step_weights(model, step.role_modules(model), tables=tables)


def graph_step(step: Callable[..., torch.Tensor], weights: Any, k_buf: torch.Tensor,
               v_buf: torch.Tensor, token: torch.Tensor, pos: torch.Tensor,
               triton: bool = False) -> torch.Tensor:
    """Mode 6's step: logits (B, vocab) for ``token`` (B, 1) at ``pos`` (a (1,) long tensor),
    its K/V rows written into ``k_buf``/``v_buf`` (L, B, n_kv, T_max, hs); every shape fixed.
    ``step``, ``weights``: ``own_step``'s. ``triton``: attention by the decode kernel over rows
    0..pos (else SDPA over every slot, masked; grouped-query heads either way)."""
    return step(weights, token, pos, attend_static(k_buf, v_buf, pos, triton))


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


class GraphDecoder(Decoder):
    """A decoder whose one-token step runs over static inputs and a preallocated cache, made once
    for ``batch_size`` sequences and captured into a CUDA graph (``capture``), replayed every
    step; uncaptured, the same step runs as it is (how the tests check it on a CPU). A way of
    stepping says how its inputs take the token and position (``write_inputs``) and what the
    step is (``run_step``: what is captured); the prefill goes through the model's ``forward``
    into the same cache, rows 0..T-1 overwritten."""

    appends = False  # its step is its own: one token per sequence

    def __init__(self, model: Any, *, batch_size: int = 1, capacity: int | None = None) -> None:
        super().__init__(model, batch_size=batch_size, capacity=capacity,
                         cache_kind="prealloc", mask="none", logits="last")
        self.cache = make_cache("prealloc", self.model, batch_size, self.capacity)
        self.graph: Any = None
        self.static_logits: torch.Tensor | None = None

    def write_inputs(self, token: torch.Tensor, pos: int) -> None:
        raise NotImplementedError

    def run_step(self) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def _capture(self, warmups: int) -> None:
        """``run_step`` captured into ``self.graph`` after ``warmups`` runs off the default
        stream (capture requires it; Triton compiles its kernels there); ``compile_s`` is the
        whole of it, never inside a timed step."""
        start = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmups):
                self.run_step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        self.static_logits = capture_and_upload(self.graph, self.run_step, torch.cuda.graph)
        torch.cuda.synchronize()
        self.compile_s = time.perf_counter() - start  # rows written here are overwritten later

    @torch.no_grad()
    def prefill(self, idx: torch.Tensor) -> torch.Tensor:
        self._check_batch(idx)
        self._start_seq(idx)
        self.cache.crop(0)  # the captured buffers are reused: prefill overwrites rows 0..T-1
        out, _ = self.model(idx, self.cache, logits="last")
        return out[:, -1, :]

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        pos = self._next_position()
        self.write_inputs(token, pos)
        if self.graph is None:
            logits = self.run_step().clone()  # a step's buffers are overwritten by the next
        else:
            self.graph.replay()
            logits = self.static_logits.clone()  # type: ignore[union-attr]  # (as a replay's)
        return self._stepped(token, logits)


class CudaGraphDecoder(GraphDecoder):
    """Mode 6: ``graph_step`` captured once per decoder and replayed every step.

    ``capture=False`` runs the same step eagerly (how the tests check it on a CPU).
    """

    def attended_keys(self, length: int) -> int:
        # The decode kernel reads the filled rows; SDPA every slot, masked (shapes never change).
        return length if self.triton else self.capacity

    def __init__(self, model: CausalLM | ModelState, *, batch_size: int = 1,
                 capacity: int | None = None, capture: bool = True,
                 triton: bool | None = None) -> None:
        super().__init__(model, batch_size=batch_size, capacity=capacity)
        self.step_fn, self.step_weights = own_step(self.model)
        dev = self.model.device
        self.capture = capture and dev.type == "cuda"
        if capture and not self.capture:
            raise ValueError("CUDA graphs need a CUDA GPU; the model is on " + str(dev))
        # The Triton decode attention wherever Triton can compile it; a test passes True to run
        # it on a CPU in Triton's interpreter.
        self.triton = triton_usable(dev) if triton is None else triton
        self.static_token = torch.zeros(batch_size, 1, dtype=torch.long, device=dev)
        self.static_pos = torch.zeros(1, dtype=torch.long, device=dev)
        if self.capture:
            self._capture(warmups=3)

    def write_inputs(self, token: torch.Tensor, pos: int) -> None:
        self.static_token.copy_(token)
        self.static_pos.fill_(pos)

    def run_step(self) -> torch.Tensor:
        return graph_step(self.step_fn, self.step_weights, self.cache.k_buf, self.cache.v_buf,
                          self.static_token, self.static_pos, self.triton)
