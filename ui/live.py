"""Long work off the script thread: a ``Job`` the page polls, and a Stop that really stops.

Contract: ``start_job(job, work, finish)`` runs ``work(job)`` on a daemon thread while holding the
device (``engine.runner.RUNNER.turn``: one measurement per device across all sessions, others
wait in a visible queue), then always calls ``finish(job)`` (save what was measured, partial or
not). ``work`` reports through ``job.update(...)`` and must pass ``job.should_stop`` to the
engine; it never calls Streamlit. ``job.should_stop()`` turns true when Stop is pressed or when
the browser session that started the job has been gone for ``ORPHAN_GRACE_S`` (a closed tab).

``live_panel(key, draw)`` is an auto-refreshing ``st.fragment``: progress bar with points done
and time left, the Stop button, and ``draw(job)`` (the live chart). When the job ends it reruns
the whole page once so the page draws the final results from ``st.session_state``.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import streamlit as st

from engine.runner import RUNNER, Cancelled, OutOfMemory, oom_guard

ORPHAN_GRACE_S = 10.0
REFRESH_S = 1.0
FINISHED = ("done", "stopped", "failed")


def _session_id() -> str | None:
    try:
        from streamlit.runtime.scriptrunner_utils.script_run_context import get_script_run_ctx

        ctx = get_script_run_ctx(suppress_warning=True)
        return ctx.session_id if ctx is not None else None
    except Exception:  # no runtime (bare mode, tests): never orphaned
        return None


def _session_alive(session_id: str | None) -> bool:
    if session_id is None:
        return True
    try:
        from streamlit.runtime import Runtime

        if not Runtime.exists():
            return True
        return Runtime.instance().is_active_session(session_id)
    except Exception:
        return True


@dataclass
class Job:
    """What a background measurement has done so far; read by the page, written by the worker."""

    kind: str
    what: str  # shown to other sessions waiting in the queue
    device: str
    params: dict[str, Any] = field(default_factory=dict)
    estimate_s: float | None = None
    total: int = 0
    done: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)
    message: str = "waiting for the device"
    elapsed_s: float = 0.0
    eta_s: float | None = None
    state: str = "queued"  # queued | running | done | stopped | failed
    error: str | None = None
    results: dict[str, Any] = field(default_factory=dict)  # e.g. the e2e result, checks
    saved_path: str | None = None
    save_error: str | None = None
    unit: str = "points"  # what `done` and `total` count, for the progress text
    started_s: float | None = None  # time.monotonic() when the device was acquired
    stop_event: threading.Event = field(default_factory=threading.Event)
    session_id: str | None = field(default_factory=_session_id)
    _gone_since: float | None = None
    _checked_at: float = 0.0

    @property
    def finished(self) -> bool:
        return self.state in FINISHED

    @property
    def partial(self) -> bool:
        return self.state != "done"

    def request_stop(self) -> None:
        self.stop_event.set()

    def should_stop(self) -> bool:
        if self.stop_event.is_set():
            return True
        now = time.monotonic()
        if now - self._checked_at >= 1.0:  # a closed tab stops the run after a grace period
            self._checked_at = now
            if _session_alive(self.session_id):
                self._gone_since = None
            elif self._gone_since is None:
                self._gone_since = now
            elif now - self._gone_since > ORPHAN_GRACE_S:
                self.message = "the browser tab went away: stopping"
                self.stop_event.set()
        return self.stop_event.is_set()

    def update(self, done: int | None = None, total: int | None = None,
               row: dict[str, Any] | None = None, elapsed_s: float | None = None,
               eta_s: float | None = None, message: str | None = None) -> None:
        if row is not None:
            self.rows.append(dict(row))
        if done is not None:
            self.done = done
        if total is not None:
            self.total = total
        if elapsed_s is not None:
            self.elapsed_s = elapsed_s
        self.eta_s = eta_s
        if message:
            self.message = message

    def seconds(self) -> float:
        """Wall seconds since the device was acquired (frozen once the job has finished)."""
        if self.finished or self.started_s is None:
            return self.elapsed_s
        return time.monotonic() - self.started_s

    def fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total else 0.0


def _wait_message(job: Job) -> Callable[[int, Any], None]:
    def on_wait(position: int, running: Any) -> None:
        who = running.describe() if running is not None else "another run"
        job.message = f"queued: position {position} for {job.device}; now running: {who}"
    return on_wait


def _worker(job: Job, work: Callable[[Job], None], finish: Callable[[Job], None]) -> None:
    owner = (job.session_id or "local")[:6]
    try:
        with RUNNER.turn(job.device, owner, job.what, job.estimate_s, job.should_stop,
                         _wait_message(job)):
            job.state, job.message = "running", "starting"
            job.started_s = time.monotonic()
            # Out of memory frees the cache and names the sizes that failed; rows kept so far
            # are still saved by `finish`, and the next run starts clean.
            with oom_guard(job.device, str(job.params.get("sizes", job.what))):
                work(job)
        job.state = "stopped" if job.stop_event.is_set() else "done"
    except Cancelled:
        job.state = "stopped"
        job.message = "cancelled before it started"
    except (OutOfMemory, ValueError) as exc:
        job.state, job.error = "failed", str(exc)
    except Exception as exc:  # shown on the page, traceback to the server log
        traceback.print_exc()
        job.state, job.error = "failed", f"{type(exc).__name__}: {exc}"
    if job.started_s is not None:
        job.elapsed_s = max(job.elapsed_s, time.monotonic() - job.started_s)
    try:
        finish(job)
    except Exception as exc:
        job.save_error = str(exc)


def start_job(job: Job, work: Callable[[Job], None], finish: Callable[[Job], None]) -> Job:
    thread = threading.Thread(target=_worker, args=(job, work, finish),
                              name=f"kvlab-{job.kind}", daemon=True)
    thread.start()
    return job


def running_job(key: str) -> Job | None:
    job = st.session_state.get(key)
    return job if isinstance(job, Job) and not job.finished else None


def _fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def progress_text(job: Job) -> str:
    if job.state == "queued":
        return job.message
    eta = f" · about {_fmt_s(job.eta_s)} left" if job.eta_s is not None else ""
    return (f"{job.done} / {job.total or '?'} {job.unit} · {_fmt_s(job.seconds())} elapsed{eta}"
            f" · {job.message}")


@st.fragment(run_every=REFRESH_S)
def live_panel(key: str, draw: Callable[[Job], None]) -> None:
    """Progress, Stop and the live chart; reruns the page once when the job has finished."""
    job = st.session_state.get(key)
    if not isinstance(job, Job):
        return
    if job.finished:
        st.rerun()
    left, right = st.columns([5, 1], vertical_alignment="center")
    left.progress(job.fraction(), text=progress_text(job))
    right.button("Stop", key=f"{key}_stop", on_click=job.request_stop, icon=":material/stop:",
                 disabled=job.stop_event.is_set(), width="stretch",
                 help="Stop after the current point; what was measured is kept and saved.")
    draw(job)


def finished_banner(job: Job) -> None:
    """One line saying how the job ended and where it was saved."""
    if job.state == "failed":
        st.error(f"The run failed: {job.error}")
    elif job.state == "stopped":
        st.warning(f"Stopped after {job.done} of {job.total} {job.unit}; what was measured is "
                   "kept.")
    where = f" Saved to `{job.saved_path}`." if job.saved_path else ""
    if job.save_error:
        st.error(f"Not saved: {job.save_error} The run stays in this session; download it below.")
    elif job.state == "done":
        st.success(f"Finished {job.done} {job.unit} in {_fmt_s(job.seconds())}.{where}")
    elif where:
        st.caption(f"Partial run.{where}")
