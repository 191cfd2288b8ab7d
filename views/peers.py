"""Peers: transformers, CTranslate2, ONNX Runtime and OpenVINO on our weights, beside our modes.

Inputs -> ``PeersParams`` -> the "peers" experiment in the measuring process (``ui.jobs``; every
engine is gated on mode 1's logits, then timed in interleaved rounds with the read floor) ->
figures from ``ui.figures_peers`` and the verdict computed from the run
(``instruments.store.peers_report.verdict``). A peer whose package is missing is listed with its
install command, never a traceback.
"""

from __future__ import annotations

import streamlit as st

from instruments import lineup
from instruments.experiments import to_dict
from instruments.experiments.inputs import parse_contexts
from instruments.experiments.peers import PeersParams
from instruments.process.client import Job
from instruments.store.peers_report import verdict
from ui import header, jobs
from ui.figures_peers import not_run, peers_figure, peers_table
from ui.state import RUN_ICON, mode_label

KEY = "peers_job"

choice = header.page("Peers", "Other inference engines holding the same weights -- "
                     "transformers, CTranslate2, ONNX Runtime, OpenVINO -- each checked against "
                     "mode 1's logits, then timed step by step beside our exact modes, round "
                     "after round, with a read of the weights as the floor.")
cfg = header.model(choice)
block = cfg.block_size
spec0 = PeersParams.defaults(choice.device, cfg)
usable_peers, missing_peers = lineup.peer_choices(choice.device, cfg.family)
ours_usable = lineup.choices(choice.device, cfg.family, with_peers=False)[0]
job = jobs.get(KEY)

with st.expander("What to measure", expanded=job is None):
    c1, c2 = st.columns(2)
    contexts_text = c1.text_input("Context lengths", ", ".join(map(str, spec0.contexts)),
                                  key="peers_contexts",
                                  help=f"Whole numbers 2..{block}, separated by commas.")
    picked_peers = c2.multiselect("Peers", usable_peers, default=usable_peers,
                                  key="peers_peers", format_func=mode_label)
    if missing_peers:
        c2.caption("Not available here: " + "; ".join(
            f"{name} ({why})" for name, why in missing_peers.items()))
    picked_ours = c1.multiselect("Our modes beside them", ours_usable,
                                 default=[m for m in lineup.with_role("peer_baseline")
                                          if m in ours_usable],
                                 key="peers_ours", format_func=mode_label)
    c3, c4, c5 = st.columns(3)
    rounds = c3.number_input("Rounds", 1, 20, spec0.rounds, key="peers_rounds",
                             help="Every engine at every context, round after round; the "
                             "median is over the rounds' medians.")
    steps = c4.number_input("Steps per round", 1, 100, spec0.steps, key="peers_steps",
                            help="Timed steps per engine, context and round (p90 needs 10 "
                            "samples in all).")
    threads = c5.number_input("Threads (0: the process's)", 0, 64, 0, key="peers_threads",
                              help="torch, CTranslate2 and ONNX Runtime threads for this run.")
    clicked = st.button("Time the peers", type="primary", disabled=jobs.running(KEY),
                        icon=RUN_ICON)

if clicked:
    try:
        params = PeersParams(parse_contexts(contexts_text, block), list(picked_peers),
                             list(picked_ours), int(threads) or None, int(rounds), int(steps))
        params.check(cfg, choice.device)
    except ValueError as exc:
        st.error(str(exc))
        st.stop()
    jobs.start(KEY, "peers", to_dict(params), f"peers, {choice.model}, "
               f"{len(params.peers)} peers × {len(params.contexts)} contexts")


def _draw(j: Job) -> None:
    df = jobs.rows(j, "peers")
    if not j.finished:
        st.caption(j.message)
        return
    log_y = st.toggle("log y", False, key="peers_logy")
    st.plotly_chart(peers_figure(df, log_y=log_y), width="stretch")
    st.caption("Median time per decode step (lines; dotted: peers) over the rounds' medians "
               "(faint points), and the time to read the Linear weights once (dashed), measured "
               "in the same process between the steps: the best of a sum and a matrix-vector "
               "product over that many bytes.")
    rows = (j.run or {}).get("tables", {}).get("peers", [])
    for line in verdict(rows):
        st.info(line, icon=":material/trophy:")
    if "context_len" in df.columns:
        for t in sorted(df["context_len"].dropna().unique()):
            st.subheader(f"At {int(t)} tokens")
            st.dataframe(peers_table(df, int(t)), hide_index=True, column_config={
                c: st.column_config.NumberColumn(c, format="%.2f") for c in (
                    "median (ms)", "p90 (ms)", "× read floor", "× our fastest exact",
                    "set-up (s)")} | {
                "logits max |Δ| vs mode 1": st.column_config.NumberColumn(format="%.2g"),
                "weights held (MB)": st.column_config.NumberColumn(format="%.0f")})
    skipped = not_run(df)
    if not skipped.empty:
        st.subheader("Not timed")
        st.dataframe(skipped, hide_index=True)
    checks = jobs.rows(j, "checks")
    if not checks.empty:
        with st.expander("Logits checks against mode 1"):
            st.dataframe(checks, hide_index=True)


jobs.section(KEY, _draw, table="peers", stem="peers",
             empty="Choose engines and contexts and press **Time the peers**. Peers are "
             f"registered in `instruments.lineup.peers` ({', '.join(lineup.PEERS)}).")
