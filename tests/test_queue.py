"""The device queue serialises measurements across sessions, shows positions, and cancels."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from instruments.process.queue import Cancelled, DeviceQueue


def _until(what: Callable[[], bool]) -> None:
    end = time.monotonic() + 10  # bounds a hang only
    while not what() and time.monotonic() < end:
        time.sleep(0.01)


def test_two_runs_never_overlap_and_both_finish() -> None:
    """The first run holds the device until the other two are seen queued (no sleep that a busy
    host could outlast); how many hold it at once is counted, not timed."""
    runner = DeviceQueue()
    holding, at_once, waits = [0], [], []
    lock, release = threading.Lock(), threading.Event()

    def job(name: str) -> None:
        with runner.turn("cpu", owner=name, what="sweep", on_wait=lambda p, r: waits.append(p)):
            with lock:
                holding[0] += 1
                at_once.append(holding[0])
            release.wait(10)
            with lock:
                holding[0] -= 1

    threads = [threading.Thread(target=job, args=(f"s{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    _until(lambda: len(set(waits)) >= 2)  # positions 1 and 2 both seen
    assert sorted(set(waits))[-2:] == [1, 2], waits  # the others queued behind the first
    release.set()
    for t in threads:
        t.join(10)
    assert at_once == [1, 1, 1], "two measurements overlapped"


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
    _until(lambda: runner.status("cpu")[0] is not None)  # "a" holds the device
    t2 = threading.Thread(target=waiter)
    t2.start()
    _until(lambda: bool(runner.status("cpu")[1]))  # "b" queued: seen, not slept for
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
