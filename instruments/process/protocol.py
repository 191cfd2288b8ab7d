"""The measuring process's wire format: one JSON object per line, each way. Torch-free.

To the process (its stdin):
  {"type": "run", "id", "experiment", "params", "model"}   run one experiment on that model
  {"type": "load", "id", "model"}                          load (or keep) the model, run nothing
  {"type": "stop", "id"}                                   stop that request after its step
  {"type": "exit"}                                         leave (also on end of input)
From the process (its stdout; library output goes to its stderr, a log file):
  {"type": "hello", "pid", "device", "torch", "facts"}     once, when it is ready
  {"type": "loaded", "id", "info"}                         the model is in memory
  {"type": "start", "id", "kind", "meta"}                  the run's meta, before any row
  {"type": "event", "id", ...Event fields}                 progress, a row, a token
  {"type": "result", "id", "run"}                          the run (partial when stopped)
  {"type": "done", "id"}                                   a load request finished
  {"type": "error", "id", "category", "message"}           input | oom | crash
"""

from __future__ import annotations

import json
from typing import Any

from instruments.store.results import to_jsonable


def encode(message: dict[str, Any]) -> str:
    return json.dumps(to_jsonable(message), allow_nan=False) + "\n"


def decode(line: str | bytes) -> dict[str, Any] | None:
    """The message on one line, or None for a line that is not one of ours."""
    try:
        msg = json.loads(line)
    except (ValueError, TypeError):
        return None
    return msg if isinstance(msg, dict) and isinstance(msg.get("type"), str) else None
