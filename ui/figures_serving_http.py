"""guidellm's runs over HTTP beside our own harness's, for the Serving page: pure builders, runs in,
a DataFrame and plotly Figures out.

  http_points(runs)            one row per point of every run given: kind "serving_http" (ours
                               or llama-server, measured by guidellm) and kind "serving" (our
                               harness: closed-loop concurrency, continuous batching under
                               Poisson arrivals); ``source`` says which, ``loop`` closed or
                               poisson, ``x`` the concurrency or the rate, ``host`` the machine
  http_figure(points, y, title, loop)   ``y`` against ``x`` for one loop, a line per source;
                               every source names its host in the legend
Torch-free, streamlit-free: the page (views/serving.py) draws them under its saved runs.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.graph_objects as go

from ui.figures import DASHES, style

COLORS = {"ours over HTTP": "#2171b5", "llama-server over HTTP": "#cb181d",
          "our harness": "#41ab5d"}
LOOPS = {"closed": ("concurrency (clients, closed loop)", True),
         "poisson": ("arrival rate (requests/s, Poisson)", True)}


def _host(meta: dict[str, Any]) -> str:
    return f"{meta.get('device_name') or meta.get('device')}, {meta.get('threads')} threads"


def http_points(runs: list[dict[str, Any]]) -> pd.DataFrame:
    rows = []
    for run in runs:
        meta = run.get("meta") or {}
        if run.get("kind") == "serving_http":
            source = ("ours over HTTP" if meta.get("server") == "kvlab"
                      else f"{meta.get('server')} over HTTP")
        elif run.get("kind") == "serving":
            source = "our harness"
        else:
            continue
        for p in (run.get("tables") or {}).get("points", []):
            if p.get("concurrency") is not None:
                loop, x = "closed", p["concurrency"]
            elif p.get("rate_per_s") is not None and p.get("way", "continuous") == "continuous":
                loop, x = "poisson", p["rate_per_s"]
            else:
                continue
            rows.append({"source": source, "loop": loop, "x": float(x), "host": _host(meta),
                         "run": str(run.get("run_id", ""))[:6],
                         **{k: p.get(k) for k in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms",
                                                  "tpot_mean_ms", "itl_p99_ms", "requests")}})
    return pd.DataFrame(rows, columns=["source", "loop", "x", "host", "run", "output_tok_s",
                                       "ttft_p50_ms", "ttft_p99_ms", "tpot_mean_ms",
                                       "itl_p99_ms", "requests"])


def http_figure(points: pd.DataFrame, y: str, y_title: str, loop: str = "closed") -> go.Figure:
    """``y`` against the concurrency (or rate), one line per source and run."""
    fig = go.Figure()
    part = points[(points["loop"] == loop) & points[y].notna()] if len(points) else points
    groups = part.groupby(["source", "run", "host"], sort=False) if len(part) else []
    for i, ((source, run, host), lines) in enumerate(groups):
        lines = lines.sort_values("x")
        name = f"{source} · {host} · {run}"
        fig.add_trace(go.Scatter(
            x=lines["x"], y=lines[y], mode="lines+markers", name=name,
            line=dict(color=COLORS.get(source, "#6a51a3"), dash=DASHES[i % len(DASHES)]),
            hovertemplate="%{x:g}: %{y:,.1f}<extra>" + name + "</extra>"))
    x_title, log_x = LOOPS[loop]
    style(fig, x_title, y_title, log_x=log_x, legend="source · host · run", height=420)
    fig.update_layout(title=dict(text=f"{y_title}: guidellm over HTTP beside our harness",
                                 x=0, xanchor="left"), margin=dict(t=70))
    return fig
