"""Correctness lab: the checks that must pass before any timing counts, and the bugs they catch.

Runs ``engine.checks`` (logits vs transformers, cached == uncached, multi-token append) with no
bug and with each of the write-up's silent bugs switched on (``inject_bug``), and generates text
each way. The bugs are switched on a ``ui.state.private_view`` of the shared model, never on the
model other sessions use. Background ``ui.live.Job``; results kept in the session.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st

from engine import generate
from engine.checks import (
    BUG_DESCRIPTIONS,
    cached_equals_uncached,
    inject_bug,
    logits_vs_transformers,
    multi_token_append,
)
from engine.tokenizer import TokenizerError, decode, encode
from ui.figures_memory import check_matrix_figure
from ui.live import Job, finished_banner, live_panel, running_job, start_job
from ui.state import RUN_ICON, current_choice, get_model, private_view

KEY = "correct_job"
NO_BUG = "no bug"
APPEND = (1, 2, 3, 7)
CHECKS = ("logits vs transformers", "cached == uncached (1 token per step)",
          "multi-token append (1, 2, 3, 7 at once)")

st.title("Correctness lab")
st.caption("Before any timing is trusted: our logits against transformers' GPT-2, cached "
           "generation against the uncached loop, and several tokens appended at once. Then the "
           "write-up's silent bugs, one at a time: which check sees each, and what text comes out.")
choice = current_choice()
model = get_model()
if model is None:
    st.stop()
block = model.config.block_size
job: Job | None = st.session_state.get(KEY)
busy = running_job(KEY) is not None

c1, c2 = st.columns([3, 1])
prompt = c1.text_input("Prompt", "Hello, I'm a language model,", max_chars=2000,
                       key="correct_prompt")
n_new = int(c2.number_input("New tokens", 2, min(200, block - 8), min(40, block - 16),
                            key="correct_new"))
bugs = st.multiselect("Bugs to switch on", list(BUG_DESCRIPTIONS), list(BUG_DESCRIPTIONS),
                      key="correct_bugs", format_func=lambda b: f"{b}: {BUG_DESCRIPTIONS[b]}")
run_clicked = st.button("Run the checks", type="primary", disabled=busy, icon=RUN_ICON)


def _check(fn, *args, **kwargs) -> tuple[bool, str, float | None]:
    try:
        res = fn(*args, **kwargs)
    except Exception as exc:  # a check that cannot run is reported, not raised
        return False, f"could not run: {type(exc).__name__}: {exc}", None
    return res.passed, res.detail, res.value


def _work(j: Job) -> None:
    ids, n = j.params["ids"], j.params["new"]
    view = private_view(model)  # bugs go on this copy; the shared model is never touched
    ext = ids + generate(view, [ids], max(APPEND), use_cache=False)[0].tolist()
    j.total = len(j.params["bugs"]) + 1
    for i, bug in enumerate([None, *j.params["bugs"]]):
        name = bug or NO_BUG
        if j.should_stop():
            return
        j.update(message=f"{name}: running the checks")
        with inject_bug(view, bug):
            results = [
                _check(logits_vs_transformers, view, ids),
                _check(cached_equals_uncached, view, [ids], n, cache_kind="concat"),
                _check(multi_token_append, view, [ext], len(ids), APPEND, cache_kind="concat"),
            ]
            j.update(message=f"{name}: generating text")
            tokens = generate(view, [ids], n, use_cache=True, cache_kind="concat")[0].tolist()
        j.results.setdefault("tokens", {})[name] = tokens
        for check, (passed, detail, value) in zip(CHECKS, results, strict=True):
            j.rows.append({"bug": name, "check": check, "passed": passed, "detail": detail,
                           "value": value})
        j.update(done=i + 1, message=f"{name}: done")


def _md(text: str) -> str:
    """Text shown literally inside markdown (model output may hold *, _, $, [ ...)."""
    out = "".join("\\" + c if c in "\\`*_{}[]()#+-.!|$<>~:" else c for c in text)
    return out.replace("\n", " ")


def _text(tokens: list[int]) -> str:
    try:
        return decode(tokens)
    except TokenizerError:
        return " ".join(map(str, tokens))


if run_clicked:
    try:
        ids = encode(prompt)
    except TokenizerError as exc:
        st.error(str(exc))
        st.stop()
    room = block - n_new
    if not ids:
        st.error("The prompt is empty: type at least one word.")
        st.stop()
    if len(ids) + max(n_new, max(APPEND)) > block:
        st.error(f"The prompt is {len(ids)} tokens; with {n_new} new tokens this model "
                 f"({block} tokens) allows at most {max(room, 0)} prompt tokens.")
        st.stop()
    job = Job("correctness", f"correctness checks, {choice.model}", choice.device,
              params={"ids": ids, "new": n_new, "bugs": list(bugs)}, total=len(bugs) + 1,
              unit="bug settings")
    st.session_state[KEY] = start_job(job, _work, lambda j: None)
    busy = True


def _draw(j: Job) -> None:
    if not j.rows:
        st.caption("Waiting for the first results…")
        return
    st.plotly_chart(check_matrix_figure(pd.DataFrame(list(j.rows))), width="stretch")
    st.caption("Each row switches one bug on; red cells are checks that fail, so they catch "
               "it. The full forward never uses the cache, so it sees none of them; single-token "
               "decode is blind to the cache order, because attention does not care about the "
               "order of the keys. Only the multi-token append sees every bug.")


if job is not None and busy:
    live_panel(KEY, _draw)
elif job is not None:
    finished_banner(job)
    base = [r for r in job.rows if r["bug"] == NO_BUG]
    if base:
        for col, r in zip(st.columns(3), base, strict=False):
            col.metric(r["check"], "passes" if r["passed"] else "FAILS")
            col.caption(r["detail"])
    _draw(job)
    tokens = job.results.get("tokens", {})
    if tokens:
        st.subheader("What the text turns into")
        good = tokens.get(NO_BUG, [])
        for name, toks in tokens.items():
            at = next((i for i, (a, b) in enumerate(zip(toks, good, strict=False)) if a != b),
                      None)
            with st.container(border=True):
                what = BUG_DESCRIPTIONS.get(name, "the engine as it is")
                verdict = ("the reference" if name == NO_BUG else "same tokens as without the bug"
                           if at is None else f"differs from new token {at} on (in red)")
                st.markdown(f"**{name}** — {_md(what)} · *{verdict}*")
                same, rest = (toks, []) if at is None else (toks[:at], toks[at:])
                st.markdown(_md(prompt) + (f":blue[{_md(_text(same))}]" if same else "")
                            + (f":red[{_md(_text(rest))}]" if rest else ""))
        st.caption("Greedy generation with the concatenating cache under each bug. A wrong value "
                   "in the right shape never crashes: the text just goes wrong."
                   + (" With random weights every line is gibberish, but a changed line still "
                      "shows the bug." if model.weights_label.startswith("random") else ""))
    with st.expander("Every check's detail"):
        st.dataframe(pd.DataFrame(job.rows), hide_index=True)
else:
    st.info("Press **Run the checks**. On gpt2 this takes a little while on a CPU: every bug "
            "runs the three checks and one generation.")
