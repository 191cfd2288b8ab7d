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
  modes_block(runs, root)   generated block "gpu-modes": each mode's cached step on a GPU run by
                            run (first light's sweeps, then each check's), at the longest
                            context each sweep reached, and the newest over its read floor (the
                            check's floor summary: weights + K/V bytes / measured bandwidth)
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
    keys = sorted({k for got in sweeps.values() for k in got},
                  key=lambda k: (k[0] != "gpt2", k[1] != "float32", k[2]))
    rows = []
    for key in keys:
        cells = [("—" if key not in sweeps[lab] else
                  f"{sweeps[lab][key][1]:.3f} ({sweeps[lab][key][0]})") for lab in labels]
        ratio = floors.get(key)
        rows.append([f"{key[0]} {key[1]}", f"`{key[2]}`", *cells,
                     "—" if ratio is None else f"{ratio:.1f}×"])
    head = ["model dtype", "mode", *[f"{lab}: ms (context)" for lab in labels],
            "newest ÷ read floor"]
    return "\n".join(md_table(head, rows))


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
