"""The server's side of the measuring processes: one per device, a queue, and jobs. Torch-free.

``submit(experiment, params, model, owner=..., results_dir=...)`` -> ``Job`` at once; a thread
of the server then waits for the device's turn (``instruments.process.queue.QUEUE``: one measurement
per device across every session, in order, cancellable), starts the device's measuring process
if none is alive (``instruments.process.processes``, whose names this module passes on),
sends the request and files every message it streams back into the job: progress, rows,
tokens, the final run. ``job.request_stop()``
stops it after its current step; ``keep_alive()`` turning false (a closed tab) does the same.
When the job ends its run is saved -- the final one, or, if the process failed or died, one
built from the rows it streamed, marked partial -- and a dead process is replaced by a fresh one
on the next request (``prestart(device)`` starts one ahead, in the background).
``model_info(spec)`` loads a model in its process (when the device is free) and says what was
loaded: weights label, fallback, shapes; ``load_soon(spec)`` starts that load without waiting
(``loading(spec)``, ``load_error(spec)`` say how it goes), and ``model_info`` waits for a load
already on its way rather than returning None.
``start_probe()``, ``devices_now()``, ``machine_now()`` and ``devices()``: which devices this
machine offers, asked once in a thread of its own (``instruments.process.devices``).
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from instruments import experiments
from instruments.process.devices import (  # noqa: F401 - passed on to the pages
    devices,
    devices_now,
    machine_now,
    start_probe,
)
from instruments.process.processes import (  # noqa: F401 - the server's one door to them
    REPO_ROOT,
    START_TIMEOUT_S,
    MeasuringProcess,
    exit_reason,
    likely_device,
    measuring_threads,
    prestart,
    process,
    running_pid,
)
from instruments.process.queue import QUEUE, Cancelled
from instruments.spine import Event, ModelSpec, partial_record
from instruments.store import results

ORPHAN_GRACE_S = 10.0


# ----------------------------------------------------------------------------------- jobs
_IDS = itertools.count(1)


@dataclass
class Job:
    """What one request has done so far: written by its thread, read by pages."""

    experiment: str  # a name of instruments.experiments, or "load"
    params: dict[str, Any]
    model: ModelSpec
    owner: str = "?"
    what: str = ""  # shown to other sessions waiting in the queue
    results_dir: Path | None = None  # None: the run is not saved
    keep_alive: Callable[[], bool] = lambda: True
    id: str = field(default_factory=lambda: f"{os.getpid()}-{next(_IDS)}")
    state: str = "queued"  # queued | running | done | stopped | failed
    message: str = "waiting for the device"
    done: int = 0
    total: int = 0
    unit: str = "points"
    eta_s: float | None = None
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # streamed rows
    kind: str | None = None
    meta: dict[str, Any] | None = None
    info: dict[str, Any] | None = None  # the loaded model: weights label, fallback, shapes
    run: dict[str, Any] | None = None  # the final run (or the partial one that was saved)
    error: str | None = None
    saved_path: str | None = None
    save_error: str | None = None
    pid: int | None = None
    started_s: float | None = None
    ended_s: float | None = None
    stop_event: threading.Event = field(default_factory=threading.Event)
    _gone_since: float | None = None

    @property
    def finished(self) -> bool:
        """Ended and saved: the state is final and ``saved_path`` / ``save_error`` are set."""
        return self.ended_s is not None

    @property
    def partial(self) -> bool:
        return self.state != "done"

    def request_stop(self) -> None:
        self.stop_event.set()

    def should_stop(self) -> bool:
        """Stop pressed, or the session that started the job gone for ORPHAN_GRACE_S."""
        if not self.stop_event.is_set() and not self.keep_alive():
            now = time.monotonic()
            self._gone_since = self._gone_since or now
            if now - self._gone_since > ORPHAN_GRACE_S:
                self.message = "the browser tab went away: stopping"
                self.stop_event.set()
        elif self._gone_since is not None:
            self._gone_since = None
        return self.stop_event.is_set()

    def seconds(self) -> float:
        if self.started_s is None:
            return 0.0
        return (self.ended_s or time.monotonic()) - self.started_s

    def fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total else 0.0

    def add(self, event: Event) -> None:
        self.done, self.total, self.unit = event.done, event.total, event.unit
        self.eta_s = event.eta_s
        if event.message:
            self.message = event.message
        if event.table is not None and event.row is not None:
            self.tables.setdefault(event.table, []).append(event.row)


def submit(experiment: str, params: dict[str, Any], model: ModelSpec, *, owner: str = "?",
           what: str = "", results_dir: Path | None = None,
           keep_alive: Callable[[], bool] = lambda: True,
           estimate_s: float | None = None) -> Job:
    """Queue a request; its thread runs it on the device's measuring process (see the top)."""
    if experiment != "load":
        experiments.get(experiment)  # unknown names fail here, in the caller
    job = Job(experiment, dict(params), model, owner, what or experiment, results_dir,
              keep_alive)
    threading.Thread(target=_drive, args=(job, estimate_s), name=f"kvlab-job-{job.id}",
                     daemon=True).start()
    return job


def _wait_message(job: Job) -> Callable[[int, Any], None]:
    def on_wait(position: int, running: Any) -> None:
        who = running.describe() if running is not None else "another run"
        job.message = f"queued: position {position} for {job.model.device}; now running: {who}"
    return on_wait


def _drive(job: Job, estimate_s: float | None) -> None:
    device = job.model.device
    try:
        with QUEUE.turn(device, job.owner, job.what, estimate_s, job.should_stop,
                        _wait_message(job)):
            job.state, job.message = "running", "starting the measuring process"
            job.started_s = time.monotonic()
            _converse(job, process(device))
    except Cancelled:
        job.state, job.message = "stopped", "cancelled before it started"
    except Exception as exc:  # the process could not start, or the pipe broke
        job.state, job.error = "failed", f"{type(exc).__name__}: {exc}"
    ended = time.monotonic()
    _save(job)
    job.ended_s = ended  # last: a job is finished once its run is saved


def _converse(job: Job, proc: MeasuringProcess) -> None:
    job.pid = proc.pid
    request: dict[str, Any] = {"type": "load" if job.experiment == "load" else "run",
                               "id": job.id, "model": job.model.to_dict()}
    if job.experiment != "load":
        request.update(experiment=job.experiment, params=job.params)
    proc.send(request)
    job.message = f"loading {job.model.describe()} in the measuring process"
    stop_sent = False
    while True:
        if not stop_sent and job.should_stop():
            proc.send({"type": "stop", "id": job.id})
            stop_sent, job.message = True, "stopping after the current step"
        try:
            msg = proc.messages.get(timeout=0.2)
        except queue.Empty:
            continue
        kind = msg["type"]
        if kind == "exit":
            job.state = "failed"
            job.error = (f"The measuring process died ({exit_reason(msg.get('code'))}). What it "
                         f"had measured is kept; the next run starts a fresh process. "
                         f"{proc.log_tail()}").strip()
            return
        if msg.get("id") != job.id:
            continue  # a late message of an earlier request
        if kind == "loaded":
            job.info = msg["info"]
            _INFO[job.model] = msg["info"]
            job.message = "loaded; starting"
        elif kind == "start":
            job.kind, job.meta = msg["kind"], msg["meta"]
        elif kind == "event":
            fields = {k: v for k, v in msg.items() if k not in ("type", "id")}
            job.add(Event(**fields))
        elif kind in ("result", "done"):
            job.run = msg.get("run")
            partial = bool(job.run and job.run["meta"].get("partial"))
            job.state = "stopped" if partial or stop_sent else "done"
            return
        elif kind == "error":
            job.state, job.error = "failed", msg["message"]
            return


def _save(job: Job) -> None:
    """The final run, or what was streamed (marked partial): saved when the job has a folder.

    A run stopped before it measured anything is kept in the job but not written."""
    if job.run is None and job.meta is not None and job.kind is not None and job.tables:
        job.run = partial_record(job.kind, job.meta, job.tables,
                                 job.error or "stopped before the end")
    if job.run is None or job.results_dir is None:
        return
    if job.run["meta"].get("partial") and not job.tables:
        return
    try:
        job.saved_path = str(results.save_run(job.run, job.results_dir))
    except results.ResultsError as exc:
        job.save_error = str(exc)


# ------------------------------------------------------------------------------- model facts
_INFO: dict[ModelSpec, dict[str, Any]] = {}


def known_info(spec: ModelSpec) -> dict[str, Any] | None:
    """What loading ``spec`` gave last time, if it was loaded in this server's lifetime."""
    return _INFO.get(spec)


def model_info(spec: ModelSpec, timeout_s: float = 300.0) -> dict[str, Any] | None:
    """Load ``spec`` in its device's process and say what was loaded; None if the device is
    busy (nothing is queued behind a measurement) or it failed (``ValueError`` with why). A load
    of ``spec`` already on its way (``load_soon``) is waited for, not asked again."""
    if spec in _INFO:
        return _INFO[spec]
    with _LOADS_LOCK:
        job = _LOADS.get(spec)
        if job is None or job.finished:
            if measuring(spec.device):
                return None
            job = _LOADS[spec] = _load(spec)
    end = time.monotonic() + timeout_s
    while not job.finished and time.monotonic() < end:
        time.sleep(0.05)
    if job.state == "failed":
        raise ValueError(job.error or "the model could not be loaded")
    return job.info


_LOADS: dict[ModelSpec, Job] = {}  # the newest load job of each spec
_LOADS_LOCK = threading.Lock()
LOADER = "sidebar"  # the owner of the load jobs pages ask for


def _load(spec: ModelSpec) -> Job:
    return submit("load", {}, spec, owner=LOADER, what=f"loading {spec.name}")


def measuring(device: str) -> bool:
    """Whether a measurement holds ``device`` or waits for it (a load of a model does not
    count: a page may queue behind it, it takes seconds at most). Pages poll for the probe or a
    load only while this is false: a measurement's own panel reruns the page soon enough, and
    a rerun costs the measurement CPU time."""
    running, waiting = QUEUE.status(device)
    return any(t.owner != LOADER for t in [*([running] if running else []), *waiting])


def load_soon(spec: ModelSpec) -> None:
    """Start loading ``spec`` in its device's process and return at once, unless it is loaded,
    on its way, failed last time (``load_error``), or the device is busy (a page asks again on
    its next run). A page that can draw from the preset's shapes calls this instead of waiting:
    the model loads while it draws."""
    if spec in _INFO:
        return
    with _LOADS_LOCK:
        if spec in _LOADS:
            return  # on its way, done, or failed: model_info asks again when a page waits
        if not measuring(spec.device):
            _LOADS[spec] = _load(spec)


def loading(spec: ModelSpec) -> bool:
    """Whether a load of ``spec`` is on its way."""
    job = _LOADS.get(spec)
    return job is not None and not job.finished


def load_error(spec: ModelSpec) -> str | None:
    """Why the newest load of ``spec`` failed (None: it did not, or none has ended)."""
    job = _LOADS.get(spec)
    if job is None or not job.finished or job.state != "failed" or spec in _INFO:
        return None
    return job.error or "the model could not be loaded"
