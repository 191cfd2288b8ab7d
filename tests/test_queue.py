"""The device queue serialises measurements across sessions, shows positions, and cancels."""

from __future__ import annotations

import threading
import time

from instruments.process.queue import Cancelled, DeviceQueue


def test_two_runs_never_overlap_and_both_finish() -> None:
    runner = DeviceQueue()
    spans: list[tuple[float, float]] = []
    waits: list[int] = []

    def job(name: str) -> None:
        with runner.turn("cpu", owner=name, what="sweep", on_wait=lambda p, r: waits.append(p)):
            start = time.monotonic()
            time.sleep(0.3)
            spans.append((start, time.monotonic()))

    threads = [threading.Thread(target=job, args=(f"s{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(spans) == 3
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert start >= end, "two measurements overlapped"
    assert waits and max(waits) >= 1  # someone saw a queue position


def test_cancel_while_waiting_releases_the_queue() -> None:
    runner = DeviceQueue()
    stop = threading.Event()
    hold = threading.Event()
    errors: list[BaseException] = []

    def holder() -> None:
        with runner.turn("cpu", owner="a"):
            hold.wait(5)

    def waiter() -> None:
        try:
            with runner.turn("cpu", owner="b", should_stop=stop.is_set):
                pass
        except Cancelled as exc:
            errors.append(exc)

    t1 = threading.Thread(target=holder)
    t1.start()
    time.sleep(0.1)
    t2 = threading.Thread(target=waiter)
    t2.start()
    time.sleep(0.2)
    running, waiting = runner.status("cpu")
    assert running is not None and running.owner == "a" and [w.owner for w in waiting] == ["b"]
    stop.set()
    t2.join(5)
    hold.set()
    t1.join(5)
    assert errors and isinstance(errors[0], Cancelled)
    assert runner.status("cpu") == (None, [])
    with runner.turn("cpu"):  # the device is free again
        pass
