#!/usr/bin/env python
"""What the live chart costs the machine it measures on: CPU seconds per redraw, server + browser.

    python scripts/bench_redraw.py                    # gpt2, five settings (~8 min)
    python scripts/bench_redraw.py --model tiny --window-s 5 --configs 1:0,1:1   # smoke run

For each setting "progress:chart" -- the seconds between progress refreshes once points are
coming (``$KVLAB_REFRESH_S``) and between live-chart redraws (``$KVLAB_LIVE_CHART_S``; 0: no
live chart) -- it starts a fresh
``streamlit run app.py``, opens the Latency sweep page in headless Chromium, presses Run with
every default and, once the first point is in, counts for ``--window-s`` seconds the CPU time
(user + system) of the Streamlit server and of every Chromium process -- everything this script
started except the measuring process, which is what is being protected. Per-process counters
(psutil) are exact whatever else the machine runs; the cgroup counter the quiet watch reads
(``instruments.measure.timing``) is printed beside them, minus the measuring process and this
script, and includes every other process on the machine. It prints, per setting, the share of one
core the page used and, against the setting with the same progress period and no live chart,
the CPU per chart redraw; the settings without a chart give the CPU per progress refresh. The
page is not polled during the window (a user's browser only draws).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from instruments.measure.timing import _usage_reader  # noqa: E402
from scripts.browser import streamlit_server, sweep_page  # noqa: E402

WORKER = "instruments.process.worker"


def cpu_s(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def groups() -> dict[str, list[psutil.Process]]:
    """This script's descendants: the server, the browser, the measuring process."""
    out: dict[str, list[psutil.Process]] = {"server": [], "browser": [], "worker": []}
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if WORKER in cmd:
            out["worker"].append(p)
        elif "streamlit" in cmd:
            out["server"].append(p)
        elif "chrom" in cmd:
            out["browser"].append(p)
    return out


def one_setting(progress_s: float, chart_s: float, args: argparse.Namespace
                ) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    folder = Path(tempfile.mkdtemp(prefix="kvlab-redraw-"))
    env = {"KVLAB_REFRESH_S": str(progress_s), "KVLAB_LIVE_CHART_S": str(chart_s)}
    with streamlit_server(folder, tiny=args.model == "tiny", env=env) as (url, _), \
            sync_playwright() as pw:
        page = sweep_page(pw, url, args.model)
        page.get_by_role("button", name="Run sweep").click()
        while True:  # the first point
            text = " ".join(page.locator('[data-testid="stProgress"]').all_inner_texts())
            if text.split(" / ")[0].strip().isdigit() and int(text.split(" / ")[0]) >= 1:
                break
            page.wait_for_timeout(200)
        page.wait_for_timeout(2000)
        usage, _ = _usage_reader()
        g = groups()
        me = psutil.Process()
        marks = {k: cpu_s(v) for k, v in g.items()} | {"me": cpu_s([me])}
        cg0, t0 = (usage() if usage else 0), time.perf_counter()
        end = t0 + args.window_s
        while time.perf_counter() < end and page.locator('[data-testid="stProgress"]').count():
            time.sleep(0.25)  # not page.wait_for_timeout: that would drive the browser
        wall = time.perf_counter() - t0
        cg = ((usage() if usage else 0) - cg0) / 1e9
        used = {k: cpu_s(v) - marks[k] for k, v in g.items()} | {"me": cpu_s([me]) - marks["me"]}
    return {"wall_s": wall, "server_s": used["server"], "browser_s": used["browser"],
            "worker_s": used["worker"], "cgroup_others_s": cg - used["worker"] - used["me"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--configs", default="1:0,1:1,3:0,3:9,5:0",
                    help="progress:chart periods in s, comma-separated (chart 0: no live chart)")
    ap.add_argument("--window-s", type=float, default=30.0)
    args = ap.parse_args(argv)
    os.environ.setdefault("KVLAB_THREADS", "1")  # as on the 2-core machine: one core left over
    settings = [tuple(float(x) for x in c.split(":")) for c in args.configs.split(",")]
    share: dict[tuple[float, float], float] = {}
    print("| progress every (s) | chart every (s) | window (s) | server CPU (ms/s) | browser CPU "
          "(ms/s) | page: share of one core | CPU per chart redraw (ms) | cgroup others (ms/s) |")
    print("|---|---|---|---|---|---|---|---|")
    for progress_s, chart_s in settings:
        r = one_setting(progress_s, chart_s, args)
        share[progress_s, chart_s] = (r["server_s"] + r["browser_s"]) / r["wall_s"]
        base = share.get((progress_s, 0.0))
        per_redraw = "" if base is None or chart_s == 0 else (
            f"{(share[progress_s, chart_s] - base) * chart_s * 1e3:.0f}")
        print(f"| {progress_s:g} | {chart_s:g} | {r['wall_s']:.0f} | "
              f"{r['server_s'] / r['wall_s'] * 1e3:.0f} | {r['browser_s'] / r['wall_s'] * 1e3:.0f} "
              f"| {share[progress_s, chart_s]:.1%} | {per_redraw} | "
              f"{r['cgroup_others_s'] / r['wall_s'] * 1e3:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
