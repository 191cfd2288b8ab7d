"""The app in a real browser: a Streamlit server on a free localhost port and the waits that
drive it, shared by the browser tests and the benchmark scripts that measure from a browser.

  streamlit_server(results, tiny)  ``streamlit run app.py`` (results in ``results``; the tiny
                                   test preset when ``tiny``), yields (url, process)
  settle(page)                     wait until the app is idle, and refuse a page with an exception
  wait_finished(page, timeout_ms)  wait until the job section's progress bar is gone
  sweep_page(pw, url, model)       Chromium on the Latency sweep page, ``model`` with random
                                   weights chosen and loaded (``model_page``: another page)
``CHROMIUM`` and ``ARGS`` launch Debian's chromium headless with Playwright.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def streamlit_server(results: Path, tiny: bool = True, env: dict[str, str] | None = None,
                     poll_s: float = 0.5, script: str = "app.py"
                     ) -> Iterator[tuple[str, subprocess.Popen]]:
    """A fresh server of app.py as ``make run`` starts it (``python -m ui.serve``), or of another
    ``script`` (``streamlit run``), run from the project's root with its settings, yielded once it
    answers (asked every ``poll_s``: a benchmark of the first page asks often); RuntimeError
    with its log if it never does."""
    port = free_port()
    env = {**os.environ, **(env or {}), "KVLAB_RESULTS_DIR": str(results),
           "KVLAB_TINY": "1" if tiny else "0"}
    log = open(results / "server.log", "w")  # noqa: SIM115 - closed below
    serve = ["-m", "ui.serve"] if script == "app.py" else ["-m", "streamlit", "run", script]
    proc = subprocess.Popen(
        [sys.executable, *serve, "--server.port", str(port),
         "--server.headless", "true", "--server.address", "127.0.0.1"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=1) as r:
                    if r.read() == b"ok":
                        break
            except OSError:
                time.sleep(poll_s)
        else:
            raise RuntimeError("streamlit did not start: " + (results / "server.log").read_text())
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def settle(page, timeout_ms: int = 60_000) -> None:
    """Wait until the app is idle (its script not running) and check for exceptions. Streamlit
    1.67 marks the state on the app's root (``data-test-script-state``); its "Running…" status
    widget is not drawn in a headless browser, so waiting on that waited for nothing -- a page
    still loading its model (seconds) counted as idle."""
    status = '[data-testid="stApp"][data-test-script-state="running"]'
    end = time.monotonic() + timeout_ms / 1000
    while True:  # idle twice in a row, 0.8 s apart: a rerun can start right after a click
        page.wait_for_timeout(800)
        page.wait_for_selector(status, state="detached", timeout=timeout_ms)
        page.wait_for_timeout(800)
        if page.locator(status).count() == 0 or time.monotonic() > end:
            break
    if page.locator('[data-testid="stException"]').count():
        raise AssertionError(page.inner_text("body"))


def wait_finished(page, timeout_ms: int) -> None:
    page.wait_for_selector('[data-testid="stProgress"]', state="detached", timeout=timeout_ms)
    settle(page)


def sweep_page(pw, url: str, model: str):  # noqa: ANN001, ANN201 (playwright objects)
    """A headless Chromium page on the server's Latency sweep page with ``model`` and random
    weights chosen (the model loaded in the measuring process): where a new user presses Run."""
    return model_page(pw, url, model, "sweep", "Latency sweep")


def model_page(pw, url: str, model: str, path: str, title: str):  # noqa: ANN001, ANN201
    """``sweep_page`` for the page at ``/path`` whose heading is ``title``."""
    page = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS).new_page(
        viewport={"width": 1440, "height": 1000})
    page.goto(f"{url}/{path}")
    page.wait_for_selector(f'h1:has-text("{title}")', timeout=120_000)
    settle(page)
    if "/" in model:  # a checkpoint's path: typed under the list's last entry, its own weights
        page.locator('[data-testid="stSelectbox"]', has_text="Preset").first.click()
        page.get_by_role("option", name=re.compile("checkpoint at a path")).click()
        settle(page)
        field = page.get_by_role("textbox", name="Checkpoint path")
        field.fill(model)
        field.press("Enter")
        settle(page, 300_000)  # the model loads in the measuring process
        return page
    # A preset's option reads "gpt2 (GPT-2)" (ui.state's label): matched by its name.
    for label, option in (("Preset", re.compile(rf"^{re.escape(model)} \(")),
                          ("Weights", "random")):
        page.locator('[data-testid="stSelectbox"]', has_text=label).first.click()
        page.get_by_role("option", name=option, exact=True).click()
        settle(page, 300_000)  # the model loads in the measuring process
    return page
