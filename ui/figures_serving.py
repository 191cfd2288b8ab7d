"""Pure figure builders for the serving runs (kind "serving"): rows of its tables in, plotly
Figures out. No Streamlit, no measurement. Every figure is titled with what it shows and the
host it ran on (``host(meta)``: the run's model, dtype, device name, threads and platform);
every axis names its unit and whether it is measured or computed.

Over time (the "live" rows streamed while a run goes on, or the run's "steps" once it ends;
each point's steps on its own clock, laid end to end by ``timeline``):
  batch_figure     running and waiting requests after each step; preemptions as red crosses
  pool_figure      the block pool stacked: held by running requests alone, shared, held by
                   the prefix tree alone, free; held blocks per running request (right axis)
Per point ("points" rows, as they arrive and once finished; the x is the experiment's own:
``axis(points)``):
  throughput_figure  output tokens/s against concurrency, rate, budget or policy, one line per
                     way (load); the peers' rows beside ours where the run has them
  latency_figure     TTFT and TPOT p50 (solid) and p99 (dashed, from 100 samples on)
  step_figure        the decode step against the batch ("batch_steps" rows labelled "all"):
                     measured median and samples, its floor, the weights' and K/V reads; the
                     batch where K/V reads overtake the weights' marked
  points_table       the points with their columns headed by unit
The budget's, the schedule's and the saved runs' figures are in ``ui.figures_serving_runs``.
``experiment_of(points, meta)`` says which of the four experiments a run was; ``titled``,
``right_axis`` and ``log_ticks`` are the look both modules share.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ui.figures import style

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf")
RUNNING, WAITING, PREEMPTED = "#1f77b4", "#ff7f0e", "#d62728"
POOL = (("own", "held by running requests alone", "#1f77b4"),
        ("blocks_shared", "shared by several holders", "#9467bd"),
        ("blocks_tree", "held by the prefix tree alone", "#7fc97f"),
        ("blocks_free", "free", "#e5e5e5"))
# experiment -> (points column on x, its axis title, log x)
AXES = {"concurrency": ("concurrency", "concurrency (clients, closed loop)", True),
        "load": ("rate_per_s", "arrival rate (requests/s, Poisson)", True),
        "budget": ("budget_tokens", "KV budget (bytes of this many tokens in the model's "
                   "dtype)", True),
        "schedule": ("policy", "scheduling policy", False)}
SERIES = {"load": "way", "schedule": None, "concurrency": None, "budget": "kv_dtype"}
# plotly's own log ticks (a narrow range still gets several), each labelled in full
LOG = dict(type="log", exponentformat="none", minorloglabels="complete")
CLOCK = "time (s, on the run's clock: measured steps laid end to end)"


def host(meta: dict[str, Any] | None) -> str:
    """What ran and where: "llama-tiny, float32 on AMD EPYC (cpu, 2 threads), Linux-…"."""
    m = meta or {}
    where = m.get("device_name") or m.get("device") or "unknown device"
    threads = m.get("threads")
    how = ", ".join(str(x) for x in (m.get("device"), threads and (
        f"{threads} thread{'s' if threads != 1 else ''}")) if x)
    return (f"{m.get('model') or '?'}, {m.get('dtype') or '?'} on {where}"
            + (f" ({how})" if how else "") + (f", {m['platform']}" if m.get("platform") else ""))


def titled(fig: go.Figure, title: str, meta: dict[str, Any] | None) -> go.Figure:
    """The figure's title and, beneath it, the host (room made above the legend)."""
    fig.update_layout(title=dict(text=f"{title}<br><sup>{host(meta)}</sup>", x=0,
                                 xanchor="left", yref="container", y=1, yanchor="top",
                                 pad=dict(t=12), font=dict(size=15)),
                      margin=dict(t=80), modebar=dict(orientation="v"),
                      legend=dict(orientation="h", x=0, xanchor="left", y=-0.2, yanchor="top"))
    return fig


def right_axis(title: str) -> dict[str, Any]:
    """A right-hand y axis from 0 with its own ticks (Streamlit's theme would sync them to the
    left axis's gridlines: 2.07, 4.13...)."""
    return dict(title=title, overlaying="y", side="right", rangemode="tozero", showgrid=False,
                tickmode="auto", nticks=6)


def log_ticks(fig: go.Figure, values: pd.Series, **where: int) -> None:
    """A log x axis ticked at the values measured (1, 4, 16 clients; the rates asked)."""
    ticks = sorted({float(v) for v in values.dropna()})
    fig.update_xaxes(type="log", tickvals=ticks, ticktext=[f"{v:g}" for v in ticks], **where)


def experiment_of(points: pd.DataFrame, meta: dict[str, Any] | None = None) -> str:
    """Which serving experiment made these points: the run's ``serving_experiment``, else the
    meta's "experiment" where it names one (a saved run's names the kind, "serving"), else the
    points' own labels, else the meta each experiment adds at its end."""
    cols, m = set(points.columns), meta or {}
    for key in ("serving_experiment", "experiment"):
        if m.get(key) in AXES:
            return str(m[key])
    for exp, col in (("load", "way"), ("schedule", "policy"), ("concurrency", "concurrency"),
                     ("budget", "budget_tokens")):
        if col in cols:
            return exp
    for exp, key in (("concurrency", "kv_overtakes_batch"), ("load", "slo_max_rate"),
                     ("budget", "one_request_tokens"), ("schedule", "working_set_tokens")):
        if key in m:
            return exp
    return "concurrency"


def timeline(steps: pd.DataFrame) -> pd.DataFrame:
    """The steps with ``clock_s``: each point's clock (``t_s``, from 0 at the point's start)
    offset by the points before it, in the order they ran; and ``first`` (a point's first)."""
    if steps.empty:
        return steps.assign(clock_s=[], first=[])
    parts, offset = [], 0.0
    for _, part in steps.groupby("label", sort=False):
        parts.append(part.assign(clock_s=part["t_s"] + offset,
                                 first=[True] + [False] * (len(part) - 1)))
        offset += float(part["t_s"].max())
    return pd.concat(parts)


def _separators(fig: go.Figure, df: pd.DataFrame) -> None:
    """A dotted line where each point began, named by its label."""
    if df["label"].nunique() < 2:
        return
    for r in df[df["first"]].itertuples():
        start = float(r.clock_s - r.t_s)
        fig.add_vline(x=start, line=dict(color="#999999", dash="dot", width=1))
        fig.add_annotation(x=start, y=1, yref="paper", text=str(r.label), showarrow=False,
                           textangle=-90, xanchor="left", yanchor="top",
                           font=dict(size=10, color="#666"))


def batch_figure(steps: pd.DataFrame, meta: dict[str, Any] | None = None) -> go.Figure:
    """Running and waiting requests after each step; preemptions as crosses on the running."""
    fig = go.Figure()
    df = timeline(steps)
    if not df.empty:
        for col, name, color in (("running", "running", RUNNING),
                                 ("waiting", "waiting (arrived, not running)", WAITING)):
            fig.add_trace(go.Scatter(
                x=df["clock_s"], y=df[col], mode="lines", name=name, line=dict(
                    color=color, shape="hv"), customdata=df[["label", "batch", "tokens"]],
                hovertemplate="%{x:.3f} s (%{customdata[0]}): %{y} " + name.split(" ")[0]
                + "; the step ran %{customdata[1]} requests, %{customdata[2]} tokens"
                "<extra></extra>"))
        hit = df[df["preempted"] > 0]
        fig.add_trace(go.Scatter(
            x=hit["clock_s"], y=hit["running"], mode="markers", name="preempted (recomputed "
            "later)", marker=dict(symbol="x", size=11, color=PREEMPTED),
            customdata=hit[["preempted", "label"]],
            hovertemplate="%{x:.3f} s (%{customdata[1]}): %{customdata[0]} preempted"
            "<extra></extra>"))
        _separators(fig, df)
    style(fig, CLOCK, "requests (measured run)", legend=None, height=440)
    return titled(fig, "Batch over time: requests running and waiting", meta)


def pool_figure(steps: pd.DataFrame, meta: dict[str, Any] | None = None) -> go.Figure:
    """The pool after each step, stacked (own + shared + tree + free = the pool's blocks), and
    the held blocks per running request on the right axis."""
    fig = go.Figure()
    df = timeline(steps)
    if not df.empty:
        df = df.assign(own=df["blocks_running"] - df["blocks_shared"])
        for col, name, color in POOL:
            fig.add_trace(go.Scatter(
                x=df["clock_s"], y=df[col], mode="lines", name=name, stackgroup="pool",
                line=dict(color=color, width=0.5, shape="hv"), fillcolor=color,
                customdata=df[["label", "blocks"]],
                hovertemplate="%{x:.3f} s (%{customdata[0]}): %{y} blocks " + name
                + " of %{customdata[1]}<extra></extra>"))
        per = df["blocks_running"] / df["running"].where(df["running"] > 0)
        fig.add_trace(go.Scatter(
            x=df["clock_s"], y=per, mode="lines", yaxis="y2", name="held blocks per running "
            "request (right)", line=dict(color="#333333", dash="dot", shape="hv"),
            hovertemplate="%{x:.3f} s: %{y:.1f} blocks per running request<extra></extra>"))
        _separators(fig, df)
    tokens = (meta or {}).get("block_tokens")
    fig.update_layout(yaxis2=right_axis("blocks per running request"))
    style(fig, CLOCK, f"blocks{f' of {tokens} tokens' if tokens else ''} (counted after each "
          "step)", legend=None, height=460)
    return titled(fig, "The block pool filling", meta)


def axis(points: pd.DataFrame, meta: dict[str, Any] | None = None) -> tuple[str, str, bool]:
    """(column, title, log) of the experiment's x."""
    return AXES[experiment_of(points, meta)]


def _series(points: pd.DataFrame, meta: dict[str, Any] | None) -> list[tuple[str, pd.DataFrame]]:
    """The points split into lines: per way (load), per K/V dtype (budget), else one line."""
    col = SERIES[experiment_of(points, meta)]
    if col is None or col not in points.columns:
        return [("measured", points)]
    return [(str(k), p) for k, p in points.groupby(col, sort=False)]


def throughput_figure(points: pd.DataFrame, meta: dict[str, Any] | None = None,
                      peers: pd.DataFrame | None = None) -> go.Figure:
    """Output tokens/s against the experiment's x, one line per way; peers' as diamonds."""
    fig = go.Figure()
    x, x_title, log_x = axis(points, meta)
    if not points.empty:
        for i, (name, part) in enumerate(_series(points, meta)):
            color = COLORS[i % 7]
            trace, extra = (go.Scatter, dict(mode="lines+markers", line=dict(color=color))) \
                if log_x else (go.Bar, {})
            part = part.sort_values(x) if log_x else part
            fig.add_trace(trace(
                x=part[x], y=part["output_tok_s"], name=name, marker_color=color,
                customdata=part[["label", "requests_s", "batch_mean"]], **extra,
                hovertemplate="%{customdata[0]}: %{y:,.1f} output tokens/s, %{customdata[1]:.2f}"
                " requests/s, mean batch %{customdata[2]:.1f}<extra></extra>"))
    ok = peers[peers["ok"].astype(bool)] if peers is not None and not peers.empty else None
    for i, (peer, part) in enumerate(ok.groupby("peer") if ok is not None else []):
        fig.add_trace(go.Scatter(
            x=part["concurrency"], y=part["output_tok_s"], mode="lines+markers",
            name=f"peer: {peer}", line=dict(dash="dot", color=COLORS[(i + 2) % 7]),
            marker=dict(symbol="diamond", size=9),
            hovertemplate="concurrency %{x}: %{y:,.1f} output tokens/s<extra>" + str(peer)
            + "</extra>"))
    style(fig, x_title, "output tokens/s (measured)", legend=None, height=380)
    if log_x and not points.empty:
        log_ticks(fig, points[x])
    return titled(fig, "Throughput: output tokens per second", meta)


def latency_figure(points: pd.DataFrame, meta: dict[str, Any] | None = None,
                   log_y: bool = True) -> go.Figure:
    """TTFT (left) and TPOT (right): p50 solid, p99 dashed where there were 100 samples."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08)
    x, x_title, log_x = axis(points, meta)
    for i, (name, part) in enumerate(_series(points, meta) if not points.empty else []):
        part = part.sort_values(x) if log_x else part
        for row, what in ((1, "ttft"), (2, "tpot")):
            for q, dash, symbol in ((50, "solid", "circle"), (99, "dash", "diamond")):
                y = part.get(f"{what}_p{q}_ms")
                if y is None or y.isna().all():
                    continue
                fig.add_trace(go.Scatter(
                    x=part[x], y=y, mode="lines+markers", name=f"{name} p{q}",
                    legendgroup=f"{name} p{q}", showlegend=row == 1,
                    line=dict(color=COLORS[i % 7], dash=dash), marker=dict(symbol=symbol),
                    customdata=part[["label", f"{what}_n"]],
                    hovertemplate="%{customdata[0]}: " + what.upper() + f" p{q} "
                    "%{y:,.1f} ms (%{customdata[1]} samples)<extra></extra>"), row=row, col=1)
    style(fig, "", "", legend=None, height=560)
    for row, what in ((1, "TTFT"), (2, "TPOT")):
        if log_x and not points.empty:
            log_ticks(fig, points[x], row=row, col=1)
        fig.update_yaxes(title_text=f"{what} (ms, measured)", row=row, col=1,
                         **(LOG if log_y else {}))
    fig.update_xaxes(title_text=x_title, row=2, col=1)
    return titled(fig, "Time to first token (TTFT) and per output token (TPOT): p50, p99",
                  meta)


def step_figure(batch_steps: pd.DataFrame, meta: dict[str, Any] | None = None) -> go.Figure:
    """The decode-only step against the batch (rows labelled "all"), beside its floor."""
    fig = go.Figure()
    df = batch_steps[batch_steps["label"] == "all"].sort_values("batch") \
        if not batch_steps.empty else batch_steps
    if not df.empty:
        if "step_samples_ms" in df.columns:
            pts = df[["batch", "step_samples_ms"]].explode("step_samples_ms").dropna()
            fig.add_trace(go.Scatter(
                x=pts["batch"], y=pts["step_samples_ms"].astype(float), mode="markers",
                name="each step (measured)", marker=dict(color=RUNNING, size=4, opacity=0.25),
                hovertemplate="batch %{x}: one step %{y:.3f} ms<extra></extra>"))
        fig.add_trace(go.Scatter(
            x=df["batch"], y=df["step_ms"], mode="lines+markers", name="median step (measured)",
            line=dict(color=RUNNING, width=3), customdata=df[["steps", "over_floor"]],
            hovertemplate="batch %{x}: %{y:.3f} ms over %{customdata[0]} steps, "
            "%{customdata[1]:.1f}× its floor<extra></extra>"))
        for col, name, line in (
                ("floor_ms", "floor: max(FLOPs ÷ matmul peak, bytes ÷ read bandwidth) "
                 "(computed)", dict(color="black", dash="dash")),
                ("weights_read_ms", "the weights' read (computed)",
                 dict(color="#2ca02c", dash="dot")),
                ("kv_read_ms", "K/V read (computed)", dict(color=PREEMPTED, dash="dot")),
                ("compute_ms", "FLOPs ÷ matmul peak (computed)",
                 dict(color="#9467bd", dash="dashdot"))):
            if col in df.columns:
                fig.add_trace(go.Scatter(
                    x=df["batch"], y=df[col], mode="lines", name=name, line=line,
                    hovertemplate="batch %{x}: %{y:.4f} ms<extra>" + name.split(" (")[0]
                    + "</extra>"))
    over = (meta or {}).get("kv_overtakes_batch")
    if over:
        fig.add_vline(x=over, line=dict(color=PREEMPTED, width=1))
        fig.add_annotation(x=math.log10(over), y=1, yref="paper", showarrow=False,
                           xanchor="left", text=f"K/V reads overtake the weights' at batch "
                           f"{over}", font=dict(color=PREEMPTED))
    style(fig, "running batch (requests decoding in the step)", "decode step (ms)",
          log_y=True, legend=None, height=420)
    fig.update_yaxes(dtick=1)  # decades: the floor's parts lie orders of magnitude apart
    if not df.empty:
        log_ticks(fig, df["batch"])
    return titled(fig, "The decode step against the batch, beside its floor", meta)










# points column -> its header on the page (unit, and measured or computed)
TABLE = {"label": "point", "requests": "requests served", "output_tok_s":
         "output tok/s (measured)", "requests_s": "requests/s (measured)",
         "goodput_requests_s": "goodput: requests/s within the SLO (measured)",
         "slo_met": "share within the SLO", "ttft_p50_ms": "TTFT p50 (ms)",
         "ttft_p99_ms": "TTFT p99 (ms)", "tpot_p50_ms": "TPOT p50 (ms)",
         "tpot_p99_ms": "TPOT p99 (ms)", "itl_p50_ms": "ITL p50 (ms)", "batch_max":
         "most running (requests)", "batch_mean": "mean running (requests)", "preemptions":
         "preemptions (count)", "hit_rate": "prefix hit rate (cached ÷ prompt tokens)",
         "schedule_share": "scheduler's share of the time", "duration_s":
         "duration (s, run's clock)"}


def points_table(points: pd.DataFrame) -> pd.DataFrame:
    """The points as the page lists them: the columns of ``TABLE``, headed with their units
    (p99 empty below 100 samples)."""
    shown = points[[c for c in TABLE if c in points.columns]]
    return shown.round({c: 3 if c in ("slo_met", "hit_rate", "schedule_share") else 2
                        for c in shown.columns}).rename(columns=TABLE)
