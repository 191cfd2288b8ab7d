#!/usr/bin/env python
"""How well the calibrated cost model predicts every mode's step on the machine it runs on.

    python scripts/bench_predict.py                        # gpt2 shapes, random weights (~6 min)
    python scripts/bench_predict.py --model smollm2-135m   # SmolLM2, its package's weights
    python scripts/bench_predict.py --model llama-tiny     # smoke runs: tiny, llama-tiny

Runs ``python -m instruments predict`` (its own process: calibration, then every predictable
mode of the model's family measured at the 16 log-spaced contexts, cached modes in 3 pooled
passes) with the dashboard's thread count and the model's own weights (the CLI's default: random
for GPT-2, whose real ones need the hub; the package's real weights for SmolLM2), then prints
the conditions (weights, threads, CPU, the load average before and after: a busy machine's
numbers lie), per mode the worst |measured - predicted| / measured against its goal (15% cached,
25% uncached), where it fell, the residual's range over the contexts and the part it points at,
as a markdown table, then each verdict's sentence. Exit status 1 when a mode misses its goal.
Run it on quiet cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from instruments import lineup  # noqa: E402
from instruments.costmodel.predict import predictable  # noqa: E402
from instruments.process.client import measuring_threads  # noqa: E402
from instruments.store.results import load_runs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--threads", type=int, default=measuring_threads())
    ap.add_argument("--modes", default=None,
                    help="default: every predicted mode that runs the model's family here")
    ap.add_argument("--weights", default=None, help="default: the model's own, as the CLI "
                    "picks them (random for GPT-2, the package's for SmolLM2)")
    ap.add_argument("--contexts", default=None, help="default: the CLI's (log-spaced (16))")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--keep", default=None, help="save the run in this folder too")
    args = ap.parse_args()
    if args.modes is None:
        family = lineup.family_of(args.model).name
        args.modes = ",".join(predictable(lineup.defaults("cpu", family)))
    weights = [] if args.weights is None else ["--weights", args.weights]
    contexts = [] if args.contexts is None else ["--contexts", args.contexts]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "instruments", "predict", "--model", args.model,
                        *weights, *contexts, "--threads", str(args.threads), "--modes",
                        args.modes, "--passes", str(args.passes), "--no-progress",
                        "--results-dir", str(folder)], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        wall_s = time.perf_counter() - t0
        load_after = os.getloadavg()[0]
        runs = [r for r in load_runs(folder).runs if r["kind"] == "step_prediction"]
        run = max(runs, key=lambda r: str(r.get("created_utc")))  # the run just made
    meta = run["meta"]
    timings = meta.get("timings") or {}
    print(f"{args.model} ({meta.get('weights')} weights, {meta.get('dtype')}), "
          f"{args.threads} thread(s), {meta['device_name']}, {os.cpu_count()} CPUs, load "
          f"average {load_before:.1f} before and {load_after:.1f} after: calibration "
          f"{timings.get('calibration_s', 0):.0f} s, whole run {wall_s:.0f} s")
    for note in meta.get("notes") or []:
        print(f"note: {note}")
    print("| mode | worst miss | at (tokens) | goal | residual over the contexts (ms) | "
          "points at | verdict |")
    print("|---|---|---|---|---|---|---|")
    points = run["tables"]["prediction"]
    worst_all = {True: 0.0, False: 0.0}
    for v in run["tables"]["verdicts"]:
        share = v["worst_share"]
        if share is None:
            print(f"| {v['mode']} | — | — | — | — | — | not predicted |")
            continue
        worst_all[v["cached"]] = max(worst_all[v["cached"]], share)
        res = [p["residual_ms"] for p in points
               if p["mode"] == v["mode"] and p["residual_ms"] is not None]
        print(f"| {v['mode']} | {share:.1%} | {v['worst_context']} | {v['goal_share']:.0%} | "
              f"{min(res):+.2f} to {max(res):+.2f} | {v['off_part'] or '—'} | "
              f"{'within' if v['within'] else 'outside'} |")
    print(f"worst over cached modes {worst_all[True]:.1%} (goal 15%), over uncached modes "
          f"{worst_all[False]:.1%} (goal 25%)")
    for v in run["tables"]["verdicts"]:
        print(v["sentence"])
    return 0 if all(v["within"] is not False for v in run["tables"]["verdicts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
