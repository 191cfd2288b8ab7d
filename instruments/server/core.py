"""The engine core: a process of its own that owns the model and one ``ServingEngine`` and
steps it while it has work (vLLM V1's EngineCore), and the front end's handle on it.

  core = Core.start(spec, engine_options, threads)   spawns the process; it loads the model,
                    builds the engine, serves one short request untimed (first-call costs), and
                    says "ready" with the model's facts (``core.facts``); ``CoreError`` with the
                    child's own message when it cannot
  core.submit(rid, prompt, max_tokens, eos_id, sampling)  /  core.cancel(rid)  /  core.close()
  core.listen(on_message)   a reader thread handing every message from the core to
                    ``on_message`` (the front end moves it onto its event loop)

Two one-way pipes (``multiprocessing``, spawn start): commands in, events out.
  in:  ("submit", rid, prompt ids, max_tokens, eos_id or None, sampling fields or None),
       ("cancel", rid), ("stop",)
  out: ("ready", facts) | ("failed", message);
       ("accepted", rid) | ("rejected", rid, message)     one per submit, before its tokens;
       ("step", t, [(rid, token)], [(rid, reason, cached tokens)], state)   after each step;
       ("state", state)                                   after commands that left it idle
``t`` is ``time.monotonic()`` when the step's tokens were picked: one clock for every process
on the host, so the front end reads TTFT and inter-token gaps off the steps, not off its own
event loop. ``state``: running and waiting requests, the pool's blocks (held by running
requests, shared, held by the prefix tree alone, free), preemptions so far, steps; and, when
idle, ``leaked``: references no running request or tree node accounts for (0 unless a
request's blocks were lost).

The loop takes every command waiting, then runs one step, and sleeps in ``poll`` when nothing
waits or runs: the front end's Python (HTTP, JSON, detokenizing) never shares this interpreter,
so it never holds the lock a step needs. A cancel is applied before the next step, so a
client's blocks are back one step after it leaves. The core ends on "stop", or when the front
end's end of the pipe closes (the front end died).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

READY_TIMEOUT_S = 600.0  # loading SmolLM2 and dequantizing it takes seconds; a cold disk more


class CoreError(RuntimeError):
    """The engine core could not start (its message says why) or has gone."""


def _state(engine: Any, idle: bool) -> dict[str, Any]:
    s = engine.pool_state()
    out = {"running": s["running_seqs"], "waiting": s["waiting_seqs"], "blocks": s["blocks"],
           "free": s["free"], "blocks_running": s["running"], "blocks_shared": s["shared"],
           "blocks_tree": s["tree_only"], "preemptions": engine.scheduler.preemptions,
           "steps": engine.steps}
    if idle:
        cache = engine.cache
        holders = Counter(b for n in cache.nodes.values() for b in n.blocks)
        holders.update(b for q in engine.scheduler.running for b in q.req.table)
        out["leaked"] = sum(max(r - holders[b], 0) for b, r in enumerate(cache.pool.refs))
    return out


def _facts(loaded: Any, engine: Any) -> dict[str, Any]:
    import torch

    from instruments.measure.device import describe_device

    cfg = loaded.model.config
    return {"config": cfg.to_dict(), "family": cfg.family, "context": cfg.block_size,
            "checkpoint": loaded.state.provenance.checkpoint,
            "vocab": cfg.vocab_size, "weights": loaded.info.get("weights_label"),
            "device": loaded.spec.device, "device_name": describe_device(
                loaded.spec.device)["name"], "dtype": loaded.spec.dtype,
            "threads": torch.get_num_threads(), "blocks": engine.cache.pool.n_blocks,
            "block_tokens": engine.cache.block_tokens,
            "budget_bytes": engine.cache.pool.nbytes(), "reads": engine.reads,
            "kernel": engine.kernel, "step": engine.step_kind,
            "max_seqs": engine.scheduler.max_seqs,
            "step_tokens": engine.scheduler.step_tokens}


def core_main(commands: Any, events: Any, spec: dict[str, Any], options: dict[str, Any],
              threads: int | None) -> None:
    """The child's whole life (the module docstring)."""
    try:
        import torch

        if threads:
            torch.set_num_threads(threads)
        from engine.serving.engine import ServingEngine, default_step
        from engine.serving.sampling import Sampling
        from instruments.spine import ModelSpec, load

        loaded = load(ModelSpec(**spec))
        model = loaded.model
        options = dict(options)
        if options.get("step", "auto") == "auto":  # the faster way where it runs (the step bench)
            options["step"] = "forward" if options.get("reads") == "gather" else \
                default_step(model.device, model.dtype)
        bpt = model.config.kv_bytes_per_token(model.dtype.itemsize)
        # the pool: what max_seqs whole contexts need, within the bytes asked for
        budget_tokens = min(options.pop("budget_bytes") // bpt,
                            options["max_seqs"] * model.config.block_size)
        engine = ServingEngine(model, max(budget_tokens, 2 * options["block_tokens"]) * bpt,
                               **options)
        with torch.no_grad():  # the first call's costs, paid before any client waits
            engine.submit([1, 2, 3, 4], 2)
            engine.drain()
    except Exception as exc:  # noqa: BLE001 (everything the load can raise goes back as text)
        events.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    events.send(("ready", _facts(loaded, engine)))
    events.send(("state", _state(engine, idle=True)))
    seqs: dict[int, Any] = {}  # rid -> Seq
    rids: dict[int, int] = {}  # seq id -> rid
    with torch.no_grad():
        while True:
            if not engine.has_work() and not commands.poll(None):
                continue
            dirty = False
            try:
                while commands.poll():
                    msg = commands.recv()
                    if msg[0] == "stop":
                        return
                    dirty = True
                    if msg[0] == "submit":
                        _, rid, prompt, max_tokens, eos_id, sampling = msg
                        try:
                            seq = engine.submit(prompt, max_tokens, eos_id,
                                                Sampling(*sampling) if sampling else None)
                        except ValueError as exc:  # BudgetError too: it can never run
                            events.send(("rejected", rid, str(exc)))
                            continue
                        seqs[rid], rids[seq.id] = seq, rid
                        events.send(("accepted", rid))
                    elif msg[0] == "cancel":
                        seq = seqs.pop(msg[1], None)
                        if seq is not None and seq.status in ("waiting", "running"):
                            engine.cancel(seq)
                            rids.pop(seq.id, None)
            except (EOFError, OSError):
                return  # the front end is gone
            if not engine.has_work():
                if dirty:
                    events.send(("state", _state(engine, idle=True)))
                continue
            out = engine.step()
            t = time.monotonic()
            emitted = [(rids[s.id], tok) for s, tok in out.emitted]
            finished = []
            for s in out.finished:
                rid = rids.pop(s.id)
                seqs.pop(rid, None)
                finished.append((rid, "stop" if s.finish_reason == "eos" else "length",
                                 s.cached_tokens))
            events.send(("step", t, emitted, finished,
                         _state(engine, idle=not engine.has_work())))


class Core:
    """The front end's handle on the engine core process (the module docstring)."""

    def __init__(self, proc: Any, commands: Any, events: Any, facts: dict[str, Any]) -> None:
        self.proc, self.commands, self.events, self.facts = proc, commands, events, facts
        self._send_lock = threading.Lock()
        self.alive = True

    @classmethod
    def start(cls, spec: dict[str, Any], options: dict[str, Any], threads: int | None = None,
              timeout_s: float = READY_TIMEOUT_S) -> Core:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no page's or server's state
        cmd_read, cmd_write = ctx.Pipe(duplex=False)
        ev_read, ev_write = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=core_main, args=(cmd_read, ev_write, spec, options, threads),
                           name="kvlab-engine-core", daemon=True)
        proc.start()
        cmd_read.close()
        ev_write.close()
        deadline = time.monotonic() + timeout_s
        while not ev_read.poll(0.2):
            if not proc.is_alive():
                raise CoreError(f"the engine core exited (code {proc.exitcode}) before it "
                                "was ready")
            if time.monotonic() > deadline:
                proc.kill()
                raise CoreError(f"the engine core was not ready within {timeout_s:.0f} s")
        try:
            msg = ev_read.recv()
        except EOFError:
            raise CoreError("the engine core exited before it was ready") from None
        if msg[0] != "ready":
            proc.join(5)
            raise CoreError(str(msg[1]))
        return cls(proc, cmd_write, ev_read, msg[1])

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            try:
                self.commands.send(msg)
            except (OSError, ValueError) as exc:
                self.alive = False
                raise CoreError("the engine core has gone") from exc

    def submit(self, rid: int, prompt: list[int], max_tokens: int, eos_id: int | None,
               sampling: tuple | None) -> None:
        self._send(("submit", rid, prompt, max_tokens, eos_id, sampling))

    def cancel(self, rid: int) -> None:
        self._send(("cancel", rid))

    def listen(self, on_message: Callable[[tuple], None]) -> threading.Thread:
        def read() -> None:
            while True:
                try:
                    msg = self.events.recv()
                except (EOFError, OSError):
                    self.alive = False
                    on_message(("gone",))
                    return
                on_message(msg)

        th = threading.Thread(target=read, name="kvlab-core-events", daemon=True)
        th.start()
        return th

    def close(self, timeout_s: float = 10.0) -> None:
        with contextlib.suppress(CoreError):
            self._send(("stop",))
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.alive = False
