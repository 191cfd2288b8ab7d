"""Mode 6: the one decode step captured once into a CUDA graph and replayed every step.

Contract: ``CudaGraphDecoder`` is a ``Decoder`` (``prefill(idx) -> (B, vocab)``, ``step(token) ->
(B, vocab)``) that gives mode 1's greedy tokens in fp32; ``decoder.compile_s`` is the capture,
never inside a timed step. It runs ``engine.models.gpt2.step.decode_step`` over the model's own
modules (``graph_step``) with a position
that is a tensor: ``attend_static`` writes the new K/V row into the preallocated buffers with
``index_copy_`` and attends over the whole capacity under a mask computed from the position, so
every shape is fixed whatever the position. Where Triton compiles for the GPU, the attention is
its decode kernel over rows 0..pos only (``engine.kernels.gpu.decode_attention``: first light
measured SDPA over the whole 1,024-slot cache at 74% of the step); without Triton, SDPA over
every slot under a mask.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..cache import make_cache
from ..kernels.gpu import triton_usable
from ..models.attention import attend_static
from ..models.gpt2.model import GPT
from ..models.gpt2.step import decode_step, model_weights
from ..models.state import ModelState
from .eager import Decoder


def graph_step(model: GPT, k_buf: torch.Tensor, v_buf: torch.Tensor, token: torch.Tensor,
               pos: torch.Tensor, triton: bool = False) -> torch.Tensor:
    """Mode 6's step: logits (B, vocab) for ``token`` (B, 1) at ``pos`` (a (1,) long tensor),
    its K/V rows written into ``k_buf``/``v_buf`` (L, B, nh, T_max, hs); every shape fixed.
    ``triton``: attention by the decode kernel over rows 0..pos (else SDPA, masked)."""
    return decode_step(model_weights(model), token, pos,
                       attend_static(k_buf, v_buf, pos, triton))


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
        # The decode kernel reads the filled rows; SDPA every slot, masked (shapes never change).
        return length if self.triton else self.capacity

    def __init__(self, model: GPT | ModelState, *, batch_size: int = 1,
                 capacity: int | None = None, capture: bool = True,
                 triton: bool | None = None) -> None:
        super().__init__(model, batch_size=batch_size, capacity=capacity,
                         cache_kind="prealloc", mask="none", logits="last")
        dev = self.model.device
        self.capture = capture and dev.type == "cuda"
        if capture and not self.capture:
            raise ValueError("CUDA graphs need a CUDA GPU; the model is on " + str(dev))
        # The Triton decode attention wherever Triton can compile it; a test passes True to run
        # it on a CPU in Triton's interpreter.
        self.triton = triton_usable(dev) if triton is None else triton
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
        args = (self.model, cache.k_buf, cache.v_buf, self.static_token, self.static_pos,
                self.triton)
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
                                self.static_token, self.static_pos, self.triton)
        self.cache.advance(1)
        self._push(token)
        return logits
