"""Pure figure builders for the prefix cache: rows of the ``prefix_ttft``, ``prefix_chat`` and
``prefix_workload`` runs in, plotly Figures out. No Streamlit, no measurement.

  ttft_figure      TTFT against the cached prefix, one colour per prompt length: measured
                   (solid), the prediction (a cold prefill of the new tokens alone + the lookup:
                   dashed), the same new tokens appended after the prefix in a contiguous cache
                   (dotted), and the lookup itself (crosses)
  chat_figure      TTFT per turn of the chat, with and without reuse
  chat_kv_figure   K/V bytes each turn computed, and the bytes held at its first token
  budget_figure    per budget: hit rate (bars) and TTFT p50 / p99 (markers), beside no reuse
  held_figure      bytes the pool held at each request's first token (the tree's and the
                   request's own), per budget, and where evictions happened
  tree_figure      the radix tree at one step of the stream: each node a box from its first to
                   its last token (x) over the lanes of the leaves below it (y), shaded by the
                   largest reference count of its blocks, outlined where the running request
                   reads it; the request's own blocks after its cached prefix (orange); the
                   leaves evicted at that step drawn in red beneath
Every axis is titled with its unit.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from ui.figures import DASHES, MIB, style

MEASURED = "#1f77b4"
PROMPTS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b")  # one colour per prompt length
MODES = {"reuse": "#1f77b4", "no reuse": "#d62728"}
REFS = {1: "#c6dbef", 2: "#6baed6", 3: "#2171b5"}  # largest reference count (3: 3 or more)
IN_USE, EVICTED, OWN = "#e6550d", "#d62728", "#fdae6b"


def ttft_figure(df: pd.DataFrame) -> go.Figure:
    """Per prompt length (one colour each): the measured TTFT (solid), the prediction (dashed),
    the extend (dotted) and the lookup (crosses), on a log axis."""
    x_title, y_title = "tokens taken from the prefix cache (P)", "time to first token (ms)"
    fig = go.Figure()
    if df.empty:
        return style(fig, x_title, y_title, legend=None)
    for i, (n, part) in enumerate(sorted(df.groupby("prompt_len"), key=lambda g: g[0])):
        part = part.sort_values("cached_tokens")
        color = PROMPTS[i % len(PROMPTS)]
        traces = (("ttft_ms", "measured", dict(color=color, width=3), "lines+markers"),
                  ("predicted_ms", "prefill of the N − P new tokens alone + lookup",
                   dict(color=color, dash="dash"), "lines"),
                  ("extend_ms", "the new tokens after the prefix, contiguous cache",
                   dict(color=color, dash="dot"), "lines"),
                  ("lookup_ms", "the lookup", dict(color=color), "markers"))
        for column, what, line, mode in traces:
            if column not in part:
                continue
            name = f"N = {n}: {what}"
            fig.add_trace(go.Scatter(
                x=part["cached_tokens"], y=part[column], mode=mode, name=name, line=line,
                marker=dict(symbol="x" if column == "lookup_ms" else "circle", color=color),
                legendgroup=str(n), customdata=part[["new_tokens", "tree_tokens"]],
                hovertemplate="P = %{x}, %{customdata[0]} new tokens: %{y:,.3f} ms "
                "(%{customdata[1]:,} tokens in the tree)<extra>" + name + "</extra>"))
    return style(fig, x_title, y_title, log_y=True, legend=None, height=480)


def chat_figure(df: pd.DataFrame) -> go.Figure:
    """TTFT per turn, one line per mode; cached tokens on hover."""
    fig = go.Figure()
    for mode, part in df.groupby("mode", sort=False) if not df.empty else []:
        part = part.sort_values("turn")
        fig.add_trace(go.Scatter(
            x=part["turn"], y=part["ttft_ms"], mode="lines+markers", name=str(mode),
            line=dict(color=MODES.get(str(mode))),
            customdata=part[["prompt_tokens", "cached_tokens"]],
            hovertemplate="turn %{x}: %{y:,.1f} ms (%{customdata[0]} tokens, %{customdata[1]} "
            "cached)<extra>" + str(mode) + "</extra>"))
    fig.update_xaxes(dtick=1)
    return style(fig, "turn", "time to first token (ms)", legend="KV of the earlier turns")


def chat_kv_figure(df: pd.DataFrame) -> go.Figure:
    """Per turn and mode: K/V computed (bars), held at the first token (markers), in MiB."""
    fig = go.Figure()
    for mode, part in df.groupby("mode", sort=False) if not df.empty else []:
        part = part.sort_values("turn")
        fig.add_trace(go.Bar(x=part["turn"], y=part["kv_bytes_computed"] / MIB,
                             name=f"{mode}: computed", marker_color=MODES.get(str(mode)),
                             hovertemplate="turn %{x}: %{y:,.2f} MiB computed<extra></extra>"))
        fig.add_trace(go.Scatter(x=part["turn"], y=part["kv_bytes_held"] / MIB, mode="markers",
                                 name=f"{mode}: held", marker=dict(
                                     symbol="diamond-open", size=11,
                                     color=MODES.get(str(mode))),
                                 hovertemplate="turn %{x}: %{y:,.2f} MiB held<extra></extra>"))
    fig.update_layout(barmode="group")
    fig.update_xaxes(dtick=1)
    return style(fig, "turn", "K/V (MiB)", legend=None, height=360)


def budget_figure(df: pd.DataFrame) -> go.Figure:
    """Per budget: hit rate (bars, left) and TTFT p50 / p99 (markers, right); no reuse's TTFT
    as dashed lines."""
    fig = go.Figure()
    if df.empty:
        return style(fig, "KV budget (MiB)", "hit rate", legend=None)
    mine, plain = df[df["reuse"]], df[~df["reuse"]]
    x = [f"{b:,.1f}" for b in mine["budget_mib"]]
    fig.add_trace(go.Bar(x=x, y=mine["hit_rate"], name="hit rate (cached / prompt tokens)",
                         marker_color="#c6dbef", customdata=mine[["evictions"]],
                         hovertemplate="%{x} MiB: %{y:.0%} of prompt tokens cached, "
                         "%{customdata[0]} evictions<extra></extra>"))
    for q, symbol in ((50, "circle"), (99, "diamond")):
        col = f"ttft_p{q}_ms"
        fig.add_trace(go.Scatter(x=x, y=mine[col], mode="lines+markers", yaxis="y2",
                                 name=f"TTFT p{q}", marker=dict(symbol=symbol, size=10),
                                 line=dict(color=MEASURED),
                                 hovertemplate=f"%{{x}} MiB: p{q} %{{y:,.0f}} ms<extra></extra>"))
        if not plain.empty and plain[col].notna().all():
            fig.add_trace(go.Scatter(x=[x[0], x[-1]], y=[float(plain[col].iloc[0])] * 2,
                                     mode="lines", yaxis="y2", name=f"no reuse: TTFT p{q}",
                                     line=dict(color=EVICTED, dash="dash" if q == 50 else "dot"),
                                     hovertemplate=f"no reuse: p{q} %{{y:,.0f}} ms"
                                     "<extra></extra>"))
    fig.update_layout(yaxis=dict(tickformat=".0%", range=[0, 1]),
                      yaxis2=dict(title="time to first token (ms)", overlaying="y",
                                  side="right", type="log"))
    return style(fig, "KV budget (MiB)", "hit rate", legend=None)


def held_figure(df: pd.DataFrame) -> go.Figure:
    """Bytes held at each request's first token, one line per budget; evictions as crosses."""
    fig = go.Figure()
    for i, (label, part) in enumerate(df.groupby("label", sort=False) if not df.empty else []):
        part = part.sort_values("request")
        fig.add_trace(go.Scatter(
            x=part["request"], y=part["bytes_held"] / MIB, mode="lines", name=str(label),
            line=dict(dash=DASHES[i % len(DASHES)]),
            hovertemplate="request %{x}: %{y:,.2f} MiB held<extra>" + str(label) + "</extra>"))
        grew = part[part["evictions"].diff().fillna(part["evictions"]) > 0]
        if len(grew):
            fig.add_trace(go.Scatter(
                x=grew["request"], y=grew["bytes_held"] / MIB, mode="markers",
                marker=dict(symbol="x", color=EVICTED), showlegend=False,
                customdata=grew[["evictions"]],
                hovertemplate="request %{x}: evictions so far %{customdata[0]}<extra></extra>"))
    return style(fig, "request (arrival order)", "K/V held (MiB)", legend="budget", height=360)


def lanes(nodes: pd.DataFrame) -> dict[int, tuple[float, float]]:
    """(low, high) lane of each node: every leaf a lane of its own, in depth-first order (the
    older child first); a node spans the lanes of the leaves below it."""
    kids: dict[int, list[int]] = {}
    for node, parent in zip(nodes["node"], nodes["parent"], strict=True):
        kids.setdefault(int(parent), []).append(int(node))
    out: dict[int, tuple[float, float]] = {}
    next_lane = 0

    def place(node: int) -> tuple[float, float]:
        nonlocal next_lane
        below = [place(k) for k in sorted(kids.get(node, []))]
        if not below:
            next_lane += 1
            span = (next_lane - 1.0, float(next_lane))
        else:
            span = (below[0][0], below[-1][1])
        out[node] = span
        return span

    for root_child in sorted(kids.get(0, [])):
        place(root_child)
    return out


def tree_figure(tree: pd.DataFrame, evictions: pd.DataFrame, step: int) -> go.Figure:
    """The tree at ``step`` (rows of the run's ``tree`` and ``evictions`` tables)."""
    fig = go.Figure()
    x_title, y_title = "token position", "leaves (one lane each)"
    nodes = tree[tree["step"] == step] if not tree.empty else tree
    if nodes.empty:
        return style(fig, x_title, y_title, legend=None)
    span = lanes(nodes)
    for ref, color in REFS.items():  # legend entries for the shades
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=(
            f"blocks referenced {ref}{'+' if ref == 3 else ''}×"),
            marker=dict(symbol="square", size=12, color=color)))
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="read by the request",
                             marker=dict(symbol="square-open", size=12, color=IN_USE)))
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="the request's own blocks",
                             marker=dict(symbol="square", size=12, color=OWN)))
    for r in nodes.itertuples():
        lo, hi = span[int(r.node)]
        own = bool(getattr(r, "request", False))
        color = OWN if own else REFS[min(int(r.max_ref), 3)]
        edge = dict(color=IN_USE, width=3) if r.lock and not own else dict(color="white",
                                                                         width=1)
        fig.add_trace(go.Scatter(
            x=[r.start, r.end, r.end, r.start, r.start], y=[lo + .06, lo + .06, hi - .06,
                                                            hi - .06, lo + .06],
            fill="toself", fillcolor=color, line=edge, mode="lines", showlegend=False,
            hovertemplate=(f"the request computes tokens {r.start}..{r.end - 1} into "
                           f"{r.blocks} blocks of its own<extra></extra>" if own else
                           f"node {r.node}: tokens {r.start}..{r.end - 1} ({r.tokens}), "
                           f"{r.blocks} blocks, {r.shared_blocks} shared, largest count "
                           f"{r.max_ref}" + (", in use" if r.lock else "") + "<extra></extra>")))
    gone = evictions[evictions["step"] == step] if not evictions.empty else evictions
    for i, e in enumerate(gone.itertuples()):
        y = -0.6 - 0.5 * i
        fig.add_trace(go.Scatter(
            x=[e.start, e.end], y=[y, y], mode="lines", line=dict(color=EVICTED, width=8),
            name="evicted at this step", showlegend=i == 0,
            hovertemplate=(f"evicted: node {e.node}, tokens {e.start}..{e.end - 1}, "
                           f"{e.blocks_freed} blocks freed<extra></extra>")))
    fig.update_yaxes(showticklabels=False)
    leaves = max(hi for _, hi in span.values())
    return style(fig, x_title, y_title, legend=None, height=int(max(300, 36 * leaves + 160)))
