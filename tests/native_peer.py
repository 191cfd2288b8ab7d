"""A planted native peer for tests/test_native.py and tests/test_llamacpp.py.

``engine_decode(path)`` stands for a native engine's first decode: it kills its own process with
SIGSEGV when the file holds ``CRASH`` -- as llama.cpp's AMX path did on a Sapphire Rapids host
(ggml-org/llama.cpp#20824) -- and otherwise appends its process id to the file named by
``RUNS_LOG`` in the environment, so a test counts where and how often it ran. ``segfault``
crashes whatever it is given (a stand-in for ``llamacpp_api.probe_file``). ``PlantedDecoder``
goes the way llama.cpp's adapter does: write the file, ``native.probe`` it, run it in this
process, then step -- as our ``concat`` mode, so its logits pass the gate.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

from instruments import lineup
from instruments.peers import native
from instruments.peers.built import temp_folder

CRASH = b"crash"
RUNS_LOG = "KVLAB_PLANTED_RUNS"


def engine_decode(path: str) -> None:
    if Path(path).read_bytes() == CRASH:
        os.kill(os.getpid(), signal.SIGSEGV)
    with open(os.environ[RUNS_LOG], "a", encoding="utf-8") as log:
        log.write(f"{os.getpid()}\n")


def segfault(*args: str) -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


class PlantedDecoder:
    """An adapter (``instruments.peers``' contract) over the planted engine and ``concat``."""

    def __init__(self, model: Any, *, batch_size: int = 1, capacity: int | None = None,
                 threads: int | None = None, crash: bool = True) -> None:
        folder = temp_folder("planted")
        path = folder / "engine.bin"
        path.write_bytes(CRASH if crash else b"fine")
        try:
            native.probe(("planted", str(crash), repr(model.config)), engine_decode, path,
                         what=f"the planted engine on {path.name}",
                         fix="leave the planted peer out")
            engine_decode(str(path))  # in this process, as a native peer's load and decode
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.inner = lineup.make_decoder(model, "concat", batch_size=batch_size,
                                         capacity=capacity)
        self.compile_s, self.extra_bytes, self.version = 0.0, 0, "planted 1"

    def __getattr__(self, name: str) -> Any:  # prefill, step, seek, length, ...: concat's
        return getattr(self.inner, name)
