"""The Results page's store sections: one run's exports, and two runs compared point by point.

  downloads(run, key)     CSV of a table, JSON Lines of every timed sample and a Markdown table
                          (``instruments.store.exports``), with the Markdown shown to copy
  default_pair(runs)      which two runs to compare first: the newest, and the earlier run that
                          shares the most points with it (ties: the newest)
  comparison(by_label)    pick two runs of one experiment; per point new ÷ old with its noise
                          band, flagged regressions and improvements, a chart
                          (``instruments.store.compare``, ``ui.figures.compare_figure``)
Reads runs already loaded; measures nothing. Torch-free.
"""

from __future__ import annotations

import re
from typing import Any

import pandas as pd
import streamlit as st

from instruments.store import compare, exports
from ui.figures import compare_figure
from ui.metrics import GLOSSARY, definitions


def _stem(run: dict[str, Any]) -> str:
    name = str(run.get("path") or run.get("run_id") or "run").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name.removesuffix(".json"))


def downloads(run: dict[str, Any], key: str) -> None:
    """The three exports of ``run``, its main table preselected."""
    tables = [name for name, rows in exports.tables_of(run).items() if rows]
    if not tables:
        st.caption("This run has no table to export.")
        return
    main = exports.main_table(run) if tables else None
    c0, c1, c2, c3 = st.columns([2, 1, 1, 1], vertical_alignment="bottom")
    table = c0.selectbox("Table to export", tables, index=tables.index(main) if main in tables
                         else 0, key=f"{key}_table")
    stem = _stem(run)
    c1.download_button("CSV", exports.table_csv(run, table), f"{stem}_{table}.csv", "text/csv",
                       key=f"{key}_csv", icon=":material/download:", width="stretch")
    c2.download_button("JSON Lines", exports.samples_jsonl(run), f"{stem}_samples.jsonl",
                       "application/jsonl", key=f"{key}_jsonl", icon=":material/download:",
                       width="stretch", help="One record per timed sample: run id, experiment, "
                       "mode, context, sample ms, disturbed or not.")
    markdown = exports.table_markdown(run, table)
    c3.download_button("Markdown", markdown + "\n", f"{stem}_{table}.md", "text/markdown",
                       key=f"{key}_md", icon=":material/download:", width="stretch")
    with st.expander("Markdown to paste into an issue"):
        st.code(markdown, language="markdown")


def _points(run: dict[str, Any]) -> set[tuple]:
    out = set()
    for m in compare.MEASURES.get(str(run.get("kind")), ()):
        for r in (run.get("tables") or {}).get(m.table) or []:
            out.add((m.table, *(r.get(k) for k in m.keys)))
    return out


def default_pair(runs: list[dict[str, Any]]) -> tuple[int, int]:
    """(old, new) indices into ``runs`` (newest first, at least two)."""
    mine = _points(runs[0])
    shared = [len(mine & _points(r)) for r in runs[1:]]
    return 1 + shared.index(max(shared)), 0


def comparison(by_label: dict[str, dict[str, Any]]) -> None:
    """The comparison section (``by_label``: the page's runs, newest first)."""
    usable = {label: run for label, run in by_label.items() if compare.comparable(run)}
    kinds = sorted({str(r["kind"]) for r in usable.values()
                    if sum(o["kind"] == r["kind"] for o in usable.values()) >= 2})
    if not kinds:
        st.caption("Two saved runs of the same experiment (latency sweeps, end-to-end runs or "
                   "bench runs) are needed for a comparison.")
        return
    c0, c1, c2, c3 = st.columns([1.3, 3, 3, 1.2], vertical_alignment="bottom")
    kind = c0.selectbox("Experiment", kinds, key="compare_kind")
    labels = [label for label, run in usable.items() if run["kind"] == kind]
    old_i, new_i = default_pair([usable[label] for label in labels])
    old = c1.selectbox("Old run", labels, index=old_i, key=f"compare_old_{kind}")
    new = c2.selectbox("New run", labels, index=new_i, key=f"compare_new_{kind}")
    floor = c3.number_input("Noise floor (%)", 0.0, 500.0, compare.DEFAULT_FLOOR * 100, 1.0,
                            key="compare_floor", help=GLOSSARY["noise band"])
    if old == new:
        st.info("Pick two different runs.")
        return
    got = compare.compare(usable[old], usable[new], floor / 100)
    bad, good = got.regressions, got.improvements
    if bad:
        st.error(f"{len(bad)} point(s) regressed beyond their noise: "
                 + ", ".join(f"{r['point']} ×{r['ratio']:.2f}" for r in bad[:6])
                 + (" …" if len(bad) > 6 else ""), icon=":material/trending_down:")
    elif good:
        st.success(f"No regression; {len(good)} point(s) improved beyond their noise.")
    else:
        st.info(f"No point moved beyond its noise ({got.headline()}).")
    for note in got.notes:
        st.warning(note)
    df = pd.DataFrame(got.rows)
    first = df["table"].iloc[0] if not df.empty else None
    if first is not None and df.loc[df["table"] == first, "ratio"].notna().any():
        st.plotly_chart(compare_figure(df[df["table"] == first]), width="stretch",
                        key="compare_chart")
        st.caption(f"New ÷ old per point of the {first} table, each over the grey band its own "
                   "samples allow (for a time, above 1 is slower; for tokens/s, below 1): "
                   "crosses are regressions, diamonds improvements.")
    st.dataframe(df[["point", "old", "new", "unit", "ratio", "noise", "verdict"]],
                 hide_index=True, column_config={
                     "old": st.column_config.NumberColumn("old", format="%.4g"),
                     "new": st.column_config.NumberColumn("new", format="%.4g"),
                     "ratio": st.column_config.NumberColumn("new ÷ old", format="%.3f",
                                                            help=GLOSSARY["new ÷ old"]),
                     "noise": st.column_config.NumberColumn("noise band (±)", format="percent",
                                                            help=GLOSSARY["noise band"])})
    left, right = st.columns([1, 3], vertical_alignment="center")
    with left:
        definitions(["new ÷ old", "noise band"])
    right.caption(f"The same from a terminal: `python -m instruments compare {_stem(usable[old])} "
                  f"{_stem(usable[new])}` (exit code 1 when a point regressed).")
