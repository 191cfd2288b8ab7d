"""The field's terms on the pages: per-point tables, a generation's serving numbers, definitions.

  point_table(df)        a sweep's latency rows as the field reads them: median, p50/p90/p99,
                         samples kept, spread, MBU/MFU (percentiles computed from the samples
                         for runs saved before rows carried them). Pure.
  serving_table(df)      the end-to-end rows: TTFT, TPOT and its percentiles, E2E, output
                         tokens/s, pp / tg tokens/s, energy. Pure.
  pp_tg_sentence(df)     llama-bench's two numbers per mode from those rows, as one sentence
  columns(names)         Streamlit column configs whose header tooltips hold the definitions
  definitions(terms)     the definitions behind a "What these mean" popover
The numbers come from ``instruments.store.stats`` (one way to compute a percentile). Torch-free.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from instruments.store import stats

P_NEED = ", ".join(f"p{q} from {n} samples" for q, n in stats.MIN_SAMPLES.items() if n > 1)
GLOSSARY = {
    "p50 / p90 / p99": "the value below which 50 / 90 / 99% of a point's kept samples lie "
    f"(linear between the closest ranks). Given only with enough samples ({P_NEED}): a p99 "
    "of three samples would just be the largest; an empty cell says there were too few.",
    "TTFT": "time to first token: the prompt's forward pass that yields the first new token "
    "(no queue here: one request at a time).",
    "TPOT": "time per output token (inter-token latency): the mean of the steps after the "
    "first; its p50/p90/p99 are over those steps, every timed repeat pooled.",
    "E2E": "end-to-end latency: the whole generation, TTFT plus every later step.",
    "output tokens/s": "new tokens × batch ÷ E2E.",
    "pp / tg": "llama-bench's prompt processing (P prompt tokens in one call) and token "
    "generation (N tokens, one step each) in tokens/s; `python -m instruments bench` gives "
    "them ± sd over repeats. Here: pp at the end-to-end prompt, tg over its later steps.",
    "MBU": "model bandwidth utilisation: the bytes a step must read (the weights once, the "
    "tied embedding once, plus the K/V rows it attends to) ÷ the step's time ÷ a peak read "
    "bandwidth: the one measured here in this run, and the datasheet's for a listed GPU. "
    "Near 1, the step streams its bytes as fast as the memory allows.",
    "MFU": "model FLOPs utilisation: the step's formula FLOPs ÷ its time ÷ a peak matmul rate "
    "(measured here; listed).",
    "new ÷ old": "a point's number in the newer run over the older one's: for a time, above 1 "
    "is slower; for tokens/s, below 1 is slower.",
    "noise band": "how far two runs of the same code may differ at a point: the larger of "
    "the two points' own spreads ((max - min) / median of their samples; a point of one sample "
    "takes its run's typical spread) and a floor you set. Beyond it a point is flagged a "
    "regression or an improvement; `python -m instruments compare OLD NEW` exits with 1 on a "
    "regression.",
    "energy": "the device's own counter around the timed runs (NVML on a GPU, RAPL on a CPU "
    "where readable): joules per generated token and average watts; empty with the reason "
    "where the device has none.",
}


def definitions(terms: list[str] | None = None, label: str = "What these mean") -> None:
    """A popover holding the definitions of ``terms`` (default: all)."""
    with st.popover(label, icon=":material/help:"):
        for term in terms or list(GLOSSARY):
            st.markdown(f"**{term}**: {GLOSSARY[term]}")


POINT_COLUMNS = ["mode", "context_len", "latency_ms", "p50_ms", "p90_ms", "p99_ms",
                 "samples_n", "spread_ms", "mbu", "mfu", "mbu_listed", "mfu_listed"]


def point_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per point: median, percentiles (from the samples where the row has none), samples kept,
    spread, MBU and MFU; columns the run lacks are left out."""
    if df.empty:
        return pd.DataFrame(columns=POINT_COLUMNS)
    out = df.copy()
    if "samples_ms" in out.columns:
        derived = pd.DataFrame([stats.percentile_fields(s if isinstance(s, list) else [])
                                for s in out["samples_ms"]], index=out.index)
        for col in derived.columns:
            if col not in out.columns:
                out[col] = derived[col]
    return out[[c for c in POINT_COLUMNS if c in out.columns]]


SERVING_COLUMNS = ["mode", "prompt_len", "new_tokens", "ttft_ms", "tpot_ms", "tpot_p50_ms",
                   "tpot_p90_ms", "tpot_p99_ms", "e2e_ms", "output_tokens_per_s",
                   "prefill_tokens_per_s", "decode_tokens_per_s", "joules_per_token",
                   "avg_watts"]


def serving_table(df: pd.DataFrame) -> pd.DataFrame:
    """The end-to-end rows' serving numbers (energy columns only where a counter gave some)."""
    if df.empty or "ttft_ms" not in df.columns:
        return pd.DataFrame(columns=SERVING_COLUMNS)
    cols = [c for c in SERVING_COLUMNS if c in df.columns]
    if "joules_per_token" in df.columns and df["joules_per_token"].isna().all():
        cols = [c for c in cols if c not in ("joules_per_token", "avg_watts")]
    return df[cols]


def pp_tg_sentence(df: pd.DataFrame) -> str | None:
    """"concat: pp8 1,234 tokens/s, tg63 456 tokens/s; ..." from end-to-end rows (None if
    the rows predate these fields)."""
    if df.empty or "prefill_tokens_per_s" not in df.columns:
        return None
    parts = []
    for r in df.itertuples():
        pp, tg = r.prefill_tokens_per_s, r.decode_tokens_per_s
        tg_text = f"tg{int(r.new_tokens) - 1} {tg:,.1f}" if pd.notna(tg) else "tg –"
        parts.append(f"{r.mode}: pp{int(r.prompt_len)} {pp:,.1f}, {tg_text} tokens/s")
    return "; ".join(parts)


def energy_note(df: pd.DataFrame) -> str | None:
    """Why the energy columns are empty, when they all are (the first row's reason)."""
    if "energy_note" not in df.columns or "joules_per_token" not in df.columns:
        return None
    if df["joules_per_token"].notna().any():
        return None
    notes = df["energy_note"].dropna()
    return f"Energy: {notes.iloc[0]}." if not notes.empty else None


_FORMATS: dict[str, tuple[str, str, str]] = {  # column -> (header, format, glossary term)
    "context_len": ("context (tokens)", "%d", ""),
    "latency_ms": ("median (ms)", "%.3f", ""),
    "p50_ms": ("p50 (ms)", "%.3f", "p50 / p90 / p99"),
    "p90_ms": ("p90 (ms)", "%.3f", "p50 / p90 / p99"),
    "p99_ms": ("p99 (ms)", "%.3f", "p50 / p90 / p99"),
    "samples_n": ("samples kept", "%d", "p50 / p90 / p99"),
    "spread_ms": ("spread (ms)", "%.3f", ""),
    "mbu": ("MBU (measured)", "percent", "MBU"), "mfu": ("MFU (measured)", "percent", "MFU"),
    "mbu_listed": ("MBU (datasheet)", "percent", "MBU"),
    "mfu_listed": ("MFU (datasheet)", "percent", "MFU"),
    "prompt_len": ("prompt (tokens)", "%d", ""), "new_tokens": ("new tokens", "%d", ""),
    "ttft_ms": ("TTFT (ms)", "%.2f", "TTFT"), "tpot_ms": ("TPOT mean (ms)", "%.3f", "TPOT"),
    "tpot_p50_ms": ("TPOT p50 (ms)", "%.3f", "TPOT"),
    "tpot_p90_ms": ("TPOT p90 (ms)", "%.3f", "TPOT"),
    "tpot_p99_ms": ("TPOT p99 (ms)", "%.3f", "TPOT"),
    "e2e_ms": ("E2E (ms)", "%.1f", "E2E"),
    "output_tokens_per_s": ("output tokens/s", "%.1f", "output tokens/s"),
    "prefill_tokens_per_s": ("pp tokens/s", "%.1f", "pp / tg"),
    "decode_tokens_per_s": ("tg tokens/s", "%.1f", "pp / tg"),
    "joules_per_token": ("J / token", "%.4g", "energy"),
    "avg_watts": ("average W", "%.1f", "energy"),
}


def columns(names: list[str]) -> dict[str, Any]:
    """Column configs for ``names``: unit in the header, the definition in its tooltip."""
    out: dict[str, Any] = {}
    for name in names:
        if name not in _FORMATS:
            continue
        header, fmt, term = _FORMATS[name]
        out[name] = st.column_config.NumberColumn(header, format=fmt,
                                                  help=GLOSSARY.get(term) or None)
    return out
