"""The Prefix cache page in headless Chromium: each of its three experiments runs from its tab in
the real app and draws -- TTFT against the cached prefix with the prediction beside it, the
chat with and without reuse, the workload's budgets and its radix tree. Screenshots
(``prefix``, ``prefix_chat``, ``prefix_tree``) go to a temporary folder and, when
``SCREENSHOT_DIR`` is set, there too (``docs/screenshots``). ``KVLAB_BROWSER_PREFIX_MODEL``
picks the preset (default llama-tiny, a test shape: seconds; smollm2-135m for real weights);
``KVLAB_BROWSER_RESULTS`` names a new results folder (the pages show where they saved).

Skipped when Chromium or Playwright is missing.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from scripts.browser import ARGS, CHROMIUM, settle, streamlit_server
from tests.test_browser import run_job, set_field, shot

MODEL = os.environ.get("KVLAB_BROWSER_PREFIX_MODEL", "llama-tiny")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed"),
]
sync_api = pytest.importorskip("playwright.sync_api")


def pick(page, label: str, option: str) -> None:  # noqa: ANN001
    page.locator('[data-testid="stSelectbox"]', has_text=label).first.click()
    page.get_by_role("option", name=re.compile(f"^{re.escape(option)}")).first.click()
    settle(page)


def test_the_prefix_page_runs_its_three_experiments(tmp_path: Path) -> None:
    # Screenshots for the docs name a folder a user would have, not pytest's temporary one.
    results = Path(os.environ.get("KVLAB_BROWSER_RESULTS") or tmp_path / "results")
    results.mkdir(parents=True)  # a fresh folder: the kinds below are this run's alone
    tiny = MODEL != "smollm2-135m"
    with streamlit_server(results, tiny=tiny) as (url, _), sync_api.sync_playwright() as pw:
        page = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS).new_page(
            viewport={"width": 1440, "height": 1000})
        page.goto(f"{url}/prefix")
        page.wait_for_selector('h1:has-text("Prefix cache")', timeout=120_000)
        settle(page)
        pick(page, "Preset", MODEL)
        if not tiny:
            page.wait_for_selector("text=/Weights: SmolLM2/", timeout=300_000)
        set_field(page, "textbox", "Prompt lengths (tokens)", "64, 192" if tiny else "256")
        set_field(page, "spinbutton", "Other tokens in the tree", "512" if tiny else "2048")
        set_field(page, "spinbutton", "Samples", "2")
        run_job(page, "Measure TTFT", 900_000)
        page.wait_for_selector("text=/Lookup: at most/", timeout=30_000)
        assert page.locator(".js-plotly-plot").count() >= 1
        shot(page, "prefix", tmp_path)

        page.get_by_role("tab", name="Multi-turn chat").click()
        settle(page)
        set_field(page, "spinbutton", "Turns", "8" if not tiny else "4")
        set_field(page, "spinbutton", "Answer tokens (at most)", "32" if not tiny else "8")
        set_field(page, "spinbutton", "Samples per turn", "1")
        run_job(page, "Run the chat", 1_200_000)
        page.wait_for_selector("text=/TTFT is .* turn 1's with reuse/", timeout=30_000)
        shot(page, "prefix_chat", tmp_path)

        page.get_by_role("tab", name="Shared-prefix workload").click()
        settle(page)
        set_field(page, "spinbutton", "Requests", "24")
        run_job(page, "Serve the workload", 1_200_000)
        page.wait_for_selector("text=/The tree under the/", timeout=30_000)
        assert page.locator(".js-plotly-plot").count() >= 5  # + budgets, bytes held, tree
        shot(page, "prefix_tree", tmp_path)
    kinds = sorted(p.name.split("_", 1)[1].rsplit("_", 1)[0] for p in results.glob("*.json"))
    assert kinds == ["prefix_chat", "prefix_ttft", "prefix_workload"], kinds
