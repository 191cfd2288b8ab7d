"""Pure builders for the KV memory planner: DataFrames in, plotly Figures out (bytes shown in MiB).

Rows follow ``instruments.costmodel.kv_plan`` and the "planner" experiment:
  against_batch  batch_size, layout, label, reserved_bytes, used_bytes
  layouts        layout, label, reserved_bytes, used_bytes, wasted_bytes, waste_share, and when
                 measured tensor_bytes
  storages       storage, bytes_per_token, rel_error (when measured)
  kv_heads       kv_heads, kind, bytes_per_token, fits_full_length
No Streamlit, no measurement.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from ui.figures import MIB, style

LAYOUT_COLORS = {"contiguous": "#d62728", "exact": "#2ca02c", "paged": "#393b79"}


def against_batch_figure(df: pd.DataFrame, budget_bytes: int | None,
                         measured: pd.DataFrame | None = None) -> go.Figure:
    """Reserved memory against batch size, one line per layout; the device's budget as a line;
    the layouts allocated for real as hollow markers at their batch."""
    fig = go.Figure()
    for layout, part in df.groupby("layout", sort=False):
        part = part.sort_values("batch_size")
        fig.add_trace(go.Scatter(
            x=part["batch_size"], y=part["reserved_bytes"] / MIB, mode="lines+markers",
            name=str(part["label"].iloc[0]), line=dict(color=LAYOUT_COLORS.get(str(layout))),
            hovertemplate="batch %{x}: %{y:,.1f} MiB reserved<extra>%{fullData.name}</extra>"))
    used = df.drop_duplicates("batch_size").sort_values("batch_size")
    fig.add_trace(go.Scatter(x=used["batch_size"], y=used["used_bytes"] / MIB, mode="lines",
                             name="in use (the tokens themselves)",
                             line=dict(color="#7f7f7f", dash="dot"),
                             hovertemplate="batch %{x}: %{y:,.1f} MiB in use<extra></extra>"))
    if measured is not None and "tensor_bytes" in measured.columns:
        got = measured.dropna(subset=["tensor_bytes"])
        fig.add_trace(go.Scatter(
            x=got["sequences"], y=got["tensor_bytes"] / MIB, mode="markers", name="allocated",
            marker=dict(symbol="circle-open", size=13, color="black"), text=got["label"],
            hovertemplate="%{text}: %{y:,.1f} MiB of tensors allocated<extra></extra>"))
    if budget_bytes:  # a trace, not a shape: it gets a legend entry and a hover
        x = [df["batch_size"].min(), df["batch_size"].max()]
        fig.add_trace(go.Scatter(
            x=x, y=[budget_bytes / MIB] * 2, mode="lines", line=dict(color="black", dash="dash"),
            name=f"this device's budget ({budget_bytes / 2**30:,.1f} GiB)",
            hovertemplate="budget: %{y:,.0f} MiB<extra></extra>"))
    return style(fig, "sequences in the batch", "KV cache memory (MiB)", log_x=True, log_y=True,
                 legend="layout")


def waste_figure(df: pd.DataFrame) -> go.Figure:
    """One stacked bar per layout: memory in use and memory reserved but unused."""
    fig = go.Figure()
    labels = df["label"].astype(str)
    fig.add_trace(go.Bar(y=labels, x=df["used_bytes"] / MIB, orientation="h", name="in use",
                         marker_color="#4c78a8",
                         hovertemplate="%{y}: %{x:,.1f} MiB in use<extra></extra>"))
    fig.add_trace(go.Bar(y=labels, x=df["wasted_bytes"] / MIB, orientation="h",
                         name="reserved, unused", marker_color="#e45756",
                         text=[f"{s:.0%} wasted" for s in df["waste_share"]],
                         textposition="outside",
                         hovertemplate="%{y}: %{x:,.1f} MiB unused<extra></extra>"))
    fig.update_layout(barmode="stack")
    return style(fig, "MiB", "", height=280, legend=None)


def storage_figure(df: pd.DataFrame) -> go.Figure:
    """Bytes per token of each KV storage type; the logits error written on each bar."""
    err = df["rel_error"] if "rel_error" in df.columns else pd.Series([None] * len(df))
    text = ["" if e is None or pd.isna(e) else f"error {e:.2g} of max logit" for e in err]
    fig = go.Figure(go.Bar(x=df["storage"], y=df["bytes_per_token"] / 1024, text=text,
                           textposition="outside", marker_color="#4c78a8",
                           hovertemplate="%{x}: %{y:,.1f} KiB per token<extra></extra>"))
    return style(fig, "KV storage", "KiB per token (K and V, every layer)", height=330,
                 legend=None)


def kv_heads_figure(df: pd.DataFrame) -> go.Figure:
    """Full-length sequences that fit for each KV-head count (what-ifs in grey)."""
    own = df["own"].astype(bool) if "own" in df else df["kind"].astype(str).str.contains(
        "this model")
    fig = go.Figure(go.Bar(
        x=df["kv_heads"].astype(str), y=df["fits_full_length"],
        marker_color=["#4c78a8" if o else "#bab0ac" for o in own], text=df["kind"],
        hovertemplate="%{x} KV heads (%{text}): %{y:,} full-length sequences<extra></extra>"))
    fig.update_xaxes(type="category")
    return style(fig, "KV heads (query heads share them)", "full-length sequences that fit",
                 height=330, legend=None)
