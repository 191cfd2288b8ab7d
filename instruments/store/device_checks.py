"""A device check as a run of the one results schema (kind "device_check"), and what the docs say
of the device checks committed under docs/runs/. Torch-free.

  check_run(summary)        the run a check's summary.json becomes (scripts/device_check/runner.py
                            saves it when the check ends, or is closed after a kill): meta the
                            check's facts (device, versions, git revision, command, budget, total
                            seconds), table ``stages`` one row per stage (status, budget, seconds,
                            run files, why, the error's type and message)
  checks_block(runs, root)  generated block "gpu-checks": every committed device check, newest
                            first: when, on what, which commit, stages by status, the failed
                            ones with their errors
  brief_block(runs, root)   generated block "gpu-brief" (README): one line per device check
  modes_block(runs, root)   generated block "gpu-modes": a row per mode, a column per model and
                            dtype, each cell the step run by run (first light's sweeps, then
                            each check's) at the longest context each sweep reached, and the
                            newest over its read floor (the check's floor summary: weights + K/V
                            bytes / measured bandwidth)
  kernels_block(runs, root) generated block "gpu-kernels": the newest GPU run of each stage that
                            times the GPU path itself -- the Triton products under each tile
                            (``triton_tiles``), mode 10 gathered and mode 11 dequantized
                            against both read in place (``cache_reads``), SDPA's backends
                            (``sdpa_backends``), the batch curve (``batch_curve``) -- each a
                            table with its verdict; a stage no check has run is named as
                            waiting
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from instruments.store import results
from instruments.store.readme_blocks import md_table

Run = dict[str, Any]


def check_run(summary: dict[str, Any]) -> Run:
    """``summary`` (summary.json's dict) as a run of kind "device_check"."""
    versions = summary.get("versions") or {}
    meta = {name: None for name in results.META_FIELDS}
    meta.update(model=summary.get("model"), device=summary.get("device"),
                device_name=summary.get("device_name"), git_rev=summary.get("git_rev"),
                torch_version=versions.get("torch"),
                transformers_version=versions.get("transformers"),
                python_version=versions.get("python"), platform=summary.get("platform"),
                partial=not summary.get("finished", False), note="",
                command=summary.get("command"), versions=versions,
                budget_s=summary.get("budget_s"), total_s=summary.get("total_s"),
                started_utc=summary.get("started_utc"), failed=list(summary.get("failed", [])))
    rows = []
    for rec in summary.get("stages", []):
        error = rec.get("error") or {}
        rows.append({"stage": rec["name"], "status": rec["status"],
                     "budget_s": rec.get("budget_s"), "seconds": rec.get("seconds"),
                     "runs": list(rec.get("runs", [])), "why": rec.get("why"),
                     "error_type": error.get("type"),
                     "error": (error.get("message") or "").split("\n")[0] or None})
    run = results.new_run("device_check", meta, {"stages": rows})
    if summary.get("started_utc"):
        run["created_utc"] = summary["started_utc"]  # when it ran, not when it was written
    return run


def checks_block(runs: list[Run], root: Path) -> str:
    """Every committed device check, newest first (see the module docstring)."""
    checks = sorted((r for r in runs if r["kind"] == "device_check"),
                    key=lambda r: str(r["created_utc"]), reverse=True)
    if not checks:
        return "No device check committed yet."
    out = []
    for r in checks:
        m = r["meta"]
        folder = Path(r["path"]).parent
        by: dict[str, list[dict[str, Any]]] = {}
        for s in r["tables"]["stages"]:
            by.setdefault(s["status"], []).append(s)
        counts = ", ".join(f"{len(by[s])} {s}" for s in ("ok", "partial", "failed", "skipped")
                           if by.get(s))
        versions = m.get("versions") or {}
        out.append(f"**{str(r['created_utc'])[:10]}, {m.get('device_name')}** (torch "
                   f"{versions.get('torch')}, triton {versions.get('triton')}; commit "
                   f"`{m.get('git_rev')}`; {m.get('total_s')} s of a {m.get('budget_s')} s "
                   f"budget; `{folder.relative_to(root)}/`): {counts}.")
        for s in by.get("failed", []):
            out.append(f"- failed: **{s['stage']}** — {s['error_type']}: {s['error']}")
        out.append("")
    return "\n".join(out).rstrip()


def _longest(run: Run) -> dict[tuple[str, str, str], tuple[int, float]]:
    """(model, dtype, mode) -> (context, ms) of each mode's longest measured cached step."""
    m = run["meta"]
    got: dict[tuple[str, str, str], tuple[int, float]] = {}
    for r in run["tables"].get("latency", []):
        if r.get("phase") != "decode":
            continue
        key = (str(m.get("model")), str(m.get("dtype")), r["mode"])
        if key not in got or r["context_len"] > got[key][0]:
            got[key] = (r["context_len"], r["latency_ms"])
    return got


def _where(run: Run, root: Path) -> str:
    """The check a run belongs to: its folder under docs/runs/<topic>/ ("first light" for
    first light's), a page's run counted with its check."""
    parts = Path(run["path"]).relative_to(root / "docs" / "runs").parts
    return "first light" if parts[0] == "gpu-first-light" else parts[1]


def modes_block(runs: list[Run], root: Path) -> str:
    """Each mode's cached step on a GPU, run by run (see the module docstring); "—": not
    timed there."""
    sweeps: dict[str, dict[tuple[str, str, str], tuple[int, float]]] = {}
    floors: dict[tuple[str, str, str], float] = {}
    for r in sorted(runs, key=lambda r: str(r["created_utc"])):
        if r["kind"] == "floor_summary":
            floors.update({(f.get("model") or "gpt2", f["dtype"], f["mode"]): f["ratio"]
                           for f in r["tables"].get("floor", [])})
        if r["kind"] != "latency_sweep" or not str(r["meta"].get("device")).startswith("cuda"):
            continue
        got = sweeps.setdefault(_where(r, root), {})
        for key, hit in _longest(r).items():
            if key not in got or hit[0] > got[key][0]:
                got[key] = hit
    if not sweeps:
        return "No GPU sweep committed yet."
    labels = sorted(sweeps, key=lambda s: s != "first light")
    keys = {k for got in sweeps.values() for k in got}
    columns = sorted({k[:2] for k in keys}, key=lambda c: (c[0] != "gpt2", c[1] != "float32", c))
    # A column's contexts go in its header when each sweep reached one context for every mode.
    reached = {col: [{got[k][0] for k in got if k[:2] == col} for got in sweeps.values()]
               for col in columns}
    uniform = {col: all(len(s) <= 1 for s in reached[col]) for col in columns}

    def cell(key: tuple[str, str, str]) -> str:
        steps = []
        for lab in labels:
            hit = sweeps[lab].get(key)
            steps.append("—" if hit is None else f"{hit[1]:.3f}" + (
                "" if uniform[key[:2]] else f" @{hit[0]}"))
        ratio = floors.get(key)
        return " → ".join(steps) + ("" if ratio is None else f" ({ratio:.1f}×)")

    def header(col: tuple[str, str]) -> str:
        if not uniform[col]:
            return f"{col[0]} {col[1]}"
        return f"{col[0]} {col[1]} @ " + " → ".join(
            str(next(iter(s))) if s else "—" for s in reached[col])

    modes = sorted({k[2] for k in keys})
    rows = [[f"`{m}`", *[cell((*col, m)) if (*col, m) in keys else "" for col in columns]]
            for m in modes]
    return "\n".join([f"ms a step, {' → '.join(labels)}, at the longest context each sweep "
                      "reached (in the column's head, else after @); in brackets the newest "
                      "over its read floor:", "",
                      *md_table(["mode", *[header(c) for c in columns]], rows)])


def brief_block(runs: list[Run], root: Path) -> str:
    """One line per committed device check, newest first: when, what, stages by status, the
    failed ones by name."""
    checks = sorted((r for r in runs if r["kind"] == "device_check"),
                    key=lambda r: str(r["created_utc"]), reverse=True)
    lines = []
    for r in checks:
        stages = r["tables"]["stages"]
        counts = ", ".join(f"{sum(s['status'] == st for s in stages)} {st}"
                           for st in ("ok", "partial", "failed", "skipped")
                           if any(s["status"] == st for s in stages))
        failed = [s["stage"] for s in stages if s["status"] == "failed"]
        lines.append(f"- {str(r['created_utc'])[:10]}, {r['meta'].get('device_name')}, commit "
                     f"`{r['meta'].get('git_rev')}`: {counts}"
                     + (f"; failed: {', '.join(failed)}" if failed else "")
                     + f" (`{Path(r['path']).parent.relative_to(root)}/`)")
    return "\n".join(lines) or "No device check committed yet."


KERNEL_KINDS = {"triton_tiles": "triton-tiles", "cache_reads": "cache-reads",
                "sdpa_backends": "sdpa-backends", "batch_curve": "batch-curve"}


def _tiles(run: Run) -> list[str]:
    """Each product's picked tile against the fastest tile timed beside it."""
    by: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in run["tables"].get("products", []):
        by.setdefault((r["dtype"], r["N"], r["K"]), []).append(r)
    rows, best_picked = [], 0
    for (dtype, n, k), got in by.items():
        best = min(got, key=lambda r: r["us"])
        picked = next((r for r in got if r["picked"]), None)
        best_picked += picked is best
        rows.append([dtype, f"{n}×{k}", "—" if picked is None else
                     f"{picked['tiles']}: {picked['us']:.1f} µs, {picked['read_gbps']:,.0f} GB/s",
                     f"{best['tiles']}: {best['us']:.1f} µs, {best['read_gbps']:,.0f} GB/s"])
    return [f"Our Triton products alone at batch 1 (`triton-tiles`): the pick was the fastest "
            f"tile for {best_picked} of {len(rows)}.", "",
            *md_table(["dtype", "N×K", "picked tile", "fastest tile"], rows)]


def _reads(run: Run) -> list[str]:
    points = run["tables"].get("points", [])
    wins = sum(p["speedup"] > 1 for p in points)
    worst = max((p["logits_rel_diff"] for p in points), default=0.0)
    rows = [[f"`{p['mode']}`", p["batch_size"], p["context_len"], f"{p['gather_ms']:.3f}",
             f"{p['in_place_ms']:.3f}", f"{p['speedup']:.2f}×"] for p in points]
    return [f"Modes 10 and 11 both ways (`cache-reads`): in place faster at {wins} of "
            f"{len(points)} points; logits differ by at most {worst:.1e} of the largest.", "",
            *md_table(["mode", "batch", "context", "read back (ms)", "in place (ms)",
                       "speed-up"], rows)]


def _sdpa(run: Run) -> list[str]:
    rows = [[r["backends"], f"`{r['mode']}`", f"{r['median_ms']:.3f}", f"{r['max_ms']:.3f}",
             r["steps"]] for r in run["tables"].get("steps", [])]
    return [f"bf16 decode over new lengths (`sdpa-backends`), {run['meta'].get('model')}:", "",
            *md_table(["backends", "mode", "median (ms)", "max (ms)", "steps"], rows)]


def _batch(run: Run) -> list[str]:
    curve = run["tables"].get("curve", [])
    rows = []
    for mode in dict.fromkeys(r["mode"] for r in curve):
        for t in sorted({r["context_len"] for r in curve if r["mode"] == mode}):
            pts = sorted((r for r in curve if r["mode"] == mode and r["context_len"] == t),
                         key=lambda r: r["batch_size"])
            lo, hi = pts[0], pts[-1]
            cross = next((c["batch_crossover"] for c in run["tables"].get("crossover", [])
                          if c["mode"] == mode and c["context_len"] == t), None)
            rows.append([f"`{mode}`", t, *(f"{r['batch_size']}: {r['latency_ms']:.3f}, "
                                           f"{r['tokens_per_s']:,.0f}, {r['over_floor']:.1f}×"
                                           for r in (lo, hi)),
                         "—" if cross is None else f"{cross:.1f}"])
    return [f"Step against the batch (`batch-curve`), {run['meta'].get('model')} "
            f"{run['meta'].get('dtype')}; each batch's ms a step, tokens/s, and the step over "
            "its floor:", "",
            *md_table(["mode", "context", "smallest batch", "largest batch",
                       "cache overtakes weights at batch"], rows)]


def kernels_block(runs: list[Run], root: Path) -> str:
    """The newest GPU run of each of ``KERNEL_KINDS`` (see the module docstring)."""
    newest: dict[str, Run] = {}
    for r in sorted(runs, key=lambda r: str(r["created_utc"])):
        if r["kind"] in KERNEL_KINDS and str(r["meta"].get("device")).startswith("cuda"):
            newest[r["kind"]] = r
    makers = {"triton_tiles": _tiles, "cache_reads": _reads, "sdpa_backends": _sdpa,
              "batch_curve": _batch}
    out = []
    for kind, maker in makers.items():
        run = newest.get(kind)
        if run is None:
            continue
        where = (f"{str(run['created_utc'])[:10]}, {run['meta'].get('device_name')}: "
                 f"`{Path(run['path']).relative_to(root)}`")
        lines = maker(run)
        if lines[-1].startswith("|---"):  # a table with no row: nothing was timed
            out += [f"`{KERNEL_KINDS[kind]}` ran out of time before its first point "
                    f"({where}).", ""]
            continue
        stopped = " Stopped early: what it measured is kept." if run["meta"].get("partial") else ""
        out += [*lines, "", f"({where}.{stopped})", ""]
    waiting = [f"`{stage}`" for kind, stage in KERNEL_KINDS.items() if kind not in newest]
    if waiting:
        out.append(f"Not run on a GPU yet: {', '.join(waiting)}.")
    return "\n".join(out).rstrip()
