"""The scheduler: which requests run in the next step, and how many of their tokens.

vLLM V1's shape (``vllm/v1/core/sched/scheduler.py``), in nano-vllm's size. There are no prefill
and decode phases: each step has a budget of tokens (``step_tokens``) and of sequences
(``max_seqs``).

  1. Running sequences first, oldest first. Each takes what it has not computed yet, up to
     what the budget has left: a decoding one takes its 1 token, one still prefilling takes
     a chunk (chunked prefill, mixed into the decode step). Blocks for the new rows come from
     the pool (``PrefixCache.reserve``: least recently used tree leaves are evicted first).
     When none is left, the newest running sequence is preempted by recompute. Its computed
     rows go to the prefix tree, where they can be evicted like any other, and the
     sequence goes back to the head of the waiting queue. When the newest is the sequence
     asking, it preempts itself and the pass stops.
  2. Waiting sequences are admitted only in a step that preempted nothing, in policy order:
     "fcfs" (arrival), or "lpm" (longest cached prefix first, SGLang's; FCFS past
     ``LPM_LIMIT`` waiting, as SGLang falls back). Admission looks the sequence up in the
     prefix tree and shares the blocks of its hit. It takes blocks for the rest of its prompt
     at once (the KV byte budget is the pool). When they are not there, it waits: that is
     the admission control.

``Seq`` is one request's state across preemptions: its tokens (the prompt, then every token
generated; the last one is sampled but not fed yet), the rows computed, its blocks (a prefix
``Request``, None while waiting) and its counts. ``schedule()`` returns the step's ``Work``:
(seq, first row, tokens). The engine runs the step and advances the sequences. The scheduler
never touches a tensor.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..cache.blocks import PoolExhausted

POLICIES = ("fcfs", "lpm")
LPM_LIMIT = 128  # past this many waiting, LPM's ranking costs more than it saves (SGLang's)


@dataclass(eq=False)
class Seq:
    """One request, from submission to its end."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    eos_id: int | None = None
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    computed: int = 0  # rows of ``tokens`` in the cache
    req: Any = None  # the prefix cache's Request holding its blocks (None: none held)
    status: str = "waiting"  # waiting | running | finished | cancelled
    cached_tokens: int = 0  # rows taken from the prefix tree at its (last) admission
    preemptions: int = 0
    finish_reason: str = ""  # "length" | "eos" | "cancelled"

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def remaining(self) -> int:
        """Tokens it may still generate."""
        return self.max_new_tokens - len(self.generated)


@dataclass(frozen=True)
class Work:
    """A sequence's share of one step: rows ``start .. start + n - 1`` of its tokens."""

    seq: Seq
    start: int
    n: int

    @property
    def samples(self) -> bool:
        """Does this step reach its last known token (so its logits give the next one)?"""
        return self.start + self.n == len(self.seq.tokens)


class Scheduler:
    """Waiting and running queues over a ``PrefixCache`` (the module docstring)."""

    def __init__(self, cache: Any, *, max_seqs: int = 64, step_tokens: int = 512,
                 policy: str = "fcfs", keep_preempted: bool = True) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; allowed: "
                             f"{', '.join(POLICIES)}")
        if max_seqs < 1 or step_tokens < 1:
            raise ValueError(f"a step needs room for at least one sequence and one token; got "
                             f"max_seqs={max_seqs}, step_tokens={step_tokens}")
        self.cache, self.max_seqs, self.step_tokens = cache, max_seqs, step_tokens
        self.policy = policy
        # a preempted sequence's rows go to the tree (True, vLLM's freed blocks keep their hash)
        # or are dropped (False)
        self.keep_preempted = keep_preempted
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.preemptions = 0
        self._ids = itertools.count()

    def add(self, prompt: list[int], max_new_tokens: int, eos_id: int | None = None) -> Seq:
        """A new waiting sequence; ValueError / BudgetError (nothing queued) for one that can
        never run (``PrefixCache.check_request``)."""
        prompt = [int(t) for t in prompt]
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be 1 or more, got {max_new_tokens}")
        self.cache.check_request(prompt, max_new_tokens)
        seq = Seq(next(self._ids), prompt, max_new_tokens, eos_id)
        self.waiting.append(seq)
        return seq

    # ------------------------------------------------------------------------------- one step
    def schedule(self) -> list[Work]:
        """The next step's work (module docstring); [] when nothing can run."""
        budget, work, before = self.step_tokens, [], self.preemptions
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != "running":  # preempted by an older sequence in this pass
                continue
            n = min(len(seq.tokens) - seq.computed, budget)
            if not self._reserve(seq, seq.computed + n):
                break  # it preempted itself: every sequence after it has gone already
            work.append(Work(seq, seq.computed, n))
            budget -= n
        if self.preemptions > before:
            return work
        for seq in self._admission_order():
            if budget == 0 or len(self.running) >= self.max_seqs:
                break
            if not self._admit(seq):
                break  # its blocks are not there: it (and everyone behind it) waits
            n = min(len(seq.tokens) - seq.computed, budget)
            work.append(Work(seq, seq.computed, n))
            budget -= n
        return work

    def _reserve(self, seq: Seq, rows: int) -> bool:
        """Blocks for ``seq``'s first ``rows`` rows, preempting the newest running sequences
        until they are there; False when ``seq`` itself had to go."""
        while True:
            try:
                self.cache.reserve(seq.req, rows)
                return True
            except PoolExhausted:
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    return False

    def _admission_order(self) -> list[Seq]:
        order = list(self.waiting)
        if self.policy == "lpm" and len(order) <= LPM_LIMIT:
            order.sort(key=lambda s: -self.cache.peek(s.tokens))  # stable: FCFS among equals
        return order

    def _admit(self, seq: Seq) -> bool:
        hit = self.cache.lookup(seq.tokens)
        try:
            seq.req = self.cache.admit(seq.tokens, seq.remaining, hit)
        except PoolExhausted:
            return False
        self.waiting.remove(seq)
        seq.req.tokens = seq.tokens  # one list: what finish() gives the tree is what it ran
        seq.computed = seq.cached_tokens = hit.length
        seq.status = "running"
        self.running.append(seq)
        return True

    # -------------------------------------------------------------------------- transitions
    def preempt(self, seq: Seq) -> None:
        """Back to the head of the waiting queue; its blocks released (its computed rows to the
        tree with ``keep_preempted``), to be recomputed (or found in the tree) when it runs
        again."""
        self.running.remove(seq)
        seq.req.length = seq.computed
        (self.cache.finish if self.keep_preempted else self.cache.cancel)(seq.req)
        seq.req, seq.computed, seq.status = None, 0, "waiting"
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Seq, reason: str) -> None:
        """A sequence that is done: its rows to the tree, its other blocks back at once."""
        self.running.remove(seq)
        seq.req.length = seq.computed
        self.cache.finish(seq.req)
        seq.req, seq.status, seq.finish_reason = None, "finished", reason

    def cancel(self, seq: Seq) -> None:
        """A client gone: its blocks back at once, nothing of it kept."""
        if seq.status == "running":
            self.running.remove(seq)
            seq.req.length = seq.computed
            self.cache.cancel(seq.req)
            seq.req = None
        elif seq.status == "waiting":
            self.waiting.remove(seq)
        else:
            raise ValueError(f"sequence {seq.id} has already ended ({seq.status}); a sequence "
                             "ends once")
        seq.status, seq.finish_reason = "cancelled", "cancelled"

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
