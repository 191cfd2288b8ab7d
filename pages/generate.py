"""Generate side by side: one prompt through two decode modes, and whether they agree.

By default the two modes are "with the KV cache" and the naive loop without it; any two modes of
the ladder can be picked. Runs ``engine.modes.generate_with_mode`` twice while holding the device
(``engine.runner.RUNNER``: one measurement at a time across sessions), streaming tokens into two
columns; the verdict comes from ``engine.checks.compare_streams`` and the per-token chart from
``ui.figures``. The last result stays in ``st.session_state["gen_result"]``: redrawing it (log
axis) never generates again.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from engine.checks import compare_streams
from engine.modes import MODES, generate_with_mode
from engine.runner import RUNNER, Cancelled, OutOfMemory, oom_guard
from engine.tokenizer import TokenizerError, decode, encode
from ui.figures import step_latency_figure
from ui.state import RUN_ICON, current_choice, get_model, mode_choices, mode_label

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
usable = mode_choices(model)[0] if model is not None else ["prealloc_fused", "uncached"]
m1, m2 = st.columns(2)
left = m1.selectbox("Left", usable, key="gen_left", format_func=mode_label,
                    index=usable.index("prealloc_fused") if "prealloc_fused" in usable else 0)
right = m2.selectbox("Right", usable, key="gen_right", format_func=mode_label,
                     index=usable.index("uncached") if "uncached" in usable else 0)
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


def _title(mode: str) -> str:
    return ("With KV cache · " if MODES[mode].cached else "Without cache · ") + mode_label(mode)


def _run_both(ids: list[int], n: int) -> dict[str, Any]:
    """Generate each way into its column (tokens appear as made); returns what to keep."""
    cols = st.columns(2)
    runs = {}
    for col, mode in zip(cols, (left, right), strict=True):
        col.subheader(_title(mode))
        box = col.empty()
        pieces: list[int] = []

        def show(ev, box=box, pieces=pieces) -> None:
            pieces.append(ev.token_ids[0])
            box.markdown(f"{prompt}**{decode(pieces)}**")

        runs[mode] = generate_with_mode(model, mode, ids, n, keep_logits=True, on_token=show)
    a, b = runs[left], runs[right]
    verdict = compare_streams(a.tokens[0].tolist(), b.tokens[0].tolist(), a.logits, b.logits)
    return {
        "prompt": prompt, "verdict": verdict, "n": a.tokens.shape[1], "sides": (left, right),
        "text": {m: decode(g.tokens[0].tolist()) for m, g in runs.items()},
        "steps": [{"mode": m, "step": i, "context_len": c, "step_ms": ms}
                  for m, g in runs.items()
                  for i, (c, ms) in enumerate(zip(g.context_len, g.step_ms, strict=True))],
    }


if clicked and model is not None:
    try:
        if left == right:
            raise ValueError("Pick two different modes to compare (left and right are the same).")
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
    for col, mode in zip(cols, res["sides"], strict=True):
        part = steps[steps["mode"] == mode]["step_ms"]
        col.subheader(_title(mode))
        col.markdown(f"{res['prompt']}**{res['text'][mode]}**")
        col.metric("ms / token (median)", f"{part.median():.2f}")
        col.caption(f"total {part.sum() / 1e3:.2f} s for {len(part)} tokens; "
                    f"first step {part.iloc[0]:.2f} ms")
    v = res["verdict"]
    if v.identical:
        st.success(f"Identical: all {res['n']} tokens match, "
                   f"{res['sides'][0]} vs {res['sides'][1]}.")
    else:
        gap_a = "?" if v.logit_gap_a is None else f"{v.logit_gap_a:.3g}"
        gap_b = "?" if v.logit_gap_b is None else f"{v.logit_gap_b:.3g}"
        ta = "?" if v.token_a is None else repr(decode([v.token_a]))
        tb = "?" if v.token_b is None else repr(decode([v.token_b]))
        a, b = res["sides"]
        st.error(f"The streams differ from new token {v.first_diff}: {a} chose {ta}, "
                 f"{b} {tb}; logit gap {gap_a} ({a} run) / {gap_b} ({b} run).")
    log_y = st.toggle("log y", False, key="gen_logy")
    st.plotly_chart(step_latency_figure(steps, log_y=log_y), width="stretch")
    st.caption("Uncached steps grow with the context; cached steps stay nearly flat. "
               "The first cached step is the prefill of the whole prompt.")
