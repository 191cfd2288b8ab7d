"""The README's headline picture, retaken as a user meets the Latency sweep page; and the
Serving page's. A fresh server whose results go where a user's do (not a test's temporary
folder), a preset users run with random weights, Run with every other default (Serving: the
closed loop at ``--concurrency``), the whole page shot when the run has finished.

    python scripts/screenshots.py                     # docs/screenshots/sweep.png, gpt2
    python scripts/screenshots.py --model smollm2-135m --out /tmp/shots
    python scripts/screenshots.py --page serving      # docs/screenshots/serving.png, smollm2-135m
    python scripts/screenshots.py --page memory --mistral-window 64 --contexts 16,32,64,128,256
        # a user's checkpoint past its sliding window: a random MistralForCausalLM saved by
        # transformers into a temporary folder, typed in as a path (sweep_mistral-*.png, ...)

A run is a measurement: take it on a quiet host (nothing else running); the page names the
host's device in its sidebar (and Serving's figures in their titles). Needs Debian's
``chromium`` and Playwright; the run lands in ``--results`` (default ``results/``, where
``make run`` saves).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.browser import (  # noqa: E402
    model_page,
    settle,
    streamlit_server,
    sweep_page,
    wait_finished,
)

RUN_TIMEOUT_MS = 900_000  # gpt2's default sweep takes 1-2 minutes on two cores
# page -> (its path, heading, Run button, the default model, the line it says when done)
PAGES = {"sweep": ("sweep", "Latency sweep", "Run sweep", "gpt2", "Finished \\d+ points"),
         "serving": ("serving", "Serving", "Serve", "smollm2-135m", "Finished \\d+ points"),
         "memory": ("memory", "Memory", "Measure memory", "gpt2", "Finished")}


def mistral_checkpoint(window: int) -> str:
    """A random Mistral (4 layers, width 256, 8 query and 2 K/V heads, a ``window``-token
    sliding window) saved by transformers as a user's folder: config.json + safetensors."""
    import tempfile

    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=4096, hidden_size=256, intermediate_size=512,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                        max_position_embeddings=1024, sliding_window=window)
    folder = Path(tempfile.mkdtemp(prefix="kvlab-shot-")) / f"mistral-window{window}"
    MistralForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return str(folder)


def set_contexts(page, which: str, contexts: str) -> None:  # noqa: ANN001 (a playwright page)
    """Type the context lengths a run measures (the sweep's custom list, the memory page's)."""
    if which == "sweep":
        page.locator('[data-testid="stSelectbox"]', has_text="Context lengths").click()
        page.get_by_role("option", name="custom list / range").click()
        settle(page)
    field = page.get_by_role("textbox", name="Lengths (tokens)" if which == "sweep"
                             else "Context lengths")
    field.fill(contexts)
    field.press("Enter")
    settle(page)


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
    parser.add_argument("--page", choices=list(PAGES), default="sweep")
    parser.add_argument("--model", default=None, help="a preset users run (not tiny; default: "
                        "gpt2 for the sweep, smollm2-135m for Serving)")
    parser.add_argument("--concurrency", default="1, 4, 16",
                        help="Serving: the closed loop's clients")
    parser.add_argument("--contexts", default=None, help="context lengths to measure (sweep, "
                        "memory; default: the page's)")
    parser.add_argument("--mistral-window", type=int, default=None,
                        help="shoot a random Mistral checkpoint of this sliding window instead")
    parser.add_argument("--results", type=Path, default=ROOT / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    args = parser.parse_args(argv)
    path, title, button, default, done = PAGES[args.page]
    model = mistral_checkpoint(args.mistral_window) if args.mistral_window else \
        args.model or default
    if model in ("tiny", "llama-tiny"):
        parser.error(f"--model {model} is a test shape; the README shows a preset users run")
    from playwright.sync_api import sync_playwright

    args.results.mkdir(parents=True, exist_ok=True)
    with streamlit_server(args.results, tiny=False) as (url, _), sync_playwright() as pw:
        page = sweep_page(pw, url, model) if args.page == "sweep" else model_page(
            pw, url, model, path, title)
        if args.page == "serving":
            field = page.get_by_role("textbox", name="Concurrencies (clients)")
            field.fill(args.concurrency)
            field.press("Enter")
            settle(page)
        if args.contexts:
            set_contexts(page, args.page, args.contexts)
        page.get_by_role("button", name=button).click()
        page.wait_for_selector('[data-testid="stProgress"]', timeout=60_000)
        wait_finished(page, RUN_TIMEOUT_MS)
        page.wait_for_selector(f"text=/{done}/", timeout=10_000)
        settle(page)
        name = f"{args.page}.png" if model == default else f"{args.page}_{Path(model).name}.png"
        shoot(page, args.out / name)
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
