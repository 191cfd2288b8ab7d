"""Predicted against measured step time, per mode and context (kind "step_prediction").

``run(loaded, PredictionParams, progress, should_stop)`` -> run with tables
  calibration  the parts timed alone (``instruments.measure.calibration``; kept with the loaded
               model (``loaded.memo``) per batch and thread count, and reused unless
               ``recalibrate``)
  latency, checks  the modes measured by the latency sweep itself (gated first, cached steps
               by cropping the cache), so measured numbers are the sweep's numbers; cached
               modes in ``passes`` passes with their samples pooled (``pooled``)
  prediction   per point: measured and predicted ms, the residual and its share, the parts
  verdicts     per mode: the worst |residual| share against the goal (15% cached, 25%
               uncached) and, where it misses, which part the residuals point at
Calibration runs first, with nothing else timed beside it; a stop during it keeps the pieces
already timed (partial run), a stop during the sweep keeps the points measured. After each
pass the cached steps' parts that do not grow with the context (their matmuls, head and small
operators at one row a sequence) are timed again, rows marked with their ``pass``, and the
predictor takes each part's median over its timings: memory bandwidth drifts over the minutes
a sweep takes (measured: the matmuls 1.7-3.2 ms above their calibration, SmolLM2 on the EPYC),
and the passes' samples are pooled the same way.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from engine.models.config import GPTConfig, ModelConfig
from instruments import lineup
from instruments.costmodel import predict
from instruments.experiments import latency
from instruments.experiments.inputs import (
    MAX_BATCH,
    contexts_within,
    modes_usable,
    parse_contexts,
    parse_modes,
    preset_contexts,
    whole,
)
from instruments.experiments.latency_retakes import merged
from instruments.spine import Event, Loaded, ProgressFn, StopFn, Tracker, no_grad, record

if TYPE_CHECKING:
    pass


@dataclass
class PredictionParams:
    """Calibrate the parts of a step on this device, then measure each mode and predict it
    (``instruments.costmodel.predict``). The calibration is kept with the loaded model and reused
    unless ``recalibrate``."""
    modes: list[str]
    contexts: list[int]
    batch_size: int = 1
    repeats: int = 3  # the most timed samples per measured point and pass (at least 2)
    calibration_repeats: int = 3
    recalibrate: bool = False
    # Cached modes are measured in this many passes over the contexts, their samples pooled:
    # a burst of machine noise then owns no point (uncached forwards, long, take one pass).
    passes: int = 3

    @classmethod
    def defaults(cls, device: str, cfg: ModelConfig) -> PredictionParams:
        block_size = cfg.block_size
        from instruments.costmodel.predict import predictable

        usable = predictable(lineup.defaults(device, cfg.family))
        return cls(usable, preset_contexts("log-spaced (16)", block_size))

    def check(self, cfg: GPTConfig, device: str) -> None:
        modes_usable(self.modes, device, cfg.family)
        contexts_within("context lengths", self.contexts, 1, cfg.block_size)
        whole("batch size", self.batch_size, 1, MAX_BATCH)
        whole("repeats", self.repeats, 1, 50)
        whole("calibration repeats", self.calibration_repeats, 1, 20)
        whole("passes", self.passes, 1, 10)


Params = PredictionParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default=None, help="default: every mode that can be predicted "
                   "and runs here without minutes of compiling")
    p.add_argument("--contexts", default="log-spaced (16)")
    p.add_argument("--repeats", type=int, default=3, help="most samples per point and pass")
    p.add_argument("--passes", type=int, default=3, help="passes over the cached modes")


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> PredictionParams:
    block_size = cfg.block_size
    base = PredictionParams.defaults(args.device, cfg)
    return PredictionParams(parse_modes(args.modes) if args.modes else base.modes,
                            parse_contexts(args.contexts, block_size), args.batch,
                            args.repeats, passes=args.passes)


def summary(run: dict[str, Any]) -> list[str]:
    return [r["sentence"] for r in run["tables"].get("verdicts", [])]


def _key(batch: int) -> tuple[Any, ...]:
    """Where this model's calibration rows are kept (``loaded.memo``: dropped with the model)."""
    import torch

    return ("step_prediction calibration", batch, torch.get_num_threads())


@no_grad
def run(loaded: Loaded, params: PredictionParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    """Calibrate (or reuse), measure, predict (see the module docstring)."""
    from instruments.measure import calibration

    start_s = time.perf_counter()
    model = loaded.checked(params)
    contexts = sorted(set(params.contexts))
    key = _key(params.batch_size)
    have = [] if params.recalibrate else list(loaded.memo.get(key, []))
    done = {(r["part"], r["variant"], r["x"]) for r in have}
    todo = [p for p in calibration.plan(params.modes, params.batch_size, contexts[-1])
            if p not in done]
    timings_todo = sum(1 if part == "hollow" else 2 for part, _, _ in todo)
    tr = Tracker(progress, should_stop, max(timings_todo, 1), unit="calibration timings")
    notes: list[str] = []
    if todo:
        tr.emit(f"calibrating {len(todo)} parts on this device (nothing else is timed now)")

        def tick(message: str) -> bool:
            tr.work += 1
            tr.done += 1
            tr.emit(message, force=False)
            return tr.stop()

        missing: list[str] = []
        new = calibration.calibrate(model, params.modes, params.batch_size, contexts[-1],
                                    params.calibration_repeats, tick, skip=done,
                                    missing=missing)
        notes += [f"not calibrated: {why}" for why in missing]
        have += new
        loaded.memo[key] = have
    else:
        notes.append("calibration reused from an earlier run on this loaded model")
    calibration_s = time.perf_counter() - start_s
    for r in have:  # streamed, so a page can predict each point as it is measured
        tr.emit(f"calibrated {r['part']} {r['variant']} at {r['x']}", table="calibration",
                row=r)
    if tr.stop():
        return record(loaded, "step_prediction", params, {"calibration": have}, partial=True,
                      notes=["stopped while calibrating: the parts timed so far are kept"],
                      timings={"calibration_s": calibration_s})
    sweeps = []
    cached = [m for m in predict.predictable(params.modes) if lineup.spec(m).cached]
    whole_plan = set(calibration.plan(cached, params.batch_size, contexts[-1]))
    flat = {p for p in whole_plan if p[0] in ("layers", "head", "small")}
    retimed: list[dict[str, Any]] = []  # not kept in the memo: they belong to this run's passes
    passes = params.passes if cached else 1
    sizes = [len(contexts) * len(params.modes if i == 0 else cached) for i in range(passes)]
    for i in range(passes):
        names = params.modes if i == 0 else cached
        if sweeps and (sweeps[-1]["meta"].get("partial") or tr.stop()):
            break
        relay = _relay(progress, i, sizes) if progress is not None else None
        sweeps.append(latency.run(loaded, latency.LatencyParams(
            contexts, names, params.batch_size, repeats=max(2, params.repeats),
            measure_peaks=False), relay, should_stop))
        if flat and not tr.stop():  # beside the pass: the parts whose time drifts with memory
            retimed += [{**r, "pass": i + 1} for r in calibration.calibrate(
                model, cached, params.batch_size, contexts[-1], params.calibration_repeats,
                skip=whole_plan - flat)]
    sweep = sweeps[0]
    measured = pooled([s["tables"]["latency"] for s in sweeps])
    points = predict.compare(predict.Calibration(have + retimed), measured)
    verdicts = predict.verdicts(points)
    tr.unit, tr.total, tr.done = "points", len(points), len(points)
    for v in verdicts:
        tr.emit(v["sentence"])
    notes += merged(n for s in sweeps for n in s["meta"].get("notes") or [])
    tables = {"calibration": have + retimed, "latency": measured,
              "checks": sweep["tables"]["checks"], "prediction": points, "verdicts": verdicts}
    return record(loaded, "step_prediction", params, tables,
                  partial=any(s["meta"].get("partial") for s in sweeps), notes=notes,
                  timings={"calibration_s": calibration_s,
                           "total_s": time.perf_counter() - start_s})


def _relay(progress: ProgressFn, i: int, sizes: list[int]) -> ProgressFn:
    """Pass ``i``'s progress as progress over all passes: points counted across them, the
    message saying which pass it is. The time left is the pass's own, plus (from the second
    pass on, once a cached pass has been timed) as long again for each pass still to come."""
    before, grand = sum(sizes[:i]), sum(sizes)
    later = len(sizes) - i - 1

    def relay(ev: Event) -> None:
        eta = ev.eta_s
        if later and eta is not None:
            eta = eta + later * (ev.elapsed_s + eta) if i > 0 else None
        progress(replace(ev, done=before + ev.done, total=grand, eta_s=eta,
                         message=f"pass {i + 1} of {len(sizes)}: {ev.message}"))

    return relay


def pooled(passes: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One latency row per (mode, context) with the samples of every pass: median, min, spread
    and the rates recomputed over all of them."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for rows_of_pass in passes:
        for r in rows_of_pass:
            key = (r["mode"], r["context_len"])
            if key not in rows:
                rows[key] = {**r, "samples_ms": list(r["samples_ms"])}
            else:
                rows[key]["samples_ms"] += list(r["samples_ms"])
    for r in rows.values():
        s = r["samples_ms"]
        r.update(latency_ms=statistics.median(s), min_ms=min(s), spread_ms=max(s) - min(s),
                 passes=sum(1 for p in passes for q in p
                            if (q["mode"], q["context_len"]) == (r["mode"], r["context_len"])))
        seconds = r["latency_ms"] / 1e3
        if seconds > 0 and r.get("flops") is not None:
            r["tflops"] = r["flops"] / seconds / 1e12
        if seconds > 0 and r.get("bytes") is not None:
            r["gbps"] = r["bytes"] / seconds / 1e9
    return list(rows.values())
