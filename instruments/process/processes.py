"""The measuring processes: one ``python -m instruments.process.worker`` per device, and its
messages. Torch-free (the dashboard's server imports it).

``process(device)`` -> the device's ``MeasuringProcess``, started now if none is alive;
``prestart(device)`` starts one ahead, in the background (``likely_device()`` guesses which);
``running_pid(device)``; ``measuring_threads()``, the threads a process computes with;
``exit_reason(code)`` in words. When the server exits each process's input is closed (it then
ends) and an empty log is removed. ``instruments.process.client`` drives them with jobs.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from instruments.process import probe, protocol

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0  # importing torch and CUDA on a cold machine can take a while


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
_PRESTART_FAILED: set[str] = set()
_PRESTART_LOCK = threading.Lock()


def prestart(device: str = "cpu") -> None:
    """Start the device's measuring process in the background unless one is alive or on its
    way: the server's first page then finds torch imported when it asks for a model, instead of
    waiting for the device probe and then for this process, one after the other (on a 2-core
    CPU each imports torch: seconds). A process that fails to start here is not tried ahead
    again (a guessed GPU a CPU-only torch cannot use); the first job that needs it starts it
    and reports why it could not."""
    with _PRESTART_LOCK:  # not the processes' lock: held for seconds while one starts, and
        proc = _PROCESSES.get(device)  # every page run calls this
        if (proc is not None and proc.alive()) or device in _PRESTARTING | _PRESTART_FAILED:
            return
        _PRESTARTING.add(device)

    def start() -> None:
        try:
            process(device)
        except Exception:  # noqa: BLE001 - reported by the job that next needs the process
            _PRESTART_FAILED.add(device)
        finally:
            _PRESTARTING.discard(device)

    threading.Thread(target=start, name=f"kvlab-prestart-{device}", daemon=True).start()


def likely_device() -> str:
    """The device the sidebar will most likely offer first, guessed without torch (the probe
    decides): "cuda" where an NVIDIA driver is loaded and torch was built for a GPU, else
    "cpu"."""
    nvidia = Path("/proc/driver/nvidia/version").exists()
    return "cuda" if nvidia and probe.gpu_build() else "cpu"


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
