"""Pure builders for the FLOPs-vs-time page: Figure 4, achieved throughput (Figure 5 / Table 2)
and a roofline. DataFrames in (sweep rows: mode, context_len, latency_ms, flops, tflops, bytes),
plotly Figures or DataFrames out; no Streamlit, no measurement.

Units: FLOPs and bytes per step as counted by ``instruments.costmodel.costs`` (formulas), time
measured; TFLOP/s = 1e12 FLOP/s, GB/s = 1e9 B/s, arithmetic intensity in FLOP per byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from instruments.measure.specs import lookup_peaks
from ui.figures import UNCACHED_MODES, mode_color, mode_names, ordered_modes, style


@dataclass(frozen=True)
class Ceiling:
    """One device roof: compute peak and memory bandwidth, with where the numbers come from."""

    label: str  # e.g. "listed (datasheet)" or "measured here"
    tflops: float
    gbps: float | None = None


def baseline_mode(df: pd.DataFrame) -> str | None:
    present = set(df["mode"].astype(str)) if not df.empty else set()
    return next((m for m in UNCACHED_MODES if m in present), None)


def reductions(df: pd.DataFrame, baseline: str = "uncached") -> pd.DataFrame:
    """How many times cheaper each other mode is than ``baseline``, in FLOPs and in time.

    Returns mode, context_len, flop_reduction, time_reduction (only contexts both modes have).
    """
    cols = ["mode", "context_len", "flop_reduction", "time_reduction"]
    if df.empty or baseline not in set(df["mode"].astype(str)):
        return pd.DataFrame(columns=cols)
    base = df[df["mode"] == baseline].set_index("context_len")
    out = []
    for mode in ordered_modes(df["mode"].astype(str)):
        if mode == baseline:
            continue
        part = df[df["mode"] == mode].set_index("context_len")
        common = sorted(set(base.index) & set(part.index))
        for t in common:
            out.append({
                "mode": mode, "context_len": t,
                "flop_reduction": float(base.loc[t, "flops"]) / float(part.loc[t, "flops"]),
                "time_reduction": float(base.loc[t, "latency_ms"])
                / float(part.loc[t, "latency_ms"]),
            })
    return pd.DataFrame(out, columns=cols)


def reduction_figure(df: pd.DataFrame, baseline: str = "uncached",
                     log_y: bool = True) -> go.Figure:
    """Figure 4: FLOP reduction (dashed) and measured time reduction (solid) against context."""
    red = reductions(df, baseline)
    fig = go.Figure()
    names = mode_names(df) if not df.empty else {}
    for mode in ordered_modes(red["mode"]):
        part = red[red["mode"] == mode].sort_values("context_len")
        color = mode_color(mode)
        label = names.get(mode, mode)
        fig.add_trace(go.Scatter(
            x=part["context_len"], y=part["flop_reduction"], mode="lines",
            name=f"{label}: FLOPs (formula)", legendgroup=mode,
            line=dict(color=color, dash="dash"),
            hovertemplate="%{x} tokens<br>%{y:.1f}× fewer FLOPs<extra>" + mode + "</extra>"))
        fig.add_trace(go.Scatter(
            x=part["context_len"], y=part["time_reduction"], mode="lines+markers",
            name=f"{label}: time (measured)", legendgroup=mode,
            line=dict(color=color, width=2), marker=dict(size=5),
            hovertemplate="%{x} tokens<br>%{y:.2f}× less time<extra>" + mode + "</extra>"))
        last = part.iloc[-1]
        for value, suffix in ((last["flop_reduction"], "FLOPs"), (last["time_reduction"], "time")):
            fig.add_annotation(x=last["context_len"], y=float(np.log10(value)) if log_y
                               else value, text=f"{value:.0f}× {suffix}" if value >= 10
                               else f"{value:.1f}× {suffix}", showarrow=False, xanchor="left",
                               xshift=6, font=dict(color=color, size=11))
    fig.add_hline(y=1, line=dict(color="#999", width=1, dash="dot"))
    return style(fig, "context length (tokens)", f"times cheaper than {baseline} (×)",
                 log_y=log_y, legend=None)


def throughput_figure(df: pd.DataFrame, ceilings: list[Ceiling] | None = None,
                      percent_of: Ceiling | None = None, log_y: bool = True) -> go.Figure:
    """Figure 5: achieved TFLOP/s (formula FLOPs ÷ measured time) per mode against context.

    With ``percent_of`` the y axis is the share of that ceiling's peak instead; otherwise the
    ``ceilings`` are drawn as horizontal lines.
    """
    fig = go.Figure()
    scale = 100.0 / percent_of.tflops if percent_of is not None else 1.0
    names = mode_names(df) if not df.empty else {}
    for mode in ordered_modes(df["mode"].astype(str)) if not df.empty else []:
        part = df[df["mode"].astype(str) == mode].sort_values("context_len")
        unit = "% of peak" if percent_of is not None else "TFLOP/s"
        fig.add_trace(go.Scatter(
            x=part["context_len"], y=part["tflops"] * scale, mode="lines+markers",
            name=names.get(mode, mode), line=dict(color=mode_color(mode), width=2),
            hovertemplate="%{x} tokens<br>%{y:.3g} " + unit + "<extra>" + mode + "</extra>"))
    if percent_of is None and not df.empty:
        span = [float(df["context_len"].min()), float(df["context_len"].max())]
        for i, c in enumerate(ceilings or []):  # a trace, not add_hline: log axes misplace those
            fig.add_trace(go.Scatter(
                x=span, y=[c.tflops, c.tflops], mode="lines", name=f"peak, {c.label}",
                line=dict(color="#444", dash=("dash", "dot")[i % 2], width=1.5),
                hovertemplate=f"{c.label} peak: {c.tflops:.3g} TFLOP/s<extra></extra>"))
    if percent_of is None:
        y_title = "achieved TFLOP/s (formula FLOPs ÷ measured time)"
    else:
        y_title = f"% of {percent_of.tflops:.3g} TFLOP/s peak ({percent_of.label})"
    return style(fig, "context length (tokens)", y_title, log_y=log_y)


def achieved_table(df: pd.DataFrame, peak: Ceiling | None = None) -> pd.DataFrame:
    """Table 2: context_len, then per mode the achieved TFLOP/s and (with a peak) its share."""
    if df.empty:
        return pd.DataFrame(columns=["context_len"])
    out = pd.DataFrame({"context_len": sorted(df["context_len"].unique())})
    for mode in ordered_modes(df["mode"].astype(str)):
        part = df[df["mode"] == mode].set_index("context_len")["tflops"]
        out[f"{mode} TFLOP/s"] = out["context_len"].map(part)
        if peak is not None:
            out[f"{mode} % of peak"] = out[f"{mode} TFLOP/s"] * 100.0 / peak.tflops
    return out


def roofline_figure(df: pd.DataFrame, ceilings: list[Ceiling]) -> go.Figure:
    """Arithmetic intensity (FLOP/byte) against achieved TFLOP/s, log-log, under the roofs.

    A roof is min(peak, bandwidth × intensity). Points far below both roofs are limited by
    neither arithmetic nor memory traffic but by per-step overhead.
    """
    fig = go.Figure()
    data = df[(df["bytes"] > 0) & (df["flops"] > 0)] if not df.empty else df
    names = mode_names(df) if not df.empty else {}
    xs: list[float] = []
    for mode in ordered_modes(data["mode"].astype(str)) if not data.empty else []:
        part = data[data["mode"].astype(str) == mode].sort_values("context_len")
        ai = part["flops"] / part["bytes"]
        xs.extend(ai.tolist())
        fig.add_trace(go.Scatter(
            x=ai, y=part["tflops"], mode="markers+lines", name=names.get(mode, mode),
            line=dict(color=mode_color(mode), width=1), marker=dict(size=7),
            customdata=np.stack([part["context_len"], part["latency_ms"]], axis=-1),
            hovertemplate="%{x:.3g} FLOP/byte<br>%{y:.3g} TFLOP/s<br>context %{customdata[0]}"
            " tokens, %{customdata[1]:.2f} ms<extra>" + mode + "</extra>"))
    ridges = [c.tflops * 1e3 / c.gbps for c in ceilings if c.gbps]
    lo = min(xs + ridges, default=0.1) / 4
    hi = max(xs + ridges, default=100.0) * 4
    grid = np.logspace(np.log10(max(lo, 1e-3)), np.log10(hi), 200)
    for i, c in enumerate(ceilings):
        dash = ("solid", "dash", "dot")[i % 3]
        roof = np.full_like(grid, c.tflops) if not c.gbps else np.minimum(
            c.tflops, c.gbps * grid / 1e3)
        what = f"{c.tflops:.3g} TFLOP/s" + (f", {c.gbps:.0f} GB/s" if c.gbps else "")
        fig.add_trace(go.Scatter(
            x=grid, y=roof, mode="lines", name=f"roof: {c.label} ({what})",
            line=dict(color="#555", dash=dash, width=1.5),
            hovertemplate="%{x:.3g} FLOP/byte<br>ceiling %{y:.3g} TFLOP/s<extra>"
            + c.label + "</extra>"))
        if c.gbps:
            ridge = c.tflops * 1e3 / c.gbps
            fig.add_annotation(x=float(np.log10(ridge)), y=float(np.log10(c.tflops)),
                               text=f"ridge {ridge:.0f} FLOP/B", showarrow=True, ay=-25,
                               font=dict(size=10, color="#555"))
    return style(fig, "arithmetic intensity (FLOP per byte moved, formula)",
                 "achieved TFLOP/s (measured)", log_x=True, log_y=True, height=460,
                 legend=None)


def ceilings(device_name: str | None, dtype: str, measured: dict[str, Any] | None,
             listed_tflops: float | None = None) -> list[Ceiling]:
    """Roofs to draw: the datasheet's (when the device is listed) and the measured ones."""
    out: list[Ceiling] = []
    spec = lookup_peaks(device_name)
    if spec is not None:
        peak = spec.peak_tflops(dtype) or spec.fp32_tflops
        out.append(Ceiling("listed", float(peak), float(spec.mem_bandwidth_gbps)))
    elif listed_tflops:
        out.append(Ceiling("listed", float(listed_tflops), None))
    if measured:
        out.append(Ceiling("measured here", float(measured["matmul_tflops"]),
                           float(measured["read_gbps"])))
    return out


def run_ceilings(run: dict[str, Any]) -> list[Ceiling]:
    """The roofs a saved run carries: its listed peaks and the peaks measured with it."""
    meta = run.get("meta") or {}
    peaks = meta.get("peaks") or {}
    return ceilings(meta.get("device_name"), str(meta.get("dtype") or "float32"),
                    peaks.get("measured"), peaks.get("fp32_tflops"))


def floor_sentence(df: pd.DataFrame, measured: dict[str, Any] | None) -> str | None:
    """What this run's cached steps were against their byte floor, from its own measured read
    bandwidth: "cached steps took a-b x the byte floor ...". None without peaks or cached rows."""
    if not measured or not measured.get("read_gbps") or df.empty or "bytes" not in df:
        return None
    rows = df[df["mode"].astype(str).map(lambda m: m not in UNCACHED_MODES)]
    if "phase" in rows:
        rows = rows[rows["phase"] != "prefill"]
    if rows.empty:
        return None
    floor_ms = rows["bytes"] / (float(measured["read_gbps"]) * 1e9) * 1e3
    ratio = rows["latency_ms"] / floor_ms
    return (f"Cached steps in this run took {ratio.min():.2g}–{ratio.max():.2g}× their byte "
            f"floor: the bytes a step must move (weights, K/V, activations) ÷ the "
            f"{float(measured['read_gbps']):.3g} GB/s read bandwidth measured with the run. "
            "Near 1× a step is bound by memory traffic; far above it, by something else.")


def share_sentence(df: pd.DataFrame, peak: Ceiling) -> str:
    """The share of ``peak`` this run's uncached and cached steps reached, in one sentence."""
    parts = []
    for what, rows in (("uncached", df[df["mode"].isin(UNCACHED_MODES)]),
                       ("cached", df[~df["mode"].isin(UNCACHED_MODES)])):
        if not rows.empty and "tflops" in rows:
            pct = rows["tflops"].astype(float) / peak.tflops * 100
            parts.append(f"{what} steps {pct.min():.2g}–{pct.max():.2g}%")
    if not parts:
        return ""
    return f"Of the {peak.label} peak ({peak.tflops:.3g} TFLOP/s), {' and '.join(parts)}."
