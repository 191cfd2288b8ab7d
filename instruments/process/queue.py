"""One measurement at a time per device, across every browser session of the server.

``QUEUE.turn(device, owner, what, estimate_s, should_stop, on_wait)`` is a context manager:
it queues the caller (first come, first served), calls ``on_wait(position, running)`` while
it waits, raises ``Cancelled`` if ``should_stop()`` turns true before its turn, and holds the
device until the block ends -- so two runs never share a measuring process. Torch-free.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


class Cancelled(Exception):
    """The caller asked to stop while waiting for the device."""


@dataclass
class Ticket:
    id: int
    device: str
    owner: str  # a short session label, shown to the others waiting
    what: str  # e.g. "latency sweep, gpt2, 16 contexts"
    estimate_s: float | None
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None

    def describe(self) -> str:
        eta = f", about {self.estimate_s:.0f} s" if self.estimate_s else ""
        return f"{self.what} (session {self.owner}{eta})"


class DeviceQueue:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queues: dict[str, list[Ticket]] = {}
        self._running: dict[str, Ticket | None] = {}
        self._ids = itertools.count(1)

    def status(self, device: str) -> tuple[Ticket | None, list[Ticket]]:
        with self._cond:
            return self._running.get(device), list(self._queues.get(device, []))

    @contextlib.contextmanager
    def turn(
        self,
        device: str,
        owner: str = "?",
        what: str = "measurement",
        estimate_s: float | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_wait: Callable[[int, Ticket | None], None] | None = None,
        poll_s: float = 0.2,
    ) -> Iterator[Ticket]:
        ticket = Ticket(next(self._ids), device, owner, what, estimate_s)
        with self._cond:
            queue = self._queues.setdefault(device, [])
            queue.append(ticket)
            try:
                while self._running.get(device) is not None or queue[0] is not ticket:
                    if should_stop is not None and should_stop():
                        raise Cancelled(f"cancelled while waiting for {device}")
                    if on_wait is not None:
                        position = queue.index(ticket) + (self._running.get(device) is not None)
                        running = self._running.get(device)
                        self._cond.release()  # never call user code holding the lock
                        try:
                            on_wait(position, running)
                        finally:
                            self._cond.acquire()
                    self._cond.wait(timeout=poll_s)
            except BaseException:
                queue.remove(ticket)
                self._cond.notify_all()
                raise
            queue.remove(ticket)
            self._running[device] = ticket
            ticket.started_at = time.monotonic()
        try:
            yield ticket
        finally:
            with self._cond:
                self._running[device] = None
                self._cond.notify_all()


QUEUE = DeviceQueue()  # one per server process: Streamlit sessions are threads of it
