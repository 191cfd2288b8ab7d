"""The serving experiments' own figures and saved runs overlaid: pure builders beside
``ui.figures_serving`` (its host line, colours and axes), rows in, plotly Figures out.

  budget_figure           per budget: preemptions (bars) and the most and mean running batch
  budget_timeline_figure  the running batch over each budget's own clock, preemptions marked
  schedule_figure         per policy: hit rate (bars) and TTFT p50 / p99
  overlay_figure          saved runs' points on one chart: colour = run (its label names its
                          host), dash = way
Every axis names its unit and whether it is measured or computed.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.graph_objects as go

from ui.figures import DASHES, style
from ui.figures_serving import AXES, COLORS, RUNNING, SERIES, log_ticks, right_axis, titled


def budget_figure(points: pd.DataFrame, meta: dict[str, Any] | None = None) -> go.Figure:
    """Per budget: preemptions (bars, left) and the most and mean running batch (right)."""
    fig = go.Figure()
    if not points.empty:
        df = points.sort_values("budget_tokens")
        x = [f"{int(b):,}" for b in df["budget_tokens"]]
        fig.add_trace(go.Bar(x=x, y=df["preemptions"], name="preemptions (measured run)",
                             marker_color="#fcbba1",
                             hovertemplate="%{x} tokens: %{y} preemptions<extra></extra>"))
        for col, name, symbol in (("batch_max", "most running", "diamond"),
                                  ("batch_mean", "mean running", "circle")):
            fig.add_trace(go.Scatter(
                x=x, y=df[col], mode="lines+markers", yaxis="y2", name=f"batch: {name}",
                marker=dict(symbol=symbol, size=9), line=dict(color=RUNNING),
                hovertemplate="%{x} tokens: %{y:.1f} " + name + "<extra></extra>"))
    fig.update_layout(yaxis2=right_axis("running batch (requests)"))
    style(fig, "KV budget (tokens)", "preemptions (count)", legend=None, height=380)
    return titled(fig, "Preemptions and the batch against the KV budget", meta)


def budget_timeline_figure(steps: pd.DataFrame, meta: dict[str, Any] | None = None
                           ) -> go.Figure:
    """The running batch over each budget's own clock, one line per budget; preemptions as
    crosses."""
    fig = go.Figure()
    for i, (label, part) in enumerate(steps.groupby("label", sort=False)
                                      if not steps.empty else []):
        color = COLORS[i % 7]
        fig.add_trace(go.Scatter(
            x=part["t_s"], y=part["running"], mode="lines", name=str(label),
            line=dict(color=color, shape="hv", dash=DASHES[i % len(DASHES)]),
            legendgroup=str(label), hovertemplate="%{x:.3f} s: %{y} running<extra>"
            + str(label) + "</extra>"))
        hit = part[part["preempted"] > 0]
        if len(hit):
            fig.add_trace(go.Scatter(
                x=hit["t_s"], y=hit["running"], mode="markers", legendgroup=str(label),
                showlegend=False, marker=dict(symbol="x", size=10, color=color),
                customdata=hit[["preempted"]], hovertemplate="%{x:.3f} s: %{customdata[0]} "
                "preempted<extra>" + str(label) + "</extra>"))
    style(fig, "time (s, on the budget's own clock)", "running requests (measured run)",
          legend=None, height=380)
    return titled(fig, "The running batch over time under each KV budget (✕: preemptions)",
                  meta)


def schedule_figure(points: pd.DataFrame, meta: dict[str, Any] | None = None) -> go.Figure:
    """Per policy: hit rate (bars, left) and TTFT p50 / p99 (markers, right)."""
    fig = go.Figure()
    if not points.empty:
        fig.add_trace(go.Bar(x=points["policy"], y=points["hit_rate"], marker_color="#c6dbef",
                             name="hit rate (cached ÷ prompt tokens, measured)",
                             customdata=points[["evictions"]] if "evictions" in points else None,
                             hovertemplate="%{x}: %{y:.0%} of prompt tokens cached"
                             "<extra></extra>"))
        for q, symbol in ((50, "circle"), (99, "diamond")):
            col = f"ttft_p{q}_ms"
            if col not in points or points[col].isna().all():
                continue
            fig.add_trace(go.Scatter(
                x=points["policy"], y=points[col], mode="markers", yaxis="y2",
                name=f"TTFT p{q} (ms, right)", marker=dict(symbol=symbol, size=12,
                                                           color=RUNNING),
                hovertemplate=f"%{{x}}: TTFT p{q} %{{y:,.1f}} ms<extra></extra>"))
    fig.update_layout(yaxis=dict(tickformat=".0%", range=[0, 1]),
                      yaxis2=right_axis("time to first token (ms, measured)"))
    style(fig, "scheduling policy", "hit rate", legend=None, height=380)
    return titled(fig, "Prefix hits and TTFT per scheduling policy", meta)


def overlay_figure(points: pd.DataFrame, y: str, y_title: str, experiment: str) -> go.Figure:
    """Saved runs' points on one chart: colour = run (``run`` column: its label, which names
    its host), dash = way or policy."""
    fig = go.Figure()
    x, x_title, log_x = AXES[experiment]
    for i, (run, part) in enumerate(points.groupby("run", sort=False)
                                    if not points.empty else []):
        series = SERIES[experiment]
        groups = part.groupby(series, sort=False) if series and series in part else [("", part)]
        for j, (name, lines) in enumerate(groups):
            lines = lines.sort_values(x) if log_x else lines
            label = f"{run} · {name}" if name else str(run)
            fig.add_trace(go.Scatter(
                x=lines[x], y=lines[y], mode="lines+markers", name=label,
                line=dict(color=COLORS[i % 7], dash=DASHES[j % len(DASHES)]),
                hovertemplate="%{x}: %{y:,.1f}<extra>" + label + "</extra>"))
    style(fig, x_title, y_title, legend="run (its host) · way", height=420 + 22 * len(fig.data))
    if log_x and not points.empty:
        log_ticks(fig, points[x])
    fig.update_layout(legend=dict(orientation="v", yanchor="top", y=-0.2, x=0,
                                  xanchor="left"), title=dict(
        text=f"Saved runs overlaid: {y_title}<br><sup>each run's host in its legend entry"
        "</sup>", x=0, xanchor="left"), margin=dict(t=80))
    return fig
