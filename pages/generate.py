"""Generate side by side: one prompt, with and without the KV cache, and whether they agree.

Runs ``engine.generate_detailed`` twice (cache on / off) while holding the device
(``engine.runner.RUNNER``: one measurement at a time across sessions), streaming tokens into two
columns; the verdict comes from ``engine.checks.compare_streams`` and the per-token chart from
``ui.figures``. The last result stays in ``st.session_state["gen_result"]``: redrawing it (log
axis) never generates again.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from engine import generate_detailed
from engine.checks import compare_streams
from engine.runner import RUNNER, Cancelled, OutOfMemory, oom_guard
from engine.tokenizer import TokenizerError, decode, encode
from ui.figures import step_latency_figure
from ui.state import RUN_ICON, current_choice, get_model

SIDES = (("cached", True, "With KV cache"), ("uncached", False, "Without cache"))

st.title("Generate side by side")
st.caption(
    "The same prompt, generated greedily twice: with the KV cache (prefill once, then one token "
    "per step) and without it (the whole sequence re-run every step). Step times are wall "
    "times with the device synchronised."
)

model = get_model()
prompt = st.text_area("Prompt", "Hello, I'm a language model,", max_chars=4000, key="gen_prompt")
limit = model.config.block_size if model is not None else 1024
n_new = st.number_input("New tokens", min_value=1, max_value=limit, value=min(40, limit - 16),
                        step=10, key="gen_new")
clicked = st.button("Generate", type="primary", disabled=model is None, icon=RUN_ICON)


def _validate(text: str, n: int) -> list[int]:
    try:
        ids = encode(text)
    except TokenizerError as exc:
        raise ValueError(str(exc)) from exc
    if not ids:
        raise ValueError("The prompt is empty: type at least one character.")
    if len(ids) + n > limit:
        raise ValueError(
            f"Prompt ({len(ids)} tokens) + {n} new tokens is beyond the model's limit of "
            f"{limit} tokens; allowed: at most {max(limit - len(ids), 0)} new tokens.")
    return ids


def _run_both(ids: list[int], n: int) -> dict[str, Any]:
    """Generate each way into its column (tokens appear as made); returns what to keep."""
    cols = st.columns(2)
    runs = {}
    for col, (mode, use_cache, title) in zip(cols, SIDES, strict=True):
        col.subheader(title)
        box = col.empty()
        pieces: list[int] = []

        def show(ev, box=box, pieces=pieces) -> None:
            pieces.append(ev.token_ids[0])
            box.markdown(f"{prompt}**{decode(pieces)}**")

        runs[mode] = generate_detailed(model, ids, n, use_cache=use_cache, keep_logits=True,
                                       on_token=show)
    a, b = runs["cached"], runs["uncached"]
    verdict = compare_streams(a.tokens[0].tolist(), b.tokens[0].tolist(), a.logits, b.logits)
    return {
        "prompt": prompt, "verdict": verdict, "n": a.tokens.shape[1],
        "text": {m: decode(g.tokens[0].tolist()) for m, g in runs.items()},
        "steps": [{"mode": m, "step": i, "context_len": c, "step_ms": ms}
                  for m, g in runs.items()
                  for i, (c, ms) in enumerate(zip(g.context_len, g.step_ms, strict=True))],
    }


if clicked and model is not None:
    try:
        ids = _validate(prompt, int(n_new))
    except ValueError as exc:
        st.error(str(exc))
        st.stop()
    note = st.empty()

    def waiting(position: int, running: Any) -> None:
        who = running.describe() if running is not None else "another run"
        note.info(f"Waiting for the device (position {position}): {who}")

    try:
        device = current_choice().device
        with RUNNER.turn(device, "generate", "side-by-side generation", on_wait=waiting), \
                oom_guard(device, f"batch 1 × context {len(ids) + int(n_new)}"):
            note.empty()
            st.session_state["gen_result"] = _run_both(ids, int(n_new))
    except (Cancelled, ValueError, OutOfMemory) as exc:
        st.error(str(exc))
        st.stop()
    st.rerun()  # draw the kept result below, the same way every later rerun draws it

res = st.session_state.get("gen_result")
if res is not None:
    steps = pd.DataFrame(res["steps"])
    cols = st.columns(2)
    for col, (mode, _, title) in zip(cols, SIDES, strict=True):
        part = steps[steps["mode"] == mode]["step_ms"]
        col.subheader(title)
        col.markdown(f"{res['prompt']}**{res['text'][mode]}**")
        col.metric("ms / token (median)", f"{part.median():.2f}")
        col.caption(f"total {part.sum() / 1e3:.2f} s for {len(part)} tokens; "
                    f"first step {part.iloc[0]:.2f} ms")
    v = res["verdict"]
    if v.identical:
        st.success(f"Identical: all {res['n']} tokens match, cached vs uncached.")
    else:
        gap_a = "?" if v.logit_gap_a is None else f"{v.logit_gap_a:.3g}"
        gap_b = "?" if v.logit_gap_b is None else f"{v.logit_gap_b:.3g}"
        ta = "?" if v.token_a is None else repr(decode([v.token_a]))
        tb = "?" if v.token_b is None else repr(decode([v.token_b]))
        st.error(f"The streams differ from new token {v.first_diff}: cached chose {ta}, "
                 f"uncached {tb}; logit gap {gap_a} (cached run) / {gap_b} (uncached run).")
    log_y = st.toggle("log y", False, key="gen_logy")
    st.plotly_chart(step_latency_figure(steps, log_y=log_y), width="stretch")
    st.caption("Uncached steps grow with the context; cached steps stay nearly flat. "
               "The first cached step is the prefill of the whole prompt.")
