"""The latency sweep's gate in two halves, so the first point does not wait for the long one.

``SweepGate(model, params, contexts, tr)``: ``first(name)`` runs a mode's short half (the short
context, the multi-token append, the greedy tokens) before its first point; ``long_half(names)``,
called once the first context is on the chart, runs the long context (512 tokens where the model
allows: seconds of uncached forwards on gpt2) for every mode timed so far. A mode that fails it
has its points withheld: dropped from the rows the run will keep, with a note, and its remaining
contexts counted as done. Each half's verdict replaces the mode's row in the ``checks`` table, so
the saved row covers every stage that ran. Method "generate" gates whole, before timing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from instruments.spine import Tracker

if TYPE_CHECKING:
    from engine.models.base import CausalLM


class SweepGate:
    """One sweep's gate (see the module docstring); ``seconds`` is the time it took."""

    def __init__(self, model: CausalLM, params: Any, contexts: list[int], tr: Tracker) -> None:
        from instruments.checks import gate

        self.checker = gate.Gate(model, params.batch_size, params.prompt_seed)
        self.tr, self.contexts = tr, contexts
        self.whole = params.method == "generate"
        self.long_done = self.whole
        self.seconds = 0.0

    def check(self, name: str, half: str) -> bool:
        """One half of the gate for ``name``; a failure withholds its points."""
        tr = self.tr
        tr.emit(f"{name}: checking its logits against mode 1"
                + ("" if half == "both" else f" ({half} context)"))
        t0 = time.perf_counter()
        check = self.checker.check(name, half)
        self.seconds += time.perf_counter() - t0
        checks = tr.tables.setdefault("checks", [])
        checks[:] = [c for c in checks if c["mode"] != name] + [check.to_row()]
        if not check.passed:
            rows = tr.tables.get("latency", [])
            withheld = [r for r in rows if r["mode"] == name]
            tr.tables["latency"] = [r for r in rows if r["mode"] != name]
            tr.done += len(self.contexts) - len(withheld)
            tr.note(f"{name}: its {len(withheld)} point(s) withheld, they failed the gate's "
                    f"long half: {check.detail}" if withheld else
                    f"{name} not timed: {check.detail}")
        return check.passed

    def first(self, name: str) -> bool:
        """The gate before a mode's first point: the short half (whole for "generate")."""
        return self.check(name, "both" if self.whole else "short")

    def due(self, t: int) -> bool:
        """Whether the long half should run before timing context ``t``."""
        return not self.long_done and t > self.contexts[0]

    def long_half(self, names: list[str]) -> list[str]:
        """The long context for ``names``; those that failed it (their points withheld)."""
        self.long_done = True
        return [name for name in names if not self.check(name, "long")]

    def finish(self, names: list[str], stopped: bool) -> None:
        """After the sweep: the long half if it never ran (a sweep of one context), or a note
        that it could not (stopped)."""
        if self.long_done:
            return
        if not stopped:
            self.long_half(names)
        else:
            self.long_done = True
            self.tr.note("stopped before the gate's long context ran: the modes timed were "
                         f"checked at {self.checker.short} tokens only")
