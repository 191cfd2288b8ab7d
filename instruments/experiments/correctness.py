"""The correctness lab: every check with no bug and with each silent bug (kind "correctness").

``run(loaded, CorrectnessParams, progress, should_stop)`` -> run with tables ``checks`` (one row
per bug setting x check: passed, detail, value; a check that could not run says so) and
``tokens`` (the greedy tokens and their text each way, concatenating cache). The prompt is text,
read by the model's own tokenizer here (the server never loads one). "cached == uncached" on
the stream with no bug passes only when it holds enough distinct tokens
(``checks.correctness.distinct_floor``: 40 of 200): a degenerate stream is inconclusive.
The bugs offered are the family's (``checks.bugs_for``: RoPE's and GQA's in a Llama model). The bugs
(``instruments.checks.bugs``) are switched on in a ``private_view`` of the loaded model -- its
own modules over the same weights -- so nothing here changes the model other requests use.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.models.config import GPTConfig, ModelConfig
from instruments.checks import bugs_for
from instruments.experiments.inputs import whole
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, no_grad, record


@dataclass
class CorrectnessParams:
    """The checks with no bug and with each silent bug switched on, and the text each way."""
    prompt_text: str = "The key-value cache in a transformer"
    new_tokens: int = 40
    bugs: list[str] | None = None  # None: every bug of the model's family
    append: list[int] = field(default_factory=lambda: [1, 2, 3, 7])
    prompt_ids: list[int] = field(default_factory=list)  # instead of text

    def check(self, cfg: GPTConfig, device: str) -> None:
        if not self.prompt_ids and not self.prompt_text.strip():
            raise ValueError("The prompt is empty: type at least one word.")
        allowed = bugs_for(cfg.family)
        bad = [b for b in self.bugs or [] if b not in allowed]
        if bad:
            raise ValueError(f"bug {bad[0]!r} does not apply to {cfg.family} models; allowed: "
                             f"{', '.join(allowed)}")
        whole("new tokens", self.new_tokens, 2)
        if self.prompt_ids:
            self.fits(len(self.prompt_ids), cfg)

    def fits(self, n: int, cfg: ModelConfig) -> None:
        room = cfg.block_size - max(self.new_tokens, max(self.append))
        if n > room:
            raise ValueError(f"The prompt is {n} tokens; with {self.new_tokens} new tokens "
                             f"this model ({cfg.block_size} tokens) allows at most "
                             f"{max(room, 0)} prompt tokens.")


Params = CorrectnessParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=CorrectnessParams.prompt_text,
                   help="the prompt, read by the model's own tokenizer")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="greedy tokens each way (default: 200 for a model with real weights, "
                   "whose stream must hold 40 distinct tokens; 40 otherwise)")
    p.add_argument("--bugs", default=None, help="bugs to switch on, by comma (default: every "
                   "bug of the model's family)")


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> CorrectnessParams:
    real = not str(args.weights or "random").startswith("random")
    n = args.new_tokens or (200 if real else 40)
    bugs = None if args.bugs is None else [b.strip() for b in args.bugs.split(",") if b.strip()]
    return CorrectnessParams(args.prompt, n, bugs)


def summary(run: dict[str, Any]) -> list[str]:
    return [f"{r['bug']:>14} · {r['check']}: "
            + ("passed" if r["passed"] else "n/a" if r["passed"] is None else "FAILED")
            for r in run["tables"].get("checks", [])]


NO_BUG = "no bug"
CHECKS = ("logits vs transformers", "cached == uncached (1 token per step)",
          "multi-token append (1, 2, 3, 7 at once)")
BUG_TOKENS = 40  # greedy tokens with a bug on: where the streams part shows in the first few


def _check(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[bool | None, str,
                                                                        float | None]:
    """(passed, detail, value); passed is None when the check could not run at all."""
    try:
        res = fn(*args, **kwargs)
    except Exception as exc:  # a check that cannot run is reported, not raised
        return None, f"could not run: {type(exc).__name__}: {exc}", None
    return res.passed, res.detail, res.value


@no_grad
def run(loaded: Loaded, params: CorrectnessParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    from engine.loop import generate
    from instruments.checks.bugs import inject_bug, private_view
    from instruments.checks.correctness import (
        cached_equals_uncached,
        logits_vs_transformers,
        multi_token_append,
    )
    from instruments.lineup import tokenizer

    cfg = loaded.model.config
    params.check(cfg, str(loaded.model.device))
    tok = tokenizer(loaded.model)
    ids = list(params.prompt_ids) or tok.encode(params.prompt_text)
    params.fits(len(ids), cfg)
    n, append = params.new_tokens, list(params.append)
    view = private_view(loaded.model)  # bugs go on this view; the loaded model is never touched
    settings = [None, *(bugs_for(cfg.family) if params.bugs is None else params.bugs)]
    tr = Tracker(progress, should_stop, len(settings), unit="bug settings")
    ext = ids + generate(view, [ids], max(append), use_cache=False)[0].tolist()
    for bug in settings:
        name = bug or NO_BUG
        if tr.stop():
            tr.note("stopped: what was checked is kept")
            break
        tr.emit(f"{name}: running the checks")
        k = n if bug is None else min(n, BUG_TOKENS)  # a bug's stream parts in a few tokens
        with inject_bug(view, bug):
            found = [
                _check(logits_vs_transformers, view, ids),
                _check(cached_equals_uncached, view, [ids], k, cache_kind="concat"),
                _check(multi_token_append, view, [ext], len(ids), append, cache_kind="concat"),
            ]
            tr.emit(f"{name}: generating text")
            tokens = generate(view, [ids], k, use_cache=True, cache_kind="concat")[0].tolist()
        for check, (passed, detail, value) in zip(CHECKS, found, strict=True):
            tr.row("checks", {"bug": name, "check": check, "passed": passed, "detail": detail,
                              "value": value}, f"{name}: {check}", points=0)
        tr.work += 1
        tr.row("tokens", {"bug": name, "token_ids": tokens, "text": tok.decode(tokens),
                          "pieces": tok.decode_each(tokens), "distinct_tokens": len(set(tokens))},
               f"{name}: done")
    tables = {"checks": tr.tables.get("checks", []), "tokens": tr.tables.get("tokens", [])}
    return record(loaded, "correctness", params, tables,
                  partial=len(tables["tokens"]) < len(settings), notes=tr.notes,
                  prompt_text=tok.decode(ids), prompt_tokens=len(ids), tokenizer=tok.name)
