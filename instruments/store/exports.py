"""A saved run in the formats other tools read: CSV, JSON Lines, Markdown. Torch-free.

  main_table(run)             the table a run is about ("latency" of a sweep, "bench", ...)
  table_csv(run, table)       the table, one row per line; list fields as JSON text
  samples_jsonl(run, table)   one JSON record per timed sample (of every table keeping them)
  table_markdown(run, table)  a pipe table to paste into an issue (list fields left out)
  export(run, fmt, table)     one of them by name: "csv" | "jsonl" | "md"
  read_jsonl(text)            the records back

A JSON Lines record (llama-bench's and llmperf's per-request lines are the model) carries the
run (``run_id``, ``experiment``, ``created_utc``, ``model``, ``device_name``, ``dtype``), the
point (``mode`` or ``engine``, ``context_len``, ``phase``, ``batch_size``, ``test``,
``depth``... whichever the row has), ``table``, ``sample_index``, ``sample_ms`` and whether the
sample was disturbed: a sample the CPU watch set aside is ``set_aside: true, disturbed: true``
with its ``why``; a kept one is ``disturbed: false`` when its point kept no disturbed sample on a
CPU, and ``null`` when that is not known (its point kept some without saying which, or no watch
ran: a GPU, an older run). Samples come from a row's ``samples_ms`` (and ``set_aside_ms``), an
end-to-end row's ``samples_s`` (whole generations, in ms here) and a ``cumulative`` row's
``step_ms`` (one step of the median generation).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from typing import Any

from instruments.store import stats

FORMATS = ("csv", "jsonl", "md")
MAIN_TABLES = {"latency_sweep": "latency", "end_to_end": "end_to_end", "bench": "bench",
               "reference": "latency"}
# Row fields that say which point a sample belongs to, copied into its JSON Lines record.
POINT_FIELDS = ("mode", "engine", "test", "label", "phase", "context_len", "depth", "n_tokens",
                "prompt_len", "new_tokens", "step", "batch_size")
RUN_FIELDS = ("model", "device_name", "dtype")
# What a Markdown table of these tables shows (the fields other tools name the same way); any
# other table shows all its scalar fields.
MARKDOWN_COLUMNS = {
    "latency": ("mode", "context_len", "latency_ms", "p50_ms", "p90_ms", "p99_ms", "samples_n",
                "spread_ms", "mbu", "mfu", "mbu_listed", "mfu_listed"),
    "end_to_end": ("mode", "prompt_len", "new_tokens", "ttft_ms", "tpot_ms", "tpot_p50_ms",
                   "tpot_p90_ms", "tpot_p99_ms", "e2e_ms", "output_tokens_per_s",
                   "joules_per_token", "avg_watts"),
    "bench": ("mode", "label", "tokens_per_s", "tokens_per_s_sd", "median_ms", "samples_n",
              "joules_per_token"),
}


class ExportError(ValueError):
    """A table or format that the run does not have; the message says what it has."""


def tables_of(run: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    return {k: v for k, v in (run.get("tables") or {}).items() if isinstance(v, list)}


def main_table(run: dict[str, Any]) -> str:
    """The table a run is about: its kind's own, else its first table with rows."""
    tables = tables_of(run)
    own = MAIN_TABLES.get(str(run.get("kind")))
    if own in tables:
        return own
    filled = [name for name, rows in tables.items() if rows]
    if not filled:
        raise ExportError("this run has no table with rows")
    return filled[0]


def _rows(run: dict[str, Any], table: str | None) -> tuple[str, list[dict[str, Any]]]:
    tables = tables_of(run)
    name = table or main_table(run)
    if name not in tables:
        raise ExportError(f"no table {name!r} in this run; it has: {', '.join(tables) or 'none'}")
    return name, tables[name]


def _columns(rows: list[dict[str, Any]], scalars_only: bool = False) -> list[str]:
    cols: dict[str, None] = {}
    for r in rows:
        for k, v in r.items():
            if not (scalars_only and isinstance(v, (list, dict))):
                cols.setdefault(k)
    if scalars_only:  # a column that is a list in any row is left out of every row
        lists = {k for r in rows for k, v in r.items() if isinstance(v, (list, dict))}
        return [c for c in cols if c not in lists]
    return list(cols)


def table_csv(run: dict[str, Any], table: str | None = None) -> str:
    """``table`` (default ``main_table``) as CSV: a header of every field, lists as JSON text."""
    _, rows = _rows(run, table)
    cols = _columns(rows)
    out = io.StringIO()
    writer = csv.DictWriter(out, cols, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else
                         ("" if v is None else v) for k, v in r.items()})
    return out.getvalue()


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def table_markdown(run: dict[str, Any], table: str | None = None,
                   columns: list[str] | None = None) -> str:
    """``table`` as a Markdown pipe table: ``columns``, else the table's ``MARKDOWN_COLUMNS``
    that its rows have, else every scalar field; floats to 4 significant digits."""
    name, rows = _rows(run, table)
    present = _columns(rows, scalars_only=True)
    cols = columns or [c for c in MARKDOWN_COLUMNS.get(name, ()) if c in present] or present
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(" --- " for _ in cols) + "|"]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    short = [c for c in cols if re.search(r"(^|_)p\d\d_", c) and any(r.get(c) is None
                                                                 for r in rows)]
    if short:
        need = ", ".join(f"p{q} at least {n}" for q, n in stats.MIN_SAMPLES.items() if n > 1)
        lines.append(f"\n– in {', '.join(short)}: too few samples for that percentile ({need}).")
    return "\n".join(lines)


def _disturbed(row: dict[str, Any], cpu: bool) -> bool | None:
    """A kept sample's verdict: False only where a CPU watch ran and kept nothing disturbed."""
    if not cpu or "disturbed_kept" not in row:
        return None
    return False if not row.get("disturbed_kept") else None


def sample_records(run: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per timed sample (see the module docstring)."""
    meta = run.get("meta") or {}
    cpu = str(meta.get("device") or "").startswith("cpu")
    base = {"run_id": run.get("run_id"), "experiment": meta.get("experiment") or run.get("kind"),
            "created_utc": run.get("created_utc"), **{k: meta.get(k) for k in RUN_FIELDS}}
    out: list[dict[str, Any]] = []
    for name, rows in tables_of(run).items():
        for row in rows:
            point = {k: row[k] for k in POINT_FIELDS if k in row}
            kept: list[float] = []
            if isinstance(row.get("samples_ms"), list):
                kept = [float(x) for x in row["samples_ms"] if x is not None]
            elif isinstance(row.get("samples_s"), list):
                kept = [float(x) * 1e3 for x in row["samples_s"] if x is not None]
            elif isinstance(row.get("step_ms"), (int, float)):
                kept = [float(row["step_ms"])]
            aside = row.get("set_aside_ms") if isinstance(row.get("set_aside_ms"), list) else []
            why = row.get("set_aside_why") or []
            verdict = _disturbed(row, cpu)
            for i, ms in enumerate(kept):
                out.append({**base, "table": name, **point, "sample_index": i, "sample_ms": ms,
                            "set_aside": False, "disturbed": verdict})
            for i, ms in enumerate(aside):
                out.append({**base, "table": name, **point, "sample_index": len(kept) + i,
                            "sample_ms": float(ms), "set_aside": True, "disturbed": True,
                            "why": why[i] if i < len(why) else None})
    return out


def samples_jsonl(run: dict[str, Any], table: str | None = None) -> str:
    """``sample_records`` (of one table, if named) as JSON Lines, NaN written as null."""
    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and not math.isfinite(v) else v

    if table is not None:
        _rows(run, table)  # an unknown table is refused with what the run has
    return "".join(json.dumps({k: clean(v) for k, v in rec.items()}) + "\n"
                   for rec in sample_records(run) if table is None or rec["table"] == table)


def read_jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def export(run: dict[str, Any], fmt: str, table: str | None = None) -> str:
    """The run as ``fmt``: "csv" (a table), "jsonl" (every sample), "md" (a table)."""
    if fmt == "csv":
        return table_csv(run, table)
    if fmt == "md":
        return table_markdown(run, table) + "\n"
    if fmt == "jsonl":
        return samples_jsonl(run, table)
    raise ExportError(f"unknown format {fmt!r}; allowed: {', '.join(FORMATS)}")
