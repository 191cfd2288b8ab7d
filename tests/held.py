"""A measuring process held where a test wants it, so its verdicts count what happened rather
than race how fast this host measures: ``frozen_at(rows, monkeypatch)`` stops the process
(SIGSTOP) the moment its ``rows``-th latency row reaches the client and lets it go (SIGCONT) on
leaving; ``until(what, why)`` waits for a condition, its time limit bounding a hang only."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from instruments.process import client


@dataclass
class Held:
    """The frozen process's pid once frozen, and the types of the requests sent to it since."""
    pids: list[int] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)


@contextlib.contextmanager
def frozen_at(rows: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[Held]:
    """What the test does meanwhile lands while the process can measure nothing more; ``sent``
    says when a request (a "stop") has gone into its input."""
    held = Held()
    real_add, real_send = client.Job.add, client.MeasuringProcess.send

    def add(self: client.Job, event: object) -> None:
        real_add(self, event)  # type: ignore[arg-type]
        if not held.pids and len(self.tables.get("latency", [])) >= rows and self.pid:
            os.kill(self.pid, signal.SIGSTOP)
            held.pids.append(self.pid)

    def send(self: client.MeasuringProcess, message: dict[str, Any]) -> None:
        real_send(self, message)
        held.sent.append(str(message.get("type")))

    monkeypatch.setattr(client.Job, "add", add)
    monkeypatch.setattr(client.MeasuringProcess, "send", send)
    try:
        yield held
    finally:
        for pid in held.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def until(what: Callable[[], bool], why: str, timeout_s: float = 120.0) -> None:
    """Wait for ``what``; ``timeout_s`` only bounds a hang (what is judged is ``what``)."""
    end = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < end, f"still waiting: {why}"
        time.sleep(0.01)
