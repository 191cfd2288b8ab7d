"""Timed sweeps: per-token latency against context length, and end-to-end generation time.

Contract:
  run_latency_sweep(model, spec, on_progress, should_stop) -> SweepResult
    Every mode is first checked (greedy tokens equal mode 1's); a mode that disagrees is not
    timed. Uncached modes: one full forward of a t-token prompt per requested t (`warmup`
    untimed + `repeats` timed calls). Cached modes: one generation run per repeat, every decode
    step timed, and the step whose input makes the sequence t tokens long is the sample for t.
    Rows (one per mode x context, context ascending within a mode) carry latency_ms (median),
    samples_ms (every timed repeat), flops/bytes from engine.costs and the achieved rates.
  run_end_to_end(...) -> E2EResult: total time to generate n tokens, and the cumulative curve.
Which context lengths to run comes from engine.contexts (re-exported here).
`should_stop()` is polled between steps; a cancelled run keeps the rows already finished.
Every timed region is device-synchronised (engine.timing).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import costs
from .contexts import (  # re-exported: pages and the CLI import them from here
    CONTEXT_PRESETS as CONTEXT_PRESETS,
)
from .contexts import (
    parse_contexts as parse_contexts,
)
from .contexts import (
    preset_contexts as preset_contexts,
)
from .contexts import (
    repeated_contexts as repeated_contexts,
)
from .model import GPT
from .modes import MODES, ModeCheck, check_mode, make_decoder, mode_available
from .timing import StepClock, time_call

MAX_BATCH = 256
ProgressFn = Callable[["Progress"], None]
StopFn = Callable[[], bool]


@dataclass
class SweepSpec:
    contexts: list[int]
    modes: list[str]
    batch_size: int = 1
    warmup: int = 1  # untimed calls per point (uncached) / untimed runs per mode (cached)
    repeats: int = 3
    prompt_seed: int = 0
    warmup_steps: int | None = None  # decode steps per cached warm-up run; None = a full run
    check_tokens: int = 16  # greedy tokens compared with mode 1 before a mode is timed

    def validate(self, model: GPT) -> None:
        """Raise ValueError (one line, saying what is allowed) if this spec cannot run."""
        block = model.config.block_size
        if not self.contexts:
            raise ValueError(f"no context lengths given; allowed: 1..{block}")
        bad = [t for t in self.contexts if isinstance(t, bool) or not isinstance(t, int)
               or not 1 <= t <= block]
        if bad:
            raise ValueError(f"context length {bad[0]!r} is outside 1..{block}")
        if not self.modes:
            raise ValueError(f"no modes given; allowed: {', '.join(MODES)}")
        for name in self.modes:
            ok, why = mode_available(model, name)
            if not ok:
                raise ValueError(f"mode {name!r} cannot run: {why}")
        for name, value, lo, hi in (("batch size", self.batch_size, 1, MAX_BATCH),
                                    ("repeats", self.repeats, 1, None),
                                    ("warmup", self.warmup, 0, None),
                                    ("check tokens", self.check_tokens, 1, None)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo or (
                    hi is not None and value > hi):
                rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
                raise ValueError(f"{name} must be a whole number {rng}, got {value!r}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"warmup steps must be >= 0, got {self.warmup_steps}")


def default_spec(device: str, block_size: int) -> SweepSpec:
    """Quick defaults: ~16 log-spaced points; more repeats and full warm-up runs on a GPU."""
    contexts = preset_contexts("log-spaced (16)", block_size)
    if str(device).startswith("cuda"):
        return SweepSpec(contexts, ["uncached", "concat"], repeats=5, warmup=1)
    # On a shared CPU a full warm-up run of gpt2 costs a minute; a short one warms the same code.
    return SweepSpec(contexts, ["uncached", "concat"], repeats=3, warmup=1, warmup_steps=32)


@dataclass
class Progress:
    done: int  # points finished (timed or refused)
    total: int
    row: dict[str, Any] | None  # the row just finished, if any
    elapsed_s: float
    eta_s: float | None  # rough: from the share of forward/step calls done
    message: str


@dataclass
class SweepResult:
    rows: list[dict[str, Any]]
    cancelled: bool
    checks: list[ModeCheck]
    notes: list[str] = field(default_factory=list)  # e.g. why a mode was not timed


class _Tracker:
    """Counts work units (for the ETA) and throttles progress callbacks between rows."""

    def __init__(self, total_points: int, total_work: float, on_progress: ProgressFn | None,
                 should_stop: StopFn | None) -> None:
        self.total, self.total_work = total_points, max(total_work, 1e-9)
        self.done, self.work = 0, 0.0
        self.on_progress, self.should_stop = on_progress, should_stop
        self.start_s = time.perf_counter()
        self.last_emit_s = 0.0

    def stop(self) -> bool:
        return bool(self.should_stop and self.should_stop())

    def emit(self, message: str, row: dict | None = None, points: int = 0,
             force: bool = True) -> None:
        self.done += points
        now = time.perf_counter()
        if self.on_progress is None or (not force and now - self.last_emit_s < 0.5):
            return
        self.last_emit_s = now
        elapsed = now - self.start_s
        frac = min(self.work / self.total_work, 1.0)
        eta = elapsed * (1 - frac) / frac if frac > 0 else None
        self.on_progress(Progress(self.done, self.total, row, elapsed, eta, message))

    def add_row(self, rows: list[dict], row: dict) -> None:
        rows.append(row)
        self.emit(f"{row['mode']}: context {row['context_len']} took {row['latency_ms']:.2f} ms",
                  row, points=1)


def _uncached_work(t: int) -> float:
    return 1.0 + t / 128  # one full forward ~ a cached step at short context, then ~linear


def _prompt(model: GPT, batch: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.config.vocab_size, (batch, length), generator=gen)
    return idx.to(model.device)


def dtype_name(model: GPT) -> str:
    return str(model.dtype).removeprefix("torch.")


def _row(model: GPT, mode: str, t: int, batch: int, samples_ms: list[float], phase: str,
         last_only: bool, compile_s: float) -> dict[str, Any]:
    cfg, spec = model.config, MODES[mode]
    cached = spec.cached and phase == "decode"
    median_ms = statistics.median(samples_ms)
    flops = costs.step_flops(cfg, t, cached=cached, batch_size=batch,
                             last_only=last_only or spec.cached)
    nbytes = costs.step_bytes(cfg, model.dtype, t, cached=cached, batch_size=batch)
    seconds = median_ms / 1e3
    return {
        "mode": mode, "mode_label": spec.label, "cached": spec.cached, "phase": phase,
        "context_len": t, "batch_size": batch, "dtype": dtype_name(model),
        "latency_ms": median_ms, "min_ms": min(samples_ms), "samples_ms": list(samples_ms),
        "flops": flops, "tflops": flops / seconds / 1e12 if seconds > 0 else None,
        "bytes": nbytes, "gbps": nbytes / seconds / 1e9 if seconds > 0 else None,
        "compile_s": compile_s,  # set-up (compile / capture) time, never part of a step
    }


def run_checks(model: GPT, modes: Sequence[str], batch: int, n_tokens: int,
               seed: int = 0) -> list[ModeCheck]:
    """check_mode for each mode on a short prompt (mode 1 is the reference: nothing to check)."""
    prompt_len = max(1, min(8, model.config.block_size - n_tokens))
    prompt = _prompt(model, min(batch, 2), prompt_len, seed)
    n = min(n_tokens, model.config.block_size - prompt_len)
    out = []
    for name in modes:
        if name == "uncached":
            out.append(ModeCheck(name, True, "mode 1 is the reference"))
            continue
        try:
            out.append(check_mode(model, name, prompt, n=n))
        except torch.OutOfMemoryError:
            raise  # not the mode's fault: the caller reports the sizes that did not fit
        except Exception as exc:  # a mode that crashes is as untrustworthy as a wrong one
            out.append(ModeCheck(name, False, f"raised {type(exc).__name__}: {exc}"))
    return out


def _time_uncached(model: GPT, mode: str, spec: SweepSpec, idx: torch.Tensor,
                   tr: _Tracker, rows: list[dict]) -> bool:
    """Returns True if cancelled. One decoder; prefill of each length is one full forward."""
    dec = make_decoder(model, mode, batch_size=spec.batch_size)
    last_only = getattr(dec, "logits", "all") == "last"
    for t in spec.contexts:
        prompt = idx[:, :t]
        for _ in range(spec.warmup):
            dec.prefill(prompt)
            tr.work += _uncached_work(t)
            if tr.stop():
                return True
        samples: list[float] = []
        for _ in range(spec.repeats):
            samples += time_call(lambda p=prompt: dec.prefill(p), warmup=0, repeats=1,
                                 device=model.device).samples_ms
            tr.work += _uncached_work(t)
            if tr.stop():
                return True
        tr.add_row(rows, _row(model, mode, t, spec.batch_size, samples, "forward", last_only,
                              getattr(dec, "compile_s", 0.0)))
    return False


def _time_cached(model: GPT, mode: str, spec: SweepSpec, idx: torch.Tensor,
                 tr: _Tracker, rows: list[dict]) -> bool:
    """One generation run per repeat; rows are emitted during the last run, as it passes them."""
    top = max(spec.contexts)
    p = max(1, min(spec.contexts) - 1)  # prefill length: the first decode step reaches min+...
    wanted = set(spec.contexts)
    samples: dict[int, list[float]] = {t: [] for t in spec.contexts}
    n_runs = spec.warmup + spec.repeats
    setup_s = 0.0

    def add(t: int, phase: str) -> None:
        tr.add_row(rows, _row(model, mode, t, spec.batch_size, samples[t], phase, True, setup_s))

    for run in range(n_runs):
        timed = run >= spec.warmup
        last = run == n_runs - 1
        n_steps = top - p
        if not timed and spec.warmup_steps is not None:
            n_steps = min(n_steps, spec.warmup_steps)
        dec = make_decoder(model, mode, batch_size=spec.batch_size, capacity=top)
        clock = StepClock(model.device)
        clock.start()
        logits = dec.prefill(idx[:, :p])
        prefill_ms = clock.stop()
        if timed and p in wanted:  # only context 1 can be a prefill here (p = 1)
            samples[p].append(prefill_ms)
            if last:
                add(p, "prefill")
        what = f"run {run + 1 - spec.warmup}/{spec.repeats}" if timed else "warm-up"
        for _ in range(n_steps):
            token = logits.argmax(-1, keepdim=True)  # greedy, chosen outside the timed region
            clock.start()
            logits = dec.step(token)
            step_ms = clock.stop()
            tr.work += 1
            t = dec.length
            setup_s = max(setup_s, getattr(dec, "compile_s", 0.0))
            if timed and t in wanted:
                samples[t].append(step_ms)
                if last:
                    add(t, "decode")
            else:
                tr.emit(f"{mode}: {what}, context {t}/{top}", force=False)
            if tr.stop():
                return True
        del dec, logits  # free this run's cache before the next one allocates its own
    return False


@torch.no_grad()
def run_latency_sweep(model: GPT, spec: SweepSpec, on_progress: ProgressFn | None = None,
                      should_stop: StopFn | None = None) -> SweepResult:
    """Per-token latency of each mode at each context length (see the module docstring)."""
    spec.validate(model)
    contexts = sorted(set(spec.contexts))
    spec = SweepSpec(**{**spec.__dict__, "contexts": contexts})
    work = sum(_mode_work(spec, name, contexts) for name in spec.modes)
    tr = _Tracker(len(contexts) * len(spec.modes), work, on_progress, should_stop)
    idx = _prompt(model, spec.batch_size, contexts[-1], spec.prompt_seed)
    rows: list[dict[str, Any]] = []
    checks: list[ModeCheck] = []
    notes: list[str] = []
    for name in spec.modes:
        tr.emit(f"{name}: checking greedy tokens against mode 1")
        check = run_checks(model, [name], spec.batch_size, spec.check_tokens, spec.prompt_seed)[0]
        checks.append(check)
        if not check.passed:
            note = f"{name} not timed: {check.detail}"
            notes.append(note)
            tr.work += _mode_work(spec, name, contexts)
            tr.emit(note, points=len(contexts))
            continue
        timer = _time_cached if MODES[name].cached else _time_uncached
        if timer(model, name, spec, idx, tr, rows) or tr.stop():
            tr.emit("cancelled; rows already measured are kept")
            return SweepResult(rows, True, checks, notes)
    return SweepResult(rows, False, checks, notes)


def _mode_work(spec: SweepSpec, name: str, contexts: list[int]) -> float:
    """Work units of one mode: a cached step is 1, an uncached forward 1 + t/128 (for the ETA)."""
    if MODES[name].cached:
        steps = contexts[-1] - max(1, contexts[0] - 1)
        warm = steps if spec.warmup_steps is None else min(steps, spec.warmup_steps)
        return spec.repeats * steps + spec.warmup * warm
    return (spec.warmup + spec.repeats) * sum(_uncached_work(t) for t in contexts)


# ------------------------------------------------------------------------------ end to end
@dataclass
class E2EResult:
    totals: list[dict[str, Any]]
    cumulative: list[dict[str, Any]]
    cancelled: bool
    checks: list[ModeCheck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@torch.no_grad()
def run_end_to_end(model: GPT, modes: Sequence[str], prompt_len: int, new_tokens: int,
                   batch_size: int = 1, repeats: int = 1, on_progress: ProgressFn | None = None,
                   should_stop: StopFn | None = None, warmup_tokens: int = 8,
                   prompt_seed: int = 0) -> E2EResult:
    """Time to generate `new_tokens` greedy tokens after a `prompt_len` prompt, per mode.

    Step 0 is the prefill (context = prompt_len); step k >= 1 feeds token k-1 back (context =
    prompt_len + k). A short untimed run of `warmup_tokens` tokens precedes each mode.
    The cumulative curve comes from the repeat with the median total.
    """
    block = model.config.block_size
    if prompt_len < 1 or new_tokens < 1 or prompt_len + new_tokens - 1 > block:
        raise ValueError(f"prompt length + new tokens - 1 must be within 1..{block} "
                         f"(got {prompt_len} + {new_tokens}), with at least one new token")
    SweepSpec([prompt_len], list(modes), batch_size, 0, repeats).validate(model)
    work = float(len(modes) * repeats * new_tokens)
    tr = _Tracker(len(modes), work, on_progress, should_stop)
    idx = _prompt(model, batch_size, prompt_len, prompt_seed)
    cfg = model.config
    totals: list[dict[str, Any]] = []
    cumulative: list[dict[str, Any]] = []
    checks, notes = [], []
    for name in modes:
        check = run_checks(model, [name], batch_size, 16, prompt_seed)[0]
        checks.append(check)
        if not check.passed:
            notes.append(f"{name} not timed: {check.detail}")
            tr.emit(notes[-1], points=1)
            continue
        runs: list[list[float]] = []
        for rep in range(-1, repeats):  # rep -1: the untimed warm-up
            n = min(new_tokens, warmup_tokens) if rep < 0 else new_tokens
            dec = make_decoder(model, name, batch_size=batch_size, capacity=prompt_len + n)
            clock = StepClock(model.device)
            clock.start()
            logits = dec.prefill(idx)
            clock.stop()
            for _ in range(n - 1):
                token = logits.argmax(-1, keepdim=True)
                clock.start()
                logits = dec.step(token)
                clock.stop()
                tr.work += 1 if rep >= 0 else 0
                what = f"run {rep + 1}/{repeats}" if rep >= 0 else "warm-up"
                tr.emit(f"{name}: {what}, token {dec.length - prompt_len + 1}/{n}", force=False)
                if tr.stop():
                    return E2EResult(totals, cumulative, True, checks, notes)
            if rep >= 0:
                runs.append(clock.samples_ms)
        spec = MODES[name]
        totals_s = [sum(r) / 1e3 for r in runs]
        median_run = sorted(runs, key=sum)[len(runs) // 2]
        flops = costs.generation_flops(cfg, prompt_len, new_tokens, cached=spec.cached,
                                       batch_size=batch_size,
                                       last_only=getattr(dec, "logits", "last") == "last")
        row = {"mode": name, "mode_label": spec.label, "cached": spec.cached,
               "prompt_len": prompt_len, "new_tokens": new_tokens, "batch_size": batch_size,
               "dtype": dtype_name(model), "total_s": statistics.median(totals_s),
               "samples_s": totals_s, "prefill_ms": median_run[0], "flops_total": flops}
        totals.append(row)
        running_s = 0.0
        for step, ms in enumerate(median_run):
            running_s += ms / 1e3
            cumulative.append({"mode": name, "step": step, "context_len": prompt_len + step,
                               "step_ms": ms, "cumulative_s": running_s})
        tr.emit(f"{name}: {new_tokens} tokens in {row['total_s']:.2f} s", row, points=1)
    return E2EResult(totals, cumulative, False, checks, notes)


# ------------------------------------------------------------------------------ summaries
def summary_table(rows: Sequence[dict[str, Any]], pair: tuple[str, str] = ("uncached", "concat"),
                  at: Sequence[int] = (10, 100, 500, 1000)) -> list[dict[str, Any]]:
    """The write-up's Table 1 (+ Table 2's rates) from sweep rows, at the nearest measured point.

    A requested point is skipped when no context measured for both modes lies within 25% of it.
    """
    by_mode: dict[str, dict[int, dict]] = {m: {} for m in pair}
    for r in rows:
        if r.get("mode") in by_mode:
            by_mode[r["mode"]][int(r["context_len"])] = r
    common = sorted(set(by_mode[pair[0]]) & set(by_mode[pair[1]]))
    out = []
    for want in at:
        if not common:
            break
        t = min(common, key=lambda c: (abs(c - want), c))
        if abs(t - want) > 0.25 * want:
            continue
        a, b = by_mode[pair[0]][t], by_mode[pair[1]][t]
        out.append({
            "context_len": want, "measured_context_len": t,
            "baseline_mode": pair[0], "baseline_ms": a["latency_ms"],
            "compare_mode": pair[1], "compare_ms": b["latency_ms"],
            "speedup": a["latency_ms"] / b["latency_ms"] if b["latency_ms"] else math.nan,
            "flop_reduction": a["flops"] / b["flops"],
            "baseline_tflops": a.get("tflops"), "compare_tflops": b.get("tflops"),
        })
    return out


def format_summary(table: Sequence[dict[str, Any]]) -> str:
    """Table 1 as fixed-width text for a terminal."""
    if not table:
        return "(no context measured in both modes near 10/100/500/1000 tokens)"
    a, b = table[0]["baseline_mode"], table[0]["compare_mode"]
    head = f"{'context':>8} {a + ' ms':>14} {b + ' ms':>14} {'speedup':>8} {'FLOP ratio':>10}"
    lines = [head]
    for r in table:
        lines.append(f"{r['measured_context_len']:>8} {r['baseline_ms']:>14.2f} "
                     f"{r['compare_ms']:>14.2f} {r['speedup']:>7.1f}x {r['flop_reduction']:>9.0f}x")
    return "\n".join(lines)
