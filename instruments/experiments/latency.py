"""Latency sweep: per-token time against context length, per decode mode (kind "latency_sweep").

``run(loaded, LatencyParams, progress, should_stop)`` -> run with tables
  latency   one row per mode x context: latency_ms (median), samples_ms (every timed sample),
            spread_ms (max - min), min_ms, flops/bytes from instruments.costs and the rates
  checks    the gate's verdict per mode (``instruments.gate``: logits against mode 1; a mode
            that fails it is not timed, and a note says so)
  summary   the write-up's Table 1 at 10/100/500/1000 tokens
  end_to_end, cumulative   with ``e2e_new_tokens`` > 0: a whole generation per mode
The work runs context by context, every mode at a context before the next context, so the
chart fills evenly from the left. Uncached modes: one full forward of a t-token prompt per
sample. Cached modes (method "crop"): the cache is filled once, growing with the contexts, and
cropped back to t - 1 tokens before each timed step at t -- no generation up to t. Each point
takes ``min_repeats`` samples, more while they disagree by more than ``spread``, at most
``repeats``. On a CPU a sample that another process disturbed (``timing.CpuWatch``) is set aside
and taken again once the machine is quiet, at most ``retakes`` times a point; the row keeps
what was set aside and why (``set_aside_ms``, ``set_aside_why``) and counts disturbed samples
it had to keep (``disturbed_kept``). Method "generate" times cached modes the write-up's way
(``latency_generate``).
``should_stop()`` is polled between samples; a stopped run keeps its rows, marked partial.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from engine import modes
from engine.decoders import Decoder, make_decoder
from engine.model import GPT
from instruments import costs, device, gate, memory
from instruments.experiments import end_to_end
from instruments.experiments.latency_generate import generation_work, time_by_generation
from instruments.params import EndToEndParams, LatencyParams
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, random_prompt, record
from instruments.tables import summary_table
from instruments.timing import CpuWatch, StepClock, synchronize


def row(model: GPT, mode: str, t: int, batch: int, samples_ms: list[float], phase: str,
        last_only: bool, compile_s: float, keys: int | None = None,
        quiet: dict[str, Any] | None = None) -> dict[str, Any]:
    """One latency row: the median, every sample, the formula FLOPs/bytes and the rates.

    ``keys``: what a cached step attends to when that is more than its context (a static-shape
    step reads the whole cache): FLOPs and bytes are charged for it. ``quiet``: the samples set
    aside as disturbed (``set_aside_ms``, ``set_aside_why``) and ``disturbed_kept``.
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
        "spread_ms": max(samples_ms) - min(samples_ms),
        "flops": flops, "tflops": flops / seconds / 1e12 if seconds > 0 else None,
        "bytes": nbytes, "gbps": nbytes / seconds / 1e9 if seconds > 0 else None,
        "compile_s": compile_s,  # set-up (compile / capture) time, never part of a step
        **(quiet or {}),
    }


def _point_work(mode: str, t: int) -> float:
    """Relative cost of one sample, for the time left: a cached step is 1; a forward grows with
    t (about 1 + t/16 on a CPU; the estimate rescales itself by the time actually taken)."""
    return 1.0 if modes.MODES[mode].cached else 1.0 + t / 16


class _Mode:
    """One mode during a sweep: its decoder (kept across contexts) and whether it is warm."""

    def __init__(self, model: GPT, name: str, p: LatencyParams, top: int) -> None:
        self.name, self.model = name, model
        self.cached = modes.MODES[name].cached
        self.dec: Decoder = make_decoder(model, name, batch_size=p.batch_size, capacity=top)
        self.warm = False
        self.watch = CpuWatch.for_device(model.device)

    def sample(self, idx: torch.Tensor, t: int) -> tuple[float, str, str | None]:
        """One timed call at context t: (ms, phase, why it was disturbed or None)."""
        dec, dev = self.dec, self.model.device
        clock = StepClock(dev, watch=self.watch)
        if not self.cached or t == 1:  # a forward of t tokens (a cached mode's prefill at 1)
            clock.start()
            dec.prefill(idx[:, :t])
            ms = clock.stop()
            return ms, ("prefill" if self.cached else "forward"), clock.disturbed[-1]  # type: ignore
        length = dec.length
        if dec.seq is None or length == 0:
            dec.prefill(idx[:, : t - 1])
        elif length >= t - 1:
            dec.rewind(t - 1)  # crop: the next step overwrites what came after
        else:
            dec.extend(idx[:, length : t - 1])  # fill the cache up to t - 1 tokens, untimed
        synchronize(dev)
        clock.start()
        dec.step(idx[:, t - 1 : t])
        ms = clock.stop()
        return ms, "decode", clock.disturbed[-1]  # type: ignore[return-value]


def _measure_point(st: _Mode, p: LatencyParams, idx: torch.Tensor, t: int,
                   tr: Tracker) -> dict[str, Any] | None:
    """The samples of one point (more while they disagree); None if stopped."""
    if not st.warm:
        for _ in range(p.warmup):
            st.sample(idx, t)
        st.warm = True
    samples: list[float] = []
    aside_ms: list[float] = []
    aside_why: list[str] = []
    kept = 0
    retakes = p.retakes
    phase = "forward"
    fewest = min(p.min_repeats, p.repeats)
    while len(samples) < p.repeats:
        if tr.stop():
            return None
        ms, phase, why = st.sample(idx, t)
        tr.work += _point_work(st.name, t)
        if why and st.watch is not None and len(aside_ms) < retakes:
            aside_ms.append(ms)
            aside_why.append(why)
            tr.emit(f"{st.name}: context {t}: a sample was disturbed ({why}); waiting for a "
                    "quiet moment to take it again")
            if not st.watch.wait_quiet(ms):
                retakes = len(aside_ms)  # never quiet in 2 s: keep what comes, marked
            continue
        samples.append(ms)
        kept += why is not None
        med = statistics.median(samples)
        if len(samples) >= fewest and (max(samples) - min(samples)) <= p.spread * med:
            break
    last_only = getattr(st.dec, "logits", "last") == "last"
    quiet = {"set_aside_ms": aside_ms, "set_aside_why": aside_why, "disturbed_kept": kept}
    return row(st.model, st.name, t, p.batch_size, samples, phase, last_only, st.dec.compile_s,
               st.dec.attended_keys(t), quiet)


@torch.no_grad()
def run(loaded: Loaded, params: LatencyParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    """Per-token latency of each mode at each context length (see the module docstring)."""
    start_s = time.perf_counter()
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
    generate = params.method == "generate"
    work = sum(generation_work(params, contexts) if generate and modes.MODES[m].cached
               else sum(_point_work(m, t) * min(params.min_repeats, params.repeats)
                        for t in contexts) for m in params.modes)
    e2e = params.e2e_new_tokens > 0
    points = len(contexts) * len(params.modes) + (len(params.modes) if e2e else 0)
    tr = Tracker(progress, should_stop, points, total_work=work)
    idx = random_prompt(model, params.batch_size, contexts[-1], params.prompt_seed)
    checker = gate.Gate(model, params.batch_size, params.prompt_seed)
    timings = {"gate_s": 0.0}
    states: dict[str, _Mode | None] = {}

    def ready(name: str) -> _Mode | None:
        """The mode's state, gated on first use (None: refused, not timed)."""
        if name not in states:
            tr.emit(f"{name}: checking its logits against mode 1")
            t0 = time.perf_counter()
            check = checker.check(name)
            timings["gate_s"] += time.perf_counter() - t0
            tr.tables.setdefault("checks", []).append(check.to_row())
            states[name] = _Mode(model, name, params, contexts[-1]) if check.passed else None
            if not check.passed:
                tr.done += len(contexts)
                tr.note(f"{name} not timed: {check.detail}")
        return states[name]

    stopped = False
    if generate:  # cached modes the write-up's way, mode after mode; uncached as below
        for name in [m for m in params.modes if modes.MODES[m].cached]:
            if ready(name) is not None and time_by_generation(
                    model, name, params, contexts, idx, tr, row):
                stopped = True
                break
    sweep = [(t, m) for t in contexts for m in params.modes
             if not (generate and modes.MODES[m].cached)]
    for t, name in sweep if not stopped else []:
        st = ready(name)
        if st is None:
            continue
        r = _measure_point(st, params, idx, t, tr)
        if r is None:
            stopped = True
            break
        tr.row("latency", r, f"{name}: context {t} took {r['latency_ms']:.2f} ms "
               f"({len(r['samples_ms'])} samples)")
    states.clear()  # free the caches before the end-to-end part allocates its own
    timings["sweep_s"] = time.perf_counter() - start_s
    if e2e and not stopped:
        t0 = time.perf_counter()
        passed = [c["mode"] for c in tr.tables.get("checks", []) if c["passed"]]
        stopped = end_to_end.measure(model, EndToEndParams(
            params.modes, params.e2e_prompt_len, params.e2e_new_tokens, params.batch_size,
            prompt_seed=params.prompt_seed), passed, tr)
        timings["e2e_s"] = time.perf_counter() - t0
    _note_disturbed(tr)
    if stopped:
        tr.note("stopped: what was measured is kept")
    peaks = None
    if params.measure_peaks:  # last: the first point must not wait for them
        tr.emit("measuring this device's peaks (once per measuring process)")
        t0 = time.perf_counter()
        peaks = device.peaks(model.device, model.dtype).to_dict()
        timings["peaks_s"] = time.perf_counter() - t0
    timings["total_s"] = time.perf_counter() - start_s
    rows = sorted(tr.tables.get("latency", []),
                  key=lambda r: (modes.ordered(params.modes).index(r["mode"]), r["context_len"]))
    tables = {"latency": rows, "checks": tr.tables.get("checks", []),
              "summary": summary_table(rows, pair=_pair(rows)),
              "end_to_end": tr.tables.get("end_to_end", []),
              "cumulative": tr.tables.get("cumulative", [])}
    return record(loaded, "latency_sweep", params, tables, partial=stopped, notes=tr.notes,
                  measured_peaks=peaks, timings=timings)


def _note_disturbed(tr: Tracker) -> None:
    """Say how many samples other processes disturbed, and what became of them."""
    rows = tr.tables.get("latency", [])
    aside = sum(len(r.get("set_aside_ms", [])) for r in rows)
    kept = sum(r.get("disturbed_kept", 0) for r in rows)
    if aside:
        tr.note(f"{aside} sample(s) set aside and taken again: another process used the CPU "
                "while they ran (every one is kept in the run, beside its point)")
    if kept:
        tr.note(f"{kept} sample(s) were disturbed and kept: the retakes ran out; the medians "
                "they enter may be high")


def _pair(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """Table 1's pair: the first uncached and the first cached mode measured (ladder order)."""
    measured = modes.ordered(r["mode"] for r in rows)
    slow = next((m for m in measured if m in modes.UNCACHED), modes.SEED_PAIR[0])
    fast = next((m for m in measured if m not in modes.UNCACHED), modes.SEED_PAIR[1])
    return slow, fast
