"""The one job section every measuring page uses: start, queue, progress, Stop, result.

Contract: ``start(key, experiment, params, what)`` (``start_checked``: a params object, checked
first) sends a request for the sidebar's model to
its device's measuring process (``instruments.process.client.submit``: queued behind other sessions'
runs, saved to ``results_dir()`` when it ends) and keeps the ``Job`` in
``st.session_state[key]``. ``section(key, draw, empty=...)`` then shows, while the job runs, an
auto-refreshing fragment -- queue position or progress, time left, Stop -- every
``FIRST_REFRESH_S`` until the job's first row arrives, then every ``REFRESH_S`` with, beside it,
``draw(job)`` (the live chart) every ``LIVE_CHART_S``; once it has ended, how it ended,
``draw(job)`` and the downloads. Each refresh costs the server and the browser CPU beside the
measurement (memory bandwidth and cache are shared even when the cores are not): measured with
``scripts/bench_redraw.py`` on the 2-core machine, 0.2-0.3 s of CPU (server + browser) per
progress refresh, about 0.3 s more per refresh while a chart is on the page, and about 1 s per
chart redraw with new points; once points are being timed the page refreshes slowly enough to
stay under the quiet watch's threshold (others using a quarter of a sample's length: about 17%
of a core here); ``docs/sweep.md`` has the numbers. ``$KVLAB_REFRESH_S`` and
``$KVLAB_LIVE_CHART_S`` override the two periods (a chart period of 0 draws the chart only when
the job has ended).
``rows(job, table)`` is a table of the final run, or the rows streamed so far. The page itself
holds no orchestration and measures nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import streamlit as st

from instruments.process import client
from instruments.process.client import Job
from ui.runs import download_buttons
from ui.state import current_choice, results_dir, session_alive, session_id, shown_path

if TYPE_CHECKING:
    import pandas as pd


def _period_s(name: str, default: float) -> float:
    text = os.environ.get(name, "")
    return float(text) if text.replace(".", "", 1).isdigit() else default


FIRST_REFRESH_S = 1.0  # until the first row: the queue, the gate, the first samples
REFRESH_S = _period_s("KVLAB_REFRESH_S", 5.0)  # then: the progress line, time left and Stop
LIVE_CHART_S = _period_s("KVLAB_LIVE_CHART_S", 30.0)  # and the live chart (0: at the end only)


def start(key: str, experiment: str, params: dict[str, Any], what: str,
          estimate_s: float | None = None) -> Job:
    sid = session_id()
    job = client.submit(experiment, params, current_choice().spec(), owner=(sid or "local")[:6],
                        what=what, results_dir=results_dir(), estimate_s=estimate_s,
                        keep_alive=lambda: session_alive(sid))
    st.session_state[key] = job
    return job


def start_checked(key: str, experiment: str, params: Any, what: str, cfg: Any,
                  device: str) -> Job | None:
    """``start`` for an experiment's params object: its ``check(cfg, device)`` first; a refusal
    is the page's error line and nothing starts."""
    from instruments.experiments import to_dict

    try:
        params.check(cfg, device)
    except ValueError as exc:
        st.error(str(exc))
        return None
    return start(key, experiment, to_dict(params), what)


def get(key: str) -> Job | None:
    job = st.session_state.get(key)
    return job if isinstance(job, Job) else None


def running(key: str) -> bool:
    job = get(key)
    return job is not None and not job.finished


def rows(job: Job, table: str) -> pd.DataFrame:
    """``table`` of the job's run when it has one, else the rows streamed so far."""
    import pandas as pd  # here: the Overview draws a job section and no table (0.5 s saved)

    if job.run is not None:
        return pd.DataFrame((job.run.get("tables") or {}).get(table) or [])
    return pd.DataFrame(list(job.tables.get(table, [])))


def notes(job: Job) -> list[str]:
    meta = (job.run or {}).get("meta") or {}
    return list(meta.get("notes") or ([meta["note"]] if meta.get("note") else []))


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def progress_text(job: Job) -> str:
    if job.state == "queued":
        return job.message
    eta = f" · about {_fmt_s(job.eta_s)} left" if job.eta_s is not None else ""
    where = f" · process {job.pid}" if job.pid else ""
    return (f"{job.done} / {job.total or '?'} {job.unit} · {_fmt_s(job.seconds())} elapsed"
            f"{eta}{where} · {job.message}")


def _panel(key: str, waiting: bool) -> None:
    """Progress and Stop; reruns the page when the job has finished, or (``waiting``) when its
    first row has arrived: the page then draws it and refreshes slower."""
    job = get(key)
    if job is None:
        return
    if job.finished or (waiting and any(job.tables.values())):
        st.rerun()
    left, right = st.columns([5, 1], vertical_alignment="center")
    left.progress(job.fraction(), text=progress_text(job))
    right.button("Stop", key=f"{key}_stop", on_click=job.request_stop, icon=":material/stop:",
                 disabled=job.stop_event.is_set(), width="stretch",
                 help="Stop after the current step (or leave the queue); what was measured is "
                 "kept and saved.")


@st.fragment(run_every=FIRST_REFRESH_S)
def first_panel(key: str) -> None:
    """The panel until the job's first row."""
    _panel(key, waiting=True)


@st.fragment(run_every=REFRESH_S)
def live_panel(key: str) -> None:
    """The panel once rows are coming."""
    _panel(key, waiting=False)


@st.fragment(run_every=LIVE_CHART_S or None)
def live_chart(key: str, draw: Callable[[Job], None]) -> None:
    """The live chart, redrawn every ``LIVE_CHART_S`` (never while running when it is 0)."""
    job = get(key)
    if job is None or job.finished:
        return
    if LIVE_CHART_S:
        draw(job)
    else:
        st.caption("The chart is drawn when the run ends.")


def finished_banner(job: Job) -> None:
    """One line saying how the job ended and where it was saved."""
    if job.state == "failed":
        st.error(f"The run failed: {job.error}")
    elif job.state == "stopped":
        st.warning(f"Stopped after {job.done} of {job.total or '?'} {job.unit}; what was "
                   "measured is kept.")
    where = f" Saved to `{shown_path(job.saved_path)}`." if job.saved_path else ""
    if job.save_error:
        st.error(f"Not saved: {job.save_error} The run stays in this session; download it below.")
    elif job.state == "done":
        st.success(f"Finished {job.done} {job.unit} in {_fmt_s(job.seconds())}.{where}")
    elif where:
        st.caption(f"Partial run.{where}")
    for note in notes(job):
        if note not in (job.error or ""):
            st.warning(note)


def section(key: str, draw: Callable[[Job], None], *, empty: str, table: str | None = None,
            stem: str = "run") -> Job | None:
    """The live panel while the job runs; banner, ``draw`` and downloads once it has ended."""
    job = get(key)
    if job is None:
        st.info(empty)
    elif not any(job.tables.values()) and not job.finished:
        first_panel(key)
    elif not job.finished:
        live_panel(key)
        live_chart(key, draw)
    else:
        finished_banner(job)
        draw(job)
        if table is not None:
            download_buttons(job.run, table, stem, f"{key}_dl")
    return job
