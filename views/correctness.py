"""Correctness lab: the checks that must pass before any timing counts, and the bugs they catch.

The "correctness" experiment (in the measuring process, ``ui.jobs``) runs the checks --
logits vs transformers, cached == uncached, multi-token append -- with no bug and with each of
the write-up's silent bugs switched on (on a private view of the model there, never on the model
other requests use), and generates text each way. Saved as kind "correctness". The bugs offered
are the model family's (a Llama model adds RoPE's and GQA's); the prompt goes as text and the
text of every token comes back with the run, so this page never loads a tokenizer.
"""

from __future__ import annotations

import streamlit as st

from instruments.checks import BUG_DESCRIPTIONS, bugs_for
from instruments.experiments import to_dict
from instruments.experiments.correctness import CorrectnessParams
from instruments.process.client import Job
from ui import header, jobs
from ui.figures_memory import check_matrix_figure
from ui.state import RUN_ICON

KEY = "correct_job"
NO_BUG = "no bug"

choice = header.page("Correctness lab", "Before any timing is trusted: our logits against "
                     "transformers' model of the same family, cached generation against the "
                     "uncached loop, and "
                     "several tokens appended at once. Then the write-up's silent bugs, one at a "
                     "time: which check sees each, and what text comes out.")
cfg = header.model(choice)
block = cfg.block_size
job = jobs.get(KEY)

c1, c2 = st.columns([3, 1])
prompt = c1.text_input("Prompt", "The key-value cache in a transformer", max_chars=2000,
                       key="correct_prompt")
n_new = int(c2.number_input("New tokens", 2, min(200, block - 8), min(40, block - 16),
                            key="correct_new"))
family_bugs = bugs_for(cfg.family)
bugs = st.multiselect("Bugs to switch on", family_bugs, family_bugs,
                      key="correct_bugs", format_func=lambda b: f"{b}: {BUG_DESCRIPTIONS[b]}")
run_clicked = st.button("Run the checks", type="primary", disabled=jobs.running(KEY),
                        icon=RUN_ICON)


def _md(text: str) -> str:
    """Text shown literally inside markdown (model output may hold *, _, $, [ ...)."""
    out = "".join("\\" + c if c in "\\`*_{}[]()#+-.!|$<>~:" else c for c in text)
    return out.replace("\n", " ")


if run_clicked:
    try:
        params = CorrectnessParams(prompt, n_new, list(bugs))
        params.check(cfg, choice.device)
    except ValueError as exc:
        st.error(str(exc))
        st.stop()
    job = jobs.start(KEY, "correctness", to_dict(params), f"correctness checks, {choice.model}")


def caught_sentences(checks) -> list[str]:
    """What this run's matrix shows, bug by bug, in words (nothing assumed)."""
    out = []
    for bug, part in checks[checks["bug"] != NO_BUG].groupby("bug", sort=False):
        caught = list(part.loc[part["passed"] == False, "check"])  # noqa: E712 (None stays)
        unsure = list(part.loc[part["passed"].isna(), "check"])
        if caught:
            text = f"{bug} was caught by {' and '.join(c.split(' (')[0] for c in caught)}."
        else:
            text = f"{bug} was caught by no check here."
        if unsure:
            text += f" ({', '.join(c.split(' (')[0] for c in unsure)}: no verdict.)"
        out.append(text)
    base = checks[(checks["bug"] == NO_BUG) & (checks["passed"] == False)]  # noqa: E712
    if not base.empty:
        out.append("Without any bug, " + " and ".join(base["check"]) + " failed: a check "
                   "that fails on a correct engine catches nothing.")
    return out


def _draw(j: Job) -> None:
    checks = jobs.rows(j, "checks")
    if checks.empty:
        st.caption("Waiting for the first results…")
        return
    if j.finished:
        base = checks[checks["bug"] == NO_BUG]
        for col, (_, r) in zip(st.columns(3), base.iterrows(), strict=False):
            verdict = {True: "passes", False: "FAILS"}.get(r["passed"], "could not run")
            col.metric(r["check"], verdict)
            col.caption(r["detail"])
    st.plotly_chart(check_matrix_figure(checks), width="stretch")
    st.caption("Each row switches one bug on; red cells are checks that fail, so they catch "
               "it; grey cells could not run or could not tell (the reason is in the hover and "
               "the table). " + " ".join(caught_sentences(checks)))
    tokens = jobs.rows(j, "tokens")
    if not j.finished or tokens.empty:
        return
    st.subheader("What the text turns into")
    by_bug = {str(r["bug"]): list(r["token_ids"]) for _, r in tokens.iterrows()}
    pieces = {str(r["bug"]): list(r["pieces"]) if "pieces" in r else [str(t) for t in
                                                                         r["token_ids"]]
              for _, r in tokens.iterrows()}
    good = by_bug.get(NO_BUG, [])
    shown = ((j.run or {}).get("meta") or {}).get("prompt_text", j.params.get("prompt_text", ""))
    for name, toks in by_bug.items():
        at = next((i for i, (a, b) in enumerate(zip(toks, good, strict=False)) if a != b), None)
        with st.container(border=True):
            what = BUG_DESCRIPTIONS.get(name, "the engine as it is")
            verdict = ("the reference" if name == NO_BUG else "same tokens as without the bug"
                       if at is None else f"differs from new token {at} on (in red)")
            st.markdown(f"**{name}** — {_md(what)} · *{verdict}*")
            text = pieces[name]
            same, rest = (text, []) if at is None else (text[:at], text[at:])
            st.markdown(_md(shown) + (f":blue[{_md(''.join(same))}]" if same else "")
                        + (f":red[{_md(''.join(rest))}]" if rest else ""))
    label = header.weights_label(choice) or ""
    st.caption("Greedy generation with the concatenating cache under each bug. A wrong value "
               "in the right shape never crashes: the text just goes wrong."
               + (" With random weights every line is gibberish, but a changed line still "
                  "shows the bug." if label.startswith("random") else ""))
    with st.expander("Every check's detail"):
        st.dataframe(checks, hide_index=True)


jobs.section(KEY, _draw, table="checks", stem="correctness",
             empty="Press **Run the checks**. On gpt2 this takes a little while on a CPU: every "
             "bug runs the three checks and one generation.")
