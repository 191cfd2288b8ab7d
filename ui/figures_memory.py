"""Pure builders for the Memory page and the Correctness lab: DataFrames in, plotly Figures out.

Memory rows follow ``instruments.measure.memory`` (bytes everywhere, shown in MiB = 2**20 B):
  breakdown  component, bytes, source (+ optional bar: one stacked bar per value)
  KV         context_len, kv_formula_bytes, kv_tensor_bytes, allocated_delta_bytes,
             reserved_delta_bytes, rss_delta_bytes (None where not measurable), baseline
  crossover  batch_size, context_len, kv_bytes, weights_bytes
  masks      kind, bytes
Correctness rows: bug, check, passed (bool), detail. No Streamlit, no measurement.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ui.figures import MIB, style

COMPONENT_COLORS = {
    "weights": "#4c78a8", "kv cache": "#f58518", "causal-mask buffers": "#e45756",
    "cublas workspace": "#72b7b2", "activations (transient peak)": "#54a24b",
    "allocator slack": "#b279a2", "process, not accounted above": "#bab0ac",
}
PALETTE = ("#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#b279a2", "#eeca3b")


def component_color(name: str, i: int = 0) -> str:
    return COMPONENT_COLORS.get(str(name).lower(), PALETTE[i % len(PALETTE)])


def breakdown_figure(df: pd.DataFrame) -> go.Figure:
    """Stacked horizontal bars: where the bytes go. One bar per value of the optional ``bar``
    column (e.g. "formula" and "measured"), one colour per component across bars."""
    fig = go.Figure()
    if "bar" not in df.columns:
        df = df.assign(bar="memory")
    bars = list(dict.fromkeys(df["bar"].astype(str)))
    totals = {b: float(df[df["bar"] == b]["bytes"].sum()) / MIB for b in bars}
    components = list(dict.fromkeys(df["component"].astype(str)))
    for i, comp in enumerate(components):
        part = df[df["component"].astype(str) == comp]
        mib = part["bytes"].astype(float) / MIB
        share = [100.0 * m / totals[b] if totals[b] else 0.0 for m, b in zip(mib, part["bar"],
                                                                             strict=True)]
        source = part["source"].astype(str) if "source" in part.columns else [""] * len(part)
        fig.add_trace(go.Bar(
            x=mib, y=part["bar"].astype(str), orientation="h", name=comp,
            marker_color=component_color(comp, i),
            text=[f"{comp} {m:,.1f}" if s > 8 else "" for m, s in zip(mib, share,
                                                                        strict=True)],
            textposition="inside", insidetextanchor="middle",
            customdata=np.stack([share, list(source)], axis=-1),
            hovertemplate=f"{comp}<br>%{{x:,.2f}} MiB (%{{customdata[0]:.1f}}% of the bar)"
            "<br>%{customdata[1]}<extra>%{y}</extra>"))
    fig.update_layout(barmode="stack", legend_traceorder="normal")
    title = " · ".join(f"{b}: {t:,.0f} MiB" for b, t in totals.items())
    return style(fig, f"MiB ({title})", "", height=160 + 60 * len(bars), legend=None)


def kv_memory_figure(df: pd.DataFrame, baseline: str | None = None,
                     log_y: bool = False) -> go.Figure:
    """Figure 6: KV cache bytes against context by formula, by tensor sizes, by the allocator.

    ``baseline`` picks rows of one baseline (e.g. "after warm-up" or "before warm-up") when the
    frame holds both.
    """
    if baseline is not None and "baseline" in df.columns:
        df = df[df["baseline"].astype(str) == baseline]
    df = df.sort_values("context_len") if not df.empty else df
    fig = go.Figure()
    series = [
        ("kv_formula_bytes", "formula 2·L·K/V heads·hs·bytes", dict(mode="lines"),
         dict(color="#333", dash="dash", width=2), None),
        ("kv_mha_formula_bytes", "formula with a K/V head per query head (MHA)",
         dict(mode="lines"), dict(color="#999", dash="dot", width=2), None),
        ("kv_tensor_bytes", "requested by the cache tensors", dict(mode="markers"), None,
         dict(symbol="circle", size=8, color="#f58518")),
        ("allocated_delta_bytes", "allocator: allocated − baseline", dict(mode="markers"), None,
         dict(symbol="circle-open", size=11, color="#4c78a8", line=dict(width=2))),
        ("reserved_delta_bytes", "allocator: reserved − baseline", dict(mode="markers"), None,
         dict(symbol="square-open", size=9, color="#9ecae9", line=dict(width=1.5))),
        ("rss_delta_bytes", "process resident memory − baseline", dict(mode="markers"), None,
         dict(symbol="diamond-open", size=9, color="#54a24b", line=dict(width=2))),
    ]
    shared = ("kv_mha_formula_bytes" in df.columns and "kv_formula_bytes" in df.columns
              and (df["kv_mha_formula_bytes"] == df["kv_formula_bytes"]).all())
    for col, name, kw, line, marker in series:
        if col not in df.columns or (col == "kv_mha_formula_bytes" and shared):
            continue  # no GQA: the MHA line would lie on the formula's
        part = df[["context_len", col]].dropna()
        if part.empty:
            continue
        fig.add_trace(go.Scatter(
            x=part["context_len"], y=part[col].astype(float) / MIB, name=name, line=line,
            marker=marker, hovertemplate="%{x} tokens<br>%{y:.2f} MiB<extra>" + name
            + "</extra>", **kw))
    return style(fig, "context length (tokens)", "KV cache memory (MiB)", log_y=log_y,
                 legend=None)


def crossover_figure(df: pd.DataFrame) -> go.Figure:
    """Batch × context heat map of KV cache ÷ weights, with the line where they are equal."""
    fig = go.Figure()
    if df.empty:
        return style(fig, "context length (tokens)", "batch size (sequences)", legend=None)
    grid = df.assign(ratio=df["kv_bytes"] / df["weights_bytes"]).pivot_table(
        index="batch_size", columns="context_len", values="ratio")
    kv_mib = df.assign(mib=df["kv_bytes"] / MIB).pivot_table(
        index="batch_size", columns="context_len", values="mib")
    z = np.log10(grid.to_numpy(dtype=float))
    ticks = [v for v in (0.01, 0.1, 1, 10, 100, 1000) if z.min() - 0.5 <= np.log10(v)
             <= z.max() + 0.5]
    fig.add_trace(go.Heatmap(
        x=[str(c) for c in grid.columns], y=[str(b) for b in grid.index], z=z,
        customdata=np.dstack([grid.to_numpy(), kv_mib.to_numpy()]),
        colorscale="RdBu_r", zmid=0,
        colorbar=dict(title="KV ÷ weights", tickvals=[np.log10(v) for v in ticks],
                      ticktext=[f"{v:g}×" for v in ticks]),
        hovertemplate="batch %{y} × context %{x}<br>KV cache %{customdata[1]:.1f} MiB<br>"
        "= %{customdata[0]:.2f}× the weights<extra></extra>"))
    fig.add_trace(go.Contour(
        x=[str(c) for c in grid.columns], y=[str(b) for b in grid.index], z=z,
        contours=dict(start=0, end=0, size=1, coloring="none", showlabels=False),
        line=dict(color="black", width=3), showscale=False, name="KV cache = weights",
        hoverinfo="skip", showlegend=True))
    fig = style(fig, "context length (tokens)", "batch size (sequences)", height=440, legend=None)
    return fig.update_xaxes(type="category").update_yaxes(type="category")


def mask_figure(df: pd.DataFrame, kv_full_bytes: float | None = None) -> go.Figure:
    """The three causal-mask variants' stored bytes, side by side (MiB)."""
    fig = go.Figure()
    mib = df["bytes"].astype(float) / MIB
    fig.add_trace(go.Bar(
        x=df["kind"].astype(str), y=mib, text=[f"{v:,.2f} MiB" for v in mib],
        textposition="outside", marker_color=["#e45756", "#f58518", "#54a24b"][: len(df)],
        hovertemplate="%{x}<br>%{y:.3f} MiB<extra></extra>", name="mask buffers"))
    if kv_full_bytes:
        fig.add_hline(y=kv_full_bytes / MIB, line=dict(color="#4c78a8", dash="dash"),
                      annotation_text=f"one full-length KV cache ({kv_full_bytes / MIB:.3g} MiB)",
                      annotation_position="top right")
    top = max([float(mib.max()) if len(mib) else 0.0, (kv_full_bytes or 0) / MIB]) * 1.2
    fig = style(fig, "mask variant", "stored mask bytes (MiB)", height=340, legend=None)
    return fig.update_yaxes(range=[0, top or 1])


def check_matrix_figure(df: pd.DataFrame) -> go.Figure:
    """Which check catches which bug: rows = bug switched on, columns = check; red = failed,
    grey = the check could not run or could not tell (``passed`` is None: neither caught nor
    missed; the detail says which)."""
    bugs = list(dict.fromkeys(df["bug"].astype(str)))
    checks = list(dict.fromkeys(df["check"].astype(str)))
    state = df["passed"].map(lambda p: 0.5 if p is None or p != p else 0.0 if p else 1.0)
    table = df.assign(state=state).pivot_table(
        index="bug", columns="check", values="state", aggfunc="max").reindex(
        index=bugs, columns=checks)
    z = table.to_numpy(dtype=float)
    inconclusive = df.assign(inc=df["detail"].astype(str).str.startswith("inconclusive")) \
        .pivot_table(index="bug", columns="check", values="inc", aggfunc="max") \
        .reindex(index=bugs, columns=checks).to_numpy(dtype=object)
    text = [["FAILS" if v == 1 else "passes" if v == 0 else
             ("inconclusive" if inc is True else "could not run") if v == 0.5 else ""
             for v, inc in zip(row, incs, strict=True)] for row, incs in zip(z, inconclusive,
                                                                            strict=True)]
    detail = df.pivot_table(index="bug", columns="check", values="detail",
                            aggfunc="first").reindex(index=bugs, columns=checks)
    fig = go.Figure(go.Heatmap(
        x=checks, y=bugs, z=z, text=text, texttemplate="%{text}", zmin=0, zmax=1,
        colorscale=[[0, "#d9f0d3"], [0.5, "#d9d9d9"], [1, "#f4a582"]], showscale=False,
        customdata=detail.to_numpy(dtype=object),
        hovertemplate="bug: %{y}<br>check: %{x}<br>%{customdata}<extra></extra>", xgap=3,
        ygap=3))
    fig.update_yaxes(autorange="reversed")
    return style(fig, "check", "bug switched on", height=120 + 60 * len(bugs), legend=None)
