"""The Floor lab's predicted-step section: a prediction job's rows drawn as they arrive.

While the job runs, the calibration rows and the sweep's latency rows stream in and the
prediction is computed here from them (``instruments.costmodel.predict``, torch-free); once the run
is saved its own ``prediction`` table is drawn. The newest saved calibration of a model, device,
dtype, threads and batch also draws the sweep's dashed line (``overlay``) and gives a sweep about
to run its predicted steps and their measured error (``sweep_predictions``).
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from instruments.costmodel import predict
from instruments.process.client import Job
from ui import jobs
from ui.figures_predict import (
    add_prediction,
    parts_figure,
    prediction_figure,
    residual_figure,
    verdict_table,
)
from ui.runs import last_sweep_like


def points(job: Job) -> pd.DataFrame:
    """The run's prediction table, or one computed from the rows streamed so far."""
    done = jobs.rows(job, "prediction")
    if not done.empty:
        return done
    cal, lat = jobs.rows(job, "calibration"), jobs.rows(job, "latency")
    if cal.empty or lat.empty:
        return pd.DataFrame()
    rows = predict.compare(predict.Calibration(cal.to_dict("records")), lat.to_dict("records"))
    return pd.DataFrame(rows)


def _calibration(model: str, device_name: str, dtype: str, threads: int, batch: int
                 ) -> tuple[predict.Calibration | None, str, dict]:
    """The newest saved calibration run (the Floor lab's Predicted step) of these, its
    lookup and when it was made; (None, "", {}) when there is none."""
    cal_run = last_sweep_like(model, device_name, dtype, threads, batch, kind="step_prediction")
    if cal_run is None:
        return None, "", {}
    cal = predict.Calibration((cal_run.get("tables") or {}).get("calibration") or [])
    return cal, str(cal_run.get("created_utc", ""))[:16].replace("T", " "), cal_run


def calibration_for(run: dict) -> tuple[predict.Calibration | None, str]:
    """The newest saved calibration of the same model, device, dtype, threads and batch as
    ``run`` (the Floor lab's Predicted step), and when it was made; None when there is none."""
    meta = run.get("meta") or {}
    cal, when, _ = _calibration(str(meta.get("model")), str(meta.get("device_name")),
                                str(meta.get("dtype")), int(meta.get("threads") or 0),
                                int(meta.get("batch_size") or 1))
    return cal, when


def sweep_predictions(model: str, device_name: str, dtype: str, threads: int, batch: int,
                      modes: list[str], contexts: list[int]
                      ) -> tuple[dict[str, dict[int, float]], dict[str, float], str]:
    """For a sweep about to run: ({mode: {context: predicted ms}}, {mode: the prediction's
    measured error}, when the calibration was made), from the newest saved calibration of the
    same model, device, dtype, threads and batch. A mode is predicted only where that
    calibration's own run found it within its goal; its error is the worst miss measured there
    (``predict.verdicts``). Empty without a calibration: the sweep then takes two samples."""
    cal, when, cal_run = _calibration(model, device_name, dtype, threads, batch)
    if cal is None:
        return {}, {}, ""
    tables = cal_run.get("tables") or {}
    verdicts = tables.get("verdicts") or predict.verdicts(tables.get("prediction") or [])
    errors = {str(v["mode"]): float(v["worst_share"]) for v in verdicts
              if v.get("within") and v["mode"] in modes and 0 < (v.get("worst_share") or 0) < 1}
    predicted: dict[str, dict[int, float]] = {}
    for mode in errors:
        steps = {t: predict.predict_point(cal, mode, t, batch)["predicted_ms"] for t in contexts}
        predicted[mode] = {t: float(ms) for t, ms in steps.items() if ms}
    predicted = {m: steps for m, steps in predicted.items() if steps}
    return predicted, {m: e for m, e in errors.items() if m in predicted}, when


def predicted_for(run: dict, modes: list[str] | None = None) -> tuple[pd.DataFrame, str]:
    """``predict.compare`` rows for a sweep run's latency rows (only ``modes``, if given), and
    when the calibration was made; empty when there is none or it covers none of them."""
    cal, when = calibration_for(run)
    rows = [r for r in (run.get("tables") or {}).get("latency") or []
            if modes is None or r["mode"] in modes]
    if cal is None or not rows:
        return pd.DataFrame(), ""
    points = pd.DataFrame(predict.compare(cal, rows))
    if points["predicted_ms"].isna().all():
        return pd.DataFrame(), ""
    return points, when


def predicted_generations(run: dict) -> list[float | None]:
    """Predicted seconds of each of the run's end-to-end generations (its ``end_to_end`` rows,
    in order; None where the calibration does not cover the mode)."""
    cal, _ = calibration_for(run)
    out: list[float | None] = []
    for r in (run.get("tables") or {}).get("end_to_end") or []:
        ms = None if cal is None else predict.predict_generation(
            cal, str(r["mode"]), int(r["prompt_len"]), int(r["new_tokens"]),
            int(r.get("batch_size") or 1))
        out.append(None if ms is None else ms / 1e3)
    return out


def overlay(job: Job, fig: go.Figure, modes: list[str]) -> str | None:
    """Dashed predicted lines on a finished sweep's chart (``predicted_for``); the caption to
    write under the chart, or None when there is no calibration or the user turned it off."""
    points, when = predicted_for(job.run or {}, modes)
    if points.empty or not st.toggle("predicted", True, key=f"sweep_predicted_{job.id}",
                                      help="The step predicted from the parts calibrated on "
                                      "this machine in the Floor lab's Predicted step."):
        return None
    add_prediction(fig, points)
    return (f"the step predicted from the parts calibrated here on {when} UTC (Floor lab, "
            "Predicted step); compiled modes are not predicted.")


def draw(job: Job) -> None:
    if not job.finished:
        # Nothing is drawn while it measures: redrawing these charts every second beside the
        # run slowed its steps up to 3x on the 2-core machine here (memory bandwidth and the
        # last-level cache are shared even when the cores are not).
        measured = len(job.tables.get("latency", []))
        st.caption(f"{measured} points measured so far. The charts are drawn when the run "
                   "ends: redrawing them beside the measurement would disturb it (the cores "
                   "share memory bandwidth and cache).")
        return
    df = points(job)
    if df.empty:
        st.caption("Nothing was measured: the run ended while calibrating.")
        return
    verdicts = predict.verdicts(df.to_dict("records"))
    st.plotly_chart(prediction_figure(df), width="stretch")
    split = "bound" in df and df["bound"].notna().any()
    st.caption("Solid: the measured median step (uncached modes: the forward of the whole "
               "sequence). Dashed: " + (
                   "the larger of the host's time to issue the step and the device's time in "
                   "its kernels, each part timed alone on this GPU." if split else
                   "the sum of the parts, each timed alone on this device."))
    for v in verdicts:
        icon = (":material/check_circle:" if v["within"] else ":material/remove_circle:"
                if v["within"] is None else ":material/cancel:")
        st.markdown(f"{icon} {v['sentence']}")
    st.plotly_chart(residual_figure(df), width="stretch")
    shown = [m for m in df["mode"].drop_duplicates() if df[df["mode"] == m]["predicted_ms"]
             .notna().any()]
    if shown:
        mode = st.selectbox("Parts of the prediction for", shown, key=f"pred_parts_{job.id}")
        st.plotly_chart(parts_figure(df, str(mode)), width="stretch")
        st.caption("Weights: every Linear matmul at the rows the mode multiplies. Attention: "
                   "the KV cache's write (or concatenation, gather, dequantization) and the "
                   "attention over the context. Small operators: norms, GELU, residual adds, "
                   "embeddings. Dispatch and host loop: the same step on the hollow model"
                   + (" (its issue time; the other parts are their kernels' time, and the "
                      "taller bar is the prediction)." if split else "."))
    st.dataframe(verdict_table(verdicts), hide_index=True)
