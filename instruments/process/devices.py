"""The device probe, run once per server in a thread of its own: which devices this machine offers.

``start_probe()`` starts it (later calls do nothing); ``devices_now()`` is its answer or None while
it runs, ``machine_now()`` that answer or the placeholder the pages draw from meanwhile (the CPU,
marked "probing"), ``devices()`` waits for it. On a torch built without GPU support the CPU's
measuring process (``instruments.process.processes``, started ahead for the first page) answers
with its greeting; otherwise a short-lived ``python -m instruments.process.probe`` does.
``$KVLAB_PROBE_HOLD_FILE`` holds the probe back until that file exists (at most START_TIMEOUT_S):
tests of the pages drawn while it runs release it once they have seen them, so no host is too
slow to draw them in time. Torch-free; ``instruments.process.client`` passes these names on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from instruments.process import probe
from instruments.process.processes import REPO_ROOT, START_TIMEOUT_S, process


class DeviceProbe:
    """The device probe, run once in a thread of its own (``find`` answers it); ``result()`` is
    None until it has landed, ``wait()`` waits for it."""

    def __init__(self, find: Callable[[], dict[str, Any]] | None = None) -> None:
        self._find = find or _find_devices
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._landed = threading.Event()
        self._result: dict[str, Any] | None = None

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvlab-probe",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            found = self._find()
        except Exception as exc:  # noqa: BLE001 - the CPU is there whatever went wrong
            found = _cpu_only(exc)
        self._result = found
        self._landed.set()

    def result(self) -> dict[str, Any] | None:
        self.start()
        return self._result

    def wait(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        self.start()
        self._landed.wait(timeout_s)
        return self._result


def _cpu_only(exc: BaseException) -> dict[str, Any]:
    return {"torch": None, "error": f"{type(exc).__name__}: {exc}",
            "devices": {"cpu": {"name": probe.cpu_name(), "kind": "cpu", "device": "cpu",
                                "dtypes": list(probe.CPU_DTYPES)}}}


def _find_devices() -> dict[str, Any]:
    """The probe's answer. A torch built without GPU support can drive only the CPU, and the
    CPU's measuring process (started ahead for the first page) already imported torch and said
    what the CPU is: its greeting answers, and no second interpreter imports torch beside it on
    a 2-core machine. Otherwise (or if that process cannot start) a short-lived process asks
    torch."""
    hold = os.environ.get("KVLAB_PROBE_HOLD_FILE", "")
    end = time.monotonic() + START_TIMEOUT_S  # a file never made holds no server for good
    while hold and not os.path.exists(hold) and time.monotonic() < end:
        time.sleep(0.05)
    if not probe.gpu_build():
        try:
            return probe.from_hello(process("cpu").hello)
        except Exception:  # noqa: BLE001, S110 - the short-lived probe below says what is wrong
            pass
    return _probe_process()


def _probe_process() -> dict[str, Any]:
    """``python -m instruments.process.probe`` in a short-lived process."""
    try:
        out = subprocess.run([sys.executable, "-m", "instruments.process.probe"], cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=START_TIMEOUT_S, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return _cpu_only(exc)


_PROBE = DeviceProbe()


def start_probe() -> None:
    """Start the device probe in the background (once per server; later calls do nothing)."""
    _PROBE.start()


def devices_now() -> dict[str, Any] | None:
    """The probe's answer, or None while it runs (it is started if it was not)."""
    return _PROBE.result()


def machine_now() -> dict[str, Any]:
    """The probe's answer, or until it lands what can be said without it (``probe.placeholder``:
    the CPU, marked ``"probing": True``)."""
    return _PROBE.result() or probe.placeholder()


def devices() -> dict[str, Any]:
    """What this machine offers, waiting for the probe: {"torch": version, "devices": {"cpu":
    facts + dtypes, "cuda": ...}} (the server imports no torch)."""
    return _PROBE.wait() or probe.placeholder()
