"""Pure figure builders: a DataFrame in, a plotly Figure out. No Streamlit; tests call them alone.

Contract: one colour per decode mode everywhere (``instruments.lineup``: each mode's ``ModeSpec``
with its colour; the reference run's "cached" shares mode 3's), every axis titled with its unit,
every trace with a hover template. Inputs are the engine's row schemas (columns named with their
unit: ``latency_ms``, ``context_len``, ``cumulative_s``); missing optional columns are tolerated.
This module holds the latency-type charts; ``figures_perf`` and ``figures_memory`` the others.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import pandas as pd
import plotly.graph_objects as go

from instruments import lineup
from instruments.store import stats

UNCACHED_MODES = lineup.uncached()
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
MIB = 2**20


mode_color = lineup.color  # one colour per mode or peer, from the registries
ordered_modes = lineup.ordered  # ladder order, then the peers


def mode_names(df: pd.DataFrame) -> dict[str, str]:
    """mode -> legend label (``mode_label`` column when present, else the mode name)."""
    if "mode_label" not in df.columns:
        return {m: m for m in df["mode"].astype(str).unique()}
    pairs = df[["mode", "mode_label"]].dropna().drop_duplicates("mode")
    out = {str(m): str(label) for m, label in zip(pairs["mode"], pairs["mode_label"],
                                                  strict=True)}
    return {m: out.get(m, m) for m in df["mode"].astype(str).unique()}


def style(fig: go.Figure, x: str, y: str, *, log_x: bool = False, log_y: bool = False,
          height: int = 420, legend: str | None = "mode") -> go.Figure:
    """The common look: titled axes with units, legend below the title, compact margins."""
    fig.update_layout(
        xaxis_title=x, yaxis_title=y, height=height, template="plotly_white",
        legend_title=legend, margin=dict(l=10, r=10, t=40, b=10), hovermode="closest",
        legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="left", x=0),
    )
    # "-": plotly infers numbers or categories. Log axes: 1-2-5 ticks as plain numbers (no "µ").
    log = dict(type="log", dtick="D2", minorloglabels="complete", exponentformat="none")
    fig.update_xaxes(**log) if log_x else fig.update_xaxes(type="-")
    fig.update_yaxes(**log) if log_y else fig.update_yaxes(type="-")
    return fig


def _samples(part: pd.DataFrame, column: str = "samples_ms") -> pd.DataFrame:
    """One row per raw sample: (context_len, value) from a list-valued column."""
    if column not in part.columns:
        return pd.DataFrame(columns=["context_len", "value"])
    pts = part[["context_len", column]].explode(column).dropna()
    return pd.DataFrame({"context_len": pts["context_len"].astype(float),
                         "value": pts[column].astype(float)})


def latency_figure(df: pd.DataFrame, *, log_x: bool = False, log_y: bool = False,
                   show_samples: bool = True, modes: Iterable[str] | None = None,
                   annotate: bool = True) -> go.Figure:
    """Figures 1-2: median per-token latency against context, one line per mode.

    Columns: mode, context_len, latency_ms; optional samples_ms (list, drawn as faint points),
    set_aside_ms (samples another process disturbed, taken again: grey crosses) and mode_label.
    With an uncached and a cached mode, the speedup at the longest shared context is written on
    the chart.
    """
    fig = go.Figure()
    if df.empty:
        return style(fig, "context length (tokens)", "time per token (ms)", log_x=log_x,
                     log_y=log_y)
    names = mode_names(df)
    wanted = ordered_modes(modes if modes is not None else df["mode"].astype(str))
    for mode in wanted:
        part = df[df["mode"].astype(str) == mode].sort_values("context_len")
        if part.empty:
            continue
        color = mode_color(mode)
        if show_samples:
            pts = _samples(part)
            if not pts.empty:
                fig.add_trace(go.Scatter(
                    x=pts["context_len"], y=pts["value"], mode="markers", legendgroup=mode,
                    showlegend=False, name=f"{names[mode]} (runs)",
                    marker=dict(color=color, size=4, opacity=0.25),
                    hovertemplate="%{x} tokens<br>one run: %{y:.3f} ms<extra>" + mode
                    + "</extra>"))
        fig.add_trace(go.Scatter(
            x=part["context_len"], y=part["latency_ms"], mode="lines+markers", name=names[mode],
            legendgroup=mode, line=dict(color=color, width=2), marker=dict(size=5),
            text=point_words(part), hovertemplate="%{x} tokens<br>%{text}<extra>" + mode
            + "</extra>"))
    if show_samples:
        _set_aside(fig, df[df["mode"].astype(str).isin(wanted)])
    if annotate:
        _annotate_speedup(fig, df, wanted, log_y)
    return style(fig, "context length (tokens)", "time per token (ms)", log_x=log_x,
                 log_y=log_y)


def point_words(part: pd.DataFrame) -> list[str]:
    """Each point's tooltip: its samples' count, median, spread and p50/p90/p99 where there are
    enough (``instruments.store.stats``), or the median alone for rows without samples."""
    samples = part["samples_ms"] if "samples_ms" in part.columns else [None] * len(part)
    return [stats.describe(s, sep="<br>") if isinstance(s, list) and s
            else f"median {float(y):.3f} ms" for s, y in zip(samples, part["latency_ms"],
                                                             strict=True)]


def _set_aside(fig: go.Figure, df: pd.DataFrame) -> None:
    """Grey crosses: samples set aside because another process used the CPU meanwhile."""
    if "set_aside_ms" not in df.columns:
        return
    cols = [c for c in ("set_aside_ms", "set_aside_why") if c in df.columns]
    pts = df[["mode", "context_len", *cols]].dropna(subset=["set_aside_ms"])
    pts = pts[pts["set_aside_ms"].map(len) > 0]
    if pts.empty:
        return
    pts = pts.explode(cols)
    why = pts["set_aside_why"] if "set_aside_why" in pts else pd.Series("", index=pts.index)
    fig.add_trace(go.Scatter(
        x=pts["context_len"].astype(float), y=pts["set_aside_ms"].astype(float), mode="markers",
        name="set aside (disturbed, taken again)",
        marker=dict(color="#888888", size=7, symbol="x-thin", line=dict(width=1.5)),
        customdata=list(zip(pts["mode"].astype(str), why.astype(str), strict=True)),
        hovertemplate="%{x} tokens, %{customdata[0]}<br>set aside: %{y:.3f} ms"
        "<br>%{customdata[1]}<extra></extra>"))


def _annotate_speedup(fig: go.Figure, df: pd.DataFrame, modes: list[str], log_y: bool) -> None:
    slow = next((m for m in UNCACHED_MODES if m in modes), None)
    fast = [m for m in modes if m not in UNCACHED_MODES]
    if slow is None or not fast:
        return
    a = df[df["mode"] == slow].set_index("context_len")["latency_ms"]
    b = df[df["mode"] == fast[0]].set_index("context_len")["latency_ms"]
    common = sorted(set(a.index) & set(b.index))
    if not common:
        return
    t = common[-1]
    ratio = float(a.loc[t]) / float(b.loc[t])
    y = float(b.loc[t])
    fig.add_annotation(x=t, y=math.log10(y) if log_y and y > 0 else y,  # log axes: log10 units
                       text=f"{ratio:.1f}× at {t}", showarrow=True,
                       arrowhead=2, ax=-40, ay=-40, font=dict(color=mode_color(fast[0])))


def step_latency_figure(df: pd.DataFrame, log_y: bool = False) -> go.Figure:
    """Generate page: the time of each generated token. Columns mode, step, context_len, step_ms."""
    fig = go.Figure()
    for mode in ordered_modes(df["mode"].astype(str)) if not df.empty else []:
        part = df[df["mode"].astype(str) == mode]
        fig.add_trace(go.Scatter(
            x=part["context_len"], y=part["step_ms"], mode="lines+markers", name=mode,
            line=dict(color=mode_color(mode)), marker=dict(size=4),
            customdata=part["step"],
            hovertemplate="token %{customdata}, context %{x} tokens<br>%{y:.2f} ms<extra>"
            + mode + "</extra>"))
    return style(fig, "context length (tokens)", "step time (ms)", log_y=log_y, height=360)


def cumulative_figure(df: pd.DataFrame, log_y: bool = False) -> go.Figure:
    """Figure 3: total time after each generated token. Columns mode, step, cumulative_s."""
    fig = go.Figure()
    if not df.empty:
        names = mode_names(df)
        for mode in ordered_modes(df["mode"].astype(str)):
            part = df[df["mode"].astype(str) == mode].sort_values("step")
            x = part["step"] + 1
            fig.add_trace(go.Scatter(
                x=x, y=part["cumulative_s"], mode="lines", name=names[mode],
                line=dict(color=mode_color(mode), width=2),
                hovertemplate="%{x} tokens generated<br>%{y:.3f} s so far<extra>" + mode
                + "</extra>"))
    return style(fig, "tokens generated", "cumulative time (s)", log_y=log_y, height=380)


def overlay_figure(df: pd.DataFrame, *, log_x: bool = False, log_y: bool = False) -> go.Figure:
    """Results page: latency of several runs on one chart. Colour = mode, dash/marker = run.

    Columns: label (the run), mode, context_len, latency_ms.
    """
    fig = go.Figure()
    if df.empty:
        return style(fig, "context length (tokens)", "time per token (ms)", legend="run · mode")
    symbols = ("circle", "square", "diamond", "triangle-up", "x", "star")
    for i, label in enumerate(dict.fromkeys(df["label"].astype(str))):
        run = df[df["label"].astype(str) == label]
        for mode in ordered_modes(run["mode"].astype(str)):
            part = run[run["mode"].astype(str) == mode].sort_values("context_len")
            fig.add_trace(go.Scatter(
                x=part["context_len"], y=part["latency_ms"], mode="lines+markers",
                name=f"{mode} · {label}",
                line=dict(color=mode_color(mode), dash=DASHES[i % len(DASHES)]),
                marker=dict(symbol=symbols[i % len(symbols)], size=6), text=point_words(part),
                hovertemplate="%{x} tokens<br>%{text}<extra>" + f"{mode}<br>{label}"
                + "</extra>"))
    n_runs = df["label"].nunique()
    fig = style(fig, "context length (tokens)", "time per token (ms)", log_x=log_x, log_y=log_y,
                legend="mode · run", height=460 + 22 * len(fig.data))
    return fig.update_layout(legend=dict(orientation="v", yanchor="top", y=-0.15, x=0,
                                         xanchor="left", title_text=f"mode · run ({n_runs})"))


VERDICT_SYMBOLS = {"regression": "x", "improvement": "diamond", "within noise": "circle"}


def compare_figure(df: pd.DataFrame, log_x: bool = False) -> go.Figure:
    """Results page: new ÷ old per point (``instruments.store.compare`` rows: point, mode,
    ratio, noise, verdict), each point's noise band drawn as a grey bar around 1. The x axis is
    the context where the points have one, else the point's name. Colour = mode, symbol =
    verdict (x: regression, diamond: improvement, circle: within noise)."""
    fig = go.Figure()
    rows = df.dropna(subset=["ratio"]) if "ratio" in df.columns else df.iloc[0:0]
    contexts = "context_len" in rows.columns and rows["context_len"].notna().all()
    x_title = "context length (tokens)" if contexts else "point"
    if rows.empty:
        return style(fig, x_title, "new ÷ old", legend="mode · verdict")
    x = rows["context_len"].astype(float) if contexts else rows["point"].astype(str)
    noise = rows["noise"].astype(float)
    fig.add_trace(go.Scatter(
        x=x, y=[1.0] * len(rows), mode="markers", name="noise band (each point's own)",
        marker=dict(size=1, color="rgba(0,0,0,0)"),
        error_y=dict(type="data", symmetric=False, array=noise, arrayminus=1 - 1 / (1 + noise),
                     color="rgba(120,120,120,0.35)", thickness=8, width=0),
        customdata=noise * 100, hovertemplate="noise band ±%{customdata:.1f}%<extra></extra>"))
    for mode in ordered_modes(rows["mode"].astype(str)):
        for verdict, symbol in VERDICT_SYMBOLS.items():
            part = rows[(rows["mode"].astype(str) == mode) & (rows["verdict"] == verdict)]
            if part.empty:
                continue
            px = part["context_len"].astype(float) if contexts else part["point"].astype(str)
            fig.add_trace(go.Scatter(
                x=px, y=part["ratio"], mode="markers", name=f"{mode} · {verdict}",
                marker=dict(color=mode_color(mode), symbol=symbol, size=10 if symbol == "x"
                            else 8, line=dict(width=1, color=mode_color(mode))),
                customdata=list(zip(part["point"], part["noise"] * 100, strict=True)),
                hovertemplate="%{customdata[0]}<br>new ÷ old %{y:.3f} (band ±%{customdata[1]:.1f}"
                "%)<extra>" + verdict + "</extra>"))
    fig.add_hline(y=1, line=dict(color="#999", width=1, dash="dot"))
    return style(fig, x_title, "new ÷ old (×)", log_x=log_x and contexts,
                 legend="mode · verdict")
