#!/usr/bin/env python
"""The measuring half of scripts/gpu_check.sh: one bounded run, every result saved to results/.

    python scripts/gpu_check.py --device cuda                # gpt2, fp32 and bf16 (~5 min)
    python scripts/gpu_check.py --device cpu --tiny --out /tmp/x   # dry run of the logic

Stages, each with its share of ``--budget-s`` (a stage past its share stops after the current
point and saves what it measured, marked partial): measured peaks; a latency sweep of every
available mode over 16 context lengths in fp32 and in bf16; step attribution; the matmul
staircase (every T on a GPU). Then it prints each cached mode's step time against the
bandwidth floor, (weights + K/V bytes) / measured read bandwidth; the issue's goal is CUDA-graph
mode within 2x of it. Exit code 0 when every stage ran (even partly), 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine import GPT, GPTConfig, costs  # noqa: E402
from engine.attribution import Peaks, attribution_sweep, measure_peaks  # noqa: E402
from engine.hardware import describe_device, device_available, lookup_peaks  # noqa: E402
from engine.modes import MODES  # noqa: E402
from engine.results import collect_meta, new_run, save_run  # noqa: E402
from engine.staircase import default_ts, run_staircase  # noqa: E402
from engine.sweep import SweepSpec, preset_contexts, run_latency_sweep  # noqa: E402

TINY = dict(n_layer=2, n_head=2, n_embd=64, block_size=128, vocab_size=512)
SHARES = {"sweep float32": 0.33, "sweep bfloat16": 0.25, "attribution": 0.12,
          "staircase": 0.30}  # of the budget left after the peaks


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny config (a dry run of the logic)")
    ap.add_argument("--out", default="results", help="results folder (default results/)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="seconds for all stages")
    ap.add_argument("--no-compile", action="store_true", help="leave out torch.compile modes")
    return ap.parse_args(argv)


class Clock:
    """Per-stage deadlines carved out of one budget; unused time rolls over to later stages."""

    def __init__(self, budget_s: float) -> None:
        self.end = time.monotonic() + budget_s
        self.stage_end = self.end

    def start(self, name: str) -> Callable[[], bool]:
        left = max(0.0, self.end - time.monotonic())
        later = [s for s in SHARES if list(SHARES).index(s) >= list(SHARES).index(name)]
        share = SHARES[name] / sum(SHARES[s] for s in later)
        self.stage_end = time.monotonic() + left * share
        print(f"\n== {name}: up to {left * share:.0f} s", flush=True)
        return lambda: time.monotonic() > self.stage_end


def meta(args: argparse.Namespace, model: GPT, dev_name: str, **extra: Any) -> dict[str, Any]:
    spec = lookup_peaks(dev_name) if args.device.startswith("cuda") else None
    return collect_meta(model="tiny" if args.tiny else "gpt2", weights=model.weights_label,
                        device=args.device, device_name=dev_name,
                        dtype=str(model.dtype).removeprefix("torch."), batch_size=1,
                        peaks=spec.to_dict() if spec else None, config=model.config.to_dict(),
                        note="scripts/gpu_check.py", **extra)


def save(args: argparse.Namespace, kind: str, m: dict[str, Any],
         tables: dict[str, list[dict[str, Any]]]) -> None:
    path = save_run(new_run(kind, m, tables), args.out)
    print(f"saved {kind}: {path}", flush=True)


def sweep_modes(model: GPT, allow_compile: bool) -> list[str]:
    out = []
    for name, spec in MODES.items():
        if spec.slow_setup and (not allow_compile or name == "fast_compiled"):
            continue  # fast_compiled is a CPU recipe; its GPU compile would eat the budget
        if spec.available(model)[0]:
            out.append(name)
    # Compiled modes last: if their compile overruns the stage, the others are already timed.
    return sorted(out, key=lambda n: MODES[n].slow_setup)


def floor_lines(rows: list[dict[str, Any]], cfg: GPTConfig, peaks: Peaks, dtype: str) -> list:
    """Each cached mode's step vs (weights + K/V bytes) / measured read bandwidth."""
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows if r["cached"]):
        got = [r for r in rows if r["mode"] == mode and r["phase"] == "decode"]
        if not got:
            continue
        r = max(got, key=lambda r: r["context_len"])
        floor_ms = costs.step_bytes(cfg, dtype, r["context_len"], cached=True) / (
            peaks.gbps * 1e9) * 1e3
        ratio = r["latency_ms"] / floor_ms
        goal = " (goal ≤ 2×: " + ("met)" if ratio <= 2 else "missed)") if mode == "cuda_graph" \
            else ""
        lines.append({"dtype": dtype, "mode": mode, "context_len": r["context_len"],
                      "step_ms": r["latency_ms"], "floor_ms": floor_ms, "ratio": ratio,
                      "text": f"{dtype:9s} {mode:15s} ctx {r['context_len']:5d}: "
                              f"{r['latency_ms']:8.3f} ms = {ratio:6.1f}× the floor "
                              f"{floor_ms:.3f} ms{goal}"})
    return lines


def _print_row(p: Any) -> None:  # engine.sweep.Progress: print finished points only
    if p.row is not None:
        print(f"  {p.message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ok, why = device_available(args.device)
    if not ok:
        print(f"cannot run on {args.device}: {why}", file=sys.stderr)
        return 2
    cuda = args.device.startswith("cuda")
    cfg = GPTConfig(**TINY) if args.tiny else GPTConfig.from_name("gpt2")
    dev_name = str(describe_device(args.device)["name"])
    print(f"# gpu_check on {dev_name} ({args.device}), torch {torch.__version__}, "
          f"{'tiny' if args.tiny else 'gpt2'}", flush=True)
    t0 = time.monotonic()
    quick = dict(nbytes=32 * 2**20, matmul_n=256, min_seconds=0.05) if args.tiny else {}
    peaks = {dt: measure_peaks(args.device, dt, **quick) for dt in ("float32", "bfloat16")}
    clock = Clock(args.budget_s - (time.monotonic() - t0))
    model = GPT.random(cfg, seed=0, device=args.device)
    save(args, "hardware", meta(args, model, dev_name),
         {"measured_peaks": [p.to_dict() for p in peaks.values()]})

    contexts = preset_contexts("log-spaced (16)", cfg.block_size)
    summary: list[dict[str, Any]] = []
    for dtype in ("float32", "bfloat16"):
        stop = clock.start(f"sweep {dtype}")
        m = model if dtype == "float32" else GPT.random(cfg, seed=0, device=args.device,
                                                         dtype=torch.bfloat16)
        modes = sweep_modes(m, allow_compile=cuda and not args.no_compile and dtype ==
                            "float32")
        repeats = 2 if cuda else 3  # a cached run is 1,023 steps: two fit the budget
        spec = SweepSpec(contexts, modes, repeats=repeats, warmup=1, warmup_steps=32,
                         check_tokens=16)
        res = run_latency_sweep(m, spec, should_stop=stop, on_progress=_print_row)
        for note in res.notes:
            print("  note:", note)
        save(args, "latency_sweep", meta(args, m, dev_name, partial=res.cancelled,
                                         contexts=contexts, modes=modes, repeats=repeats, warmup=1),
             {"latency": res.rows, "checks": [vars(c) for c in res.checks]})
        summary += floor_lines(res.rows, cfg, peaks[dtype], dtype)
        if m is not model:
            del m

    stop = clock.start("attribution")
    rows: list[dict[str, Any]] = []
    att_modes = [x for x in ("concat", "prealloc_fused", "cuda_graph", "compiled", "fast")
                 if x in sweep_modes(model, cuda and not args.no_compile)]
    att_ctx = sorted({16, 128, 512, cfg.block_size - 16} & set(range(1, cfg.block_size - 15)))
    for mode in att_modes:
        if stop():
            break
        res = attribution_sweep(model, mode, att_ctx, steps=8, peaks=peaks["float32"],
                                should_stop=stop)
        rows += res.rows
        for r in res.rows:
            print(f"  {mode:15s} ctx {r['context_len']:5d}: step {r['step_ms']:.3f} ms, "
                  f"{r['ops_per_step']:.0f} ops, launches {r['launches_per_step']}, "
                  f"floor {r['floor_ms']:.3f} ms, overhead {r['overhead_ms']:.3f} ms")
    save(args, "attribution", meta(args, model, dev_name, partial=stop(),
                                   peaks_measured=peaks["float32"].to_dict()),
         {"attribution": rows})

    stop = clock.start("staircase")
    stair = run_staircase(cfg, model=model, ts=default_ts(cfg.block_size, args.device),
                          include_forward=True, forward_every=8 if cuda else 1,
                          min_sample_ms=1.0 if cuda else 0.0, should_stop=stop)
    if stair.totals:
        last = stair.totals[-1]
        fwd = last["forward_ms"] or next((t["forward_ms"] for t in reversed(stair.totals)
                                           if t["forward_ms"]), None)
        print(f"  {len(stair.totals)} T values; at T={last['T']} the matmuls sum to "
              f"{last['total_ms']:.3f} ms (whole uncached step: "
              f"{'—' if fwd is None else f'{fwd:.3f} ms'})")
    save(args, "staircase", meta(args, model, dev_name, partial=stair.cancelled),
         {"staircase": stair.rows, "totals": stair.totals})

    print(f"\n== cached step vs the bandwidth floor (bytes ÷ {peaks['float32'].gbps:.0f} GB/s "
          "measured read bandwidth), longest context measured")
    for line in summary:
        print(line["text"])
    save(args, "floor_summary", meta(args, model, dev_name),
         {"floor": [{k: v for k, v in s.items() if k != "text"} for s in summary]})
    print(f"\ndone in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
