"""HTML figures of saved runs, offline, without the dashboard: ``python -m ui.plots``.

    python -m ui.plots --results-dir results [--figures-dir results/figures]

One HTML file per saved run and figure (the same pure builders the pages draw with) plus a
latency overlay of every sweep and the write-up's A40 reference. Nothing is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from instruments.store import frames, results
from ui.figures_perf import run_ceilings

# (run kind, table, file suffix, ui module, builder): pure DataFrame -> Figure functions
FIGURES = [
    ("latency_sweep", "latency", "latency", "figures", "latency_figure"),
    ("latency_sweep", "latency", "reduction", "figures_perf", "reduction_figure"),
    ("latency_sweep", "latency", "throughput", "figures_perf", "throughput_figure"),
    ("latency_sweep", "cumulative", "cumulative", "figures", "cumulative_figure"),
    ("end_to_end", "cumulative", "cumulative", "figures", "cumulative_figure"),
    ("end_to_end", "cumulative", "steps", "figures", "step_latency_figure"),
    ("memory", "kv_memory", "kv_memory", "figures_memory", "kv_memory_figure"),
    ("memory", "breakdown", "breakdown", "figures_memory", "breakdown_figure"),
    ("memory", "crossover", "crossover", "figures_memory", "crossover_figure"),
    ("memory", "masks", "masks", "figures_memory", "mask_figure"),
    ("peers", "peers", "peers", "figures_peers", "peers_figure"),
]


def _builder(module: str, name: str) -> Callable[..., Any]:
    return getattr(importlib.import_module(f"ui.{module}"), name)


def write_figures(results_dir: str | Path, figures_dir: str | Path | None = None
                  ) -> tuple[list[Path], list[tuple[str, str]]]:
    """HTML figures for every saved run (one file per run and figure) plus a latency overlay
    of all sweeps and the write-up's reference run. Nothing is measured."""
    loaded = results.load_runs(results_dir)
    out = Path(figures_dir) if figures_dir else Path(results_dir) / "figures"
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def write(fig: Any, name: str) -> None:
        if fig is not None:
            path = out / name
            fig.write_html(path, include_plotlyjs="directory")  # plotly.min.js once, offline
            written.append(path)

    for run in loaded.runs:
        short = f"{run['created_utc'][:19].replace(':', '')}_{run['run_id'][:6]}"
        for kind, table, fig_name, module, fn_name in FIGURES:
            df = frames.table_frame([run], table)
            if run["kind"] != kind or df.empty:
                continue
            if fig_name == "breakdown" and "breakdown_formula" in run["tables"]:
                formula = frames.table_frame([run], "breakdown_formula")
                df = pd.concat([df.assign(bar="measured"), formula.assign(bar="formula")],
                               ignore_index=True)
            extra = {"ceilings": run_ceilings(run)} if fn_name == "throughput_figure" else {}
            write(_builder(module, fn_name)(df, **extra), f"{kind}_{short}_{fig_name}.html")
    sweeps = [r for r in loaded.runs if r["kind"] == "latency_sweep"]
    if sweeps:
        overlay = _builder("figures", "overlay_figure")
        with contextlib.suppress(results.ResultsError):
            sweeps = sweeps + [results.reference_run()]
        write(overlay(frames.table_frame(sweeps, "latency"), log_x=True), "latency_overlay.html")
    return written, loaded.skipped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ui.plots", description=__doc__.split("\n")[0])
    ap.add_argument("--results-dir", default="results")
    ap.add_argument("--figures-dir", default=None, help="default: RESULTS_DIR/figures")
    args = ap.parse_args(argv)
    paths, skipped = write_figures(args.results_dir, args.figures_dir)
    for path, why in skipped:
        print(f"skipped {path}: {why}", file=sys.stderr)
    where = Path(args.figures_dir or Path(args.results_dir) / "figures")
    print(f"wrote {len(paths)} figures to {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
