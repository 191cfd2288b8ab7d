"""Runs as tables: a short label per run, and one table across runs as a DataFrame.

``run_label(run)`` names a run for a menu or a legend; ``table_frame(runs, table)`` stacks one
table of many runs (from ``instruments.store.results``) with the run-level columns on every row, so
runs from different machines line up. Pure functions over run dicts; no files are read here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd

# Run-level columns `table_frame` adds to every row, so runs from different machines line up.
RUN_COLUMNS = (
    "run_id", "kind", "model", "device_name", "dtype", "batch_size", "weights", "created_utc",
    "label",
)


def run_label(run: dict[str, Any]) -> str:
    """Short human label: meta "label" if set, else device · model · dtype · batch · date."""
    meta = run.get("meta") or {}
    if meta.get("label"):
        return str(meta["label"])
    parts = [
        str(meta.get("device_name") or meta.get("device") or "unknown device"),
        str(meta.get("model") or "?"),
        str(meta.get("dtype") or "?"),
    ]
    if meta.get("batch_size") is not None:
        parts.append(f"batch {meta['batch_size']}")
    parts.append(str(run.get("created_utc", ""))[:16].replace("T", " "))
    label = " · ".join(p for p in parts if p)
    return label + (" (partial)" if meta.get("partial") else "")


def table_frame(runs: list[dict[str, Any]], table: str) -> pd.DataFrame:
    """`table` from every run that has it, one DataFrame, with the RUN_COLUMNS added per row.

    A row's own field wins over the run's (a batch sweep's rows carry their own batch_size);
    the run's value fills it only where the row has none. Empty frame (with RUN_COLUMNS) if none.
    """
    import pandas as pd  # here, not at import: a first page that only names runs skips it

    frames = []
    for run in runs:
        rows = (run.get("tables") or {}).get(table) or []
        if not rows:
            continue
        frame = pd.DataFrame(rows)
        meta = run.get("meta") or {}
        values = {
            "run_id": run.get("run_id"),
            "kind": run.get("kind"),
            "created_utc": run.get("created_utc"),
            "label": run_label(run),
            **{k: meta.get(k) for k in ("model", "device_name", "dtype", "batch_size", "weights")},
        }
        for column, value in values.items():
            if column not in frame.columns:
                frame[column] = value
            elif value is not None:
                frame[column] = frame[column].where(frame[column].notna(), value)
        frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=list(RUN_COLUMNS))
    return pd.concat(frames, ignore_index=True, sort=False)
