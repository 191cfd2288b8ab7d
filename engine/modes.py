"""The ladder of decode modes, each a ``Decoder`` with the same two calls.

  decoder.prefill(idx)  -> logits (B, vocab) for the token after ``idx`` (B, T); starts a sequence
  decoder.step(token)   -> logits (B, vocab) after appending ``token`` (B, 1)
Uncached modes keep the whole sequence and re-run it every step; cached modes keep a KV cache.
Every mode is registered in ``MODES`` with a label. Modes 6-9 live in ``engine.compiled`` and
``engine.fast`` and are registered here through lazy factories, so importing this module stays
cheap and never imports ``torch._dynamo``. ``check_mode`` compares a mode's greedy tokens with
mode 1's; the sweep refuses to time a mode that disagrees.

Every decoder reports two set-up costs that are never part of a step's time:
  ``decoder.compile_s``    seconds spent compiling / capturing before the first step (0 if none)
  ``decoder.extra_bytes``  bytes held besides the model and the KV cache (packed weight copies)
``ModeSpec.slow_setup`` marks modes whose first use costs minutes (torch.compile on a CPU):
sweeps and pages should offer them but not include them by default.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .generate import Generation, TokenEvent, checked_request, generate_detailed
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
    slow_setup: bool = False  # first use compiles for minutes: opt-in, never a default


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
        self.compile_s = 0.0  # set-up time kept out of every step (compile, graph capture)
        self.extra_bytes = 0  # memory besides weights and cache (e.g. packed weight copies)

    @property
    def length(self) -> int:
        return 0 if self.seq is None else self.seq.size(1)

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
            out, _ = self.model(idx, use_cache=False, logits=self.logits, mask=self.mask)
        else:
            self.cache = self.model.make_cache(self.cache_kind, idx.size(0), self.capacity)
            out, _ = self.model(idx, self.cache, logits="last", mask=self.mask)
        return out[:, -1, :]

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        self._push(token)
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


def _lazy_factory(module: str, cls: str, **fixed: object) -> Callable[..., Decoder]:
    """A factory that imports its module on first use (torch._dynamo is slow to import)."""

    def make(model: GPT, **kw: object) -> Decoder:
        mod = importlib.import_module(f"engine.{module}")
        return getattr(mod, cls)(model, **fixed, **kw)

    return make


def _lazy_available(module: str, func: str) -> Callable[[GPT], tuple[bool, str]]:
    def available(model: GPT) -> tuple[bool, str]:
        return getattr(importlib.import_module(f"engine.{module}"), func)(model)

    return available


register_mode(ModeSpec(
    "cuda_graph", "6 · CUDA graph of the whole decode step", True,
    "The decode step is captured once over the preallocated cache and replayed with one "
    "launch; positions live in a tensor, attention spans the whole capacity under a mask.",
    _lazy_factory("compiled", "CudaGraphDecoder"),
    _lazy_available("compiled", "cuda_graph_available")))
register_mode(ModeSpec(
    "compiled", "7 · torch.compile of the decode step", True,
    "torch.compile (reduce-overhead on a GPU, inductor on a CPU) of a step that only reads the "
    "cache; the caller writes the new key/value row. Compile time is reported apart.",
    _lazy_factory("compiled", "CompiledDecoder", variant="compiled"),
    _lazy_available("compiled", "compiled_available"), slow_setup=True))
register_mode(ModeSpec(
    "fast", "8 · fast CPU path (transposed weights, split matmuls)", True,
    "Weights copied once to [in, out] (split across the cores) with a transposed copy of the "
    "output projection, preallocated cache, fused attention: streams the weights faster.",
    _lazy_factory("fast", "FastDecoder"),
    _lazy_available("fast", "fast_available")))
register_mode(ModeSpec(
    "fast_compiled", "9 · fast path compiled (inductor freezing + max-autotune)", True,
    "torch.compile with freezing and max_autotune of the read-only step: packed weights and "
    "generated matrix-vector kernels. Minutes to compile on a CPU; holds packed weight copies.",
    _lazy_factory("compiled", "CompiledDecoder", variant="fast_compiled"),
    _lazy_available("compiled", "fast_compiled_available"), slow_setup=True))

# Modes 1 vs 3 are what the write-up compared as "no cache" vs "KV cache".
SEED_PAIR = ("uncached", "concat")


def mode_available(model: GPT, name: str) -> tuple[bool, str]:
    if name not in MODES:
        return False, f"unknown mode {name!r}; allowed: {', '.join(MODES)}"
    return MODES[name].available(model)


def default_modes(model: GPT) -> list[str]:
    """Modes available on this model's device that are cheap to set up (no minutes of compile)."""
    return [n for n, spec in MODES.items() if not spec.slow_setup and spec.available(model)[0]]


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


def generate_with_mode(
    model: GPT,
    name: str,
    prompt_ids: object,
    max_new_tokens: int,
    *,
    keep_logits: bool = False,
    on_token: Callable[[TokenEvent], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Generation:
    """Greedy generation through mode ``name``, every step timed with the device synchronised."""
    idx = checked_request(model, prompt_ids, max_new_tokens)
    dec = make_decoder(model, name, batch_size=idx.size(0), capacity=idx.size(1) + max_new_tokens)
    return generate_detailed(model, idx, max_new_tokens, keep_logits=keep_logits,
                             on_token=on_token, should_stop=should_stop, decoder=dec)
