"""What a sweep says about its disturbed samples, once its points are taken.

``note_disturbed(tracker, budget) -> counts`` sums the latency rows' retake fields (set aside
and taken again, flagged but kept in line, kept out of line, confirmed by a prediction) and the
retake budget's spending into ``meta.retakes``, and adds a note per kind that occurred;
``merged(notes)`` is several sweeps' notes as one run's (each kind once, its counts summed).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
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


_COUNTED = re.compile(r"(\d+) (sample\(s\) .*)", re.S)


def merged(notes: Iterable[str]) -> list[str]:
    """Several sweeps' notes as one run's, in first-seen order: a note once, and a counted one
    ("3 sample(s) set aside ...") once with its counts summed (the predicted step's passes each
    say theirs; three lines that differ only in a number read as three events)."""
    counts: dict[str, int | None] = {}
    for note in notes:
        m = _COUNTED.fullmatch(note)
        text, n = (m[2], int(m[1])) if m else (note, None)
        if n is not None and counts.get(text) is not None:
            counts[text] = int(counts[text] or 0) + n
        else:
            counts.setdefault(text, n)
    return [text if n is None else f"{n} {text}" for text, n in counts.items()]
