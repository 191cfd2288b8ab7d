"""What this machine's devices are, printed as one JSON line (run as a short-lived process).

    python -m instruments.process.probe

The dashboard's server imports no torch; it asks this once at start-up, in the background
(``instruments.process.devices.start_probe``), which devices exist, their names, memory and the
dtypes each supports. Until the answer lands the pages draw from ``placeholder()``: the CPU (its
name read from /proc/cpuinfo, its dtypes), marked ``"probing": True``. Where this torch build
cannot drive a GPU at all (``gpu_build()`` reads torch's version file as text, without importing
torch) nothing needs a second torch import: the CPU measuring process's greeting carries the
same facts (``from_hello``), and on a 2-core CPU that saves a core for seconds at start-up.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import platform
import re
import sys
from pathlib import Path
from typing import Any

from instruments.store.results import to_jsonable

# What ``instruments.measure.device.supported_dtypes("cpu")`` answers, known without torch
# (tests/test_app.py holds the two equal).
CPU_DTYPES = ("float32", "bfloat16")


def probe() -> dict:
    import torch

    from instruments.measure.device import describe_device, device_available, supported_dtypes

    found = {}
    for name in ("cpu", "cuda"):
        ok, why = device_available(name)
        if ok:
            found[name] = {**describe_device(name), "dtypes": supported_dtypes(name)}
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "devices": found}


@functools.lru_cache(maxsize=1)
def gpu_build() -> bool:
    """Whether the installed torch was built for a GPU (CUDA or ROCm), read from its version file
    without importing it; True when that cannot be told (the full probe then decides)."""
    try:
        spec = importlib.util.find_spec("torch")
        text = (Path(spec.origin).parent / "version.py").read_text(encoding="utf-8")  # type: ignore[union-attr, arg-type]
    except (ImportError, AttributeError, TypeError, OSError, ValueError):
        return True
    found = {m["key"]: m["value"].strip() for m in re.finditer(
        r"^(?P<key>cuda|hip)\b[^=\n]*=(?P<value>[^\n]*)$", text, re.M)}
    if set(found) != {"cuda", "hip"}:
        return True
    return any(value != "None" for value in found.values())


@functools.lru_cache(maxsize=1)
def cpu_name() -> str:
    """The CPU's name as the probe gives it (/proc/cpuinfo's model name), without torch."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def placeholder() -> dict[str, Any]:
    """What the pages may use before the probe has answered: the CPU, by name, with its dtypes."""
    cpu = {"name": cpu_name(), "kind": "cpu", "device": "cpu", "dtypes": list(CPU_DTYPES),
           "probing": True}
    return {"torch": None, "probing": True, "devices": {"cpu": cpu}}


def from_hello(hello: dict[str, Any]) -> dict[str, Any]:
    """The probe's answer from a CPU measuring process's greeting, for a torch build without GPU
    support (where the CPU is all there is)."""
    facts = dict(hello["facts"])
    return {"torch": hello.get("torch"), "cuda": None,
            "devices": {"cpu": {**facts, "dtypes": list(CPU_DTYPES)}}}


if __name__ == "__main__":
    print(json.dumps(to_jsonable(probe())))
    sys.exit(0)
