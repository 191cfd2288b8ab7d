"""Summaries drawn from saved rows (no measuring, torch-free): the write-up's Table 1.

``summary_table(rows, pair, at)`` -> one row per requested context: latency each way, measured
speedup, FLOP reduction; ``format_summary`` prints it for a terminal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def summary_table(rows: Sequence[dict[str, Any]], pair: tuple[str, str] = ("uncached", "concat"),
                  at: Sequence[int] = (10, 100, 500, 1000)) -> list[dict[str, Any]]:
    """The write-up's Table 1 (+ Table 2's rates) from sweep rows, at the nearest measured point.

    A requested point is skipped when no context measured for both modes lies within 25% of it.
    """
    by_mode: dict[str, dict[int, dict]] = {m: {} for m in pair}
    for r in rows:
        if r.get("mode") in by_mode:
            by_mode[r["mode"]][int(r["context_len"])] = r
    common = sorted(set(by_mode[pair[0]]) & set(by_mode[pair[1]]))
    out = []
    for want in at:
        if not common:
            break
        t = min(common, key=lambda c: (abs(c - want), c))
        if abs(t - want) > 0.25 * want:
            continue
        a, b = by_mode[pair[0]][t], by_mode[pair[1]][t]
        out.append({
            "context_len": want, "measured_context_len": t,
            "baseline_mode": pair[0], "baseline_ms": a["latency_ms"],
            "compare_mode": pair[1], "compare_ms": b["latency_ms"],
            "speedup": a["latency_ms"] / b["latency_ms"] if b["latency_ms"] else math.nan,
            "flop_reduction": a["flops"] / b["flops"],
            "baseline_tflops": a.get("tflops"), "compare_tflops": b.get("tflops"),
        })
    return out


def format_summary(table: Sequence[dict[str, Any]]) -> str:
    """Table 1 as fixed-width text for a terminal."""
    if not table:
        return "(no context measured in both modes near 10/100/500/1000 tokens)"
    a, b = table[0]["baseline_mode"], table[0]["compare_mode"]
    head = f"{'context':>8} {a + ' ms':>14} {b + ' ms':>14} {'speedup':>8} {'FLOP ratio':>10}"
    lines = [head]
    for r in table:
        lines.append(f"{r['measured_context_len']:>8} {r['baseline_ms']:>14.2f} "
                     f"{r['compare_ms']:>14.2f} {r['speedup']:>7.1f}x {r['flop_reduction']:>9.0f}x")
    return "\n".join(lines)
