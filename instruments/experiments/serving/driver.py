"""Driving the serving engine with requests on a clock, and keeping what happened to each.

``drive(engine, arrivals, mode, ...)`` -> ``Served``: the requests run through the engine, step
by step, with every step timed (device-synchronised ``time.perf_counter``):
  - ``schedule_ms``: the scheduler's own decision;
  - ``step_ms``: the forward, the sampling and the bookkeeping of ``engine.execute``.
Time runs on a virtual clock. Each step advances it by its measured ``schedule_ms + step_ms``.
When nothing runs, it jumps to the next arrival, because an idle server waits and nothing
here sleeps. A request's arrival, first token and finish are read off that clock. So TTFT and
TPOT are what a server of these measured step times gives the stream, and the harness's own
row-keeping is not charged to them.

How requests reach the engine (``mode``):
  "continuous"  each request is submitted at its arrival; the engine batches continuously
  "static"      requests queue until the engine is empty; then up to ``static_batch`` of them
                are submitted together and run to completion (a static batch)
  "single"      one request at a time (``static_batch`` = 1)
A closed loop (``clients`` given): ``clients`` requests start at time 0, and each finished
request brings the next one at that moment, until ``len(arrivals)`` have been served.

Each request's row keeps its prompt ids, its generated ids, its arrival, first-token and
finish times, its token times, the tokens the prefix tree gave it, and its preemptions. So
any run can be checked again (the tokens against the engine alone) and plotted again. Each
step's row keeps the batch, its tokens, the queues and the pool after it. ``sync`` is the
device's synchronize (a no-op on a CPU).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MODES = ("continuous", "static", "single")


@dataclass
class Arrival:
    """A request of the workload: when it arrives (s), its prompt and how many tokens."""

    at_s: float
    prompt: list[int]
    new_tokens: int
    group: int = -1  # the workload's own label (a shared system prompt, say)


@dataclass
class Served:
    requests: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    duration_s: float = 0.0
    stopped: bool = False


def _sync_for(device: Any) -> Callable[[], None]:
    import torch

    if str(device).startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


def drive(engine: Any, arrivals: list[Arrival], mode: str = "continuous", *,
          clients: int | None = None, static_batch: int = 1, label: str = "",
          should_stop: Callable[[], bool] | None = None,
          on_step: Callable[[dict[str, Any]], None] | None = None,
          max_steps: int = 200_000) -> Served:
    """Serve ``arrivals`` through ``engine`` (the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"unknown serving mode {mode!r}; allowed: {', '.join(MODES)}")
    batch_cap = 1 if mode == "single" else static_batch
    sync = _sync_for(engine.model.device)
    clock = time.perf_counter
    out = Served()
    pending = deque(sorted(range(len(arrivals)), key=lambda i: arrivals[i].at_s)) \
        if clients is None else deque(range(len(arrivals)))
    queue: deque[int] = deque()  # arrived, not yet given to the engine (static, single)
    rows: dict[int, dict[str, Any]] = {}  # seq id -> its request row
    now = 0.0

    def give(i: int, at_s: float) -> None:
        a = arrivals[i]
        seq = engine.submit(a.prompt, a.new_tokens)
        rows[seq.id] = {"label": label, "request": i, "group": a.group,
                        "prompt_tokens": len(a.prompt), "prompt_ids": list(a.prompt),
                        "arrival_s": at_s, "first_token_s": None, "finish_s": None,
                        "token_s": [], "generated_ids": [], "cached_tokens": 0,
                        "preemptions": 0, "seq": seq}

    def arrive(upto_s: float) -> None:
        """Every open-loop arrival up to ``upto_s``: to the engine, or to the queue."""
        while clients is None and pending and arrivals[pending[0]].at_s <= upto_s:
            i = pending.popleft()
            if mode == "continuous":
                give(i, arrivals[i].at_s)
            else:
                queue.append(i)

    if clients is not None:  # closed loop: the first ``clients`` requests at time 0
        for _ in range(min(clients, len(pending))):
            give(pending.popleft(), 0.0)
    while len(out.steps) < max_steps:
        arrive(now)
        if mode != "continuous" and not engine.has_work() and queue:
            for _ in range(min(batch_cap, len(queue))):  # a static batch, all at once
                i = queue.popleft()
                give(i, arrivals[i].at_s)
        if not engine.has_work():
            if clients is None and pending:
                now = max(now, arrivals[pending[0]].at_s)  # idle: jump to the next arrival
                continue
            if not queue:
                break
        if should_stop is not None and should_stop():
            out.stopped = True
            break
        before = engine.scheduler.preemptions
        t0 = clock()
        works = engine.schedule()
        t1 = clock()
        step = engine.execute(works, engine.scheduler.preemptions - before)
        sync()
        t2 = clock()
        now += t2 - t0
        for seq, token in step.emitted:
            row = rows[seq.id]
            row["token_s"].append(now)
            row["generated_ids"].append(token)
            if row["first_token_s"] is None:
                row["first_token_s"] = now
        for seq in step.finished:
            row = rows[seq.id]
            row["finish_s"] = now
            row["cached_tokens"], row["preemptions"] = seq.cached_tokens, seq.preemptions
            if clients is not None and pending:
                give(pending.popleft(), now)
        pool = engine.pool_state()
        srow = {"label": label, "step": len(out.steps), "t_s": now,
                "schedule_ms": (t1 - t0) * 1e3, "step_ms": (t2 - t1) * 1e3,
                "batch": step.batch, "decodes": step.decodes, "tokens": step.tokens,
                "prefill_tokens": step.tokens - step.decodes, "emitted": len(step.emitted),
                "contexts": [w.start + w.n for w in works if w.n == 1],
                "preempted": step.preempted, "running": pool["running_seqs"],
                "waiting": pool["waiting_seqs"] + len(queue),  # arrived, not running
                "blocks_running": pool["running"], "blocks_shared": pool["shared"],
                "blocks_tree": pool["tree_only"], "blocks_free": pool["free"],
                "blocks": pool["blocks"]}
        out.steps.append(srow)
        if on_step is not None:
            on_step(srow)
    out.duration_s = now
    for row in rows.values():
        row.pop("seq")
        out.requests.append(row)
    out.requests.sort(key=lambda r: r["request"])
    return out
