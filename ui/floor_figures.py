"""Pure figure builders for the Floor lab page: rows in, plotly Figures / DataFrames out.

No Streamlit, no measurement. Inputs are the row schemas of the experiments in
``instruments.experiments``: ``attribution`` (``attribute_step`` rows), ``staircase``
(``staircase`` and ``totals``), ``scope`` and ``precision``. Every axis is titled with its
unit; times in ms, memory in MiB.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from ui.figures import mode_color, ordered_modes, style

PART_COLORS = {"floor": "#2ca02c", "excess": "#ff7f0e", "idle": "#d62728"}
SHAPE_COLORS = {"qkv": "#1f77b4", "attn_proj": "#17becf", "mlp_up": "#9467bd",
                "mlp_down": "#8c564b", "head": "#e377c2"}
MIB = 2**20


def _empty(x: str, y: str) -> go.Figure:
    return style(go.Figure(), x, y, legend=None)


def attribution_figure(df: pd.DataFrame, mode: str | None = None, *,
                       cuda: bool | None = None) -> go.Figure:
    """Stacked parts of one mode's step against context, the measured step and both floors.

    Bars: the floor's share of the busy time, busy time above the floor, idle time; they add up
    to ``step_ms`` (the black line). Dashed lines: the byte and FLOP floors on their own.
    """
    x_title, y_title = "context length (tokens)", "time per decode step (ms)"
    if df.empty:
        return _empty(x_title, y_title)
    if mode is None:
        mode = str(df["mode"].iloc[0])
    part = df[df["mode"].astype(str) == mode].sort_values("context_len")
    if part.empty:
        return _empty(x_title, y_title)
    if cuda is None:
        cuda = str(part["device"].iloc[0]).startswith("cuda") if "device" in part else False
    x = part["context_len"].astype(str)  # categories: bars stay readable at 8 and 1000
    idle = "device idle (launch and host overhead)" if cuda else "host gaps (Python, dispatch)"
    busy = "kernel time" if cuda else "time inside operators"
    fig = go.Figure()
    for col, name, color in (
        ("floor_part_ms", f"{busy} the floor explains", PART_COLORS["floor"]),
        ("excess_ms", f"{busy} above the floor (unexplained)", PART_COLORS["excess"]),
        ("idle_ms", idle, PART_COLORS["idle"]),
    ):
        fig.add_trace(go.Bar(x=x, y=part[col], name=name, marker_color=color,
                             hovertemplate="%{x} tokens<br>%{y:.3f} ms<extra>" + name
                             + "</extra>"))
    fig.add_trace(go.Scatter(x=x, y=part["step_ms"], mode="lines+markers",
                             name="measured step (median)", line=dict(color="black", width=2),
                             error_y=dict(type="data", array=part["spread_ms"] / 2,
                                          visible=True, color="black", thickness=1),
                             customdata=part["spread_ms"],
                             hovertemplate="%{x} tokens<br>median %{y:.3f} ms, interquartile "
                             "range %{customdata:.3f} ms<extra>measured</extra>"))
    if "explained_share" in part:  # the share of the step the floor and host time explain
        fig.add_trace(go.Scatter(x=x, y=part["step_ms"], mode="text", showlegend=False,
                                 text=[f"{v:.0%} explained" for v in part["explained_share"]],
                                 textposition="top center", hoverinfo="skip"))
    floors = [("byte_floor_ms", "floor: bytes ÷ measured bandwidth", "dash"),
              ("flop_floor_ms", "floor: FLOPs ÷ measured peak", "dot")]
    if str(part.get("weight_storage", pd.Series([""])).iloc[0]) and \
            "model_dtype_floor_ms" in part:  # a weight-only rung: the model dtype's floor too
        floors.append(("model_dtype_floor_ms", "byte floor with the weights in "
                       f"{part['dtype'].iloc[0] if 'dtype' in part else 'the model dtype'}",
                       "dashdot"))
    for col, name, dash in floors:
        fig.add_trace(go.Scatter(x=x, y=part[col], mode="lines", name=name,
                                 line=dict(color="#555", dash=dash, width=1.5),
                                 hovertemplate="%{x} tokens<br>%{y:.3f} ms<extra>" + name
                                 + "</extra>"))
    title = str(part["mode_label"].iloc[0]) if "mode_label" in part else mode
    fig = style(fig, x_title, y_title, legend="part of the step", height=460)
    # The title sits above the two-row legend, not on top of it.
    fig.update_layout(barmode="stack", title=dict(text=title, y=0.98, yanchor="top"),
                      margin=dict(l=10, r=10, t=110, b=10))
    return fig


def explained_sentence(df: pd.DataFrame, mode: str) -> str:
    """One sentence per mode: how much of the measured step the floor and the profiled host
    time explain across the contexts profiled, and how much kernel time nothing explains."""
    part = df[df["mode"].astype(str) == mode]
    if part.empty or "explained_share" not in part:
        return ""
    share, rest = part["explained_share"] * 100, part["excess_ms"]
    return (f"{mode}: the floor and the profiled host time explain {share.min():.0f}–"
            f"{share.max():.0f}% of the measured step across {len(part)} context lengths; the "
            f"rest, {rest.min():.3g}–{rest.max():.3g} ms, is kernel time above the floor that "
            "nothing measured here explains." + weight_floor_sentence(part))


def weight_floor_sentence(part: pd.DataFrame) -> str:
    """For a weight-only rung (int8 / bf16 weights): the step against its own byte floor and
    against the floor of the same step with the weights in the model dtype; "" otherwise."""
    storage = str(part["weight_storage"].iloc[0]) if "weight_storage" in part else ""
    if not storage or "model_dtype_floor_ms" not in part:
        return ""
    own = part["step_ms"] / part["byte_floor_ms"]
    dtype_floor = part["step_ms"] / part["model_dtype_floor_ms"]
    dtype = str(part["dtype"].iloc[0]) if "dtype" in part else "the model dtype"
    return (f" With its weights in {storage}, its steps took {own.min():.2f}–{own.max():.2f}× "
            f"its own byte floor and {dtype_floor.min():.2f}–{dtype_floor.max():.2f}× the "
            f"floor of the same step with {dtype} weights (below 1×: under what any exact "
            f"{dtype} engine can reach).")


def counts_figure(df: pd.DataFrame) -> go.Figure:
    """Operator calls per step (solid) and CUDA kernel launches per step (dashed), per mode."""
    fig = go.Figure()
    if df.empty:
        return style(fig, "context length (tokens)", "calls per decode step")
    for mode in ordered_modes(df["mode"].astype(str)):
        part = df[df["mode"].astype(str) == mode].sort_values("context_len")
        color = mode_color(mode)
        fig.add_trace(go.Scatter(x=part["context_len"], y=part["ops_per_step"], name=mode
                                 + ": ATen operators", mode="lines+markers",
                                 line=dict(color=color),
                                 hovertemplate="%{x} tokens<br>%{y:.0f} operators<extra>"
                                 + mode + "</extra>"))
        launches = part.get("launches_per_step")
        if launches is not None and launches.notna().any():
            fig.add_trace(go.Scatter(x=part["context_len"], y=launches, mode="lines+markers",
                                     name=mode + ": kernel launches",
                                     line=dict(color=color, dash="dash"),
                                     hovertemplate="%{x} tokens<br>%{y:.0f} launches<extra>"
                                     + mode + "</extra>"))
    fig = style(fig, "context length (tokens)", "calls per decode step")
    fig.update_yaxes(rangemode="tozero")  # counts barely move with context: a linear axis
    return fig


def attribution_table(df: pd.DataFrame) -> pd.DataFrame:
    """The numbers behind the chart, one row per mode and context, rounded for reading."""
    cols = ["mode", "context_len", "step_ms", "spread_ms", "byte_floor_ms", "flop_floor_ms",
            "model_dtype_floor_ms", "above_floor_ms", "explained_share", "ops_per_step",
            "kernels_per_step", "launches_per_step", "ops_ms", "python_ms", "device_ms", "bound"]
    if df.empty:
        return pd.DataFrame(columns=cols)
    out = df[[c for c in cols if c in df.columns]].copy()
    return out.sort_values(["mode", "context_len"]).reset_index(drop=True)


def staircase_figure(totals: pd.DataFrame, uncached: pd.DataFrame | None = None, *,
                     log_y: bool = False) -> go.Figure:
    """The matmuls' summed time per T, over the measured uncached step at the same T.

    ``totals``: T, total_ms, total_last_ms, forward_ms (optional). ``uncached``: optional sweep
    rows (context_len, latency_ms) of mode 1 from another run, drawn as a third curve.
    """
    fig = go.Figure()
    x_title, y_title = "tokens processed, T", "time (ms)"
    if totals.empty:
        return style(fig, x_title, y_title, log_y=log_y, legend=None)
    t = totals.sort_values("T")
    fig.add_trace(go.Scatter(x=t["T"], y=t["total_ms"], mode="lines+markers",
                             name="Linear matmuls alone (head on all T rows)",
                             line=dict(color="#1f77b4"), marker=dict(size=4),
                             hovertemplate="T=%{x}<br>%{y:.3f} ms<extra>matmuls</extra>"))
    fig.add_trace(go.Scatter(x=t["T"], y=t["total_last_ms"], mode="lines",
                             name="Linear matmuls, head on the last row (mode 2)",
                             line=dict(color="#1f77b4", dash="dot"),
                             hovertemplate="T=%{x}<br>%{y:.3f} ms<extra>matmuls, mode 2"
                             "</extra>"))
    if "forward_ms" in t and t["forward_ms"].notna().any():
        fig.add_trace(go.Scatter(x=t["T"], y=t["forward_ms"], mode="lines+markers",
                                 name="whole uncached step, same run (mode 1)",
                                 line=dict(color=mode_color("uncached")), marker=dict(size=4),
                                 hovertemplate="T=%{x}<br>%{y:.3f} ms<extra>mode 1</extra>"))
    if uncached is not None and not uncached.empty:
        u = uncached.sort_values("context_len")
        fig.add_trace(go.Scatter(x=u["context_len"], y=u["latency_ms"], mode="lines",
                                 name="uncached step from a saved sweep",
                                 line=dict(color=mode_color("uncached"), dash="dash"),
                                 hovertemplate="%{x} tokens<br>%{y:.3f} ms<extra>sweep</extra>"))
    return style(fig, x_title, y_title, log_y=log_y, legend=None)


def shapes_figure(rows: pd.DataFrame, *, log_y: bool = True) -> go.Figure:
    """Each matmul shape's own time per T: a jump here that the FLOPs do not have is a step."""
    fig = go.Figure()
    if rows.empty:
        return style(fig, "tokens processed, T", "time per matmul (ms)", log_y=log_y,
                     legend="shape")
    for shape in [s for s in SHAPE_COLORS if s in set(rows["shape"])]:
        part = rows[rows["shape"] == shape].sort_values("T")
        k, n = int(part["k"].iloc[0]), int(part["n"].iloc[0])
        name = f"{shape}: T×{k} @ {k}×{n}"
        fig.add_trace(go.Scatter(x=part["T"], y=part["latency_ms"], mode="lines", name=name,
                                 line=dict(color=SHAPE_COLORS[shape]),
                                 customdata=part["tflops"],
                                 hovertemplate="T=%{x}<br>%{y:.4f} ms · %{customdata:.2f} "
                                 "TFLOP/s<extra>" + shape + "</extra>"))
    return style(fig, "tokens processed, T", "time per matmul (ms)", log_y=log_y,
                 legend="shape")


def scope_figure(df: pd.DataFrame, x: str = "batch_size") -> go.Figure:
    """Measured cached-vs-uncached speedup and the FLOP ratio as the batch or the model grows."""
    x_title = {"batch_size": "batch size (sequences)",
               "model": "model"}.get(x, x)
    fig = go.Figure()
    if df.empty:
        return style(fig, x_title, "uncached ÷ cached step time (×)", legend=None)
    part = df.copy()
    if x == "batch_size":
        part = part.sort_values("batch_size")
    done = part[part["speedup"].notna()] if "speedup" in part else part.iloc[0:0]
    xs = done[x].astype(str) if x == "model" else done[x]
    fig.add_trace(go.Scatter(x=xs, y=done["speedup"], mode="lines+markers",
                             name="measured speedup", line=dict(color="#1f77b4", width=2),
                             hovertemplate="%{x}<br>%{y:.1f}× faster<extra>measured</extra>"))
    xr = part[x].astype(str) if x == "model" else part[x]
    fig.add_trace(go.Scatter(x=xr, y=part["flop_ratio"], mode="lines+markers",
                             name="FLOP ratio (uncached ÷ cached)",
                             line=dict(color="#7f7f7f", dash="dash"),
                             hovertemplate="%{x}<br>%{y:.0f}× fewer FLOPs<extra>formula"
                             "</extra>"))
    return style(fig, x_title, "uncached ÷ cached step time (×)", log_x=x == "batch_size",
                 log_y=True, legend=None)


def scope_table(df: pd.DataFrame) -> pd.DataFrame:
    cols = ["model", "batch_size", "context_len", "cached_ms", "uncached_ms", "speedup",
            "flop_ratio", "tokens_per_s", "skipped"]
    return df[[c for c in cols if c in df.columns]].reset_index(drop=True)


def precision_table(df: pd.DataFrame) -> pd.DataFrame:
    """Time, memory and agreement with fp32 per precision, memory in MiB."""
    if df.empty:
        return pd.DataFrame(columns=["precision"])
    out = pd.DataFrame({
        "precision": df["precision"],
        "step (ms)": df["step_ms"],
        "weights (MiB)": df["weight_bytes"] / MIB,
        "KV per token (KiB)": df["kv_bytes_per_token"] / 1024,
        "top-1 agreement with fp32": df["top1_agreement"],
        "max |Δ logit| vs fp32": df["max_logit_diff"],
        "greedy tokens identical to fp32": df["identical_prefix_tokens"],
    })
    return out.reset_index(drop=True)


def precision_figure(df: pd.DataFrame) -> go.Figure:
    """Decode-step time per precision, with the weight memory written on each bar."""
    fig = go.Figure()
    if df.empty:
        return style(fig, "precision", "time per decode step (ms)", legend=None)
    fig.add_trace(go.Bar(x=df["precision"], y=df["step_ms"], marker_color="#1f77b4",
                         text=[f"{b / MIB:.0f} MiB" for b in df["weight_bytes"]],
                         textposition="outside", name="step time",
                         hovertemplate="%{x}<br>%{y:.3f} ms<br>weights %{text}<extra></extra>"))
    return style(fig, "precision", "time per decode step (ms)", legend=None)
