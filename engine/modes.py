"""The ladder of decode modes, each a ``Decoder`` with the same two calls.

  decoder.prefill(idx)  -> logits (B, vocab) for the token after ``idx`` (B, T); starts a sequence
  decoder.step(token)   -> logits (B, vocab) after appending ``token`` (B, 1)
Uncached modes keep the whole sequence and re-run it every step; cached modes keep a KV cache.
Every mode is registered in ``MODES`` with a label; faster modes (CUDA graph, torch.compile,
the fast CPU path) register themselves through ``register_mode``. ``check_mode`` compares a
mode's greedy tokens with mode 1's; the sweep refuses to time a mode that disagrees.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .model import GPT


@dataclass(frozen=True)
class ModeSpec:
    name: str
    label: str  # shown in the UI, with its rung number
    cached: bool
    description: str
    factory: Callable[..., Decoder]
    available: Callable[[GPT], tuple[bool, str]] = lambda model: (True, "")
    exact: bool = True  # expected to give mode 1's tokens exactly (fp32, greedy)


class Decoder:
    """Base: eager PyTorch through ``GPT.forward`` with a cache kind, mask and logits choice."""

    def __init__(
        self,
        model: GPT,
        *,
        batch_size: int = 1,
        capacity: int | None = None,
        cache_kind: str | None = "prealloc",
        mask: str = "none",
        logits: str = "last",
    ) -> None:
        self.model = model
        self.batch_size = batch_size
        self.capacity = capacity or model.config.block_size
        self.cache_kind = cache_kind
        self.mask = mask
        self.logits = logits
        self.cache = None
        self.seq: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.seq is None else self.seq.size(1)

    @torch.no_grad()
    def prefill(self, idx: torch.Tensor) -> torch.Tensor:
        self.seq = idx
        if self.cache_kind is None:
            out, _ = self.model(idx, use_cache=False, logits=self.logits, mask=self.mask)
        else:
            self.cache = self.model.make_cache(self.cache_kind, idx.size(0), self.capacity)
            out, _ = self.model(idx, self.cache, logits="last", mask=self.mask)
        return out[:, -1, :]

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        assert self.seq is not None, "prefill first"
        self.seq = torch.cat([self.seq, token], dim=1)
        if self.cache_kind is None:
            out, _ = self.model(self.seq, use_cache=False, logits=self.logits, mask=self.mask)
        else:
            out, _ = self.model(token, self.cache, logits="last", mask=self.mask)
        return out[:, -1, :]


MODES: dict[str, ModeSpec] = {}


def register_mode(spec: ModeSpec) -> None:
    MODES[spec.name] = spec


register_mode(ModeSpec(
    "uncached", "1 · no cache, logits at every position", False,
    "The naive loop: the whole sequence re-run every step, output projection on every position.",
    lambda m, **kw: Decoder(m, cache_kind=None, mask="seed", logits="all", **kw)))
register_mode(ModeSpec(
    "uncached_last", "2 · no cache, last-position logits", False,
    "Still re-runs the sequence, but projects only the last position onto the vocabulary.",
    lambda m, **kw: Decoder(m, cache_kind=None, mask="seed", logits="last", **kw)))
register_mode(ModeSpec(
    "concat", "3 · concatenating KV cache (the write-up's)", True,
    "torch.cat grows the cache every step; explicit attention with the fp32 mask buffers.",
    lambda m, **kw: Decoder(m, cache_kind="concat", mask="seed", **kw)))
register_mode(ModeSpec(
    "prealloc", "4 · preallocated cache, written in place", True,
    "Cache buffers sized once, new keys/values written at their position; same attention.",
    lambda m, **kw: Decoder(m, cache_kind="prealloc", mask="seed", **kw)))
register_mode(ModeSpec(
    "prealloc_fused", "5 · preallocated cache + fused attention, no stored mask", True,
    "scaled_dot_product_attention applies causality itself: no mask buffers at all.",
    lambda m, **kw: Decoder(m, cache_kind="prealloc", mask="none", **kw)))

# Modes 1 vs 3 are what the write-up compared as "no cache" vs "KV cache".
SEED_PAIR = ("uncached", "concat")


def mode_available(model: GPT, name: str) -> tuple[bool, str]:
    if name not in MODES:
        return False, f"unknown mode {name!r}; allowed: {', '.join(MODES)}"
    return MODES[name].available(model)


def make_decoder(model: GPT, name: str, **kwargs: object) -> Decoder:
    ok, why = mode_available(model, name)
    if not ok:
        raise ValueError(why)
    return MODES[name].factory(model, **kwargs)


@torch.no_grad()
def greedy_tokens(decoder: Decoder, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """n greedy tokens (B, n) through a decoder."""
    logits = decoder.prefill(prompt)
    out = []
    for i in range(n):
        nxt = logits.argmax(-1, keepdim=True)
        out.append(nxt)
        if i + 1 < n:
            logits = decoder.step(nxt)
    return torch.cat(out, dim=1)


@dataclass
class ModeCheck:
    mode: str
    passed: bool
    detail: str


def check_mode(model: GPT, name: str, prompt: torch.Tensor, n: int = 24) -> ModeCheck:
    """Greedy tokens of ``name`` must equal mode 1's (the naive loop) before it is timed."""
    want = greedy_tokens(make_decoder(model, "uncached", batch_size=prompt.size(0)), prompt, n)
    got = greedy_tokens(make_decoder(model, name, batch_size=prompt.size(0)), prompt, n)
    if torch.equal(want, got):
        return ModeCheck(name, True, f"{n} greedy tokens identical to mode 1")
    diff = (want != got).nonzero()
    pos = int(diff[0, 1])
    return ModeCheck(name, False, f"differs from mode 1 at new token {pos}: "
                                  f"{int(got[0, pos])} instead of {int(want[0, pos])}")
