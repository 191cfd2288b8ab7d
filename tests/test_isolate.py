"""``native`` test modules run in a child pytest (``tests/isolate.py``): a segfault inside one
of their tests is one failed test naming the signal, and the suite goes on -- the tests after it
in the same module (a new child) and in the next module. Run in place, the same crash ends
pytest itself with no summary.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import isolate

ROOT = Path(__file__).resolve().parents[1]
SUITE = ["tests/fixtures/isolate/native_crash.py", "tests/fixtures/isolate/plain.py"]
pytestmark = pytest.mark.timeout(300)


def _pytest(*files: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != isolate.REPORT}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *(files or SUITE)], cwd=ROOT, capture_output=True, text=True,
                          timeout=280, env={**clean, **env}, check=False)


def test_a_segfault_fails_one_test_and_the_suite_goes_on() -> None:
    out = _pytest()
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "1 failed, 3 passed" in out.stdout, out.stdout[-3000:]
    assert "FAILED tests/fixtures/isolate/native_crash.py::test_segfaults" in out.stdout
    assert "_ test_segfaults _" in out.stdout
    assert "\ncrashed (signal 11, SIGSEGV) in the child process running it" in out.stdout
    assert "in test_segfaults" in out.stdout  # the child's faulthandler stack, kept


def test_run_in_place_the_same_crash_ends_pytest(tmp_path: Path) -> None:
    out = _pytest(**{isolate.REPORT: str(tmp_path / "reports.jsonl")})  # as a child runs them
    assert out.returncode == -11 and "passed" not in out.stdout, out.stdout[-3000:]
    assert "Segmentation fault" in out.stderr


def test_a_module_mixing_marked_and_unmarked_tests_is_refused() -> None:
    out = _pytest("tests/fixtures/isolate/mixed.py")
    assert out.returncode == 4, out.stdout[-2000:] + out.stderr[-2000:]
    assert "mark whole modules native (pytestmark), not single tests: " in out.stderr
