#!/usr/bin/env python
"""Does the dashboard disturb what it measures? The same sweep from the browser and from the CLI.

    python scripts/bench_isolation.py                 # gpt2 shapes, 8-200:8, 2 rounds (~10 min)
    python scripts/bench_isolation.py --model tiny --contexts 8-64:8 --rounds 1   # smoke run

Each round starts ``streamlit run app.py`` on a free port, runs a latency sweep (modes 1 and 3,
one timed run per context, random weights) from headless Chromium while a second browser
session keeps moving between the pages, then runs the same sweep with the CLI
(``python -m instruments sweep``) in its own process. It prints, per round and mode: the largest
step against the mode's median (the issue's bound: no cached step above 3x), and the in-app
median against the CLI's, per context (the bound: within 15%). Do not run it while other work
loads the cores: the numbers would lie.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.test_browser import ARGS, CHROMIUM, settle, streamlit_server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["Overview", "FLOPs vs time", "Memory", "Results", "Generate side by side",
         "Floor lab", "Correctness lab"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2", help="gpt2 (default) or tiny")
    ap.add_argument("--contexts", default="8-200:8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temp folder)")
    ap.add_argument("--threads", default="", help="torch threads for both (default: theirs)")
    ap.add_argument("--pace-s", type=float, default=2.0,
                    help="seconds the second session stays on each page")
    return ap.parse_args(argv)


def choose(page, label: str, option: str) -> None:
    page.locator('[data-testid="stSelectbox"]', has_text=label).first.click()
    page.get_by_role("option", name=option, exact=True).click()
    settle(page)


def browser_sweep(pw, url: str, args: argparse.Namespace) -> None:
    """Session A runs the sweep; session B browses the other pages until A has finished."""
    from tests.test_browser import wait_finished

    browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
    a = browser.new_page(viewport={"width": 1440, "height": 1000})
    a.goto(f"{url}/sweep")
    a.wait_for_selector('h1:has-text("Latency sweep")', timeout=120_000)
    settle(a)
    choose(a, "Preset", args.model)
    choose(a, "Weights", "random")
    settle(a, 300_000)  # the model loads in the measuring process
    choose(a, "Context lengths", "custom list / range")
    box = a.get_by_role("textbox", name="Lengths (tokens)")
    box.fill(args.contexts)
    box.press("Enter")
    repeats = a.get_by_role("spinbutton", name="Repeats")
    repeats.fill("1")
    repeats.press("Enter")
    a.get_by_text("End-to-end too").click()  # off: the CLI sweep below has none either
    settle(a)
    b = browser.new_page(viewport={"width": 1440, "height": 1000})
    b.goto(url)
    a.get_by_role("button", name="Run sweep").click()
    a.wait_for_selector('[data-testid="stProgress"]', timeout=60_000)
    visits = 0
    while a.locator('[data-testid="stProgress"]').count():
        title = PAGES[visits % len(PAGES)]  # session B moves on, page after page
        b.locator('[data-testid="stSidebarNav"] a', has_text=title).first.click()
        b.wait_for_timeout(args.pace_s * 1000)
        visits += 1
    wait_finished(a, 60_000)
    print(f"  browser: the second session opened {visits} pages during the sweep", flush=True)
    browser.close()


def cli_sweep(args: argparse.Namespace, folder: Path) -> None:
    subprocess.run([sys.executable, "-m", "instruments", "sweep", "--model", args.model,
                    "--weights", "random", "--contexts", args.contexts, "--repeats", "1",
                    "--new-tokens", "0", "--no-progress", "--results-dir", str(folder),
                    *(["--threads", args.threads] if args.threads else [])],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def latency(folder: Path) -> dict[str, dict[int, float]]:
    (path,) = [p for p in folder.glob("*.json")
               if json.loads(p.read_text())["kind"] == "latency_sweep"]
    rows = json.loads(path.read_text())["tables"]["latency"]
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        out.setdefault(r["mode"], {})[r["context_len"]] = r["latency_ms"]
    return out


def report(app: dict[str, dict[int, float]], cli: dict[str, dict[int, float]]) -> list[str]:
    lines = []
    for mode in app:
        steps = list(app[mode].values())
        median = statistics.median(steps)
        worst = max(steps) / median
        ratios = [app[mode][t] / cli[mode][t] for t in app[mode] if t in cli.get(mode, {})]
        mid = statistics.median(ratios)
        lines.append(f"| {mode} | {median:.2f} | {max(steps):.2f} | {worst:.2f}× | "
                     f"{statistics.median(cli[mode].values()):.2f} | {mid:.3f} | "
                     f"{min(ratios):.2f}–{max(ratios):.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    from playwright.sync_api import sync_playwright

    args = parse_args(argv)
    base = Path(args.out or tempfile.mkdtemp(prefix="kvlab-isolation-"))
    print("| mode | app median (ms) | app max (ms) | max ÷ median | CLI median (ms) "
          "| app ÷ CLI, median over contexts | range |")
    print("|---|---|---|---|---|---|---|")
    for i in range(args.rounds):
        app_dir, cli_dir = base / f"round{i}-app", base / f"round{i}-cli"
        app_dir.mkdir(parents=True)
        cli_dir.mkdir(parents=True)
        with streamlit_server(app_dir, tiny=args.model == "tiny") as (url, _), \
                sync_playwright() as pw:
            browser_sweep(pw, url, args)
        cli_sweep(args, cli_dir)
        for line in report(latency(app_dir), latency(cli_dir)):
            print(line, flush=True)
    print(f"runs kept in {base}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
