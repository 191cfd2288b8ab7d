#!/usr/bin/env python
"""The default sweep as a new user runs it from the browser, against the same sweep from the CLI.

    python scripts/bench_sweep.py                     # gpt2 shapes, random weights (~10 minutes)
    python scripts/bench_sweep.py --model tiny        # smoke run
    python scripts/bench_sweep.py --report docs/runs/sweep   # the table again, from saved runs

Issue 25's done-criterion, measured as stated:
1. ``--runs`` times (3): a fresh ``streamlit run app.py`` with an empty results folder (a new
   user: no earlier sweep to estimate from, no calibration), headless Chromium on the Latency
   sweep page, the model and random weights chosen, Run with every default (16 contexts, modes 1
   and 3, the end-to-end part, retakes on, the live chart on). The page is read once a second, as
   a user's browser would be looked at: the seconds from Run to the first point (the progress
   line counts one) and to "Finished". The server saves the run in its folder.
2. The same sweep from the CLI (``python -m instruments sweep``, retakes on, the dashboard's
   thread count), twice: the saved medians of modes 1 and 3 of each browser run against the
   first CLI run, context by context, and the second CLI run against the first -- the noise
   floor of the comparison.
The runs are kept under ``--out`` (an empty folder: browser-1..N/, cli/, cli-again/; copy them to
``docs/runs/sweep/`` to publish them) and the table is printed from them, so ``--report``
regenerates it from committed runs. ``--calibrated`` first runs the step-prediction calibration
(``python -m instruments prediction``) and gives each browser run a copy, to time the sweep where a
prediction stands in for second samples. ``--crop-check`` also times mode 3 the write-up's way
(``--method generate``, 3 whole generations) beside the default crop method, the per-context
medians compared (what ``latency_generate`` says this script checks). Run it on quiet cores: the
numbers would lie.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from instruments.process.client import measuring_threads  # noqa: E402
from instruments.store import results  # noqa: E402
from instruments.store.sweep_bench import TIMING_KIND, against, report  # noqa: E402
from scripts.browser import streamlit_server, sweep_page  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def cli(folder: Path, args: argparse.Namespace, experiment: str = "sweep", *extra: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "instruments", experiment, "--model", args.model,
                    "--weights", "random", "--threads", str(args.threads), "--no-progress",
                    "--results-dir", str(folder), *extra], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)


def crop_check(out: Path, args: argparse.Namespace) -> str:
    """Mode 3, the default crop method ÷ the write-up's generations, per context."""
    cached = ["--modes", "concat", "--repeats", "3", "--new-tokens", "0", "--no-peaks"]
    cli(out / "crop", args, "sweep", *cached)
    cli(out / "generate", args, "sweep", *cached, "--method", "generate")
    return "mode 3, crop ÷ generate: " + against(sweep_run(out / "crop"),
                                                 sweep_run(out / "generate"), "concat")


def browser(folder: Path, args: argparse.Namespace) -> dict[str, float]:
    """One new user's default sweep; the seconds to the first point and to the end."""
    from playwright.sync_api import sync_playwright

    with streamlit_server(folder, tiny=args.model == "tiny",
                          env={"KVLAB_THREADS": str(args.threads)}) as (url, _), \
            sync_playwright() as pw:
        page = sweep_page(pw, url, args.model)
        t0 = time.perf_counter()
        page.get_by_role("button", name="Run sweep").click()
        first = None
        while not page.locator("text=/Finished \\d+ points/").count():
            text = " ".join(page.locator('[data-testid="stProgress"]').all_inner_texts())
            done = text.split(" / ")[0].strip()
            if first is None and done.isdigit() and int(done) >= 1:
                first = time.perf_counter() - t0
            page.wait_for_timeout(1000)  # read once a second, as a user looks at it
        total = time.perf_counter() - t0
    timing = {"first_s": first if first is not None else total, "total_s": total}
    meta = results.collect_meta(model=args.model, weights="random", device="cpu",
                                dtype="float32", threads=args.threads,
                                command="scripts/bench_sweep.py (headless Chromium, Run with "
                                "every default, the page read once a second)")
    results.save_run(results.new_run(TIMING_KIND, meta, {"timing": [timing]}), folder)
    return timing


def saved(out: Path) -> list[dict]:
    """Every run kept under ``out``, each with its path (what the report reads)."""
    from instruments.store.results import load_runs

    return load_runs(out, recursive=True).runs


def table(out: Path) -> list[str]:
    """The markdown table, from the runs kept in ``out`` (``instruments.store.sweep_bench``)."""
    return report(saved(out)) or [f"no browser run under {out}"]


def sweep_run(folder: Path) -> dict:
    (run,) = [r for r in saved(folder) if r.get("kind") == "latency_sweep"]
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--threads", type=int, default=measuring_threads(),
                    help="the measuring process's threads (default: the dashboard's)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="/tmp/kvlab_sweep_bench",
                    help="an empty folder for the runs (copy its folders to docs/runs/sweep/)")
    ap.add_argument("--calibrated", action="store_true",
                    help="give each browser run a calibration of this machine first")
    ap.add_argument("--crop-check", action="store_true",
                    help="also compare mode 3's crop method with the write-up's generations")
    ap.add_argument("--report", metavar="FOLDER", help="only print the table of saved runs")
    args = ap.parse_args(argv)
    if args.report:
        print("\n".join(table(Path(args.report))))
        return 0
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty: move its runs away or pass another --out")
    calibration = None
    if args.calibrated:
        cli(out / "calibration", args, "prediction")
        (calibration,) = (out / "calibration").glob("*.json")
    for i in range(1, args.runs + 1):
        folder = out / f"browser-{i}"
        folder.mkdir(parents=True)
        if calibration is not None:
            shutil.copy(calibration, folder / calibration.name)
        timing = browser(folder, args)
        print(f"browser run {i}: first point after {timing['first_s']:.1f} s, finished after "
              f"{timing['total_s']:.0f} s", flush=True)
    cli(out / "cli", args)
    cli(out / "cli-again", args)  # the CLI against itself: the noise floor
    for folder in out.iterdir():  # the servers' logs are not runs
        (folder / "server.log").unlink(missing_ok=True)
    print("\n".join(table(out)))
    if args.crop_check:
        print(crop_check(out, args))
    print(f"runs kept in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
