"""Figures of a peers run: pure builders, a DataFrame of its ``peers`` rows in, plotly/pandas out.

``peers_figure(df)``: median step time against context, one line per engine (our modes and the
peers, in their registry colours, ladder order first), each round's median as a faint point,
and the read floor measured in the same rounds as a dashed black line. ``peers_table(df, t)``:
the table at one context (median, p90, × read floor, × our fastest exact mode, logits error,
weights held, version), fastest first. ``not_run(df)``: the peers that were not timed and why.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from instruments import lineup
from ui.figures import style

MB = 1e6


def _timed(df: pd.DataFrame) -> pd.DataFrame:
    if df.empty or "latency_ms" not in df.columns:
        return pd.DataFrame(columns=["engine", "context_len", "latency_ms"])
    return df[df["latency_ms"].notna()]


def peers_figure(df: pd.DataFrame, *, log_y: bool = False, engines: list[str] | None = None
                 ) -> go.Figure:
    fig = go.Figure()
    done = _timed(df)
    title = ("context length (tokens)", "time per token (ms)")
    if done.empty:
        return style(fig, *title, log_y=log_y, legend="engine")
    floor = done.groupby("context_len")["floor_ms"].first().sort_index() \
        if "floor_ms" in done.columns else pd.Series(dtype=float)
    for name in lineup.ordered(engines if engines is not None else done["engine"].astype(str)):
        part = done[done["engine"] == name].sort_values("context_len")
        if part.empty:
            continue
        color = lineup.color(name)
        if "rounds_ms" in part.columns:
            pts = part[["context_len", "rounds_ms"]].explode("rounds_ms").dropna()
            fig.add_trace(go.Scatter(
                x=pts["context_len"].astype(float), y=pts["rounds_ms"].astype(float),
                mode="markers", legendgroup=name, showlegend=False,
                marker=dict(color=color, size=5, opacity=0.3),
                hovertemplate="%{x} tokens<br>one round's median: %{y:.3f} ms<extra>" + name
                + "</extra>"))
        dash = "dot" if lineup.is_peer(name) else "solid"
        fig.add_trace(go.Scatter(
            x=part["context_len"], y=part["latency_ms"], mode="lines+markers",
            name=lineup.label(name), legendgroup=name,
            line=dict(color=color, width=2, dash=dash), marker=dict(size=7),
            hovertemplate="%{x} tokens<br>median %{y:.3f} ms<extra>" + name + "</extra>"))
    if not floor.empty:
        fig.add_trace(go.Scatter(
            x=floor.index, y=floor.values, mode="lines+markers", name="read floor (measured)",
            line=dict(color="black", width=2, dash="dash"), marker=dict(size=6),
            hovertemplate="%{x} tokens<br>read of the weights: %{y:.3f} ms<extra></extra>"))
    return style(fig, *title, log_y=log_y, legend="engine")


TABLE_COLUMNS = {
    "engine": "engine", "precision": "precision", "latency_ms": "median (ms)",
    "p90_ms": "p90 (ms)", "x_floor": "× read floor", "x_fastest_exact": "× our fastest exact",
    "logits_max_abs_diff": "logits max |Δ| vs mode 1", "weights_mb": "weights held (MB)",
    "version": "version", "conversion_s": "set-up (s)",
}


def peers_table(df: pd.DataFrame, context: int) -> pd.DataFrame:
    """One context's rows, fastest first, with readable column names."""
    done = _timed(df)
    part = done[done["context_len"] == context].sort_values("latency_ms").copy()
    part["weights_mb"] = part.get("weight_bytes", pd.Series(dtype=float)) / MB
    cols = [c for c in TABLE_COLUMNS if c in part.columns]
    return part[cols].rename(columns=TABLE_COLUMNS).reset_index(drop=True)


def not_run(df: pd.DataFrame) -> pd.DataFrame:
    """Engines that were not timed: unavailable (the install command) or refused by the gate."""
    if df.empty or "latency_ms" not in df.columns:
        return pd.DataFrame(columns=["engine", "why"])
    part = df[df["latency_ms"].isna()].copy()
    if "available" in part.columns:
        part["status"] = part["available"].map(
            lambda ok: "refused by the gate" if ok is True else "unavailable")
    cols = [c for c in ("engine", "status", "why") if c in part.columns]
    return part[cols].reset_index(drop=True)
