"""Pure figure builders: a DataFrame in, a plotly Figure out. No streamlit, testable alone.

One colour per cache mode everywhere (``MODE_COLORS``), axis titles with units.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

MODE_COLORS = {
    "uncached": "#d62728",
    "uncached_last": "#ff7f0e",
    "cached": "#1f77b4",
    "concat": "#1f77b4",
    "prealloc": "#2ca02c",
    "prealloc_fused": "#17becf",
    "cuda_graph": "#9467bd",
    "compiled": "#8c564b",
    "fast": "#e377c2",
}


def mode_color(mode: str) -> str:
    return MODE_COLORS.get(mode, "#7f7f7f")


def step_latency_figure(df: pd.DataFrame) -> go.Figure:
    """Per-token latency of generation runs: columns mode, step, context_len, step_ms."""
    fig = go.Figure()
    for mode, part in df.groupby("mode", sort=False):
        fig.add_trace(go.Scatter(
            x=part["context_len"], y=part["step_ms"], mode="lines+markers", name=str(mode),
            line=dict(color=mode_color(str(mode))), marker=dict(size=4),
            hovertemplate="context %{x} tokens<br>%{y:.2f} ms<extra>" + str(mode) + "</extra>",
        ))
    fig.update_layout(
        xaxis_title="context length (tokens)", yaxis_title="step time (ms)",
        legend_title="mode", margin=dict(l=10, r=10, t=30, b=10), height=360,
    )
    return fig
