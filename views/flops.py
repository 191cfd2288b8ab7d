"""FLOPs vs time: why 1000× less arithmetic buys only a few × less time.

Works on any sweep: this session's last one, a saved run, or the write-up's A40 numbers
(``ui.runs.pick_sweep_run``). Figures from ``ui.figures_perf``: Figure 4 (FLOP reduction vs
time reduction), achieved TFLOP/s and share of peak (Figure 5 / Table 2), and a roofline.
Peaks: the datasheet's when the device is listed, and those measured with the run itself; a
run that carries none is drawn without shares of a measured peak.
"""

from __future__ import annotations

import streamlit as st

from ui import header
from ui.figures_perf import (
    achieved_table,
    baseline_mode,
    ceilings,
    floor_sentence,
    reduction_figure,
    roofline_figure,
    share_sentence,
    throughput_figure,
)
from ui.figures_predict import add_predicted_reduction
from ui.predicted import predicted_for
from ui.runs import latency_frame, pick_sweep_run

choice = header.page("FLOPs vs time", "FLOPs are counted from formulas (the cost model); "
                     "times are measured. Dividing one by the other says which regime a decode "
                     "step is in.")
run = pick_sweep_run("flops_source")
if run is None:
    st.info("No sweep yet: run one on the **Latency sweep** page (or keep the A40 reference "
            "file in results/reference/).")
    st.stop()
df = latency_frame(run)
if df.empty:
    st.warning("This run has no latency rows.")
    st.stop()
meta = run.get("meta") or {}
peaks = meta.get("peaks") or {}  # {listed, measured} (saved runs) or {fp32_tflops} (reference)
measured = peaks.get("measured")
said = floor_sentence(df, measured)
if said:
    st.info(said, icon=":material/speed:")

# ------------------------------------------------------------------------------- Figure 4
st.subheader("Fewer FLOPs is not the same as less time")
base = baseline_mode(df)
if base is None:
    st.caption("This run has no uncached mode to compare against; add mode 1 or 2 to the sweep.")
else:
    log_y = st.toggle("log y", True, key="flops_red_log")
    fig = reduction_figure(df, base, log_y=log_y)
    points, when = predicted_for(run)
    if not points.empty:
        add_predicted_reduction(fig, points, base)
    st.plotly_chart(fig, width="stretch")
    st.caption(f"Figure 4: dashed, how many times fewer FLOPs each cached mode does than "
               f"{base}; solid, how many times less time it takes. The gap between them is "
               "what arithmetic does not explain."
               + (f" Dotted: the same ratio from the step predicted by the parts calibrated "
                  f"here on {when} UTC (Floor lab, Predicted step) -- weights streamed, "
                  "attention and cache, small operators, dispatch." if not points.empty else ""))

# ------------------------------------------------------------------------------- Figure 5
st.subheader("Achieved arithmetic throughput")
roofs = ceilings(meta.get("device_name"), str(meta.get("dtype") or "float32"), measured,
                 peaks.get("fp32_tflops"))
if not measured:
    st.caption("No peak recorded for that machine: the run carries no measured peaks, and this "
               "machine's would not describe it. Shares of the listed (datasheet) peak only, "
               "where the device is listed.")
c1, c2 = st.columns([1, 2])
as_pct = c1.toggle("as % of peak", False, key="flops_pct", disabled=not roofs)
peak = None
if as_pct and roofs:
    names = [c.label for c in roofs]
    which = c2.radio("peak", names, horizontal=True, key="flops_peak",
                     label_visibility="collapsed")
    peak = roofs[names.index(which)]
st.plotly_chart(throughput_figure(df, roofs, percent_of=peak), width="stretch")
st.caption("Figure 5: formula FLOPs per step divided by the measured step time."
           + (" " + share_sentence(df, roofs[-1]) if roofs else ""))
if not roofs:
    st.caption("No peak known for this run's device: shares of peak and the roofline need one.")

table = achieved_table(df, roofs[0] if roofs else None)
fmt = {c: st.column_config.NumberColumn(c, format="%.4g") for c in table.columns
       if c.endswith("TFLOP/s")}
fmt.update({c: st.column_config.NumberColumn(c, format="%.2f%%") for c in table.columns
            if c.endswith("% of peak")})
fmt["context_len"] = st.column_config.NumberColumn("context (tokens)")
with st.expander("Table 2: achieved TFLOP/s" + (f" and % of the {roofs[0].label} peak "
                                                 f"({roofs[0].tflops:.3g} TFLOP/s)"
                                                 if roofs else "")):
    st.dataframe(table, hide_index=True, column_config=fmt)

# ------------------------------------------------------------------------------- roofline
st.subheader("Roofline")
if roofs:
    st.plotly_chart(roofline_figure(df, roofs), width="stretch")
    st.caption("Each point is one mode at one context: its FLOPs per byte it must move (x) "
               "against the FLOP/s it reached (y). Points on the slanted roof are limited by "
               "memory bandwidth, on the flat roof by arithmetic; points far below both spend "
               "their time on something neither roof describes.")
else:
    st.info("The roofline needs a device peak.")
