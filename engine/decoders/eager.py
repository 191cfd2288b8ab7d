"""The eager ``Decoder``: steps through the model's own ``forward``; every decoder's base class.

  decoder.prefill(idx)  -> logits (B, vocab) for the token after ``idx`` (B, T); starts a sequence
  decoder.step(token)   -> logits (B, vocab) after appending ``token`` (B, 1)
  decoder.seek(ids, t)  holds exactly ``ids[:, :t]`` afterwards, without logits: prefill, crop
                        or extend, whichever is cheapest from what it holds (set-up, untimed)
Uncached modes keep the whole sequence and re-run it every step; cached modes keep a KV cache.
This base class is modes 1-5, 10 and 11 (eager PyTorch through the model's ``forward`` -- any
family's -- with a cache kind, a causal-mask variant and a logits choice); the other ways of
stepping subclass it (``engine.decoders``). ``model`` is a model of
``engine.families`` or its ``engine.models.state.ModelState``: what a decoder builds on the model
(mask buffers, packed copies, compiled steps) is kept there, shared by every decoder of that model
(``decoder.state``).

Decoders whose steps go through the model's ``forward`` (``appends = True``: modes 1-5, 10, 11) also
take several tokens at once, ``decoder.append(tokens) -> (B, T, vocab)``, the path a multi-token
append (speculative decoding, a chunked prefill) would use; modes with a step of their own
(6-9) do not, and say so.

Every decoder reports two set-up costs that are never part of a step's time:
  ``decoder.compile_s``    seconds spent compiling / capturing before the first step (0 if none)
  ``decoder.extra_bytes``  bytes held besides the model and the KV cache (packed weight copies)
"""

from __future__ import annotations

import torch

from ..families import make_cache
from ..models.base import CausalLM
from ..models.state import ModelState


class Decoder:
    """Base: eager PyTorch through the model's ``forward`` with a cache kind, mask and logits
    choice."""

    appends = True  # False in subclasses whose step is their own (not the model's forward)

    def __init__(
        self,
        model: CausalLM | ModelState,
        *,
        batch_size: int = 1,
        capacity: int | None = None,
        cache_kind: str | None = "prealloc",
        mask: str | None = "none",
        logits: str = "last",
        reads: str | None = None,
    ) -> None:
        self.state = ModelState.of(model)
        self.model = self.state.model
        self.batch_size = batch_size
        self.capacity = capacity or self.model.config.block_size
        self.cache_kind = cache_kind
        self.reads = reads  # how a paged cache is read (engine.cache.paged); None: by device
        self.mask = mask  # None: the model's own variant (its config's)
        self.attention = self.state.attention(mask)  # engine.models.attention, buffers shared
        self.logits = logits
        self.cache = None
        self.seq: torch.Tensor | None = None
        self.compile_s = 0.0  # set-up time kept out of every step (compile, graph capture)
        self.extra_bytes = 0  # memory besides weights and cache (e.g. packed weight copies)

    @property
    def length(self) -> int:
        return 0 if self.seq is None else self.seq.size(1)

    def holds_sequence(self) -> bool:
        """Whether the cache this decoder filled still holds its sequence. A decoder whose
        buffers are shared with others of its mode (modes 7, 9) loses them when another one
        prefills: ``seek`` then starts afresh instead of stepping over someone else's rows."""
        return True

    def _start_seq(self, idx: torch.Tensor) -> None:
        # Tokens live in a buffer sized once, so a step appends without allocating.
        self._tokens = idx.new_empty(idx.size(0), max(self.capacity, idx.size(1)))
        self._tokens[:, : idx.size(1)] = idx
        self.seq = self._tokens[:, : idx.size(1)]

    def _push(self, token: torch.Tensor) -> None:
        assert self.seq is not None, "prefill first"
        n = self.seq.size(1)
        if n >= self._tokens.size(1):  # past the capacity: grow (the model will refuse later)
            self._tokens = torch.cat([self._tokens, torch.empty_like(self._tokens)], dim=1)
        self._tokens[:, n] = token[:, 0]
        self.seq = self._tokens[:, : n + 1]

    def _check_batch(self, idx: torch.Tensor) -> None:
        """A decoder whose buffers were made for ``batch_size`` sequences takes that many."""
        if idx.size(0) != self.batch_size:
            raise ValueError(f"this decoder was built for batch size {self.batch_size}, got "
                             f"{idx.size(0)} sequences")

    def _next_position(self) -> int:
        """Where a one-token step of its own writes the new K/V row of its preallocated cache
        (ValueError past the cache's capacity)."""
        assert self.seq is not None and self.cache is not None, "prefill first"
        pos = self.cache.length
        if pos + 1 > self.cache.capacity:
            raise ValueError(f"KV cache holds at most {self.cache.capacity} tokens; this step "
                             f"would need {pos + 1}")
        return pos

    def _stepped(self, token: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """After a one-token step of its own: the cache one row longer, the token kept."""
        self.cache.advance(1)
        self._push(token)
        return logits

    def rewind(self, length: int) -> None:
        """Forget every token from ``length`` on, so a step can be re-timed at the same context.

        Cached modes crop their cache (the next step overwrites the dropped rows).
        """
        if self.seq is None or not 1 <= length <= self.seq.size(1):
            raise ValueError(f"rewind length must be within 1..{self.length}, got {length}")
        self.seq = self._tokens[:, :length]
        if self.cache is not None:
            self.cache.crop(length)

    @torch.no_grad()
    def prefill(self, idx: torch.Tensor) -> torch.Tensor:
        self._start_seq(idx)
        if self.cache_kind is None:
            out, _ = self.model(idx, use_cache=False, logits=self.logits,
                                attention=self.attention)
        else:
            self.cache = make_cache(self.cache_kind, self.model, idx.size(0), self.capacity,
                                    reads=self.reads)
            out, _ = self.model(idx, self.cache, logits="last", attention=self.attention)
        return out[:, -1, :]

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        self._push(token)
        if self.cache_kind is None:
            out, _ = self.model(self.seq, use_cache=False, logits=self.logits,
                                attention=self.attention)
        else:
            out, _ = self.model(token, self.cache, logits="last", attention=self.attention)
        return out[:, -1, :]


    @torch.no_grad()
    def seek(self, ids: torch.Tensor, length: int) -> None:
        """Hold exactly the first ``length`` tokens of ``ids`` (B, >= length), so that the next
        ``step(ids[:, length:length + 1])`` is a step at context ``length + 1``.

        A cached mode crops its cache when ``ids`` extends what it holds past ``length``, fills
        it with the missing tokens when it holds fewer, and prefills afresh otherwise (a
        different prefix). An uncached mode only keeps the tokens: its step re-runs them all.
        """
        if not 1 <= length <= ids.size(1):
            raise ValueError(f"seek length must be within 1..{ids.size(1)}, got {length}")
        if self.cache_kind is None:
            self._start_seq(ids[:, :length])
            return
        held = self.length if self.holds_sequence() else 0
        same = held > 0 and torch.equal(self.seq[:, : min(held, length)],  # type: ignore[index]
                                        ids[:, : min(held, length)])
        # a cache that cannot go back (a sliding window's ring past its window) starts afresh
        back = getattr(self.cache, "can_crop", lambda n: True)(length)
        if not same or (held > length and not back):
            self.prefill(ids[:, :length])
        elif held >= length:
            self.rewind(length)  # the next step overwrites what came after
        else:
            self.extend(ids[:, held:length])

    @torch.no_grad()
    def extend(self, tokens: torch.Tensor) -> None:
        """Feed ``tokens`` (B, T) without their logits: set-up that fills the cache (any mode
        whose cache the model's ``forward`` can write, its own step or not), so a step can then
        be timed at a longer context without generating up to it."""
        for i in range(tokens.size(1)):
            self._push(tokens[:, i : i + 1])
        if self.cache is not None:
            self.model(tokens, self.cache, logits="last", attention=self.attention)

    def attended_keys(self, length: int) -> int:
        """Keys a step at sequence length ``length`` attends to (its FLOPs and bytes follow)."""
        return length

    @torch.no_grad()
    def append(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab) of ``tokens`` (B, T) appended at once after the sequence."""
        if not self.appends:
            raise NotImplementedError(f"{type(self).__name__} takes one token per step")
        for i in range(tokens.size(1)):
            self._push(tokens[:, i : i + 1])
        if self.cache_kind is None:
            out, _ = self.model(self.seq, use_cache=False, logits="all", attention=self.attention)
            return out[:, -tokens.size(1) :, :]
        out, _ = self.model(tokens, self.cache, logits="all", attention=self.attention)
        return out
