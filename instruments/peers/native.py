"""Native engines tried in a throwaway process before they run in the measuring one.

A native peer runs C/C++ in the measuring process, side by side with our modes (its steps must be
timed there). A crash in that code -- a segfault, an abort -- cannot be caught: it would end the
process, the run and every row measured so far. So before its adapter loads a file in-process
it calls ``probe(key, target, *args, what=..., fix=...)``: a fresh interpreter runs
``target(*args)`` (a module-level function of a torch-free module: the engine's load and first
decodes of that very file), and
  killed by a signal      -> ``PeerUnavailable("crashed (signal 11, SIGSEGV) in a probe of
                             <what>; <fix>")``: the caller lists the peer as unavailable and the
                             run goes on
  no exit in ``timeout_s`` -> ``PeerUnavailable("hung: ...")`` (killed; in-process it would
                             hang the run)
  exit 0, or a Python error -> the in-process build goes on (it meets the same error and says
                             why itself)
The answer is kept per ``key`` for the life of the process -- the engine, its package version,
the file's format and the model's shapes, what a crash depends on -- so a sweep, the gate and a
rebuild after weights change pay it once. Its cost: one interpreter start and the engine's
import (no torch), one load of the file (mapped, not copied), ten tokens; not timed here.

Who probes: llama.cpp, which ``make peers`` compiles for this CPU (``-march=native``) and whose
AMX path crashed a Sapphire Rapids host (ggml-org/llama.cpp#20824). CTranslate2, ONNX Runtime and
OpenVINO are not probed: their wheels are built once by their vendors for a baseline CPU and pick
kernels at run time, and a probe would load their ~0.5 GB conversion (gpt2) a second time per
peer and run; their tests run in a child process all the same (``tests/isolate.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from instruments.lineup import PeerUnavailable

ROOT = Path(__file__).resolve().parents[2]  # the repository: the child imports from it
TIMEOUT_S = 300.0  # a load and ten tokens of gpt2's F32 file take seconds on 2 cores
_SEEN: dict[tuple[str, ...], str] = {}  # key -> "" (it ran) or why the peer is unavailable
_CHILD = "import sys, importlib; getattr(importlib.import_module(sys.argv[1]), sys.argv[2])" \
    "(*sys.argv[3:])"


def signal_name(number: int) -> str:
    """``"signal 11, SIGSEGV"`` (the number alone where Python has no name for it)."""
    try:
        return f"signal {number}, {signal.Signals(number).name}"
    except ValueError:
        return f"signal {number}"


def probe(key: tuple[str, ...], target: Callable[..., None], *args: object, what: str,
          fix: str, timeout_s: float = TIMEOUT_S) -> None:
    """Run ``target(*args)`` (arguments passed as text) in a child process once per ``key``;
    raise ``PeerUnavailable`` when it was killed by a signal or hung (see the module
    docstring). ``what``: the engine, build and file tried; ``fix``: what the user can do."""
    if key not in _SEEN:
        _SEEN[key] = _run(target, [str(a) for a in args], what, fix, timeout_s)
    if _SEEN[key]:
        raise PeerUnavailable(_SEEN[key])


def _run(target: Callable[..., None], args: list[str], what: str, fix: str,
         timeout_s: float) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, "-c", _CHILD, target.__module__, target.__qualname__, *args]
    try:  # the child's output is the engine's log: kept out of the run's
        done = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return f"hung: a probe of {what} did not finish in {timeout_s:.0f} s; {fix}"
    if done.returncode < 0:  # POSIX: killed by signal -returncode
        return f"crashed ({signal_name(-done.returncode)}) in a probe of {what}; {fix}"
    return ""
