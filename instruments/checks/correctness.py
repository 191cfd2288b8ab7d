"""Correctness checks that must pass before any timing is trusted.

Each check returns a ``CheckResult`` (passed, a one-line detail, the measured number). Each runs
the model as it is configured (its own causal-mask variant), so that with one of the write-up's
silent bugs switched on (``instruments.checks.bugs``) the correctness lab can show which check
catches which bug.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.loop import as_prompt_tensor, first_difference, generate
from engine.models.base import CausalLM
from engine.models.state import ModelState
from instruments import lineup
from instruments.checks.gate import tolerance


@dataclass
class CheckResult:
    name: str
    passed: bool | None  # None: the check ran but cannot tell (see detail)
    detail: str
    value: float | None = None  # e.g. the max abs logit difference
    first_diff: int | None = None


def allowed(model: CausalLM, reference: torch.Tensor) -> float:
    """The largest |Δ logit| a correct computation may show: the dtype's share
    (``instruments.checks.gate.TOLERANCE``) of the reference's largest |logit|."""
    return tolerance(model.dtype) * float(reference.float().abs().max())


@torch.no_grad()
def logits_vs_transformers(
    model: CausalLM, prompt_ids: Sequence[int], tol: float | None = None
) -> CheckResult:
    """Max abs logit difference against ``transformers``' model of the same family (GPT-2's
    ``GPT2LMHeadModel``, the Llama family's ``LlamaForCausalLM``) holding the same weights."""
    idx = as_prompt_tensor(prompt_ids, model)
    ours, _ = model(idx, use_cache=False, attention=ModelState.of(model).attention())
    hf = lineup.reference(model)
    ref = hf(idx.cpu()).logits
    tol = allowed(model, ref) if tol is None else tol
    diff = float((ours.float().cpu() - ref.float()).abs().max())
    ok = diff <= tol
    return CheckResult("logits vs transformers", ok,
                       f"max |Δlogit| = {diff:.2e} (tolerance {tol:.1e})", diff)


def distinct_floor(new_tokens: int) -> int:
    """The fewest distinct tokens a stream of ``new_tokens`` must hold for "identical" to count
    (a fifth of them, at least 3): random weights at GPT-2's shapes repeat one token, and a
    broken cache can repeat it too."""
    return max(3, new_tokens // 5)


@torch.no_grad()
def uncached_part(model: CausalLM, prompt: torch.Tensor, cached: torch.Tensor) -> int | None:
    """Where the uncached greedy loop's stream parts from ``cached`` (B, n), the greedy tokens
    generated with a cache after ``prompt`` (B, T); None if it never does.

    Found with ONE uncached forward over prompt + cached tokens instead of n: a causal model's
    logits at position T + k - 1 of that forward are what the uncached loop computes after the
    prefix prompt + cached[:k] (the same sums; float32 rounding of a longer matmul may differ by
    ~1e-6 of the largest logit), so the loop's next token is their argmax for as long as the
    prefix is the loop's own stream -- that is, up to and including the first disagreement.
    On SmolLM2 at 200 tokens this is one forward of ~1 s on a CPU instead of 200."""
    T = prompt.size(1)
    full = torch.cat([prompt, cached[:, :-1]], 1)
    logits, _ = model(full, use_cache=False, attention=ModelState.of(model).attention())
    ours = logits[:, T - 1:].argmax(-1)  # (B, n): the uncached loop's token after each prefix
    differ = (ours != cached).any(0)
    return int(differ.nonzero()[0]) if bool(differ.any()) else None


@torch.no_grad()
def cached_equals_uncached(
    model: CausalLM, prompt_ids: object, new_tokens: int, cache_kind: str = "prealloc",
    min_distinct: int | None = None,
) -> CheckResult:
    """Greedy generation with the cache must give exactly the uncached loop's tokens
    (``uncached_part`` says where they part, in one forward).

    When the stream holds fewer than ``min_distinct`` distinct tokens (default
    ``distinct_floor``), equal streams prove little: the check is then inconclusive
    (``passed`` None), never passed.
    """
    idx = as_prompt_tensor(prompt_ids, model)
    a = generate(model, idx, new_tokens, use_cache=True, cache_kind=cache_kind)
    worst = uncached_part(model, idx, a)
    floor = distinct_floor(new_tokens) if min_distinct is None else min_distinct
    distinct = min(int(row.unique().numel()) for row in a)
    if worst is not None:
        detail = f"tokens differ from position {worst} ({cache_kind} cache)"
        return CheckResult("cached == uncached", False, detail, first_diff=worst)
    if distinct < floor and new_tokens > 4:
        return CheckResult("cached == uncached", None,  # type: ignore[arg-type]
                           f"inconclusive: {new_tokens} tokens identical, but the stream holds "
                           f"only {distinct} distinct token(s), fewer than {floor} "
                           f"({cache_kind} cache)", float(distinct))
    return CheckResult("cached == uncached", True,
                       f"{new_tokens} tokens identical, {distinct} distinct ({cache_kind} cache)",
                       float(distinct))


@torch.no_grad()
def multi_token_append(
    model: CausalLM,
    prompt_ids: object,
    prefill: int,
    append_sizes: Sequence[int] = (1, 2, 3, 7),
    cache_kind: str = "prealloc",
    tol: float | None = None,
) -> CheckResult:
    """Prefill ``prefill`` tokens, append n at once; logits must equal a full forward's."""
    idx = as_prompt_tensor(prompt_ids, model)
    need = prefill + max(append_sizes)
    if idx.size(1) < need:
        raise ValueError(f"the prompt needs at least {need} tokens for this check")
    attention = ModelState.of(model).attention()  # the model's own variant
    full, _ = model(idx[:, :need], use_cache=False, attention=attention)
    tol = allowed(model, full) if tol is None else tol
    worst = 0.0
    for n in append_sizes:
        cache = lineup.make_cache(cache_kind, model, idx.size(0), need)
        model(idx[:, :prefill], cache, attention=attention)
        got, _ = model(idx[:, prefill : prefill + n], cache, attention=attention)
        want = full[:, prefill : prefill + n]
        worst = max(worst, float((got - want).abs().max()))
    ok = worst <= tol
    sizes = ", ".join(map(str, append_sizes))
    return CheckResult(f"append {sizes} tokens at once", ok,
                       f"max |Δlogit| = {worst:.2e} vs full forward ({cache_kind} cache, "
                       f"tolerance {tol:.1e})", worst)


@dataclass
class Verdict:
    identical: bool
    first_diff: int | None  # position in the generated stream (0 = first new token)
    token_a: int | None = None
    token_b: int | None = None
    logit_gap_a: float | None = None  # in run A's logits: logit[token_a] - logit[token_b]
    logit_gap_b: float | None = None  # in run B's logits: logit[token_b] - logit[token_a]


def compare_streams(
    tokens_a: Sequence[int],
    tokens_b: Sequence[int],
    logits_a: Sequence[torch.Tensor] = (),
    logits_b: Sequence[torch.Tensor] = (),
    row: int = 0,
) -> Verdict:
    """Where two generations part, and how close the two choices were in each run's logits."""
    d = first_difference(list(tokens_a), list(tokens_b))
    if d is None:
        return Verdict(True, None)
    if d >= min(len(tokens_a), len(tokens_b)):
        return Verdict(False, d)
    ta, tb = int(tokens_a[d]), int(tokens_b[d])
    gap_a = gap_b = None
    if len(logits_a) > d:
        gap_a = float(logits_a[d][row, ta] - logits_a[d][row, tb])
    if len(logits_b) > d:
        gap_b = float(logits_b[d][row, tb] - logits_b[d][row, ta])
    return Verdict(False, d, ta, tb, gap_a, gap_b)
