"""The server's side of the measuring processes: one per device, a queue, and jobs. Torch-free.

``submit(experiment, params, model, owner=..., results_dir=...)`` -> ``Job`` at once; a thread
of the server then waits for the device's turn (``instruments.process.queue.QUEUE``: one measurement
per device across every session, in order, cancellable), starts the device's measuring process
if none is alive (``python -m instruments.process.worker``), sends the request and files every
message it streams back into the job: progress, rows, tokens, the final run. ``job.request_stop()``
stops it after its current step; ``keep_alive()`` turning false (a closed tab) does the same.
When the job ends its run is saved -- the final one, or, if the process failed or died, one
built from the rows it streamed, marked partial -- and a dead process is replaced by a fresh one
on the next request (``prestart(device)`` starts one ahead, in the background).
``model_info(spec)`` loads a model in its process (when the device is free) and says what was
loaded: weights label, fallback, shapes.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from instruments import experiments
from instruments.process import protocol
from instruments.process.queue import QUEUE, Cancelled
from instruments.spine import Event, ModelSpec, partial_record
from instruments.store import results

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0  # importing torch and CUDA on a cold machine can take a while
ORPHAN_GRACE_S = 10.0


# ------------------------------------------------------------------------ measuring processes
class MeasuringProcess:
    """One ``instruments.process.worker`` subprocess and the thread that reads its messages."""

    def __init__(self, device: str) -> None:
        self.device = device
        fd, self.log_path = tempfile.mkstemp(prefix=f"kvlab-worker-{device.replace(':', '')}-",
                                             suffix=".log")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "instruments.process.worker", "--device", device,
                 "--threads", str(measuring_threads())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=REPO_ROOT,
                env=env, text=True, encoding="utf-8", bufsize=1)
        self.messages: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, name=f"kvlab-read-{device}", daemon=True).start()
        self.hello = self._wait_hello()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = protocol.decode(line)
            if msg is not None:
                self.messages.put(msg)
        self.messages.put({"type": "exit", "code": self.proc.wait()})
        self.drop_empty_log()

    def drop_empty_log(self) -> None:
        """Remove the process's log once it has ended with nothing in it (most do): a server
        that runs for months should not leave a file in the temp folder per process."""
        with contextlib.suppress(OSError):
            if os.path.getsize(self.log_path) == 0:
                os.unlink(self.log_path)

    def _wait_hello(self) -> dict[str, Any]:
        end = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < end:
            try:
                msg = self.messages.get(timeout=0.5)
            except queue.Empty:
                continue
            if msg["type"] == "hello":
                return msg
            if msg["type"] == "exit":
                raise RuntimeError(f"the measuring process for {self.device} could not start "
                                   f"({exit_reason(msg['code'])}). {self.log_tail()}")
        self.kill()
        raise RuntimeError(f"the measuring process for {self.device} did not start within "
                           f"{START_TIMEOUT_S:.0f} s. {self.log_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(protocol.encode(message))
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log_tail(self, lines: int = 6) -> str:
        try:
            text = Path(self.log_path).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        kept = [ln for ln in text.strip().splitlines() if not ln.startswith("USDT:")]
        return ("Its last output: " + " | ".join(kept[-lines:])) if kept else ""


def measuring_threads() -> int:
    """Threads a measuring process computes with: every core but one, which is left to this
    server and the browser (a step whose two threads share two cores with a busy page is as
    slow as its slower thread: measured here, 10x on the tiny shape). ``$KVLAB_THREADS``
    overrides it (say, all cores when the browser runs on another machine)."""
    env = os.environ.get("KVLAB_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


_PROCESSES: dict[str, MeasuringProcess] = {}
_PROCESSES_LOCK = threading.Lock()


def process(device: str) -> MeasuringProcess:
    """The device's measuring process, started now if none is alive."""
    with _PROCESSES_LOCK:
        proc = _PROCESSES.get(device)
        if proc is None or not proc.alive():
            proc = _PROCESSES[device] = MeasuringProcess(device)
        return proc


_PRESTARTING: set[str] = set()


def prestart(device: str = "cpu") -> None:
    """Start the device's measuring process in the background unless one is alive or on its
    way: the server's first page then finds torch imported when it asks for a model, instead of
    waiting for the device probe and then for this process, one after the other (on a 2-core
    CPU each imports torch: seconds). A process that fails to start here is started again, and
    its failure reported, by the first job that needs it."""
    with _PROCESSES_LOCK:
        proc = _PROCESSES.get(device)
        if (proc is not None and proc.alive()) or device in _PRESTARTING:
            return
        _PRESTARTING.add(device)

    def start() -> None:
        try:
            process(device)
        except Exception:  # noqa: BLE001 - reported by the job that next needs the process
            pass
        finally:
            _PRESTARTING.discard(device)

    threading.Thread(target=start, name=f"kvlab-prestart-{device}", daemon=True).start()


def likely_device() -> str:
    """The device the sidebar will most likely offer first, guessed without torch (the probe
    decides): "cuda" where an NVIDIA driver is loaded, else "cpu"."""
    return "cuda" if Path("/proc/driver/nvidia/version").exists() else "cpu"


@atexit.register
def _end_processes() -> None:
    """When the server exits: close each process's input (it then ends, as on a closed pipe),
    wait a moment, and drop the logs left empty."""
    for proc in list(_PROCESSES.values()):
        with contextlib.suppress(OSError, ValueError):
            if proc.proc.stdin is not None:
                proc.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.proc.wait(timeout=2)
        proc.drop_empty_log()


def running_pid(device: str) -> int | None:
    proc = _PROCESSES.get(device)
    return proc.pid if proc is not None and proc.alive() else None


def exit_reason(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " -- killed, perhaps by the system running out of memory" if name == "SIGKILL" \
            else ""
        return f"ended by {name}{hint}"
    return f"exit code {code}"


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
    busy (nothing is queued behind a measurement) or it failed (``ValueError`` with why)."""
    if spec in _INFO:
        return _INFO[spec]
    running, waiting = QUEUE.status(spec.device)
    if running is not None or waiting:
        return None
    job = submit("load", {}, spec, owner="sidebar", what=f"loading {spec.name}")
    end = time.monotonic() + timeout_s
    while not job.finished and time.monotonic() < end:
        time.sleep(0.05)
    if job.state == "failed":
        raise ValueError(job.error or "the model could not be loaded")
    return job.info


# ---------------------------------------------------------------------------------- devices
@functools.lru_cache(maxsize=1)
def devices() -> dict[str, Any]:
    """What this machine offers, asked once of a short-lived process (the server imports no
    torch): {"torch": version, "devices": {"cpu": facts + dtypes, "cuda": ...}}."""
    try:
        out = subprocess.run([sys.executable, "-m", "instruments.process.probe"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=START_TIMEOUT_S, check=True)
        found = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return {"torch": None, "error": f"{type(exc).__name__}: {exc}",
                "devices": {"cpu": {"name": "CPU", "kind": "cpu", "dtypes": ["float32"]}}}
    return found
