"""Modules marked ``native`` run in a child pytest process: a crash fails a test, not the suite.

A test that drives llama.cpp, CTranslate2, ONNX Runtime or OpenVINO in this process can die in
their C/C++ code (llama.cpp's AMX path segfaulted on a Sapphire Rapids host:
ggml-org/llama.cpp#20824); in-process that ends pytest with no summary. Forking is no way out:
a child forked after torch's OpenMP pool has run hangs in its first parallel region (checked
here: torch 2.13, GNU libgomp), so pytest-forked is not used. Instead the first ``native`` test
of a module starts a fresh ``python -m pytest`` on every ``native`` test of that module not yet
run. The child (``REPORT`` set in its environment) runs them in place and appends, line by line,
each test's start and its reports in pytest's own serialised form to a file; the parent replays
them as its own. A child killed by a signal: the test it had started and not finished fails
with "crashed (signal 11, SIGSEGV) in the child process running it" and the child's last output
(pytest's faulthandler prints the Python stack); the tests after it get a new child. Cost: one
interpreter, pytest and the module's fixtures per module, not per test.

The marker goes on whole modules (``pytestmark``): the parent sets up no fixture for them, so a
module mixing marked and unmarked tests would leave its fixtures half torn down (refused). To
run them in place (under a debugger): ``KVLAB_ISOLATED_REPORT=/dev/null pytest ...``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from instruments.peers.native import signal_name

MARK = "native"
REPORT = "KVLAB_ISOLATED_REPORT"  # set in a child: where its reports go
TAIL = 40  # lines of a crashed child's output kept in the failure


def in_child() -> bool:
    return REPORT in os.environ


class Child:
    """In the child: each test's start and reports, appended to ``REPORT`` as they happen."""

    def __init__(self, config: pytest.Config) -> None:
        self.config, self.path = config, Path(os.environ[REPORT])

    def _write(self, entry: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as f:  # closed each time: a crash keeps it
            f.write(json.dumps(entry) + "\n")

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        self._write({"start": nodeid})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._write({"report": self.config.hook.pytest_report_to_serializable(
            config=self.config, report=report)})


class Parent:
    """In the parent: ``native`` tests replayed from a child's reports."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.done: dict[str, list[pytest.TestReport]] = {}

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        marked: dict[Path, set[bool]] = {}
        for item in items:
            marked.setdefault(item.path, set()).add(item.get_closest_marker(MARK) is not None)
        mixed = [str(p) for p, kinds in marked.items() if len(kinds) > 1]
        if mixed:
            raise pytest.UsageError(f"mark whole modules {MARK} (pytestmark), not single tests: "
                                    f"{', '.join(mixed)}")
        for item in items:  # the child holds each test to its own timeout; here, none
            if item.get_closest_marker(MARK) is not None:
                item.add_marker(pytest.mark.timeout(0), append=False)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None
                                ) -> bool | None:
        if item.get_closest_marker(MARK) is None:
            return None
        if item.nodeid not in self.done:
            items = item.session.items
            pending = [i for i in items[items.index(item):] if i.path == item.path]
            self._run_child(pending)
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        for report in self.done.pop(item.nodeid):
            item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _run_child(self, pending: list[pytest.Item]) -> None:
        folder = Path(tempfile.mkdtemp(prefix="kvlab_isolated_"))
        report, output = folder / "reports.jsonl", folder / "output.txt"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--basetemp={folder / 'tmp'}", *[i.nodeid for i in pending]]
        try:
            with output.open("wb") as out:
                rc = subprocess.run(cmd, cwd=self.config.rootpath, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, check=False,
                                    env={**os.environ, REPORT: str(report)}).returncode
            started, got = self._read(report)
            tail = "\n".join(output.read_text("utf-8", "replace").splitlines()[-TAIL:])
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        for item in pending:
            if item.nodeid in got and any(r.when == "teardown" for r in got[item.nodeid]):
                self.done[item.nodeid] = got[item.nodeid]
            elif item.nodeid in started or item is pending[0]:  # died in it, or never reached
                why = (f"crashed ({signal_name(-rc)}) in the child process running it"
                       if rc < 0 else f"its child pytest ended (exit {rc}) before it finished")
                self.done[item.nodeid] = [*got.get(item.nodeid, []), self._failed(
                    item, f"{why} (tests/isolate.py); the child's last output:\n{tail}")]
                return  # the tests after it: a new child

    def _read(self, path: Path) -> tuple[set[str], dict[str, list[pytest.TestReport]]]:
        started: set[str] = set()
        got: dict[str, list[pytest.TestReport]] = {}
        lines = path.read_text("utf-8").splitlines() if path.exists() else []
        for entry in map(json.loads, lines):
            if "start" in entry:
                started.add(entry["start"])
                continue
            report = self.config.hook.pytest_report_from_serializable(
                config=self.config, data=entry["report"])
            got.setdefault(report.nodeid, []).append(report)
        return started, got

    @staticmethod
    def _failed(item: pytest.Item, text: str) -> pytest.TestReport:
        return pytest.TestReport(item.nodeid, item.location, {k: 1 for k in item.keywords},
                                 "failed", text, "call")


def register(config: pytest.Config) -> None:
    """The plugin this process needs: ``Child`` in a child, else ``Parent``."""
    config.pluginmanager.register(Child(config) if in_child() else Parent(config),
                                  "kvlab-isolate")
