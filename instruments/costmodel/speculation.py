"""What speculative decoding should gain, from the measured multi-token verify curve. Torch-free.

One forward that appends m tokens costs t(m) (the ``verify`` table of ``instruments.
experiments.speculate``); a plain step is t(1). A draft of k tokens is verified by appending
m = k + 1 (the last token and the draft). With each draft token accepted independently with
probability alpha, a forward yields on average

    E[tokens per forward] = (1 - alpha^(k+1)) / (1 - alpha)        (k + 1 at alpha = 1)

so decoding speeds up by E / (t(k+1) / t(1)), and breaks even at the alpha where E equals
t(k+1) / t(1) (``break_even``): in the memory-bound regime t(k+1) ~ t(1) and any acceptance
wins; where a forward's cost grows like k + 1 (compute-bound), none does.

``VerifyCurve(rows).ms(context, m)`` reads t(m) at any context from the measured points: linear
in m between the measured m, and linear in the context between the measured contexts (the
nearest one outside them). ``speedups`` predicts a whole generation both ways -- from the
formula at the measured acceptance, and from the forwards that actually ran (their draft
lengths and contexts) -- counting the prefill both sides, as the measured times do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens per forward] for drafts of ``k`` tokens each accepted with probability alpha."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance must be within 0..1, got {alpha!r}")
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def break_even(ratio: float, k: int) -> float | None:
    """The acceptance at which drafts of ``k`` tokens pay for a verify forward costing ``ratio``
    = t(k+1)/t(1): 0.0 when any acceptance wins (ratio <= 1), None when none can (ratio >=
    k + 1, what a compute-bound forward costs)."""
    if ratio <= 1.0:
        return 0.0
    if ratio >= k + 1:
        return None
    lo, hi = 0.0, 1.0  # expected_tokens grows with alpha from 1 to k + 1
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < ratio else (lo, mid)
    return (lo + hi) / 2


def _linear(points: Sequence[tuple[float, float]], x: float) -> float:
    """y at x, linear between sorted (x, y) points, the end segments extended beyond them."""
    if len(points) == 1:
        return points[0][1]
    i = next((j for j in range(1, len(points)) if points[j][0] >= x), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class VerifyCurve:
    """t(context, m) in ms from verify rows (``context_len``, ``k`` = tokens appended,
    ``latency_ms``) of one mode."""

    def __init__(self, rows: Iterable[dict[str, Any]]) -> None:
        self.by_context: dict[int, list[tuple[float, float]]] = {}
        for r in rows:
            self.by_context.setdefault(int(r["context_len"]), []).append(
                (float(r["k"]), float(r["latency_ms"])))
        if not self.by_context:
            raise ValueError("no verify points to predict from")
        for pts in self.by_context.values():
            pts.sort()

    def ms(self, context: float, m: float) -> float:
        """One forward appending ``m`` tokens after ``context`` held tokens."""
        per_context = sorted((c, _linear(pts, m)) for c, pts in self.by_context.items())
        lo, hi = per_context[0][0], per_context[-1][0]
        return max(1e-9, _linear(per_context, min(max(context, lo), hi)))

    def ratio(self, context: float, m: float) -> float:
        """t(m) / t(1) at ``context``."""
        return self.ms(context, m) / self.ms(context, 1)


def loop_ms(curve: VerifyCurve, *, prompt_len: int, new_tokens: int, prefill_ms: float,
            plain_ms: float) -> float:
    """The plain decoding loop's own work per step beyond its forward (choosing the token,
    keeping it), from a measured plain generation: what it took beyond the prefill and the
    curve's single-token forwards, per step (0 when the curve already accounts for it all)."""
    steps = new_tokens - 1
    if steps < 1:
        return 0.0
    forwards_ms = sum(curve.ms(prompt_len + i, 1) for i in range(steps))
    return max(0.0, (plain_ms - prefill_ms - forwards_ms) / steps)


def speedups(curve: VerifyCurve, *, k: int, acceptance: float | None, prompt_len: int,
             new_tokens: int, forwards: Sequence[tuple[int, int]], prefill_ms: float,
             step_loop_ms: float = 0.0, draft_ms: Sequence[float] = ()
             ) -> dict[str, float | None]:
    """Predicted speedups of a speculative generation of ``new_tokens`` after ``prompt_len``
    over plain decoding with the same mode (prefill included on both sides):

      speedup_predicted         the formula: (n - 1) / E forwards of t(k + 1), E at
                                ``acceptance``, at the generation's middle context
      speedup_predicted_drafts  the forwards that ran, ``forwards`` = (context held, tokens
                                drafted): each costs t(drafted + 1) at its context
    and ``verify_ratio`` t(k + 1) / t(1), ``break_even_acceptance`` for this k there.
    Every step or forward also pays ``step_loop_ms`` (the loop's own work, ``loop_ms``), and
    each speculative forward its drafting, ``draft_ms`` (per forward, timed apart: the n-gram
    search and choosing among k + 1 rows of logits); the formula charges their mean. Without
    them, a model whose forwards are a few milliseconds of dispatch is over-predicted."""
    steps = new_tokens - 1  # the prefill makes the first token on both sides
    mid = prompt_len + steps / 2
    plain_ms = prefill_ms + sum(curve.ms(prompt_len + i, 1) + step_loop_ms for i in range(steps))
    mean_draft_ms = sum(draft_ms) / len(draft_ms) if draft_ms else 0.0
    ratio = curve.ratio(mid, k + 1)
    out: dict[str, float | None] = {"verify_ratio": ratio,
                                    "break_even_acceptance": break_even(ratio, k),
                                    "expected_tokens_per_forward": None,
                                    "speedup_predicted": None, "speedup_predicted_drafts": None}
    if acceptance is not None:
        e = expected_tokens(acceptance, k)
        out["expected_tokens_per_forward"] = e
        spec_ms = prefill_ms + steps / e * (curve.ms(mid, k + 1) + step_loop_ms + mean_draft_ms)
        out["speedup_predicted"] = plain_ms / spec_ms
    if forwards:
        drafting = list(draft_ms) or [0.0] * len(forwards)
        spec_ms = prefill_ms + sum(curve.ms(c, d + 1) + step_loop_ms + extra
                                   for (c, d), extra in zip(forwards, drafting, strict=True))
        out["speedup_predicted_drafts"] = plain_ms / spec_ms
    return out
