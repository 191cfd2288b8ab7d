"""The dashboard's pages driven by Streamlit's ``AppTest``, as the tests and the device check
(``scripts/device_check/pages.py``) both drive them: open a page, set its inputs, press Run, wait
for the measuring process to finish the job. Torch-free, like every page.

  ``APP``, ``routed_pages()``  the router (app.py) and the pages it offers, in its order
  ``open_page(page, state=None, timeout_s=60)``  a fresh session of the app on ``views/<page>
                   .py``, with ``state`` (sidebar keys: model, weights, device, dtype) set before
                   its first run; ``PageError`` if the page raised
  ``no_traceback(at)``  ``PageError`` naming what raised, if anything did
  ``wait_job(at, key, timeout_s)``  rerun the page until the job in ``session_state[key]`` is
                   finished; ``PageError`` if the page raises meanwhile, ``JobTimeout`` (one)
                   if time runs out
  ``configure_sweep(at, contexts, repeats, e2e)``  the Latency sweep page's inputs
  ``charts(at)``  the page's plotly charts
``PageError`` is an ``AssertionError``: a test that meets one fails with its message.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parents[1] / "app.py")


class PageError(AssertionError):
    """A page raised (an exception element or an uncaught exception), or its job did not end."""


class JobTimeout(PageError):
    """The page's job had not finished when the time given to wait for it ran out."""


def routed_pages() -> list[str]:
    """The pages the router offers (their views/ file names), in its order."""
    text = Path(APP).read_text(encoding="utf-8")
    return re.findall(r'st\.Page\("views/(\w+)\.py"', text)


def no_traceback(at: AppTest) -> None:
    if at.exception:
        raise PageError(f"the page raised: {[e.message for e in at.exception]}")


def open_page(page: str, state: dict[str, Any] | None = None,
              timeout_s: float = 60.0) -> AppTest:
    """A fresh session on ``views/<page>.py``; ``state`` is set before the app's first run
    (the sidebar reads its keys: ``model``, ``weights``, ``device``, ``dtype``)."""
    at = AppTest.from_file(APP, default_timeout=timeout_s)
    for key, value in (state or {}).items():
        at.session_state[key] = value
    at.run()
    at.switch_page(f"views/{page}.py")
    at.run()
    no_traceback(at)
    return at


def wait_job(at: AppTest, key: str, timeout_s: float = 90.0) -> Any:
    """The job in ``session_state[key]`` once finished (the page drawn once more after)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        time.sleep(0.2)
        at.run()
        no_traceback(at)
        job = at.session_state[key]
        if job.finished:
            at.run()  # the page's final drawing
            return job
    raise JobTimeout(f"{key} did not finish in {timeout_s:.0f} s")


def charts(at: AppTest) -> list:
    return list(at.get("plotly_chart"))


def configure_sweep(at: AppTest, contexts: str, repeats: int = 1, e2e: bool = False) -> None:
    """The Latency sweep page's inputs: custom contexts, samples, no warm-up, end to end."""
    at.selectbox(key="sweep_preset").set_value("custom list / range").run()
    at.text_input(key="sweep_custom").set_value(contexts)
    at.number_input(key="sweep_repeats").set_value(repeats)
    at.number_input(key="sweep_warmup").set_value(0)
    at.toggle(key="sweep_e2e").set_value(e2e)
    at.run()
    if e2e:
        at.number_input(key="sweep_new").set_value(6).run()
