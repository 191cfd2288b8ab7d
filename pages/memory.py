"""Memory: where the bytes go, the KV cache measured three ways, and when it outgrows the weights.

Formulas (``engine.costs``, ``engine.memory.crossover_grid``, ``memory_breakdown(measure=False)``)
draw at once; measurements (``measure_kv_memory`` for both baselines, ``memory_breakdown``) run
as a background ``ui.live.Job`` holding the device, stoppable, saved to results/ as kind
"memory". Figures from ``ui.figures_memory``; the baseline toggle only redraws.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from engine import costs
from engine.memory import crossover_grid, measure_kv_memory, memory_breakdown
from engine.results import ResultsError
from engine.sweep import parse_contexts, preset_contexts
from ui.figures_memory import breakdown_figure, crossover_figure, kv_memory_figure, mask_figure
from ui.live import Job, finished_banner, live_panel, running_job, start_job
from ui.runs import download_buttons, save_measurement
from ui.state import CPU_NOTE, RUN_ICON, current_choice, get_model, is_cpu

KEY = "memory_job"
BASELINES = ("after warm-up", "before warm-up")
MASKS = {"seed": "one fp32 mask per layer (the write-up's)", "shared_bool": "one shared bool mask",
         "none": "no stored mask (fused attention)"}

st.title("Memory")
st.caption("What a generation holds in memory: the weights, the KV cache, the causal masks and "
           "the workspaces, by formula and as measured on this device.")
choice = current_choice()
model = get_model()
if model is None:
    st.stop()
cfg, dtype, block = model.config, choice.dtype, model.config.block_size
cpu = is_cpu(choice)
if cpu:
    st.info(CPU_NOTE + " On a CPU torch keeps no allocator counters: measured memory is the "
            "process's resident set size.", icon=":material/memory:")
job: Job | None = st.session_state.get(KEY)
busy = running_job(KEY) is not None

# ----------------------------------------------------------------------------- breakdown
st.subheader("Where the bytes go")
c1, c2, c3, c4 = st.columns(4)
batch = int(c1.number_input("Batch size", 1, 256, 1, key="mem_batch"))
context = int(c2.number_input("Context (tokens)", 1, block, block, key="mem_context"))
mask = c3.selectbox("Mask variant", list(MASKS), key="mem_mask", format_func=MASKS.get)
kind = c4.selectbox("Cache", ["concat", "prealloc"], key="mem_cache",
                    help="concat grows by concatenation every step (the write-up's); "
                    "prealloc is sized once.")


def _bar(rows: list[dict], bar: str) -> list[dict]:
    return [dict(r, bar=bar) for r in rows]


rows = _bar(memory_breakdown(model, batch, context, kind, measure=False, mask=mask), "formula")
measured = job.results.get("breakdown") if job is not None and job.finished else None
if measured and (measured["batch"], measured["context"], measured["mask"]) == (batch, context,
                                                                              mask):
    extra = [r for r in measured["rows"] if r["component"].startswith("process")]
    keep = st.toggle("include the rest of the process (Python, torch libraries)", False,
                     key="mem_rest", disabled=not extra,
                     help="On a CPU the measured bar ends with resident memory no row explains.")
    shown = [r for r in measured["rows"] if keep or r not in extra]
    rows = _bar(shown, "measured") + rows
st.plotly_chart(breakdown_figure(pd.DataFrame(rows)), width="stretch")
st.caption(f"Batch {batch} × {context} tokens in {dtype}. Hover a segment for its size and "
           "source. At batch 1 the weights dwarf the cache; raise the batch and the cache takes "
           "over." + (" The measured bar comes from the last measurement below." if measured
                      else ""))

# ----------------------------------------------------------------------------- Figure 6
st.subheader("The KV cache, three ways")
with st.expander("What to measure", expanded=job is None):
    m1, m2 = st.columns(2)
    preset = m1.text_input("Context lengths", ", ".join(map(str, preset_contexts(
        "log-spaced (16)", block))), key="mem_points",
        help=f"Whole numbers 1..{block} or ranges like 64-{block}:64, separated by commas.")
    fill = m2.radio("Fill", ["prefill", "decode"], horizontal=True, key="mem_fill",
                    help="prefill: a fresh cache per point; decode: one generation passing "
                    "every point (the write-up's way; slower).")
    measure_clicked = st.button("Measure memory", type="primary", disabled=busy, icon=RUN_ICON)


def _work(j: Job) -> None:
    pts, kind_, fill_ = j.params["points"], j.params["kind"], j.params["fill"]
    j.total = len(pts) * len(BASELINES) + 1  # one row per point and baseline, + breakdown
    for base in reversed(BASELINES):  # "before warm-up" first, while the process is cold
        chunks = [pts] if fill_ == "decode" else [[t] for t in pts]
        for chunk in chunks:
            if j.should_stop():
                return
            for r in measure_kv_memory(model, chunk, j.params["batch"], kind_,
                                       warmup_first=base == BASELINES[0], fill=fill_):
                j.update(done=j.done + 1, row=r, message=f"{base}: {r['context_len']} tokens")
    if not j.should_stop():
        b, t, m = j.params["breakdown"]
        j.results["breakdown"] = {"batch": b, "context": t, "mask": m, "rows": memory_breakdown(
            model, b, t, kind_, measure=True, mask=m)}
        j.update(done=j.total, message="breakdown measured")


def _finish(j: Job) -> None:
    if not j.rows:
        return
    tables = {"kv_memory": j.rows,  # table names as the CLI's (engine.experiments) memory runs
              "breakdown": (j.results.get("breakdown") or {}).get("rows", [])}
    try:
        run, path = save_measurement("memory", j.params["model_name"], model, j.device, tables,
                                     partial=j.partial, batch_size=j.params["batch"])
    except ResultsError as exc:
        j.save_error = str(exc)
        return
    j.results["run"], j.saved_path = run, str(path)


if measure_clicked:
    try:
        points = parse_contexts(preset, block)
    except ValueError as exc:
        st.error(str(exc))
        st.stop()
    job = Job("memory", f"memory, {choice.model}, {len(points)} contexts", choice.device,
              params={"points": points, "batch": batch, "kind": kind, "fill": fill,
                      "breakdown": (batch, context, mask), "model_name": choice.model,
                      "sizes": f"batch {batch} × context up to {max(points)}"})
    st.session_state[KEY] = start_job(job, _work, _finish)
    busy = True

if job is not None:
    b1, b2 = st.columns([2, 1])
    baseline = b1.radio("Baseline", BASELINES, horizontal=True, key="mem_baseline",
                        help="before warm-up: taken before the first matmul, as in the "
                        "write-up's first attempt; a lazily allocated workspace then shows "
                        "as a constant offset.")
    log_y = b2.toggle("log y", False, key="mem_logy")

    def _draw(j: Job) -> None:
        st.plotly_chart(kv_memory_figure(pd.DataFrame(list(j.rows)), baseline, log_y),
                        width="stretch")
        st.caption("Figure 6: the formula (dashed) against the bytes the cache tensors hold "
                   "(filled) and what the allocator or the process gained (hollow). Tensor "
                   "bytes sit on the formula; allocator readings add blocks and offsets.")

    if busy:
        live_panel(KEY, _draw)
    else:
        finished_banner(job)
        _draw(job)
        with st.expander("Raw rows"):
            st.dataframe(pd.DataFrame(job.rows), hide_index=True)
        download_buttons(job.results.get("run"), "kv_memory", "memory", "mem_dl")

# ----------------------------------------------------------------------------- crossover
st.subheader("When the cache outgrows the weights")
contexts = sorted({2**k for k in range(4, 20) if 2**k <= block} | {block})
grid = pd.DataFrame(crossover_grid(cfg, dtype, [1, 2, 4, 8, 16, 32, 64, 128], contexts))
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
