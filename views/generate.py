"""Generate side by side: one prompt through two decode modes, and whether they agree.

By default the two modes are "with the KV cache" and the naive loop without it; any two modes of
the ladder can be picked. The "generation" experiment runs in the measuring process
(``ui.jobs``); its tokens stream back and are written into the two columns as they come. The
verdict and the per-token chart come from the run it returns. The prompt goes as text: the
measuring process reads it with the model's own tokenizer (a checkpoint's tokenizer.json or
GGUF vocabulary, else its family's: GPT-2's BPE, SmolLM2's) and, for an instruct model, in its
chat template when the toggle asks; the text of every token comes back with it, so this page
never loads a tokenizer.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

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
preset = lineup.preset(choice.model)
default_prompt = ("The key-value cache in a transformer" if preset.chat
                  else "Hello, I'm a language model,")
prompt = st.text_area("Prompt", default_prompt, max_chars=4000, key="gen_prompt")
chat = st.toggle("Chat template", False, key="gen_chat", disabled=not preset.chat,
                 help="Wrap the prompt in the model's own chat template (the instruct model's "
                 "user turn, then the assistant's)." if preset.chat else
                 f"{choice.model} has no chat template.")
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
        params = GenerationParams(prompt, int(n_new), [left, right], chat=bool(chat))
        params.check(cfg, choice.device)
    except ValueError as exc:
        st.error(str(exc))
        st.stop()
    jobs.start(KEY, "generation", to_dict(params), "side-by-side generation")


def _text(text: str) -> str:
    """Model text shown as it is: no Markdown read into it (code, asterisks, underscores), its
    line breaks and indentation kept."""
    escaped = "".join("\\" + c if c in MARKDOWN else c for c in text)
    lines = escaped.split("\n")
    return "  \n".join(line[: len(line) - len(line.lstrip(" "))].replace(" ", "&nbsp;")
                       + line.lstrip(" ") for line in lines)


MARKDOWN = set("\\`*_{}[]()#+-.!|<>~$")


def _draw(job: Job) -> None:
    tokens = jobs.rows(job, "tokens")
    sides = job.params["modes"]
    meta = (job.run or {}).get("meta") or {}
    shown = meta.get("prompt_text", job.params.get("prompt_text", ""))
    if meta.get("tokenizer"):
        st.caption(f"Prompt: {meta.get('prompt_tokens')} tokens ({meta['tokenizer']}"
                   + (", chat template" if job.params.get("chat") else "") + ").")
    cols = st.columns(2)
    for col, side, mode in zip(cols, ("left", "right"), sides, strict=True):
        part = tokens[tokens["side"] == side] if not tokens.empty else tokens
        col.subheader(_title(mode))
        new = (meta.get("texts") or {}).get(side)
        if new is None:
            new = "".join(str(t) for t in part["piece"]) if "piece" in part else ""
        col.markdown(f"{_text(shown)}**{_text(new)}**")
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
        pieces = dict(zip(tokens["token_id"], tokens["piece"], strict=True)) \
            if "piece" in tokens else {}
        ta = "?" if pd.isna(v["token_a"]) else repr(pieces.get(int(v["token_a"]), v["token_a"]))
        tb = "?" if pd.isna(v["token_b"]) else repr(pieces.get(int(v["token_b"]), v["token_b"]))
        st.error(f"The streams differ from new token {int(v['first_diff'])}: {a} chose {ta}, "
                 f"{b} {tb}; logit gap {gap_a} ({a} run) / {gap_b} ({b} run).")
    log_y = st.toggle("log y", False, key="gen_logy")
    st.plotly_chart(step_latency_figure(tokens, log_y=log_y), width="stretch")
    st.caption("The time of each generated token against the context it attended to. A cached "
               "mode's first step is the prefill of the whole prompt.")


jobs.section(KEY, _draw, table="tokens", stem="generation",
             empty="Type a prompt and press **Generate**.")
