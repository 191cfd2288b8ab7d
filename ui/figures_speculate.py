"""Pure figure builders for speculative decoding: rows of the ``speculate`` experiment in,
plotly Figures / DataFrames out. No Streamlit, no measurement.

  verify_figure        t(k)/t(1) against k per context, between the memory-bound ideal (1: k
                       tokens cost one read of the weights) and the compute-bound line (k)
  speedup_figure       per draft length k: the measured speedup over plain decoding (bars), the
                       two predictions from the verify curve (markers), break-even at 1
  acceptance_figure    per k: the acceptance measured, the break-even acceptance on this device
                       (below it drafts of k lose time), tokens per forward on hover
  speculative_table    the numbers behind them
Every axis is titled with its unit; times in ms.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from ui.figures import DASHES, style

MEASURED, FORMULA, DRAFTS, EVEN = "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"


def verify_figure(df: pd.DataFrame) -> go.Figure:
    """One line per context: a forward appending k tokens over one appending 1."""
    x_title, y_title = "tokens appended in one forward (k)", "t(k) / t(1)"
    fig = go.Figure()
    if df.empty:
        return style(fig, x_title, y_title, legend=None)
    ks = sorted(df["k"].astype(int).unique())
    for i, (ctx, part) in enumerate(sorted(df.groupby("context_len"), key=lambda g: g[0])):
        part = part.sort_values("k")
        fig.add_trace(go.Scatter(
            x=part["k"], y=part["t_ratio"], mode="lines+markers",
            name=f"measured after {ctx} tokens", line=dict(dash=DASHES[i % len(DASHES)],
                                                            color=MEASURED),
            customdata=part[["latency_ms", "speedup_vs_steps"]],
            hovertemplate="k = %{x}<br>t(k)/t(1) = %{y:.2f}<br>%{customdata[0]:.3f} ms, "
            "%{customdata[1]:.2f}x faster than k single steps<extra>" + f"{ctx} tokens"
            + "</extra>"))
    fig.add_trace(go.Scatter(x=ks, y=[1] * len(ks), mode="lines", name="memory-bound ideal "
                             "(k tokens for one read of the weights)",
                             line=dict(color="#2ca02c", dash="dash"),
                             hovertemplate="k = %{x}: 1<extra>ideal</extra>"))
    fig.add_trace(go.Scatter(x=ks, y=ks, mode="lines", name="compute-bound (k times one token)",
                             line=dict(color="#7f7f7f", dash="dot"),
                             hovertemplate="k = %{x}: %{y}<extra>compute-bound</extra>"))
    fig = style(fig, x_title, y_title, log_x=True, log_y=True, legend="verify forward")
    # ticks at the powers of two: the k + 1 points beside them (what a draft of k appends) are
    # drawn but not labelled, or 16 and 17 would print over each other on a log axis
    ticks = [k for k in ks if k & (k - 1) == 0] or ks
    fig.update_xaxes(tickvals=ticks, ticktext=[str(k) for k in ticks])
    return fig


def _by_k(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values("k").assign(k_label=lambda d: "k = " + d["k"].astype(str))


def _measured_bars(df: pd.DataFrame, col: str, name: str, custom: list[str], hover: str
                   ) -> tuple[go.Figure, pd.DataFrame]:
    """A figure with the measured ``col`` as one bar per draft length (rows sorted by k)."""
    d = _by_k(df)
    fig = go.Figure(go.Bar(x=d["k_label"], y=d[col], name=name, marker_color=MEASURED,
                           customdata=d[custom], hovertemplate=hover))
    return fig, d


def speedup_figure(df: pd.DataFrame) -> go.Figure:
    """Measured speedup over plain greedy decoding per draft length, and both predictions."""
    x_title, y_title = "draft length", "speedup over plain decoding (×)"
    if df.empty:
        return style(go.Figure(), x_title, y_title, legend=None)
    fig, d = _measured_bars(df, "speedup_measured", "measured", ["latency_ms", "plain_ms"],
                            "%{x}: %{y:.2f}x<br>speculative %{customdata[0]:.1f} ms, "
                            "plain %{customdata[1]:.1f} ms<extra>measured</extra>")
    for col, name, color, symbol in (
            ("speedup_predicted", "predicted: E[tokens/forward] at the measured acceptance",
             FORMULA, "diamond"),
            ("speedup_predicted_drafts", "predicted: the forwards that ran, timed by the "
             "verify curve", DRAFTS, "x")):
        if col in d:
            fig.add_trace(go.Scatter(x=d["k_label"], y=d[col], mode="markers", name=name,
                                     marker=dict(color=color, size=12, symbol=symbol),
                                     hovertemplate="%{x}: %{y:.2f}x<extra>" + name
                                     + "</extra>"))
    fig.add_hline(y=1.0, line=dict(color=EVEN, dash="dash"),
                  annotation_text="break-even", annotation_position="top left")
    return style(fig, x_title, y_title, legend="speedup", height=440)


def acceptance_figure(df: pd.DataFrame) -> go.Figure:
    """Acceptance measured per draft length against the break-even acceptance here."""
    x_title, y_title = "draft length", "acceptance (share of drafted tokens kept)"
    if df.empty:
        return style(go.Figure(), x_title, y_title, legend=None)
    fig, d = _measured_bars(df, "acceptance", "acceptance measured",
                            ["tokens_per_forward", "accepted", "drafted"],
                            "%{x}: %{y:.0%} (%{customdata[1]} of %{customdata[2]} drafted)<br>"
                            "%{customdata[0]:.2f} tokens per forward<extra>measured</extra>")
    even = d["break_even_acceptance"]
    fig.add_trace(go.Scatter(
        x=d["k_label"], y=even, mode="lines+markers", name="break-even acceptance on this "
        "device (from the verify curve)", line=dict(color=EVEN, dash="dash"),
        marker=dict(size=10), hovertemplate="%{x}: %{y:.0%}<extra>break-even</extra>"))
    never = d[even.isna()]
    if not never.empty:  # a forward of k + 1 costs k + 1 steps or more: no acceptance wins
        fig.add_trace(go.Scatter(x=never["k_label"], y=[1.0] * len(never), mode="markers",
                                 name="never breaks even", marker=dict(color=EVEN, size=12,
                                                                       symbol="x"),
                                 hovertemplate="%{x}: no acceptance pays<extra></extra>"))
    fig = style(fig, x_title, y_title, legend=None, height=440)
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%")
    return fig


def speculative_table(df: pd.DataFrame) -> pd.DataFrame:
    cols = ["k", "acceptance", "break_even_acceptance", "tokens_per_forward",
            "expected_tokens_per_forward", "speedup_measured", "speedup_predicted",
            "speedup_predicted_drafts", "verify_ratio", "forwards", "drafted", "accepted",
            "latency_ms", "plain_ms", "prefill_ms", "identical"]
    if df.empty:
        return pd.DataFrame(columns=cols)
    return df[[c for c in cols if c in df.columns]].sort_values("k").reset_index(drop=True)


def speculation_sentence(df: pd.DataFrame) -> str:
    """The best measured speedup, how far the predictions were from it, and exactness."""
    if df.empty:
        return ""
    best = df.loc[df["speedup_measured"].idxmax()]
    pred = best.get("speedup_predicted_drafts")
    miss = "" if pred is None or pd.isna(pred) else (
        f"; the verify curve predicted {pred:.2f}× from the forwards that ran "
        f"({pred / best['speedup_measured'] - 1:+.0%})")
    same = ("Every speculative run gave plain greedy decoding's tokens, token for token"
            if bool(df["identical"].all()) else "SOME RUNS DIFFERED from plain greedy decoding")
    return (f"Best: drafts of {int(best['k'])} tokens, {best['speedup_measured']:.2f}× plain "
            f"decoding measured{miss}. {same}.")
