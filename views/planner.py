"""KV memory planner: how many sequences fit, and what paging, a smaller cache dtype or fewer KV
heads would save.

Formulas (``instruments.costmodel.kv_plan``) draw at once; **Plan on this device** runs the
"planner" experiment in the measuring process (``ui.jobs``): it reads the free memory, allocates
the caches the plan predicts (and the three layouts of the drawn batch), reports what the tensors
and the allocator hold, frees them, and measures the logits error of each KV storage type against
fp32. The step time of the paged and int8 modes beside mode 5 is a latency sweep of those three.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from instruments import lineup
from instruments.costmodel import kv_plan
from instruments.experiments import to_dict
from instruments.experiments.latency import LatencyParams
from instruments.experiments.planner import PlannerParams
from instruments.process.client import Job
from ui import header, jobs
from ui.figures import latency_figure
from ui.figures_planner import (
    against_batch_figure,
    kv_heads_figure,
    storage_figure,
    waste_figure,
)
from ui.state import RUN_ICON

KEY = "planner_job"
MIB, GIB = 2**20, 2**30
SWEEP_KEY = "planner_steps_job"

choice = header.page("KV memory planner", "How many sequences fit on this device, and what "
                     "paged blocks, a smaller KV dtype or fewer KV heads would save: formulas "
                     "at once, then the same caches allocated for real in the measuring process.")
cfg = header.model(choice)
block, dtype = cfg.block_size, choice.dtype
c1, c2, c3, c4 = st.columns(4)
dist = c1.selectbox("Lengths", kv_plan.DISTRIBUTIONS, key="plan_dist",
                    help="The final lengths of the batch's sequences: long-tailed (log-normal, "
                    "most short, a few long), uniform (1 to twice the mean) or all the same.")
n_seq = int(c2.number_input("Sequences", 1, 4096, 32, key="plan_n"))
mean_len = int(c3.number_input("Mean length (tokens)", 1, block, max(1, block // 4),
                               key="plan_mean"))
block_tokens = int(c4.number_input("Paged block (tokens)", 1, block, min(16, block),
                                   key="plan_bt"))
cap_mib = int(st.number_input(
    "Largest allocation (MiB, 0 = automatic)", 0, 2**20, 0, step=256, key="plan_cap",
    help="The most one measured allocation may take. Automatic: 2,048 MiB on a CPU (so the "
    "machine keeps working), the plan's whole budget on a GPU. A bigger cache is reported as "
    "capped: allocated at the batch that fits under this limit."))
clicked = st.button("Plan on this device", type="primary", disabled=jobs.running(KEY),
                    icon=RUN_ICON, help="Reads the free memory, allocates the predicted caches, "
                    "frees them, and measures each KV storage type's logits error.")
if clicked:
    params = PlannerParams(dist, n_seq, mean_len, block_tokens, max_alloc_mib=cap_mib or None)
    try:
        params.check(cfg, choice.device)
    except ValueError as exc:
        st.error(str(exc))
        st.stop()
    jobs.start(KEY, "planner", to_dict(params), f"KV planner, {choice.model}")

job = jobs.get(KEY)
run = job.run if job is not None and job.finished else None
meta = (run or {}).get("meta") or {}
budget = meta.get("budget_bytes")
# the measured layouts belong to the batch the run drew: shown only while the inputs still match
same = run is not None and (meta.get("distribution"), meta.get("sequences"), meta.get("mean_len"),
                            meta.get("block_tokens")) == (dist, n_seq, mean_len, block_tokens)
lengths = kv_plan.draw_lengths(dist, n_seq, mean_len, block)
bpt = kv_plan.kv_bytes_per_token(cfg, dtype)


def _draw(j: Job) -> None:
    fit = jobs.rows(j, "fit")
    if fit.empty:
        return
    m = (j.run or {}).get("meta") or {}
    free, b = m.get("free_bytes"), m.get("budget_bytes")
    top = fit.iloc[-1]
    if free is not None and b is not None:
        st.info(f"{free / GIB:,.1f} GiB free with the weights loaded; the plan may use "
                f"{b / GIB:,.1f} GiB (90%, less one full-length prefill's activations). At "
                f"{int(top['context_len']):,} tokens **{int(top['formula_batch']):,} sequences "
                "fit** by formula.", icon=":material/memory:")
    shown = fit.assign(**{
        "formula MiB": fit["formula_bytes"] / MIB,
        "tensors MiB": fit.get("tensor_bytes", pd.Series(dtype=float)) / MIB,
        "tensors = formula": fit.get("tensor_bytes") == fit["formula_bytes"]
        if "tensor_bytes" in fit else None,
        "allocator gained MiB": fit.get("allocated_delta_bytes", pd.Series(dtype=float)) / MIB,
        "process gained MiB": fit.get("rss_delta_bytes", pd.Series(dtype=float)) / MIB})
    cols = ["context_len", "formula_batch", "allocated_batch", "capped", "formula MiB",
            "tensors MiB", "tensors = formula", "allocator gained MiB", "process gained MiB"]
    st.dataframe(shown[[c for c in cols if c in shown]].round(1), hide_index=True)
    st.caption("Each row allocated a preallocated cache of *allocated_batch* sequences at that "
               "context in the measuring process, read what it holds, then freed it. *capped*: "
               "the formula's batch was more than one allocation may take here.")


st.subheader("What fits on this device")
jobs.section(KEY, _draw, table="fit", stem="kv_planner",
             empty="Press **Plan on this device** to read the free memory and allocate the "
             "caches the formulas predict.")

# ------------------------------------------------------------------------------ layouts
st.subheader("A mixed-length batch, held three ways")
many = kv_plan.draw_lengths(dist, max(n_seq, 4096), mean_len, block)
batches = sorted({2**k for k in range(13)} | {n_seq})
held = cfg.cache_rows(block)  # the rows a cache holds for the limit: a sliding window's fewer
curve = pd.DataFrame(kv_plan.memory_against_batch(kv_plan.held(cfg, many), held, block_tokens,
                                                  bpt, batches))
rows = pd.DataFrame(kv_plan.layouts(kv_plan.held(cfg, lengths), held, block_tokens, bpt, budget))
measured = jobs.rows(job, "layouts") if same and job is not None else None
st.plotly_chart(against_batch_figure(curve, budget, measured), width="stretch")
st.plotly_chart(waste_figure(rows), width="stretch")
paged, cont = rows.set_index("layout").loc["paged"], rows.set_index("layout").loc["contiguous"]
st.caption(
    f"{n_seq} sequences, {dist} lengths averaging {sum(lengths) / n_seq:,.0f} tokens "
    f"(longest {max(lengths):,}), in {dtype} ({bpt:,} B per token). Sized for the model's "
    f"{block:,}-token limit they reserve {cont['reserved_bytes'] / MIB:,.0f} MiB and waste "
    f"{cont['waste_share']:.0%}; in {block_tokens}-token blocks, "
    f"{paged['reserved_bytes'] / MIB:,.1f} MiB and {paged['waste_share']:.0%}."
    + (f" On this device that is {int(cont['fits_sequences']):,} against "
       f"{int(paged['fits_sequences']):,} such sequences." if budget else
       " Plan on this device to draw its budget line.")
    + (" Hollow circles: the layouts allocated for real (tensor bytes)." if measured is not None
       else ""))
if held < block:
    st.caption(f"A sliding window of {held:,} tokens: attention sees only the last {held:,}, so "
               f"every cache holds at most {held:,} rows per layer (a ring) and memory stays "
               "flat past the window: a sequence of l tokens reserves min(l, window).")
if measured is not None and not measured.empty:
    with st.expander("Measured layouts"):
        st.dataframe(measured, hide_index=True)

# ------------------------------------------------------------------------------ storage
st.subheader("A smaller KV dtype")
storages = jobs.rows(job, "storages") if run is not None else pd.DataFrame(
    kv_plan.storage_rows(cfg, dtype, budget))
st.plotly_chart(storage_figure(storages), width="stretch")
if "rel_error" in storages:
    st.dataframe(storages, hide_index=True)
    st.caption("Errors: the largest |Δ logit| over a 128-token prefill and 64 decode steps fed "
               "the same random tokens, as a share of the largest fp32 logit; top1_agree is the "
               "share of positions whose most likely next token is unchanged. int8 stores one "
               "scale per token and head beside the values.")
else:
    st.caption("Bytes per token by formula; Plan on this device to measure each type's logits "
               "error against fp32 on the loaded model.")

# ------------------------------------------------------------------------------ kv heads
st.subheader("How many K/V heads the cache holds")
heads = pd.DataFrame(kv_plan.kv_head_rows(cfg, dtype, budget))
if budget:
    st.plotly_chart(kv_heads_figure(heads), width="stretch")
st.dataframe(heads, hide_index=True)
own = (f"one K/V head per query head ({cfg.n_head})" if cfg.n_kv_head == cfg.n_head else
       f"{cfg.n_kv_head} K/V heads for its {cfg.n_head} query heads (grouped-query attention: "
       f"each K/V head serves {cfg.n_head // cfg.n_kv_head} query heads)")
st.caption(f"This model caches {own}. Grouped-query and multi-query attention share each K/V "
           "head among several query heads; the rows not marked as this model's are formulas "
           "only: a what-if this model cannot run.")

# ------------------------------------------------------------------------------ step time
st.subheader("What paging and int8 cost per step")
usable = lineup.with_role("planner_step", choice.device, choice.family)
steps_clicked = st.button(f"Time modes {', '.join(str(lineup.spec(m).rung) for m in usable)}",
                          disabled=jobs.running(SWEEP_KEY), icon=RUN_ICON,
                          help="A latency sweep of these modes alone (the Latency sweep page's "
                          "experiment, at 8 log-spaced contexts), each passing the gate first.")
if steps_clicked:
    contexts = sorted({round(8 * (block / 8) ** (i / 7)) for i in range(8)} | {block})
    sweep = LatencyParams([t for t in contexts if t <= block], usable, measure_peaks=False)
    jobs.start(SWEEP_KEY, "latency", to_dict(sweep), f"paged / int8 step time, {choice.model}")


def _steps(j: Job) -> None:
    df = jobs.rows(j, "latency")
    st.plotly_chart(latency_figure(df, log_x=True), width="stretch")
    if df.empty or not j.finished:
        return
    last = df[df["context_len"] == df["context_len"].max()].set_index("mode")["latency_ms"]
    base = lineup.with_role("reference_cached")[0]
    if base in last:
        ratios = ", ".join(f"mode {lineup.spec(m).rung} {last[m] / last[base]:.2f}×"
                           for m in last.index if m != base)
        st.caption(f"At {int(df['context_len'].max()):,} tokens, against mode "
                   f"{lineup.spec(base).rung}: {ratios}. The "
                   "paged mode gathers its blocks into one tensor every step and the int8 mode "
                   "dequantizes its whole cache every step; mode 5 reads its cache in place.")


jobs.section(SWEEP_KEY, _steps, table="latency", stem="planner_steps",
             empty="Press the button to time the paged and int8 modes beside mode 5.")
