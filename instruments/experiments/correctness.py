"""The correctness lab: every check with no bug and with each silent bug (kind "correctness").

``run(loaded, CorrectnessParams, progress, should_stop)`` -> run with tables ``checks`` (one row
per bug setting x check: passed, detail, value; a check that could not run says so) and
``tokens`` (the greedy text each way, concatenating cache). The bugs are switched on a
``private_view`` of the loaded model, so nothing here changes the model other requests use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.loop import generate
from instruments.checks import (
    cached_equals_uncached,
    inject_bug,
    logits_vs_transformers,
    multi_token_append,
    private_view,
)
from instruments.params import CorrectnessParams
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, record

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


@torch.no_grad()
def run(loaded: Loaded, params: CorrectnessParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
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
