"""The multi-token verify curve and speculative decoding against it (kind "speculate").

``run(loaded, SpeculateParams, progress, should_stop)`` -> run with tables
  verify       one row per context x k (the asked k, 1, and each k + 1 a draft of k verifies,
               where it fits): one forward appending k tokens after ``context_len``
               held tokens (``decoder.append``), timed by the ``Sampler`` after ``decoder.seek``
               as ``BACK_TO_BACK`` forwards in a row (each rewound), per forward --
               ``latency_ms`` (median), ``samples_ms``, ``t_ratio`` = t(k)/t(1) at that
               context (1 is the memory-bound ideal, k the compute-bound line),
               ``speedup_vs_steps`` = k t(1) / t(k) (k single steps against one append)
  speculative  one row per draft length k: prompt-lookup speculative decoding
               (``engine.decoders.speculative``) of ``new_tokens`` after the prompt, timed whole
               (prefill included) against plain greedy decoding with the same mode
               (``plain_ms``; with mode 5, "over mode 5"): ``acceptance`` (accepted / drafted
               tokens), ``tokens_per_forward``, ``speedup_measured``, ``speedup_predicted``
               (from the verify curve at that acceptance, E[tokens per forward] = (1 -
               a^(k+1)) / (1 - a)), ``speedup_predicted_drafts`` (from the forwards that ran),
               both charging each forward the loop's own work (``step_loop_ms``: the plain
               loop's per step beyond the curve's forwards) and its own work besides the
               forward (``draft_ms``, summed: the n-gram search, the fed tensor, the choices
               among its rows, the comparison, the history written; timed apart after the run),
               ``break_even_acceptance`` and ``identical`` (token for token equal to plain
               greedy decoding, which the engine promises)
  checks       the gate's verdict on the mode (logits against mode 1; a refused mode is not
               timed)
The prompt is ``prompt`` (text, read with the model's vocabulary: GPT-2's BPE, or bytes for a
256-token model) or, empty, ``DEFAULT_PROMPT``; its start is cut when it and the new tokens
exceed the model's context. With random weights the greedy stream repeats one token, so the
drafts are trivially right: meta ``distinct_tokens`` counts the stream's distinct tokens and a
note says so. Formulas: ``instruments.costmodel.speculation``.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.models.config import GPTConfig, ModelConfig
from instruments import lineup
from instruments.costmodel.speculation import VerifyCurve, loop_ms, speedups
from instruments.experiments.inputs import contexts_within, modes_usable, parse_contexts, whole
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, no_grad, record

if TYPE_CHECKING:
    import torch

    from engine.models.base import CausalLM

KS = [1, 2, 4, 8, 16, 32]
MAX_K = 64
# Factories whose decoders append several tokens at once (``Decoder.appends``; a test keeps
# this in step with the decoders themselves): known here without importing torch.
DEFAULT_PROMPT = '''def mean(values):
    """The arithmetic mean of values."""
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    """The population variance of values."""
    m = mean(values)
    total = 0
    for value in values:
        total += (value - m) ** 2
    return total / len(values)


def '''


# Each verify sample times this many forwards back to back (each appended, then rewound), as
# the decoding loops run them. One forward alone right after the Sampler's own work cost more:
# on the trained fixture (1 ms forwards) the single sample of t(1) took 1.10-1.25 ms where the
# plain loop's steps took 0.92, which over-predicted speculation's gain by 15-28%.
BACK_TO_BACK = 4


def appends(mode: str) -> bool:
    spec = lineup.mode_spec(mode)
    return spec is not None and spec.appends


@dataclass
class SpeculateParams:
    """The verify curve at ``contexts`` for appends of ``ks`` tokens, then speculative decoding
    with drafts of each k (``new_tokens`` > 0) against plain greedy decoding."""

    contexts: list[int]
    ks: list[int] = field(default_factory=lambda: list(KS))
    mode: str = "prealloc_fused"
    prompt: str = ""  # "": DEFAULT_PROMPT
    new_tokens: int = 64  # 0: the verify curve only
    repeats: int = 3  # the most samples per point (at least 2, more while they disagree)
    ngram: int = 3  # the longest n-gram prompt lookup matches
    prompt_seed: int = 0  # the random tokens of the verify curve
    chat: bool = False  # the prompt in the model's chat template: the drafts meet a chat answer

    @classmethod
    def defaults(cls, device: str, cfg: ModelConfig) -> SpeculateParams:
        block_size = cfg.block_size
        fit = [t for t in (128, 512) if t + max(KS) <= block_size]
        return cls(fit or [max(1, block_size - max(KS)) // 2],
                   new_tokens=min(64, block_size // 4))

    def check(self, cfg: GPTConfig, device: str) -> None:
        modes_usable([self.mode], device, cfg.family)
        if not appends(self.mode):
            ok = ", ".join(m for m in lineup.mode_names() if appends(m))
            raise ValueError(f"mode {self.mode!r} takes one token per step; allowed: {ok}")
        contexts_within("draft lengths k", self.ks, 1, MAX_K)
        top = cfg.block_size - max(self.ks)
        if top < 1:
            raise ValueError(f"k up to {max(self.ks)} does not fit in {cfg.block_size} tokens")
        contexts_within("context lengths", self.contexts, 1, top)
        whole("new tokens", self.new_tokens, 0, cfg.block_size - 1)
        if 0 < self.new_tokens < 2:
            raise ValueError("new tokens must be 0 (verify curve only) or at least 2")
        whole("repeats", self.repeats, 1, 50)
        whole("n-gram length", self.ngram, 1, 16)


Params = SpeculateParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default="128,512",
                   help="tokens held before each verify forward (each + the largest k must fit)")
    p.add_argument("--k", default=",".join(map(str, KS)),
                   help=f"tokens appended in one forward / draft lengths (1..{MAX_K})")
    p.add_argument("--mode", default="prealloc_fused", help="a mode that appends several "
                   f"tokens at once: {', '.join(m for m in lineup.mode_names() if appends(m))}")
    p.add_argument("--prompt", default="", help="text to continue (default: a Python snippet)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens to generate (0: no "
                   "speculative part)")
    p.add_argument("--repeats", type=int, default=3, help="the most samples per point")
    p.add_argument("--ngram", type=int, default=3, help="longest n-gram prompt lookup matches")
    p.add_argument("--chat", action="store_true",
                   help="the prompt in the model's chat template (an instruct model's answer)")


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> SpeculateParams:
    block_size = cfg.block_size
    if args.batch != 1:
        raise ValueError(f"speculative decoding runs one sequence; allowed: --batch 1, got "
                         f"{args.batch}")
    try:
        ks = sorted({int(k) for k in str(args.k).split(",") if k.strip()})
    except ValueError:
        raise ValueError(f"--k must be whole numbers separated by commas, got {args.k!r}") \
            from None
    return SpeculateParams(parse_contexts(args.contexts, block_size), ks, args.mode,
                           args.prompt, args.new_tokens, args.repeats, args.ngram, args.seed,
                           args.chat)


def summary(run: dict[str, Any]) -> list[str]:
    lines = []
    for r in run["tables"].get("verify", []):
        lines.append(f"verify: {r['k']:3d} tokens after {r['context_len']:5d}: "
                     f"{r['latency_ms']:8.3f} ms = {r['t_ratio']:.2f}x one token")
    for r in run["tables"].get("speculative", []):
        acc = "—" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        pred = r["speedup_predicted_drafts"]
        lines.append(f"k={r['k']:2d}: acceptance {acc}, {r['tokens_per_forward']:.2f} tokens "
                     f"a forward, {r['speedup_measured']:.2f}x measured, "
                     f"{'—' if pred is None else f'{pred:.2f}x'} predicted"
                     + ("" if r["identical"] else "  NOT IDENTICAL to greedy"))
    return lines


def _sampler(model: CausalLM, p: SpeculateParams, tr: Tracker) -> Any:
    from instruments.measure.sampler import Sampler

    return Sampler(model.device, repeats=p.repeats, min_repeats=min(2, p.repeats), warmup=1,
                   should_stop=tr.stop)


def _verify(model: CausalLM, p: SpeculateParams, tr: Tracker) -> bool:
    """The verify rows; True if stopped."""
    from engine.decoders import make_decoder
    from engine.loop import random_prompt

    # t(1) is every ratio's denominator; a draft of k tokens is verified by appending k + 1,
    # measured too where it fits: the curve is not straight between the asked points (gpt2 at
    # 1 thread on the Xeon: t(2) 49.7 ms, t(4) 87.5, and 3-token forwards far nearer t(2)
    # than the line between them, which under-predicted k = 2 by 16-18%)
    room = model.config.block_size - max(p.contexts)
    ks = sorted(set(p.ks) | {1} | {k + 1 for k in p.ks if k + 1 <= room})
    top = max(p.contexts) + max(ks)
    dec = make_decoder(model, p.mode, capacity=top)
    ids = random_prompt(model, 1, top, p.prompt_seed)
    sampler = _sampler(model, p, tr)
    for t in sorted(set(p.contexts)):
        one = None
        for k in ks:
            def forwards(t: int = t, k: int = k) -> None:
                for _ in range(BACK_TO_BACK):
                    dec.append(ids[:, t : t + k])
                    dec.rewind(t)

            got = sampler.point(forwards, lambda t=t: dec.seek(ids, t))
            if got is None:
                return True
            got.samples_ms = [ms / BACK_TO_BACK for ms in got.samples_ms]
            ms = statistics.median(got.samples_ms)
            one = ms if k == 1 else one
            tr.work += 1
            tr.row("verify", {
                "mode": p.mode, "mode_label": lineup.label(p.mode), "context_len": t, "k": k,
                "latency_ms": ms, "samples_ms": got.samples_ms, "min_ms": min(got.samples_ms),
                "spread_ms": max(got.samples_ms) - min(got.samples_ms),
                "t_ratio": ms / one, "per_token_ms": ms / k, "steps_ms": k * one,
                "speedup_vs_steps": k * one / ms, **got.quiet()},
                f"{k} tokens after {t}: {ms:.3f} ms ({ms / one:.2f}x one)")
    return False


def prompt_ids(model: CausalLM, text: str, new_tokens: int, chat: bool = False
               ) -> tuple[torch.Tensor, str]:
    """(1, T) ids of ``text`` (``DEFAULT_PROMPT`` when empty) in the model's vocabulary -- in
    its chat template when ``chat`` --, its start cut so that T + new_tokens fits the model;
    and a note when it was cut or, for the default prompt without the tokenizer files, replaced
    by random tokens ("" if neither). A text that cannot be read raises a one-line ValueError."""
    import torch

    from engine.loop import random_prompt
    from instruments.lineup import TokenizerError

    cfg = model.config
    room = cfg.block_size - new_tokens
    try:
        tok = lineup.tokenizer(model)
        text = text or DEFAULT_PROMPT
        ids = tok.encode(tok.chat(text) if chat else text)
    except TokenizerError as exc:
        if text:
            raise ValueError(str(exc).splitlines()[0]) from exc
        return random_prompt(model, 1, min(64, room)), (
            "the GPT-2 tokenizer files are unavailable (set TIKTOKEN_CACHE_DIR): "
            f"{min(64, room)} random tokens stand in for the default prompt")
    if not ids:
        raise ValueError("the prompt is empty; give some text")
    note = ""
    if len(ids) > room:
        note = (f"the prompt's first {len(ids) - room} of {len(ids)} tokens were cut: it and "
                f"{new_tokens} new tokens must fit in {cfg.block_size}")
        ids = ids[-room:]
    return torch.tensor([ids], dtype=torch.long, device=model.device), note


def _drafting_ms(history: Any, forwards: list[Any], k: int, ngram: int, prompt_len: int,
                 n: int, vocab: int) -> list[float]:
    """Each speculative forward's own work besides the forward, timed apart (median of 3): the
    loop's own ``draft_feed`` (the n-gram search over the history it saw, the fed tensor) and
    ``keep`` (the greedy choice of each of the 1 + drafted rows, the comparison, the history
    written), over stand-in logits."""
    import time

    import torch

    from engine.decoders.speculative import draft_feed, keep

    rows = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(0))  # host: stand-in
    scratch = history.clone()
    out = []
    for f in forwards:
        size = f.context_len + 1  # the held tokens and the last one, not yet in the cache
        room = n - (size - prompt_len)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            draft, feed = draft_feed(history, size, min(k, room - 1), ngram)
            keep(draft, rows[: feed.size(1)], scratch, size)
            times.append(time.perf_counter() - start)
        out.append(statistics.median(times) * 1e3)
    return out


def _speculate(model: CausalLM, p: SpeculateParams, prompt: torch.Tensor, tr: Tracker,
               meta: dict[str, Any]) -> bool:
    """The plain generation, then one speculative row per k; True if stopped."""
    import torch

    from engine.decoders import make_decoder
    from engine.decoders.speculative import speculative_decode
    from engine.loop import decode, first_difference
    n, t0 = p.new_tokens, prompt.size(1)
    dec = make_decoder(model, p.mode, capacity=t0 + n)
    prefill = _sampler(model, p, tr).point(lambda: dec.prefill(prompt))
    plain: list[Any] = []
    base = _sampler(model, p, tr).point(lambda: plain.append(decode(dec, prompt, n)))
    if prefill is None or base is None:
        return True
    want = plain[-1].tokens
    distinct = int(want.unique().numel())
    tok = lineup.tokenizer(model)
    meta.update(prompt_tokens=t0, prompt_text=tok.decode(prompt[0].tolist()),
                output_text=tok.decode(want[0].tolist()), distinct_tokens=distinct)
    if distinct <= 2:
        tr.note(f"the greedy stream is {distinct} distinct token(s) repeated (what random "
                "weights give): the drafts are trivially right, so this acceptance says little "
                "about real text")
    plain_ms, prefill_ms = base.median_ms, prefill.median_ms
    curve = VerifyCurve(r for r in tr.tables.get("verify", []))
    step_loop_ms = loop_ms(curve, prompt_len=t0, new_tokens=n, prefill_ms=prefill_ms,
                           plain_ms=plain_ms)
    meta.update(step_loop_ms=step_loop_ms)
    for k in sorted(set(p.ks)):
        sdec = make_decoder(model, p.mode, capacity=t0 + n)
        runs: list[Any] = []

        def generate(sdec: Any = sdec, k: int = k, runs: list[Any] = runs) -> None:
            runs.append(speculative_decode(sdec, prompt, n, k, ngram=p.ngram))

        got = _sampler(model, p, tr).point(generate)  # a fresh sampler: its own warm-up
        if got is None:
            return True
        spec = runs[-1]
        same = torch.equal(spec.tokens, want)
        if not same:
            at = first_difference(want[0].tolist(), spec.tokens[0].tolist())
            tr.note(f"k={k}: the speculative tokens differ from plain greedy decoding at token "
                    f"{at}: a near-tie the multi-token forward rounded the other way")
        history = torch.cat([prompt[0].cpu(), spec.tokens[0].cpu()])
        draft_ms = _drafting_ms(history, spec.forwards, k, p.ngram, t0, n, model.config.vocab_size)
        pred = speedups(curve, k=k, acceptance=spec.acceptance, prompt_len=t0, new_tokens=n,
                        forwards=[(f.context_len, f.drafted) for f in spec.forwards],
                        prefill_ms=prefill_ms, step_loop_ms=step_loop_ms, draft_ms=draft_ms)
        tr.work += 1
        tr.row("speculative", {
            "mode": p.mode, "k": k, "ngram": p.ngram, "prompt_tokens": t0, "new_tokens": n,
            "forwards": len(spec.forwards), "drafted": spec.drafted, "accepted": spec.accepted,
            "acceptance": spec.acceptance, "tokens_per_forward": spec.tokens_per_forward,
            "latency_ms": got.median_ms, "samples_ms": got.samples_ms, "plain_ms": plain_ms,
            "plain_samples_ms": base.samples_ms, "prefill_ms": prefill_ms,
            "speedup_measured": plain_ms / got.median_ms, **pred,
            "step_loop_ms": step_loop_ms, "draft_ms": sum(draft_ms),
            "identical": same, "distinct_tokens": distinct},
            f"k={k}: {plain_ms / got.median_ms:.2f}x over plain decoding")
    return False


@no_grad
def run(loaded: Loaded, params: SpeculateParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    """The verify curve, then speculative decoding (see the module docstring)."""
    from instruments.checks import gate

    model = loaded.checked(params)
    ks = sorted(set(params.ks) | {1})
    points = len(set(params.contexts)) * len(ks)
    spec_points = len(set(params.ks)) if params.new_tokens else 0
    tr = Tracker(progress, should_stop, points + spec_points)
    if params.new_tokens:  # read the prompt first: a text that cannot be read fails at once
        prompt, why = prompt_ids(model, params.prompt, params.new_tokens, params.chat)
        if why:
            tr.note(why)
    tr.emit(f"{params.mode}: checking its logits against mode 1")
    check = gate.Gate(model, 1, params.prompt_seed).check(params.mode)
    tr.tables["checks"] = [check.to_row()]
    meta: dict[str, Any] = {}
    stopped = False
    if not check.passed:
        tr.note(f"{params.mode} not timed: {check.detail}")
    else:
        stopped = _verify(model, params, tr)
        if not stopped and params.new_tokens:
            stopped = _speculate(model, params, prompt, tr, meta)
    if stopped:
        tr.note("stopped: what was measured is kept")
    tables = {name: tr.tables.get(name, []) for name in ("verify", "speculative", "checks")}
    return record(loaded, "speculate", params, tables, partial=stopped, notes=tr.notes, **meta)
