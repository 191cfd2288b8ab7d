"""The device check's pages stage (imported by scripts/gpu_check.py): every page the dashboard's
router offers, under Streamlit's AppTest, on the check's device with the check's model (gpt2,
random weights; the tiny shape in a --tiny dry run), driven by ``ui.apptest`` as the tests drive
them. Where a page's Run button starts a cheap experiment (``RUNS``) it is pressed and its job
waited for in the measuring process on that device: the Overview's peaks, 8 generated tokens, a
3-context sweep, memory at 3 contexts, the planner capped at 8 MiB, the correctness lab on 12
tokens; Peers, FLOPs, Floor lab and Results are drawn only (their runs take tens of seconds, or
they run none). Runs are saved under OUT/pages (the Results page lists them), and so is the
measuring process's log when it wrote one.

``PAGES`` is the stage (``pages(check)``): failed, naming each page, when a page raised (an
exception element, an uncaught exception), its run failed, or the sidebar chose another device
or model; partial when time ran out before a Run was pressed or waited for (that job stopped);
skipped where streamlit or plotly do not import (``missing``). Its details list each page: what
it ran, how the job ended, seconds, the error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from instruments.spine import ModelSpec

from .runner import Stage

WHEELS = "the wheels requirements-gpu-pages.txt lists, on PYTHONPATH (its header says how)"


def _set(key: str, value: Any) -> Callable[[Any], None]:
    def press(at: Any) -> None:
        widget = at.text_input(key=key) if isinstance(value, str) else at.number_input(key=key)
        widget.set_value(value)
        at.button[0].click().run()
    return press


def _peaks(at: Any) -> None:
    at.button(key="overview_bench").click().run()


def _sweep(at: Any) -> None:
    from ui.apptest import configure_sweep  # noqa: PLC0415 - streamlit only where it imports

    configure_sweep(at, "4, 8, 16", repeats=1)
    at.button[0].click().run()


# page -> (what its run measures, how it is pressed, the job's session key)
RUNS: dict[str, tuple[str, Callable[[Any], None], str]] = {
    "overview": ("the device's peaks (Measure peaks here)", _peaks, "peaks_job"),  # PEAKS_KEY
    "generate": ("8 tokens through the page's two modes", _set("gen_new", 8), "gen_job"),
    "sweep": ("a sweep of contexts 4, 8, 16, one sample, the page's modes", _sweep, "sweep_job"),
    "memory": ("memory at 8, 64 and 128 tokens", _set("mem_points", "8, 64, 128"),
               "memory_job"),
    "planner": ("the planner, allocations capped at 8 MiB", _set("plan_cap", 8), "planner_job"),
    "correctness": ("the correctness lab on 12 new tokens", _set("correct_new", 12),
                    "correct_job"),
}


def missing(args: Any) -> str | None:
    """Why the pages cannot be drawn here (None: they can)."""
    try:
        import plotly.graph_objects  # noqa: F401, PLC0415
        import streamlit.testing.v1  # noqa: F401, PLC0415
    except Exception as exc:  # noqa: BLE001 - a missing dependency of theirs says the same
        return f"streamlit / plotly do not import here ({type(exc).__name__}: {exc}); need {WHEELS}"
    return None


class _BareThread(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "missing ScriptRunContext" not in record.getMessage()


@contextlib.contextmanager
def _environment(folder: str, tiny: bool) -> Iterator[None]:
    """Runs saved under ``folder`` (and the measuring process's log), the test shapes offered
    in a --tiny dry run, Streamlit's warnings about bare threads muted; as before afterwards."""
    saved = {k: os.environ.get(k) for k in ("KVLAB_RESULTS_DIR", "KVLAB_TINY")}
    before = tempfile.tempdir
    os.environ["KVLAB_RESULTS_DIR"] = folder
    os.environ["KVLAB_TINY"] = "1" if tiny else "0"
    tempfile.tempdir = folder
    # AppTest's sessions are driven from this thread: Streamlit says so, five times a page (a
    # filter: Streamlit sets its loggers' levels itself when it reads its config)
    said = logging.getLogger("streamlit.runtime.scriptrunner_utils.script_run_context")
    bare = _BareThread()
    said.addFilter(bare)
    try:
        yield
    finally:
        said.removeFilter(bare)
        tempfile.tempdir = before
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def state_spec(state: dict[str, str]) -> ModelSpec:
    return ModelSpec(state["model"], state["weights"], state["device"], state["dtype"])


def one_page(page: str, state: dict[str, str], end_s: float) -> dict[str, Any]:
    """Draw ``page``, press its Run (if cheap) and wait for the job until ``end_s``."""
    from ui import apptest  # noqa: PLC0415

    row: dict[str, Any] = {"page": page, "ran": None, "job": None, "seconds": None,
                           "error": None}
    t0 = time.monotonic()
    try:
        at = apptest.open_page(page, state)
        choice = at.session_state["choice"]
        if choice.spec() != state_spec(state):
            raise apptest.PageError(f"the sidebar chose {choice.spec().describe()}, not "
                                    f"{state_spec(state).describe()}")
        if page in RUNS:
            what, press, key = RUNS[page]
            row["ran"] = what
            if time.monotonic() >= end_s:
                row["job"] = "not run: the stage's time was spent"
            else:
                press(at)
                apptest.no_traceback(at)
                try:
                    job = apptest.wait_job(at, key, end_s - time.monotonic())
                    row["job"] = job.state
                    if job.state == "failed":
                        raise apptest.PageError(f"its run failed: {job.error}")
                except apptest.JobTimeout:
                    at.session_state[key].request_stop()
                    row["job"] = "stopped: the stage's time was spent"
    except Exception as exc:  # noqa: BLE001 - one page's error is that page's, the next runs
        lines = "".join(traceback.format_exception(exc)).rstrip().splitlines()
        row.update(error=f"{type(exc).__name__}: {exc}", traceback=lines[-8:])
        print(f"  {page}: {row['error']}", flush=True)
    row["seconds"] = round(time.monotonic() - t0, 1)
    print(f"  {page}: {'FAILED' if row['error'] else 'drawn'} in {row['seconds']:.1f} s"
          + (f"; {row['ran']}: {row['job']}" if row["ran"] else ""), flush=True)
    return row


def pages(check: Any) -> None:
    from instruments.process import client  # noqa: PLC0415
    from ui import apptest  # noqa: PLC0415

    end_s = time.monotonic() + check.runner.budget_s
    device = "cuda" if check.cuda else "cpu"
    state = {"model": check.name, "weights": "random", "device": device, "dtype": "float32"}
    folder = check.out / "pages"
    folder.mkdir(parents=True, exist_ok=True)
    with _environment(str(folder), check.args.tiny):
        client.start_probe()  # what a fresh server does, before any page asks
        client.prestart(device)
        found = client.devices()["devices"]
        if device not in found:
            raise RuntimeError(f"the device probe did not offer {device}: {sorted(found)}")
        client.model_info(state_spec(state), timeout_s=max(5.0, end_s - time.monotonic()))
        rows = [one_page(page, state, end_s) for page in apptest.routed_pages()]
    check.runner.details(device=device, model=check.name, pages=rows)
    failed = [f"{r['page']} ({r['error']})" for r in rows if r["error"]]
    if failed:
        raise RuntimeError(f"{len(failed)} page(s) failed: {'; '.join(failed)}")
    short = [r["page"] for r in rows if r["job"] and r["job"] != "done"]
    if short:
        check.runner.partial(f"runs not done: {', '.join(short)} (the pages' details say why)")


PAGES = Stage("pages", pages, fixed_s=60.0, skip=missing,
              what="every dashboard page under AppTest on the device; cheap Runs pressed")
