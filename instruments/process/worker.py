"""The measuring process: one per device, its own interpreter, nothing else running in it.

    python -m instruments.process.worker --device cpu

Started on demand by ``instruments.process.client`` (the dashboard's server) and spoken to in the
line protocol of ``instruments.process.protocol``: requests on stdin, messages on stdout (library
output is moved to stderr, which the client keeps as a log). It loads and holds one model on its
device -- a request naming another model replaces it, memory freed first -- and runs one
experiment at a time, the same ``run(loaded, params, progress, should_stop)`` the CLI calls.
A reader thread waits on stdin (blocked in a read, it holds no interpreter lock) and turns a
"stop" into the flag the experiment polls between steps; end of input (the server went away)
stops the run and ends the process.
"""

from __future__ import annotations

import argparse
import gc
import os
import queue
import sys
import threading
import traceback
from dataclasses import asdict, replace
from typing import Any, TextIO

from instruments import experiments
from instruments.process import protocol
from instruments.spine import Loaded, ModelSpec, base_meta, load


class Channel:
    """Messages out, one JSON line each, on the stdout this process started with."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        with self.lock:
            self.out.write(protocol.encode(message))
            self.out.flush()


def same_random(loaded: Loaded, spec: ModelSpec) -> bool:
    """Whether ``loaded`` (asked for as "auto", fallen back) already holds the seeded random
    weights that ``spec`` asks for as "random": "auto" falls back to the same seed's."""
    was = loaded.spec
    return (spec.weights == "random" and was.weights == "auto"
            and bool(loaded.info.get("weights_fallback"))
            and (was.name, was.device, was.dtype, was.seed)
            == (spec.name, spec.device, spec.dtype, spec.seed))


class Worker:
    def __init__(self, device: str, channel: Channel) -> None:
        self.device = device
        self.channel = channel
        self.loaded: Loaded | None = None
        self.requests: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.stopped: set[str] = set()  # ids of requests asked to stop (a stop may come early)
        self.closed = threading.Event()

    # -- input -------------------------------------------------------------------------------
    def read(self, stream: TextIO) -> None:
        for line in stream:
            msg = protocol.decode(line)
            if msg is None:
                continue
            if msg["type"] == "stop":
                self.stopped.add(str(msg.get("id")))
            elif msg["type"] == "exit":
                break
            else:
                self.requests.put(msg)
        self.closed.set()  # end of input: the server is gone; stop whatever runs
        self.requests.put(None)

    # -- the model ---------------------------------------------------------------------------
    def ensure(self, spec: ModelSpec) -> Loaded:
        if spec.device != self.device:
            raise ValueError(f"this measuring process holds {self.device}; asked for "
                             f"{spec.device}")
        if self.loaded is not None and same_random(self.loaded, spec):
            # "auto" that fell back to random weights holds what "random" asks for: a user who
            # switches the sidebar from the one to the other does not wait for a second load
            self.loaded = replace(self.loaded, spec=spec,
                                  info={**self.loaded.info, "weights_fallback": None})
        if self.loaded is None or self.loaded.spec != spec:
            self.release()
            self.loaded = load(spec)
        return self.loaded

    def release(self) -> None:
        """Drop the model and everything kept for it: its state (packed copies, compiled steps,
        mask buffers) and the experiments' memo -- emptied first, so that nothing still
        referring to the state (a decoder in a traceback) keeps that memory."""
        if self.loaded is not None:
            assert self.loaded.state is not None
            self.loaded.state.clear()
            self.loaded.memo.clear()
        self.loaded = None
        free_memory(self.device)

    # -- requests ----------------------------------------------------------------------------
    def handle(self, msg: dict[str, Any]) -> None:
        rid = str(msg.get("id"))
        oom = None
        try:
            spec = ModelSpec(**msg["model"])
            loaded = self.ensure(spec)
            self.channel.send({"type": "loaded", "id": rid, "info": loaded.info})
            if msg["type"] == "load":
                self.channel.send({"type": "done", "id": rid})
                return
            exp = experiments.get(str(msg.get("experiment")))
            p = experiments.from_dict(exp.params, dict(msg.get("params") or {}))
            p.check(loaded.model.config, self.device)
            self.channel.send({"type": "start", "id": rid, "kind": exp.kind,
                               "meta": base_meta(loaded, exp.kind, p)})

            def progress(event: Any) -> None:
                self.channel.send({"type": "event", "id": rid, **asdict(event)})

            def should_stop() -> bool:
                return rid in self.stopped or self.closed.is_set()

            run = exp.run(loaded, p, progress, should_stop)
            return_freed_heap()  # before the result: whoever waits on it sees the memory after
            self.channel.send({"type": "result", "id": rid, "run": run})
        except Exception as exc:
            category, message = classify(exc)
            if category == "crash":
                traceback.print_exc()
            if category == "oom":
                oom = message  # free memory below, once the exception no longer holds tensors
            else:
                self.channel.send({"type": "error", "id": rid, "category": category,
                                   "message": message})
        finally:
            self.stopped.discard(rid)
        if oom is not None:
            free_memory(self.device)
            self.channel.send({"type": "error", "id": rid, "category": "oom", "message": oom})

    def serve(self) -> None:
        import torch

        from instruments.measure.device import describe_device

        self.channel.send({"type": "hello", "pid": os.getpid(), "device": self.device,
                           "torch": torch.__version__, "facts": describe_device(self.device)})
        while True:
            msg = self.requests.get()
            if msg is None:
                return
            self.handle(msg)


def return_freed_heap() -> None:
    """Give the heap pages a finished experiment freed back to the system (glibc's
    malloc_trim), after its run, never inside a timed step. glibc keeps freed memory once its
    dynamic mmap threshold has grown: measured here, 50 MiB of anonymous memory stayed with the
    measuring process after 20 small sweeps that followed other experiments, none of it live."""
    from instruments.measure.memory import malloc_trim

    gc.collect()
    malloc_trim()


def classify(exc: BaseException) -> tuple[str, str]:
    """(category, message for the page): "input" for what the user can fix, "oom", "crash"."""
    import torch

    from engine.models.loader import WeightsError
    from instruments.lineup import TokenizerError

    text = str(exc).strip()
    if isinstance(exc, torch.OutOfMemoryError) or (
            isinstance(exc, RuntimeError) and ("out of memory" in text.lower()
                                               or "can't allocate memory" in text.lower())):
        first = text.splitlines()[0][:200] if text else "out of memory"
        return "oom", (f"Out of memory: {first}. Try a smaller batch size or context, a smaller "
                       "model, or a lower-precision dtype.")
    if isinstance(exc, (ValueError, WeightsError, TokenizerError)):
        return "input", text.splitlines()[0] if text else type(exc).__name__
    return "crash", f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def free_memory(device: str) -> None:
    import torch

    gc.collect()
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m instruments.process.worker")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    # Keep a private copy of stdout for messages; anything else printed goes to stderr.
    channel = Channel(os.fdopen(os.dup(1), "w", encoding="utf-8"))
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    worker = Worker(args.device, channel)
    threading.Thread(target=worker.read, args=(sys.stdin,), name="requests", daemon=True).start()
    try:
        worker.serve()
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the server went away while a message was on its way: nobody
        return 0  # is left to tell, and its log should not end in a traceback
    return 0


if __name__ == "__main__":
    sys.exit(main())
