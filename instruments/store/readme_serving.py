"""The generated blocks of docs/serving.md: the serving runs under docs/runs/serving/ in,
Markdown out. Torch-free; each maker is ``make(runs, root) -> str`` (``instruments.store.readme``).

  serving_targets      the issue's CPU targets, each met or missed, with the numbers that say so
  serving_step         the batched decode step at each batch, our three ways and llama.cpp's,
                       against its floor (kind "serving_step", ``scripts/bench_serving.py``)
  serving_concurrency  the closed loop: tokens/s, TTFT, TPOT, ITL per concurrency, and the peers
  serving_load         the open loop: each way at each rate, and the highest rate it held the SLO
  serving_budget       the model's dtype and int8 K/V at budgets from one request to all, and the
                       tightest budget's requests served again alone
  serving_schedule     FCFS against longest prefix match on the prefix workload
Each names the run file, its host, threads and the load average around it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from instruments.store.readme_blocks import Run, md_table, ms, rel, run_line, table

FILLS = "`python scripts/bench_serving.py`"
FLOOR_GOAL, SPEEDUP_GOAL, HF_GOAL, SCHEDULE_GOAL = 1.3, 6.0, 4.0, 0.05


def _newest(runs: list[Run], kind: str, experiment: str | None = None) -> Run | None:
    """The newest run of ``kind`` (and, for "serving", of that experiment), or None."""
    found = [r for r in runs if r.get("kind") == kind and (
        experiment is None or (r.get("meta") or {}).get("serving_experiment") == experiment)]
    return found[-1] if found else None


def _missing(runs: list[Run], what: str, root: Path) -> str:
    folder = rel(Path(runs[0]["path"]).parent, root) if runs else "docs/runs/serving"
    return f"_No {what} run in `{folder}/` yet: {FILLS} makes one on a quiet host._"


def _by(rows: list[dict[str, Any]], key: str) -> dict[Any, dict[str, Any]]:
    return {r[key]: r for r in rows}


def serving_step(runs: list[Run], root: Path) -> str:
    run = _newest(runs, "serving_step")
    if run is None:
        return _missing(runs, "serving_step", root)
    rows = table(run, "steps", root)
    ways = [w for w in ("fast", "forward", "gather", "llama.cpp") if any(
        r["way"] == w for r in rows)]
    cell = {(r["way"], r["batch"]): r for r in rows}
    head = ["batch", *(f"{w} ms (× floor)" for w in ways), "floor ms (weights + K/V)"]
    body = []
    for b in sorted({r["batch"] for r in rows}):
        any_row = next(cell[(w, b)] for w in ways if (w, b) in cell)
        body.append([b, *(f"{ms(cell[(w, b)]['step_ms'])} ({cell[(w, b)]['over_floor']:.2f})"
                          if (w, b) in cell else "—" for w in ways),
                     f"{ms(any_row['floor_ms'])} ({ms(any_row['weights_read_ms'])} + "
                     f"{ms(any_row['kv_read_ms'])})"])
    ctx = rows[0]["context"]
    return "\n".join([f"Each sequence at {ctx} tokens; {run_line(run, root)}", "",
                      *md_table(head, body)])


def _targets_step(run: Run, root: Path) -> list[list[str]]:
    rows = table(run, "steps", root)
    ours = [r for r in rows if r["way"] != "llama.cpp"]
    best = {}
    for r in ours:
        if r["batch"] not in best or r["step_ms"] < best[r["batch"]]["step_ms"]:
            best[r["batch"]] = r
    within = [b for b, r in best.items() if r["over_floor"] <= FLOOR_GOAL]
    worst = max(best.values(), key=lambda r: r["over_floor"])
    out = [[f"batched step ≤ {FLOOR_GOAL}× its floor, batch 1–64",
            f"{len(within)} of {len(best)} batches (worst: batch {worst['batch']}, "
            f"{worst['over_floor']:.2f}×, {worst['way']})",
            "met" if len(within) == len(best) else "missed"]]
    llama = {r["batch"]: r for r in rows if r["way"] == "llama.cpp"}
    if llama:
        beat = [b for b in best if b in llama and best[b]["step_ms"] <= llama[b]["step_ms"]]
        ratios = [best[b]["step_ms"] / llama[b]["step_ms"] for b in best if b in llama]
        out.append(["≤ llama.cpp's batched step (F32, same batch)",
                    f"{len(beat)} of {len(llama)} batches (ours ÷ llama.cpp "
                    f"{min(ratios):.2f}–{max(ratios):.2f}×)",
                    "met" if len(beat) == len(llama) else "missed"])
    at32 = [r for r in ours if r["batch"] == 32 and r["schedule_ms"] is not None]
    if at32:
        r = min(at32, key=lambda r: r["step_ms"])
        share = r["schedule_ms"] / r["step_ms"]
        out.append([f"scheduler ≤ {SCHEDULE_GOAL:.0%} of the step at batch 32",
                    f"{r['schedule_ms']:.3f} of {r['step_ms']:.1f} ms ({share:.1%}, {r['way']})",
                    "met" if share <= SCHEDULE_GOAL else "missed"])
    return out


def serving_targets(runs: list[Run], root: Path) -> str:
    rows: list[list[str]] = []
    step = _newest(runs, "serving_step")
    if step is not None:
        rows += _targets_step(step, root)
    conc = _newest(runs, "serving", "concurrency")
    if conc is not None:
        pts = _by(table(conc, "points", root), "concurrency")
        if 1 in pts and 16 in pts:
            x = pts[16]["output_tok_s"] / pts[1]["output_tok_s"]
            rows.append([f"concurrency 16 ≥ {SPEEDUP_GOAL:g}× concurrency 1's tokens/s",
                         f"{x:.1f}× ({pts[16]['output_tok_s']:.0f} against "
                         f"{pts[1]['output_tok_s']:.0f} tok/s)",
                         "met" if x >= SPEEDUP_GOAL else "missed"])
        hf = [p for p in (conc.get("tables") or {}).get("peers", [])
              if p.get("ok") and "transformers" in p["peer"] and p["concurrency"] == 16]
        if hf and 16 in pts:
            x = pts[16]["output_tok_s"] / hf[0]["output_tok_s"]
            rows.append([f"≥ {HF_GOAL:g}× transformers' continuous batching at 16",
                         f"{x:.1f}× ({hf[0]['output_tok_s']:.1f} tok/s, tokens "
                         f"{'equal' if hf[0]['tokens_equal'] else 'DIFFER'})",
                         "met" if x >= HF_GOAL else "missed"])
    load = _newest(runs, "serving", "load")
    if load is not None:
        rows.append(_continuous_vs_static(table(load, "points", root)))
    budget = _newest(runs, "serving", "budget")
    for r in ((budget or {}).get("tables") or {}).get("recheck", []):
        rows.append([f"exact: served alone = served together ({r['label']})",
                     f"{r['tokens_differing']} of {r['tokens']} tokens differ over "
                     f"{r['requests']} requests ({r['preemptions']} preemptions)",
                     "met" if r["tokens_differing"] == 0 and r["requests"] >= 32 else "missed"])
    if not rows:
        return _missing(runs, "serving", root)
    return "\n".join(md_table(["target", "measured", "verdict"], rows))


def _continuous_vs_static(pts: list[dict[str, Any]]) -> list[str]:
    """At each rate: continuous batching's TTFT p99 (p50 where too few requests for a p99)
    lower than static batching's, and its tokens/s at least static's."""
    cont = {p["rate_per_s"]: p for p in pts if p["way"] == "continuous"}
    stat = {p["rate_per_s"]: p for p in pts if p["way"] == "static"}
    rates = sorted(set(cont) & set(stat))
    q = "p99" if all(cont[r]["ttft_p99_ms"] is not None for r in rates) else "p50"
    wins = [r for r in rates if (cont[r][f"ttft_{q}_ms"] or 0) < (stat[r][f"ttft_{q}_ms"] or 0)
            and cont[r]["output_tok_s"] >= stat[r]["output_tok_s"] * 0.999]
    return ["continuous: lower TTFT and ≥ tokens/s than static batches",
            f"{len(wins)} of {len(rates)} rates (TTFT {q})",
            "met" if rates and len(wins) == len(rates) else "missed"]


def serving_concurrency(runs: list[Run], root: Path) -> str:
    run = _newest(runs, "serving", "concurrency")
    if run is None:
        return _missing(runs, "serving (concurrency)", root)
    head = ["clients", "output tok/s", "TTFT p50 / p99 (ms)", "TPOT p50 / p99 (ms)",
            "ITL p99 (ms)", "mean batch", "time in prompt steps"]
    steps: dict[str, list[float]] = {}  # label -> [all steps' ms, those carrying prompt tokens']
    for s in table(run, "steps", root):
        t = steps.setdefault(s["label"], [0.0, 0.0])
        t[0] += s["step_ms"]
        t[1] += s["step_ms"] if s["prefill_tokens"] else 0.0
    share = {k: f"{v[1] / v[0]:.0%}" if v[0] else "—" for k, v in steps.items()}
    body = [[p["concurrency"], f"{p['output_tok_s']:,.1f}",
             f"{ms(p['ttft_p50_ms'])} / {ms(p['ttft_p99_ms'])}",
             f"{ms(p['tpot_p50_ms'])} / {ms(p['tpot_p99_ms'])}", ms(p["itl_p99_ms"]),
             f"{p['batch_mean']:.1f}", share.get(f"C={p['concurrency']}", "—")]
            for p in table(run, "points", root)]
    lines = [run_line(run, root), "", *md_table(head, body)]
    peers = (run.get("tables") or {}).get("peers", [])
    if peers:
        ours = _by(table(run, "points", root), "concurrency")
        prow = [[p["peer"], p["concurrency"] or "—",
                 f"{p['output_tok_s']:,.1f}" if p.get("ok") else f"unavailable: {p['why']}",
                 ("equal" if p["tokens_equal"] else f"{p['tokens_differing']} differ")
                 if p.get("ok") else "—",
                 f"{ours[p['concurrency']]['output_tok_s'] / p['output_tok_s']:.2f}×"
                 if p.get("ok") and p["concurrency"] in ours else "—"] for p in peers]
        lines += ["", *md_table(["peer", "clients", "output tok/s", "tokens", "ours ÷ peer"],
                                prow)]
    kv = (run.get("meta") or {}).get("kv_overtakes_batch")
    lines += ["", f"The K/V rows the decode steps read overtook the weights' read at batch "
              f"{kv}." if kv else "The K/V rows never outweighed the weights' read here."]
    return "\n".join(lines)


def serving_load(runs: list[Run], root: Path) -> str:
    """A row per rate, the three ways side by side: tokens/s, TTFT p50 / p99, SLO met."""
    run = _newest(runs, "serving", "load")
    if run is None:
        return _missing(runs, "serving (load)", root)
    m = run.get("meta") or {}
    pts = table(run, "points", root)
    ways = [w for w in ("single", "static", "continuous") if any(p["way"] == w for p in pts)]
    cell = {(p["way"], p["rate_per_s"]): p for p in pts}
    body = [[f"{r:g}", *(f"{cell[(w, r)]['output_tok_s']:,.1f}; {ms(cell[(w, r)]['ttft_p50_ms'])}"
                         f" / {ms(cell[(w, r)]['ttft_p99_ms'])}; "
                         f"{(cell[(w, r)]['slo_met'] or 0):.0%}" if (w, r) in cell else "—"
                         for w in ways)]
            for r in sorted({p["rate_per_s"] for p in pts})]
    held = m.get("slo_max_rate") or {}
    said = "; ".join(f"{w}: {f'{r:g}/s' if r else 'none'}" for w, r in held.items())
    return "\n".join([f"Each cell: output tok/s; TTFT p50 / p99 (ms); share meeting the SLO "
                      f"(TTFT ≤ {m.get('slo_ttft_ms'):g} ms, TPOT ≤ {m.get('slo_tpot_ms'):g} "
                      f"ms). {run_line(run, root)}", "",
                      *md_table(["rate (/s)", *ways], body), "",
                      f"Highest rate where ≥ {m.get('slo_share', 0.9):.0%} met the SLO: "
                      f"{said}."])


def serving_budget(runs: list[Run], root: Path) -> str:
    """A row per budget, the model's dtype and int8 side by side: tokens held, the most
    running, preemptions, tokens/s."""
    run = _newest(runs, "serving", "budget")
    if run is None:
        return _missing(runs, "serving (budget)", root)
    pts = table(run, "points", root)
    kinds = list(dict.fromkeys(p["kv_dtype"] for p in pts))
    cell = {(p["kv_dtype"], p["budget_tokens"]): p for p in pts}
    body = [[ms(next(p for p in pts if p["budget_tokens"] == b)["budget_bytes"] / 2**20),
             *(f"{cell[(k, b)]['pool_tokens']:,}; {cell[(k, b)]['batch_max']}; "
               f"{cell[(k, b)]['preemptions']}; {cell[(k, b)]['output_tok_s']:,.1f}"
               if (k, b) in cell else "—" for k in kinds)]
            for b in sorted({p["budget_tokens"] for p in pts})]
    lines = [f"Each cell: tokens it holds; most running; preemptions; output tok/s. "
             f"{run_line(run, root)}", "", *md_table(["budget (MiB)", *kinds], body)]
    for r in (run.get("tables") or {}).get("recheck", []):
        lines += ["", f"Served again alone ({r['label']}): {r['requests']} requests, "
                  f"{r['tokens_differing']} of {r['tokens']} tokens differ."]
    return "\n".join(lines)


def serving_schedule(runs: list[Run], root: Path) -> str:
    run = _newest(runs, "serving", "schedule")
    if run is None:
        return _missing(runs, "serving (schedule)", root)
    m = run.get("meta") or {}
    head = ["policy", "hit rate", "TTFT p50 / p99 (ms)", "output tok/s", "evictions"]
    body = [[p["policy"], f"{p['hit_rate']:.0%}",
             f"{ms(p['ttft_p50_ms'])} / {ms(p['ttft_p99_ms'])}", f"{p['output_tok_s']:,.1f}",
             p["evictions"]] for p in table(run, "points", root)]
    return "\n".join([f"Budget {m.get('budget_tokens'):,} tokens against a working set of "
                      f"{m.get('working_set_tokens'):,}; {run_line(run, root)}", "",
                      *md_table(head, body)])
