"""Saved runs for the pages: listing them, picking a sweep, offering downloads. Torch-free.

Runs are written by ``instruments.process.client`` when a job ends (the same schema-1 files the CLI
writes); pages read them here: ``saved_runs()`` (results/ and the shipped examples,
docs/runs/examples/), ``pick_sweep_run`` (this session's last sweep, any saved one, or the
write-up's A40 figures), ``latency_frame`` (a sweep's rows with formula FLOPs/bytes filled where
absent) and ``download_buttons``.
"""

from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING, Any

import streamlit as st

from instruments import lineup
from instruments.costmodel import costs
from instruments.store import exports
from instruments.store.frames import run_label
from instruments.store.results import (
    EXAMPLES_PATH,
    LoadResult,
    ResultsError,
    load_runs,
    reference_run,
)
from ui.state import results_dir

if TYPE_CHECKING:
    import pandas as pd


def run_json(run: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in run.items() if k != "path"}, indent=1, default=str)


def download_buttons(run: dict[str, Any] | None, table: str, stem: str, key: str) -> None:
    """CSV of one table (``instruments.store.exports``: lists as JSON text) and JSON of the
    whole run, side by side."""
    if not run:
        return
    rows = (run.get("tables") or {}).get(table) or []
    left, right, _ = st.columns([1, 1, 3])
    left.download_button("Download CSV", exports.table_csv(run, table) if rows else "",
                         file_name=f"{stem}.csv", mime="text/csv", key=f"{key}_csv",
                         disabled=not rows, icon=":material/download:")
    right.download_button("Download JSON", run_json(run), file_name=f"{stem}.json",
                          mime="application/json", key=f"{key}_json", icon=":material/download:")


def latency_frame(run: dict[str, Any]) -> pd.DataFrame:
    """A run's "latency" rows, with formula FLOPs/bytes and achieved rates filled where absent.

    Saved sweeps carry them already; the reference run (published A40 numbers) has only
    latencies, so they are computed from ``instruments.costmodel.costs`` for the run's model shape.
    """
    import pandas as pd  # here, as in ui.jobs.rows

    rows = pd.DataFrame((run.get("tables") or {}).get("latency") or [])
    if rows.empty:
        return rows
    meta = run.get("meta") or {}
    config = meta.get("config") or {}
    try:
        cfg = (lineup.config_from_dict(config, meta.get("family")) if config
               else lineup.config(meta.get("model") or "gpt2"))
    except (TypeError, ValueError):
        cfg = lineup.config("gpt2")
    dtype = meta.get("dtype") or "float32"
    batch = int(meta.get("batch_size") or 1)
    cached = rows["mode"].astype(str).map(lambda m: m not in lineup.uncached())
    if "flops" not in rows.columns:
        rows["flops"] = [costs.step_flops(cfg, int(t), cached=bool(c), batch_size=batch)
                         for t, c in zip(rows["context_len"], cached, strict=True)]
    if "bytes" not in rows.columns:
        rows["bytes"] = [costs.step_bytes(cfg, dtype, int(t), cached=bool(c), batch_size=batch,
                                          last_only=bool((s := lineup.mode_spec(m))
                                                         and not s.cached
                                                         and not s.logits_all),
                                          storage=s.weight_storage if s else "")
                         for t, c, m in zip(rows["context_len"], cached, rows["mode"],
                                            strict=True)]
    seconds = rows["latency_ms"].astype(float) / 1e3
    if "tflops" not in rows.columns:
        rows["tflops"] = rows["flops"] / seconds / 1e12
    if "gbps" not in rows.columns:
        rows["gbps"] = rows["bytes"] / seconds / 1e9
    return rows


def session_sweep_run() -> dict[str, Any] | None:
    """The last sweep of this session as a run (saved or not), None if there is none."""
    job = st.session_state.get("sweep_job")
    if job is None:
        return None
    if job.run is not None:
        return job.run
    if not job.tables.get("latency"):
        return None
    return {"run_id": "session", "kind": "latency_sweep", "created_utc": "",
            "meta": {**(job.meta or {}), "partial": True},
            "tables": {"latency": list(job.tables["latency"])}}


def pick_sweep_run(key: str) -> dict[str, Any] | None:
    """A selectbox over this session's last sweep, the saved sweeps and the A40 reference."""
    options: dict[str, dict[str, Any]] = {}
    mine = session_sweep_run()
    if mine is not None:
        options["this session's last sweep" + (" (running)" if mine["run_id"] == "session"
                                               else "")] = mine
    loaded = saved_runs()
    for run in reversed(loaded.runs):
        if (run.get("tables") or {}).get("latency"):
            options[run_label(run)] = run
    with contextlib.suppress(ResultsError):
        options["write-up's A40 (published)"] = reference_run()
    if not options:
        return None
    label = st.selectbox("Data", list(options), key=key,
                         help="The last sweep of this session, any saved sweep in "
                         f"{results_dir()}, or the write-up's published A40 numbers.")
    return options[label]


def saved_runs() -> LoadResult:
    """Runs saved in results/ plus the shipped examples (docs/runs/examples/), oldest first.

    The published A40 figures (results/reference/) are not listed here: pages offer them apart.
    """
    loaded = load_runs(results_dir())
    more = load_runs(EXAMPLES_PATH)  # a missing folder is an empty result
    loaded.runs.extend(more.runs)
    loaded.skipped.extend(more.skipped)
    loaded.runs.sort(key=lambda run: str(run.get("created_utc", "")))
    return loaded


def last_sweep_like(model: str, device_name: str, dtype: str, threads: int,
                    batch: int, kind: str = "latency_sweep") -> dict[str, Any] | None:
    """The newest complete run of ``kind`` (a sweep: what the estimate before Run is fitted on;
    a step prediction: the calibration a sweep's chart can overlay) of this model on this
    device, dtype, threads and batch (None when there is none yet)."""
    for run in reversed(saved_runs().runs):
        meta = run.get("meta") or {}
        if (run.get("kind") == kind and not meta.get("partial")
                and meta.get("model") == model and meta.get("device_name") == device_name
                and meta.get("dtype") == dtype and meta.get("threads") == threads
                and int(meta.get("batch_size") or 1) == batch):
            return run
    return None
