"""What this machine's devices are, printed as one JSON line (run as a short-lived process).

    python -m instruments.process.probe

The dashboard's server imports no torch; it asks this once at start-up which devices exist,
their names, memory and the dtypes each supports.
"""

from __future__ import annotations

import json
import sys

from instruments.store.results import to_jsonable


def probe() -> dict:
    import torch

    from instruments.measure.device import describe_device, device_available, supported_dtypes

    found = {}
    for name in ("cpu", "cuda"):
        ok, why = device_available(name)
        if ok:
            found[name] = {**describe_device(name), "dtypes": supported_dtypes(name)}
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "devices": found}


if __name__ == "__main__":
    print(json.dumps(to_jsonable(probe())))
    sys.exit(0)
