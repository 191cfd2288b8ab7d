"""Generate side by side: one prompt, with and without the KV cache, and whether they agree."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from engine import generate_detailed
from engine.checks import compare_streams
from engine.tokenizer import TokenizerError, decode, encode
from ui.figures import step_latency_figure
from ui.state import get_model

st.title("Generate side by side")
st.caption(
    "The same prompt, generated greedily twice: with the KV cache (prefill once, then one token "
    "per step) and without it (the whole sequence re-run every step). Step times are wall "
    "times with the device synchronised."
)

model = get_model()
prompt = st.text_area("Prompt", "Hello, I'm a language model,", max_chars=4000)
limit = model.config.block_size if model is not None else 1024
n_new = st.number_input("New tokens", min_value=1, max_value=limit, value=40, step=10)
go = st.button("Generate", type="primary", disabled=model is None)

if go and model is not None:
    try:
        ids = encode(prompt)
    except TokenizerError as exc:
        st.error(str(exc))
        st.stop()
    if not ids:
        st.error("The prompt is empty: type at least one character.")
        st.stop()
    if len(ids) + int(n_new) > limit:
        st.error(
            f"Prompt ({len(ids)} tokens) + {int(n_new)} new tokens is beyond the model's limit "
            f"of {limit} tokens; allowed: at most {max(limit - len(ids), 0)} new tokens."
        )
        st.stop()
    cols = st.columns(2)
    runs = {}
    for col, (mode, use_cache) in zip(cols, [("cached", True), ("uncached", False)],
                                      strict=True):
        col.subheader("With KV cache" if use_cache else "Without cache")
        box = col.empty()
        pieces: list[int] = []

        def show(ev, box=box, pieces=pieces) -> None:
            pieces.append(ev.token_ids[0])
            box.markdown(f"{prompt}**{decode(pieces)}**")

        try:
            runs[mode] = generate_detailed(model, ids, int(n_new), use_cache=use_cache,
                                           keep_logits=True, on_token=show)
        except ValueError as exc:
            col.error(str(exc))
            st.stop()
        g = runs[mode]
        col.metric("ms / token (median)", f"{pd.Series(g.step_ms).median():.2f}")
        col.caption(f"total {g.total_ms / 1e3:.2f} s for {len(g.step_ms)} tokens; "
                    f"first step {g.step_ms[0]:.2f} ms")
    a, b = runs["cached"], runs["uncached"]
    verdict = compare_streams(a.tokens[0].tolist(), b.tokens[0].tolist(), a.logits, b.logits)
    if verdict.identical:
        st.success(f"Identical: all {a.tokens.shape[1]} tokens match, cached vs uncached.")
    else:
        st.error(
            f"The streams differ from new token {verdict.first_diff}: cached chose "
            f"{verdict.token_a!r}, uncached {verdict.token_b!r}; logit gap "
            f"{verdict.logit_gap_a} (cached run) / {verdict.logit_gap_b} (uncached run)."
        )
    rows = [
        {"mode": mode, "step": i, "context_len": c, "step_ms": ms}
        for mode, g in runs.items()
        for i, (c, ms) in enumerate(zip(g.context_len, g.step_ms, strict=True))
    ]
    st.plotly_chart(step_latency_figure(pd.DataFrame(rows)), width="stretch")
    st.caption("Uncached steps grow with the context; cached steps stay nearly flat. "
               "The first cached step is the prefill of the whole prompt.")
