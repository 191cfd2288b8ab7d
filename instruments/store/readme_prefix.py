"""The generated blocks of docs/prefix.md: the prefix cache's runs under docs/runs/prefix/ in,
Markdown out. Torch-free; each maker is ``make(runs, root) -> str`` (``instruments.store.readme``).

  prefix_targets   the issue's four targets, each met or missed, with the figure that says so
  prefix_ttft      TTFT against the cached prefix, beside the prediction (alone + lookup) and
                   the new tokens after the prefix in a contiguous cache
  prefix_chat      per turn: TTFT and K/V computed with and without reuse, answers identical
  prefix_workload  per budget: hit rate, TTFT p50 / p99, the most bytes held, evictions
Each names the host, the load average when the run began and ended, and its run file.
"""

from __future__ import annotations

from pathlib import Path

from instruments.store.readme_blocks import Run, md_table, ms, newest, rel, run_line, table

MIB = 2**20
TTFT_GOAL, LOOKUP_GOAL, TURN_GOAL = 1.1, 0.01, 1.5
FILLS = "`python scripts/bench_prefix.py`"


def _missing(runs: list[Run], kind: str, root: Path) -> str | None:
    """The line a block shows while its folder holds no run of ``kind`` (None: it has one)."""
    if any(r.get("kind") == kind for r in runs):
        return None
    folder = rel(Path(runs[0]["path"]).parent, root)
    return f"_No {kind} run in `{folder}/` yet: {FILLS} makes one._"


def prefix_ttft(runs: list[Run], root: Path) -> str:
    """The longest prompt's points (the others are in the run file and on the page)."""
    if (note := _missing(runs, "prefix_ttft", root)) is not None:
        return note
    run = newest(runs, "prefix_ttft", root)
    rows = table(run, "ttft", root)
    n = max(r["prompt_len"] for r in rows)
    head = ["P", "TTFT (ms)", "÷ alone+lookup", "÷ extend+lookup"]
    body = [[r["cached_tokens"], ms(r["ttft_ms"]), f"{r['over_predicted']:.2f}",
             f"{r['over_extend']:.2f}"]
            for r in rows if r["prompt_len"] == n]
    return "\n".join([f"N = {n:,}: {run_line(run, root)}", "", *md_table(head, body)])


def prefix_chat(runs: list[Run], root: Path) -> str:
    if (note := _missing(runs, "prefix_chat", root)) is not None:
        return note
    run = newest(runs, "prefix_chat", root)
    by = {(r["turn"], r["mode"]): r for r in table(run, "turns", root)}
    head = ["turn", "cached/prompt", "TTFT (ms)", "K/V computed (MiB)"]
    body = [[t, f"{a['cached_tokens']}/{a['prompt_tokens']}",
             f"{ms(a['ttft_ms'])}/{ms(b['ttft_ms'])}",
             f"{a['kv_bytes_computed'] / MIB:.2f}/{b['kv_bytes_computed'] / MIB:.2f}"]
            for t in sorted({t for t, _ in by})
            if (a := by.get((t, "reuse"))) and (b := by.get((t, "no reuse")))]
    return "\n".join([run_line(run, root), "", *md_table(head, body)])


def prefix_workload(runs: list[Run], root: Path) -> str:
    if (note := _missing(runs, "prefix_workload", root)) is not None:
        return note
    run = newest(runs, "prefix_workload", root)
    m = run["meta"]
    head = ["budget (MiB)", "hit rate", "TTFT p50/p99 (ms)", "held (MiB)", "evictions"]
    body = [[r["label"].replace(" MiB", ""), f"{r['hit_rate']:.0%}",
             f"{ms(r['ttft_p50_ms'])}/{ms(r['ttft_p99_ms'])}",
             f"{r['bytes_held_max'] / MIB:.1f}", r["evictions"]]
            for r in table(run, "budgets", root)]
    mix = (f"{m.get('requests')} requests, {m.get('rate_per_s')}/s; {m.get('systems')}×"
           f"{m.get('system_tokens')}-token system prompts, {m.get('documents')}×"
           f"{m.get('document_tokens')}-token documents.")
    return "\n".join([f"{run_line(run, root)} {mix}", "", *md_table(head, body)])


def prefix_targets(runs: list[Run], root: Path) -> str:
    """The four targets from the newest run of each kind (a kind not run yet says so)."""
    lines = []
    kinds = {r.get("kind") for r in runs}
    if "prefix_ttft" in kinds:
        run = newest(runs, "prefix_ttft", root)
        rows = table(run, "ttft", root)
        hit = [r for r in rows if r["cached_tokens"] > 0]
        for key, what in (("over_predicted", "new tokens alone"),
                          ("over_extend", "extend")):
            miss = [r for r in hit if r[key] > TTFT_GOAL]
            lines.append(f"- TTFT ≤ {TTFT_GOAL}× ({what}, + lookup): met at "
                         f"{len(hit) - len(miss)} of {len(hit)} cached points" + (
                             "." if not miss else "; missed at " + ", ".join(
                                 f"P {r['cached_tokens']} of {r['prompt_len']} ({r[key]:.2f}×)"
                                 for r in miss[:3]) + ("…" if len(miss) > 3 else "") + "."))
        big = [r for r in rows if r["tree_tokens"] >= 8192]
        worst = max(big, key=lambda r: r["lookup_share"]) if big else None
        lines.append(f"- Lookup ≤ {LOOKUP_GOAL:.0%} of TTFT, ≥ 8,192 tokens in the tree: "
                     + ("not measured (fewer held)." if worst is None else
                        f"at most {worst['lookup_share']:.3%}, "
                        + ("met." if worst["lookup_share"] <= LOOKUP_GOAL else "missed.")))
        drift = max(r["max_abs_logit_diff"] for r in rows)
        ok = all(r["exact"] for r in rows)
        lines.append(f"- Logits within fp32's tolerance of a full prefill: largest |Δ| "
                     f"{drift:.1e}, {'met' if ok else '**missed**'}.")
    if "prefix_chat" in kinds:
        run = newest(runs, "prefix_chat", root)
        ratio = (run["meta"].get("ttft_turn_ratio") or {})
        rows = table(run, "turns", root)
        last = max(r["turn"] for r in rows)
        mine, plain = ratio.get("reuse"), ratio.get("no reuse")
        if mine is not None and plain is not None:
            lines.append(f"- Chat, turn {last} ≤ {TURN_GOAL}× turn 1's TTFT: {mine:.2f}× with "
                         f"reuse ({'met' if mine <= TURN_GOAL else 'missed'}), {plain:.2f}× "
                         "without; "
                         "answers " + ("identical." if all(r["identical"] for r in rows)
                                       else "**not identical**."))
    return "\n".join(lines) or f"_No target measured yet: {FILLS} makes the runs._"
