"""Floor lab: where a decode step's time goes, on this device, and how far it is from the floor.

Experiments, each a job in the measuring process (``ui.jobs``: queued, Stop keeps what was
measured, saved to results/): step attribution, the predicted step, the matmul staircase, scope
as batch and model grow, precision, and speculative decoding against the multi-token verify
curve. The page only turns inputs into params and rows into ``ui.floor_figures`` /
``ui.figures_speculate`` figures.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from instruments import lineup
from instruments.costmodel import predict
from instruments.experiments.attribution import AttributionParams
from instruments.experiments.inputs import parse_contexts
from instruments.experiments.precision import PrecisionParams, precisions_for
from instruments.experiments.prediction import PredictionParams
from instruments.experiments.scope import ScopeParams
from instruments.experiments.speculate import KS, SpeculateParams, appends
from instruments.experiments.staircase import StaircaseParams
from instruments.process.client import Job
from ui import figures_speculate as fs
from ui import header, jobs, predicted
from ui.floor_figures import (
    attribution_figure,
    attribution_table,
    counts_figure,
    explained_sentence,
    precision_figure,
    precision_table,
    scope_figure,
    scope_table,
    shapes_figure,
    staircase_figure,
)
from ui.runs import latency_frame, pick_sweep_run
from ui.state import available_dtypes, is_cpu, mode_choices, mode_label

choice = header.page("Floor lab", "Where does a decode step's time go: arithmetic, memory "
                     "traffic, or neither? Profile it, set it against the floors measured on "
                     "this device, and see how the picture changes with context, batch, model "
                     "size and precision.")
cfg = header.model(choice)
cpu = is_cpu(choice)
block = cfg.block_size
usable, unavailable = mode_choices(choice.device, cfg.family)


def _start(key: str, experiment: str, params: object, what: str) -> None:
    jobs.start_checked(key, experiment, params, what, cfg, choice.device)


def _contexts(text: str, name: str = "context length") -> list[int] | None:
    try:
        return parse_contexts(text, block, name)
    except ValueError as exc:
        st.error(str(exc))
        return None


tab_attr, tab_pred, tab_stair, tab_scope, tab_prec, tab_spec = st.tabs(
    ["Step attribution", "Predicted step", "Staircase", "Scope: batch and model size",
     "Precision", "Speculative decoding"])

# ------------------------------------------------------------------------- step attribution
with tab_attr:
    KEY_A = "floor_attr_job"
    st.markdown("Profile decode steps with `torch.profiler`: operator calls and kernel "
                "launches per step, time inside operators (CPU) or kernels (GPU), and the "
                "rest; next to the floors **bytes ÷ measured bandwidth** and **FLOPs ÷ measured "
                "peak**.")
    want = AttributionParams.defaults(choice.device, cfg).modes
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
                 disabled=jobs.running(KEY_A) or not modes):
        contexts = _contexts(text)
        if contexts:
            _start(KEY_A, "attribution", AttributionParams(modes, contexts, steps),
                   f"step attribution, {choice.model}")

    def draw_attr(job: Job) -> None:
        df = jobs.rows(job, "attribution")
        if df.empty:
            return
        for mode in df["mode"].drop_duplicates():
            st.plotly_chart(attribution_figure(df, str(mode)), width="stretch")
            st.markdown(explained_sentence(df, str(mode)))
        st.caption("Bars add up to the measured step (black, with the interquartile range of "
                   "its timed samples). Green: the part of the busy time the floor accounts "
                   "for; red: time nothing was busy (host gaps); orange: busy time above the "
                   "floor, which neither the floor nor the host time explains.")
        st.plotly_chart(counts_figure(df), width="stretch")
        st.caption("ATen operator calls (and, on a GPU, kernel launches) per decode step, as "
                   "the profiler counted them.")
        peaks = ((job.run or {}).get("meta") or {}).get("peaks", {}).get("measured")
        if peaks:
            st.caption(f"Floors from the peaks measured with this run: "
                       f"{peaks['matmul_tflops']:.2f} TFLOP/s matmul, {peaks['read_gbps']:.1f} "
                       "GB/s read.")
        st.dataframe(attribution_table(df), hide_index=True)

    jobs.section(KEY_A, draw_attr, table="attribution", stem="attribution",
                 empty="Pick modes and contexts, then **Profile**.")

# ---------------------------------------------------------------------------- predicted step
with tab_pred:
    KEY_PR = "floor_pred_job"
    st.markdown("Time each part of a step alone on this device -- the Linear matmuls at the "
                "rows a mode multiplies, attention and the KV cache at each context, the small "
                "operators, and the same step on a *hollow* model (the same layers with widths "
                "of 4: only dispatch and Python left) -- then add them up and set the sum "
                "against the measured step. The residual is what the parts do not explain.")
    defaults = PredictionParams.defaults(choice.device, cfg)
    predictable = predict.predictable(usable)
    r1, r2, r3 = st.columns([3, 2, 1])
    pmodes = r1.multiselect("Decode modes", predictable,
                            [m for m in defaults.modes if m in predictable],
                            key="floor_pred_modes", format_func=mode_label,
                            help="Compiled modes (6, 7, 9) are not predicted: they fuse the "
                            "operators this model adds up.")
    ptext = r2.text_input("Context lengths", ", ".join(map(str, defaults.contexts)),
                          key="floor_pred_ctx", help=f"Comma-separated or ranges like "
                          f"8-{block}:64.")
    prep = int(r3.number_input("Samples per point", 2, 20, defaults.repeats,
                               key="floor_pred_rep"))
    recal = st.toggle("Calibrate again", False, key="floor_pred_recal",
                      help="The calibration is kept in the measuring process and reused.")
    if st.button("Predict and measure", type="primary", icon=":material/play_arrow:",
                 key="floor_pred_go", disabled=jobs.running(KEY_PR) or not pmodes):
        contexts = _contexts(ptext)
        if contexts:
            _start(KEY_PR, "prediction", PredictionParams(pmodes, contexts, repeats=prep,
                                                          recalibrate=recal),
                   f"step prediction, {choice.model}")
    jobs.section(KEY_PR, predicted.draw, table="latency", stem="prediction",
                 empty="Pick modes and contexts, then **Predict and measure**.")

# ------------------------------------------------------------------------------- staircase
with tab_stair:
    KEY_S = "floor_stair_job"
    st.markdown("The uncached curve has jumps its FLOP formula cannot make. Time each "
                "Linear matmul of the uncached step alone at every T, add them up, and lay "
                "the sum over the measured uncached step: do the jumps line up?")
    s1, s2, s3 = st.columns([2, 1, 1])
    stext = s1.text_input("T values", f"1-{block}:{1 if not cpu else 32}", key="floor_stair_t",
                          help="Default: every T on a GPU, a stride of 32 on a CPU.")
    repeats = int(s2.number_input("Repeats", 1, 10, 3, key="floor_stair_rep"))
    forward = s3.toggle("Time the whole step too", not cpu, key="floor_stair_fwd",
                        help="Also time the full uncached forward at each T (slow on a CPU).")
    if st.button("Run staircase", type="primary", icon=":material/play_arrow:",
                 key="floor_stair_go", disabled=jobs.running(KEY_S)):
        ts = _contexts(stext, "token count")
        if ts:
            _start(KEY_S, "staircase", StaircaseParams(ts, repeats, forward),
                   f"matmul staircase, {choice.model}")
    run = pick_sweep_run("floor_stair_sweep") if jobs.get(KEY_S) else None

    def draw_stair(job: Job) -> None:
        totals = jobs.rows(job, "totals")
        frame = latency_frame(run) if run else pd.DataFrame()
        uncached = frame[frame["mode"] == "uncached"] if "mode" in frame else None
        st.plotly_chart(staircase_figure(totals, uncached), width="stretch")
        st.caption("Blue: the Linear matmuls alone, summed as the step runs them (n_layer × "
                   "four shapes + the output projection). Red: the whole uncached step. Jumps "
                   "in both at the same T point at the matmul library (tile sizes, kernel "
                   "switches); jumps only in red point elsewhere.")
        shapes = jobs.rows(job, "staircase")
        if not shapes.empty:
            st.plotly_chart(shapes_figure(shapes), width="stretch")
            st.caption("Each shape on its own: a staircase here is the library's, whatever "
                       "the model around it does.")

    jobs.section(KEY_S, draw_stair, table="totals", stem="staircase",
                 empty="Choose T values and press **Run staircase**.")

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
    cached_mode = c3.selectbox("Cached mode", [m for m in usable if m not in lineup.uncached()],
                               key="floor_scope_mode", format_func=mode_label)
    if what == "batch size":
        batches = st.multiselect("Batch sizes", [1, 2, 4, 8, 16, 32, 64], [1, 2, 4, 8, 16, 32],
                                 key="floor_scope_b")
    else:
        sizes = [m for m in lineup.models() if lineup.family_of(m).name == cfg.family]
        names = st.multiselect("Models (random weights)", sizes, sizes,
                               key="floor_scope_m",
                               help="Each is built with seeded random weights on "
                               f"{choice.device}; ones that do not fit are skipped.")
    budget = st.slider("Time budget per uncached step (s)", 1, 120, 20, key="floor_scope_s")
    if st.button("Run scope", type="primary", icon=":material/play_arrow:", key="floor_scope_go",
                 disabled=jobs.running(KEY_C)):
        grow = "batch" if what == "batch size" else "model"
        points = batches if grow == "batch" else names
        _start(KEY_C, "scope", ScopeParams(grow, list(points), ctx, cached_mode,
                                           max_seconds=float(budget)),
               f"scope ({what}), {choice.model}")

    def draw_scope(job: Job) -> None:
        df = jobs.rows(job, "scope")
        if df.empty:
            return
        x = "batch_size" if job.params["grow"] == "batch" else "model"
        st.plotly_chart(scope_figure(df, x), width="stretch")
        st.caption("Solid: how many times faster the cached step is than re-running the "
                   "whole sequence. Dashed: how many times fewer FLOPs it does.")
        st.dataframe(scope_table(df), hide_index=True)

    jobs.section(KEY_C, draw_scope, table="scope", stem="scope",
                 empty="Choose what to grow and press **Run scope**.")

# ------------------------------------------------------------------------------- precision
with tab_prec:
    KEY_P = "floor_prec_job"
    st.markdown("Lower precision halves the bytes a step streams. What does it do to time, "
                "memory and the answers? Lower precisions are compared with fp32 on the same "
                "tokens: top-1 agreement and the largest logit difference, not exact equality.")
    offered = precisions_for(choice.device, available_dtypes(choice.device))
    p1, p2 = st.columns([2, 1])
    precs = p1.multiselect("Precisions", offered, offered, key="floor_prec_list",
                           help="TF32 and fp16 are offered on CUDA GPUs only.")
    n_new = int(p2.number_input("Tokens compared", 4, max(4, block // 4), 32,
                                key="floor_prec_n"))
    if st.button("Compare", type="primary", icon=":material/play_arrow:", key="floor_prec_go",
                 disabled=jobs.running(KEY_P) or not precs):
        _start(KEY_P, "precision", PrecisionParams(list(precs), min(32, block - n_new - 16),
                                                   n_new), f"precision comparison, {choice.model}")

    def draw_prec(job: Job) -> None:
        df = jobs.rows(job, "precision")
        if df.empty:
            return
        st.plotly_chart(precision_figure(df), width="stretch")
        st.dataframe(precision_table(df), hide_index=True)
        st.caption("Random weights make near-ties common, so greedy streams can part early "
                   "even when the logits agree closely; pretrained weights show the real "
                   "agreement.")

    jobs.section(KEY_P, draw_prec, table="precision", stem="precision",
                 empty="Choose precisions and press **Compare**.")

# -------------------------------------------------------------------- speculative decoding
with tab_spec:
    KEY_V = "floor_spec_job"
    st.markdown("The other way under the read floor: make more tokens per read. One forward "
                "that appends k tokens reads the weights once, so where a step is bound by "
                "memory, k tokens cost about one. Speculative decoding drafts tokens cheaply "
                "-- here by **prompt lookup**: what followed the last few tokens where they "
                "occurred before, in the prompt or the text so far -- verifies them in one "
                "forward, keeps the longest prefix the model agrees with and rewinds the "
                "cache. The output is plain greedy decoding's, token for token.")
    label = header.weights_label(choice) or ("random" if choice.weights == "random" else "")
    if label.startswith("random"):
        st.warning("**Random weights: acceptance is trivially high.** A random model's greedy "
                   "stream repeats one token, so any draft of that token is right. For real "
                   "acceptance, load real weights: **smollm2-135m** (its real weights come "
                   "with `make`), *pretrained* GPT-2 where you have it, or the sidebar's *local "
                   "folder* `tests/fixtures/bytes_stdlib` (a byte-level model trained on "
                   "Python's standard library). The verify curve does not depend on the "
                   "weights.")
    v1, v2, v3 = st.columns([2, 1.2, 1.8])
    vmodes = [m for m in usable if appends(m)]
    sdef = SpeculateParams.defaults(choice.device, cfg)
    vmode = v1.selectbox("Decode mode", vmodes, key="floor_spec_mode", format_func=mode_label,
                         index=vmodes.index(sdef.mode) if sdef.mode in vmodes else 0,
                         help="Modes that append several tokens in one forward. Speedups are "
                         "over plain greedy decoding with the same mode.")
    vtext = v2.text_input("Contexts (tokens held)", ", ".join(map(str, sdef.contexts)),
                          key="floor_spec_ctx", help="Each plus the largest k must fit the "
                          f"model's {block} tokens.")
    vk = v3.multiselect("k", KS, KS, key="floor_spec_k",
                        help="Tokens appended in one forward; draft lengths.")
    prompt = st.text_area("Prompt (paste text to continue; empty: a Python snippet)", "",
                          key="floor_spec_prompt", height=110)
    w1, w2, w3 = st.columns(3)
    vnew = int(w1.number_input("New tokens", 2, max(2, block // 2), sdef.new_tokens,
                               key="floor_spec_new"))
    vgram = int(w2.number_input("Longest n-gram looked up", 1, 8, 3, key="floor_spec_ngram"))
    can_chat = lineup.preset(choice.model).chat
    vchat = w3.toggle("Chat template", False, key="floor_spec_chat", disabled=not can_chat,
                      help="The prompt as a user turn in the model's chat template: the drafts "
                      "meet a chat answer." if can_chat else "This model has no chat template.")
    if st.button("Measure the verify curve and speculate", type="primary",
                 icon=":material/play_arrow:", key="floor_spec_go",
                 disabled=jobs.running(KEY_V) or not vk or not vmodes):
        vctx = _contexts(vtext)
        if vctx:
            _start(KEY_V, "speculate", SpeculateParams(vctx, sorted(vk), vmode, prompt, vnew,
                                                       ngram=vgram, chat=bool(vchat)),
                   f"verify curve and speculative decoding, {choice.model}")

    def draw_spec(job: Job) -> None:
        verify, spec = jobs.rows(job, "verify"), jobs.rows(job, "speculative")
        if not verify.empty:
            st.plotly_chart(fs.verify_figure(verify), width="stretch")
            st.caption("One forward appending k tokens, over one appending a single token, "
                       "after the same context. Near the green line, k tokens cost one read of "
                       "the weights; on the grey line each token costs a step of its own.")
        if spec.empty:
            return
        st.markdown(fs.speculation_sentence(spec))
        left, right = st.columns(2)
        left.plotly_chart(fs.speedup_figure(spec), width="stretch")
        right.plotly_chart(fs.acceptance_figure(spec), width="stretch")
        st.caption("Predicted (orange): E[tokens per forward] = (1 − α^(k+1)) / (1 − α) at the "
                   "measured acceptance α, each forward costing t(k+1) from the verify curve. "
                   "Predicted (green): the forwards that actually ran, each timed by the "
                   "curve. Red: the acceptance below which drafts of k tokens cost more time "
                   "than they save on this device.")
        st.dataframe(fs.speculative_table(spec), hide_index=True)
        meta = (job.run or {}).get("meta") or {}
        if meta.get("output_text"):
            st.markdown("Prompt, as the model read it, then ⟦ the greedy output ⟧:")
            st.code(f"{meta.get('prompt_text', '')}⟦{meta['output_text']}⟧", language=None,
                    wrap_lines=True)

    jobs.section(KEY_V, draw_spec, table="speculative", stem="speculate",
                 empty="Choose contexts and draft lengths, then **Measure the verify curve and "
                 "speculate**.")
