"""End to end: the time to generate n tokens after a prompt, per mode (kind "end_to_end").

``run(loaded, EndToEndParams, progress, should_stop)`` -> run with tables ``end_to_end`` (one
row per mode: total_s median, samples_s, prefill_ms, flops_total, disturbed_steps: the median
run's steps during which another process used the CPU, on a CPU), ``cumulative`` (the running
total after each token, from the repeat with the median total) and ``checks``. Call 0 is the
prefill (context = prompt_len); call k >= 1 feeds token k-1 back (context = prompt_len + k).
A short untimed run of ``warmup_tokens`` tokens precedes each mode. ``measure`` is the same
work inside another experiment (the latency sweep's end-to-end part).

In the serving benchmarks' terms (vLLM, llmperf; ``docs/metrics.md``), each row also carries
``ttft_ms`` (time to first token: the prompt's forward that yields it, median over repeats; no
queueing here), ``tpot_ms`` (time per output token: the mean of the later steps, every timed
repeat pooled) with ``tpot_p50_ms`` / ``tpot_p90_ms`` / ``tpot_p99_ms`` over those steps (None
where too few: ``instruments.store.stats``), ``e2e_ms`` (the median total), and
``output_tokens_per_s`` (new tokens x batch / that total), ``prefill_tokens_per_s`` and
``decode_tokens_per_s`` (llama-bench's pp and tg at this prompt), and the energy of the timed
runs where the device counts it (``instruments.measure.energy``: ``energy_j``,
``joules_per_token``, ``avg_watts``, or ``energy_note`` saying why not).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.models.config import GPTConfig, ModelConfig
from instruments import lineup
from instruments.costmodel import costs
from instruments.experiments.inputs import MAX_BATCH, modes_usable, parse_modes, whole
from instruments.measure.energy import row_fields
from instruments.spine import (
    Loaded,
    ProgressFn,
    StopFn,
    Tracker,
    no_grad,
    record,
)
from instruments.store.stats import mean_sd, percentile_fields

if TYPE_CHECKING:
    from engine.models.base import CausalLM


@dataclass
class EndToEndParams:
    """Time to generate ``new_tokens`` after a ``prompt_len`` prompt, per mode."""
    modes: list[str]
    prompt_len: int = 8
    new_tokens: int = 120
    batch_size: int = 1
    repeats: int = 1
    warmup_tokens: int = 8
    prompt_seed: int = 0

    def check(self, cfg: GPTConfig, device: str) -> None:
        modes_usable(self.modes, device, cfg.family)
        whole("batch size", self.batch_size, 1, MAX_BATCH)
        whole("repeats", self.repeats, 1)
        if self.prompt_len < 1 or self.new_tokens < 1 or \
                self.prompt_len + self.new_tokens - 1 > cfg.block_size:
            raise ValueError(f"prompt length + new tokens - 1 must be within 1..{cfg.block_size}"
                             f" (got {self.prompt_len} + {self.new_tokens}), with at least one "
                             "new token")


Params = EndToEndParams


def add_arguments(p: argparse.ArgumentParser, own_modes: bool = True) -> None:
    """This experiment's flags; the latency sweep adds them (``own_modes=False``) for its
    end-to-end part, whose modes are the sweep's."""
    if own_modes:
        p.add_argument("--modes", default="uncached,concat",
                       help=f"from: {', '.join(lineup.names())}")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=None,
                   help="default: up to the block size on CUDA (1016, as the write-up), 64 on "
                   "CPU; 0 leaves the end-to-end part out of a sweep")
    p.add_argument("--e2e-repeats", type=int, default=1)


def new_tokens(args: argparse.Namespace, block_size: int) -> int:
    """--new-tokens, or its device default."""
    if args.new_tokens is not None:
        return args.new_tokens
    if str(args.device).startswith("cuda"):
        return block_size - args.prompt_len
    return min(64, block_size - args.prompt_len)


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> EndToEndParams:
    block_size = cfg.block_size
    return EndToEndParams(parse_modes(args.modes), args.prompt_len, new_tokens(args, block_size),
                          args.batch, args.e2e_repeats, prompt_seed=args.seed)


def summary(run: dict[str, Any]) -> list[str]:
    def serving(r: dict[str, Any]) -> str:
        if r.get("ttft_ms") is None:  # a run saved before these fields
            return ""
        tpot = f"{r['tpot_ms']:.2f} ms" if r.get("tpot_ms") is not None else "-"
        return (f" · TTFT {r['ttft_ms']:.2f} ms · TPOT {tpot} · "
                f"{r['output_tokens_per_s']:.1f} output tokens/s")

    return [f"{r['mode']:>16}: {r['new_tokens']} tokens in {r['total_s']:.3f} s{serving(r)}"
            for r in run["tables"].get("end_to_end", [])]


def measure(model: CausalLM, p: EndToEndParams, names: list[str], tr: Tracker) -> bool:
    """Time each mode in ``names`` (already gated); rows go to ``tr``. True if stopped."""
    from engine.loop import decode, random_prompt
    from instruments.lineup import make_decoder
    from instruments.measure.energy import NOTHING, EnergyMeter
    from instruments.measure.timing import CpuWatch, StepClock

    idx = random_prompt(model, p.batch_size, p.prompt_len, p.prompt_seed)
    watch = CpuWatch.for_device(model.device)  # a generation is not retaken: disturbance counted
    meter = EnergyMeter.for_device(model.device)
    for name in names:
        runs: list[list[float]] = []
        disturbed: list[int] = []
        energy = NOTHING
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
            meter.start()
            gen = decode(dec, idx, n, timer=clock, on_step=on_step, should_stop=tr.stop)
            used = meter.stop()
            del dec
            if gen.stopped_early:
                return True
            if rep >= 0:
                runs.append(gen.step_ms)
                energy = energy + used
                disturbed.append(sum(why is not None for why in clock.disturbed))
        totals_s = [sum(r) / 1e3 for r in runs]
        middle = sorted(range(len(runs)), key=lambda i: sum(runs[i]))[len(runs) // 2]
        median_run = runs[middle]
        spec = lineup.spec(name)
        flops = costs.generation_flops(model.config, p.prompt_len, p.new_tokens,
                                       cached=spec.cached, batch_size=p.batch_size,
                                       last_only=last_only)
        total = {"mode": name, "mode_label": spec.label, "cached": spec.cached,
                 "prompt_len": p.prompt_len, "new_tokens": p.new_tokens,
                 "batch_size": p.batch_size, "dtype": str(model.dtype).removeprefix("torch."),
                 "total_s": statistics.median(totals_s), "samples_s": totals_s,
                 "prefill_ms": median_run[0], "flops_total": flops,
                 "disturbed_steps": disturbed[middle] if watch is not None else None,
                 **serving_fields(runs, p, energy)}
        running_s = 0.0
        for step, ms in enumerate(median_run):
            running_s += ms / 1e3
            tr.tables.setdefault("cumulative", []).append(
                {"mode": name, "step": step, "context_len": p.prompt_len + step, "step_ms": ms,
                 "cumulative_s": running_s})
        tr.row("end_to_end", total, f"{name}: {p.new_tokens} tokens in {total['total_s']:.2f} s")
    return False


def serving_fields(runs: list[list[float]], p: EndToEndParams, energy: Any) -> dict[str, Any]:
    """TTFT, TPOT (mean and percentiles), end-to-end ms, throughputs and energy of the timed
    runs (each a list of call ms, the prefill first): see the module docstring."""
    later = [ms for r in runs for ms in r[1:]]
    tpot_ms, _ = mean_sd(later)
    ttft_ms = statistics.median(r[0] for r in runs)
    e2e_ms = statistics.median(sum(r) for r in runs)
    b = p.batch_size
    return {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms,
            **percentile_fields(later, "ms", prefix="tpot_"), "e2e_ms": e2e_ms,
            "output_tokens_per_s": p.new_tokens * b / (e2e_ms / 1e3) if e2e_ms > 0 else None,
            "prefill_tokens_per_s": p.prompt_len * b / (ttft_ms / 1e3) if ttft_ms > 0 else None,
            "decode_tokens_per_s": b * 1e3 / tpot_ms if tpot_ms else None,
            **row_fields(energy, p.new_tokens * b * len(runs))}


def work(p: EndToEndParams) -> float:
    return float(len(p.modes) * p.repeats * p.new_tokens)


@no_grad
def run(loaded: Loaded, params: EndToEndParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    from instruments.checks import gate

    model = loaded.checked(params)
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
