"""What each generated block of the README and docs/ says: run dicts in, Markdown out. Torch-free.

Each maker is ``make(runs, root) -> str``: ``runs`` are the run files of its folder under
docs/runs/ (loaded by ``instruments.store.readme``, never empty, newest last), ``root`` the
checkout they came from. A maker states only what its runs hold, with the machine, versions and
file each figure came from; a run it needs but cannot find raises ``ReadmeError`` naming it.
Figures are rounded here once, so a block reads the same on every machine that makes it.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from instruments.store.results import REFERENCE_PATH, REPO_ROOT, ResultsError, load_run
from instruments.store.tables import summary_table

Run = dict[str, Any]
MIB = 2**20


class ReadmeError(Exception):
    """A block cannot be made: one line that names the file or folder and says why."""


# ------------------------------------------------------------------------------------ helpers
def rel(path: str | Path, root: Path) -> str:
    """``path`` as the checkout names it (docs/runs/...), for messages and provenance lines."""
    try:
        return Path(path).resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def newest(runs: list[Run], kind: str, root: Path) -> Run:
    found = [r for r in runs if r.get("kind") == kind]
    if not found:
        folder = rel(Path(runs[0]["path"]).parent, root)
        raise ReadmeError(f"{folder}/ holds no {kind} run (its block needs one)")
    return found[-1]


def table(run: Run, name: str, root: Path) -> list[dict[str, Any]]:
    rows = (run.get("tables") or {}).get(name)
    if not rows:
        raise ReadmeError(f"{rel(run['path'], root)}: table {name!r} is missing or empty")
    return rows


def machine(run: Run) -> str:
    """What a run measured on: machine, threads, model, weights, dtype, torch, date."""
    m = run.get("meta") or {}
    threads = m.get("threads")
    on = f"{m.get('device_name') or m.get('device')} ({m.get('device')}" + (
        f", {threads} torch thread{'s' if threads != 1 else ''})" if threads else ")")
    return (f"{on}, {m.get('model')} with {m.get('weights')} weights, {m.get('dtype')}, "
            f"torch {m.get('torch_version')}, {str(run.get('created_utc'))[:10]}"
            + (" (partial)" if m.get("partial") else ""))


def host(run: Run) -> str:
    """The host a run names: its device's name and its platform up to the architecture (two
    VMs with the same CPU model differ there)."""
    m = run.get("meta") or {}
    plat = re.sub(r"-(x86_64|aarch64|arm64|AMD64).*$", "", str(m.get("platform") or "?"))
    name = re.sub(r"\((R|TM)\)| Processor$", "", str(m.get("device_name") or m.get("device")))
    return f"{name} ({plat})"


def source(run: Run, root: Path) -> str:
    """Where a figure came from: ``machine(run)`` and the run file."""
    return f"{machine(run)}: `{rel(run['path'], root)}`"


def run_line(run: Run, root: Path) -> str:
    """The run file, its host, threads, model and the load average around it, in one line."""
    m = run.get("meta") or {}
    start, end = m.get("load_avg_start"), m.get("load_avg_end")
    load = "" if not start else f", load {start[0]:.2f}→{(end or ['?'])[0]:.2f}"
    return (f"`{rel(run['path'], root)}` ({host(run).split(' (')[0]}, {m.get('threads')} "
            f"threads, {m.get('model')}{load}).")


def ms(v: Any) -> str:
    """A time in ms as the tables print it: one decimal from 10 on, two below, — for none."""
    return "—" if v is None else f"{v:,.1f}" if v >= 10 else f"{v:,.2f}"


def md_table(head: Iterable[str], rows: Iterable[Iterable[Any]]) -> list[str]:
    head = list(head)
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def span(values: list[float | None], fmt: str) -> str:
    """"lo–hi" in ``fmt`` (one figure where both round alike); None values left out, "–" if
    none is left."""
    got = [v for v in values if v is not None]
    if not got:
        return "–"
    lo, hi = format(min(got), fmt), format(max(got), fmt)
    return lo if lo == hi else f"{lo}–{hi}"


def _by_mode(run: Run, root: Path) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in table(run, "latency", root):
        out.setdefault(str(r["mode"]), {})[int(r["context_len"])] = r
    return out


def _when(run: Run) -> datetime:
    return datetime.fromisoformat(str(run["created_utc"]))


# ------------------------------------------------------------------------------ the example run
def example_sweep(runs: list[Run], root: Path) -> str:
    """The write-up's Table 1 from the example sweep, the cached step's range, the A40's figure."""
    run = newest(runs, "latency_sweep", root)
    rows = table(run, "latency", root)
    t1 = summary_table(rows)
    if not t1:
        raise ReadmeError(f"{rel(run['path'], root)}: no context near 10, 100, 500 or 1000 "
                          "tokens measured in both modes 1 and 3")
    a, b = t1[0]["baseline_mode"], t1[0]["compare_mode"]
    lines = [f"Measured on {source(run, root)}.", ""]
    lines += md_table(["context (tokens)", f"`{a}` (ms)", f"`{b}` (ms)", "measured speedup",
                       "FLOP reduction"],
                      ([f"{r['measured_context_len']:,}", f"{r['baseline_ms']:,.1f}",
                        f"{r['compare_ms']:,.1f}", f"{r['speedup']:.1f}×",
                        f"{r['flop_reduction']:,.0f}×"] for r in t1))
    by = _by_mode(run, root)
    cached, uncached = by[b], by[a]
    lo, hi = min(cached), max(cached)
    lines += ["", f"Over the run's {len(cached)} contexts ({lo:,}–{hi:,} tokens) the `{b}` step "
              f"took {span([r['latency_ms'] for r in cached.values()], '.1f')} ms; the `{a}` "
              f"step climbed from {uncached[min(uncached)]['latency_ms']:,.0f} ms to "
              f"{uncached[max(uncached)]['latency_ms'] / 1e3:.1f} s."]
    ref_path = root / REFERENCE_PATH.relative_to(REPO_ROOT)
    try:
        facts = {f["name"]: f for f in load_run(ref_path)["tables"].get("facts", [])}
    except ResultsError as exc:
        raise ReadmeError(f"{rel(ref_path, root)}: {exc}") from exc
    if "speedup_at_1023" not in facts:
        raise ReadmeError(f"{rel(ref_path, root)}: no fact speedup_at_1023")
    lines.append(f"The write-up's A40 measured {facts['speedup_at_1023']['value']}× between the "
                 f"same two modes at 1,023 tokens (`{rel(ref_path, root)}`).")
    return "\n".join(lines)


def example_end_to_end(runs: list[Run], root: Path) -> str:
    run = newest(runs, "end_to_end", root)
    rows = table(run, "end_to_end", root)
    lines = [f"Measured on {source(run, root)}.", ""]
    lines += md_table(["mode", "prompt (tokens)", "new tokens", "whole generation (s)",
                       "prompt's forward (ms)"],
                      ([f"`{r['mode']}`", r["prompt_len"], r["new_tokens"],
                        f"{r['total_s']:,.2f}", f"{r['prefill_ms']:,.1f}"] for r in rows))
    return "\n".join(lines)


def example_memory(runs: list[Run], root: Path) -> str:
    run = newest(runs, "memory", root)
    rows = table(run, "kv_memory", root)
    model = table(run, "model", root)[0]
    kind = rows[0].get("cache_kind")
    lines = [f"Measured on {source(run, root)}; the `{kind}` cache filled by one prefill per "
             "context.", ""]
    lines += md_table(["context (tokens)", "formula (MiB)", "tensors (MiB)",
                       "process's resident gain (MiB)"],
                      ([f"{r['context_len']:,}", f"{r['kv_formula_bytes'] / MIB:,.2f}",
                        f"{r['kv_tensor_bytes'] / MIB:,.2f}",
                        "—" if r.get("rss_delta_bytes") is None
                        else f"{r['rss_delta_bytes'] / MIB:,.2f}"] for r in rows))
    cross = (run["tables"].get("crossover") or [{}])[0].get("crossover_tokens")
    lines += ["", f"Weights {model['weights_bytes'] / MIB:,.1f} MiB (formula "
              f"{model['weights_formula_bytes'] / MIB:,.1f} MiB)"
              + ("" if cross is None else f"; at batch 1 the cache outgrows them at "
                 f"{cross:,.0f} tokens") + "."]
    return "\n".join(lines)


def example_hardware(runs: list[Run], root: Path) -> str:
    run = newest(runs, "hardware", root)
    mm, bw = table(run, "matmul", root)[0], table(run, "bandwidth", root)[0]
    floor = table(run, "floor", root)[0]
    return (f"Measured on {source(run, root)}: a {mm['n']:,}² matmul at {mm['tflops']:.3f} "
            f"TFLOP/s, reads at {bw['read_gbps']:.1f} GB/s, copies at {bw['copy_gbps']:.1f} GB/s; "
            f"streaming the {floor['linear_weight_bytes'] / 1e6:,.0f} MB of Linear weights once "
            f"takes {floor['floor_ms']:.1f} ms at that read rate.")


# ---------------------------------------------------------------------------------- planner
def planner(runs: list[Run], root: Path) -> str:
    run = newest(runs, "kv_planner", root)
    m = run["meta"]
    fit = table(run, "fit", root)
    lines = [f"Measured on {source(run, root)}.", "",
             f"Free with the weights loaded: {m['free_bytes'] / 2**30:.1f} GiB; budget "
             f"{m['budget_bytes'] / 2**30:.1f} GiB; one allocation capped at "
             f"{m['alloc_cap_bytes'] / MIB:,.0f} MiB; {fit[0]['bytes_per_token']:,} B of KV per "
             "token.", ""]
    lines += md_table(["context (tokens)", "sequences that fit (formula)", "allocated",
                       "tensor bytes = formula", "resident gain − tensor bytes"],
                      ([f"{r['context_len']:,}", f"{r['formula_batch']:,}",
                        f"{r['allocated_batch']:,}" + (" (capped)" if r.get("capped") else ""),
                        "yes" if r.get("tensor_bytes") == r["formula_bytes"] else "**no**",
                        _gain(r)] for r in fit))
    lengths = m.get("lengths") or []
    lines += ["", f"A {m.get('distribution')} batch of {len(lengths)} sequences (mean "
              f"{statistics.mean(lengths):,.0f} tokens, longest {max(lengths):,}), held three "
              "ways:" if lengths else "The mixed batch, held three ways:", ""]
    lines += md_table(["layout", "reserved (MiB)", "wasted", "sequences that fit",
                       "allocated: tensor bytes = reserved"],
                      ([r["label"], f"{r['reserved_bytes'] / MIB:,.1f}",
                        f"{r['waste_share']:.1%}", f"{r['fits_sequences']:,}",
                        _held(r)] for r in table(run, "layouts", root)))
    lines += ["", "KV storage, logits against fp32 (teacher-forced steps):", ""]
    lines += md_table(["storage", "bytes per token", "measured", "max \\|Δ\\| ÷ largest logit",
                       "top-1 agreement"],
                      ([r["storage"], f"{r['bytes_per_token']:,}",
                        f"{r['measured_bytes_per_token']:,}", _sci(r.get("rel_error")),
                        "—" if r.get("top1_agree") is None else f"{r['top1_agree']:.0%}"]
                       for r in table(run, "storages", root)))
    return "\n".join(lines)


def _gain(row: dict[str, Any]) -> str:
    if row.get("tensor_bytes") is None:
        return row.get("error") or "not allocated"
    gained = row.get("allocated_delta_bytes")
    gained = row.get("rss_delta_bytes") if gained is None else gained
    return "—" if gained is None else f"{(gained - row['tensor_bytes']) / 1024:+,.0f} KiB"


def _held(row: dict[str, Any]) -> str:
    if row.get("tensor_bytes") is None:
        return "formula only (over the allocation cap)" if row.get("error") else "—"
    return "yes" if row["tensor_bytes"] == row["reserved_bytes"] else "**no**"


def _sci(x: float | None) -> str:
    return "—" if x is None else f"{x:.2g}"


# ---------------------------------------------------------------------------- predicted step
def predicted_step(runs: list[Run], root: Path) -> str:
    preds = [r for r in runs if r.get("kind") == "step_prediction"] or [
        newest(runs, "step_prediction", root)]
    rows = []
    for run in preds:
        verdicts = table(run, "verdicts", root)
        threads = run["meta"].get("threads")
        rows.append([f"`{Path(run['path']).name}` ({threads} thread{'s' if threads != 1 else ''})",
                     _worst(verdicts, True), _worst(verdicts, False),
                     ", ".join(f"`{v['mode']}`" for v in verdicts
                               if v.get("worst_share") is None) or "—"])
    lines = [f"Runs in `{rel(Path(preds[0]['path']).parent, root)}/`; the newest on "
             f"{machine(preds[-1])}.", ""]
    goal = {c: next((v["goal_share"] for r in preds for v in r["tables"]["verdicts"]
                     if bool(v["cached"]) == c), None) for c in (True, False)}
    lines += md_table(["run", f"worst miss, cached modes (goal {_pct(goal[True])})",
                       f"worst miss, uncached modes (goal {_pct(goal[False])})",
                       "not predicted"], rows)
    return "\n".join(lines + _residuals(preds[-1], root))


def _residuals(run: Run, root: Path) -> list[str]:
    """Per mode of the newest run: its worst miss, its residual (measured - predicted) over
    the contexts, and the verdict; nothing when the run holds no ``prediction`` table."""
    pred = (run.get("tables") or {}).get("prediction") or []
    if not pred:
        return []
    resid: dict[str, list[float]] = {}
    for r in pred:
        if r.get("residual_ms") is not None:
            resid.setdefault(str(r["mode"]), []).append(float(r["residual_ms"]))
    rows = []
    for v in table(run, "verdicts", root):
        got = resid.get(str(v["mode"]))
        rows.append([f"`{v['mode']}`", "—" if v.get("worst_share") is None else
                     f"{v['worst_share']:.1%} at {v['worst_context']:,} tokens",
                     f"{min(got):+.1f} to {max(got):+.1f}" if got else "—",
                     "—" if v.get("within") is None else "yes" if v["within"] else "**no**"])
    return ["", f"Per mode, the newest run (`{Path(run['path']).name}`): the residual is "
            "measured − predicted at each of its contexts.", "",
            *md_table(["mode", "worst miss", "residual over the contexts (ms)",
                       "within its goal"], rows)]


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.0%}"


def _worst(verdicts: list[dict[str, Any]], cached: bool) -> str:
    got = [v for v in verdicts if bool(v["cached"]) == cached and v.get("worst_share") is not None]
    if not got:
        return "—"
    got.sort(key=lambda v: v["worst_share"], reverse=True)
    w = got[0]
    text = f"{w['worst_share']:.1%} (`{w['mode']}` at {w['worst_context']:,} tokens)"
    rest = [v["worst_share"] for v in got[1:]]
    return text + (f"; others {span(rest, '.1%')}" if rest else "")


# ------------------------------------------------------------------- isolation and the sweep
def isolation(runs: list[Run], root: Path) -> str:
    """Per sweep and mode: the step's spread, what was set aside, and against the nearest CLI run
    in time (the CLI records its command line; a page's run does not)."""
    sweeps = [r for r in runs if r.get("kind") == "latency_sweep"] or [
        newest(runs, "latency_sweep", root)]
    cli = [r for r in sweeps if (r.get("meta") or {}).get("command")]
    out = []
    for run in sweeps:
        others = [c for c in cli if c is not run]
        near = min(others, key=lambda c: abs((_when(c) - _when(run)).total_seconds()),
                   default=None)
        theirs = _by_mode(near, root) if near is not None else {}
        for mode, points in _by_mode(run, root).items():
            steps = [p["latency_ms"] for p in points.values()]
            med = statistics.median(steps)
            aside = [ms for p in points.values() for ms in p.get("set_aside_ms") or []]
            kept = sum(int(p.get("disturbed_kept") or 0) for p in points.values())
            ratios = [p["latency_ms"] / theirs[mode][t]["latency_ms"]
                      for t, p in points.items() if t in theirs.get(mode, {})]
            out.append([f"`{Path(run['path']).name}`",
                        "CLI" if (run.get("meta") or {}).get("command") else "a page",
                        "on" if (run.get("meta") or {}).get("retakes", 3) else "off",
                        f"`{mode}`", f"{med:,.1f}", f"{max(steps) / med:.2f}×",
                        f"{len(aside)}" + (f" ({max(aside) / med:.1f}×)" if aside else "")
                        + f"; {kept}",
                        f"{statistics.median(ratios):.3f} ({span(ratios, '.2f')})"
                        if ratios else "—"])
    lines = [f"The newest run on {machine(sweeps[-1])}.", ""]
    lines += md_table(["run", "from", "retakes", "mode", "median step (ms)", "largest ÷ median",
                       "set aside (largest ÷ median); disturbed kept",
                       "÷ the nearest CLI run, median over contexts (range)"], out)
    return "\n".join(lines)


# -------------------------------------------------------------------------- what ran where
def days(stamps: list[str]) -> str:
    """The day, or the first and last day, of ISO timestamps: "2026-12-03 – 2026-12-04"."""
    when = sorted({s[:10] for s in stamps})
    return when[0] if len(when) == 1 else f"{when[0]} – {when[-1]}"


def hosts(runs: list[Run], root: Path) -> str:
    """Every host the committed runs name, with how many runs, under which folders, when; and
    how many ran on a GPU."""
    by: dict[str, list[Run]] = {}
    for r in runs:
        if (r.get("meta") or {}).get("device_name"):  # not a benchmark's own timing record
            by.setdefault(host(r), []).append(r)
    rows = []
    for name, got in sorted(by.items(), key=lambda kv: min(str(r["created_utc"]) for r in
                                                          kv[1])):
        topics = sorted({Path(rel(r["path"], root)).parts[2] for r in got})
        rows.append([name, ", ".join(sorted({str(r["meta"].get("device")) for r in got})),
                     len(got), ", ".join(f"`{t}/`" for t in topics),
                     days([str(r["created_utc"]) for r in got])])
    gpu = sum(str((r.get("meta") or {}).get("device", "")).startswith("cuda") for r in runs)
    return "\n".join([*md_table(["host (device, platform)", "device", "runs",
                                 "folders under docs/runs/", "dates"], rows), "",
                      f"**On a GPU: {gpu or 'no'} committed run"
                      f"{'' if gpu == 1 else 's'}.**"])


# ------------------------------------------------------------------------------ device check
def gpu_check_length(runs: list[Run], root: Path) -> str:
    """How long ``make gpu-check`` may run: the time limit scripts/gpu_check.sh sets (LIMIT_S),
    and the CUDA tests' cap within it (TESTS_S)."""
    path = root / "scripts" / "gpu_check.sh"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ReadmeError(f"{rel(path, root)}: could not read: {exc.strerror or exc}") from exc
    limit = re.search(r"^LIMIT_S=(\d+)", text, re.M)
    tests = re.search(r"^TESTS_S=(\d+)", text, re.M)
    if limit is None or tests is None:
        raise ReadmeError(f"{rel(path, root)}: no `LIMIT_S=N` with `TESTS_S=N` found")
    total = int(limit.group(1))
    return (f"`make gpu-check` (`scripts/gpu_check.sh`) stops at {total} s ({total / 60:.3g} "
            f"minutes), its CUDA tests at {tests.group(1)} s.")
