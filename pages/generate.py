"""Generate side by side: one prompt through two decode modes, and whether they agree.

By default the two modes are "with the KV cache" and the naive loop without it; any two modes of
the ladder can be picked. The "generation" experiment runs in the measuring process
(``ui.jobs``); its tokens stream back and are written into the two columns as they come. The
verdict and the per-token chart come from the run it returns.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from engine.tokenizer import TokenizerError, encode, text_or_ids
from instruments import lineup
from instruments.experiments import to_dict
from instruments.experiments.generation import GenerationParams
from instruments.process.client import Job
from ui import header, jobs
from ui.figures import step_latency_figure
from ui.state import RUN_ICON, mode_choices, mode_label

KEY = "gen_job"

choice = header.page("Generate side by side", "The same prompt, generated greedily twice: with "
                     "the KV cache (prefill once, then one token per step) and without it (the "
                     "whole sequence re-run every step). Step times are wall times with the "
                     "device synchronised, measured in the measuring process.")
cfg = header.model(choice)
limit = cfg.block_size
prompt = st.text_area("Prompt", "Hello, I'm a language model,", max_chars=4000, key="gen_prompt")
n_new = st.number_input("New tokens", min_value=1, max_value=limit, value=min(40, limit - 16),
                        step=10, key="gen_new")
usable = mode_choices(choice.device, cfg.family)[0]
m1, m2 = st.columns(2)
cached = lineup.fastest_exact(choice.device, cfg.family)
left = m1.selectbox("Left", usable, key="gen_left", format_func=mode_label,
                    index=usable.index(cached) if cached in usable else 0)
right = m2.selectbox("Right", usable, key="gen_right", format_func=mode_label,
                     index=usable.index("uncached") if "uncached" in usable else 0)
clicked = st.button("Generate", type="primary", disabled=jobs.running(KEY), icon=RUN_ICON)


def _title(mode: str) -> str:
    return ("With KV cache · " if lineup.spec(mode).cached else "Without cache · ") \
        + mode_label(mode)


if clicked:
    try:
        try:
            ids = encode(prompt)
        except TokenizerError as exc:
            raise ValueError(str(exc)) from exc
        params = GenerationParams(ids, int(n_new), [left, right])
        params.check(cfg, choice.device)
    except ValueError as exc:
        st.error(str(exc))
        st.stop()
    st.session_state["gen_prompt_text"] = prompt
    jobs.start(KEY, "generation", to_dict(params), "side-by-side generation")


def _draw(job: Job) -> None:
    tokens = jobs.rows(job, "tokens")
    sides = job.params["modes"]
    shown = st.session_state.get("gen_prompt_text", "")
    cols = st.columns(2)
    for col, side, mode in zip(cols, ("left", "right"), sides, strict=True):
        part = tokens[tokens["side"] == side] if not tokens.empty else tokens
        col.subheader(_title(mode))
        ids = [int(t) for t in part["token_id"]] if not part.empty else []
        col.markdown(f"{shown}**{text_or_ids(ids)}**")
        if job.finished and not part.empty:
            col.metric("ms / token (median)", f"{part['step_ms'].median():.2f}")
            col.caption(f"total {part['step_ms'].sum() / 1e3:.2f} s for {len(part)} tokens; "
                        f"first step {part['step_ms'].iloc[0]:.2f} ms")
    verdict = jobs.rows(job, "verdict")
    if not job.finished or verdict.empty:
        return
    v = verdict.iloc[0]
    a, b = sides
    if bool(v["identical"]):
        st.success(f"Identical: all {int(v['new_tokens'])} tokens match, {a} vs {b}.")
    else:
        gap_a = "?" if pd.isna(v["logit_gap_a"]) else f"{v['logit_gap_a']:.3g}"
        gap_b = "?" if pd.isna(v["logit_gap_b"]) else f"{v['logit_gap_b']:.3g}"
        ta = "?" if pd.isna(v["token_a"]) else repr(text_or_ids([int(v["token_a"])]))
        tb = "?" if pd.isna(v["token_b"]) else repr(text_or_ids([int(v["token_b"])]))
        st.error(f"The streams differ from new token {int(v['first_diff'])}: {a} chose {ta}, "
                 f"{b} {tb}; logit gap {gap_a} ({a} run) / {gap_b} ({b} run).")
    log_y = st.toggle("log y", False, key="gen_logy")
    st.plotly_chart(step_latency_figure(tokens, log_y=log_y), width="stretch")
    st.caption("The time of each generated token against the context it attended to. A cached "
               "mode's first step is the prefill of the whole prompt.")


jobs.section(KEY, _draw, table="tokens", stem="generation",
             empty="Type a prompt and press **Generate**.")
