"""Floor lab: where a decode step's time goes, on this device, and how far it is from the floor.

Four experiments, each a background ``ui.live.Job`` (device lock, progress, Stop keeps what was
measured, saved to results/): step attribution (``engine.attribution``), the matmul staircase
(``engine.staircase``), scope as batch and model grow (``engine.scope``) and precision.
The page only turns inputs into engine calls and rows into ``ui.floor_figures`` figures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd
import streamlit as st

from engine import PRESETS
from engine.attribution import Peaks, attribution_sweep
from engine.results import ResultsError
from engine.scope import batch_sweep, model_size_sweep, precision_compare, precisions_for
from engine.staircase import default_ts, run_staircase
from engine.sweep import parse_contexts
from ui.device import get_bench
from ui.floor_figures import (
    attribution_figure,
    attribution_table,
    counts_figure,
    precision_figure,
    precision_table,
    scope_figure,
    scope_table,
    shapes_figure,
    staircase_figure,
)
from ui.live import Job, finished_banner, live_panel, running_job, start_job
from ui.runs import download_buttons, latency_frame, pick_sweep_run, save_measurement
from ui.state import CPU_NOTE, current_choice, get_model, is_cpu, mode_choices, mode_label

st.title("Floor lab")
st.caption("A cached decode step takes the same time at every context length. Is that time "
           "arithmetic, memory traffic or overhead? Profile it, set it against the floors "
           "measured on this device, and see how the picture changes with shape, batch, model "
           "size and precision.")
choice = current_choice()
model = get_model()
if model is None:
    st.stop()
cpu = is_cpu(choice)
if cpu:
    st.info(CPU_NOTE, icon=":material/memory:")
block = model.config.block_size
usable, unavailable = mode_choices(model)


def _peaks() -> Peaks | None:
    """The overview page's measured peaks, when this session has them (else measured in-job)."""
    bench = get_bench(choice.device, choice.dtype)
    if not bench:
        return None
    return Peaks(choice.device, choice.dtype, bench["matmul_tflops"], bench["read_gbps"],
                 bench["bytes"])


def _launch(key: str, kind: str, what: str, total: int, params: dict[str, Any],
            work: Callable[[Job], None]) -> None:
    def finish(job: Job) -> None:
        tables = {name: rows for name, rows in job.results.get("tables", {}).items() if rows}
        if not tables:
            return
        try:
            run, path = save_measurement(kind, choice.model, model, job.device, tables,
                                         partial=job.partial, note=job.error or "", **params)
        except ResultsError as exc:
            job.save_error = str(exc)
            return
        job.results["run"], job.saved_path = run, str(path)

    job = Job(kind, what, choice.device, params=params, total=total)
    st.session_state[key] = start_job(job, work, finish)


def _progress(job: Job, offset: int = 0) -> Callable[[int, int, str], None]:
    def update(done: int, total: int, message: str) -> None:
        job.update(done=offset + done, message=message)
    return update


def _show(key: str, draw: Callable[[Job], None], table: str, empty: str) -> None:
    """Live panel while running; banner, figures and downloads once finished."""
    job: Job | None = st.session_state.get(key)
    if job is None:
        st.info(empty)
    elif running_job(key) is not None:
        live_panel(key, draw)
    else:
        finished_banner(job)
        draw(job)
        download_buttons(job.results.get("run"), table, kind_stem(key), f"{key}_dl")


def kind_stem(key: str) -> str:
    return key.removesuffix("_job")


def _contexts(text: str) -> list[int] | None:
    try:
        return parse_contexts(text, block)
    except ValueError as exc:
        st.error(str(exc))
        return None


tab_attr, tab_stair, tab_scope, tab_prec = st.tabs(
    ["Step attribution", "Staircase", "Scope: batch and model size", "Precision"])

# ------------------------------------------------------------------------- step attribution
with tab_attr:
    KEY_A = "floor_attr_job"
    st.markdown("Profile decode steps with `torch.profiler`: operator calls and kernel "
                "launches per step, time inside operators (CPU) or kernels (GPU), and the "
                "rest; next to the floors **bytes ÷ measured bandwidth** and **FLOPs ÷ measured "
                "peak**.")
    want = ["concat", "prealloc_fused", "fast", "cuda_graph"]
    a1, a2, a3 = st.columns([2, 2, 1])
    modes = a1.multiselect("Decode modes", usable, [m for m in want if m in usable],
                           key="floor_attr_modes", format_func=mode_label,
                           help="⏳: compiles first (minutes on a CPU).")
    ctx0 = sorted({t for t in (16, 64, 256, 512) if t < block - 16} | {block - 16})
    text = a2.text_input("Context lengths", ", ".join(map(str, ctx0)), key="floor_attr_ctx",
                         help=f"Comma-separated or ranges like 16-{block - 16}:128.")
    steps = int(a3.number_input("Steps per point", 2, 50, 8, key="floor_attr_steps"))
    if unavailable:
        a1.caption("Not here: " + "; ".join(f"{m} ({why})" for m, why in unavailable.items()))
    if st.button("Profile", type="primary", icon=":material/play_arrow:", key="floor_attr_go",
                 disabled=running_job(KEY_A) is not None or not modes):
        contexts = _contexts(text)
        if contexts:
            peaks0 = _peaks()

            def work_attr(job: Job, modes: list[str] = modes, contexts: list[int] = contexts,
                          steps: int = steps, peaks: Peaks | None = peaks0) -> None:
                job.results["tables"] = {"attribution": job.rows}
                for i, mode in enumerate(modes):
                    res = attribution_sweep(model, mode, contexts, steps=steps, peaks=peaks,
                                            on_progress=_progress(job, i * (len(contexts) + 1)),
                                            should_stop=job.should_stop,
                                            on_row=lambda r: job.update(row=r))
                    peaks = res.peaks
                    job.results.setdefault("notes", []).extend(res.notes)
                    job.results["peaks"] = peaks.to_dict()
                    if res.cancelled:
                        break

            _launch(KEY_A, "attribution", f"step attribution, {choice.model}",
                    len(modes) * (len(contexts) + 1),
                    {"modes": modes, "contexts": contexts, "steps": steps}, work_attr)

    def draw_attr(job: Job) -> None:
        df = pd.DataFrame(list(job.rows))
        for note in job.results.get("notes", []):
            st.warning(note)
        if df.empty:
            return
        for mode in df["mode"].drop_duplicates():
            st.plotly_chart(attribution_figure(df, str(mode)), width="stretch")
        st.caption("Bars add up to the measured step. Green: the part of the busy time the "
                   "floor accounts for; orange: busy beyond it; red: time nothing was busy. "
                   "If the black line tracks the dashed bytes floor, the step is bound by "
                   "reading the weights; if red dominates and stays flat with context, it is "
                   "overhead — the write-up's suspect.")
        st.plotly_chart(counts_figure(df), width="stretch")
        st.caption("Operators per step grow with the layers, not with context; CUDA graphs "
                   "and compilation cut the launches.")
        peaks = job.results.get("peaks")
        if peaks:
            st.caption(f"Measured here: {peaks['tflops']:.2f} TFLOP/s matmul, "
                       f"{peaks['gbps']:.1f} GB/s read. ± is the stated error of the profiled "
                       "split (profiler cost + timing spread).")
        st.dataframe(attribution_table(df), hide_index=True)

    _show(KEY_A, draw_attr, "attribution", "Pick modes and contexts, then **Profile**.")

# ------------------------------------------------------------------------------- staircase
with tab_stair:
    KEY_S = "floor_stair_job"
    st.markdown("The uncached curve has jumps its FLOP formula cannot make. Time each "
                "Linear matmul of the uncached step alone at every T, add them up, and lay "
                "the sum over the measured uncached step: do the jumps line up?")
    s1, s2, s3 = st.columns([2, 1, 1])
    default = default_ts(block, choice.device)
    stext = s1.text_input("T values", f"1-{block}:{1 if not cpu else 32}", key="floor_stair_t",
                          help=f"Default: every T on a GPU, a stride of 32 on a CPU "
                          f"({len(default)} points).")
    repeats = int(s2.number_input("Repeats", 1, 10, 3, key="floor_stair_rep"))
    forward = s3.toggle("Time the whole step too", not cpu, key="floor_stair_fwd",
                        help="Also time the full uncached forward at each T (slow on a CPU).")
    if st.button("Run staircase", type="primary", icon=":material/play_arrow:",
                 key="floor_stair_go", disabled=running_job(KEY_S) is not None):
        ts = _contexts(stext)
        if ts:
            def work_stair(job: Job, ts: list[int] = ts, repeats: int = repeats,
                           forward: bool = forward) -> None:
                res = run_staircase(model.config, model=model, ts=ts, repeats=repeats,
                                    include_forward=forward, on_progress=_progress(job),
                                    should_stop=job.should_stop,
                                    on_row=lambda r: job.update(row=r))
                job.results["tables"] = {"staircase": res.rows, "totals": res.totals}

            _launch(KEY_S, "staircase", f"matmul staircase, {choice.model}", len(ts),
                    {"ts": ts, "repeats": repeats}, work_stair)
    run = pick_sweep_run("floor_stair_sweep") if st.session_state.get(KEY_S) else None

    def draw_stair(job: Job) -> None:
        totals = pd.DataFrame(list(job.rows))
        frame = latency_frame(run) if run else pd.DataFrame()
        uncached = frame[frame["mode"] == "uncached"] if "mode" in frame else None
        st.plotly_chart(staircase_figure(totals, uncached), width="stretch")
        st.caption("Blue: the Linear matmuls alone, summed as the step runs them (n_layer × "
                   "four shapes + the output projection). Red: the whole uncached step. Jumps "
                   "in both at the same T point at the matmul library (tile sizes, kernel "
                   "switches); jumps only in red point elsewhere.")
        shapes = pd.DataFrame((job.results.get("tables") or {}).get("staircase", []))
        if not shapes.empty:
            st.plotly_chart(shapes_figure(shapes), width="stretch")
            st.caption("Each shape on its own: a staircase here is the library's, whatever "
                       "the model around it does.")

    _show(KEY_S, draw_stair, "totals", "Choose T values and press **Run staircase**.")

# ----------------------------------------------------------------------------------- scope
with tab_scope:
    KEY_C = "floor_scope_job"
    st.markdown("At batch 1 on a small model each kernel does little work, so fixed costs "
                "hide the FLOP savings. Grow the batch or the model and the measured "
                "speedup should climb toward the FLOP ratio.")
    c1, c2, c3 = st.columns(3)
    what = c1.radio("Grow", ["batch size", "model size"], key="floor_scope_what",
                    horizontal=True)
    ctx = int(c2.number_input("Context (tokens)", 8, block - 16, min(128, block - 16),
                              key="floor_scope_ctx"))
    cached_mode = c3.selectbox("Cached mode", [m for m in usable if m not in
                                                ("uncached", "uncached_last")],
                               key="floor_scope_mode", format_func=mode_label)
    if what == "batch size":
        batches = st.multiselect("Batch sizes", [1, 2, 4, 8, 16, 32, 64], [1, 2, 4, 8, 16, 32],
                                 key="floor_scope_b")
    else:
        names = st.multiselect("Models (random weights)", list(PRESETS), list(PRESETS),
                               key="floor_scope_m",
                               help="Each is built with seeded random weights on "
                               f"{choice.device}; ones that do not fit are skipped.")
    budget = st.slider("Time budget per uncached step (s)", 1, 120, 20, key="floor_scope_s")
    if st.button("Run scope", type="primary", icon=":material/play_arrow:", key="floor_scope_go",
                 disabled=running_job(KEY_C) is not None):
        def work_scope(job: Job, what: str = what, ctx: int = ctx, mode: str = cached_mode,
                       budget: int = budget) -> None:
            kw = dict(context_len=ctx, cached_mode=mode, max_seconds=float(budget),
                      on_progress=_progress(job), should_stop=job.should_stop,
                      on_row=lambda r: job.update(row=r))
            if what == "batch size":
                res = batch_sweep(model, batch_sizes=job.params["points"], **kw)
            else:
                res = model_size_sweep(job.params["points"], device=choice.device,
                                       dtype=choice.dtype, **kw)
            job.results["tables"] = {"scope": res.rows}

        points = batches if what == "batch size" else names
        _launch(KEY_C, "scope", f"scope ({what}), {choice.model}", len(points),
                {"points": points, "grow": what, "context_len": ctx}, work_scope)

    def draw_scope(job: Job) -> None:
        df = pd.DataFrame(list(job.rows))
        if df.empty:
            return
        x = "batch_size" if job.params["grow"] == "batch size" else "model"
        st.plotly_chart(scope_figure(df, x), width="stretch")
        st.caption("Solid: how many times faster the cached step is than re-running the "
                   "whole sequence. Dashed: how many times fewer FLOPs it does. The gap "
                   "narrows as each launch carries more work.")
        st.dataframe(scope_table(df), hide_index=True)

    _show(KEY_C, draw_scope, "scope", "Choose what to grow and press **Run scope**.")

# ------------------------------------------------------------------------------- precision
with tab_prec:
    KEY_P = "floor_prec_job"
    st.markdown("Lower precision halves the bytes a step streams. What does it do to time, "
                "memory and the answers? Lower precisions are compared with fp32 on the same "
                "tokens: top-1 agreement and the largest logit difference, not exact equality.")
    offered = precisions_for(choice.device)
    p1, p2 = st.columns([2, 1])
    precs = p1.multiselect("Precisions", offered, offered, key="floor_prec_list",
                           help="TF32 and fp16 are offered on CUDA GPUs only.")
    n_new = int(p2.number_input("Tokens compared", 4, max(4, block // 4), 32,
                                key="floor_prec_n"))
    if st.button("Compare", type="primary", icon=":material/play_arrow:", key="floor_prec_go",
                 disabled=running_job(KEY_P) is not None or not precs):
        def work_prec(job: Job, precs: list[str] = precs, n_new: int = n_new) -> None:
            res = precision_compare(model, precs, new_tokens=n_new,
                                    prompt_len=min(32, block - n_new - 16),
                                    on_progress=_progress(job), should_stop=job.should_stop,
                                    on_row=lambda r: job.update(row=r))
            job.results["tables"] = {"precision": res.rows}

        _launch(KEY_P, "precision", f"precision comparison, {choice.model}", len(precs),
                {"precisions": precs}, work_prec)

    def draw_prec(job: Job) -> None:
        df = pd.DataFrame(list(job.rows))
        if df.empty:
            return
        st.plotly_chart(precision_figure(df), width="stretch")
        st.dataframe(precision_table(df), hide_index=True)
        st.caption("Random weights make near-ties common, so greedy streams can part early "
                   "even when the logits agree closely; pretrained weights show the real "
                   "agreement.")

    _show(KEY_P, draw_prec, "precision", "Choose precisions and press **Compare**.")
