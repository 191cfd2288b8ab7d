"""End to end: the time to generate n tokens after a prompt, per mode (kind "end_to_end").

``run(loaded, EndToEndParams, progress, should_stop)`` -> run with tables ``end_to_end`` (one
row per mode: total_s median, samples_s, prefill_ms, flops_total, disturbed_steps: the median
run's steps during which another process used the CPU, on a CPU), ``cumulative`` (the running
total after each token, from the repeat with the median total) and ``checks``. Call 0 is the
prefill (context = prompt_len); call k >= 1 feeds token k-1 back (context = prompt_len + k).
A short untimed run of ``warmup_tokens`` tokens precedes each mode. ``measure`` is the same
work inside another experiment (the latency sweep's end-to-end part).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from engine import modes
from engine.decoders import make_decoder
from engine.loop import decode
from engine.model import GPT
from instruments import costs, gate
from instruments.params import EndToEndParams
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, random_prompt, record
from instruments.timing import CpuWatch, StepClock


def measure(model: GPT, p: EndToEndParams, names: list[str], tr: Tracker) -> bool:
    """Time each mode in ``names`` (already gated); rows go to ``tr``. True if stopped."""
    idx = random_prompt(model, p.batch_size, p.prompt_len, p.prompt_seed)
    watch = CpuWatch.for_device(model.device)  # a generation is not retaken: disturbance counted
    for name in names:
        runs: list[list[float]] = []
        disturbed: list[int] = []
        last_only = True
        for rep in range(-1, p.repeats):  # rep -1: the untimed warm-up
            n = min(p.new_tokens, p.warmup_tokens) if rep < 0 else p.new_tokens
            dec = make_decoder(model, name, batch_size=p.batch_size, capacity=p.prompt_len + n)
            last_only = getattr(dec, "logits", "last") == "last"
            what = f"run {rep + 1}/{p.repeats}" if rep >= 0 else "warm-up"

            def on_step(s: Any, what: str = f"end to end, {name}: {what}", n: int = n,
                        timed: bool = rep >= 0) -> None:
                tr.work += 1 if timed else 0
                tr.emit(f"{what}, token {s.index + 1}/{n}", force=False)

            clock = StepClock(model.device, watch=watch)
            gen = decode(dec, idx, n, timer=clock, on_step=on_step, should_stop=tr.stop)
            del dec
            if gen.stopped_early:
                return True
            if rep >= 0:
                runs.append(gen.step_ms)
                disturbed.append(sum(why is not None for why in clock.disturbed))
        totals_s = [sum(r) / 1e3 for r in runs]
        middle = sorted(range(len(runs)), key=lambda i: sum(runs[i]))[len(runs) // 2]
        median_run = runs[middle]
        spec = modes.MODES[name]
        flops = costs.generation_flops(model.config, p.prompt_len, p.new_tokens,
                                       cached=spec.cached, batch_size=p.batch_size,
                                       last_only=last_only)
        total = {"mode": name, "mode_label": spec.label, "cached": spec.cached,
                 "prompt_len": p.prompt_len, "new_tokens": p.new_tokens,
                 "batch_size": p.batch_size, "dtype": str(model.dtype).removeprefix("torch."),
                 "total_s": statistics.median(totals_s), "samples_s": totals_s,
                 "prefill_ms": median_run[0], "flops_total": flops,
                 "disturbed_steps": disturbed[middle] if watch is not None else None}
        running_s = 0.0
        for step, ms in enumerate(median_run):
            running_s += ms / 1e3
            tr.tables.setdefault("cumulative", []).append(
                {"mode": name, "step": step, "context_len": p.prompt_len + step, "step_ms": ms,
                 "cumulative_s": running_s})
        tr.row("end_to_end", total, f"{name}: {p.new_tokens} tokens in {total['total_s']:.2f} s")
    return False


def work(p: EndToEndParams) -> float:
    return float(len(p.modes) * p.repeats * p.new_tokens)


@torch.no_grad()
def run(loaded: Loaded, params: EndToEndParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    model = loaded.model
    params.check(model.config, str(model.device))
    tr = Tracker(progress, should_stop, len(params.modes), total_work=work(params))
    passed = []
    checker = gate.Gate(model, params.batch_size, params.prompt_seed)
    for name in params.modes:
        check = checker.check(name)
        tr.tables.setdefault("checks", []).append(check.to_row())
        if check.passed:
            passed.append(name)
        else:
            tr.done += 1
            tr.note(f"{name} not timed: {check.detail}")
    stopped = measure(model, params, passed, tr)
    if stopped:
        tr.note("stopped: what was measured is kept")
    tables = {k: tr.tables.get(k, []) for k in ("end_to_end", "cumulative", "checks")}
    return record(loaded, "end_to_end", params, tables, partial=stopped, notes=tr.notes)
