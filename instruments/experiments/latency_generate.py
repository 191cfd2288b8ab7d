"""The write-up's way to time a cached mode: one whole generation per repeat.

``time_by_generation(model, mode, params, contexts, idx, tr, row)`` runs ``warmup`` untimed
generations (``warmup_steps`` long) and ``repeats`` timed ones from the shortest context to the
longest, every step timed; the step whose input makes the sequence t tokens long is the sample
for t, and rows are emitted during the last run as it passes them. Slow -- a generation of a
thousand tokens per repeat to time sixteen steps -- but it is what the write-up did; the
latency sweep's default ("crop") is checked against it by ``scripts/bench_sweep.py --crop-check``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from engine.loop import Step, decode
from engine.models.base import CausalLM
from instruments.lineup import make_decoder
from instruments.measure.timing import StepClock
from instruments.spine import Tracker


class Sampling(Protocol):
    """What of a sweep's parameters (``latency.LatencyParams``) generating by steps reads: a
    protocol, so this module does not import the sweep that imports it."""

    warmup: int
    repeats: int
    warmup_steps: int | None
    batch_size: int


def time_by_generation(model: CausalLM, mode: str, p: Sampling, contexts: list[int],
                       idx: torch.Tensor, tr: Tracker, row: Callable[..., dict[str, Any]]
                       ) -> bool:
    """Rows for one cached mode (see the module docstring). True if stopped."""
    top = contexts[-1]
    start = max(1, contexts[0] - 1)  # prefill length: the first step makes the sequence start+1
    wanted = set(contexts)
    samples: dict[int, list[float]] = {t: [] for t in contexts}
    n_runs = p.warmup + p.repeats
    for run_i in range(n_runs):
        timed, last = run_i >= p.warmup, run_i == n_runs - 1
        n_steps = top - start
        if not timed and p.warmup_steps is not None:
            n_steps = min(n_steps, p.warmup_steps)
        what = f"run {run_i + 1 - p.warmup}/{p.repeats}" if timed else "warm-up"
        dec = make_decoder(model, mode, batch_size=p.batch_size, capacity=top)

        def on_step(s: Step, timed: bool = timed, last: bool = last, what: str = what,
                    dec: Any = dec) -> None:
            # The prefill's context is `start`; step k's input makes the sequence start + k long.
            t, phase = s.context_len, s.phase
            if s.index > 0:
                tr.work += 1
            if timed and t in wanted and (phase != "prefill" or t == 1):
                samples[t].append(s.step_ms)  # type: ignore[arg-type]
                if last:
                    r = row(model, mode, t, p.batch_size, samples[t], phase, True,
                            dec.compile_s, dec.attended_keys(t))
                    tr.row("latency", r, f"{mode}: context {t} took {r['latency_ms']:.2f} ms")
                    return
            tr.emit(f"{mode}: {what}, context {t}/{top}", force=False)

        gen = decode(dec, idx[:, :start], n_steps + 1, timer=StepClock(model.device),
                     on_step=on_step, should_stop=tr.stop)
        del dec  # free this run's cache before the next one allocates its own
        if gen.stopped_early or tr.stop():
            return True
    return False


def generation_work(p: Sampling, contexts: list[int]) -> float:
    """Decode steps a cached mode runs this way (warm-up runs included)."""
    steps = contexts[-1] - max(1, contexts[0] - 1)
    warm = steps if p.warmup_steps is None else min(steps, p.warmup_steps)
    return float(p.repeats * steps + p.warmup * warm)
