"""The one decode loop: prefill, then one token per step, through any ``Decoder``.

``decode(decoder, prompt, n)`` makes ``n`` decoder calls (the prefill, then ``n - 1`` steps) and
returns a ``Generation``: the ``n`` new tokens (B, n), the context each call attended to and,
when a ``timer`` is given, each call's time. Everything that generates -- pages, sweeps,
attribution, the mode gate, teacher-forced comparisons -- goes through this loop.

  timer        ``start()`` / ``stop() -> ms | None`` around each decoder call, nothing else (the
               token is picked outside the timed region); e.g.
               ``instruments.measure.timing.StepClock``
  feed         (B, n) tokens to feed back instead of the picked ones (teacher forcing); the
               picked tokens are still returned
  on_step      called after every call with a ``Step``; ``should_stop`` is polled before each
  keep_logits  keep each call's (B, vocab) logits, in fp32 on the CPU

Greedy by default; ``temperature`` > 0 samples (``top_k``, reproducible with ``seed``).
``random_prompt(model, batch, length, seed)`` is the one random-prompt helper (uniform ids on
the model's device). ``generate(model, prompt_ids, n)`` is the convenience wrapper: prompt
validation, a decoder for ``use_cache`` / ``mode``, and the tokens (B, n) back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .decoders import Decoder, make_decoder
from .models.base import CausalLM


class StepTimer(Protocol):
    """Brackets each decoder call; ``stop`` returns the call's ms, or None when not timed."""

    def start(self) -> None: ...
    def stop(self) -> float | None: ...


@dataclass
class Step:
    index: int  # 0 = the prefill
    context_len: int  # tokens the call attended to: prompt + tokens fed back so far
    token_ids: list[int]  # the token picked for each sequence of the batch
    step_ms: float | None  # the decoder call's time, when the timer timed it
    phase: str  # "prefill" | "decode" (cached modes) | "uncached"


@dataclass
class Generation:
    tokens: torch.Tensor  # (B, n) the picked tokens, prompt excluded
    context_len: list[int] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)  # the calls the timer timed, in order
    logits: list[torch.Tensor] = field(default_factory=list)  # (B, vocab) per call, on request
    stopped_early: bool = False

    @property
    def total_ms(self) -> float:
        return float(sum(self.step_ms))


def as_prompt_tensor(prompt_ids: object, model: CausalLM) -> torch.Tensor:
    """Validate a prompt (ids, list of id lists, or tensor) into a (B, T) LongTensor."""
    if isinstance(prompt_ids, torch.Tensor):
        ids = prompt_ids.detach().to("cpu", torch.long)
    else:
        seq = list(prompt_ids)  # type: ignore[call-overload]
        if seq and all(isinstance(x, (Sequence, torch.Tensor)) for x in seq):
            rows = [list(map(int, row)) for row in seq]
            if len({len(r) for r in rows}) > 1:
                raise ValueError("all prompts in a batch must have the same number of tokens")
            ids = torch.tensor(rows, dtype=torch.long)  # host: validated here
        else:
            ids = torch.tensor([list(map(int, seq))], dtype=torch.long)  # host: validated here
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.size(0) == 0 or ids.size(1) == 0:
        raise ValueError("the prompt is empty; give at least one token")
    vocab = model.config.vocab_size
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.numel():
        raise ValueError(
            f"token id {int(bad[0])} is outside the vocabulary; allowed: 0..{vocab - 1}"
        )
    return ids.to(model.device)

def random_prompt(model: CausalLM, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """(batch, length) token ids drawn uniformly from the vocabulary, on the model's device."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, length),  # host: same ids anywhere
                        generator=gen)
    return ids.to(model.device)


def checked_request(model: CausalLM, prompt_ids: object, max_new_tokens: int) -> torch.Tensor:
    """The prompt as (B, T) ids, after checking that it and ``max_new_tokens`` fit the model."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool):
        raise ValueError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be 0 or more, got {max_new_tokens}")
    idx = as_prompt_tensor(prompt_ids, model)
    T0, limit = idx.size(1), model.config.block_size
    if T0 + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({T0} tokens) + max_new_tokens ({max_new_tokens}) = {T0 + max_new_tokens} "
            f"is beyond the model's context limit of {limit}; allowed: max_new_tokens ≤ "
            f"{max(limit - T0, 0)} for this prompt"
        )
    return idx


def _pick(
    logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator | None
) -> torch.Tensor:
    """Next token (B, 1) from last-position logits (B, vocab)."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=gen)


@torch.no_grad()
def decode(
    decoder: Decoder,
    prompt: torch.Tensor,
    n: int,
    *,
    feed: torch.Tensor | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int | None = None,
    keep_logits: bool = False,
    timer: StepTimer | None = None,
    on_step: Callable[[Step], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Generation:
    """``n`` decoder calls on ``prompt`` (B, T): see the module docstring."""
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be 1 or more (or None), got {top_k}")
    if feed is not None and feed.size(1) < n - 1:
        raise ValueError(f"feed holds {feed.size(1)} tokens; {n - 1} are fed back")
    B, T0 = prompt.shape
    device = prompt.device
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    cached = getattr(decoder, "cache_kind", None) is not None
    # Tokens go into a buffer sized once: a step allocates nothing that outlives it.
    tokens = torch.empty(B, n, dtype=torch.long, device=device)
    out = Generation(tokens=tokens[:, :0])
    fed = prompt
    for i in range(n):
        if should_stop is not None and should_stop():
            out.stopped_early = True
            break
        if timer is not None:
            timer.start()
        logits = decoder.prefill(prompt) if i == 0 else decoder.step(fed)
        step_ms = timer.stop() if timer is not None else None
        # A peer's logits come back on the CPU: the token is picked, kept and fed back on the
        # prompt's device, where the model (ours or the peer's) reads its ids.
        nxt = _pick(logits.to(device), temperature, top_k, gen)  # (B, 1)
        tokens[:, i : i + 1] = nxt
        out.tokens = tokens[:, : i + 1]
        fed = tokens[:, i : i + 1] if feed is None else feed[:, i : i + 1]
        out.context_len.append(T0 + i)
        if step_ms is not None:
            out.step_ms.append(step_ms)
        if keep_logits:
            out.logits.append(logits.float().cpu())
        if on_step is not None:
            phase = ("prefill" if i == 0 else "decode") if cached else "uncached"
            on_step(Step(i, T0 + i, nxt[:, 0].tolist(), step_ms, phase))
    return out


def generate(
    model: CausalLM,
    prompt_ids: object,
    max_new_tokens: int,
    use_cache: bool = True,
    *,
    mode: str | None = None,
    cache_kind: str = "prealloc",
    logits: str = "all",
    **kwargs: object,
) -> torch.Tensor:
    """The generated token ids (B, n), prompt excluded.

    ``mode`` names a rung of the ladder (``engine.modes``); otherwise the model's own mask
    variant runs with a ``cache_kind`` cache, or without a cache (``logits`` "all" | "last").
    Other keywords go to ``decode``.
    """
    idx = checked_request(model, prompt_ids, max_new_tokens)
    capacity = idx.size(1) + max_new_tokens
    if mode is not None:
        dec = make_decoder(model, mode, batch_size=idx.size(0), capacity=capacity)
    elif use_cache:
        dec = Decoder(model, batch_size=idx.size(0), capacity=capacity, cache_kind=cache_kind,
                      mask=None)
    else:
        dec = Decoder(model, batch_size=idx.size(0), cache_kind=None, mask=None, logits=logits)
    return decode(dec, idx, max_new_tokens, **kwargs).tokens  # type: ignore[arg-type]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where two token streams differ (None if identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
