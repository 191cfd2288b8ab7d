"""Results: every saved run, several overlaid on one chart, downloads, and files that failed.

Reads ``instruments.store.results.load_runs(results_dir())`` (never raises: bad files come back as
skipped with the reason) and the write-up's A40 reference (``reference_run``); overlays the selected
runs' "latency" tables with ``ui.figures.overlay_figure``. The inspected run exports as CSV, JSON
Lines and Markdown, and two runs of one experiment compare point by point (``ui.compare``).
Nothing here measures anything.
"""

from __future__ import annotations

import json

import pandas as pd
import streamlit as st

from instruments.store.frames import run_label, table_frame
from instruments.store.results import ResultsError, reference_run
from ui import header
from ui.compare import comparison, downloads
from ui.figures import overlay_figure
from ui.runs import run_json, saved_runs
from ui.state import results_dir

REFERENCE = "write-up's A40 (published)"

folder = results_dir()
header.page("Results", f"Every run saved in `{folder}` (and the shipped examples in "
            "docs/runs/examples/): every experiment from the app and from the command line, "
            "from this machine or copied from others.")
loaded = saved_runs()
runs = list(reversed(loaded.runs))  # newest first


def _labels(items: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for run in items:
        label = run_label(run)
        if run.get("kind") != "latency_sweep":
            label = f"{run.get('kind')} · {label}"
        if label in out:
            label = f"{label} [{str(run.get('run_id'))[:6]}]"
        out[label] = run
    return out


def _modes(run: dict) -> str:
    meta = run.get("meta") or {}
    modes = meta.get("modes") or list(dict.fromkeys(
        str(r.get("mode")) for r in (run.get("tables") or {}).get("latency", [])))
    return ", ".join(modes) if modes else "—"


by_label = _labels(runs)
if runs:
    summary = pd.DataFrame([{
        "date (UTC)": str(r.get("created_utc", ""))[:19].replace("T", " "),
        "kind": r.get("kind"),
        "device": (r.get("meta") or {}).get("device_name") or (r.get("meta") or {}).get("device"),
        "model": (r.get("meta") or {}).get("model"),
        "weights": (r.get("meta") or {}).get("weights"),
        "dtype": (r.get("meta") or {}).get("dtype"),
        "batch": (r.get("meta") or {}).get("batch_size"),
        "modes": _modes(r),
        "partial": bool((r.get("meta") or {}).get("partial")),
        "file": str(r.get("path", "")).rsplit("/", 1)[-1],
    } for r in runs])
else:
    summary = pd.DataFrame()

# ----------------------------------------------------------------------------- overlay chart
with_latency = {k: v for k, v in by_label.items() if (v.get("tables") or {}).get("latency")}
c1, c2, c3, c4 = st.columns([4, 1.4, 0.8, 0.8], vertical_alignment="bottom")
chosen = c1.multiselect("Runs to overlay", list(with_latency),
                        default=list(with_latency)[:1], key="results_pick",
                        help="Latency sweeps only; colour = decode mode, line style = run.")
with_ref = c2.toggle("write-up's A40", True, key="results_ref",
                     help="The write-up's published per-token latencies (GPT-2 small, A40).")
log_x = c3.toggle("log x", False, key="results_logx")
log_y = c4.toggle("log y", True, key="results_logy")
selected = [with_latency[k] for k in chosen]
labels = {id(with_latency[k]): k for k in chosen}
if with_ref:
    try:
        ref = reference_run()
        selected.append(ref)
        labels[id(ref)] = REFERENCE
    except ResultsError as exc:
        st.warning(f"The reference run could not be read: {exc}")
frame = table_frame(selected, "latency")
if not frame.empty:
    frame["label"] = [labels.get(id(r), run_label(r)) for r in selected
                      for _ in (r.get("tables") or {}).get("latency") or []]
    st.plotly_chart(overlay_figure(frame, log_x=log_x, log_y=log_y), width="stretch")
    st.caption("Per-token latency of each selected run: colour is the decode mode, line style "
               "the run. Different machines differ in level and shape; compare the shapes.")
    d1, d2, _ = st.columns([1, 1, 3])
    csv = frame.drop(columns=["samples_ms", "set_aside_ms", "set_aside_why"],
                     errors="ignore").to_csv(index=False)
    d1.download_button("Download CSV", csv, "latency_runs.csv", "text/csv", key="results_csv",
                       icon=":material/download:")
    d2.download_button("Download JSON", "[" + ",\n".join(run_json(r) for r in selected) + "]",
                       "runs.json", "application/json", key="results_json",
                       icon=":material/download:")
else:
    st.info("Nothing to draw: choose a run (or the reference). Sweeps saved on the **Latency "
            "sweep** page appear here.")

# ----------------------------------------------------------------------------- tables
st.subheader(f"Saved runs ({len(runs)})")
if summary.empty:
    st.caption(f"No run saved in {folder} yet.")
else:
    st.dataframe(summary, hide_index=True, column_config={
        "partial": st.column_config.CheckboxColumn("partial", help="stopped before the end")})
    pick = st.selectbox("Inspect one run", list(by_label), key="results_inspect")
    run = by_label[pick]
    tables = run.get("tables") or {}
    with st.expander(f"Tables of {pick}"):
        for name, rows in tables.items():
            st.markdown(f"**{name}** ({len(rows)} rows)")
            st.dataframe(pd.DataFrame(rows), hide_index=True)
        st.json(json.loads(run_json({**run, "tables": {}})), expanded=False)
    downloads(run, "results_export")
    st.subheader("Compare two runs")
    comparison(by_label)
if loaded.skipped:
    st.subheader(f"Files that could not be read ({len(loaded.skipped)})")
    st.dataframe(pd.DataFrame([{"file": p.rsplit("/", 1)[-1], "reason": why}
                               for p, why in loaded.skipped]), hide_index=True)
    st.caption("These files are left untouched; fix or delete them by hand.")
