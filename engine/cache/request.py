"""A request served through the prefix cache: the KV cache its model's forward writes.

``PrefixCache.admit`` returns a ``Request``; it is the ``cache`` argument of the model's own
``forward`` (GPT-2's or the Llama family's, unchanged: both read ``length`` and call
``update(layer, k, v)`` per layer then ``advance(T)``). What it holds:

  table        block ids, one per ``block_tokens`` positions from 0: the tree's blocks it
               shares (positions below ``cached``, read only), the copy of the block where the
               hit ends mid-block, and blocks of its own taken as positions need them
  k, v         contiguous (L, 1, n_kv, capacity, hs) buffers the attention reads: the cached
               rows are copied in once at admission (torch has no attention that reads blocks
               in place), new rows are written there by ``update`` and, at ``advance``, into
               the request's own blocks. Read in place instead (``in_place``: the prefix cache
               on a GPU, ``PrefixCache(reads=)``), a request holds no buffers: ``attend`` writes
               each layer's new rows into its own blocks and runs our Triton paged attention
               through its table (vLLM's way): no copy at admission
  tokens       the prompt, then every token stepped; ``length`` rows are computed

  logits = req.prefill(model, chunk_tokens=None)   the prompt's uncached tokens (in chunks of
               ``chunk_tokens``), the last one's logits (1, vocab); ``should_stop`` (given to
               ``admit``) is polled before every layer, and a stop cancels the request
               (``RequestCancelled``: the tree as if it never ran)
  logits = req.step(model, token)                  one more token (at most ``max_new_tokens``)
  tokens = req.greedy(model, logits, n, eos_id)    n greedy tokens after ``logits`` (the last
               one picked but not fed, as a decode loop leaves it)

Every tensor is made on the model's device, in its dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class RequestCancelled(RuntimeError):
    """The request was stopped mid-prefill; it holds nothing any more."""


class Request:
    """One running request over the prefix cache (module docstring); ``cache`` is the
    ``PrefixCache`` that admitted it, ``node`` the tree node its cached prefix ends in."""

    def __init__(self, cache: Any, ids: list[int], max_new_tokens: int,
                 table: list[int], node: Any, cached: int,
                 should_stop: Callable[[], bool] | None = None) -> None:
        self.cache, self.tokens, self.table, self.node = cache, list(ids), table, node
        self.prompt_len, self.capacity = len(ids), len(ids) + max_new_tokens
        self.cached = cached  # tokens whose rows came from the tree
        self.length = 0  # rows computed or copied in (the cache API's length)
        self.should_stop = should_stop
        self.state = "running"
        self._polling = False
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.in_place = bool(getattr(cache, "in_place", False))
        self._table_t: torch.Tensor | None = None  # (1, blocks) on the device: the kernels'
        self._lengths: torch.Tensor | None = None  # (1,) int32: a step's length

    # ---------------------------------------------------------------- set-up and teardown
    def start(self, scratch: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Take the contiguous buffers and copy the cached rows into them (None: read in
        place, nothing to copy)."""
        if scratch is not None:
            self.k, self.v = scratch
            if self.cached:
                self.cache.pool.read_into(self.table, self.cached, self.k[:, 0], self.v[:, 0])
        self.length = self.cached

    def release(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand the buffers back (the cache keeps them for the next request)."""
        pair = (self.k, self.v)
        self.k = self.v = None
        return pair  # type: ignore[return-value]

    # ------------------------------------------------------------------ the KV cache API
    def _span(self, k: torch.Tensor) -> tuple[int, int]:
        """(start, end) of a forward's new rows; a stop asked for, or rows past the capacity
        the request was admitted for, end it here."""
        if self._polling and self.should_stop is not None and self.should_stop():
            raise RequestCancelled("stopped")
        start, end = self.length, self.length + k.size(2)
        if end > self.capacity:
            raise ValueError(f"this request was admitted for {self.capacity} tokens; this "
                             f"step would need {end}; allowed: max_new_tokens more at "
                             "admission")
        return start, end

    def attends(self, q: torch.Tensor) -> bool:
        """Read in place: ``attend`` takes every forward's attention."""
        return self.in_place

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        """In place: this layer's new rows k, v (1, n_kv, T, hs) into the request's own blocks,
        then y (1, nh, T, hs), each new token over rows 0..its position, through its table."""
        from ..kernels.gpu.decode_attention import decode_attention  # noqa: PLC0415 (triton)
        from ..kernels.gpu.paged_prefill import paged_prefill  # noqa: PLC0415
        from .paged import step_lengths  # noqa: PLC0415

        start, end = self._span(k)
        if layer == 0:  # blocks for the new rows (own ones: shared blocks are never written)
            self.cache.reserve(self, end)
            if self._table_t is None or self._table_t.size(1) != len(self.table):
                # a table only grows (blocks are appended): a copy when it does, not a step
                self._table_t = torch.tensor([self.table], dtype=torch.int64, device=q.device)
        self._lengths = step_lengths(self._lengths, layer, 1, end, q.device)
        self.cache.pool.write(self.table, start, k[0], v[0], layer=layer)
        kp, vp = self.cache.pool.layer_view(layer)
        if k.size(2) > 1:
            return paged_prefill(q.contiguous(), kp, vp, self._table_t, start)
        y = decode_attention(q[:, :, 0].contiguous(), kp, vp, self._lengths,
                             table=self._table_t)  # (1, nh, hs)
        return y.unsqueeze(2)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self._span(k)
        kb, vb = self.k[layer], self.v[layer]  # type: ignore[index]
        kb[:, :, start:end] = k
        vb[:, :, start:end] = v
        return kb[:, :, :end], vb[:, :, :end]  # (1, n_kv, S, hs), oldest first

    def advance(self, n_new: int) -> None:
        """The forward's rows are complete in every layer: into the request's own blocks."""
        start, end = self.length, self.length + n_new
        if not self.in_place:  # (in place, ``attend`` wrote them layer by layer)
            self.cache.reserve(self, end)
            k, v = self.k[:, 0, :, start:end], self.v[:, 0, :, start:end]  # type: ignore[index]
            self.cache.pool.write(self.table, start, k, v)
        self.length = end

    # ------------------------------------------------------------------------ generating
    def _ids(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor([tokens], dtype=torch.long, device=self.cache.pool.k.device)

    @torch.no_grad()
    def prefill(self, model: Any, chunk_tokens: int | None = None) -> torch.Tensor:
        """Logits (1, vocab) after the prompt, its uncached tokens computed here."""
        if self.state != "running":
            raise ValueError(f"this request is {self.state}; only a running request prefills")
        todo = self.prompt_len - self.length
        chunk = chunk_tokens or max(todo, 1)
        out = None
        self._polling = True
        try:
            for s in range(self.length, self.prompt_len, chunk):
                out, _ = model(self._ids(self.tokens[s : min(s + chunk, self.prompt_len)]),
                               self, logits="last")
        except RequestCancelled:
            done = self.length - self.cached
            self.cache.cancel(self)
            raise RequestCancelled(
                f"request cancelled after {done} of its {todo} uncached prompt tokens "
                f"({self.cached} came from the cache); its blocks went back to the pool and "
                "nothing of it entered the tree") from None
        except BaseException:
            self.cache.cancel(self)
            raise
        finally:
            self._polling = False
        if out is None:
            raise ValueError("the whole prompt came from the cache; a lookup leaves at least "
                             "its last token to compute")
        return out[:, -1, :]

    @torch.no_grad()
    def step(self, model: Any, token: int) -> torch.Tensor:
        """Logits (1, vocab) after feeding ``token``."""
        if self.state != "running":
            raise ValueError(f"this request is {self.state}; only a running request steps")
        if len(self.tokens) >= self.capacity:
            raise ValueError(f"this request was admitted for {self.capacity} tokens; allowed: "
                             "max_new_tokens more at admission")
        self.tokens.append(int(token))
        try:
            out, _ = model(self._ids([int(token)]), self, logits="last")
        except BaseException:
            self.cache.cancel(self)
            raise
        return out[:, -1, :]

    def greedy(self, model: Any, logits: torch.Tensor, n: int,
               eos_id: int | None = None) -> list[int]:
        """Up to ``n`` greedy tokens after ``logits``; stops after ``eos_id``."""
        out: list[int] = []
        for i in range(n):
            token = int(logits[0].argmax())
            out.append(token)
            if token == eos_id or i == n - 1:
                break
            logits = self.step(model, token)
        return out
