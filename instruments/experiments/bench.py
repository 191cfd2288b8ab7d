"""llama-bench's summary: prompt processing and token generation in tokens/s ± sd (kind "bench").

  python -m instruments bench --modes concat,prealloc_fused -p 512 -n 128 --depth 0,512 -r 5

Tests, per mode and per depth d (tokens already in context, llama-bench's ``-d``; 0 by default):
  pp{P} @ d  P prompt tokens in one call. A cached mode seeks to d tokens (untimed), then takes
             the P tokens at once (a chunked prefill, logits of the last; at d = 0 the
             prefill). An uncached mode holds no cache for the d tokens: it re-runs all d + P
             (counted as P tokens: what a user gets from the call).
  tg{N} @ d  N tokens, one step each, after d tokens (at least 1: a step follows a token); the
             steps take their tokens from a fixed random sequence, so picking a token is not
             timed (as in llama-bench).
Each test is one point of the ``Sampler`` (``instruments.measure.sampler``) of exactly
``repeats`` samples after ``warmup`` untimed ones, every sample one whole test (on a CPU a
disturbed sample is set aside and taken again). Tokens/s per sample = tokens x batch / its
seconds; a row reports their mean ± sample standard deviation (llama-bench's avg_ts ±
stddev_ts), the samples, p50/p90/p99 of the sample ms (``instruments.store.stats``) and the
energy of the samples where the device counts it (``instruments.measure.energy``). Each mode
first passes the gate (``instruments.checks.gate``). ``summary(run)`` / ``markdown(run)`` give
llama-bench's Markdown table. Torch-free at import.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from engine.models.config import GPTConfig, ModelConfig
from instruments import lineup
from instruments.costmodel import costs
from instruments.experiments.inputs import MAX_BATCH, modes_usable, parse_modes, whole
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, no_grad, record
from instruments.store.stats import mean_sd, percentile_fields


@dataclass
class BenchParams:
    """pp{prompt_tokens} and tg{gen_tokens} at each depth, per mode (see the module docstring)."""

    modes: list[str]
    prompt_tokens: int = 512  # 0: no pp test
    gen_tokens: int = 128  # 0: no tg test
    depths: list[int] = field(default_factory=lambda: [0])
    repeats: int = 5
    warmup: int = 1
    batch_size: int = 1
    prompt_seed: int = 0
    retakes: int = 3  # CPU: disturbed samples set aside and taken again, per test

    @classmethod
    def defaults(cls, device: str, cfg: ModelConfig) -> BenchParams:
        """pp512 and tg128 (llama-bench's), shrunk to fit a short model."""
        block_size = cfg.block_size
        ours = [m for m in lineup.with_role("bench", device, cfg.family)
                if not lineup.spec(m).slow_setup]
        return cls(ours, min(512, block_size // 2), min(128, block_size // 4))

    def tests(self) -> list[tuple[str, int, int]]:
        """(phase "pp" | "tg", tokens, depth) in llama-bench's order: pp then tg per depth."""
        out = []
        for d in self.depths:
            if self.prompt_tokens:
                out.append(("pp", self.prompt_tokens, d))
            if self.gen_tokens:
                out.append(("tg", self.gen_tokens, d))
        return out

    def longest(self) -> int:
        """The most tokens any test holds (its decoders' capacity)."""
        return max(d + n if phase == "pp" else max(d, 1) + n for phase, n, d in self.tests())

    def check(self, cfg: GPTConfig, device: str) -> None:
        modes_usable(self.modes, device, cfg.family)
        whole("prompt tokens", self.prompt_tokens, 0, cfg.block_size)
        whole("generated tokens", self.gen_tokens, 0, cfg.block_size - 1)
        if not self.prompt_tokens and not self.gen_tokens:
            raise ValueError("nothing to run: prompt tokens and generated tokens are both 0")
        if not self.depths:
            raise ValueError("no depth given; allowed: whole numbers from 0, e.g. 0,512")
        for d in self.depths:
            whole("depth", d, 0, cfg.block_size - 1)
        whole("repeats", self.repeats, 1)
        whole("warmup", self.warmup, 0)
        whole("batch size", self.batch_size, 1, MAX_BATCH)
        whole("retakes", self.retakes, 0)
        if self.longest() > cfg.block_size:
            raise ValueError(f"depth + prompt tokens and depth + generated tokens must fit the "
                             f"model's {cfg.block_size} tokens; the longest test holds "
                             f"{self.longest()}")


Params = BenchParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default=None, help=f"from: {', '.join(lineup.mode_names())} "
                   "(default: the bench role's modes that run here)")
    p.add_argument("-p", "--prompt-tokens", type=int, default=None,
                   help="pp test: prompt tokens in one call (default 512, or half the model's "
                   "limit; 0: none)")
    p.add_argument("-n", "--gen-tokens", type=int, default=None,
                   help="tg test: tokens generated one by one (default 128; 0: none)")
    p.add_argument("-d", "--depth", default="0",
                   help="tokens already in context before each test, e.g. 0,512 (default 0)")
    p.add_argument("-r", "--repeats", type=int, default=5, help="timed samples per test")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before each test")
    p.add_argument("--retakes", type=int, default=3,
                   help="CPU: disturbed samples per test set aside and taken again (0: keep)")


def parse_depths(text: str) -> list[int]:
    """'0, 512' -> [0, 512] (ValueError saying what is allowed)."""
    parts = [s.strip() for s in str(text).split(",") if s.strip()]
    if not parts or not all(s.isdigit() for s in parts):
        raise ValueError(f"cannot read depths {text!r}; allowed: whole numbers from 0 separated "
                         "by commas, e.g. 0,512")
    return list(dict.fromkeys(int(s) for s in parts))


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> BenchParams:
    base = BenchParams.defaults(args.device, cfg)
    return BenchParams(
        base.modes if args.modes is None else parse_modes(args.modes),
        base.prompt_tokens if args.prompt_tokens is None else args.prompt_tokens,
        base.gen_tokens if args.gen_tokens is None else args.gen_tokens,
        parse_depths(args.depth), args.repeats, args.warmup, args.batch, args.seed,
        args.retakes)


# ------------------------------------------------------------------------------- the table
def test_label(row: dict[str, Any]) -> str:
    """llama-bench's test name: "pp512", "tg128 @ d512"."""
    depth = int(row.get("depth") or 0)
    return f"{row['test']}{f' @ d{depth}' if depth else ''}"


def markdown(run: dict[str, Any]) -> str:
    """llama-bench's Markdown table of a bench run: one line per mode and test, t/s ± sd."""
    meta = run.get("meta") or {}
    rows = (run.get("tables") or {}).get("bench") or []
    try:
        cfg = lineup.config_from_dict(meta["config"], meta.get("family"))
        size = f"{costs.weight_bytes(cfg, meta.get('dtype') or 'float32') / 2**20:.2f} MiB"
        params = f"{costs.param_count(cfg) / 1e6:.2f} M"
    except (KeyError, TypeError, ValueError):
        size = params = "?"
    model = f"{meta.get('model', '?')} {meta.get('dtype', '')}".strip()
    energy = any(r.get("joules_per_token") is not None for r in rows)
    lines = ["| model | size | params | device | threads | mode | test | t/s |"
             + (" J/token |" if energy else ""),
             "| ----- | ---: | -----: | ------ | ------: | ---- | ---: | --: |"
             + (" ------: |" if energy else "")]
    for r in rows:
        ts, sd = r.get("tokens_per_s"), r.get("tokens_per_s_sd")
        value = "-" if ts is None else f"{ts:.2f}" + (f" ± {sd:.2f}" if sd is not None else "")
        jpt = r.get("joules_per_token")
        lines.append(f"| {model} | {size} | {params} | {meta.get('device_name') or '?'} | "
                     f"{meta.get('threads') or '?'} | {r['mode']} | {test_label(r)} | {value} |"
                     + ((f" {jpt:.4g} |" if jpt is not None else " - |") if energy else ""))
    if not energy and meta.get("energy_note"):
        lines.append(f"\nenergy: {meta['energy_note']}")
    return "\n".join(lines)


def summary(run: dict[str, Any]) -> list[str]:
    return [markdown(run)]


# ------------------------------------------------------------------------------- measuring
def _calls(dec: Any, idx: Any, phase: str, n: int, depth: int) -> tuple[Any, Any]:
    """(prepare, step) of one sample of a test (see the module docstring)."""
    if phase == "pp":
        if dec.cache_kind is None or depth == 0:  # no cache to hold the depth: re-run it all
            return None, lambda: dec.prefill(idx[:, : depth + n])
        return (lambda: dec.seek(idx, depth)), (lambda: dec.extend(idx[:, depth : depth + n]))
    start = max(depth, 1)

    def generate() -> None:
        for i in range(start, start + n):
            dec.step(idx[:, i : i + 1])

    return (lambda: dec.seek(idx, start)), generate


def _test(model: Any, name: str, dec: Any, idx: Any, test: tuple[str, int, int],
          p: BenchParams, tr: Tracker, meter: Any) -> dict[str, Any] | None:
    """One test's row; None if stopped."""
    from instruments.measure.energy import NOTHING, row_fields
    from instruments.measure.sampler import Sampler
    from instruments.measure.timing import synchronize

    phase, n, depth = test
    prepare, step = _calls(dec, idx, phase, n, depth)
    energy, metered = [NOTHING], [0]

    def prepared() -> None:  # the meter starts after the set-up's own work has finished
        if prepare is not None:
            prepare()
        synchronize(model.device)
        meter.start()

    def taken(ms: float) -> None:
        energy[0] = energy[0] + meter.stop()
        metered[0] += 1
        tr.work += 1

    sampler = Sampler(model.device, repeats=p.repeats, min_repeats=p.repeats, spread=-1.0,
                      retakes=p.retakes, warmup=p.warmup, should_stop=tr.stop)
    got = sampler.point(step, prepared, on_sample=taken)
    if got is None:
        return None
    tokens = n * p.batch_size
    rates = [tokens / (ms / 1e3) for ms in got.samples_ms]
    mean, sd = mean_sd(rates)
    spec = lineup.spec(name)
    label = test_label({"test": f"{phase}{n}", "depth": depth})
    row = {"mode": name, "mode_label": spec.label, "test": f"{phase}{n}", "label": label,
           "phase": phase,
           "n_tokens": n, "depth": depth, "batch_size": p.batch_size,
           "dtype": str(model.dtype).removeprefix("torch."), "samples_ms": got.samples_ms,
           "median_ms": got.median_ms, "tokens_per_s": mean, "tokens_per_s_sd": sd,
           "samples_tokens_per_s": rates, **percentile_fields(got.samples_ms),
           **got.quiet(), **row_fields(energy[0], tokens * metered[0]),
           "compile_s": dec.compile_s}
    return row


@no_grad
def run(loaded: Loaded, params: BenchParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    """Each mode's pp / tg tests (see the module docstring)."""
    from engine.decoders import make_decoder
    from engine.loop import random_prompt
    from instruments.checks import gate
    from instruments.measure.energy import EnergyMeter

    model = loaded.checked(params)
    tests = params.tests()
    tr = Tracker(progress, should_stop, len(tests) * len(params.modes), unit="tests",
                 total_work=len(tests) * len(params.modes) * (params.repeats + params.warmup))
    top = params.longest()
    idx = random_prompt(model, params.batch_size, top, params.prompt_seed)
    checker = gate.Gate(model, params.batch_size, params.prompt_seed)
    meter = EnergyMeter.for_device(model.device)
    stopped = False
    for name in params.modes:
        tr.emit(f"{name}: checking its logits against mode 1")
        check = checker.check(name)
        tr.tables.setdefault("checks", []).append(check.to_row())
        if not check.passed:
            tr.done += len(tests)
            tr.note(f"{name} not timed: {check.detail}")
            continue
        dec = make_decoder(model, name, batch_size=params.batch_size, capacity=top)
        for test in tests:
            tr.emit(f"{name}: {test[0]}{test[1]}" + (f" @ d{test[2]}" if test[2] else ""))
            row = _test(model, name, dec, idx, test, params, tr, meter)
            if row is None:
                stopped = True
                break
            tr.row("bench", row, f"{name}: {row['label']} {row['tokens_per_s']:.1f} tokens/s")
        del dec
        if stopped:
            tr.note("stopped: what was measured is kept")
            break
    tables = {"bench": tr.tables.get("bench", []), "checks": tr.tables.get("checks", [])}
    return record(loaded, "bench", params, tables, partial=stopped, notes=tr.notes,
                  energy_source=meter.source, energy_note=meter.why)
