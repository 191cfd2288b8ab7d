"""Token generation: prefill then decode with the cache, or the naive loop without it.

``generate(model, prompt_ids, max_new_tokens, use_cache=True, ...)`` returns the new token ids
as a LongTensor (B, n), prompt excluded. ``generate_detailed`` returns the same plus per-step
times (device-synchronised) and, on request, each step's logits. ``on_token`` is called after
every step with a ``TokenEvent``; ``should_stop`` is polled between steps so a page can cancel.
Greedy decoding is deterministic; sampling (temperature, top-k) is reproducible via ``seed``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .model import GPT


@dataclass
class TokenEvent:
    step: int  # index of the generated token, 0-based
    token_ids: list[int]  # the new token of each sequence in the batch
    step_ms: float  # wall time of this step, synchronised with the device
    context_len: int  # tokens the step attended to (prompt + tokens fed back so far)
    phase: str  # "prefill" (first token, cache filled) | "decode" | "uncached"


@dataclass
class Generation:
    tokens: torch.Tensor  # (B, n) new tokens
    step_ms: list[float] = field(default_factory=list)
    context_len: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # (B, vocab) per step, on request
    stopped_early: bool = False

    @property
    def total_ms(self) -> float:
        return float(sum(self.step_ms))


def as_prompt_tensor(prompt_ids: object, model: GPT) -> torch.Tensor:
    """Validate a prompt (ids, list of id lists, or tensor) into a (B, T) LongTensor."""
    if isinstance(prompt_ids, torch.Tensor):
        ids = prompt_ids.detach().to("cpu", torch.long)
    else:
        seq = list(prompt_ids)  # type: ignore[call-overload]
        if seq and all(isinstance(x, (Sequence, torch.Tensor)) for x in seq):
            rows = [list(map(int, row)) for row in seq]
            if len({len(r) for r in rows}) > 1:
                raise ValueError("all prompts in a batch must have the same number of tokens")
            ids = torch.tensor(rows, dtype=torch.long)
        else:
            ids = torch.tensor([list(map(int, seq))], dtype=torch.long)
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


def checked_request(model: GPT, prompt_ids: object, max_new_tokens: int) -> torch.Tensor:
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
def generate_detailed(
    model: GPT,
    prompt_ids: object,
    max_new_tokens: int,
    use_cache: bool = True,
    *,
    cache_kind: str = "prealloc",
    logits: str = "all",
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int | None = None,
    keep_logits: bool = False,
    on_token: Callable[[TokenEvent], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    decoder: object | None = None,
) -> Generation:
    """Generate and time every step. ``logits`` ("all"|"last") applies to the uncached loop.

    ``decoder`` (an ``engine.modes.Decoder`` sized for this request) replaces the built-in
    cached/uncached calls, so any rung of the mode ladder generates through this same loop.
    """
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be 1 or more (or None), got {top_k}")
    idx = checked_request(model, prompt_ids, max_new_tokens)
    B, T0 = idx.shape
    device = model.device
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    out = Generation(tokens=torch.empty(B, 0, dtype=torch.long, device=device))
    new: list[torch.Tensor] = []
    if decoder is not None:
        use_cache = getattr(decoder, "cache_kind", None) is not None
    cache = None
    if use_cache and decoder is None:
        cache = model.make_cache(cache_kind, B, T0 + max_new_tokens)
    seq = idx  # the whole sequence: only the built-in uncached loop re-reads it
    nxt = idx
    for step in range(max_new_tokens):
        if should_stop is not None and should_stop():
            out.stopped_early = True
            break
        _sync(device)
        t0 = time.perf_counter()
        if decoder is not None:
            last = decoder.prefill(idx) if step == 0 else decoder.step(nxt)  # type: ignore[attr-defined]
        elif use_cache:
            last = model(nxt, cache, logits="last")[0][:, -1, :]  # (B, vocab)
        else:
            last = model(seq, use_cache=False, logits=logits)[0][:, -1, :]
        nxt = _pick(last, temperature, top_k, gen)  # (B, 1)
        _sync(device)
        step_ms = (time.perf_counter() - t0) * 1e3
        ctx = T0 + step
        phase = ("prefill" if step == 0 else "decode") if use_cache else "uncached"
        new.append(nxt)
        if not use_cache and decoder is None:
            seq = torch.cat([seq, nxt], dim=1)
        out.step_ms.append(step_ms)
        out.context_len.append(ctx)
        if keep_logits:
            out.logits.append(last.float().cpu())
        if on_token is not None:
            on_token(TokenEvent(step, nxt[:, 0].tolist(), step_ms, ctx, phase))
    if new:
        out.tokens = torch.cat(new, dim=1)
    return out


def generate(
    model: GPT,
    prompt_ids: object,
    max_new_tokens: int,
    use_cache: bool = True,
    **kwargs: object,
) -> torch.Tensor:
    """The generated token ids (B, n), prompt excluded. See ``generate_detailed`` for options."""
    return generate_detailed(model, prompt_ids, max_new_tokens, use_cache, **kwargs).tokens


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where two token streams differ (None if identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
