"""The Serving page in headless Chromium: a closed loop at concurrencies 1, 4 and 16 runs from the
page in the real app; while it goes on the batch over time, the block pool and the curves are
drawn live beside the progress bar (the live chart redrawn every 3 s here, ``KVLAB_LIVE_CHART_S``),
and once it ends every step is drawn with the decode step against its floor and the run
overlaid. Screenshots (``serving_live``, ``serving``) go to a temporary folder and, when
``SCREENSHOT_DIR`` is set, there too. ``KVLAB_BROWSER_SERVING_MODEL`` picks the preset (default
llama-tiny, a test shape: seconds; smollm2-135m for real shapes).

Skipped when Chromium or Playwright is missing.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from scripts.browser import ARGS, CHROMIUM, settle, streamlit_server, wait_finished
from tests.test_browser import set_field, shot

MODEL = os.environ.get("KVLAB_BROWSER_SERVING_MODEL", "llama-tiny")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed"),
]
sync_api = pytest.importorskip("playwright.sync_api")
PLOTS = ".js-plotly-plot"


def test_the_serving_page_draws_a_run_live_and_when_it_ends(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    tiny = MODEL == "llama-tiny"
    with streamlit_server(results, tiny=True, env={"KVLAB_LIVE_CHART_S": "3"}) as (url, _), \
            sync_api.sync_playwright() as pw:
        page = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS).new_page(
            viewport={"width": 1440, "height": 1000})
        page.goto(f"{url}/serving")
        page.wait_for_selector('h1:has-text("Serving")', timeout=120_000)
        settle(page)
        page.locator('[data-testid="stSelectbox"]', has_text="Preset").first.click()
        page.get_by_role("option", name=re.compile(f"^{re.escape(MODEL)} ")).first.click()
        settle(page, 300_000)
        set_field(page, "textbox", "Concurrencies (clients)", "1, 4, 16")
        if tiny:  # long enough for the live chart to be drawn a few times
            set_field(page, "spinbutton", "Requests per client", "8")
            set_field(page, "spinbutton", "Output max (tokens)", "128")
            set_field(page, "spinbutton", "Output min (tokens)", "64")
        page.get_by_role("button", name="Serve").click()
        page.wait_for_selector('[data-testid="stProgress"]', timeout=60_000)
        page.wait_for_function(f"() => document.querySelectorAll('{PLOTS}').length >= 4",
                               timeout=600_000)
        assert page.locator('[data-testid="stProgress"]').count() == 1  # still running
        page.wait_for_selector("text=/Live: \\d+ of the steps so far/", timeout=10_000)
        shot(page, "serving_live", tmp_path)
        assert page.locator('[data-testid="stProgress"]').count() == 1, "ended during the shot"
        wait_finished(page, 1_800_000)
        page.wait_for_selector("text=/Finished 3 points/", timeout=30_000)
        page.wait_for_selector("text=/The decode-only steps at each batch/", timeout=30_000)
        # batch, pool, throughput, percentiles, the step; the saved run overlaid twice
        assert page.locator(PLOTS).count() == 7
        assert page.get_by_text(re.compile(r"Batch over time")).count() >= 1
        shot(page, "serving", tmp_path)
    (run,) = results.glob("*_serving_*.json")
    assert run.stat().st_size > 0
