"""Memory: where the bytes go, the KV cache measured three ways, and when it outgrows the weights.

Formulas (``instruments.costmodel.costs``: the breakdown, the crossover grid, the mask bytes) draw
at once; measurements -- the cache at each context against both baselines, and a measured breakdown
-- are the "memory" experiment in the measuring process (``ui.jobs``), saved as kind "memory".
Figures from ``ui.figures_memory``; the baseline toggle only redraws.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from instruments.costmodel import costs
from instruments.experiments import to_dict
from instruments.experiments.inputs import MAX_BATCH, parse_contexts
from instruments.experiments.memory import CROSSOVER_BATCHES, MEMORY_BASELINES, MemoryParams
from instruments.process.client import Job
from ui import header, jobs
from ui.figures_memory import breakdown_figure, crossover_figure, kv_memory_figure, mask_figure
from ui.state import RUN_ICON, is_cpu

KEY = "memory_job"
MASKS = {"seed": "one fp32 mask per layer (the write-up's)", "shared_bool": "one shared bool mask",
         "none": "no stored mask (fused attention)"}

choice = header.page("Memory", "What a generation holds in memory: the weights, the KV cache, "
                     "the causal masks and the workspaces, by formula and as measured on this "
                     "device.")
cfg = header.model(choice)
dtype, block = choice.dtype, cfg.block_size
cpu = is_cpu(choice)
if cpu:
    st.info("On a CPU torch keeps no allocator counters: measured memory is the measuring "
            "process's resident set size.", icon=":material/memory:")
job = jobs.get(KEY)
busy = jobs.running(KEY)
spec0 = MemoryParams.defaults(choice.device, cfg)  # the experiment's own defaults

# ----------------------------------------------------------------------------- breakdown
st.subheader("Where the bytes go")
c1, c2, c3, c4 = st.columns(4)
batch = int(c1.number_input("Batch size", 1, MAX_BATCH, spec0.batch_size,
                            key="mem_batch"))
context = int(c2.number_input("Context (tokens)", 1, block, block, key="mem_context"))
mask = c3.selectbox("Mask variant", list(MASKS), key="mem_mask", format_func=MASKS.get)
kind = c4.selectbox("Cache", ["concat", "prealloc"], key="mem_cache",
                    index=["concat", "prealloc"].index(spec0.cache_kind),
                    help="concat grows by concatenation every step (the write-up's); "
                    "prealloc is sized once.")


def _bar(rows: list[dict], bar: str) -> list[dict]:
    return [dict(r, bar=bar) for r in rows]


rows = _bar(costs.breakdown_formula(cfg, dtype, batch, context, mask, choice.device), "formula")
measured = None
if job is not None and job.finished and job.run is not None:
    p = job.params
    if (p["batch_size"], p["breakdown_context"], p["breakdown_mask"], p["breakdown_cache"]) \
            == (batch, context, mask, kind):
        measured = job.run["tables"].get("breakdown") or None
if measured:
    extra = [r for r in measured if r["component"].startswith("process")]
    keep = st.toggle("include the rest of the process (Python, torch libraries)", False,
                     key="mem_rest", disabled=not extra,
                     help="On a CPU the measured bar ends with resident memory no row explains.")
    shown = [r for r in measured if keep or r not in extra]
    rows = _bar(shown, "measured") + rows
st.plotly_chart(breakdown_figure(pd.DataFrame(rows)), width="stretch")
if job is not None and job.run is not None:
    ws = job.run["meta"].get("cublas_workspace_bytes")
    st.caption("cuBLAS workspace: none on a CPU." if ws is None else
               f"cuBLAS workspace measured on this GPU: {ws:,} B. It depends on the "
               "architecture: the write-up saw 8,519,680 B on an A40 (Ampere); Hopper GPUs "
               "(H100, H200) allocate 32 MiB by default.")
st.caption(f"Batch {batch} × {context} tokens in {dtype}. Hover a segment for its size and "
           "source. At batch 1 the weights dwarf the cache; raise the batch and the cache takes "
           "over." + (" The measured bar comes from the last measurement below." if measured
                      else ""))

# ----------------------------------------------------------------------------- Figure 6
st.subheader("The KV cache, three ways")
with st.expander("What to measure", expanded=job is None):
    m1, m2 = st.columns(2)
    preset = m1.text_input("Context lengths", ", ".join(map(str, spec0.contexts)),
                           key="mem_points",
        help=f"Whole numbers 1..{block} or ranges like 64-{block}:64, separated by commas.")
    fill = m2.radio("Fill", ["prefill", "decode"], horizontal=True, key="mem_fill",
                    index=["prefill", "decode"].index(spec0.fill),
                    help="prefill: a fresh cache per point; decode: one generation passing "
                    "every point (the write-up's way; slower).")
    measure_clicked = st.button("Measure memory", type="primary", disabled=busy, icon=RUN_ICON)


if measure_clicked:
    try:
        params = MemoryParams(parse_contexts(preset, block), batch, kind, fill,
                              breakdown_context=context, breakdown_mask=mask,
                              breakdown_cache=kind)
        params.check(cfg, choice.device)
    except ValueError as exc:
        st.error(str(exc))
        st.stop()
    job = jobs.start(KEY, "memory", to_dict(params),
                     f"memory, {choice.model}, {len(params.contexts)} contexts")
    busy = True

if job is not None:
    b1, b2 = st.columns([2, 1])
    baseline = b1.radio("Baseline", MEMORY_BASELINES, horizontal=True, key="mem_baseline",
                        help="before warm-up: taken before the first matmul, as in the "
                        "write-up's first attempt; a lazily allocated workspace then shows "
                        "as a constant offset.")
    log_y = b2.toggle("log y", False, key="mem_logy")


def _draw(j: Job) -> None:
    df = jobs.rows(j, "kv_memory")
    st.plotly_chart(kv_memory_figure(df, baseline, log_y), width="stretch")
    gqa = (f" The dotted line is the same cache with one K/V head per query head "
           f"({cfg.n_head} instead of {cfg.n_kv_head}): what grouped-query attention saves."
           if cfg.n_kv_head < cfg.n_head else "")
    st.caption("Figure 6: the formula (dashed) against the bytes the cache tensors hold "
               "(filled) and what the allocator or the process gained (hollow)." + gqa
               + " The measuring "
               "process may have run other experiments first, so \"before warm-up\" is before "
               "this measurement's warm-up, not before the process's first matmul.")
    if j.finished and not df.empty:
        with st.expander("Raw rows"):
            st.dataframe(df, hide_index=True)


jobs.section(KEY, _draw, table="kv_memory", stem="memory",
             empty="Choose context lengths and press **Measure memory**.")

# ----------------------------------------------------------------------------- crossover
st.subheader("When the cache outgrows the weights")
contexts = sorted({2**k for k in range(4, 20) if 2**k <= block} | {block})
grid = pd.DataFrame(costs.crossover_grid(cfg, dtype, list(CROSSOVER_BATCHES), contexts))
st.plotly_chart(crossover_figure(grid), width="stretch")
cross = costs.kv_overtakes_weights_tokens(cfg, dtype)
st.caption(f"KV cache ÷ weights for each batch × context (formula). Right of the black line the "
           f"cache is the bigger of the two: from about {cross:,.0f} tokens of batch × context, "
           f"i.e. {cross / block:.1f} full-length sequences.")

# ----------------------------------------------------------------------------- masks
st.subheader("The causal mask's hidden cost")
masks = pd.DataFrame([{"kind": MASKS[k], "bytes": costs.mask_bytes(cfg, k)} for k in MASKS])
st.plotly_chart(mask_figure(masks, costs.kv_bytes(cfg, dtype, 1, block)), width="stretch")
st.caption("Bytes of stored causal masks for each variant (formula). One fp32 triangle per "
           "layer costs a sizeable fraction of a full-length cache and holds nothing a fused "
           "attention kernel needs.")
