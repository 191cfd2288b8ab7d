"""Modes 6 (CUDA graph) and 7/9 (torch.compile): steps with static shapes or a read-only cache.

Contract: ``CudaGraphDecoder`` and ``CompiledDecoder`` are ``Decoder``s (``prefill(idx) -> (B,
vocab)``, ``step(token) -> (B, vocab)``) that give mode 1's greedy tokens in fp32.
``decoder.compile_s`` is the one-off cost (graph capture, or compilation) and is never inside a
timed step. Both need steps whose shapes do not change with the position, because
``GPT.forward`` passes positions as Python ints (a new graph per token):

- ``graph_step`` (mode 6) takes the position as a tensor, writes the new K/V row into the
  preallocated buffers with ``index_copy_`` and attends over the whole capacity under a mask
  computed from that tensor. Captured once per decoder, replayed every step.
- ``read_only_step`` (modes 7 and 9) only *reads* the cache and returns the new K/V rows; the
  caller writes them in place. Compiling a step that writes the cache either recompiles per
  position or copies the whole cache every step (measured, see the notes). On a CPU the cache is
  passed as a view of the filled length (one dynamic-shape graph); on a GPU as the full capacity
  with a mask (static shapes, so ``reduce-overhead`` can replay it as a CUDA graph).

Compiled steps are built once per (model, variant, batch size) and kept on the model, with a
static cache of ``block_size`` tokens that every decoder of that key shares (one live sequence
per key: a new prefill takes the buffers over; an older decoder then refuses to step).
"""

from __future__ import annotations

import importlib
import math
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .decoders import Decoder
from .kv_cache import PreallocKVCache
from .model import GPT

VARIANTS = ("compiled", "fast_compiled", "eager")  # "eager": the same step, not compiled (tests)


# ------------------------------------------------------------------------- the step functions
def graph_step(
    model: GPT, k_buf: torch.Tensor, v_buf: torch.Tensor, token: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    """Logits (B, vocab) for ``token`` (B, 1) at position ``pos`` (a (1,) long tensor).

    Writes the new K/V row of every layer into ``k_buf``/``v_buf`` (L, B, nh, T_max, hs) and
    attends over all T_max slots, masking those after ``pos``: every shape is fixed.
    """
    cfg, tr = model.config, model.transformer
    batch, n_embd, nh = token.size(0), cfg.n_embd, cfg.n_head
    hs = n_embd // nh
    t_max = k_buf.size(3)
    allowed = (torch.arange(t_max, device=pos.device) <= pos).view(1, 1, 1, t_max)
    x = tr.wte(token[:, 0]) + tr.wpe(pos)  # (B, C)
    for i, blk in enumerate(tr.h):
        q, k, v = blk.attn.c_attn(blk.ln_1(x)).view(batch, 3, nh, hs).unbind(1)  # (B, nh, hs)
        k_buf[i].index_copy_(2, pos, k.unsqueeze(2))
        v_buf[i].index_copy_(2, pos, v.unsqueeze(2))
        y = F.scaled_dot_product_attention(q.unsqueeze(2), k_buf[i], v_buf[i], attn_mask=allowed)
        x = x + blk.attn.c_proj(y.reshape(batch, n_embd))
        x = x + blk.mlp(blk.ln_2(x))
    return model.lm_head(tr.ln_f(x))


def read_only_step(
    model: GPT, token: torch.Tensor, k_past: torch.Tensor, v_past: torch.Tensor,
    pos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits (B, vocab), new keys, new values (L, B, nh, hs)); the cache is only read.

    ``k_past``/``v_past`` are (L, B, nh, P, hs). With ``pos`` None all P rows are the past and
    the new token sits at position P; otherwise rows >= ``pos`` are masked out (static shapes).
    Attention over past + new key is one softmax over the concatenated scores: the same sum as
    attending over a cache that already holds the new row.
    """
    cfg, tr = model.config, model.transformer
    batch, n_embd, nh = token.size(0), cfg.n_embd, cfg.n_head
    hs = n_embd // nh
    p_len = k_past.size(3)
    scale = 1.0 / math.sqrt(hs)
    if pos is None:
        x = tr.wte(token[:, 0]) + tr.wpe.weight[p_len]
        masked = None
    else:
        x = tr.wte(token[:, 0]) + tr.wpe(pos)
        masked = torch.arange(p_len, device=pos.device) >= pos  # (P,) True = not yet written
    new_k, new_v = [], []
    for i, blk in enumerate(tr.h):
        q, k, v = blk.attn.c_attn(blk.ln_1(x)).view(batch, 3, nh, hs).unbind(1)  # (B, nh, hs)
        new_k.append(k)
        new_v.append(v)
        q4 = q.unsqueeze(2)  # (B, nh, 1, hs)
        s_past = (q4 @ k_past[i].transpose(-1, -2)) * scale  # (B, nh, 1, P)
        if masked is not None:
            s_past = s_past.masked_fill(masked, float("-inf"))
        s_new = (q4 * k.unsqueeze(2)).sum(-1, keepdim=True) * scale  # (B, nh, 1, 1)
        w = torch.softmax(torch.cat([s_past, s_new], dim=-1), dim=-1)
        y = w[..., :p_len] @ v_past[i] + w[..., p_len:] * v.unsqueeze(2)  # (B, nh, 1, hs)
        x = x + blk.attn.c_proj(y.reshape(batch, n_embd))
        x = x + blk.mlp(blk.ln_2(x))
    return model.lm_head(tr.ln_f(x)), torch.stack(new_k), torch.stack(new_v)


class _ReadOnlyStep(nn.Module):
    """``read_only_step`` as a module, so torch.compile sees the weights as parameters."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, token: torch.Tensor, k_past: torch.Tensor, v_past: torch.Tensor,
                pos: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        return read_only_step(self.model, token, k_past, v_past, pos)


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


def _runner(model: GPT, variant: str, batch_size: int) -> _Runner:
    # Kept on the model (not in a WeakKeyDictionary: the runner references the model).
    runners: dict[tuple[str, int], _Runner] = model.__dict__.setdefault("_compiled_runners", {})
    key = (variant, batch_size)
    if key not in runners:
        runners[key] = _Runner(model, variant, batch_size)
    return runners[key]


class CompiledDecoder(Decoder):
    """Modes 7 ("compiled") and 9 ("fast_compiled"): prefill eagerly, then the compiled step."""

    appends = False  # its step is its own, not GPT.forward

    def attended_keys(self, length: int) -> int:
        # On a GPU the step is static-shaped: it attends over the whole cache under a mask.
        return self.runner.k_buf.size(3) if self.runner.static else length

    def __init__(self, model: GPT, *, batch_size: int = 1, capacity: int | None = None,
                 variant: str = "compiled") -> None:
        super().__init__(model, batch_size=batch_size, capacity=capacity,
                         cache_kind="prealloc", mask="none", logits="last")
        self.variant = variant
        self.runner = _runner(model, variant, batch_size)
        self.runner.warm(2, batch_size)  # compile now, outside any timed step
        self.compile_s = self.runner.compile_s
        if variant == "fast_compiled":
            # Freezing keeps packed copies of the Linear weights inside the compiled graph
            # (~494 MB for gpt2 in fp32, measured): an estimate, torch does not report it.
            self.extra_bytes = linear_weight_bytes(model)

    @torch.no_grad()
    def prefill(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.size(0) != self.runner.k_buf.size(1):
            raise ValueError(f"this decoder was built for batch size {self.runner.k_buf.size(1)}"
                             f", got a prompt of {idx.size(0)} sequences")
        self._start_seq(idx)
        self.cache = _cache_over(self.runner.k_buf, self.runner.v_buf)
        self.runner.owner = weakref.ref(self)  # weak: the model must not keep decoders alive
        out, _ = self.model(idx, self.cache, logits="last", mask="none")
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

    def __init__(self, model: GPT, *, batch_size: int = 1, capacity: int | None = None,
                 capture: bool = True) -> None:
        super().__init__(model, batch_size=batch_size, capacity=capacity,
                         cache_kind="prealloc", mask="none", logits="last")
        dev = model.device
        self.capture = capture and dev.type == "cuda"
        if capture and not self.capture:
            raise ValueError("CUDA graphs need a CUDA GPU; the model is on " + str(dev))
        self.cache = model.make_cache("prealloc", batch_size, self.capacity)
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
        out, _ = self.model(idx, self.cache, logits="last", mask="none")
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
