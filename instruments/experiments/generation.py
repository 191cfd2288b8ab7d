"""Generate side by side: one prompt, greedily, through two modes, token by token (kind
"generation").

``run(loaded, GenerationParams, progress, should_stop)`` -> run with tables ``tokens`` (one row
per generated token and side: side, mode, step, token_id, context_len, step_ms -- streamed as
they come, so the page writes the text live) and ``verdict`` (identical, or the first new token
where the two part, both tokens and their logit gap in each run).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.decoders import make_decoder
from engine.loop import Step, checked_request, decode
from instruments.checks import compare_streams
from instruments.params import GenerationParams
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, record
from instruments.timing import StepClock


@torch.no_grad()
def run(loaded: Loaded, params: GenerationParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    model = loaded.model
    params.check(model.config, str(model.device))
    idx = checked_request(model, [params.prompt_ids], params.new_tokens)
    n = params.new_tokens
    tr = Tracker(progress, should_stop, 2 * n, unit="tokens")
    gens = []
    for side, mode in zip(("left", "right"), params.modes, strict=True):
        dec = make_decoder(model, mode, batch_size=1, capacity=idx.size(1) + n)

        def on_step(s: Step, side: str = side, mode: str = mode) -> None:
            tr.work += 1
            tr.row("tokens", {"side": side, "mode": mode, "step": s.index,
                              "token_id": s.token_ids[0], "context_len": s.context_len,
                              "step_ms": s.step_ms}, f"{mode}: token {s.index + 1}/{n}")

        gens.append(decode(dec, idx, n, keep_logits=True, timer=StepClock(model.device),
                           on_step=on_step, should_stop=tr.stop))
        del dec
    a, b = gens
    stopped = a.stopped_early or b.stopped_early
    verdict = compare_streams(a.tokens[0].tolist(), b.tokens[0].tolist(), a.logits, b.logits)
    tables = {"tokens": tr.tables.get("tokens", []),
              "verdict": [] if stopped else [{"left": params.modes[0],
                                              "right": params.modes[1],
                                              "new_tokens": int(a.tokens.size(1)),
                                              **vars(verdict)}]}
    if stopped:
        tr.note("stopped before both sides finished: no verdict")
    return record(loaded, "generation", params, tables, partial=stopped, notes=tr.notes)
