#!/usr/bin/env python
"""How long the default sweep takes, from the CLI and from the browser, and whether it measures
what the write-up's slower method measures.

    python scripts/bench_sweep.py            # gpt2 shapes, random weights (~8 minutes)
    python scripts/bench_sweep.py --model tiny   # smoke run

1. The default sweep from the CLI (16 log-spaced contexts, modes 1 and 3, at least 2 samples
   per point, the end-to-end part included), with the dashboard's thread count: its wall time.
2. The same cached points timed the write-up's way (``--method generate``, 3 whole generations)
   and the default way (crop), side by side: the per-context medians of mode 3 compared.
3. The default sweep from headless Chromium against a fresh server whose results folder holds
   run 1: the estimate the page showed before Run, the seconds to the first point, and to the
   end. Prints one markdown table for the README. Run it on quiet cores: the numbers would lie.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.browser import ARGS, CHROMIUM, settle, streamlit_server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def cli(folder: Path, args: argparse.Namespace, *extra: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "instruments", "sweep", "--model", args.model,
                    "--weights", "random", "--threads", str(args.threads), "--no-progress",
                    "--results-dir", str(folder), *extra], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def rows(folder: Path, mode: str) -> dict[int, float]:
    (path,) = folder.glob("*.json")
    return {r["context_len"]: r["latency_ms"]
            for r in json.loads(path.read_text())["tables"]["latency"] if r["mode"] == mode}


def browser(folder: Path, args: argparse.Namespace) -> tuple[str, float, float]:
    """(the estimate caption, seconds to the first point, seconds to the end)."""
    from playwright.sync_api import sync_playwright

    with streamlit_server(folder, tiny=args.model == "tiny") as (url, _), \
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
        said = page.locator("text=/should take about/").first.inner_text()
        t0 = time.perf_counter()
        page.get_by_role("button", name="Run sweep").click()
        first = None
        while True:
            text = " ".join(page.locator('[data-testid="stProgress"]').all_inner_texts())
            done = text.split(" / ")[0]
            if first is None and done.isdigit() and int(done) >= 1:
                first = time.perf_counter() - t0
            if page.locator("text=/Finished \\d+ points/").count():
                break
            page.wait_for_timeout(200)
        return said, first or float("nan"), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--threads", type=int, default=1, help="as the dashboard on 2 cores: 1")
    args = ap.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="kvlab-bench-sweep-"))
    default, crop, gen = base / "default", base / "crop", base / "generate"
    for folder in (default, crop, gen):
        folder.mkdir()
    cli_s = cli(default, args)
    print(f"1. CLI default sweep: {cli_s:.0f} s (process start and model load included)")
    cached = ["--modes", "concat", "--repeats", "3", "--new-tokens", "0", "--no-peaks"]
    cli(gen, args, *cached, "--method", "generate")
    cli(crop, args, *cached)
    a, b = rows(crop, "concat"), rows(gen, "concat")
    ratio = {t: a[t] / b[t] for t in a}
    close = sum(abs(r - 1) <= 0.1 for r in ratio.values())
    print("2. mode 3, crop ÷ generate per context: median "
          f"{statistics.median(ratio.values()):.3f}, range {min(ratio.values()):.3f}–"
          f"{max(ratio.values()):.3f}; within 10% at {close} of {len(ratio)} contexts")
    said, first_s, total_s = browser(default, args)
    print(f"3. browser: the page said \"{said}\"; first point after {first_s:.1f} s; "
          f"finished after {total_s:.0f} s")
    print(f"runs kept in {base}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
