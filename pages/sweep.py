"""Latency sweep: per-token time against context for chosen decode modes, drawn as it is measured.

Inputs → ``engine.sweep.run_latency_sweep`` (then optionally ``run_end_to_end``) on a background
``ui.live.Job`` → figures from ``ui.figures``. The job holds the device lock, Stop ends it within
one step, and the run (partial or not) is saved to results/ when it ends. Results live in
``st.session_state["sweep_job"]``; chart options only redraw them.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from engine.memory import fits, peak_memory_estimate
from engine.modes import MODES
from engine.results import ResultsError
from engine.sweep import (
    CONTEXT_PRESETS,
    MAX_BATCH,
    SweepSpec,
    default_spec,
    parse_contexts,
    preset_contexts,
    repeated_contexts,
    run_end_to_end,
    run_latency_sweep,
    summary_table,
)
from ui.device import get_bench
from ui.figures import UNCACHED_MODES, cumulative_figure, latency_figure, ordered_modes
from ui.live import Job, finished_banner, live_panel, running_job, start_job
from ui.runs import download_buttons, save_measurement
from ui.state import CPU_NOTE, RUN_ICON, current_choice, get_model, is_cpu, mode_choices, mode_label

KEY = "sweep_job"
CUSTOM = "custom list / range"

st.title("Latency sweep")
st.caption("Time per generated token against the number of tokens in context, for each decode "
           "mode: the write-up's Figures 1–3 and Table 1, measured here and now.")
choice = current_choice()
model = get_model()
if model is None:
    st.stop()
cpu = is_cpu(choice)
if cpu:
    st.info(CPU_NOTE, icon=":material/memory:")
block = model.config.block_size
spec0 = default_spec(choice.device, block)
job: Job | None = st.session_state.get(KEY)
busy = running_job(KEY) is not None
usable, unavailable = mode_choices(model)

with st.expander("What to measure", expanded=job is None):
    c1, c2 = st.columns([1, 1])
    preset = c1.selectbox("Context lengths", [*CONTEXT_PRESETS, CUSTOM], key="sweep_preset",
                          help="Presets are clipped to the model's limit of "
                          f"{block} tokens.")
    custom = ""
    if preset == CUSTOM:
        custom = c1.text_input("Lengths (tokens)", "8, 16, 32, 64-512:64", key="sweep_custom",
                               help=f"Whole numbers 1..{block}, ranges start-stop:step, "
                               "separated by commas.")
    default_modes = [m for m in spec0.modes if m in usable]
    modes = c2.multiselect("Decode modes", usable, default=default_modes, key="sweep_modes",
                           format_func=mode_label,
                           help="Each mode is first checked to give mode 1's greedy tokens. "
                           "⏳: compiles first (minutes on a CPU).")
    if unavailable:
        c2.caption("Not available here: " + "; ".join(
            f"{MODES[m].label.split(' · ')[0]} {m} ({why})" for m, why in unavailable.items()))
    c3, c4, c5, c6 = st.columns(4)
    batch = c3.number_input("Batch size", 1, MAX_BATCH, spec0.batch_size, key="sweep_batch")
    warmup = c4.number_input("Warm-up runs", 0, 10, spec0.warmup, key="sweep_warmup",
                             help="Untimed runs before timing each mode.")
    repeats = c5.number_input("Repeats", 1, 20, spec0.repeats, key="sweep_repeats",
                              help="Timed runs per point; the line is their median.")
    e2e = c6.toggle("End-to-end too", True, key="sweep_e2e",
                    help="Also time one whole generation per mode (Figure 3).")
    if e2e:
        c7, c8, _ = st.columns([1, 1, 2])
        prompt_len = c7.number_input("Prompt tokens", 1, block - 1, min(8, block - 1),
                                     key="sweep_prompt")
        new_tokens = c8.number_input(
            "New tokens", 1, block, min(block - 8, 200) if cpu else block - 8,
            key="sweep_new", help="The write-up generated 1,016 tokens after an 8-token prompt.")
    run_clicked = st.button("Run sweep", type="primary", disabled=busy, icon=RUN_ICON)


def _contexts() -> list[int]:
    if preset == CUSTOM:
        twice = repeated_contexts(custom, block)
        if twice:
            st.info(f"Listed more than once, measured once: {', '.join(map(str, twice))}.")
        return parse_contexts(custom, block)
    return preset_contexts(preset, block)


def _work(job: Job) -> None:
    spec: SweepSpec = job.params["spec"]

    def progress(p) -> None:  # engine.sweep.Progress
        job.update(p.done, p.total, p.row, p.elapsed_s, p.eta_s, p.message)

    res = run_latency_sweep(model, spec, on_progress=progress, should_stop=job.should_stop)
    job.results["checks"] = [vars(c) for c in res.checks]
    job.results["notes"] = list(res.notes)
    if res.cancelled or job.should_stop() or not job.params.get("e2e"):
        return
    prompt, new = job.params["e2e"]

    def e2e_progress(p) -> None:
        job.update(eta_s=p.eta_s, message=f"end to end: {p.message}")

    out = run_end_to_end(model, spec.modes, prompt, new, spec.batch_size,
                         on_progress=e2e_progress, should_stop=job.should_stop)
    job.results["totals"], job.results["cumulative"] = out.totals, out.cumulative


def _finish(job: Job) -> None:
    if not job.rows:
        return
    spec: SweepSpec = job.params["spec"]
    tables = {"latency": job.rows, "checks": job.results.get("checks", []),
              "end_to_end": job.results.get("totals", []),
              "cumulative": job.results.get("cumulative", [])}
    note = "stopped before the end" if job.state == "stopped" else (job.error or "")
    try:
        run, path = save_measurement(
            "latency_sweep", job.params["model_name"], model, job.device, tables,
            partial=job.partial, note=note, batch_size=spec.batch_size, warmup=spec.warmup,
            repeats=spec.repeats, contexts=spec.contexts, modes=spec.modes,
            measured_peaks=job.params.get("bench"))
    except ResultsError as exc:
        job.save_error = str(exc)
        return
    job.results["run"] = run
    job.saved_path = str(path)


if run_clicked:
    try:
        contexts = _contexts()
        spec = SweepSpec(contexts, list(modes), int(batch), int(warmup), int(repeats),
                         warmup_steps=spec0.warmup_steps)
        spec.validate(model)
        e2e_args = (int(prompt_len), int(new_tokens)) if e2e else None
        if e2e_args and e2e_args[0] + e2e_args[1] - 1 > block:
            raise ValueError(f"prompt + new tokens must be at most {block + 1} "
                             f"(the model's limit is {block} tokens)")
        est = peak_memory_estimate(model.config, choice.dtype, spec.batch_size, max(contexts),
                                   None if all(m in UNCACHED_MODES for m in modes) else
                                   "concat", device=choice.device)
        ok, why = fits(choice.device, est, resident_bytes=est["weights_bytes"])
        if not ok:
            raise ValueError(f"This sweep would not fit in memory ({why}). Use a smaller "
                             "batch size or shorter contexts.")
    except ValueError as exc:
        st.error(str(exc))
        st.stop()
    job = Job("latency_sweep", f"latency sweep, {choice.model}, {len(contexts)} contexts × "
              f"{len(modes)} modes", choice.device,
              params={"spec": spec, "e2e": e2e_args, "model_name": choice.model,
                      "sizes": f"batch {spec.batch_size} × context up to {max(contexts)}",
                      "bench": get_bench(choice.device, choice.dtype)},
              total=len(contexts) * len(modes))
    st.session_state[KEY] = start_job(job, _work, _finish)
    busy = True

# ----------------------------------------------------------------------------- chart options
if job is not None:
    o1, o2, o3, o4 = st.columns([1, 1, 1, 3])
    log_x = o1.toggle("log x", False, key="sweep_logx")
    log_y = o2.toggle("log y", False, key="sweep_logy")
    samples = o3.toggle("each run", True, key="sweep_samples",
                        help="Show every timed repeat as a faint point.")
    measured = ordered_modes(job.params["spec"].modes)
    shown = o4.multiselect("Series", measured, default=measured,
                           key="sweep_shown_" + "-".join(measured),
                           format_func=mode_label)


def _draw(j: Job) -> None:
    df = pd.DataFrame(list(j.rows))
    st.plotly_chart(latency_figure(df, log_x=log_x, log_y=log_y, show_samples=samples,
                                   modes=shown), width="stretch")
    st.caption("Median time per token (line) and each timed run (faint points). Uncached "
               "modes climb with context; cached ones should stay nearly flat."
               + (" On a shared CPU anything else running (this browser too, if it runs on the "
                  "same machine) shows up as scatter between the runs." if cpu else ""))


if job is not None and busy:
    live_panel(KEY, _draw)
elif job is not None:
    finished_banner(job)
    if job.rows:
        _draw(job)
    for note in job.results.get("notes", []):
        st.warning(note)
    # --------------------------------------------------------------------- Table 1
    ran = [m for m in job.params["spec"].modes if any(r["mode"] == m for r in job.rows)]
    slow = next((m for m in ran if m in UNCACHED_MODES), None)
    fast = next((m for m in ran if m not in UNCACHED_MODES), None)
    if slow and fast:
        table = pd.DataFrame(summary_table(job.rows, pair=(slow, fast)))
        st.subheader("Per-token latency at the write-up's points")
        if table.empty:
            st.caption("No context measured near 10, 100, 500 or 1000 tokens in both modes.")
        else:
            st.dataframe(table[["measured_context_len", "baseline_ms", "compare_ms", "speedup",
                                "flop_reduction"]], hide_index=True, column_config={
                "measured_context_len": st.column_config.NumberColumn("context (tokens)"),
                "baseline_ms": st.column_config.NumberColumn(f"{slow} (ms)", format="%.2f"),
                "compare_ms": st.column_config.NumberColumn(f"{fast} (ms)", format="%.2f"),
                "speedup": st.column_config.NumberColumn("measured speedup", format="%.1f×"),
                "flop_reduction": st.column_config.NumberColumn("FLOP reduction",
                                                                format="%.0f×")})
            st.caption("Table 1: the FLOP ratio grows with context; the measured speedup "
                       "grows far more slowly.")
    # --------------------------------------------------------------------- end to end
    cum = pd.DataFrame(job.results.get("cumulative", []))
    if not cum.empty:
        st.subheader("A whole generation, end to end")
        st.plotly_chart(cumulative_figure(cum), width="stretch")
        st.caption("Figure 3: cumulative time as tokens are generated. Uncached steps get "
                   "dearer each token, so the total bends upward; cached totals grow linearly.")
        totals = pd.DataFrame(job.results["totals"])
        st.dataframe(totals[["mode", "prompt_len", "new_tokens", "total_s", "prefill_ms"]],
                     hide_index=True, column_config={
                         "prompt_len": st.column_config.NumberColumn("prompt (tokens)"),
                         "new_tokens": st.column_config.NumberColumn("new tokens"),
                         "total_s": st.column_config.NumberColumn("total (s)", format="%.2f"),
                         "prefill_ms": st.column_config.NumberColumn("prefill (ms)",
                                                                     format="%.1f")})
    if job.results.get("checks"):
        with st.expander("Mode checks (greedy tokens against mode 1)"):
            st.dataframe(pd.DataFrame(job.results["checks"]), hide_index=True)
    if job.rows:
        with st.expander("Raw rows"):
            st.dataframe(pd.DataFrame(job.rows), hide_index=True)
        download_buttons(job.results.get("run") or {"tables": {"latency": job.rows}},
                         "latency", "latency_sweep", "sweep_dl")
else:
    st.info("Choose what to measure and press **Run sweep**. Points appear on the chart as they "
            "are measured; **Stop** keeps what was measured so far.")
