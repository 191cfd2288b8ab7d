"""The correctness lab: every check with no bug and with each silent bug (kind "correctness").

``run(loaded, CorrectnessParams, progress, should_stop)`` -> run with tables ``checks`` (one row
per bug setting x check: passed, detail, value; a check that could not run says so) and
``tokens`` (the greedy text each way, concatenating cache). The bugs
(``instruments.checks.bugs``) are switched on in a ``private_view`` of the loaded model -- its
own modules over the same weights -- so nothing here changes the model other requests use.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.config import GPTConfig, ModelConfig
from instruments.checks import BUG_KINDS
from instruments.experiments.inputs import whole
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, no_grad, record


@dataclass
class CorrectnessParams:
    """The checks with no bug and with each silent bug switched on, and the text each way."""
    prompt_ids: list[int]
    new_tokens: int = 40
    bugs: list[str] = field(default_factory=lambda: list(BUG_KINDS))
    append: list[int] = field(default_factory=lambda: [1, 2, 3, 7])

    def check(self, cfg: GPTConfig, device: str) -> None:
        if not self.prompt_ids:
            raise ValueError("The prompt is empty: type at least one word.")
        bad = [b for b in self.bugs if b not in BUG_KINDS]
        if bad:
            raise ValueError(f"unknown bug {bad[0]!r}; allowed: {', '.join(BUG_KINDS)}")
        whole("new tokens", self.new_tokens, 2)
        room = cfg.block_size - max(self.new_tokens, max(self.append))
        if len(self.prompt_ids) > room:
            raise ValueError(f"The prompt is {len(self.prompt_ids)} tokens; with "
                             f"{self.new_tokens} new tokens this model ({cfg.block_size} tokens)"
                             f" allows at most {max(room, 0)} prompt tokens.")


Params = CorrectnessParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default="The KV cache stores", help="the prompt (GPT-2 tokens)")
    p.add_argument("--new-tokens", type=int, default=40)


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> CorrectnessParams:
    from engine.tokenizer import get_tokenizer

    return CorrectnessParams(get_tokenizer().encode(args.prompt), args.new_tokens)


def summary(run: dict[str, Any]) -> list[str]:
    return [f"{r['bug']:>14} · {r['check']}: "
            + ("passed" if r["passed"] else "n/a" if r["passed"] is None else "FAILED")
            for r in run["tables"].get("checks", [])]


NO_BUG = "no bug"
CHECKS = ("logits vs transformers", "cached == uncached (1 token per step)",
          "multi-token append (1, 2, 3, 7 at once)")


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

    params.check(loaded.model.config, str(loaded.model.device))
    ids, n, append = list(params.prompt_ids), params.new_tokens, list(params.append)
    view = private_view(loaded.model)  # bugs go on this view; the loaded model is never touched
    settings = [None, *params.bugs]
    tr = Tracker(progress, should_stop, len(settings), unit="bug settings")
    ext = ids + generate(view, [ids], max(append), use_cache=False)[0].tolist()
    for bug in settings:
        name = bug or NO_BUG
        if tr.stop():
            tr.note("stopped: what was checked is kept")
            break
        tr.emit(f"{name}: running the checks")
        with inject_bug(view, bug):
            found = [
                _check(logits_vs_transformers, view, ids),
                _check(cached_equals_uncached, view, [ids], n, cache_kind="concat"),
                _check(multi_token_append, view, [ext], len(ids), append, cache_kind="concat"),
            ]
            tr.emit(f"{name}: generating text")
            tokens = generate(view, [ids], n, use_cache=True, cache_kind="concat")[0].tolist()
        for check, (passed, detail, value) in zip(CHECKS, found, strict=True):
            tr.row("checks", {"bug": name, "check": check, "passed": passed, "detail": detail,
                              "value": value}, f"{name}: {check}", points=0)
        tr.work += 1
        tr.row("tokens", {"bug": name, "token_ids": tokens}, f"{name}: done")
    tables = {"checks": tr.tables.get("checks", []), "tokens": tr.tables.get("tokens", [])}
    return record(loaded, "correctness", params, tables,
                  partial=len(tables["tokens"]) < len(settings), notes=tr.notes)
