#!/usr/bin/env python
"""What the live chart costs the machine it measures on: CPU seconds per redraw, server + browser.

    python scripts/bench_redraw.py                    # gpt2, rates 1, 2, 5 s and none (~6 min)
    python scripts/bench_redraw.py --model tiny --window-s 5   # smoke run

For each redraw period (``$KVLAB_LIVE_CHART_S``; 0: no live chart) it starts a fresh
``streamlit run app.py``, opens the Latency sweep page in headless Chromium, presses Run with
every default and, once the first point is in, counts for ``--window-s`` seconds the CPU time
(user + system) of the Streamlit server and of every Chromium process -- everything this script
started except the measuring process, which is what is being protected. Per-process counters
(psutil) are exact whatever else the machine runs; the cgroup counter the quiet watch reads
(``instruments.measure.timing``) is printed beside them, minus the measuring process and this
script, and includes every other process on the machine. It prints, per period, the share of one
core the page used and, against the run without a live chart, the CPU per redraw. The page is
not polled during the window (a user's browser only draws).
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
from scripts.browser import ARGS, CHROMIUM, settle, streamlit_server  # noqa: E402

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


def one_rate(rate_s: float, args: argparse.Namespace) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    folder = Path(tempfile.mkdtemp(prefix="kvlab-redraw-"))
    env = {"KVLAB_LIVE_CHART_S": str(rate_s)}
    with streamlit_server(folder, tiny=args.model == "tiny", env=env) as (url, _), \
            sync_playwright() as pw:
        page = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS).new_page(
            viewport={"width": 1440, "height": 1000})
        page.goto(f"{url}/sweep")
        page.wait_for_selector('h1:has-text("Latency sweep")', timeout=120_000)
        settle(page)
        for label, option in (("Preset", args.model), ("Weights", "random")):
            page.locator('[data-testid="stSelectbox"]', has_text=label).first.click()
            page.get_by_role("option", name=option, exact=True).click()
            settle(page, 300_000)
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
    ap.add_argument("--rates", default="0,1,2,5", help="redraw periods in s (0: no live chart)")
    ap.add_argument("--window-s", type=float, default=30.0)
    args = ap.parse_args(argv)
    os.environ.setdefault("KVLAB_THREADS", "1")  # as on the 2-core machine: one core left over
    rows = {float(r): one_rate(float(r), args) for r in args.rates.split(",")}
    base = rows.get(0.0)
    print("| redraw every | window (s) | server CPU (ms/s) | browser CPU (ms/s) | page: share of "
          "one core | CPU per redraw (ms) | cgroup others (ms/s) |")
    print("|---|---|---|---|---|---|---|")
    for rate, r in rows.items():
        per_s = (r["server_s"] + r["browser_s"]) / r["wall_s"]
        per_redraw = "" if base is None or rate == 0 else (
            f"{(per_s - (base['server_s'] + base['browser_s']) / base['wall_s']) * rate * 1e3:.0f}")
        print(f"| {'never (at the end)' if rate == 0 else f'{rate:g} s'} | {r['wall_s']:.0f} | "
              f"{r['server_s'] / r['wall_s'] * 1e3:.0f} | {r['browser_s'] / r['wall_s'] * 1e3:.0f} "
              f"| {per_s:.1%} | {per_redraw} | {r['cgroup_others_s'] / r['wall_s'] * 1e3:.0f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
