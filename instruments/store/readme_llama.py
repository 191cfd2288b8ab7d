"""The generated blocks of docs/llama.md: what SmolLM2-135M's committed runs say. Torch-free.

Makers as in ``instruments.store.readme_blocks`` (``make(runs, root) -> str``):
  llama_checks     the correctness run: every check with no bug (logits against transformers,
                   cached == uncached with its distinct tokens, the multi-token append), which
                   check caught each bug, and the first words of the real text
  llama_runs       the sweep and the memory run: step time per mode at each context; the KV
                   cache by formula, tensors and allocator, and by formula with a K/V head per
                   query head (what GQA saves)
  llamacpp_summary the README's lines: per model, ours over llama.cpp per format over every
                   run, thread count and context, q4_1 against the fp32 read; which instruction
                   sets have run it, on which hosts, and which never have (our kernel's build,
                   ``meta.kernel_isa``: -march=native, so the host's, as llama.cpp's is)
  llamacpp         the peers runs with llama.cpp: per run (host, threads, model), our step over
                   llama.cpp's on the same weights at each format and context, and our q4_1
                   step over the fp32 read floor, against the goal (<= 1) and the target (0.8);
                   the instruction set our kernel ran (``meta.kernel_isa``)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.kernels.cpu import ISA_NAMES
from instruments.store.peers_report import LLAMACPP_PAIRS as PAIRS
from instruments.store.peers_report import llamacpp_pairs
from instruments.store.readme_blocks import (
    ReadmeError,
    Run,
    host,
    md_table,
    newest,
    rel,
    span,
    table,
)


def llama_checks(runs: list[Run], root: Path) -> str:
    run = newest(runs, "correctness", root)
    rows = table(run, "checks", root)
    base = [r for r in rows if r["bug"] == "no bug"]
    caught: dict[str, list[str]] = {}
    for r in rows:
        if r["bug"] != "no bug" and r["passed"] is False:
            caught.setdefault(r["bug"], []).append(r["check"].split(" (")[0])
    bugs = list(dict.fromkeys(r["bug"] for r in rows if r["bug"] != "no bug"))
    text = next((t.get("text", "") for t in table(run, "tokens", root) if t["bug"] == "no bug"),
                "")
    m = run.get("meta") or {}
    out = [*md_table(["check, no bug", "verdict", "what it measured"],
                     [[r["check"], {True: "passed", False: "FAILED"}.get(r["passed"], "n/a"),
                       r["detail"].replace("|", "\\|")] for r in base]), "",
           *md_table(["bug switched on", "caught by"],
                     [[b, ", ".join(caught.get(b, [])) or "no check"] for b in bugs]), "",
           f"The prompt \"{m.get('prompt_text')}\" continued: \"{' '.join(text.split()[:40])}"
           "…\"", "", f"{host(run)}, {m.get('weights')}, {str(run.get('created_utc'))[:10]}: "
           f"`{rel(run['path'], root)}`."]
    return "\n".join(out)


def llama_runs(runs: list[Run], root: Path) -> str:
    sweep = newest(runs, "latency_sweep", root)
    memory = newest(runs, "memory", root)
    rows = [r for r in table(sweep, "latency", root) if r.get("phase") != "prefill"]
    contexts = sorted({int(r["context_len"]) for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    cell = {(r["mode"], int(r["context_len"])): float(r["latency_ms"]) for r in rows}
    out = md_table(["mode", *(f"{t} tokens (ms)" for t in contexts)],
                   [[f"`{m}`", *(f"{cell[(m, t)]:,.1f}" if (m, t) in cell else "–"
                                 for t in contexts)] for m in modes])
    kv = max(table(memory, "kv_memory", root), key=lambda r: int(r["context_len"]))
    mha = kv.get("kv_mha_formula_bytes")
    out += ["", f"KV cache at {int(kv['context_len']):,} tokens: {kv['kv_formula_bytes']:,} B by "
            f"formula, {kv['kv_tensor_bytes']:,} B in the cache's tensors"
            + (f", {mha:,} B if every query head kept its own K/V" if mha else "") + "."]
    out += ["", f"{host(sweep)}, {(sweep.get('meta') or {}).get('threads')} thread(s), "
            f"{str(sweep.get('created_utc'))[:10]}: `{rel(sweep['path'], root)}`, "
            f"`{rel(memory['path'], root)}`."]
    return "\n".join(out)


def _pairs(run: Run, root: Path) -> list[dict[str, Any]]:
    """``llamacpp_pairs`` of a run, each format's pair as (ours ms, theirs ms)."""
    return [{**p, **{fmt: None if p[fmt] is None else (float(p[fmt][0]["latency_ms"]),
                                                       float(p[fmt][1]["latency_ms"]))
                     for *_, fmt in PAIRS}}
            for p in llamacpp_pairs(table(run, "peers", root))]


def _goals(run: Run, root: Path) -> list[list[Any]]:
    m = run.get("meta") or {}
    out = []
    for p in _pairs(run, root):
        cells = ["–" if p[fmt] is None else
                 f"{p[fmt][0]:.1f} / {p[fmt][1]:.1f} = {p[fmt][0] / p[fmt][1]:.2f}"
                 for *_, fmt in PAIRS]
        cells.append("–" if p["q4_floor"] is None else f"{p['q4_floor']:.2f}")
        out.append([str(run.get("created_utc"))[:16].replace("T", " "), host(run),
                    m.get("model"), m.get("kernel_isa") or "–", m.get("threads"), p["context"],
                    *cells])
    return out


def llamacpp_summary(runs: list[Run], root: Path) -> str:
    """The README's lines: per model, ours over llama.cpp's step per format (the span over every
    committed run, thread count and context: misses stay in view), q4_1 against the fp32 read
    and its own bytes, and the instruction sets our kernel ran."""
    by_model: dict[str, list[Run]] = {}
    for run in runs:
        if run.get("kind") == "peers" and _pairs(run, root):
            by_model.setdefault(str((run.get("meta") or {}).get("model")), []).append(run)
    if not by_model:
        raise ReadmeError("no peers run with llama.cpp is committed")
    lines, isas = [], {}
    for model, chosen in sorted(by_model.items()):
        points = [p for r in chosen for p in _pairs(r, root)]
        threads = sorted({(r.get("meta") or {}).get("threads") for r in chosen})
        contexts = sorted({p["context"] for p in points})
        for r in chosen:
            isas.setdefault((r.get("meta") or {}).get("kernel_isa") or "unrecorded",
                            set()).add(host(r))
        cells = []
        for *_, fmt in PAIRS:
            ratios = [p[fmt][0] / p[fmt][1] for p in points if p[fmt]]
            if ratios:
                cells.append(f"{fmt} {span(ratios, '.2f')}×")
            elif any(f"{fmt} why" in p for p in points):
                why = next(p[f"{fmt} why"] for p in points if f"{fmt} why" in p)
                cells.append(f"{fmt} not compared (llama.cpp's {why.split(';')[0]})")
        floor = [p["q4_floor"] for p in points if p["q4_floor"] is not None]
        own = [p["q4_own"] for p in points if p["q4_own"] is not None]
        n = len(chosen)
        lines.append(f"- **{model}** ({n} run{'s' * (n != 1)}; {', '.join(map(str, threads))} "
                     f"thread(s), {' and '.join(map(str, contexts))} tokens): ours ÷ llama.cpp's "
                     "step " + ", ".join(cells)
                     + (f"; our q4_1 step {span(floor, '.2f')}× a read of the fp32 weights"
                        if floor else "")
                     + (f", {span(own, '.2f')}× a read of its own bytes" if own else "") + ".")
    order = {name: i for i, name in enumerate(ISA_NAMES)}  # widest first, "unrecorded" last
    ran = "; ".join(f"{isa} on {', '.join(sorted(isas[isa]))}"
                    for isa in sorted(isas, key=lambda i: order.get(i, len(order))))
    never = [isa for isa in ISA_NAMES if isa not in isas]
    return "\n".join([f"Every committed run (goal ≤ 1, target ≤ 0.8; q4_1's ≤ 0.35× the fp32 "
                      "read), by the instruction set our kernel was built for (the host's "
                      f"unless KVLAB_KERNEL_ISA narrowed it; llama.cpp's is the host's): {ran}"
                      + (f"; never run on {', '.join(never)}" if never else "") + ":", "",
                      *lines])


def llamacpp(runs: list[Run], root: Path) -> str:
    """The newest run with llama.cpp per host, model and thread count, a row per context (the
    README's lines span every run)."""
    newest_of: dict[tuple[str, str, Any], Run] = {}
    for run in sorted(runs, key=lambda r: str(r.get("created_utc"))):
        if run.get("kind") == "peers" and _pairs(run, root):
            m = run.get("meta") or {}
            newest_of[(host(run), str(m.get("model")), m.get("threads"))] = run
    if not newest_of:
        raise ReadmeError(f"{rel(Path(runs[0]['path']).parent, root)}/ holds no peers run "
                          "with llama.cpp")
    hosts = sorted({h for h, _, _ in newest_of})
    head = ["model", "our kernel", "threads", "context",
            *(f"ours / llama.cpp {fmt} (ms)" for *_, fmt in PAIRS), "q4_1 × fp32 read"]
    total = sum(1 for r in runs if r.get("kind") == "peers" and _pairs(r, root))
    lines = [f"Per host, model and thread count the newest of {total} runs:"]
    for h in hosts:  # one table a host, the host and its runs' dates said once above it
        mine = [run for (rh, _, _), run in newest_of.items() if rh == h]
        days = sorted({str(run.get("created_utc"))[:10] for run in mine})
        rows = [row[2:] for run in mine for row in _goals(run, root)]  # less run time, host
        span = days[0] if len(days) == 1 else f"{days[0]} – {days[-1]}"
        lines += ["", f"{h}, {span}:", "", *md_table(head, rows)]
    return "\n".join([*lines, "",
                      "Ours: `q4_1_weights`, `q8_0_weights`, and our fastest exact fp32 mode; "
                      "goal ≤ 1, target ≤ 0.8; q4_1's target ≤ 0.35× a read of the fp32 "
                      "weights measured in the same process."])
