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

``--first`` measures the first minutes instead (``FIRST_GOALS``): for each read interval of
``--reads`` (every 0.1 s and once a second) and each of ``--runs`` runs, three fresh servers, each
with an empty results folder, the browser already open: (1) the Overview, seconds from the
server's start to its title, to the page settled (its script idle) and to the device probe's
facts and the model in; (2) the Latency sweep page settled (idle, its model loaded, the probe
in), Run with every default, seconds to the first point; (3) the Latency sweep page opened and
Run pressed the moment the button appears, seconds from the page's first paint (its title) to
the first point. Each sweep is stopped after its first point (the server saves it). Before
them, the floor under (1): a fresh server of a bare Streamlit app that only writes the title.
A call measures what its ``--out`` folder lacks (``--pairs`` at a time: quiet moments on a
shared host), so it can be called again into the same folder. ``--report`` prints their table
too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from instruments.process.client import measuring_threads  # noqa: E402
from instruments.store import results  # noqa: E402
from instruments.store.sweep_bench import (  # noqa: E402
    FIRST_KIND,
    STARTED_WITH,
    TIMING_KIND,
    against,
    first_report,
    report,
)
from scripts.browser import ARGS, CHROMIUM, settle, streamlit_server, sweep_page  # noqa: E402

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


# One look at the page per read: its title, whether its script runs, what it says.
LOOK = """() => {
  const app = document.querySelector('[data-testid="stApp"]');
  const text = document.body ? document.body.innerText : '';
  const run = Array.from(document.querySelectorAll('button'))
      .find(b => b.innerText.includes('Run sweep'));
  return {state: app ? app.getAttribute('data-test-script-state') : null,
          titles: Array.from(document.querySelectorAll('h1')).map(h => h.innerText),
          probing: text.includes('probing…'),
          loading: text.includes(' in the measuring process…'),
          run: run ? !run.disabled : false,
          failed: document.querySelectorAll('[data-testid="stException"]').length > 0,
          progress: Array.from(document.querySelectorAll('[data-testid="stProgress"]'))
              .map(e => e.innerText).join(' ')};
}"""
SERVER_POLL_S = 0.05  # how often the benchmark asks whether a fresh server answers


def look(page) -> dict:  # noqa: ANN001
    seen = page.evaluate(LOOK)
    if seen["failed"]:
        raise AssertionError(page.inner_text("body"))
    return seen


def points(seen: dict) -> int:
    done = seen["progress"].split(" / ")[0].strip()
    return int(done) if done.isdigit() else 0


def server(folder: Path, args: argparse.Namespace):  # noqa: ANN201
    folder.mkdir(parents=True, exist_ok=True)
    return streamlit_server(folder, tiny=args.model == "tiny", poll_s=SERVER_POLL_S,
                            env={"KVLAB_THREADS": str(args.threads)})


def first_page(chromium, folder: Path, args: argparse.Namespace, every: float  # noqa: ANN001
               ) -> dict[str, float]:
    """A fresh server's Overview in an open browser: seconds from the server's start to the
    title, to the page settled, and to the probe's facts and the model in (no "probing…", no
    "loading…")."""
    page = chromium.new_page(viewport={"width": 1440, "height": 1000})
    t0 = time.perf_counter()
    with server(folder, args) as (url, _):
        up = time.perf_counter() - t0
        page.goto(url, wait_until="commit")
        title = settled = filled = None
        while filled is None and time.perf_counter() - t0 < 300:
            seen, now = look(page), time.perf_counter() - t0
            if title is None and any("KV Cache Lab" in h for h in seen["titles"]):
                title = now
            idle = title is not None and seen["state"] != "running"
            if settled is None and idle:
                settled = now
            if idle and not seen["probing"] and not seen["loading"]:
                filled = now
            page.wait_for_timeout(every * 1000)
    page.close()
    if filled is None:
        raise RuntimeError("the Overview never settled with its facts in")
    return {"server_up_s": up, "page_title_s": title, "page_settled_s": settled,
            "page_filled_s": filled}


BARE_APP = 'import streamlit as st\n\nst.title("KV Cache Lab")\n'


def bare_page(chromium, folder: Path, every: float) -> dict[str, float]:  # noqa: ANN001
    """The floor under the first page: a fresh server of a Streamlit app that only writes the
    title (none of this project's code), seconds from the server's start to the title."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bare_app.py").write_text(BARE_APP)
    page = chromium.new_page(viewport={"width": 1440, "height": 1000})
    t0 = time.perf_counter()
    with streamlit_server(folder, poll_s=SERVER_POLL_S, script=str(folder / "bare_app.py")) \
            as (url, _):
        up = time.perf_counter() - t0
        page.goto(url, wait_until="commit")
        title = None
        while title is None and time.perf_counter() - t0 < 120:
            if any("KV Cache Lab" in h for h in look(page)["titles"]):
                title = time.perf_counter() - t0
            page.wait_for_timeout(every * 1000)
    page.close()
    (folder / "bare_app.py").unlink()
    if title is None:
        raise RuntimeError("the bare app's title never appeared")
    return {"bare_up_s": up, "bare_title_s": title}


def first_point(chromium, folder: Path, args: argparse.Namespace, every: float,  # noqa: ANN001
                at_once: bool) -> dict[str, float]:
    """A fresh server's Latency sweep page, Run with every default: pressed once the page has
    settled, or (``at_once``) the moment the button appears; the seconds to the first point
    (from Run, and from the page's first paint), the page read every ``every`` s. The sweep is
    stopped after its first point and saved by the server."""
    page = chromium.new_page(viewport={"width": 1440, "height": 1000})
    with server(folder, args) as (url, _):
        page.goto(f"{url}/sweep", wait_until="commit")
        paint = clicked = first = None
        if not at_once:  # settled: idle, the model in, the probe landed
            page.wait_for_selector('h1:has-text("Latency sweep")', timeout=120_000)
            end = time.monotonic() + 300
            while time.monotonic() < end:
                settle(page, 300_000)
                seen = look(page)
                if not seen["probing"] and not seen["loading"] and seen["run"]:
                    break
            page.get_by_role("button", name="Run sweep").click()
            clicked = time.perf_counter()
        end = time.perf_counter() + 300
        while first is None and time.perf_counter() < end:
            seen, now = look(page), time.perf_counter()
            if paint is None and any("Latency sweep" in h for h in seen["titles"]):
                paint = now
            if clicked is None and seen["run"]:
                page.get_by_role("button", name="Run sweep").click()
                clicked = time.perf_counter()
            elif clicked is not None and points(seen) >= 1:
                first = now
                break
            page.wait_for_timeout(every * 1000)
        if first is None or clicked is None:
            raise RuntimeError("no first point within 300 s")
        page.get_by_role("button", name="Stop").click()
        end = time.monotonic() + 300
        while not list(folder.glob("*latency_sweep*.json")) and time.monotonic() < end:
            time.sleep(0.5)
    page.close()
    if not at_once:
        return {"settled_point_s": first - clicked}
    return {"paint_point_s": first - paint, "paint_run_s": clicked - paint,
            "run_point_s": first - clicked}


def first_minutes(out: Path, args: argparse.Namespace) -> None:
    """``--first``: per read interval and run, the three fresh servers (see the top); each
    run's timing is saved in its folder beside the sweeps its servers saved."""
    from playwright.sync_api import sync_playwright

    todo = [(every, i) for every in args.reads for i in range(1, args.runs + 1)
            if not any(r.get("kind") == FIRST_KIND
                       for r in saved(out / f"every-{every:g}s-run-{i}"))]
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for every, i in todo[:args.pairs]:
            folder = out / f"every-{every:g}s-run-{i}"
            shutil.rmtree(folder, ignore_errors=True)  # an earlier try that did not finish
            load_1m = os.getloadavg()[0]
            timing = {"read_every_s": every, "load_1m": load_1m, "started_with": STARTED_WITH,
                      **bare_page(chromium, folder / "bare", every),
                      **first_page(chromium, folder / "page", args, every),
                      **first_point(chromium, folder / "settled", args, every, False),
                      **first_point(chromium, folder / "paint", args, every, True)}
            meta = results.collect_meta(
                model=args.model, weights="auto", device="cpu", dtype="float32",
                threads=args.threads, command="scripts/bench_sweep.py --first (headless "
                f"Chromium, fresh servers, every default, the page read every {every:g} s)")
            sweeps = [r for r in saved(folder) if r.get("kind") == "latency_sweep"]
            if sweeps:
                meta["device_name"] = sweeps[0]["meta"].get("device_name")
            timing["load_1m_after"] = os.getloadavg()[0]
            results.save_run(results.new_run(FIRST_KIND, meta, {"timing": [timing]}),
                             folder)
            print(f"read every {every:g} s, run {i} (load {load_1m:.2f}): a bare Streamlit "
                  f"app's title {timing['bare_title_s']:.1f} s; first page "
                  f"{timing['page_title_s']:.1f} s (settled {timing['page_settled_s']:.1f} "
                  f"s, filled in {timing['page_filled_s']:.1f} s); first point "
                  f"{timing['settled_point_s']:.1f} s from a settled page, "
                  f"{timing['paint_point_s']:.1f} s from first paint", flush=True)
        chromium.close()
    for log in out.rglob("server.log"):  # the servers' logs are not runs
        log.unlink()


def saved(out: Path) -> list[dict]:
    """Every run kept under ``out``, each with its path (what the report reads)."""
    from instruments.store.results import load_runs

    return load_runs(out, recursive=True).runs


def table(out: Path) -> list[str]:
    """The markdown tables, from the runs kept in ``out`` (``instruments.store.sweep_bench``)."""
    runs = saved(out)
    first = first_report(runs)
    return [*report(runs), *([""] if first and report(runs) else []), *first] or [
        f"no browser run under {out}"]


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
                    help="give each browser run a calibration of the host first")
    ap.add_argument("--crop-check", action="store_true",
                    help="also compare mode 3's crop method with the write-up's generations")
    ap.add_argument("--report", metavar="FOLDER", help="only print the table of saved runs")
    ap.add_argument("--first", action="store_true",
                    help="measure the first page and the first point on fresh servers instead")
    ap.add_argument("--reads", type=lambda text: [float(x) for x in text.split(",")],
                    default=[0.1, 1.0], help="--first: the page read every this many seconds "
                    "(default 0.1,1)")
    ap.add_argument("--pairs", type=int, default=None,
                    help="--first: measure at most this many (read interval, run) pairs now; "
                    "the folder keeps those done, so a later call goes on (quiet moments)")
    args = ap.parse_args(argv)
    if args.report:
        print("\n".join(table(Path(args.report))))
        return 0
    out = Path(args.out)
    if args.first:  # goes on where an earlier call into the same folder stopped
        first_minutes(out, args)
        print("\n".join(table(out)))
        print(f"runs kept in {out}")
        return 0
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
