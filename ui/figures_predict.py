"""Pure figure builders for the predicted step: ``prediction`` rows in, plotly Figures out.

Rows are ``instruments.costmodel.predict.compare``'s (one per mode x context: measured_ms,
predicted_ms, residual_ms, residual_share and the parts). No Streamlit, no measurement; times in ms.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from instruments.costmodel.predict import GOALS, PART_LABELS, PARTS
from ui.figures import mode_color, ordered_modes, style

PART_COLORS = {"weights_ms": "#1f77b4", "attention_ms": "#ff7f0e",
               "small_ops_ms": "#2ca02c", "dispatch_host_ms": "#d62728"}
X_TITLE = "context length (tokens)"


def _predicted(df: pd.DataFrame) -> pd.DataFrame:
    if df.empty or "predicted_ms" not in df:
        return df.iloc[0:0]
    return df[df["predicted_ms"].notna()].sort_values(["mode", "context_len"])


def prediction_figure(df: pd.DataFrame) -> go.Figure:
    """Measured (solid, markers) and predicted (dashed) step time per mode, log axes."""
    fig = go.Figure()
    part = _predicted(df)
    for mode in ordered_modes(part["mode"].astype(str)):
        m = part[part["mode"] == mode]
        label = str(m["mode_label"].iloc[0]) if "mode_label" in m else mode
        color = mode_color(mode)
        fig.add_trace(go.Scatter(x=m["context_len"], y=m["measured_ms"], mode="lines+markers",
                                 name=label, legendgroup=mode, line=dict(color=color, width=2),
                                 hovertemplate="%{x} tokens<br>measured %{y:.2f} ms<extra>"
                                 + mode + "</extra>"))
        fig.add_trace(go.Scatter(x=m["context_len"], y=m["predicted_ms"], mode="lines",
                                 name=f"{label} (predicted)", legendgroup=mode,
                                 showlegend=False, line=dict(color=color, width=2, dash="dash"),
                                 hovertemplate="%{x} tokens<br>predicted %{y:.2f} ms<extra>"
                                 + mode + "</extra>"))
    return style(fig, X_TITLE, "time per step or forward (ms)", log_x=True, log_y=True,
                 height=480)


def add_prediction(fig: go.Figure, df: pd.DataFrame) -> go.Figure:
    """Dashed predicted lines (``predict.compare`` rows) over a latency figure, one per mode."""
    part = _predicted(df)
    for mode in ordered_modes(part["mode"].astype(str)) if not part.empty else []:
        m = part[part["mode"] == mode]
        fig.add_trace(go.Scatter(x=m["context_len"], y=m["predicted_ms"], mode="lines",
                                 name=f"{mode} predicted", legendgroup=mode, showlegend=False,
                                 line=dict(color=mode_color(mode), width=1.5, dash="dash"),
                                 hovertemplate="%{x} tokens<br>predicted %{y:.2f} ms<extra>"
                                 + mode + "</extra>"))
    return fig


def add_predicted_reduction(fig: go.Figure, df: pd.DataFrame, baseline: str) -> go.Figure:
    """Dotted lines on Figure 4: how many times less time each mode takes than ``baseline``
    by the prediction (predicted baseline ÷ predicted mode, per context)."""
    part = _predicted(df)
    if part.empty or baseline not in set(part["mode"]):
        return fig
    base = part[part["mode"] == baseline].set_index("context_len")["predicted_ms"]
    for mode in ordered_modes(part["mode"].astype(str)):
        if mode == baseline:
            continue
        rows = part[part["mode"] == mode]
        label = str(rows["mode_label"].iloc[0]) if "mode_label" in rows else mode
        m = rows.set_index("context_len")["predicted_ms"]
        common = sorted(set(base.index) & set(m.index))
        if not common:
            continue
        fig.add_trace(go.Scatter(x=common, y=[base[t] / m[t] for t in common], mode="lines",
                                 name=f"{label}: time (predicted)", legendgroup=mode,
                                 line=dict(color=mode_color(mode), dash="dot", width=2),
                                 hovertemplate="%{x} tokens<br>%{y:.2f}× less time, predicted"
                                 "<extra>" + mode + "</extra>"))
    return fig


def residual_figure(df: pd.DataFrame) -> go.Figure:
    """(measured − predicted) / measured per mode against context, with the two goals."""
    fig = go.Figure()
    part = _predicted(df)
    for mode in ordered_modes(part["mode"].astype(str)):
        m = part[part["mode"] == mode]
        fig.add_trace(go.Scatter(x=m["context_len"], y=m["residual_share"] * 100,
                                 mode="lines+markers", name=mode,
                                 line=dict(color=mode_color(mode)),
                                 customdata=m["residual_ms"],
                                 hovertemplate="%{x} tokens<br>%{y:+.1f}% (%{customdata:+.2f} "
                                 "ms)<extra>" + mode + "</extra>"))
    for cached, goal in GOALS.items():
        what = "cached" if cached else "uncached"
        line = dict(color="#888", dash="dot", width=1)
        fig.add_hline(y=goal * 100, line=line, annotation_text=f"goal ±{goal:.0%} ({what})",
                      annotation_position="top left")
        fig.add_hline(y=-goal * 100, line=line)
    fig.add_hline(y=0, line=dict(color="black", width=1))
    return style(fig, X_TITLE, "residual: (measured − predicted) ÷ measured (%)", log_x=True,
                 height=380)


def parts_figure(df: pd.DataFrame, mode: str) -> go.Figure:
    """The prediction's parts stacked for one mode, the measured step as a black line."""
    part = _predicted(df)
    part = part[part["mode"] == mode]
    fig = go.Figure()
    if part.empty:
        return style(fig, X_TITLE, "time (ms)", legend=None)
    x = part["context_len"].astype(str)  # categories: every bar readable
    split = "bound" in part and part["bound"].notna().any()  # a GPU's: host and device apart
    base = pd.Series(0.0, index=part.index)
    for col in PARTS:
        side = "host" if col == "dispatch_host_ms" else "device"
        fig.add_trace(go.Bar(x=x, y=part[col], name=PART_LABELS[col] + (
                                 f" ({side})" if split else ""),
                             marker_color=PART_COLORS[col],
                             offsetgroup=side if split else None,
                             base=None if not split or side == "host" else base.copy(),
                             hovertemplate="%{x} tokens<br>%{y:.3f} ms<extra>"
                             + PART_LABELS[col] + "</extra>"))
        if split and side == "device":
            base = base + part[col].astype(float)
    fig.add_trace(go.Scatter(x=x, y=part["measured_ms"], mode="lines+markers",
                             name="measured (median)", line=dict(color="black", width=2)))
    fig = style(fig, X_TITLE, "time per step or forward (ms)", legend="predicted part",
                height=440)
    # On a GPU the prediction is the taller of the two bars (the host issues while the device
    # runs); elsewhere the parts add up, one stacked bar.
    fig.update_layout(barmode="group" if split else "stack")
    return fig


def verdict_table(verdicts: list[dict]) -> pd.DataFrame:
    """One row per mode: worst miss, goal, verdict."""
    rows = []
    for v in verdicts:
        worst = v.get("worst_share")
        rows.append({
            "mode": v["mode"],
            "worst miss": "—" if worst is None else f"{worst:.1%}",
            "at (tokens)": v.get("worst_context") or "—",
            "goal": f"{v['goal_share']:.0%}",
            "verdict": ("not predicted" if v.get("within") is None
                        else "within" if v["within"] else "outside"),
            "part off": v.get("off_part") or "—",
        })
    return pd.DataFrame(rows)
