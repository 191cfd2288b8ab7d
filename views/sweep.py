"""Latency sweep: per-token time against context for chosen decode modes, drawn as it is measured.

Inputs → ``LatencyParams`` → the "latency" experiment in the measuring process (``ui.jobs``:
queued, Stop keeps what was measured, saved to results/) → figures from ``ui.figures``.
The job lives in ``st.session_state["sweep_job"]``; chart options only redraw it.
"""

from __future__ import annotations

import streamlit as st

from instruments import lineup
from instruments.costmodel import estimate
from instruments.experiments import to_dict
from instruments.experiments.inputs import (
    CONTEXT_PRESETS,
    MAX_BATCH,
    parse_contexts,
    preset_contexts,
    repeated_contexts,
)
from instruments.experiments.latency import LatencyParams
from instruments.process import client
from instruments.process.client import Job
from ui import header, jobs, metrics, predicted
from ui.figures import cumulative_figure, latency_figure, ordered_modes
from ui.figures_perf import floor_sentence
from ui.runs import last_sweep_like
from ui.state import RUN_ICON, device_facts, is_cpu, mode_choices, mode_label

KEY = "sweep_job"
CUSTOM = "custom list / range"

choice = header.page("Latency sweep", "Time per generated token against the number of tokens "
                     "in context, for each decode mode: the write-up's Figures 1–3 and Table 1, "
                     "measured here and now.")
cfg = header.model(choice)
cpu = is_cpu(choice)
block = cfg.block_size
spec0 = LatencyParams.defaults(choice.device, cfg)
job = jobs.get(KEY)
busy = jobs.running(KEY)
usable, unavailable = mode_choices(choice.device, cfg.family)

E2E_BUDGET_S = 25.0


def _params(new: int) -> LatencyParams:
    """The sweep the widgets describe (ValueError when the contexts cannot be read), with the
    predicted steps of the newest calibration of this machine when one exists."""
    contexts = parse_contexts(custom, block) if preset == CUSTOM else preset_contexts(preset,
                                                                                       block)
    steps, errors, _ = predicted.sweep_predictions(
        choice.model, device_name, choice.dtype, client.measuring_threads(), int(batch),
        list(picked), contexts)
    return LatencyParams(contexts, list(picked), int(batch), int(warmup), int(repeats),
                         warmup_steps=spec0.warmup_steps, e2e_new_tokens=new,
                         e2e_prompt_len=int(prompt_len),
                         retakes=spec0.retakes if retake else 0,
                         predicted_ms=steps or None, prediction_error=errors or None)


def _planned() -> LatencyParams | None:
    try:
        return _params(int(new_tokens))
    except ValueError:
        return None


with st.expander("What to measure", expanded=job is None):
    c1, c2 = st.columns([1, 1])
    preset = c1.selectbox("Context lengths", [*CONTEXT_PRESETS, CUSTOM], key="sweep_preset",
                          help=f"Presets are clipped to the model's limit of {block} tokens.")
    custom = ""
    if preset == CUSTOM:
        custom = c1.text_input("Lengths (tokens)", "8, 16, 32, 64-512:64", key="sweep_custom",
                               help=f"Whole numbers 1..{block}, ranges start-stop:step, "
                               "separated by commas.")
    picked = c2.multiselect("Decode modes", usable, default=[m for m in spec0.modes
                                                             if m in usable],
                            key="sweep_modes", format_func=mode_label,
                            help="Each mode is first checked to give mode 1's greedy tokens. "
                            "⏳: compiles first (minutes on a CPU).")
    if unavailable:
        c2.caption("Not available here: " + "; ".join(
            f"{lineup.label(m).split(' · ')[0]} {m} ({why})"
            for m, why in unavailable.items()))
    c3, c4, c5, c6 = st.columns(4)
    batch = c3.number_input("Batch size", 1, MAX_BATCH, spec0.batch_size, key="sweep_batch")
    warmup = c4.number_input("Warm-up calls", 0, 10, spec0.warmup, key="sweep_warmup",
                             help="Untimed calls before each mode's first point.")
    repeats = c5.number_input("Repeats", 1, 20, spec0.repeats, key="sweep_repeats",
                              help=f"The most timed samples per point. Each point takes "
                              f"{spec0.min_repeats}, more while they disagree by more than "
                              f"{spec0.spread:.0%}; the line is their median. A cheap point "
                              f"(a cached step) takes samples until they add up to "
                              f"{spec0.point_ms:.0f} ms, up to {spec0.cheap_repeats}.")
    e2e = c6.toggle("End-to-end too", True, key="sweep_e2e",
                    help="Also time one whole generation per mode (Figure 3).")
    retake = c6.toggle("Retake disturbed samples", True, key="sweep_retake", disabled=not cpu,
                       help=f"On a CPU: a sample during which another process (a browser tab, "
                       f"a build) used the CPU, or took this one's core, and that is out of line "
                       f"with the point's other samples (or its prediction), is set aside (a "
                       f"grey cross on the chart) and taken again once the machine is quiet, up "
                       f"to {spec0.retakes} times per point and {spec0.retake_share:.0%} of the "
                       "sweep's time. One in line is kept.")
    device_name = str(device_facts(choice.device).get("name"))
    prior = last_sweep_like(choice.model, device_name, choice.dtype, client.measuring_threads(),
                            int(batch))
    fitted = estimate.from_run(prior) if prior else None
    prompt_len, new_tokens = 8, 0
    if e2e:
        c7, c8, _ = st.columns([1, 1, 2])
        prompt_len = c7.number_input("Prompt tokens", 1, block - 1, min(8, block - 1),
                                     key="sweep_prompt")
        fits_in = None if not cpu or fitted is None else estimate.tokens_that_fit(
            LatencyParams(spec0.contexts, picked or ["uncached"], e2e_prompt_len=int(prompt_len)),
            cfg, choice.dtype, fitted[0], E2E_BUDGET_S)
        new_tokens = c8.number_input(
            "New tokens", 1, block, min(block - 8, fits_in or 64) if cpu else block - 8,
            key="sweep_new", help="The write-up generated 1,016 tokens after an 8-token prompt. "
            f"On a CPU the default is what fits about {E2E_BUDGET_S:.0f} s, by your last sweep.")
    planned = _planned()
    if planned is not None and fitted is not None:
        secs = estimate.sweep_seconds(planned, cfg, choice.dtype, fitted[0], fitted[1])
        st.caption(f"This sweep should take about **{secs:.0f} s**, by the steps your last "
                   f"sweep of {choice.model} measured here ({str(prior['created_utc'])[:16]}; "
                   "noisy points take more samples)." if secs is not None else
                   "No estimate for a mode your last sweep did not time.")
    elif planned is not None:
        st.caption(f"No estimate yet: the first sweep of {choice.model} on this device measures "
                   "what its steps cost; later ones are estimated from it.")
    if planned is not None and planned.prediction_error:
        st.caption("Predicted steps from this machine's calibration (Floor lab, Predicted "
                   "step): a point whose first sample lands within the prediction's measured "
                   "error (" + ", ".join(f"{m} {e:.0%}" for m, e in
                                         planned.prediction_error.items())
                   + ") takes no second sample.")
    run_clicked = st.button("Run sweep", type="primary", disabled=busy, icon=RUN_ICON)


if run_clicked:
    try:
        twice = repeated_contexts(custom, block) if preset == CUSTOM else []
        if twice:
            st.info(f"Listed more than once, measured once: {', '.join(map(str, twice))}.")
        params = _params(int(new_tokens) if e2e else 0)
        params.check(cfg, choice.device)
        contexts = params.contexts
    except ValueError as exc:
        st.error(str(exc))
        st.stop()
    job = jobs.start(KEY, "latency", to_dict(params), f"latency sweep, {choice.model}, "
                     f"{len(contexts)} contexts × {len(picked)} modes")
    busy = True

# ----------------------------------------------------------------------------- chart options
if job is not None:
    o1, o2, o3, o4 = st.columns([1, 1, 1, 3])
    log_x = o1.toggle("log x", False, key="sweep_logx")
    log_y = o2.toggle("log y", False, key="sweep_logy")
    samples = o3.toggle("each run", True, key="sweep_samples",
                        help="Show every timed repeat as a faint point.")
    measured = ordered_modes(job.params["modes"])
    shown = o4.multiselect("Series", measured, default=measured,
                           key="sweep_shown_" + "-".join(measured), format_func=mode_label)


def _draw(j: Job) -> None:
    df = jobs.rows(j, "latency")
    fig = latency_figure(df, log_x=log_x, log_y=log_y, show_samples=samples, modes=shown)
    calibrated = predicted.overlay(j, fig, shown) if j.finished else None
    st.plotly_chart(fig, width="stretch")
    st.caption("Median time per token (line) and each timed sample (faint points), measured in "
               "a process of its own: nothing this page draws runs beside a timed step. Grey "
               "crosses: samples another process disturbed (hover for why) that were out of line "
               "with their point, set aside and taken again."
               + (f" Dashed: {calibrated}" if calibrated else ""))
    if not j.finished:
        return
    said = floor_sentence(df, ((j.run or {}).get("meta") or {}).get("peaks", {}).get("measured"))
    if said:
        st.info(said, icon=":material/speed:")
    table = jobs.rows(j, "summary")
    if not table.empty:
        st.subheader("Per-token latency at the write-up's points")
        slow, fast = table["baseline_mode"].iloc[0], table["compare_mode"].iloc[0]
        st.dataframe(table[["measured_context_len", "baseline_ms", "compare_ms", "speedup",
                            "flop_reduction"]], hide_index=True, column_config={
            "measured_context_len": st.column_config.NumberColumn("context (tokens)"),
            "baseline_ms": st.column_config.NumberColumn(f"{slow} (ms)", format="%.2f"),
            "compare_ms": st.column_config.NumberColumn(f"{fast} (ms)", format="%.2f"),
            "speedup": st.column_config.NumberColumn("measured speedup", format="%.1f×"),
            "flop_reduction": st.column_config.NumberColumn("FLOP reduction", format="%.0f×")})
        last = table.iloc[-1]
        st.caption(f"Table 1. At {int(last['measured_context_len'])} tokens {fast} does "
                   f"{last['flop_reduction']:.0f}× fewer FLOPs than {slow} and took "
                   f"{last['speedup']:.1f}× less time.")
    if not df.empty:
        with st.expander("Per point: median, p50 / p90 / p99, samples kept, spread, MBU, MFU"):
            points = metrics.point_table(df)
            st.dataframe(points, hide_index=True, column_config=metrics.columns(list(points)))
            metrics.definitions(["p50 / p90 / p99", "MBU", "MFU"])
    cum = jobs.rows(j, "cumulative")
    if not cum.empty:
        st.subheader("A whole generation, end to end")
        st.plotly_chart(cumulative_figure(cum), width="stretch")
        totals = jobs.rows(j, "end_to_end")
        st.caption("Figure 3: cumulative time as tokens are generated. " + "; ".join(
            f"{r.mode}: {int(r.new_tokens)} tokens in {r.total_s:.2f} s"
            for r in totals.itertuples()) + ".")
        shown_cols = ["mode", "prompt_len", "new_tokens", "total_s", "prefill_ms"]
        predicted_s = predicted.predicted_generations(j.run or {})
        if any(v is not None for v in predicted_s):  # a calibration of this machine covers it
            totals = totals.assign(predicted_s=predicted_s)
            shown_cols.append("predicted_s")
        if "disturbed_steps" in totals and totals["disturbed_steps"].notna().any():
            shown_cols.append("disturbed_steps")
        serving = [c for c in metrics.serving_table(totals)
                   if c not in shown_cols and c != "e2e_ms"]  # E2E is the total here
        if serving:  # TTFT says what the prefill column said, in the field's words
            shown_cols.remove("prefill_ms")
        shown_cols += serving
        st.dataframe(totals[shown_cols],
                     hide_index=True, column_config={**metrics.columns(serving),
                         "predicted_s": st.column_config.NumberColumn(
                             "predicted (s)", format="%.2f", help="The prompt's forward and "
                             "one step per token, summed from the parts calibrated on this "
                             "machine (Floor lab, Predicted step)."),
                         "prompt_len": st.column_config.NumberColumn("prompt (tokens)"),
                         "new_tokens": st.column_config.NumberColumn("new tokens"),
                         "total_s": st.column_config.NumberColumn(
                             "total = E2E (s)", format="%.2f", help=metrics.GLOSSARY["E2E"]),
                         "prefill_ms": st.column_config.NumberColumn("prefill (ms)",
                                                                     format="%.1f"),
                         "disturbed_steps": st.column_config.NumberColumn(
                             "disturbed steps", help="Steps of the median run during which "
                             "another process used the CPU or took this one's core. A "
                             "generation is not retaken: its total includes them.")})
        pp_tg, no_energy = metrics.pp_tg_sentence(totals), metrics.energy_note(totals)
        if pp_tg:
            st.caption("In llama-bench's terms (one generation each; `python -m instruments "
                       f"bench` gives ± sd over repeats): {pp_tg}.")
        if no_energy:
            st.caption(no_energy)
        metrics.definitions(["TTFT", "TPOT", "E2E", "output tokens/s", "pp / tg", "energy"])
    checks = jobs.rows(j, "checks")
    if not checks.empty:
        with st.expander("Mode checks (logits against mode 1)"):
            st.dataframe(checks, hide_index=True)
    if not df.empty:
        with st.expander("Raw rows"):
            st.dataframe(df, hide_index=True)


jobs.section(KEY, _draw, table="latency", stem="latency_sweep",
             empty="Choose what to measure and press **Run sweep**. Points appear on the chart "
             "as they are measured; **Stop** keeps what was measured so far.")
