"""The generated blocks about speed: peers, kernels, the default sweep. Torch-free.

Makers as in ``instruments.store.readme_blocks`` (``make(runs, root) -> str``):
  peers        the newest ``peers`` run per thread count: each engine's decode step as a
               multiple of the weight-read floor measured beside it, per context
  peers_summary  the same runs for the README: our fastest exact step and ``int8_weights``
               against CTranslate2 at the same precision, ms, × the floor and the ratio
  kernels      the newest ``kernels`` run (``scripts/bench_kernels.py``): every matrix-vector
               candidate per kind of matrix, ms and × a ``sum()`` of the same fp32 bytes; and
               its ``attention`` table (SDPA against our ``attend``) where it has one
  sweep_bench  ``scripts/bench_sweep.py``'s runs (subfolders): the default sweep from the
               browser against issue 25's goals (``instruments.store.sweep_bench``)
"""

from __future__ import annotations

from pathlib import Path

from instruments.store.readme_blocks import Run, machine, md_table, newest, rel, table
from instruments.store.sweep_bench import report

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
                      "faster):", "", *out, "", *notes]
                     + ([f"- not timed: {', '.join(skipped)}"] if skipped else []))


def _newest_peers(runs: list[Run], root: Path) -> dict[int, Run]:
    """The newest ``peers`` run per thread count (raises, naming the folder, when none)."""
    out: dict[int, Run] = {}
    for r in runs:
        if r.get("kind") == "peers":
            out[int((r.get("meta") or {}).get("threads") or 0)] = r
    if not out:
        newest(runs, "peers", root)
    return out


# (ours, the peer at the same precision): ours None = our fastest exact mode at that context
PAIRS = ((None, "ct2_float32"), ("int8_weights", "ct2_int8"))


def peers_summary(runs: list[Run], root: Path) -> str:
    """Per thread count and context: each pair of ``PAIRS`` as ms (× the floor) and ours ÷ the
    peer's -- issue 22's and issue 21's measuring stick, read off the newest runs."""
    lines = []
    for threads, run in sorted(_newest_peers(runs, root).items()):
        rows = [r for r in table(run, "peers", root) if r.get("latency_ms") is not None]
        for t in sorted({r["context_len"] for r in rows}):
            here = {r["engine"]: r for r in rows if r["context_len"] == t}
            exact = next((e for e, r in here.items() if r.get("x_fastest_exact") == 1.0), None)
            floor = next((r.get("floor_ms") for r in here.values() if r.get("floor_ms")), None)
            cells: list[str] = []
            for ours, peer in PAIRS:
                a, b = here.get(ours or exact or ""), here.get(peer)
                cells += [_ms_x(a), _ms_x(b), f"{a['latency_ms'] / b['latency_ms']:.2f}"
                          if a and b else "–"]
            lines.append([threads, t, "–" if floor is None else f"{floor:.1f}",
                          f"`{exact}`" if exact else "–", *cells])
    head = ["threads", "context", "read of the fp32 weights (ms)", "our fastest exact",
            "its step (× floor)", "CTranslate2 fp32", "ours ÷ CTranslate2", "`int8_weights`",
            "CTranslate2 int8", "ours ÷ CTranslate2"]
    notes = [f"- {threads} thread(s): {machine(run)}; `{rel(run['path'], root)}`"
             for threads, run in sorted(_newest_peers(runs, root).items())]
    return "\n".join(["Median decode step in ms (× the read floor measured beside it), gpt2's "
                      "shapes, one process per thread count:", "", *md_table(head, lines), "",
                      *notes])


def _ms_x(r: dict | None) -> str:
    if not r:
        return "–"
    x = r.get("x_floor")
    return f"{r['latency_ms']:.1f} ({x:.2f}×)" if x else f"{r['latency_ms']:.1f}"


def kernels(runs: list[Run], root: Path) -> str:
    """The newest kernels run: per thread count, candidate × kind of matrix."""
    run = newest(runs, "kernels", root)
    rows = table(run, "kernels", root)
    names = list(dict.fromkeys(r["candidate"] for r in rows))
    out = [f"Measured on {machine(run)}: `{rel(run['path'], root)}`. Each cell: ms for one token "
           "through all 12 layers' matrices of that kind (the output projection once), and × a "
           "`sum()` of the same fp32 matrices timed beside it.", ""]
    for threads in sorted({r["threads"] for r in rows}):
        got = {(r["candidate"], r["kind"]): r for r in rows if r["threads"] == threads}
        out += [f"{threads} thread(s):", ""]
        out += md_table(["candidate", *[f"`{k}`" for k in KINDS]], (
            [n, *[f"{got[n, k]['latency_ms']:.2f} ({got[n, k]['x_fp32_read']:.2f}×)"
                  if (n, k) in got else "–" for k in KINDS]] for n in names))
        out.append("")
    attention = (run.get("tables") or {}).get("attention") or []
    if attention:
        out += ["The attention over the cache, one new token through 12 layers (12 heads of 64), "
                "ms and × a `sum()` of the same cached K and V bytes:", ""]
        names = list(dict.fromkeys(r["candidate"] for r in attention))
        keys = sorted({(r["threads"], r["context_len"]) for r in attention})
        got = {(r["candidate"], r["threads"], r["context_len"]): r for r in attention}
        out += md_table(["candidate", *[f"{t} thread(s), {c} tokens" for t, c in keys]], (
            [n, *[f"{got[n, t, c]['latency_ms']:.2f} ({got[n, t, c]['x_kv_read']:.2f}×)"
                  if (n, t, c) in got else "–" for t, c in keys]] for n in names))
        out.append("")
    return "\n".join(out).rstrip("\n")


def sweep_bench(runs: list[Run], root: Path) -> str:
    """The default sweep from the browser, three times, against the CLI (issue 25)."""
    lines = report(runs)
    if not lines:
        folder = rel(Path(runs[0]["path"]).parent, root)
        return f"_`{folder}/` holds no browser run of `scripts/bench_sweep.py` yet._"
    first = next(r for r in runs if r.get("kind") == "latency_sweep")
    return "\n".join([f"Measured on {machine(first)}.", "", *lines])
