"""Prefix cache: a prompt's KV kept across requests and reused, measured three ways.

Three experiments, each run in the measuring process (``ui.jobs``) and saved like every other:
"prefix_ttft" (time to first token against the cached prefix P, the prediction beside it),
"prefix_chat" (a multi-turn chat in the model's template, with and without reuse) and
"prefix_workload" (requests sharing system prompts and documents under KV budgets, with the
radix tree drawn as it ran). This page draws their rows; it measures nothing.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from instruments import lineup
from instruments.experiments.inputs import parse_contexts
from instruments.experiments.prefix.chat import USER_TURNS, PrefixChatParams
from instruments.experiments.prefix.ttft import SHARES, PrefixTtftParams
from instruments.experiments.prefix.workload import PrefixWorkloadParams
from instruments.process.client import Job
from ui import header, jobs
from ui.figures_prefix import (
    budget_figure,
    chat_figure,
    chat_kv_figure,
    held_figure,
    tree_figure,
    ttft_figure,
)
from ui.state import RUN_ICON

choice = header.page("Prefix cache", "Serving engines keep the KV of prompts they have seen "
                     "(a system prompt, a shared document, a chat's earlier turns) in blocks "
                     "under a radix tree of token ids, and a new request computes only what "
                     "the tree lacks. Here: what that does to the time to first token, exactly.")
cfg = header.model(choice)
block = cfg.block_size


def _start(key: str, experiment: str, params: object, what: str) -> None:
    jobs.start_checked(key, experiment, params, what, cfg, choice.device)


tab_ttft, tab_chat, tab_load = st.tabs(["TTFT against the cached prefix", "Multi-turn chat",
                                        "Shared-prefix workload"])

# ------------------------------------------------------------------------ TTFT against P
with tab_ttft:
    KEY_T = "prefix_ttft_job"
    base = PrefixTtftParams.defaults(choice.device, cfg)
    t1, t2, t3, t4 = st.columns([2, 3, 2, 1])
    lens_text = t1.text_input("Prompt lengths (tokens)", ", ".join(map(str, base.prompt_lens)),
                              key="prefix_lens", help=f"Each 2..{block}.")
    shares_text = t2.text_input("Shares held in the tree", ", ".join(f"{s:g}" for s in SHARES),
                                key="prefix_shares", help="P = share × N, each 0..1; 1 = the "
                                "whole prompt (its last token is still computed, for logits).")
    tree_tokens = int(t3.number_input("Other tokens in the tree", 0, 1_000_000,
                                      base.tree_tokens, step=1024, key="prefix_tree"))
    repeats = int(t4.number_input("Samples", 1, 50, base.repeats, key="prefix_repeats"))
    if st.button("Measure TTFT", type="primary", icon=RUN_ICON, key="prefix_ttft_go",
                 disabled=jobs.running(KEY_T)):
        try:
            lens = parse_contexts(lens_text, block, "prompt length")
            shares = sorted({float(s) for s in shares_text.split(",") if s.strip()})
        except ValueError as exc:
            st.error(str(exc) if "allowed" in str(exc) else
                     f"cannot read the shares {shares_text!r}; allowed: numbers 0..1 separated "
                     "by commas")
        else:
            _start(KEY_T, "prefix_ttft", PrefixTtftParams(lens, shares, tree_tokens,
                                                          repeats=repeats),
                   f"prefix TTFT, {choice.model}")

    def draw_ttft(job: Job) -> None:
        df = jobs.rows(job, "ttft")
        st.plotly_chart(ttft_figure(df), width="stretch")
        if df.empty:
            return
        hit = df[df["cached_tokens"] > 0]
        worst = hit.loc[hit["over_predicted"].idxmax()] if not hit.empty else None
        lines = [f"Lookup: at most {df['lookup_share'].max():.2%} of a TTFT, with up to "
                 f"{int(df['tree_tokens'].max()):,} tokens in the tree."]
        if worst is not None:
            lines.append(f"TTFT over the prediction: {hit['over_predicted'].min():.2f}–"
                         f"{hit['over_predicted'].max():.2f}× (worst at N = "
                         f"{int(worst['prompt_len'])}, P = {int(worst['cached_tokens'])}); over "
                         f"the new tokens after the prefix in a contiguous cache: "
                         f"{hit['over_extend'].min():.2f}–{hit['over_extend'].max():.2f}×.")
        exact = bool(df["exact"].all())
        lines.append(f"Logits against one full prefill: largest |Δ| "
                     f"{df['max_abs_logit_diff'].max():.2g} — "
                     + ("within fp32's tolerance at every point." if exact
                        else "**beyond fp32's tolerance somewhere**."))
        st.caption(" ".join(lines))
        cols = ["prompt_len", "cached_tokens", "new_tokens", "ttft_ms", "predicted_ms",
                "alone_ms", "extend_ms", "lookup_ms", "lookup_share", "over_predicted",
                "over_extend", "tree_tokens", "max_abs_logit_diff", "exact"]
        st.dataframe(df[[c for c in cols if c in df]], hide_index=True)

    jobs.section(KEY_T, draw_ttft, table="ttft", stem="prefix_ttft",
                 empty="Press **Measure TTFT**: each prompt is served with P of its tokens in "
                 "the tree, beside a cold prefill of its N − P new tokens alone.")

# ---------------------------------------------------------------------------- the chat
with tab_chat:
    KEY_C = "prefix_chat_job"
    has_template = lineup.preset(choice.model).chat  # the model's tokenizer holds one
    if not has_template:
        st.info("The chat needs a chat template: choose **smollm2-135m** in the sidebar, or a "
                "checkpoint whose tokenizer holds one.")
    c1, c2, c3 = st.columns(3)
    turns = int(c1.number_input("Turns", 1, len(USER_TURNS), len(USER_TURNS), key="chat_turns"))
    answer = int(c2.number_input("Answer tokens (at most)", 1, 512, 48, key="chat_answer"))
    samples = int(c3.number_input("Samples per turn", 1, 50, 3, key="chat_repeats"))
    with st.expander("The user's turns"):
        st.markdown("\n".join(f"{i}. {t}" for i, t in enumerate(USER_TURNS, 1)))
    if st.button("Run the chat", type="primary", icon=RUN_ICON, key="prefix_chat_go",
                 disabled=jobs.running(KEY_C) or not has_template):
        _start(KEY_C, "prefix_chat", PrefixChatParams(turns, answer, samples),
               f"prefix chat, {choice.model}")

    def draw_chat(job: Job) -> None:
        df = jobs.rows(job, "turns")
        st.plotly_chart(chat_figure(df), width="stretch")
        st.plotly_chart(chat_kv_figure(df), width="stretch")
        if df.empty:
            return
        last = int(df["turn"].max())
        ratio = {m: float(p.sort_values("turn")["ttft_ms"].iloc[-1]
                          / p.sort_values("turn")["ttft_ms"].iloc[0])
                 for m, p in df.groupby("mode")}
        same = bool(df["identical"].all())
        st.caption(f"Turn {last}'s TTFT is {ratio.get('reuse', float('nan')):.2f}× turn 1's "
                   f"with reuse, {ratio.get('no reuse', float('nan')):.2f}× without. The "
                   "answers are " + ("identical token for token both ways." if same else
                                     "**not identical** both ways (see the table)."))
        shown = df[df["mode"] == "reuse"][["turn", "prompt_tokens", "cached_tokens",
                                           "ttft_ms", "identical", "answer"]]
        st.dataframe(shown, hide_index=True)

    jobs.section(KEY_C, draw_chat, table="turns", stem="prefix_chat",
                 empty="Press **Run the chat**: eight user turns, the model's own answers, "
                 "each turn timed with and without the earlier turns' KV.")

# ------------------------------------------------------------------------- the workload
with tab_load:
    KEY_W = "prefix_load_job"
    base_w = PrefixWorkloadParams.defaults(choice.device, cfg)
    w1, w2, w3, w4 = st.columns([3, 1, 1, 1])
    budgets_text = w1.text_input("KV budgets (MiB)", ", ".join(f"{b:g}" for b in
                                                              base_w.budgets_mib),
                                 key="load_budgets")
    n_req = int(w2.number_input("Requests", 1, 5000, base_w.requests, key="load_requests"))
    rate = float(w3.number_input("Arrivals per s", 0.01, 1000.0, base_w.rate_per_s,
                                 key="load_rate"))
    new = int(w4.number_input("New tokens", 1, 256, base_w.new_tokens, key="load_new"))
    if st.button("Serve the workload", type="primary", icon=RUN_ICON, key="prefix_load_go",
                 disabled=jobs.running(KEY_W)):
        try:
            budgets = [float(b) for b in budgets_text.split(",") if b.strip()]
        except ValueError:
            st.error(f"cannot read the budgets {budgets_text!r}; allowed: sizes in MiB "
                     "separated by commas")
        else:
            params = PrefixWorkloadParams(budgets, n_req, rate_per_s=rate, new_tokens=new,
                                          system_tokens=base_w.system_tokens,
                                          document_tokens=base_w.document_tokens)
            _start(KEY_W, "prefix_workload", params, f"prefix workload, {choice.model}")

    def draw_load(job: Job) -> None:
        per = jobs.rows(job, "budgets")
        st.plotly_chart(budget_figure(per), width="stretch")
        st.plotly_chart(held_figure(jobs.rows(job, "requests")), width="stretch")
        if not per.empty:
            st.dataframe(per, hide_index=True)
        tree, gone = jobs.rows(job, "tree"), jobs.rows(job, "evictions")
        if tree.empty:
            return
        meta = (job.run or {}).get("meta") or {}
        steps = sorted(int(x) for x in tree["step"].unique())
        evicting = sorted(int(x) for x in gone["step"].unique()) if not gone.empty else []
        step = st.select_slider("Step (request admitted)", steps,
                                evicting[-1] if evicting else steps[-1], key="load_step",
                                help="Opens at the last step that evicted a leaf.")
        st.plotly_chart(tree_figure(tree, gone, int(step)), width="stretch")
        st.caption(f"The tree under the {meta.get('picture_label', 'chosen')} budget as request "
                   f"{int(step)} was admitted: each box a node (its tokens along x), stacked "
                   "over the leaves below it; darker blocks are shared more; outlined: what "
                   "the running request reads. Red beneath: the leaves evicted to make room.")
        if not gone.empty:
            st.dataframe(pd.DataFrame(gone), hide_index=True)

    jobs.section(KEY_W, draw_load, table="budgets", stem="prefix_workload",
                 empty="Press **Serve the workload**: the same seeded stream under each budget, "
                 "and once without reuse.")
