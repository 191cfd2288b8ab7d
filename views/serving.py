"""Serving: many requests at once, batched continuously over the paged block pool.

Inputs -> ``ServingParams`` (checked by its ``check``) -> the "serving" experiment in the
measuring process (``ui.jobs``: queued, Stop keeps what was measured, saved to results/) ->
figures from ``ui.figures_serving``. While the run goes on: the batch over time, the block
pool filling (from the "live" step rows, two a second at most), and the throughput and
percentile curves as points arrive. Once it has ended: the same from every step of the run,
and the experiment's own figures (the step against its floor; the budget's preemptions; the
policies' hit rates; the peers). Saved runs of the same experiment are overlaid beneath. This
page measures nothing.
"""

from __future__ import annotations

import importlib.util

import streamlit as st

from instruments.experiments.serving import EXPERIMENTS, WAYS, ServingParams
from instruments.process.client import Job
from instruments.store.frames import table_frame
from ui import header, jobs
from ui.figures_serving import (
    batch_figure,
    experiment_of,
    points_table,
    pool_figure,
    step_figure,
    throughput_figure,
)
from ui.figures_serving import latency_figure as percentiles_figure
from ui.figures_serving_http import http_figure, http_points
from ui.figures_serving_runs import (
    budget_figure,
    budget_timeline_figure,
    overlay_figure,
    schedule_figure,
)
from ui.runs import saved_runs
from ui.state import RUN_ICON, results_dir, shown_path

KEY = "serving_job"
TITLES = {"concurrency": "Concurrency (closed loop)", "load": "Load (Poisson arrivals)",
          "budget": "KV budget (preemption)", "schedule": "Schedule (FCFS vs prefix match)"}
PEERS_HERE = importlib.util.find_spec("instruments.peers.serving") is not None

choice = header.page("Serving", "Many requests at once: a scheduler admits them under a KV "
                     "budget, batches their decode steps continuously with chunked prefill, "
                     "and preempts the newest when the pool runs out. Here: the batch and the "
                     "block pool over time, throughput and latency percentiles against load.")
cfg = header.model(choice)
base = ServingParams.defaults(choice.device, cfg)
job = jobs.get(KEY)


def _numbers(text: str, cast: type, what: str, allowed: str) -> list:
    try:
        return [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"cannot read the {what} {text!r}; allowed: {allowed} separated by "
                         "commas") from None


def _join(values: list) -> str:
    return ", ".join(f"{v:g}" for v in values)


with st.expander("What to serve", expanded=job is None):
    experiment = st.radio("Experiment", EXPERIMENTS, format_func=TITLES.get, horizontal=True,
                          key="serving_experiment")
    p = ServingParams.defaults(choice.device, cfg)
    p.experiment, p.peers = experiment, False
    c1, c2, c3, c4, c5 = st.columns([2, 2, 1.2, 1.2, 1.2])
    if experiment == "concurrency":
        conc_text = c1.text_input("Concurrencies (clients)", _join(base.concurrency),
                                  key="serving_conc", help="Whole numbers 1..1024: each a "
                                  "closed loop of that many clients.")
        p.rounds = int(c5.number_input("Requests per client", 1, 100, base.rounds,
                                       key="serving_rounds"))
        p.peers = c2.toggle("Peers too", False, key="serving_peers", disabled=not PEERS_HERE,
                            help="Other engines' batched decoding on the same requests, gated "
                            "on their tokens." + ("" if PEERS_HERE else " Not in this checkout "
                                                  "(instruments.peers.serving)."))
    elif experiment == "load":
        rates_text = c1.text_input("Arrival rates (requests/s)", _join(base.rates),
                                   key="serving_rates")
        p.ways = list(c2.multiselect("Ways", WAYS, WAYS, key="serving_ways", help="single: one "
                                     "request at a time; static: batches of max sequences "
                                     "run to the end; continuous: batched step by step."))
        p.slo_ttft_ms = float(c3.number_input("SLO: TTFT ≤ (ms)", 1.0, 1e6, base.slo_ttft_ms,
                                              format="%.0f", key="serving_slo_ttft"))
        p.slo_tpot_ms = float(c4.number_input("SLO: TPOT ≤ (ms)", 1.0, 1e6, base.slo_tpot_ms,
                                              format="%.0f", key="serving_slo_tpot"))
    elif experiment == "budget":
        budgets_text = c1.text_input("KV budgets (tokens)", "", key="serving_budgets",
                                     placeholder="from one request's blocks to all of them",
                                     help="Whole numbers; empty: five, spread in log from one "
                                     "request's blocks to every request's.")
    else:
        p.policies = list(c1.multiselect("Policies", ["fcfs", "lpm"], ["fcfs", "lpm"],
                                         key="serving_policies", help="fcfs: first come, "
                                         "first served; lpm: longest prefix match first."))
        p.rates = [float(c3.number_input("Arrivals (requests/s)", 0.01, 1e4, base.rates[0],
                                         key="serving_rate"))]
        budget = int(c2.number_input("KV budget (tokens; 0: a third of the working set)", 0,
                                     10**9, 0, key="serving_budget"))
        p.budgets_tokens = [budget] if budget else []
    if experiment != "concurrency":
        p.requests = int(c5.number_input("Requests per point", 1, 10_000, base.requests,
                                         key="serving_requests"))
    r1, r2, r3, r4, r5, r6 = st.columns(6)
    top = cfg.block_size
    if experiment != "schedule":
        p.prompt_min = int(r1.number_input("Prompt min (tokens)", 1, top, base.prompt_min,
                                           key="serving_pmin"))
        p.prompt_max = int(r2.number_input("Prompt max (tokens)", 1, top, base.prompt_max,
                                           key="serving_pmax"))
    p.output_min = int(r3.number_input("Output min (tokens)", 1, top, base.output_min,
                                       key="serving_omin"))
    p.output_max = int(r4.number_input("Output max (tokens)", 1, top, base.output_max,
                                       key="serving_omax"))
    p.max_seqs = int(r5.number_input("Max sequences", 1, 1024, base.max_seqs,
                                     key="serving_seqs", help="The most requests running at "
                                     "once (concurrency: each point's own)."))
    p.step_tokens = int(r6.number_input("Step tokens", 1, 65_536, base.step_tokens,
                                        key="serving_step", help="Tokens one step may run: "
                                        "decodes first, prefill chunks in what is left."))
    clicked = st.button("Serve", type="primary", icon=RUN_ICON, disabled=jobs.running(KEY),
                        key="serving_go")

if clicked:
    try:
        if experiment == "concurrency":
            p.concurrency = _numbers(conc_text, int, "concurrencies", "whole numbers 1..1024")
        elif experiment == "load":
            p.rates = _numbers(rates_text, float, "rates", "numbers above 0")
        elif experiment == "budget":
            p.budgets_tokens = _numbers(budgets_text, int, "budgets", "whole numbers of tokens")
    except ValueError as exc:
        st.error(str(exc))
    else:
        jobs.start_checked(KEY, "serving", p, f"serving ({experiment}), {choice.model}", cfg,
                           choice.device)
        job = jobs.get(KEY)


def _meta(j: Job) -> dict:
    """The run's meta (the start's while it runs), naming the experiment the job asked for."""
    meta = dict((j.run or {}).get("meta") or j.meta or {})
    return {**meta, "experiment": j.params.get("experiment", meta.get("experiment"))}


def _chart(fig, key: str) -> None:  # noqa: ANN001 (a plotly figure)
    st.plotly_chart(fig, width="stretch", key=key)


def _over_time(j: Job, steps, points, meta: dict) -> None:  # noqa: ANN001 (DataFrames)
    """The batch and the pool (left) beside throughput and percentiles (right)."""
    peers = jobs.rows(j, "peers")
    left, right = st.columns(2)
    with left:
        _chart(batch_figure(steps, meta), "serving_fig_batch")
        _chart(pool_figure(steps, meta), "serving_fig_pool")
    with right:
        _chart(throughput_figure(points, meta, peers if not peers.empty else None),
               "serving_fig_tput")
        _chart(percentiles_figure(points, meta), "serving_fig_pct")


def _draw(j: Job) -> None:
    meta, points = _meta(j), jobs.rows(j, "points")
    if not j.finished:
        live = jobs.rows(j, "live")
        _over_time(j, live, points, meta)
        done = f"{len(points)} point{'s' if len(points) != 1 else ''}"
        st.caption(f"Live: {len(live)} of the steps so far (two a second at most reach the "
                   f"page), {done} finished. Every step is drawn when the run ends. Times are "
                   "measured steps on the run's own clock.")
        return
    steps = jobs.rows(j, "steps")
    if steps.empty and points.empty:
        return
    _over_time(j, steps, points, meta)
    st.caption("Each point runs on a fresh engine; its steps are laid end to end (dotted "
               "lines). TTFT = first token − arrival (queueing included), TPOT = (finish − "
               "first token) ÷ (output tokens − 1), per request; p99 is drawn from 100 "
               "requests on. All measured: each step's own time on the run's clock.")
    exp = experiment_of(points, meta)
    if exp == "concurrency":
        _chart(step_figure(jobs.rows(j, "batch_steps"), meta), "serving_fig_steps")
        over = meta.get("kv_overtakes_batch")
        st.caption("The decode-only steps at each batch (median: line; each: faint points) "
                   "beside the floor computed from the FLOPs and bytes each step needs and "
                   "the peaks measured at the start of the run. " + (
                       f"K/V reads (computed) overtake the weights' read at batch {over}."
                       if over else "K/V reads (computed) stay under the weights' read at "
                       "every batch measured."))
    elif exp == "load":
        held = meta.get("slo_max_rate") or {}
        share = meta.get("slo_share", 0.9)
        st.info(f"Highest rate holding the SLO (TTFT ≤ {meta.get('slo_ttft_ms'):g} ms and "
                f"TPOT ≤ {meta.get('slo_tpot_ms'):g} ms for {share:.0%} of requests, "
                "measured): " + "; ".join(f"{w}: {f'{r:g}/s' if r else 'none tried'}"
                                         for w, r in held.items()) + ".")
    elif exp == "budget":
        b1, b2 = st.columns(2)
        with b1:
            _chart(budget_figure(points, meta), "serving_fig_budget_pts")
        with b2:
            _chart(budget_timeline_figure(steps, meta), "serving_fig_budget_time")
        st.caption(f"One request at its full length needs {meta.get('one_request_tokens')} "
                   f"tokens of blocks, all {int(points['requests'].max())} at once "
                   f"{meta.get('all_requests_tokens')} (computed).")
    else:
        _chart(schedule_figure(points, meta), "serving_fig_policies")
        st.caption(f"KV budget {meta.get('budget_tokens')} tokens against a working set of "
                   f"{meta.get('working_set_tokens')} (computed); {meta.get('groups')} shared "
                   f"prefixes, arrivals at {meta.get('rate_per_s')} requests/s.")
    peers = jobs.rows(j, "peers")
    if not peers.empty:
        st.subheader("Peers on the same requests")
        st.dataframe(peers, hide_index=True)
    if not points.empty:
        st.dataframe(points_table(points), hide_index=True)


jobs.section(KEY, _draw, table="points", stem="serving",
             empty="Choose an experiment and press **Serve**. The batch and the block pool "
             "are drawn as the run goes on; **Stop** keeps the points finished so far.")

# ------------------------------------------------------------------ saved runs overlaid
st.subheader("Saved runs of this experiment")
mine = [r for r in reversed(saved_runs().runs) if r.get("kind") == "serving"
        and (r.get("tables") or {}).get("points")
        and experiment_of(table_frame([r], "points"), r.get("meta")) == experiment]


def _label(run: dict) -> str:
    m = run.get("meta") or {}
    return (f"{m.get('device_name') or m.get('device')} · {m.get('model')} · {m.get('dtype')} · "
            f"{str(run.get('created_utc', ''))[:16].replace('T', ' ')}"
            + (" (partial)" if m.get("partial") else ""))


labels: dict[str, dict] = {}
for run in mine:
    name = _label(run)
    labels[name if name not in labels else f"{name} [{str(run.get('run_id'))[:6]}]"] = run
if not labels:
    st.caption(f"No saved {TITLES[experiment].lower()} run in `{shown_path(results_dir())}` "
               "yet.")
else:
    newest = str(mine[0].get("run_id"))[:8]  # a run saved since: the newest three again
    chosen = st.multiselect("Runs to overlay", list(labels), list(labels)[:3],
                            key=f"serving_overlay_{experiment}_{newest}", help="Newest first; "
                            "each run names its host.")
    frame = table_frame([labels[k] for k in chosen], "points")
    if not frame.empty:
        frame["run"] = [k for k in chosen for _ in labels[k]["tables"]["points"]]
        o1, o2 = st.columns(2)
        with o1:
            _chart(overlay_figure(frame, "output_tok_s", "output tokens/s (measured)",
                                  experiment), "serving_fig_overlay_tput")
        with o2:
            _chart(overlay_figure(frame, "ttft_p50_ms", "TTFT p50 (ms, measured)",
                                  experiment), "serving_fig_overlay_ttft")
        st.caption("Colour: the run; dash: the way. Files: " + ", ".join(
            f"`{shown_path(labels[k].get('path', ''))}`" for k in chosen) + ".")

# ------------------------------------------------------- over HTTP: guidellm's runs beside ours
http = [r for r in saved_runs().runs if r.get("kind") == "serving_http"]
if http:
    st.subheader("Over HTTP: guidellm against our server and llama-server")
    loop = "closed" if experiment == "concurrency" else "poisson"
    pts = http_points(http + [r for r in saved_runs().runs if r.get("kind") == "serving"])
    h1, h2 = st.columns(2)
    with h1:
        _chart(http_figure(pts, "output_tok_s", "output tokens/s (measured)", loop),
               "serving_fig_http_tput")
    with h2:
        _chart(http_figure(pts, "ttft_p50_ms", "TTFT p50 (ms, measured)", loop),
               "serving_fig_http_ttft")
    st.caption("guidellm's runs are made by `scripts/bench_server.py` "
               "([docs/serving-http.md](docs/serving-http.md)); each line names its host.")
