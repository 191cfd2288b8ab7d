"""The default-sweep benchmark's report (``scripts/bench_sweep.py``) from its runs. Torch-free.

The benchmark keeps, per browser run, a folder ``browser-N/`` holding the sweep the server saved
and a ``sweep_browser_timing`` run (the seconds from Run to the first point and to "Finished",
read off the page once a second), and the same sweep from the CLI in ``cli/`` and again in
``cli-again/`` (the noise floor of comparing two sweeps). ``report(runs)`` turns those runs
(loaded recursively, each with its ``path``) into the Markdown table: per browser run the two
times against issue 25's goals (``GOALS``), what its Sampler did with flagged samples, and its
medians of modes 1 and 3 against the first CLI run, context by context.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

Run = dict[str, Any]
GOALS = {"total_s": 90.0, "first_s": 5.0, "median_share": 0.10}  # issue 25
TIMING_KIND = "sweep_browser_timing"


def by_folder(runs: list[Run]) -> dict[str, dict[str, Run]]:
    """{folder name: {kind: newest run of that kind}} for runs loaded with their paths."""
    out: dict[str, dict[str, Run]] = {}
    for r in runs:
        out.setdefault(Path(r["path"]).parent.name, {})[str(r.get("kind"))] = r
    return out


def medians(run: Run) -> dict[tuple[str, int], float]:
    return {(r["mode"], r["context_len"]): r["latency_ms"]
            for r in (run.get("tables") or {}).get("latency", []) if r.get("latency_ms")}


def against(a: Run, b: Run, mode: str) -> str:
    """a's medians over b's for one mode: the median ratio, the range, contexts within 10%."""
    ma, mb = medians(a), medians(b)
    ratios = [ma[k] / mb[k] for k in ma if k[0] == mode and k in mb]
    if not ratios:
        return "–"
    close = sum(abs(r - 1) <= GOALS["median_share"] for r in ratios)
    return (f"{statistics.median(ratios):.3f} ({min(ratios):.2f}–{max(ratios):.2f}; "
            f"{close}/{len(ratios)} within 10%)")


def report(runs: list[Run]) -> list[str]:
    """The Markdown table of a benchmark's runs; [] when they hold no browser run."""
    folders = by_folder(runs)
    browsers = sorted(n for n, k in folders.items() if n.startswith("browser-")
                      and TIMING_KIND in k and "latency_sweep" in k)
    if not browsers:
        return []
    cli_run = folders.get("cli", {}).get("latency_sweep")
    again = folders.get("cli-again", {}).get("latency_sweep")
    lines = ["| run | first point (s) | total (s) | goal met (≤ 5 s, ≤ 90 s) | retaken / kept "
             "in line / kept disturbed | confirmed by prediction | mode 1 ÷ CLI (range; within "
             "10%) | mode 3 ÷ CLI (range; within 10%) |", "|---|---|---|---|---|---|---|---|"]
    for name in browsers:
        timing = folders[name][TIMING_KIND]["tables"]["timing"][0]
        run = folders[name]["latency_sweep"]
        q = (run.get("meta") or {}).get("retakes") or {}
        met = timing["first_s"] <= GOALS["first_s"] and timing["total_s"] <= GOALS["total_s"]
        cmp = [against(run, cli_run, m) if cli_run else "–" for m in ("uncached", "concat")]
        lines.append(f"| {name} | {timing['first_s']:.1f} | {timing['total_s']:.0f} | "
                     f"{'yes' if met else 'no'} | {q.get('retaken', '?')} / "
                     f"{q.get('flagged_consistent', '?')} / {q.get('disturbed_kept', '?')} | "
                     f"{q.get('confirmed_by_prediction', '?')} | {cmp[0]} | {cmp[1]} |")
    if cli_run and again:
        total = ((again.get("meta") or {}).get("timings") or {}).get("total_s")
        lines.append(f"| CLI again (noise floor) | – | "
                     f"{'–' if total is None else format(total, '.0f')} | – | – | – | "
                     f"{against(again, cli_run, 'uncached')} | "
                     f"{against(again, cli_run, 'concat')} |")
    return lines
