"""The generated blocks about speed: peers, kernels, the default sweep. Torch-free.

Makers as in ``instruments.store.readme_blocks`` (``make(runs, root) -> str``):
  peers        the newest ``peers`` run per thread count: each engine's decode step as a
               multiple of the weight-read floor measured beside it, per context
  kernels      the newest ``kernels`` run (``scripts/bench_kernels.py``): every matrix-vector
               candidate per kind of matrix, ms and × a ``sum()`` of the same fp32 bytes; and
               its ``attention`` table (SDPA against our ``attend``) where it has one
  sweep_bench  ``scripts/bench_sweep.py``'s runs (subfolders): the default sweep from the
               browser against issue 25's goals (``instruments.store.sweep_bench``)
  first_run    the same runs of several hosts, one line per host: how long a new user's first
               sweep took from the browser; and, from ``--first`` runs, per host and read
               interval, a fresh server's first page and first point (``first_summary``)
  speculation  ``scripts/bench_speculate.py``'s runs: per model and prompt, the acceptance and
               the measured speedup per draft length, and how often the prediction was within
               15% of it
"""

from __future__ import annotations

from pathlib import Path

from instruments.store.readme_blocks import (
    Run,
    days,
    host,
    machine,
    md_table,
    newest,
    rel,
    table,
)
from instruments.store.sweep_bench import (
    FIRST_GOALS,
    FIRST_KIND,
    TIMING_KIND,
    by_folder,
    first_met,
    first_rows,
    first_summary,
    goals_text,
    report,
    started_with,
)

KINDS = ("c_attn", "attn.c_proj", "c_fc", "mlp.c_proj", "lm_head")


def peers(runs: list[Run], root: Path) -> str:
    """× the read floor per engine, one line per thread count and context."""
    newest_by_threads = _newest_peers(runs, root)
    engines: list[str] = []
    lines_rows = []
    for threads in sorted(newest_by_threads):
        run = newest_by_threads[threads]
        rows = [r for r in table(run, "peers", root) if r.get("latency_ms") is not None]
        for r in rows:
            if r["engine"] not in engines:
                engines.append(r["engine"])
        for t in sorted({r["context_len"] for r in rows}):
            here = {r["engine"]: r for r in rows if r["context_len"] == t}
            floor = next((r.get("floor_ms") for r in here.values() if r.get("floor_ms")), None)
            lines_rows.append((threads, t, floor, here))
    out = md_table(["threads", "context", "read of the fp32 weights (ms)", *[f"`{e}`"
                                                                            for e in engines]],
                   ([threads, t, "–" if floor is None else f"{floor:.1f}",
                     *[f"{here[e]['x_floor']:.2f}×" if e in here and here[e].get("x_floor")
                       else "–" for e in engines]]
                    for threads, t, floor, here in lines_rows))
    notes = [f"- {threads} thread(s): {machine(run)}; `{rel(run['path'], root)}`"
             for threads, run in sorted(newest_by_threads.items())]
    skipped = sorted({f"`{r['engine']}` ({r.get('why', '')})" for run in newest_by_threads.values()
                      for r in table(run, "peers", root) if r.get("latency_ms") is None})
    return "\n".join(["Median step as a multiple of the read floor measured beside it (lower is "
                      "faster):", "", *out, "", *notes, *_gate(newest_by_threads, root)]
                     + ([f"- not timed: {', '.join(skipped)}"] if skipped else []))


def _gate(by_threads: dict[int, Run], root: Path) -> list[str]:
    """The gate's verdict per engine in the run of the fewest threads: the largest logit error
    against mode 1, and what its tolerance allowed."""
    run = by_threads[min(by_threads)]
    seen: dict[str, str] = {}
    for r in table(run, "peers", root):
        if r.get("logits_max_abs_diff") is not None and r["engine"] not in seen:
            seen[r["engine"]] = (f"`{r['engine']}` {r['logits_max_abs_diff']:.2g} "
                                 f"({r.get('logits_tolerance') or 0:.2g})")
    return [f"- the gate, largest logit error against mode 1 (allowed): {', '.join(seen.values())}"
            ] if seen else []


def _newest_peers(runs: list[Run], root: Path) -> dict[int, Run]:
    """The newest ``peers`` run per thread count (raises, naming the folder, when none)."""
    out: dict[int, Run] = {}
    for r in runs:
        if r.get("kind") == "peers":
            out[int((r.get("meta") or {}).get("threads") or 0)] = r
    if not out:
        newest(runs, "peers", root)
    return out


def kernels(runs: list[Run], root: Path) -> str:
    """The newest kernels run: per thread count, candidate × kind of matrix."""
    run = newest(runs, "kernels", root)
    rows = table(run, "kernels", root)
    names = list(dict.fromkeys(r["candidate"] for r in rows))
    out = [f"Measured on {machine(run)}: `{rel(run['path'], root)}`. One token through all 12 "
           "layers' matrices of each kind (the output projection once): the `sum()` of the same "
           "fp32 matrices in ms, every other candidate as a multiple of it, timed beside it.", ""]
    for threads in sorted({r["threads"] for r in rows}):
        got = {(r["candidate"], r["kind"]): r for r in rows if r["threads"] == threads}
        out += [f"{threads} thread(s):", ""]
        out += md_table(["candidate", *[f"`{k}`" for k in KINDS]], (
            [n, *[_cell(got.get((n, k)), "x_fp32_read") for k in KINDS]] for n in names))
        out.append("")
    attention = (run.get("tables") or {}).get("attention") or []
    if attention:
        out += ["The attention over the cache, one new token through 12 layers (12 heads of 64): "
                "the `sum()` of the same cached K and V bytes in ms, the others × it:", ""]
        names = list(dict.fromkeys(r["candidate"] for r in attention))
        keys = sorted({(r["threads"], r["context_len"]) for r in attention})
        got = {(r["candidate"], r["threads"], r["context_len"]): r for r in attention}
        out += md_table(["candidate", *[f"{t} thread(s), {c} tokens" for t, c in keys]], (
            [n, *[_cell(got.get((n, t, c)), "x_kv_read") for t, c in keys]] for n in names))
        out.append("")
    return "\n".join(out).rstrip("\n")


def _cell(r: dict | None, ratio: str) -> str:
    """A read in ms, anything else as a multiple of the read beside it."""
    if r is None:
        return "–"
    return f"{r['latency_ms']:.2f} ms" if r["candidate"].startswith("read") else \
        f"{r[ratio]:.2f}×"


def sweep_bench(runs: list[Run], root: Path) -> str:
    """The default sweep from the browser, three times, against the CLI (issue 25)."""
    lines = report(runs)
    if not lines:
        folder = rel(Path(runs[0]["path"]).parent, root)
        return f"_`{folder}/` holds no browser run of `scripts/bench_sweep.py` yet._"
    first = next(r for r in runs if r.get("kind") == "latency_sweep")
    return "\n".join([f"Measured on {machine(first)}.", "", *lines])


def _top(run: Run, root: Path) -> str:
    """The folder under docs/runs/ a run was loaded from."""
    return Path(rel(run["path"], root)).parts[2]


def _history_values(run: Run, root: Path) -> tuple[dict[int, list[float | None]], set[str]]:
    """Per context of one peers run: [read floor ms, fastest exact ÷ CTranslate2 fp32, its ×
    the floor, int8_weights ÷ CTranslate2 int8] (None where a row is missing); the exact modes
    that were fastest."""
    got = [r for r in table(run, "peers", root) if r.get("latency_ms") is not None]
    at = {(r["engine"], r["context_len"]): r for r in got}
    out, fastest = {}, set()
    for t in sorted({r["context_len"] for r in got}):
        exact = next((e for (e, c), r in at.items() if c == t
                      and r.get("x_fastest_exact") == 1.0), "")
        fastest |= {exact} - {""}
        floor = next((r["floor_ms"] for (_, c), r in at.items() if c == t and r.get("floor_ms")),
                     None)
        ours, ct2, q, cq = (at.get((exact, t)), at.get(("ct2_float32", t)),
                            at.get(("int8_weights", t)), at.get(("ct2_int8", t)))
        out[t] = [floor, ours["latency_ms"] / ct2["latency_ms"] if ours and ct2 else None,
                  ours.get("x_floor") if ours else None,
                  q["latency_ms"] / cq["latency_ms"] if q and cq else None]
    return out, fastest


def first_run(runs: list[Run], root: Path) -> str:
    """Per host: the default sweep from the browser, seconds to its first point and to the end;
    then, where ``--first`` runs are committed, per host and read interval: a fresh server's
    first page and the first point, from a settled page and from the first paint."""
    folders: dict[str, list[Run]] = {}
    for r in runs:
        folders.setdefault(_top(r, root), []).append(r)
    rows, firsts, timed_all = [], [], []
    for folder, got in folders.items():
        timed = [r for r in got if r.get("kind") == FIRST_KIND]
        timed_all += timed
        # a host's runs apart from another's, and those of each way of starting the app
        for where, how in sorted({(host(r), started_with(r)) for r in timed}):
            mine = [r for r in timed if (host(r), started_with(r)) == (where, how)]
            firsts += [[where, days([str(r["created_utc"]) for r in mine]), *row,
                        f"`{folder}/`"] for row in first_summary(mine)]
        per = by_folder(got)
        timings = [k[TIMING_KIND]["tables"]["timing"][0] for n, k in sorted(per.items())
                   if n.startswith("browser-") and TIMING_KIND in k]
        sweep = next((r for r in got if r.get("kind") == "latency_sweep"), None)
        if not timings or sweep is None:
            continue
        first = [t["first_s"] for t in timings]
        total = [t["total_s"] for t in timings]
        rows.append([host(sweep), str(sweep["created_utc"])[:10], len(timings),
                     f"{min(first):.1f}–{max(first):.1f}", f"{min(total):.0f}–{max(total):.0f}",
                     f"`{folder}/`"])
    if not rows and not firsts:
        return "_No browser run of `scripts/bench_sweep.py` is committed yet._"
    rows.sort(key=lambda r: r[1])
    out = md_table(["host (device, platform)", "date", "runs", "first point (s)",
                    "whole sweep (s)", "runs in docs/runs/"], rows) if rows else []
    if firsts:
        out += [*([""] if out else []),
                "The first minutes on a fresh server (`scripts/bench_sweep.py --first`): the "
                "Overview's first page, seconds from the server's start to its title and to the "
                "page settled, beside a bare Streamlit app's title timed on the same host in the "
                "same run (no code of ours: the floor); the default sweep's first point, Run "
                "pressed on a settled page and Run pressed the moment it appears (from the "
                f"page's first paint, shown, not judged). Goals: {goals_text()}. Met in the "
                f"committed runs: {_first_verdict(timed_all)}:", "",
                *md_table(["host (device, platform)", "date", "app started with",
                           "page read every", "runs",
                           "bare Streamlit title (s)", "first page: title / settled (s)",
                           "title over the bare app's (s)",
                           "first point, settled page (s)",
                           "first point from first paint (s)",
                           f"first page ≤ bare + {FIRST_GOALS['page_over_bare_s']:g} s",
                           f"first point ≤ {FIRST_GOALS['settled_point_s']:g} s",
                           "runs in docs/runs/"], sorted(firsts, key=lambda r: (r[1], r[2], r[3])))]
    return "\n".join(out)


def _first_verdict(runs: list[Run]) -> str:
    """How many committed ``--first`` runs met each goal, the first page's of those that timed
    a bare app beside them."""
    met = [first_met(t) for t in first_rows(runs)]
    page = [m[0] for m in met if m[0] is not None]
    return (f"the first page in {sum(page)} of {len(page)} runs"
            + (f" (and {len(met) - len(page)} timed no bare app)" if len(met) > len(page) else "")
            + f", the first point in {sum(m[1] for m in met)} of {len(met)}")


GOAL = 0.15  # scripts/bench_speculate.py's: the prediction within 15% of the measured speedup


def _model(meta: dict) -> str:
    weights = str(meta.get("weights") or "")
    if weights.startswith("local checkpoint (") and weights.endswith(")"):
        return f"`{weights[len('local checkpoint ('):-1]}` (trained fixture)"
    return f"{meta.get('model')}, {weights.split(', ')[0]} weights"  # where from: in the run


def speculation(runs: list[Run], root: Path) -> str:
    """Per model and prompt, its newest speculate run: acceptance and measured speedup per k,
    how many predictions came within ``GOAL``, whether every output equalled greedy decoding
    (older repeats are counted, not shown)."""
    every = [r for r in runs if r.get("kind") == "speculate"] or [
        newest(runs, "speculate", root)]
    last: dict[tuple[str, str], Run] = {}
    for run in sorted(every, key=lambda r: str(r.get("created_utc"))):
        m = run.get("meta") or {}
        last[(_model(m), str(m.get("bench_prompt")))] = run
    found = sorted(last.values(), key=lambda r: str(r.get("created_utc")))
    rows = []
    for run in found:
        m, sp = run.get("meta") or {}, table(run, "speculative", root)
        within = sum(1 for r in sp if r.get("speedup_predicted_drafts") is not None and
                     abs(r["speedup_predicted_drafts"] / r["speedup_measured"] - 1) <= GOAL)
        rows.append([f"`{Path(run['path']).name}`", _model(m), m.get("bench_prompt") or "–",
                     m.get("distinct_tokens", "–"),
                     "/".join(f"{r['acceptance'] * 100:.0f}" for r in sp) + "%",
                     "/".join(f"{r['speedup_measured']:.2f}" for r in sp) + "×",
                     f"{within} of {len(sp)}",
                     "yes" if all(r.get("identical") for r in sp) else "**no**"])
    ks = "/".join(str(r["k"]) for r in table(found[-1], "speculative", root))
    m = found[-1].get("meta") or {}
    threads = m.get("threads")
    head = ["run", "model", "prompt", "distinct tokens generated", "acceptance per k",
            "measured speedup per k", f"prediction within {GOAL:.0%}", "output = greedy"]
    one = len({r[1] for r in rows}) == 1  # one model: named once, above the table
    if one:
        head.pop(1)
        rows = [r[:1] + r[2:] for r in rows]
    return "\n".join([f"{_model(m) + '; ' if one else ''}"
                      f"Draft lengths k = {ks}; mode `{m.get('mode')}`, {m.get('new_tokens')} "
                      f"new tokens per prompt; on {host(found[-1])}, {threads} thread"
                      f"{'' if threads == 1 else 's'}, torch {m.get('torch_version')}, "
                      f"{str(found[-1].get('created_utc'))[:10]}. Speedup: the whole generation "
                      "against plain greedy decoding with the same mode."
                      + (f" The newest run of each; {len(every) - len(found)} older repeats "
                         "are in the folder." if len(every) > len(found) else ""),
                      "", *md_table(head, rows)])
