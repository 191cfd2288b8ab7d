"""Reading a peers run (kind "peers", ``instruments.experiments.peers``): torch-free, for the CLI,
the Peers page, ``scripts/bench_peers.py`` and the generated docs.

``verdict(rows)``         the fastest engine at each precision and context, and how far the others
                          are
``markdown(rows)``        the table of every engine and context, then the peers that did not run
``llamacpp_pairs(rows)``  per context, our rung and llama.cpp's peer on the same bytes, per format
``llamacpp_goals(rows)``  those pairs against the goal (ours <= llama.cpp) and the target (0.8x),
                          and q4_1 against the fp32 read floor (0.35x)
"""

from __future__ import annotations

from typing import Any


def timed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("latency_ms") is not None]


def verdict(rows: list[dict[str, Any]]) -> list[str]:
    """At each context: the fastest engine at each precision, and how far the others are."""
    out = []
    done = timed(rows)
    for t in sorted({r["context_len"] for r in done}):
        here = [r for r in done if r["context_len"] == t]
        parts = []
        for precision in sorted({r["precision"] for r in here}, key=lambda p: p != "float32"):
            group = sorted((r for r in here if r["precision"] == precision),
                           key=lambda r: r["latency_ms"])
            best = group[0]
            said = (f"{precision}: {best['engine']} is fastest ({best['latency_ms']:.2f} ms, "
                    f"{best['x_floor']:.2f}× the read floor)" if best.get("x_floor") else
                    f"{precision}: {best['engine']} is fastest ({best['latency_ms']:.2f} ms)")
            ours = [r for r in group if r["kind"] == "mode"]
            if ours and ours[0] is not best:
                said += (f"; our fastest, {ours[0]['engine']}, takes "
                         f"{ours[0]['latency_ms'] / best['latency_ms']:.2f}× its time")
            elif ours and len(group) > 1:
                said += (f"; the next, {group[1]['engine']}, takes "
                         f"{group[1]['latency_ms'] / best['latency_ms']:.2f}× its time")
            parts.append(said)
        out.append(f"At {t} tokens, {'; '.join(parts)}.")
    return out


# (our rung, llama.cpp's peer on the same bytes, the format): the goal is ours <= theirs at
# every context and thread count, the target 0.8x; q4_1 also <= 0.35x the fp32 read floor
LLAMACPP_PAIRS = (("q4_1_weights", "llamacpp_q4_1", "Q4_1"),
                  ("q8_0_weights", "llamacpp_q8_0", "Q8_0"),
                  (None, "llamacpp_f32", "F32"))  # None: our fastest exact fp32 mode
LLAMACPP_GOAL, LLAMACPP_TARGET, Q4_FLOOR_TARGET = 1.0, 0.8, 0.35


def llamacpp_pairs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per context of a run with llama.cpp's rows: {"context", per format (ours, theirs) -- the
    rows -- or None, f"{format} why" where llama.cpp's was not timed, "q4_floor" and "q4_own":
    q4_1's x the fp32 read and x a read of its own bytes}; [] for a run without llama.cpp."""
    done = timed(rows)
    if not any(str(r.get("engine", "")).startswith("llamacpp") for r in done):
        return []  # a peers run from before llama.cpp joined, or without it installed
    untimed = {r["engine"]: r.get("why") or "not timed" for r in rows
               if r.get("latency_ms") is None}
    out = []
    for t in sorted({int(r["context_len"]) for r in done}):
        here = {r["engine"]: r for r in done if int(r["context_len"]) == t}
        exact = [r for r in here.values() if r.get("kind") == "mode"
                 and r.get("precision") == "float32"]
        point: dict[str, Any] = {"context": t}
        for ours, theirs, fmt in LLAMACPP_PAIRS:
            mine = here.get(ours) if ours else min(exact, key=lambda r: r["latency_ms"],
                                                   default=None)
            other = here.get(theirs)
            point[fmt] = None if mine is None or other is None else (mine, other)
            if theirs in untimed:
                point[f"{fmt} why"] = untimed[theirs]
        q4 = here.get("q4_1_weights") or {}
        point["q4_floor"], point["q4_own"] = q4.get("x_floor"), q4.get("x_own_floor")
        out.append(point)
    return out


def llamacpp_goals(rows: list[dict[str, Any]]) -> list[str]:
    """One line per context and format: our step over llama.cpp's on the same weights, against
    the goal (<= 1) and the target (<= 0.8), and our q4_1 step over the fp32 read floor."""
    out = []
    for point in llamacpp_pairs(rows):
        for _, theirs, fmt in LLAMACPP_PAIRS:
            if point[fmt] is None:
                continue
            mine, other = point[fmt]
            ratio = mine["latency_ms"] / other["latency_ms"]
            said = ("target met" if ratio <= LLAMACPP_TARGET else "goal met"
                    if ratio <= LLAMACPP_GOAL else "MISSED")
            line = (f"At {point['context']} tokens: {mine['engine']} {mine['latency_ms']:.2f} ms "
                    f"÷ {theirs} {other['latency_ms']:.2f} ms = {ratio:.2f} ({said}: goal ≤ 1, "
                    f"target ≤ {LLAMACPP_TARGET})")
            if fmt == "Q4_1" and point["q4_floor"] is not None:
                line += (f"; {point['q4_floor']:.2f}× the fp32 read floor (target ≤ "
                         f"{Q4_FLOOR_TARGET})")
            out.append(line + ".")
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """The README's table: one line per engine and context, then the peers that did not run."""
    head = ("| engine | precision | context | median (ms) | p90 (ms) | × read floor | "
            "× its own floor | × our fastest exact | logits max abs diff | weights (MB) | "
            "version |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]

    def num(v: Any, spec: str) -> str:
        return "—" if v is None else format(v, spec)

    for r in sorted(timed(rows), key=lambda r: (r["context_len"], r["latency_ms"])):
        lines.append(
            f"| {r['engine']} | {r['precision']} | {r['context_len']} | "
            f"{r['latency_ms']:.2f} | {num(r.get('p90_ms'), '.2f')} | "
            f"{num(r.get('x_floor'), '.2f')} | {num(r.get('x_own_floor'), '.2f')} | "
            f"{num(r.get('x_fastest_exact'), '.2f')} | "
            f"{num(r.get('logits_max_abs_diff'), '.2g')} | "
            f"{num((r.get('weight_bytes') or 0) / 1e6 or None, '.0f')} | {r.get('version', '')} |")
    for r in rows:
        if r.get("latency_ms") is None:  # unavailable here, or refused by the gate / stopped
            said = "unavailable" if r.get("available") is False else "not timed"
            lines.append(f"| {r['engine']} | {r.get('precision', '')} | — | {said}: "
                         f"{r.get('why', '')} | | | | | | | |")
    return "\n".join(lines)
