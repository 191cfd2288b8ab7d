#!/usr/bin/env python
"""How scripts/gpu_check.py runs its stages: each one isolated, bounded in time, and written
down in summary.json after every one (scripts/gpu_check.sh runs it alone only to close the
summary of a check it had to kill: ``device_check/runner.py --close OUT WHY``).

  ``Stage(name, run, share=, fixed_s=, skip=, what=)``  one row of the stages table: ``run(check)``
        measures; its time is ``fixed_s`` (capped by what is left) or ``share`` of what the
        fixed stages still to come leave; ``skip(args)`` says why it cannot run here (None: it
        can), decided before any time is handed out
  ``Runner(stages, out, total_s, started_s, facts)``  ``.run(check, selected) -> exit status``
        (``check`` is what each stage is handed: its ``args`` go to ``skip``, its
        ``after_stage()`` runs after each stage); ``.should_stop()`` (the running stage's
        budget is spent), ``.budget_s``, ``.saved(path, partial=why)``, ``.partial(why)`` and
        ``.details(**facts)`` for the stage that runs
  ``StageSkipped(why)``  raised by a stage that finds it cannot run (status skipped)
  ``close(out, why)``  a summary left "running" by a killed check: that stage failed, the rest
        skipped, the last line printed

Isolation: a stage that raises is recorded -- status failed, the error's type, message and the
traceback's last lines, the run files it saved (partial ones included) -- and the next stage
runs. Time: ``should_stop`` turns true at the stage's budget (experiments stop after the current
point and keep what they measured, marked partial). A watchdog thread lets a stage run past its
budget by ``max(GRACE_S, budget)`` (a compile that started late finishes); then it writes every
thread's traceback (faulthandler) to ``OUT/<stage>.hang.txt`` and the log, and raises
``StageOverrun`` in the main thread (a signal: it lands as soon as Python code runs again, and
no ``except Exception`` swallows it). A stage still stuck ``KILL_AFTER_S`` later is inside C
code: the watchdog writes the summary (that stage failed, the rest skipped), prints the last
line and ends the process with status 1.
summary.json (and, when the check ends, the same as a run file of kind "device_check":
``instruments.store.device_checks``): the facts (device, versions, git revision, command,
platform), then per stage its status
(pending, running, then ok / partial / failed / skipped), budget, seconds, run files (relative
to OUT), why (skipped or partial), error and details, and the check's total seconds. The exit
status is 1 when a stage failed, else 0; the last line printed is ``failed stages: a, b`` (or
``failed stages: none (...)``).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GRACE_S = 30.0  # past its budget a stage may run at least this long before the watchdog acts
KILL_AFTER_S = 15.0  # after StageOverrun was raised: still stuck means stuck inside C code
TRACEBACK_LINES = 12  # of a failed stage's traceback, kept in summary.json (the log has all)
DONE = ("ok", "partial", "failed", "skipped")


class StageSkipped(Exception):
    """A stage that cannot run here says why (status skipped, not failed)."""


class StageOverrun(BaseException):
    """Raised in the main thread when a stage runs far past its budget. A BaseException, like
    KeyboardInterrupt: the ``except Exception`` of a gate or a peer must not swallow it."""


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[Any], None]
    share: float = 0.0  # of the time the later fixed stages leave
    fixed_s: float | None = None  # its own seconds instead (capped by what is left)
    skip: Callable[[Any], str | None] | None = None
    what: str = ""  # one line for --list-stages


class Runner:
    """Runs the selected stages in the table's order (see the module docstring)."""

    def __init__(self, stages: list[Stage], out: Path, total_s: float, started_s: float,
                 facts: dict[str, Any]) -> None:
        self.stages, self.out, self.started_s = stages, out, started_s
        self.end_s = started_s + total_s
        self.summary: dict[str, Any] = {**facts, "budget_s": total_s, "finished": False,
                                        "stages": []}
        self._lock = threading.RLock()  # the main thread and the watchdog both write
        self._record: dict[str, Any] | None = None  # the running stage's
        self._stage_t0 = self._stage_end_s = self._hard_s = float("inf")
        self._interrupted = False  # the watchdog asked for StageOverrun
        self._in_stage = False  # the main thread is inside a stage's run (it may be raised)
        self._can_interrupt = False  # SIGUSR1 is ours (the stages run in the main thread)
        self._ended = threading.Event()  # the watchdog's end
        self.budget_s = 0.0

    # ------------------------------------------------------------------ for the running stage
    def should_stop(self) -> bool:
        return time.monotonic() > self._stage_end_s

    def saved(self, path: Path, partial: str | None = None) -> None:
        """A run file the stage wrote; ``partial``: why it is partial (its note)."""
        rec = self._record
        if rec is not None:
            rec["runs"].append(os.path.relpath(path, self.out))
            if partial is not None:
                rec["partial_runs"].append(os.path.relpath(path, self.out))
                rec["why"] = rec["why"] or partial

    def partial(self, why: str) -> None:
        if self._record is not None:
            self._record["why"] = why

    def details(self, **facts: Any) -> None:
        if self._record is not None:
            self._record["details"].update(facts)

    # --------------------------------------------------------------------------------- running
    def _budget(self, stage: Stage, todo: list[Stage]) -> float:
        left = max(0.0, self.end_s - time.monotonic())
        if stage.fixed_s is not None:
            return min(stage.fixed_s, left)
        rest = todo[todo.index(stage) + 1:]
        fixed = sum(s.fixed_s or 0.0 for s in rest)
        shares = stage.share + sum(s.share for s in rest if s.fixed_s is None)
        return max(0.0, left - fixed) * stage.share / shares if shares else 0.0

    def run(self, check: Any, selected: list[str]) -> int:
        records = {s.name: {"name": s.name, "status": "pending", "budget_s": None,
                            "seconds": None, "runs": [], "partial_runs": [], "why": None,
                            "error": None, "details": {}} for s in self.stages}
        self.summary["stages"] = list(records.values())
        todo = []
        for s in self.stages:
            why = ("not selected (--stages)" if s.name not in selected
                   else s.skip(check.args) if s.skip else None)
            if why:
                records[s.name].update(status="skipped", why=why, seconds=0.0)
            else:
                todo.append(s)
        self.write()
        watchdog = threading.Thread(target=self._watch, name="gpu-check-watchdog", daemon=True)
        handler = _install(self._overrun)
        self._can_interrupt = handler is not None
        watchdog.start()
        try:
            for stage in todo:
                if not self._one(stage, records[stage.name], todo, check):
                    break  # interrupted (Ctrl-C): what is left is skipped
        finally:
            self._ended.set()
            _restore(handler)
            self._stage_end_s = self._hard_s = float("inf")
        return self.finish()

    def _one(self, stage: Stage, rec: dict[str, Any], todo: list[Stage], check: Any) -> bool:
        self.budget_s = self._budget(stage, todo)
        t0 = self._stage_t0 = time.monotonic()
        with self._lock:
            self._interrupted = False
            self._record = rec
            rec.update(status="running", budget_s=round(self.budget_s, 1))
            self._stage_end_s = t0 + self.budget_s
            self._hard_s = self._stage_end_s + max(GRACE_S, self.budget_s)
            self.write()
        print(f"\n== {stage.name}: up to {self.budget_s:.0f} s", flush=True)
        going_on = True
        try:
            self._in_stage = True
            try:
                stage.run(check)
            finally:  # from here on no StageOverrun is raised (one that lands first is caught)
                self._in_stage = False
            rec["status"] = "partial" if rec["partial_runs"] or rec["why"] else "ok"
        except StageSkipped as exc:
            rec.update(status="skipped", why=str(exc))
        except (Exception, StageOverrun, KeyboardInterrupt) as exc:
            rec.update(status="failed", error=error_of(exc))
            traceback.print_exception(exc)
            going_on = not isinstance(exc, KeyboardInterrupt)
        try:
            check.after_stage()  # what a failed stage held (its frames, GPU memory) is let go
        except Exception as exc:  # noqa: BLE001 - a broken device: the next stage says so
            print(f"  after {stage.name}: {type(exc).__name__}: {exc}", flush=True)
        with self._lock:
            self._stage_end_s = self._hard_s = float("inf")
            self._record = None
            rec["seconds"] = round(time.monotonic() - t0, 1)
            self.write()
        print(f"  {stage.name}: {rec['status']} in {rec['seconds']:.1f} s"
              + (f" ({rec['why']})" if rec["why"] else ""), flush=True)
        return going_on

    def finish(self, why_rest: str = "not run: the check was interrupted") -> int:
        """Mark what did not run, write the summary, print the last line; the exit status."""
        with self._lock:
            for rec in self.summary["stages"]:
                if rec["status"] not in DONE:
                    rec.update(status="skipped", why=why_rest, seconds=rec["seconds"] or 0.0)
            self.summary["finished"] = True
            self.write()
            save_check_run(self.out, self.summary)
            return last_line(self.summary)

    def write(self) -> None:
        with self._lock:
            self.summary["total_s"] = round(time.monotonic() - self.started_s, 1)
            self.summary["failed"] = [r["name"] for r in self.summary["stages"]
                                      if r["status"] == "failed"]
            write_json(self.out / "summary.json", self.summary)

    # -------------------------------------------------------------------------------- watchdog
    def _watch(self) -> None:
        while not self._ended.wait(0.5):
            with self._lock:
                rec, hard = self._record, self._hard_s
            if rec is None or time.monotonic() < hard:
                continue
            name = rec["name"]
            dump = self.out / f"{name}.hang.txt"
            print(f"\n!! {name} ran {time.monotonic() - self._stage_end_s:.0f} s past its "
                  f"budget; every thread's traceback ({dump.name}):", flush=True)
            try:
                with open(dump, "w", encoding="utf-8") as fh:  # faulthandler writes to a file
                    faulthandler.dump_traceback(fh, all_threads=True)
                print(dump.read_text(encoding="utf-8"), flush=True)
            except OSError:  # a full disk: the log has them at least
                faulthandler.dump_traceback(sys.stdout, all_threads=True)
            if self._can_interrupt:
                self._interrupted = True
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)
            end = time.monotonic() + KILL_AFTER_S
            while self._record is rec and time.monotonic() < end:
                time.sleep(0.2)
            with self._lock:
                if self._record is not rec:
                    continue  # it came back: the next stage runs
                rec.update(status="failed", seconds=round(time.monotonic() - self._stage_t0, 1),
                           error={"type": "StageHung", "message": (
                               f"still running {KILL_AFTER_S:.0f} s after StageOverrun was "
                               f"raised (inside C code?); tracebacks in {dump.name}"),
                               "traceback": []})
                status = self.finish(f"not run: {name} hung and the check ended there")
            os._exit(status)

    def _overrun(self, signum: int, frame: Any) -> None:
        if self._interrupted and self._in_stage:  # else it came back already: nothing to do
            self._interrupted = False
            raise StageOverrun(f"{self._record['name']} ran past its budget of "
                               f"{self.budget_s:.0f} s by more than "
                               f"{max(GRACE_S, self.budget_s):.0f} s and was interrupted")


def _install(handler: Callable[[int, Any], None]) -> Any:
    """SIGUSR1 -> ``handler`` while the stages run (only the main thread may set one)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGUSR1, handler)


def _restore(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGUSR1, previous)


def error_of(exc: BaseException) -> dict[str, Any]:
    lines = "".join(traceback.format_exception(exc)).rstrip().splitlines()
    return {"type": type(exc).__name__, "message": str(exc),
            "traceback": lines[-TRACEBACK_LINES:]}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically: a check killed mid-write still leaves the previous summary."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def last_line(summary: dict[str, Any]) -> int:
    """Print the line that ends the check; its exit status (1 when a stage failed)."""
    by: dict[str, list[str]] = {}
    for rec in summary["stages"]:
        by.setdefault(rec["status"], []).append(rec["name"])
    failed = by.get("failed", [])
    rest = ", ".join(f"{len(by[s])} {s}" for s in ("ok", "partial", "skipped") if by.get(s))
    print(f"\ngpu_check: {summary.get('total_s', 0):.0f} s; summary.json in "
          f"{summary.get('out', '.')}", flush=True)
    print(f"failed stages: {', '.join(failed) if failed else f'none ({rest})'}", flush=True)
    return 1 if failed else 0


def close(out: Path, why: str) -> int:
    """A summary a killed check left behind: the running stage failed with ``why``, the
    pending ones skipped; the last line printed, the exit status returned."""
    path = out / "summary.json"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        print(f"failed stages: unknown (no readable {path}: {exc})", flush=True)
        return 1
    for rec in summary["stages"]:
        if rec["status"] == "running":
            rec.update(status="failed", error={"type": "Killed", "message": why,
                                               "traceback": []})
        elif rec["status"] not in DONE:
            rec.update(status="skipped", why=f"not run: {why}", seconds=0.0)
    summary["failed"] = [r["name"] for r in summary["stages"] if r["status"] == "failed"]
    summary["finished"] = True
    write_json(path, summary)
    save_check_run(out, summary)
    return last_line(summary)


def save_check_run(out: Path, summary: dict[str, Any]) -> None:
    """The summary as a run file too (kind "device_check"), so the docs can read the check
    with its runs; a failure to write it is said, never raised (summary.json is written)."""
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:  # run alone as scripts/device_check/runner.py --close
        sys.path.insert(0, root)
    try:
        from instruments.store import results
        from instruments.store.device_checks import check_run

        results.save_run(check_run(summary), out)
    except Exception as exc:  # noqa: BLE001 - the check's own summary must survive this
        print(f"  the check's run file was not saved: {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--close":
        print("usage: runner.py --close OUT WHY", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(close(Path(sys.argv[2]), sys.argv[3]))
