"""Latency sweep: per-token time against context length, per decode mode (kind "latency_sweep").

``run(loaded, LatencyParams, progress, should_stop)`` -> run with tables
  latency   one row per mode x context (ascending within a mode): latency_ms (median),
            samples_ms (every timed repeat), min_ms, flops/bytes from instruments.costs and the
            achieved rates
  checks    the gate's verdict per mode (``instruments.gate``: logits against mode 1; a mode
            that fails it is not timed, and a note says so)
  summary   the write-up's Table 1 at 10/100/500/1000 tokens
  end_to_end, cumulative   with ``e2e_new_tokens`` > 0: a whole generation per mode
Uncached modes: one full forward of a t-token prompt per requested t (``warmup`` untimed +
``repeats`` timed calls). Cached modes: one generation per repeat through the engine's decode
loop, every step timed, and the step whose input makes the sequence t tokens long is the sample
for t. ``should_stop()`` is polled between steps; a stopped run keeps its rows, marked partial.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from engine import modes
from engine.decoders import make_decoder
from engine.loop import Step, decode
from engine.model import GPT
from instruments import costs, device, gate, memory
from instruments.experiments import end_to_end
from instruments.params import EndToEndParams, LatencyParams
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, random_prompt, record
from instruments.tables import summary_table
from instruments.timing import StepClock, time_call


def _uncached_work(t: int) -> float:
    return 1.0 + t / 128  # one full forward ~ a cached step at short context, then ~linear


def mode_work(params: LatencyParams, name: str, contexts: list[int]) -> float:
    """Work units of one mode: a cached step is 1, an uncached forward 1 + t/128 (for the ETA)."""
    if modes.MODES[name].cached:
        steps = contexts[-1] - max(1, contexts[0] - 1)
        warm = steps if params.warmup_steps is None else min(steps, params.warmup_steps)
        return params.repeats * steps + params.warmup * warm
    return (params.warmup + params.repeats) * sum(_uncached_work(t) for t in contexts)


def row(model: GPT, mode: str, t: int, batch: int, samples_ms: list[float], phase: str,
        last_only: bool, compile_s: float, keys: int | None = None) -> dict[str, Any]:
    """One latency row: the median, every sample, the formula FLOPs/bytes and the rates.

    ``keys``: what a cached step attends to when that is more than its context (a static-shape
    step reads the whole cache): FLOPs and bytes are charged for it.
    """
    cfg, spec = model.config, modes.MODES[mode]
    cached = spec.cached and phase == "decode"
    keys = keys if cached else None
    median_ms = statistics.median(samples_ms)
    flops = costs.step_flops(cfg, t, cached=cached, batch_size=batch,
                             last_only=last_only or spec.cached, keys=keys)
    nbytes = costs.step_bytes(cfg, model.dtype, t, cached=cached, batch_size=batch,
                              last_only=last_only or spec.cached, keys=keys)
    seconds = median_ms / 1e3
    return {
        "mode": mode, "mode_label": spec.label, "cached": spec.cached, "phase": phase,
        "context_len": t, "attended_keys": keys or t, "batch_size": batch,
        "dtype": str(model.dtype).removeprefix("torch."),
        "latency_ms": median_ms, "min_ms": min(samples_ms), "samples_ms": list(samples_ms),
        "flops": flops, "tflops": flops / seconds / 1e12 if seconds > 0 else None,
        "bytes": nbytes, "gbps": nbytes / seconds / 1e9 if seconds > 0 else None,
        "compile_s": compile_s,  # set-up (compile / capture) time, never part of a step
    }


def _time_uncached(model: GPT, mode: str, p: LatencyParams, contexts: list[int],
                   idx: torch.Tensor, tr: Tracker) -> bool:
    """Returns True if stopped. One decoder; prefill of each length is one full forward."""
    dec = make_decoder(model, mode, batch_size=p.batch_size)
    last_only = getattr(dec, "logits", "all") == "last"
    for t in contexts:
        prompt = idx[:, :t]
        for _ in range(p.warmup):
            dec.prefill(prompt)
            tr.work += _uncached_work(t)
            if tr.stop():
                return True
        samples: list[float] = []
        for _ in range(p.repeats):
            samples += time_call(lambda pr=prompt: dec.prefill(pr), warmup=0, repeats=1,
                                 device=model.device).samples_ms
            tr.work += _uncached_work(t)
            if tr.stop():
                return True
        r = row(model, mode, t, p.batch_size, samples, "forward", last_only, dec.compile_s)
        tr.row("latency", r, f"{mode}: context {t} took {r['latency_ms']:.2f} ms")
    return False


def _time_cached(model: GPT, mode: str, p: LatencyParams, contexts: list[int],
                 idx: torch.Tensor, tr: Tracker) -> bool:
    """One generation per repeat; rows are emitted during the last one, as it passes them."""
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


@torch.no_grad()
def run(loaded: Loaded, params: LatencyParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    """Per-token latency of each mode at each context length (see the module docstring)."""
    model = loaded.model
    params.check(model.config, str(model.device))
    contexts = sorted(set(params.contexts))
    est = costs.peak_memory_estimate(
        model.config, model.dtype, params.batch_size, contexts[-1],
        None if all(m in modes.UNCACHED for m in params.modes) else "concat",
        device=str(model.device))
    ok, why = memory.fits(model.device, est, resident_bytes=est["weights_bytes"])
    if not ok:
        raise ValueError(f"This sweep would not fit in memory ({why}). Use a smaller batch size "
                         "or shorter contexts.")
    work = sum(mode_work(params, name, contexts) for name in params.modes)
    e2e = params.e2e_new_tokens > 0
    points = len(contexts) * len(params.modes) + (len(params.modes) if e2e else 0)
    tr = Tracker(progress, should_stop, points, total_work=work)
    peaks = None
    if params.measure_peaks:
        tr.emit("measuring this device's peaks (once per measuring process)")
        peaks = device.peaks(model.device, model.dtype).to_dict()
    idx = random_prompt(model, params.batch_size, contexts[-1], params.prompt_seed)
    checker = gate.Gate(model, params.batch_size, params.prompt_seed)
    stopped = False
    for name in params.modes:
        tr.emit(f"{name}: checking its logits against mode 1")
        check = checker.check(name)
        tr.tables.setdefault("checks", []).append(check.to_row())
        if not check.passed:
            tr.work += mode_work(params, name, contexts)
            tr.done += len(contexts)
            tr.note(f"{name} not timed: {check.detail}")
            continue
        timer = _time_cached if modes.MODES[name].cached else _time_uncached
        if timer(model, name, params, contexts, idx, tr) or tr.stop():
            stopped = True
            break
    if e2e and not stopped:
        e2e_params = EndToEndParams(params.modes, params.e2e_prompt_len, params.e2e_new_tokens,
                                    params.batch_size, prompt_seed=params.prompt_seed)
        passed = [c["mode"] for c in tr.tables.get("checks", []) if c["passed"]]
        stopped = end_to_end.measure(model, e2e_params, passed, tr)
    if stopped:
        tr.note("stopped: what was measured is kept")
    rows = tr.tables.get("latency", [])
    tables = {"latency": rows, "checks": tr.tables.get("checks", []),
              "summary": summary_table(rows, pair=_pair(rows)),
              "end_to_end": tr.tables.get("end_to_end", []),
              "cumulative": tr.tables.get("cumulative", [])}
    return record(loaded, "latency_sweep", params, tables, partial=stopped, notes=tr.notes,
                  measured_peaks=peaks)


def _pair(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """Table 1's pair: the first uncached and the first cached mode measured (ladder order)."""
    measured = modes.ordered(r["mode"] for r in rows)
    slow = next((m for m in measured if m in modes.UNCACHED), modes.SEED_PAIR[0])
    fast = next((m for m in measured if m not in modes.UNCACHED), modes.SEED_PAIR[1])
    return slow, fast
