"""What a sweep says about its disturbed samples, once its points are taken.

``note_disturbed(tracker, budget) -> counts`` sums the latency rows' retake fields (set aside
and taken again, flagged but kept in line, kept out of line, confirmed by a prediction) and the
retake budget's spending into ``meta.retakes``, and adds a note per kind that occurred.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from instruments.spine import Tracker

if TYPE_CHECKING:
    from instruments.measure.sampler import RetakeBudget


def note_disturbed(tr: Tracker, budget: RetakeBudget | None) -> dict[str, Any]:
    """Say how many flagged samples were retaken, kept in line, kept out of line; the counts
    (meta.retakes)."""
    rows = tr.tables.get("latency", [])
    out = {"retaken": sum(len(r.get("set_aside_ms", [])) for r in rows),
           "flagged_consistent": sum(r.get("flagged_consistent", 0) for r in rows),
           "disturbed_kept": sum(r.get("disturbed_kept", 0) for r in rows),
           "confirmed_by_prediction": sum(r.get("confirmed_by") == "prediction" for r in rows),
           "retake_s": budget.spent_s if budget is not None else 0.0,
           "budget_share": budget.share if budget is not None else None,
           "budget_refused": budget.refused if budget is not None else 0}
    if out["retaken"]:
        tr.note(f"{out['retaken']} sample(s) set aside and taken again: another process used "
                "the CPU while they ran and they were out of line with the point's other "
                "samples or its prediction (every one is kept in the run, beside its point)")
    if out["flagged_consistent"]:
        tr.note(f"{out['flagged_consistent']} sample(s) were flagged as disturbed but agreed "
                "with their point's other samples or its prediction: kept")
    if out["disturbed_kept"]:
        tr.note(f"{out['disturbed_kept']} sample(s) were disturbed and kept out of line: the "
                "retakes or their budget ran out; the medians they enter may be high")
    return out
