"""Where a decode step's time goes: profiler counts, host vs device time, and the floors.

Contract:
  measure_peaks(device, dtype, nbytes=None) -> Peaks       measured matmul TFLOP/s + read GB/s
  attribute_step(model, mode, context_len, ...) -> dict     one row (fields below)
  attribution_sweep(model, mode, contexts, ...) -> AttributionResult (rows, cancelled, notes)

For one mode at one context length, ``steps`` decode steps are timed plainly (``step_ms``, the
median), then the same number are run under ``torch.profiler``, each inside a
``record_function`` span. From the trace, per step: ATen operator calls (all, and top-level),
kernel launches and device time (CUDA), time inside top-level operators or the compiled region
(``ops_ms``) and the host time between them (``python_ms``). The floors are formulas over
measured rates: ``flop_floor_ms`` = FLOPs / measured matmul peak, ``byte_floor_ms`` = bytes /
measured read bandwidth (FLOPs and bytes from ``engine.costs``); ``overhead_ms`` = step_ms -
max(floors).

The chart splits ``step_ms`` into three parts that add up to it exactly:
  ``floor_part_ms``   the part of the busy time the floor explains (min(busy, floor))
  ``excess_ms``       busy time above the floor (kernels slower than peak rate)
  ``idle_ms``         step time with nothing busy: host gaps (CPU) or an idle device (CUDA)
"busy" is time inside operators on a CPU and kernel time on a GPU, measured under the
profiler and rescaled to the plain step. The profiled parts themselves (``ops_ms`` +
``python_ms``) are compared with the plain ``step_ms``: they agree within ``error_ms``, the
profiler's own cost (calibrated per operator on this device) plus the timing spread.
``should_stop()`` is polled between context lengths; ``on_progress(done, total, message)``
and ``on_row(row)`` report as rows are measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from . import costs
from .hardware import measure_matmul_tflops, measure_read_bandwidth_gbps
from .model import GPT
from .modes import MODES, check_mode, make_decoder
from .timing import synchronize

STEP_SPAN = "kv_lab.decode_step"
ProgressFn = Callable[[int, int, str], None]
StopFn = Callable[[], bool]
RowFn = Callable[[dict[str, Any]], None]
_LAUNCH_NAMES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaGraphLaunch")


@dataclass(frozen=True)
class Peaks:
    """Rates measured on this device (not datasheet numbers)."""

    device: str
    dtype: str
    tflops: float  # median achieved matmul TFLOP/s
    gbps: float  # median read bandwidth, 1e9 B/s
    bandwidth_bytes: int  # size of the tensor the bandwidth was measured on

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_peaks(device: Any = "cpu", dtype: Any = "float32", nbytes: int | None = None,
                  matmul_n: int | None = None, min_seconds: float = 0.3) -> Peaks:
    """Matmul peak and read bandwidth for the floors. ``nbytes`` defaults to 256 MiB on a CPU
    (well past its last-level cache) and 1 GiB on a GPU."""
    dev = torch.device(device)
    nbytes = nbytes or (2**30 if dev.type == "cuda" else 256 * 2**20)
    n = matmul_n or (4096 if dev.type == "cuda" else 768)
    mm = measure_matmul_tflops(dev, dtype, n=n, min_seconds=min_seconds)
    bw = measure_read_bandwidth_gbps(dev, nbytes=nbytes, repeats=5)
    return Peaks(str(dev), str(dtype).removeprefix("torch."), mm.median_tflops,
                 bw.read_median_gbps, bw.nbytes)


_PROFILER_COST_US: dict[str, float] = {}


def profiler_cost_us(device: Any = "cpu", n_ops: int = 400) -> float:
    """Extra wall time the profiler adds per ATen operator here (µs), measured once per device.

    Tiny ops timed with and without the profiler; the difference per op is what the profiled
    step carries on top of the plain one.
    """
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
    acts = [ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    return acts


def _prompt(model: GPT, batch: int, length: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=gen)
    return ids.to(model.device)


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


def _read_trace(prof: Any, cuda: bool) -> _Trace:
    """Per-step figures from the trace: counts are means, times come from the median step.

    Only events inside a step span count. "Busy" host time is every direct child of a span:
    ATen operators in eager modes, the compiled region in compiled ones.
    """
    events = list(prof.events())
    spans = sorted((e for e in events if e.name == STEP_SPAN), key=lambda e: e.time_range.start)
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
        top += sum(1 for c in children if c.name.startswith("aten::"))
        busy = sum(c.time_range.end - c.time_range.start for c in children)
        issued = max((c.time_range.end for c in children), default=start) - start
        per_step.append((end - start, busy, issued))
    # The median step by wall time: its parts add up to its wall time exactly, and one noisy
    # step (another process taking the core) does not drag the parts of the others.
    wall, busy, issued = sorted(per_step)[n // 2]
    walls = sorted(w for w, _, _ in per_step)
    spread = (walls[(3 * n) // 4] - walls[n // 4]) if n >= 4 else 0.0
    cpu_ops = sum(1 for e in events if e.name.startswith("aten::")
                  and e.device_type == torch.autograd.DeviceType.CPU and inside(e))
    kernels = launches = device_ms = None
    if cuda:
        dev_events = [e for e in events
                      if e.device_type == torch.autograd.DeviceType.CUDA and inside(e)]
        kernels = len(dev_events) / n
        device_ms = sum(e.time_range.end - e.time_range.start for e in dev_events) / n / 1e3
        launches = sum(1 for e in events if e.name in _LAUNCH_NAMES and inside(e)) / n
    return _Trace(
        profiled_step_ms=wall / 1e3, ops_ms=busy / 1e3, python_ms=(wall - busy) / 1e3,
        host_ms=issued / 1e3, device_ms=device_ms, ops_per_step=cpu_ops / n,
        top_ops_per_step=top / n, kernels_per_step=kernels, launches_per_step=launches,
        spread_ms=spread / 1e3,
    )


@torch.no_grad()
def attribute_step(
    model: GPT, mode: str, context_len: int, *, steps: int = 8, warmup: int = 3,
    batch_size: int = 1, peaks: Peaks | None = None, decoder: Any = None,
) -> dict[str, Any]:
    """One attribution row for ``mode`` with ``context_len`` tokens in view at the first step.

    The timed steps run at contexts context_len .. context_len + steps - 1. Pass a ``decoder``
    (of ``mode``, capacity >= context_len + warmup + steps) to reuse it across rows.
    """
    cfg = model.config
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got {steps} and {warmup}")
    start_len = context_len - 1 - warmup  # cached tokens before the warm-up steps
    if start_len < 1 or context_len + steps - 1 > cfg.block_size:
        raise ValueError(
            f"context {context_len} with {warmup} warm-up and {steps} timed steps does not fit; "
            f"allowed: {warmup + 2}..{cfg.block_size - steps + 1}")
    dev = model.device
    peaks = peaks or measure_peaks(dev, model.dtype)
    dec = decoder or make_decoder(model, mode, batch_size=batch_size,
                                  capacity=min(cfg.block_size, context_len + steps + warmup))
    prompt = _prompt(model, batch_size, start_len)

    def prepare() -> torch.Tensor:  # untimed: prefill and warm-up steps
        logits = dec.prefill(prompt)
        for _ in range(warmup):
            logits = dec.step(logits.argmax(-1, keepdim=True))
        synchronize(dev)
        return logits

    def run(logits: torch.Tensor, timer: Callable[[], AbstractContextManager[Any]]) -> None:
        for _ in range(steps):
            token = logits.argmax(-1, keepdim=True)  # chosen outside the timed region
            with timer():
                logits = dec.step(token)

    samples: list[float] = []

    @contextmanager
    def plain() -> Iterator[None]:
        synchronize(dev)
        t0 = time.perf_counter()
        yield
        synchronize(dev)
        samples.append((time.perf_counter() - t0) * 1e3)

    @contextmanager
    def traced() -> Iterator[None]:
        with record_function(STEP_SPAN):
            yield
            synchronize(dev)  # the span covers the device's work too

    run(prepare(), plain)
    cuda = dev.type == "cuda"
    logits = prepare()
    with profile(activities=_activities(dev)) as prof:  # the timed steps only
        run(logits, traced)
    tr = _read_trace(prof, cuda)

    step_ms = statistics.median(samples)
    spec = MODES[mode]
    last_only = spec.cached or getattr(dec, "logits", "last") == "last"
    flops = costs.step_flops(cfg, context_len, cached=spec.cached, batch_size=batch_size,
                             last_only=last_only)
    nbytes = costs.step_bytes(cfg, model.dtype, context_len, cached=spec.cached,
                              batch_size=batch_size)
    flop_floor = flops / (peaks.tflops * 1e12) * 1e3
    byte_floor = nbytes / (peaks.gbps * 1e9) * 1e3
    floor = max(flop_floor, byte_floor)
    busy_profiled = tr.device_ms if cuda and tr.device_ms is not None else tr.ops_ms
    busy = step_ms * min(1.0, busy_profiled / tr.profiled_step_ms)  # rescaled to the plain step
    floor_part = min(busy, floor)
    quart = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [step_ms] * 3
    spread = max(quart[2] - quart[0], 0.02 * step_ms) + tr.spread_ms
    prof_cost = profiler_cost_us(dev) * tr.ops_per_step / 1e3
    return {
        "mode": mode, "mode_label": spec.label, "context_len": context_len,
        "batch_size": batch_size, "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(dev), "steps": steps,
        "step_ms": step_ms, "samples_ms": samples,
        "ops_per_step": tr.ops_per_step, "top_ops_per_step": tr.top_ops_per_step,
        "kernels_per_step": tr.kernels_per_step, "launches_per_step": tr.launches_per_step,
        "profiled_step_ms": tr.profiled_step_ms, "ops_ms": tr.ops_ms,
        "python_ms": tr.python_ms, "host_ms": tr.host_ms, "device_ms": tr.device_ms,
        "flops": flops, "bytes": nbytes, "peak_tflops": peaks.tflops,
        "bandwidth_gbps": peaks.gbps, "flop_floor_ms": flop_floor,
        "byte_floor_ms": byte_floor, "floor_ms": floor,
        "bound": "memory" if byte_floor >= flop_floor else "compute",
        "overhead_ms": step_ms - floor,
        "busy_ms": busy, "floor_part_ms": floor_part, "excess_ms": busy - floor_part,
        "idle_ms": step_ms - busy,
        "profiler_cost_ms": prof_cost, "error_ms": prof_cost + 2 * spread,
        "compile_s": getattr(dec, "compile_s", 0.0),
    }


@dataclass
class AttributionResult:
    rows: list[dict[str, Any]]
    peaks: Peaks
    cancelled: bool = False
    notes: list[str] = field(default_factory=list)


@torch.no_grad()
def attribution_sweep(
    model: GPT, mode: str, contexts: Sequence[int], *, steps: int = 8, warmup: int = 3,
    batch_size: int = 1, peaks: Peaks | None = None, check: bool = True,
    on_progress: ProgressFn | None = None, should_stop: StopFn | None = None,
    on_row: RowFn | None = None,
) -> AttributionResult:
    """Rows of ``attribute_step`` over context lengths (clipped to what fits), one decoder."""
    cfg = model.config
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")
    lo, hi = warmup + 2, cfg.block_size - steps + 1
    wanted = sorted({min(max(int(t), lo), hi) for t in contexts})
    notes: list[str] = []
    if set(wanted) != {int(t) for t in contexts}:
        notes.append(f"context lengths clipped to {lo}..{hi} (warm-up and timed steps must fit)")
    total = len(wanted) + 1
    if on_progress:
        on_progress(0, total, "measuring the matmul peak and read bandwidth")
    peaks = peaks or measure_peaks(model.device, model.dtype)
    result = AttributionResult([], peaks, notes=notes)
    if check and mode != "uncached":
        verdict = check_mode(model, mode, _prompt(model, min(batch_size, 2), 8), n=16)
        if not verdict.passed:
            result.notes.append(f"{mode} not profiled: {verdict.detail}")
            return result
    dec = make_decoder(model, mode, batch_size=batch_size, capacity=cfg.block_size)
    for i, t in enumerate(wanted):
        if should_stop and should_stop():
            result.cancelled = True
            result.notes.append("cancelled; rows already measured are kept")
            break
        if on_progress:
            on_progress(i + 1, total, f"{mode}: profiling context {t}")
        row = attribute_step(model, mode, t, steps=steps, warmup=warmup,
                             batch_size=batch_size, peaks=peaks, decoder=dec)
        result.rows.append(row)
        if on_row:
            on_row(row)
    if on_progress and not result.cancelled:
        on_progress(total, total, f"{mode}: done")
    return result


@torch.no_grad()
def step_memory_growth(decoder: Any, logits: torch.Tensor, n_steps: int = 100) -> dict[str, Any]:
    """Bytes a decoder keeps per decode step (net growth) and allocates per step (churn).

    Runs ``n_steps`` greedy steps under ``torch.profiler(profile_memory=True)``, reads the
    allocator's running total at the end of each step from the trace, and returns
    ``net_bytes_per_step`` = (total after the last step - total after the first) / (n - 1):
    0 when a step frees everything it allocates (a preallocated cache), ~the K/V row when the
    cache grows by concatenation. ``churn_bytes_per_step`` counts every allocation, freed or
    not. ``decoder`` must be prefilled with room for ``n_steps`` more tokens; ``logits`` are its
    last output.
    """
    import json
    import os
    import tempfile

    if n_steps < 2:
        raise ValueError(f"n_steps must be >= 2, got {n_steps}")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(n_steps):
            with record_function(STEP_SPAN):
                logits = decoder.step(logits.argmax(-1, keepdim=True))
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as fh:
            trace = json.load(fh)["traceEvents"]
    finally:
        os.unlink(path)
    spans = sorted((e["ts"] + e["dur"]) for e in trace if e.get("name") == STEP_SPAN)
    mem = sorted((e["ts"], e["args"]) for e in trace if e.get("name") == "[memory]"
                 and int(e["args"].get("Device Type", 0)) == 0)  # 0 = CPU
    if len(spans) < 2 or not mem:
        return {"n_steps": n_steps, "net_bytes_per_step": None, "churn_bytes_per_step": None}

    def total_at(t: float) -> int:
        before = [a["Total Allocated"] for ts, a in mem if ts <= t]
        return int(before[-1]) if before else int(mem[0][1]["Total Allocated"])

    churn = sum(int(a["Bytes"]) for _, a in mem if int(a["Bytes"]) > 0)
    return {"n_steps": n_steps,
            "net_bytes_per_step": (total_at(spans[-1]) - total_at(spans[0])) / (len(spans) - 1),
            "churn_bytes_per_step": churn / n_steps}
