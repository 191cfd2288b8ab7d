"""The README's headline picture, retaken as a user meets the Latency sweep page. A fresh server
whose results go where a user's do (not a test's temporary folder), a preset users run (gpt2 by
default) with random weights, Run with every other default, the whole page shot when the sweep
has finished.

    python scripts/screenshots.py                     # docs/screenshots/sweep.png, gpt2
    python scripts/screenshots.py --model smollm2-135m --out /tmp/shots

The sweep is a measurement: take it on a quiet host (nothing else running), and the page names
the host's device in its sidebar. Needs Debian's ``chromium`` and Playwright; the run lands in
``--results`` (default ``results/``, where ``make run`` saves).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.browser import settle, streamlit_server, sweep_page, wait_finished  # noqa: E402

SWEEP_TIMEOUT_MS = 600_000  # gpt2's default sweep takes 1-2 minutes on two cores


def shoot(page, path: Path) -> None:  # noqa: ANN001 (a playwright page)
    """The whole page: Streamlit scrolls inside its main block, so grow the window first."""
    height = page.evaluate("() => Math.max(...Array.from(document.querySelectorAll("
                           "'[data-testid=stMain] *, [data-testid=stMain]'), e => e.scrollHeight))")
    page.set_viewport_size({"width": 1440, "height": max(900, min(int(height), 6000))})
    page.wait_for_timeout(1500)  # plotly re-lays out to the new size
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", help="a preset users run (not tiny)")
    parser.add_argument("--results", type=Path, default=ROOT / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    args = parser.parse_args(argv)
    if args.model in ("tiny", "llama-tiny"):
        parser.error(f"--model {args.model} is a test shape; the README shows a preset users run")
    from playwright.sync_api import sync_playwright

    args.results.mkdir(parents=True, exist_ok=True)
    with streamlit_server(args.results, tiny=False) as (url, _), sync_playwright() as pw:
        page = sweep_page(pw, url, args.model)
        page.get_by_role("button", name="Run sweep").click()
        page.wait_for_selector('[data-testid="stProgress"]', timeout=60_000)
        wait_finished(page, SWEEP_TIMEOUT_MS)
        page.wait_for_selector("text=/Finished \\d+ points/", timeout=10_000)
        settle(page)
        name = "sweep.png" if args.model == "gpt2" else f"sweep_{args.model}.png"
        shoot(page, args.out / name)
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
