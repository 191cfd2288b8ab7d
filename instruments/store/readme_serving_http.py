"""The block of docs/serving-http.md made from docs/runs/serving-http/: guidellm against our
server and against llama-server, beside our own harness at the same points. Torch-free.

``serving_http(runs, root)`` reads the newest "serving_http" run of each server and the newest
"serving" runs (the harness: a closed loop per concurrency, Poisson per rate) and gives one row
per point: output tokens/s over HTTP and in the harness (the ratio: the 10% target), TTFT p50
both ways, llama-server's output tokens/s and both servers' ITL p99 (the target: ours at or
above its throughput, at or under its ITL p99 up to concurrency 16), then TPOT at the largest
concurrency over HTTP against the engine driven directly (the 2% target), and the host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from instruments.store.readme_blocks import Run, host, md_table, rel

HARNESS_SHARE = 0.10  # guidellm's throughput and TTFT within 10% of the harness's
FRONT_END_SHARE = 0.02  # the HTTP front end adds at most 2% to TPOT at the top concurrency
TOP_CONCURRENCY = 16


def _newest(runs: list[Run], pred: Any) -> Run | None:
    found = [r for r in runs if pred(r)]
    return found[-1] if found else None  # runs come oldest first


def _points(run: Run | None) -> dict[str, dict[str, Any]]:
    """Rows by point key: "C=4" (closed loop) or "2/s" (Poisson)."""
    out = {}
    for row in (run or {}).get("tables", {}).get("points", []):
        if row.get("concurrency") is not None:
            out[f"C={row['concurrency']}"] = row
        elif row.get("rate_per_s") is not None and row.get("way", "continuous") == "continuous":
            out[f"{row['rate_per_s']:g}/s"] = row
    return out


def _num(x: Any, fmt: str = ",.1f") -> str:
    return "—" if x is None else format(x, fmt)


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if a and b else None


def serving_http(runs: list[Run], root: Path) -> str:
    ours = _newest(runs, lambda r: r["kind"] == "serving_http"
                   and r["meta"].get("server") == "kvlab")
    llama = _newest(runs, lambda r: r["kind"] == "serving_http"
                    and r["meta"].get("server") == "llama-server")
    harness: dict[str, dict[str, Any]] = {}
    for r in runs:  # oldest first: the newest run of each point wins
        if r["kind"] == "serving":
            harness.update(_points(r))
    if ours is None:
        return "_No serving_http run of our server yet: run `python scripts/bench_server.py " \
               "--out docs/runs/serving-http` on a quiet machine._"
    mine, theirs = _points(ours), _points(llama)
    rows = []
    for key, row in mine.items():
        h, ll = harness.get(key, {}), theirs.get(key, {})
        tput = _ratio(row["output_tok_s"], h.get("output_tok_s"))
        ttft = _ratio(row["ttft_p50_ms"], h.get("ttft_p50_ms"))
        within = tput is not None and ttft is not None and abs(tput - 1) <= HARNESS_SHARE \
            and abs(ttft - 1) <= HARNESS_SHARE
        beat = (ll and row["output_tok_s"] >= ll["output_tok_s"]
                and (row["itl_p99_ms"] or 0) <= (ll.get("itl_p99_ms") or 0))
        rows.append([key, _num(row["output_tok_s"]), _num(h.get("output_tok_s")),
                     _num(tput, ".3f"), f"{_num(row['ttft_p50_ms'])} / "
                     f"{_num(h.get('ttft_p50_ms'))}", "held" if within else "missed",
                     _num(ll.get("output_tok_s")), f"{_num(row['itl_p99_ms'], '.2f')} / "
                     f"{_num(ll.get('itl_p99_ms'), '.2f')}",
                     "—" if not ll else ("held" if beat else "missed")])
    lines = md_table(["point", "ours over HTTP (output tok/s)", "our harness (tok/s)",
                      "HTTP ÷ harness", "TTFT p50 HTTP / harness (ms)", "within 10%",
                      "llama-server (tok/s)", "ITL p99 ours / llama-server (ms)",
                      "ours ≥ llama-server"], rows)
    top = max((r["concurrency"] for r in mine.values() if r.get("concurrency")), default=None)
    if top is not None and f"C={top}" in harness:
        a, b = mine[f"C={top}"]["tpot_mean_ms"], harness[f"C={top}"]["tpot_mean_ms"]
        if a and b:
            lines += ["", f"TPOT at concurrency {top}: {a:.2f} ms over HTTP, {b:.2f} ms with the "
                      f"engine driven directly ({a / b - 1:+.1%}; the target: at most "
                      f"{FRONT_END_SHARE:+.0%}{'' if top == TOP_CONCURRENCY else ', at 16'})."]
    m = ours["meta"]
    lines += ["", f"Measured on {host(ours)}, {m.get('threads')} threads a server, "
              f"{m.get('model')} from {m.get('weights')}, prompts of {m.get('prompt_tokens')} "
              f"tokens asking for {m.get('output_tokens')}, guidellm {m.get('guidellm_version')}"
              + (f"; llama-server: {llama['meta'].get('llama_cpp')}" if llama else "; no "
                 "llama-server run") + f". Files: `{rel(ours['path'], root)}`"
              + (f", `{rel(llama['path'], root)}`" if llama else "") + "."]
    return "\n".join(lines)
