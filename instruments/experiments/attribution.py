"""Where a decode step's time goes: profiler counts, host vs device time, and the floors
(kind "attribution").

``run(loaded, AttributionParams, progress, should_stop)`` -> run with table ``attribution``: for
each mode (gated first) and context, ``attribute_step``'s row. ``steps`` decode steps are timed
plainly (``step_ms``, the median), then the same number run under ``torch.profiler``, each
inside a ``record_function`` span (``instruments.measure.timing.Spans``). From the trace, per step:
operator calls, ATen's and our kernels' (all, and top-level), kernel launches and device time
(CUDA) with the longest kernels by name (``top_kernels``: calls and device us a step), time
inside top-level operators or the compiled region (``ops_ms``) and the host time between them
(``python_ms``). The floors are formulas over measured rates: ``flop_floor_ms`` =
FLOPs / measured matmul peak, ``byte_floor_ms`` = bytes / measured read bandwidth (FLOPs and
bytes from ``instruments.costmodel.costs``, peaks from ``instruments.measure.device.peaks``);
``above_floor_ms`` = step_ms - max(floors): host time and kernels slower than the peak rates
together, not "overhead" alone.
Bytes count the mode's weights as it stores them (``weight_storage``: int8 and bf16 rungs stream
fewer), so each mode's byte floor is its own; ``model_dtype_floor_ms`` is the same step's byte
floor with the weights in the model dtype -- what a weight-only rung gets under.

The chart splits ``step_ms`` into three parts that add up to it exactly:
  ``floor_part_ms``   the part of the busy time the floor explains (min(busy, floor))
  ``excess_ms``       busy time above the floor (kernels slower than peak rate)
  ``idle_ms``         step time with nothing busy: host gaps (CPU) or an idle device (CUDA)
"busy" is time inside operators on a CPU and kernel time on a GPU, measured under the
profiler and rescaled to the plain step. ``explained_share`` = (floor_part_ms + idle_ms) /
step_ms is how much of the step the floor and the profiled host time account for; the rest,
``excess_ms``, is kernel time above the floor that nothing here explains. ``spread_ms`` is the
interquartile range of the plain step's samples (its own spread). The profiled parts themselves
(``ops_ms`` + ``python_ms``) are compared with the plain ``step_ms``: they agree within
``profile_tolerance_ms``, the profiler's own cost (calibrated per operator on this device) plus
the timing spreads -- a tolerance of the profiled split, not an uncertainty of the step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.models.config import GPTConfig, ModelConfig
from instruments import lineup
from instruments.costmodel import costs
from instruments.experiments.inputs import (
    MAX_BATCH,
    contexts_within,
    modes_usable,
    parse_contexts,
    parse_modes,
    whole,
)
from instruments.measure.timing import Spans, StepClock, synchronize
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, no_grad, record

if TYPE_CHECKING:
    from torch.profiler import ProfilerActivity

    from engine.models.base import CausalLM
    from instruments.measure.device import Peaks


@dataclass
class AttributionParams:
    """Where a decode step's time goes, per mode and context (profiler, floors)."""
    modes: list[str]
    contexts: list[int]
    steps: int = 8
    warmup: int = 3
    batch_size: int = 1

    @classmethod
    def defaults(cls, device: str, cfg: ModelConfig) -> AttributionParams:
        """The attribution role's modes that run here and set up in seconds; four contexts."""
        ours = [m for m in lineup.with_role("attribution", device, cfg.family)
                if not lineup.spec(m).slow_setup]
        return cls(ours, [t for t in (16, 64, 256, 512) if t <= cfg.block_size])

    def check(self, cfg: GPTConfig, device: str) -> None:
        modes_usable(self.modes, device, cfg.family)
        contexts_within("context lengths", self.contexts, 1, cfg.block_size)
        whole("steps", self.steps, 1, 200)
        whole("warm-up steps", self.warmup, 0, 50)
        whole("batch size", self.batch_size, 1, MAX_BATCH)


Params = AttributionParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default=None,
                   help="default: the attribution role's modes that run here")
    p.add_argument("--contexts", default="16,64,256,512", help="attribution context lengths")
    p.add_argument("--steps", type=int, default=8, help="timed steps per point")


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> AttributionParams:
    base = AttributionParams.defaults(args.device, cfg)
    return AttributionParams(base.modes if args.modes is None else parse_modes(args.modes),
                             parse_contexts(args.contexts, cfg.block_size), args.steps,
                             batch_size=args.batch)


def summary(run: dict[str, Any]) -> list[str]:
    return [f"{r['mode']:>16} at {r['context_len']:>5} tokens: {r['step_ms']:.2f} ms a step"
            for r in run["tables"].get("attribution", [])]


STEP_SPAN = "kv_lab.decode_step"
# Operator calls: ATen's and our C++ kernels' (mode 8's whole step is one ``kvlab::`` call, the
# ATen calls it makes nested inside it)
OP_PREFIXES = ("aten::", "kvlab::")
_LAUNCH_NAMES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaGraphLaunch")


_PROFILER_COST_US: dict[str, float] = {}


def profiler_cost_us(device: Any = "cpu", n_ops: int = 400) -> float:
    """Extra wall time the profiler adds per ATen operator here (µs), measured once per device.

    Tiny ops timed with and without the profiler; the difference per op is what the profiled
    step carries on top of the plain one.
    """
    import torch
    from torch.profiler import profile

    key = str(torch.device(device))
    if key in _PROFILER_COST_US:
        return _PROFILER_COST_US[key]
    x = torch.zeros(4, device=device)

    def loop() -> float:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(n_ops):
            x.add_(1.0)
        synchronize(device)
        return time.perf_counter() - start

    loop()
    plain = min(loop() for _ in range(3))
    with profile(activities=_activities(device)):
        profiled = min(loop() for _ in range(3))
    cost = max(0.0, (profiled - plain) / n_ops * 1e6)
    _PROFILER_COST_US[key] = cost
    return cost


def _activities(device: Any) -> list[ProfilerActivity]:
    import torch
    from torch.profiler import ProfilerActivity

    acts = [ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    return acts


TOP_KERNELS = 12  # the longest kernels a CUDA row names (the step's whole device time is summed)


@dataclass
class _Trace:
    profiled_step_ms: float
    ops_ms: float
    python_ms: float
    host_ms: float
    device_ms: float | None
    ops_per_step: float
    top_ops_per_step: float
    kernels_per_step: float | None
    launches_per_step: float | None
    spread_ms: float  # interquartile range of the profiled steps' wall times
    top_kernels: list[dict[str, Any]]  # CUDA: the kernels by device time per step, longest first


def _read_trace(prof: Any, cuda: bool) -> _Trace:
    """Per-step figures from the trace: counts are means, times come from the median step.

    Only events inside a step span count. "Busy" host time is every direct child of a span:
    ATen operators in eager modes, the compiled region in compiled ones. On CUDA the profiler
    reports each ``record_function`` span twice, on the CPU and as a GPU-side annotation: only
    the CPU one is a step, and the annotation is no kernel (its length is the span's own).
    """
    import torch

    events = list(prof.events())
    cpu_type = torch.autograd.DeviceType.CPU
    spans = sorted((e for e in events if e.name == STEP_SPAN and e.device_type == cpu_type),
                   key=lambda e: e.time_range.start)
    if not spans:
        raise RuntimeError("the profiler recorded no decode-step spans")
    n = len(spans)
    bounds = [(e.time_range.start, e.time_range.end) for e in spans]

    def inside(e: Any) -> bool:
        start, end = e.time_range.start, e.time_range.end
        return any(lo <= start and end <= hi for lo, hi in bounds)

    per_step = []  # (wall, busy, host issue) in µs for each step
    top = 0
    for span in spans:
        start, end = span.time_range.start, span.time_range.end
        children = list(span.cpu_children)
        top += sum(1 for c in children if c.name.startswith(OP_PREFIXES))
        busy = sum(c.time_range.end - c.time_range.start for c in children)
        issued = max((c.time_range.end for c in children), default=start) - start
        per_step.append((end - start, busy, issued))
    # The median step by wall time: its parts add up to its wall time exactly, and one noisy
    # step (another process taking the core) does not drag the parts of the others.
    wall, busy, issued = sorted(per_step)[n // 2]
    walls = sorted(w for w, _, _ in per_step)
    spread = (walls[(3 * n) // 4] - walls[n // 4]) if n >= 4 else 0.0
    cpu_ops = sum(1 for e in events if e.name.startswith(OP_PREFIXES)
                  and e.device_type == cpu_type and inside(e))
    kernels = launches = device_ms = None
    top_kernels: list[dict[str, Any]] = []
    if cuda:
        dev_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.name != STEP_SPAN and inside(e)]
        kernels = len(dev_events) / n
        device_ms = sum(e.time_range.end - e.time_range.start for e in dev_events) / n / 1e3
        launches = sum(1 for e in events if e.name in _LAUNCH_NAMES and inside(e)) / n
        by_name: dict[str, list[float]] = {}
        for e in dev_events:
            by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
        top_kernels = sorted(({"kernel": name[:120], "calls_per_step": len(t) / n,
                               "device_us_per_step": sum(t) / n} for name, t in by_name.items()),
                             key=lambda k: -k["device_us_per_step"])[:TOP_KERNELS]
    return _Trace(
        profiled_step_ms=wall / 1e3, ops_ms=busy / 1e3, python_ms=(wall - busy) / 1e3,
        host_ms=issued / 1e3, device_ms=device_ms, ops_per_step=cpu_ops / n,
        top_ops_per_step=top / n, kernels_per_step=kernels, launches_per_step=launches,
        spread_ms=spread / 1e3, top_kernels=top_kernels,
    )


@no_grad
def attribute_step(
    model: CausalLM, mode: str, context_len: int, *, steps: int = 8, warmup: int = 3,
    batch_size: int = 1, peaks: Peaks | None = None, decoder: Any = None,
) -> dict[str, Any]:
    """One attribution row for ``mode`` with ``context_len`` tokens in view at the first step.

    The timed steps run at contexts context_len .. context_len + steps - 1. Pass a ``decoder``
    (of ``mode``, capacity >= context_len + warmup + steps) to reuse it across rows.
    """
    from torch.profiler import profile

    from engine.decoders import make_decoder
    from engine.loop import decode, random_prompt
    from instruments.measure import device

    cfg = model.config
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got {steps} and {warmup}")
    start_len = context_len - 1 - warmup  # cached tokens before the warm-up steps
    if start_len < 1 or context_len + steps - 1 > cfg.block_size:
        raise ValueError(
            f"context {context_len} with {warmup} warm-up and {steps} timed steps does not fit; "
            f"allowed: {warmup + 2}..{cfg.block_size - steps + 1}")
    dev = model.device
    peaks = peaks or device.peaks(dev, model.dtype)
    dec = decoder or make_decoder(model, mode, batch_size=batch_size,
                                  capacity=min(cfg.block_size, context_len + steps + warmup))
    prompt = random_prompt(model, batch_size, start_len)
    calls = 1 + warmup + steps  # the prefill and the warm-up steps are never timed
    clock = StepClock(dev, skip=1 + warmup)
    decode(dec, prompt, calls, timer=clock)
    samples = clock.samples_ms
    cuda = dev.type == "cuda"
    with profile(activities=_activities(dev)) as prof:  # only the spans are read
        decode(dec, prompt, calls, timer=Spans(STEP_SPAN, dev, skip=1 + warmup))
    tr = _read_trace(prof, cuda)

    step_ms = statistics.median(samples)
    spec = lineup.spec(mode)
    last_only = spec.cached or getattr(dec, "logits", "last") == "last"
    keys = dec.attended_keys(context_len)  # the whole capacity for static-shape modes
    flops = costs.step_flops(cfg, context_len, cached=spec.cached, batch_size=batch_size,
                             last_only=last_only, keys=keys)
    nbytes = costs.step_bytes(cfg, model.dtype, context_len, cached=spec.cached,
                              batch_size=batch_size, last_only=last_only, keys=keys,
                              storage=spec.weight_storage)  # the mode's own bytes per weight
    # the same step with the weights in the model dtype: how far below that floor a
    # weight-only mode (int8, bf16) gets
    dtype_bytes = costs.step_bytes(cfg, model.dtype, context_len, cached=spec.cached,
                                   batch_size=batch_size, last_only=last_only, keys=keys)
    busy_profiled = tr.device_ms if cuda and tr.device_ms is not None else tr.ops_ms
    busy = step_ms * min(1.0, busy_profiled / tr.profiled_step_ms)  # rescaled to the plain step
    quart = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [step_ms] * 3
    step_spread = quart[2] - quart[0]  # interquartile range of the plain step's samples
    prof_cost = profiler_cost_us(dev) * tr.ops_per_step / 1e3
    tolerance = prof_cost + 2 * (max(step_spread, 0.02 * step_ms) + tr.spread_ms)
    row = {
        "mode": mode, "mode_label": spec.label, "context_len": context_len,
        "attended_keys": keys, "batch_size": batch_size,
        "dtype": str(model.dtype).removeprefix("torch."), "device": str(dev), "steps": steps,
        "step_ms": step_ms, "samples_ms": samples, "spread_ms": step_spread,
        "ops_per_step": tr.ops_per_step, "top_ops_per_step": tr.top_ops_per_step,
        "kernels_per_step": tr.kernels_per_step, "launches_per_step": tr.launches_per_step,
        "profiled_step_ms": tr.profiled_step_ms, "ops_ms": tr.ops_ms,
        "python_ms": tr.python_ms, "host_ms": tr.host_ms, "device_ms": tr.device_ms,
        "flops": flops, "bytes": nbytes, "weight_storage": spec.weight_storage or "",
        "model_dtype_bytes": dtype_bytes, "busy_ms": busy, "idle_ms": step_ms - busy,
        "profiler_cost_ms": prof_cost, "profile_tolerance_ms": tolerance,
        "compile_s": getattr(dec, "compile_s", 0.0), "top_kernels": tr.top_kernels,
    }
    return with_floors(row, peaks)


def with_floors(row: dict[str, Any], peaks: Peaks) -> dict[str, Any]:
    """The row's floors and the parts that depend on them, from ``peaks``' rates."""
    step_ms, busy = row["step_ms"], row["busy_ms"]
    flop_floor = row["flops"] / (peaks.matmul_tflops * 1e12) * 1e3
    byte_floor = row["bytes"] / (peaks.read_gbps * 1e9) * 1e3
    floor = max(flop_floor, byte_floor)
    floor_part = min(busy, floor)
    return {**row, "peak_tflops": peaks.matmul_tflops, "bandwidth_gbps": peaks.read_gbps,
            "flop_floor_ms": flop_floor, "byte_floor_ms": byte_floor, "floor_ms": floor,
            "model_dtype_floor_ms": row.get("model_dtype_bytes", row["bytes"])
            / (peaks.read_gbps * 1e9) * 1e3,
            "bound": "memory" if byte_floor >= flop_floor else "compute",
            "above_floor_ms": step_ms - floor, "floor_above_step": floor > step_ms,
            "floor_part_ms": floor_part, "excess_ms": busy - floor_part,
            # = (floor_part + idle) / step, written so that no excess gives exactly 1 (the fused
            # step's operators can take less than the floor on a tiny model)
            "explained_share": 1.0 - (busy - floor_part) / step_ms if step_ms > 0 else None}


def profile_mode(model: CausalLM, mode: str, contexts: list[int], p: AttributionParams,
                 peaks: Peaks, tr: Tracker) -> bool:
    """Rows of ``attribute_step`` for one mode over ``contexts``, one decoder. True if stopped."""
    from engine.decoders import make_decoder

    dec = make_decoder(model, mode, batch_size=p.batch_size, capacity=model.config.block_size)
    for t in contexts:
        if tr.stop():
            return True
        tr.emit(f"{mode}: profiling context {t}")
        r = attribute_step(model, mode, t, steps=p.steps, warmup=p.warmup,
                           batch_size=p.batch_size, peaks=peaks, decoder=dec)
        tr.work += 1
        tr.row("attribution", r, f"{mode}: context {t}, {r['step_ms']:.2f} ms a step")
    return False


@no_grad
def run(loaded: Loaded, params: AttributionParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    from instruments.checks import gate
    from instruments.measure import device

    model = loaded.model
    cfg = model.config
    params.check(cfg, str(model.device))
    lo, hi = params.warmup + 2, cfg.block_size - params.steps + 1
    contexts = sorted({min(max(int(t), lo), hi) for t in params.contexts})
    tr = Tracker(progress, should_stop, len(params.modes) * len(contexts))
    if set(contexts) != set(params.contexts):
        tr.note(f"context lengths clipped to {lo}..{hi} (warm-up and timed steps must fit)")
    tr.emit("measuring the matmul peak and read bandwidth (once per measuring process)")
    peaks = device.peaks(model.device, model.dtype)
    stopped = False
    checker = gate.Gate(model, params.batch_size)
    for mode in params.modes:
        check = checker.check(mode)
        tr.tables.setdefault("checks", []).append(check.to_row())
        if not check.passed:
            tr.done += len(contexts)
            tr.note(f"{mode} not profiled: {check.detail}")
            continue
        if profile_mode(model, mode, contexts, params, peaks, tr):
            stopped = True
            tr.note("stopped: rows already measured are kept")
            break
    rows, peaks = recheck_floors(tr.tables.get("attribution", []), peaks, model, tr)
    tables = {"attribution": rows, "checks": tr.tables.get("checks", [])}
    return record(loaded, "attribution", params, tables, partial=stopped, notes=tr.notes,
                  measured_peaks=peaks.to_dict())


def recheck_floors(rows: list[dict[str, Any]], peaks: Peaks, model: CausalLM,
                   tr: Tracker) -> tuple[list[dict[str, Any]], Peaks]:
    """A floor above a measured step is impossible: the rates were under-measured. Measure
    them again once and recompute every floor; rows still below their floor are flagged."""
    from instruments.measure import device

    if not any(r["floor_above_step"] for r in rows):
        return rows, peaks
    tr.emit("a floor exceeds a measured step: measuring the peaks again")
    peaks = device.peaks(model.device, model.dtype, fresh=True)
    rows = [with_floors(r, peaks) for r in rows]
    low = [r for r in rows if r["floor_above_step"]]
    tr.note("a floor exceeded a measured step, so the peaks were measured again"
            + (f"; {len(low)} point(s) still sit below their floor (flagged): the measured "
               "read bandwidth is lower than what these steps achieved" if low else ""))
    return rows, peaks
