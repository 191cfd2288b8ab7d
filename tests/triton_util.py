"""Helpers for the Triton kernels' tests: where they run (``DEVICE``: a CUDA GPU when there is
one, else the CPU under ``TRITON_INTERPRET=1``, which tests/conftest.py sets before anything
imports ``triton``), and planted bugs (a kernel module's source with one edit, imported afresh)
so that each test can show it fails on the bug it guards."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed (requirements-gpu.txt)")
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def planted(module: ModuleType, old: str, new: str, tmp_path: Path) -> ModuleType:
    """``module`` imported again from a copy of its source with ``old`` replaced by ``new``
    (exactly once: a planted bug must land where it was aimed)."""
    src = Path(module.__file__ or "").read_text(encoding="utf-8")
    assert src.count(old) == 1, f"{old!r} occurs {src.count(old)} times in {module.__name__}"
    path = tmp_path / f"planted_{abs(hash((old, new)))}.py"
    path.write_text(src.replace(old, new), encoding="utf-8")
    name = f"{module.__package__}.{path.stem}"  # in its package: its relative imports work
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # triton.jit reads the source through inspect
    spec.loader.exec_module(mod)
    return mod
