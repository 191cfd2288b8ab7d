"""guidellm's JSON report read into a run of ours (kind "serving_http"). Torch-free.

  run = to_run(report, server=..., meta={...})   one run per report: a row of ``points`` per
        guidellm benchmark (a Poisson rate or a concurrency), named like the serving
        experiments' points (``instruments.experiments.serving.metrics.point``), so the Serving
        page and ``compare`` read both; ValueError naming what is missing in a report that is
        not guidellm's
  rows = points(report, server)

A row: ``label`` ("poisson @ 2/s", "C=4"), ``server`` (ours or llama-server), ``profile``,
``rate_per_s`` or ``concurrency``, the requests that succeeded, errored or were left
incomplete, the benchmark's duration, output tokens and output tokens/s (tokens over the
duration, as our harness counts), requests/s, and each latency as mean, p50 and p99 in ms:
``ttft`` (request sent to first token), ``tpot`` and ``itl`` (both guidellm's
inter_token_latency: each request's (last token - first token) / (tokens - 1), weighted by its
tokens; guidellm keeps no single gaps, so its ITL is this per-request mean, vLLM's TPOT), and
``e2e`` (request latency). ``guidellm_output_tok_s`` is guidellm's own output-token rate.
"""

from __future__ import annotations

from typing import Any

from instruments.store import results

DEFINITIONS = {
    "ttft_ms": "guidellm: request sent to first streamed token",
    "tpot_ms": "guidellm inter_token_latency: per request (last - first token) / (tokens - 1), "
               "token-weighted (vLLM's TPOT)",
    "itl_ms": "the same as tpot_ms: guidellm keeps no single gaps",
    "e2e_ms": "guidellm request_latency",
    "output_tok_s": "output tokens of the successful requests / the benchmark's duration",
}


def _stat(metric: dict[str, Any], scale: float = 1.0) -> tuple[Any, Any, Any]:
    s = metric.get("successful") or {}
    pct = s.get("percentiles") or {}
    if not s.get("count"):
        return None, None, None
    return (s["mean"] * scale, pct.get("p50", s.get("median")) * scale,
            pct["p99"] * scale if pct.get("p99") is not None else None)


def points(report: dict[str, Any], server: str) -> list[dict[str, Any]]:
    try:
        benchmarks = report["benchmarks"]
        version = report["metadata"]["guidellm_version"]
    except (KeyError, TypeError):
        raise ValueError("not a guidellm report: no benchmarks or metadata") from None
    rows = []
    for b in benchmarks:
        strat, m = b["config"]["strategy"], b["metrics"]
        totals = m["request_totals"]
        dur = float(b["duration"])
        out_tokens = (m["output_token_count"].get("successful") or {}).get("total_sum") or 0
        rate, streams = strat.get("rate"), strat.get("streams")
        label = f"C={streams}" if streams else (f"{strat['type_']} @ {rate:g}/s" if rate
                                                else strat["type_"])
        row: dict[str, Any] = {
            "label": label, "server": server, "client": f"guidellm {version}",
            "profile": strat["type_"], "rate_per_s": rate, "concurrency": streams,
            "requests": totals["successful"], "errored": totals["errored"],
            "incomplete": totals["incomplete"], "duration_s": dur,
            "output_tokens": out_tokens, "output_tok_s": out_tokens / max(dur, 1e-12),
            "requests_s": totals["successful"] / max(dur, 1e-12),
            "guidellm_output_tok_s": (m["output_tokens_per_second"].get("successful")
                                      or {}).get("mean"),
            "concurrency_mean": (m["request_concurrency"].get("successful") or {}).get("mean"),
        }
        for prefix, metric, scale in (("ttft", "time_to_first_token_ms", 1.0),
                                      ("tpot", "inter_token_latency_ms", 1.0),
                                      ("itl", "inter_token_latency_ms", 1.0),
                                      ("e2e", "request_latency", 1e3)):
            mean, p50, p99 = _stat(m[metric], scale)
            row.update({f"{prefix}_mean_ms": mean, f"{prefix}_p50_ms": p50,
                        f"{prefix}_p99_ms": p99})
        rows.append(row)
    return rows


def to_run(report: dict[str, Any], *, server: str, meta: dict[str, Any]) -> dict[str, Any]:
    """A results-schema run of kind "serving_http" (``meta``: the host, the server's facts,
    the workload; versions and git revision are added)."""
    rows = points(report, server)
    spec = (report.get("config") or {}).get("spec") or {}
    full = results.collect_meta(**{
        "experiment": "serving_http", "server": server,
        "guidellm_version": report["metadata"]["guidellm_version"],
        "profile": spec.get("profile"), "data": spec.get("data"),
        "backend": {k: (spec.get("backend") or {}).get(k) for k in ("target", "model",
                                                                    "request_format")},
        "definitions": DEFINITIONS, **meta})
    full["errors"] = sum(r["errored"] + r["incomplete"] for r in rows)
    return results.new_run("serving_http", full, {"points": rows})
