"""Latency sweep: per-token time against context length, per decode mode (kind "latency_sweep").

``run(loaded, LatencyParams, progress, should_stop)`` -> run with tables
  latency   one row per mode x context: latency_ms (median), samples_ms (every timed sample),
            spread_ms (max - min), min_ms, p50_ms / p90_ms / p99_ms over the kept samples (None
            where too few: ``instruments.store.stats``), flops/bytes from
            instruments.costmodel.costs and the rates, and once the peaks are measured (last)
            mbu / mfu against them and mbu_listed / mfu_listed against the datasheet
            (``instruments.experiments.utilization``)
  checks    the gate's verdict per mode (``latency_gate``: logits against mode 1, the short
            context before the first point, the long one after the first context; a mode that
            fails is not timed, or has its points withheld, and a note says so)
  summary   the write-up's Table 1 at 10/100/500/1000 tokens
  end_to_end, cumulative   with ``e2e_new_tokens`` > 0: a whole generation per mode
The work runs context by context, every mode at a context before the next context, so the chart
fills evenly from the left (``order`` "spread": the shortest, the longest, then those between,
halving the gaps: a sweep stopped early still spans them). Uncached modes: one full forward of a
t-token prompt per sample. Cached modes (method "crop"): the decoder seeks to t - 1 tokens (its
cache filled, grown or cropped back) before each timed step at t -- no generation up to t. The
samples of a point are the ``Sampler``'s (``instruments.measure.sampler``): at least
``min_repeats``, more while they disagree by more than ``spread``, at most ``repeats`` (a
prediction within its measured error stands in for one; a cheap point samples on to ``point_ms``);
a sample the CPU watch flags is retaken only when out of line, within a budget (``LatencyParams``).
The row keeps what was set aside and why (``set_aside_ms``, ``set_aside_why``), counts flagged
samples kept in line (``flagged_consistent``) and out of line (``disturbed_kept``), its
``retake_s`` and what ended the point (``confirmed_by``: "samples", "prediction" or None);
meta.retakes sums them. Method "generate" times cached modes the write-up's way
(``latency_generate``). ``should_stop()`` is polled between samples; a stopped run keeps its rows,
marked partial.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.models.config import GPTConfig, ModelConfig
from instruments import lineup
from instruments.costmodel import costs
from instruments.experiments import end_to_end
from instruments.experiments.inputs import (
    MAX_BATCH,
    contexts_within,
    modes_usable,
    parse_contexts,
    parse_modes,
    preset_contexts,
    spread_order,
    whole,
)
from instruments.experiments.latency_retakes import note_disturbed
from instruments.experiments.utilization import add_shares, listed_peaks, row
from instruments.spine import (
    Loaded,
    ProgressFn,
    StopFn,
    Tracker,
    no_grad,
    record,
)
from instruments.store.tables import format_summary, summary_table

if TYPE_CHECKING:
    import torch

    from engine.models.base import CausalLM
    from instruments.measure.sampler import RetakeBudget, Sampler


@dataclass
class LatencyParams:
    """Per-token latency against context, per mode; optionally a whole generation per mode.

    Each point takes ``min_repeats`` timed samples, more while they disagree by more than
    ``spread`` (max - min over the median), up to ``repeats``. ``method`` "crop" fills each cached
    mode's cache once and crops it back to each context; "generate" is the write-up's way: one
    generation per repeat, read as it passes each context (``warmup_steps`` sizes its warm-up).
    On a CPU, a sample during which another process used the CPU and that is out of line with
    the point's other samples (or its prediction) is set aside and taken again once the machine
    is quiet, up to ``retakes`` times per point ("crop" only), while retakes and waits stay
    within ``retake_share`` of the elapsed sweep. ``predicted_ms`` ({mode: {context: ms}}) and
    ``prediction_error`` ({mode: share}, the calibration's measured miss): a first sample within
    that error of the prediction needs no second one. A cheap point (a cached step) samples on,
    past ``repeats`` if need be, until its samples add up to ``point_ms`` or there are
    ``cheap_repeats`` of them (``point_ms`` 0: off): its median then stands on five samples for
    a fraction of a second, and one disturbed sample no longer moves it.
    """
    contexts: list[int]
    modes: list[str]
    batch_size: int = 1
    warmup: int = 1  # untimed calls per mode before its first point (per run: "generate")
    repeats: int = 3  # the most timed samples per point
    prompt_seed: int = 0
    warmup_steps: int | None = None  # "generate": decode steps per warm-up run; None = a full run
    e2e_new_tokens: int = 0  # > 0: also time a whole generation per mode (end-to-end tables)
    e2e_prompt_len: int = 8
    measure_peaks: bool = True  # the device's peaks go into the run (measured once a process)
    min_repeats: int = 2
    spread: float = 0.10
    method: str = "crop"
    retakes: int = 3  # CPU: disturbed samples set aside and taken again, per point (0: keep all)
    retake_share: float = 0.15  # retakes and quiet-waits: at most this share of the sweep
    predicted_ms: dict[str, dict[int, float]] | None = None  # mode -> context -> predicted step
    prediction_error: dict[str, float] | None = None  # mode -> the prediction's measured miss
    point_ms: float = 250.0  # a cheap point samples on until its samples add up to this
    cheap_repeats: int = 5  # ... or until it has this many
    order: str = "ascending"  # or "spread": shortest, longest, then between (module docstring)

    @classmethod
    def defaults(cls, device: str, cfg: ModelConfig) -> LatencyParams:
        """~16 log-spaced points, modes 1 and 3 (the write-up's pair) and, on a CPU, mode 8 (our
        fastest exact cached step there); more samples allowed on a GPU."""
        block_size = cfg.block_size
        contexts = preset_contexts("log-spaced (16)", block_size)
        pair = [m for m in lineup.seed_pair() if lineup.available(m, device, cfg.family)[0]]
        if str(device).startswith("cuda"):
            return cls(contexts, pair, repeats=5, warmup=2)
        fastest = lineup.fastest_exact(str(device), cfg.family)
        return cls(contexts, list(dict.fromkeys([*pair, fastest])), repeats=3, warmup=1,
                   warmup_steps=32)

    def check(self, cfg: GPTConfig, device: str) -> None:
        contexts_within("context lengths", self.contexts, 1, cfg.block_size)
        modes_usable(self.modes, device, cfg.family)
        whole("batch size", self.batch_size, 1, MAX_BATCH)
        whole("repeats", self.repeats, 1)
        whole("fewest repeats", self.min_repeats, 1)
        whole("warmup", self.warmup, 0)
        whole("retakes", self.retakes, 0)
        whole("cheap repeats", self.cheap_repeats, 1)
        if isinstance(self.point_ms, bool) or not isinstance(self.point_ms, int | float) or \
                not 0 <= self.point_ms <= 60_000:
            raise ValueError("point ms (the timed ms a cheap point's samples add up to) must be "
                             f"from 0 (off) to 60000, got {self.point_ms!r}")
        if self.order not in ("ascending", "spread"):
            raise ValueError(f"order must be 'ascending' or 'spread', got {self.order!r}")
        if self.method not in ("crop", "generate"):
            raise ValueError(f"method must be 'crop' or 'generate', got {self.method!r}")
        if not 0 < self.spread < 10:
            raise ValueError(f"spread must be a share above 0 (0.1 = 10%), got {self.spread!r}")
        if self.warmup_steps is not None:
            whole("warmup steps", self.warmup_steps, 0)
        if isinstance(self.retake_share, bool) or not 0 <= self.retake_share < 1:
            raise ValueError("retake share must be a share of the sweep from 0 to below 1 "
                             f"(0.15 = 15%), got {self.retake_share!r}")
        for mode, table in (self.predicted_ms or {}).items():
            if mode not in self.modes or any(isinstance(v, bool) or not isinstance(
                    v, int | float) or v <= 0 for v in table.values()):
                raise ValueError(f"predicted_ms must map a swept mode to positive ms per "
                                 f"context, got {mode!r}")
        if any(isinstance(e, bool) or not isinstance(e, int | float) or not 0 < e < 1
               for e in (self.prediction_error or {}).values()):
            raise ValueError("prediction_error must be a share between 0 and 1 (0.1 = 10%) "
                             "per mode")
        if self.e2e_new_tokens:
            self.end_to_end().check(cfg, device)

    def prediction(self, mode: str, t: int) -> tuple[float | None, float | None]:
        """(predicted ms, its measured error) of ``mode`` at ``t``; (None, None) if none."""
        table = (self.predicted_ms or {}).get(mode) or {}
        ms = table.get(t, table.get(str(t)))  # type: ignore[call-overload]  # JSON keys
        error = (self.prediction_error or {}).get(mode)
        return (float(ms), float(error)) if ms is not None and error is not None else (None, None)

    def end_to_end(self) -> end_to_end.EndToEndParams:
        """The end-to-end part's own params."""
        return end_to_end.EndToEndParams(self.modes, self.e2e_prompt_len, self.e2e_new_tokens,
                                         self.batch_size, prompt_seed=self.prompt_seed)


Params = LatencyParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default="log-spaced (16)",
                   help='a preset ("log-spaced (16)", "every length 8..1024") or "8,16,100-200:10"')
    p.add_argument("--modes", default=None, help="default: uncached,concat (+ fast on a CPU); "
                   f"from: {', '.join(lineup.names())}")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=None,
                   help="the most timed samples per point (at least 2, more while they "
                   "disagree by more than 10%%; a cheap point up to 5): default 3 on CPU, 5 on "
                   "CUDA")
    p.add_argument("--method", default="crop", choices=["crop", "generate"],
                   help="crop: fill the cache once and crop it to each context (default); "
                   "generate: one whole generation per repeat, the write-up's way")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="steps per cached warm-up run (default: 32 on CPU, a full run on CUDA)")
    p.add_argument("--no-peaks", action="store_true", help="do not measure the device's peaks")
    p.add_argument("--point-ms", type=float, default=LatencyParams.point_ms,
                   help="a cheap point samples on until its samples add up to this many ms "
                   "(at most 5 samples; 0: off; default %(default)s)")
    p.add_argument("--retakes", type=int, default=3,
                   help="CPU: samples per point set aside and taken again when another process "
                   "used the CPU during them and they were out of line (0 keeps every sample)")
    p.add_argument("--retake-share", type=float, default=0.15,
                   help="CPU: retakes and their waits for quiet use at most this share of the "
                   "sweep's elapsed time (default 0.15)")
    end_to_end.add_arguments(p, own_modes=False)


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> LatencyParams:
    block_size = cfg.block_size
    base = LatencyParams.defaults(args.device, cfg)
    return LatencyParams(
        parse_contexts(args.contexts, block_size),
        parse_modes(args.modes) if args.modes else base.modes, args.batch,
        args.warmup, args.repeats if args.repeats is not None else base.repeats, args.seed,
        args.warmup_steps if args.warmup_steps is not None else base.warmup_steps,
        e2e_new_tokens=end_to_end.new_tokens(args, block_size), e2e_prompt_len=args.prompt_len,
        measure_peaks=not args.no_peaks, method=args.method, retakes=args.retakes,
        retake_share=args.retake_share, point_ms=args.point_ms)


def summary(run: dict[str, Any]) -> list[str]:
    q = run["meta"].get("retakes") or {}
    said = [f"flagged samples: {q['retaken']} retaken, {q['flagged_consistent']} kept in line, "
            f"{q['disturbed_kept']} kept out of line; {q['retake_s']:.1f} s on retakes; "
            f"{q['confirmed_by_prediction']} point(s) confirmed by the prediction"] if q else []
    return [format_summary(run["tables"].get("summary", [])), *said, *end_to_end.summary(run)]


def _point_work(mode: str, t: int) -> float:
    """Relative cost of one sample, for the time left: a cached step is 1; a forward grows with
    t (about 1 + t/16 on a CPU; the estimate rescales itself by the time actually taken)."""
    return 1.0 if lineup.spec(mode).cached else 1.0 + t / 16


def _samples(p: LatencyParams, mode: str) -> int:
    """Samples a point of ``mode`` takes at the least, for the time left: a cached step is
    cheap, so it takes ``cheap_repeats`` when ``point_ms`` is on."""
    fewest = min(p.min_repeats, p.repeats)
    return max(fewest, p.cheap_repeats) if p.point_ms and lineup.spec(mode).cached else fewest


class _Mode:
    """One mode during a sweep: its decoder (kept across contexts) and its ``Sampler``."""
    def __init__(self, model: CausalLM, name: str, p: LatencyParams, top: int,
                 tr: Tracker | None = None, budget: RetakeBudget | None = None) -> None:
        from instruments.lineup import make_decoder
        from instruments.measure.sampler import Sampler

        self.name, self.model, self.params = name, model, p
        self.cached = lineup.spec(name).cached
        self.dec = make_decoder(model, name, batch_size=p.batch_size, capacity=top)

        def set_aside(ms: float, why: str) -> None:
            if tr is not None:
                tr.emit(f"{name}: a disturbed sample was out of line ({why}); waiting for a "
                        "quiet moment to take it again")

        self.sampler: Sampler = Sampler(
            model.device, repeats=p.repeats, min_repeats=p.min_repeats, spread=p.spread,
            retakes=p.retakes, warmup=p.warmup, should_stop=tr.stop if tr else None,
            on_set_aside=set_aside, budget=budget, point_ms=p.point_ms,
            cheap_repeats=p.cheap_repeats)

    def calls(self, idx: torch.Tensor, t: int) -> tuple[Any, Any, str]:
        """(prepare, step, phase) of one sample at context t: a forward of t tokens (a cached
        mode's prefill at 1), or a seek to t - 1 tokens, untimed, then one timed step."""
        dec = self.dec
        if not self.cached or t == 1:
            return None, lambda: dec.prefill(idx[:, :t]), ("prefill" if self.cached else "forward")
        return (lambda: dec.seek(idx, t - 1)), (lambda: dec.step(idx[:, t - 1 : t])), "decode"

    def point(self, idx: torch.Tensor, t: int, tr: Tracker | None = None
              ) -> dict[str, Any] | None:
        """The row of one point (its samples, more while they disagree); None if stopped."""
        prepare, step, phase = self.calls(idx, t)
        work = _point_work(self.name, t)

        def counted(ms: float) -> None:
            if tr is not None:
                tr.work += work

        predicted_ms, error = self.params.prediction(self.name, t)
        got = self.sampler.point(step, prepare, on_sample=counted, predicted_ms=predicted_ms,
                                 error=error)
        if got is None:
            return None
        last_only = getattr(self.dec, "logits", "last") == "last"
        return row(self.model, self.name, t, self.dec.batch_size, got.samples_ms, phase,
                   last_only, self.dec.compile_s, self.dec.attended_keys(t), got.quiet())


@no_grad
def run(loaded: Loaded, params: LatencyParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    """Per-token latency of each mode at each context length (see the module docstring)."""
    from engine.loop import random_prompt
    from instruments.experiments.latency_gate import SweepGate
    from instruments.experiments.latency_generate import generation_work, time_by_generation
    from instruments.measure import device, memory
    from instruments.measure.sampler import RetakeBudget

    start_s = time.perf_counter()
    model = loaded.checked(params)
    contexts = sorted(set(params.contexts))
    est = costs.peak_memory_estimate(
        model.config, model.dtype, params.batch_size, contexts[-1],
        None if all(m in lineup.uncached() for m in params.modes) else lineup.seed_pair()[1],
        device=str(model.device))
    ok, why = memory.fits(model.device, est, resident_bytes=est["weights_bytes"])
    if not ok:
        raise ValueError(f"This sweep would not fit in memory ({why}). Use a smaller batch size "
                         "or shorter contexts.")
    generate = params.method == "generate"
    work = sum(generation_work(params, contexts) if generate and lineup.spec(m).cached
               else sum(_point_work(m, t) * _samples(params, m) for t in contexts)
               for m in params.modes)
    e2e = params.e2e_new_tokens > 0
    points = len(contexts) * len(params.modes) + (len(params.modes) if e2e else 0)
    tr = Tracker(progress, should_stop, points, total_work=work)
    idx = random_prompt(model, params.batch_size, contexts[-1], params.prompt_seed)
    gate = SweepGate(model, params, contexts, tr)
    timings: dict[str, float] = {}
    states: dict[str, _Mode | None] = {}
    budget = RetakeBudget(params.retake_share, on_spent=lambda spent_s: tr.note(
        f"the retake budget ({params.retake_share:.0%} of the sweep so far) was spent after "
        f"{spent_s:.1f} s of retakes: disturbed samples out of line are kept from here on, "
        "and counted")) if params.retakes else None

    def ready(name: str) -> _Mode | None:
        """The mode's state, gated on first use (None: refused, not timed)."""
        if name not in states:
            ok = gate.first(name)
            states[name] = _Mode(model, name, params, contexts[-1], tr, budget) if ok else None
        return states[name]

    def timed() -> list[str]:
        return [name for name, st in states.items() if st is not None]

    stopped = False
    if generate:  # cached modes the write-up's way, mode after mode; uncached as below
        for name in [m for m in params.modes if lineup.spec(m).cached]:
            if ready(name) is not None and time_by_generation(
                    model, name, params, contexts, idx, tr, row):
                stopped = True
                break
    order = spread_order(contexts) if params.order == "spread" else contexts
    sweep = [(t, m) for t in order for m in params.modes
             if not (generate and lineup.spec(m).cached)]
    for t, name in sweep if not stopped else []:
        if gate.due(t):  # the first context is on the chart: the gate's long half, then on
            for failed in gate.long_half(timed()):
                states[failed] = None
        st = ready(name)
        if st is None:
            continue
        r = st.point(idx, t, tr)
        if r is None:
            stopped = True
            break
        spent = f" · retakes {budget.spent_s:.1f} s" if budget is not None else ""
        tr.row("latency", r, f"{name}: context {t} took {r['latency_ms']:.2f} ms "
               f"({len(r['samples_ms'])} samples){spent}")
    gate.finish(timed(), stopped)
    timings["gate_s"] = gate.seconds
    states.clear()  # free the caches before the end-to-end part allocates its own
    timings["sweep_s"] = time.perf_counter() - start_s
    if e2e and not stopped:
        t0 = time.perf_counter()
        passed = [c["mode"] for c in tr.tables.get("checks", []) if c["passed"]]
        stopped = end_to_end.measure(model, params.end_to_end(), passed, tr)
        timings["e2e_s"] = time.perf_counter() - t0
    retakes = note_disturbed(tr, budget)
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
                  key=lambda r: (lineup.ordered(params.modes).index(r["mode"]), r["context_len"]))
    tables = {"latency": rows, "checks": tr.tables.get("checks", []),
              "summary": summary_table(rows, pair=_pair(rows)),
              "end_to_end": tr.tables.get("end_to_end", []),
              "cumulative": tr.tables.get("cumulative", [])}
    out = record(loaded, "latency_sweep", params, tables, partial=stopped, notes=tr.notes,
                 measured_peaks=peaks, timings=timings, retakes=retakes)
    meta = out["meta"]  # MBU / MFU against the peaks the run carries
    add_shares(out["tables"]["latency"], peaks,
               listed_peaks(meta["device_name"], meta["dtype"], bool(meta.get("tf32")),
                            meta["device"]))
    return out


def _pair(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """Table 1's pair: the first uncached and the first cached mode measured (ladder order)."""
    measured = lineup.ordered(r["mode"] for r in rows)
    pair = lineup.seed_pair()
    slow = next((m for m in measured if m in lineup.uncached()), pair[0])
    fast = next((m for m in measured if m not in lineup.uncached()), pair[1])
    return slow, fast
