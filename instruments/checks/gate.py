"""The gate every timed mode passes first: its logits against mode 1's (the naive loop).

``Gate(model, batch, seed).check(name) -> ModeCheck``. Greedy tokens alone cannot judge a mode
at GPT-2 shapes with random weights: the greedy stream is one token repeated, so a broken cache
can give "identical" tokens. The gate therefore feeds the same random tokens (teacher forcing)
through mode 1 and through the mode, at a short context and at a long one (512 tokens where the
model allows), and compares every step's logits: max |Δ| must stay within a tolerance set by the
dtype, relative to the largest reference logit (``TOLERANCE``: on gpt2 with random weights,
largest logit 2.6, a correct exact mode differed by ≤ 2e-6 of it in fp32 and ≤ 0.013 in bf16,
the write-up's bugs by ≥ 0.32 -- the cache-order bug; the others ≥ 0.52 -- in both; a lossy mode
-- the int8 cache -- is held to its registered ``tolerance`` when that is wider).
A mode whose steps go through ``GPT.forward`` also appends three tokens at once (what the cache
order bug breaks; single-token decode is blind to it). Greedy tokens are then compared too, for
the record: "identical", "differ at token k", or "inconclusive" when mode 1's stream repeats a
token -- never "identical" then. A mode that crashes is refused, never raised. The stages can
run in two halves (``check(name, "short")``, later ``check(name, "long")``), so a sweep can time
its first points before the long context's forwards have run. Mode 1's logits at a stage come
from one of its forwards over the whole fed sequence (``_reference`` says why that is the same),
and its greedy tokens from one forward over the prompt and the checked mode's greedy tokens
(``_reference_greedy``: mode 1 runs its own loop only from where they disagree).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

import torch

from engine import dtypes
from engine.loop import decode, random_prompt
from engine.models.base import CausalLM
from engine.models.state import ModelState
from instruments import lineup
from instruments.lineup import make_decoder

# max |Δ logit| allowed, as a share of the largest |logit| of mode 1, by dtype.
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1, "float16": 0.03}
LONG_CONTEXT = 512
APPENDED = 3
GREEDY_TOKENS = 16
HALVES = ("short", "long", "both")


@dataclass
class ModeCheck:
    mode: str
    passed: bool
    detail: str
    max_diff: float | None = None  # largest |Δ logit| against mode 1, over every stage
    tolerance: float | None = None  # what it had to stay within
    tokens: str = ""  # greedy tokens: identical | differ at token k | inconclusive (...)

    def to_row(self) -> dict[str, Any]:
        return asdict(self)


def tolerance(dtype: Any) -> float:
    return TOLERANCE[dtypes.canonical(dtype)]


def greedy(model: CausalLM | ModelState, name: str, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` greedy tokens (B, n) of mode ``name`` after ``prompt``."""
    dec = make_decoder(model, name, batch_size=prompt.size(0), capacity=prompt.size(1) + n)
    return decode(dec, prompt, n).tokens


def _forced(model: ModelState, tokens: torch.Tensor, start: int, name: str) -> torch.Tensor:
    """Logits (steps, B, vocab) of ``tokens`` (B, T) fed in after a ``start``-token prefill."""
    dec = make_decoder(model, name, batch_size=tokens.size(0), capacity=tokens.size(1))
    n = tokens.size(1) - start + 1
    gen = decode(dec, tokens[:, :start], n, feed=tokens[:, start:], keep_logits=True)
    return torch.stack(gen.logits)


def _reference(model: ModelState, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """Mode 1's logits (steps, B, vocab) for ``tokens`` (B, T) fed in after a ``start``-token
    prefill, from ONE of its forwards instead of T - start + 1: mode 1's step is a forward over
    the whole prefix that computes every position's logits (and keeps the last), and a causal
    model's logits at position t depend on tokens 0..t only, so its last forward already holds
    every earlier step's logits (equal to float32 rounding, ~1e-6 of the largest logit here,
    against TOLERANCE's 1e-4). At 512 tokens on gpt2 this saves four uncached forwards: seconds
    of a sweep's gate on a CPU."""
    dec = make_decoder(model, "uncached", batch_size=tokens.size(0), capacity=tokens.size(1))
    with torch.no_grad():
        logits, _ = dec.model(tokens, use_cache=False, logits="all", attention=dec.attention)
    return logits[:, start - 1:].float().cpu().transpose(0, 1)  # (T - start + 1, B, vocab)


def _reference_greedy(model: ModelState, prompt: torch.Tensor, candidate: torch.Tensor
                      ) -> torch.Tensor:
    """Mode 1's greedy tokens (B, n) after ``prompt`` (B, T), found with ``candidate`` (B, n)
    -- the greedy tokens of the mode being checked -- in ONE of mode 1's forwards over prompt +
    candidate instead of n: that forward's logits at each position are its step's logits there
    (``_reference`` says why), so its argmax after each prefix is mode 1's next token as long as
    the prefix is mode 1's own stream, i.e. up to and including the first position where the
    candidate disagrees. From there mode 1 goes on by its own loop. On gpt2 this turns the
    gate's 16 uncached forwards (8-23 tokens: seconds on a CPU) into one."""
    n, T = candidate.size(1), prompt.size(1)
    dec = make_decoder(model, "uncached", batch_size=prompt.size(0), capacity=T + n)
    with torch.no_grad():
        logits, _ = dec.model(torch.cat([prompt, candidate[:, :-1]], 1), use_cache=False,
                              logits="all", attention=dec.attention)
    ours = logits[:, T - 1:].argmax(-1)  # (B, n): mode 1's token after each prefix
    agree = (ours == candidate).all(0)
    if bool(agree.all()):
        return ours
    k = int((~agree).nonzero()[0])  # the first position some row disagrees at
    head = ours[:, : k + 1]  # mode 1's own tokens: every prefix before k was its stream
    if k + 1 == n:
        return head
    return torch.cat([head, greedy(model, "uncached", torch.cat([prompt, head], 1),
                                   n - k - 1)], 1)


def _appended(model: ModelState, name: str, tokens: torch.Tensor) -> torch.Tensor | None:
    """Logits (B, APPENDED, vocab) of the last tokens appended at once, or None if the mode
    takes one token per step. Done after a short prefill: a wrong order of the keys then moves
    the attention the most (a few keys out of a handful, not out of hundreds)."""
    dec = make_decoder(model, name, batch_size=tokens.size(0), capacity=tokens.size(1))
    if not dec.appends:
        return None
    dec.prefill(tokens[:, :-APPENDED])
    return dec.append(tokens[:, -APPENDED:]).float().cpu()


class Gate:
    """Mode 1's reference logits on fixed random tokens, computed once, and checks against it.

    ``check(name)`` runs every stage; ``check(name, "short")`` then ``check(name, "long")`` run
    the same stages in two halves (the short context, the append and the greedy tokens first;
    the long context later), each verdict covering every stage run so far for that mode.

    The gate holds the model's state while it lives, so what a check builds (a compiled step,
    packed copies) is there for the decoders that are timed after it."""

    def __init__(self, model: CausalLM | ModelState, batch: int = 1, seed: int = 0,
                 steps: int = 8) -> None:
        self.state = ModelState.of(model)
        self.model = model = self.state.model
        block = model.config.block_size
        self.steps = steps
        self.short = min(8, block - steps)
        self.long = max(self.short, min(LONG_CONTEXT, block - 4))
        self.tokens = random_prompt(model, min(batch, 2), self.long + 4, seed)
        self.tol_share = tolerance(model.dtype)
        self._ref: dict[str, Any] = {"stages": {}}
        self._seen: dict[str, dict[str, float | None]] = {}  # mode -> stage -> max |Δ|
        self._tokens_said: dict[str, str] = {}

    def _stage_names(self, half: str) -> list[str]:
        short = [f"{self.short} tokens", "3 appended at once"]
        long = [f"{self.long} tokens"]
        if half not in HALVES:
            raise ValueError(f"half must be one of {', '.join(HALVES)}, got {half!r}")
        return {"short": short, "long": long, "both": short + long}[half]

    def _stage(self, name: str, stage: str) -> torch.Tensor | None:
        forced = _reference if name == "uncached" else functools.partial(_forced, name=name)
        if stage == f"{self.short} tokens":
            short = self.tokens[:, : self.short + self.steps - 1]
            return forced(self.state, tokens=short, start=self.short)
        if stage == f"{self.long} tokens":
            return forced(self.state, tokens=self.tokens, start=self.long)
        return _appended(self.state, name, self.tokens[:, : self.short + APPENDED])

    def reference(self, half: str = "both", candidate: torch.Tensor | None = None
                  ) -> dict[str, Any]:
        """Mode 1's logits at the half's stages (computed once each), the tolerance from the
        largest |logit| over the stages computed so far, and mode 1's greedy tokens (found with
        ``candidate``, a checked mode's, when given: ``_reference_greedy``)."""
        ref = self._ref
        for stage in self._stage_names(half):
            if stage not in ref["stages"]:
                ref["stages"][stage] = self._stage("uncached", stage)
        ref["scale"] = max(float(v.abs().max()) for v in ref["stages"].values() if v is not None)
        ref["tol"] = self.tol_share * ref["scale"]
        if "greedy" not in ref:
            prompt = self.tokens[:, : self.short]
            ref["greedy"] = (greedy(self.state, "uncached", prompt, GREEDY_TOKENS)
                             if candidate is None else
                             _reference_greedy(self.state, prompt, candidate))
        return ref

    def check(self, name: str, half: str = "both") -> ModeCheck:
        if name == "uncached":
            return ModeCheck(name, True, "mode 1 is the reference", tokens="the reference")
        try:
            return self._check(name, half)
        except torch.OutOfMemoryError:
            raise  # not the mode's fault: the caller reports the sizes that did not fit
        except Exception as exc:  # a mode that crashes is as untrustworthy as a wrong one
            return ModeCheck(name, False, f"raised {type(exc).__name__}: {exc}")

    def _check(self, name: str, half: str) -> ModeCheck:
        stream = None  # the mode's greedy tokens, the first time it is checked
        if name not in self._tokens_said:
            stream = greedy(self.state, name, self.tokens[:, : self.short], GREEDY_TOKENS)
        ref = self.reference(half, candidate=stream)
        # a lossy mode (the int8 cache) is held to its own stated bound when that is wider
        tol = max(ref["tol"], lineup.spec(name).tolerance * ref["scale"])
        seen = self._seen.setdefault(name, {})
        for stage in self._stage_names(half):
            got, want = self._stage(name, stage), ref["stages"][stage]
            seen[stage] = None if got is None or want is None else float((got - want)
                                                                         .abs().max())
        if stream is not None:
            self._tokens_said[name] = self._tokens(stream, ref["greedy"])
        tokens = self._tokens_said[name]
        diffs = {stage: d for stage, d in seen.items() if d is not None}
        where = max(diffs, key=lambda s: diffs[s]) if diffs else ""
        worst = diffs.get(where, 0.0)
        contexts = [s.split()[0] for s in seen if s.endswith(" tokens")]
        checked = " and ".join(contexts) + " tokens" + (
            f", {APPENDED} appended at once" if seen.get("3 appended at once") is not None
            else "")
        if worst > tol:
            return ModeCheck(name, False, f"logits differ from mode 1 by {worst:.3g} at {where} "
                             f"(allowed {tol:.2g} in {dtypes.canonical(self.model.dtype)}); "
                             f"greedy tokens: {tokens}", worst, tol, tokens)
        return ModeCheck(name, True, f"logits within {tol:.2g} of mode 1 (max |Δ| {worst:.2g}) "
                         f"at {checked}; greedy tokens: {tokens}", worst, tol, tokens)

    @staticmethod
    def _tokens(got: torch.Tensor, want: torch.Tensor) -> str:
        if torch.equal(want, got):
            if int(want[0].unique().numel()) <= 2:
                return (f"inconclusive: mode 1's {want.size(1)} greedy tokens repeat "
                        f"{int(want[0].unique().numel())} value(s), so agreeing proves little")
            return f"identical ({want.size(1)} tokens)"
        pos = int((want != got).nonzero()[0, 1])
        return f"differ at token {pos}"
