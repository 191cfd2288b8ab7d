"""Overview: the device, the model and its weights, library versions, and a guide to the pages.

Device facts come from the probe of this machine (``ui.state.device_facts``) and the datasheet
table (``instruments.measure.specs``); the peaks are measured only when asked, in the measuring
process (the hardware experiment, ``ui.device``), and the model is loaded there too. The page
never waits for either: until the probe lands its facts read "probing…", and the model card is
drawn from the preset's config while the model loads (``header.model``); each fills in on the
rerun that follows.
"""

from __future__ import annotations

import platform
from importlib import metadata

import streamlit as st

from instruments import lineup
from instruments.costmodel import costs
from instruments.measure.specs import lookup_peaks
from instruments.process import client
from instruments.process.client import Job
from ui import device, header, jobs
from ui.state import device_facts, machine, probing

GUIDE = [
    ("views/generate.py", "Generate side by side",
     "One prompt, generated with and without the cache; are the tokens identical?"),
    ("views/sweep.py", "Latency sweep",
     "Time per token against context for each decode mode, drawn live (Figures 1–3)."),
    ("views/peers.py", "Peers",
     "transformers, CTranslate2, ONNX Runtime and OpenVINO on the same weights, beside our step."),
    ("views/flops.py", "FLOPs vs time",
     "1000× fewer FLOPs, a few × less time: achieved TFLOP/s and a roofline (Figures 4–5)."),
    ("views/floor.py", "Floor lab",
     "What sets the cached step's floor, and what gets under it: int8 weights, speculation."),
    ("views/memory.py", "Memory",
     "Weights, KV cache, masks and workspace; when the cache outgrows the weights (Figure 6)."),
    ("views/planner.py", "KV memory planner",
     "How many sequences fit here; what paged blocks, int8 KV or fewer KV heads would save."),
    ("views/prefix.py", "Prefix cache",
     "A prompt's KV kept and reused: TTFT against the cached prefix, a chat, a workload."),
    ("views/serving.py", "Serving",
     "Many requests batched continuously: the batch and block pool over time, tokens/s, TTFT."),
    ("views/correctness.py", "Correctness lab",
     "Checks against transformers, and the silent bugs each check can or cannot see."),
    ("views/results.py", "Results",
     "Every saved run, overlaid across machines, with the write-up's A40 numbers."),
]
LIBRARIES = ("transformers", "streamlit", "plotly", "pandas", "numpy", "tiktoken")
PROBING = "probing…"


def _gib(n: float | None) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "?"


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


_FAMILIES = lineup.family_titles()  # the family table's, so a family added there is named here
SUBTITLE = (f"Language models written from scratch ({', '.join(_FAMILIES[:-1])} and "
            f"{_FAMILIES[-1]} families) decoding with and without a KV cache, measured live on "
            "this machine: where the time and the memory of text generation actually go."
            if len(_FAMILIES) > 1 else
            f"A {_FAMILIES[0]} model written from scratch, decoding with and without a KV cache, "
            "measured live on this machine: where the time and the memory of text generation "
            "actually go.")
choice = header.page("KV Cache Lab", SUBTITLE)

dev_col, model_col = st.columns(2)
with dev_col:
    st.subheader("Device")
    facts = device_facts(choice.device)
    pending = bool(facts.get("probing"))
    st.markdown(f"**{facts.get('name')}** ({facts.get('kind')})")
    a, b, c = st.columns(3)
    a.metric("Memory", PROBING if pending else _gib(facts.get("total_memory_bytes")))
    if facts.get("kind") == "cpu":
        b.metric("Cores / threads", PROBING if pending else
                 f"{facts.get('cores') or '?'} / {facts.get('threads')}")
        c.metric("measuring threads", str(client.measuring_threads()),
                 help="torch threads of the measuring process: every core but one, which is "
                 "kept for this page and the browser ($KVLAB_THREADS sets it)")
        if pending:
            st.caption(f"Vector extensions: {PROBING}")
        elif facts.get("capability"):
            st.caption(f"Vector extensions: {facts['capability']}")
    else:
        b.metric("Compute capability", str(facts.get("capability")))
        c.metric("SMs", str(facts.get("multiprocessors")))
    spec = lookup_peaks(facts.get("name")) if facts.get("kind") == "cuda" else None
    if spec is not None:
        peak = spec.peak_tflops(choice.dtype) or spec.fp32_tflops
        st.markdown(f"Listed peaks ({spec.source}): **{peak:g} TFLOP/s** {choice.dtype}, "
                    f"**{spec.mem_bandwidth_gbps:g} GB/s** memory bandwidth.")
    else:
        st.caption("No datasheet peaks are listed for this device; measure them below.")
    if st.button("Measure peaks here (a few seconds)", key="overview_bench",
                 disabled=jobs.running(device.PEAKS_KEY)):
        device.start_peaks()

    def draw_peaks(job: Job) -> None:
        measured = device.bench(choice.device, choice.dtype)
        if not measured:
            return
        a, b = st.columns(2)
        a.metric(f"matmul {measured['matmul_n']}³ ({measured['dtype']})",
                 f"{measured['matmul_tflops']:.3g} TFLOP/s")
        b.metric("read bandwidth", f"{measured['read_gbps']:.1f} GB/s",
                 help=f"best of a sum and a matrix-vector product over "
                 f"{measured['bandwidth_bytes'] / 2**20:.0f} MiB ({measured['read_kernel']} "
                 f"won); copy: {measured['copy_gbps']:.1f} GB/s (read + write)")
        floor = (job.run["tables"].get("floor") or [{}])[0] if job.run else {}
        if floor.get("floor_ms"):
            st.markdown(f"A decode step that streams the {floor['linear_weight_bytes'] / 1e6:,.0f}"
                        f" MB of Linear weights of {choice.model} cannot beat "
                        f"**{floor['floor_ms']:.3g} ms** here (bytes ÷ measured bandwidth).")
        st.caption("Measured in the measuring process: what a large matmul and a streaming "
                   "read reach here. The FLOPs page draws them as the roofline.")

    jobs.section(device.PEAKS_KEY, draw_peaks, empty="Peaks not measured in this session yet.")

with model_col:
    st.subheader("Model")
    cfg = header.model(choice, quiet=True)  # the preset's shapes while it loads
    label = header.weights_label(choice)
    if label is None:
        header.loading_note(choice)
    elif label.startswith("random"):
        why = (client.known_info(choice.spec()) or {}).get("weights_fallback")
        st.warning(f"**Random weights** — {label}. Generated text is gibberish; timings and "
                   "memory are those of the real shapes."
                   + header.fallback_note(why))
    else:
        st.success(f"**{label}**")
    a, b, c = st.columns(3)
    a.metric("Preset", choice.model)
    b.metric("Parameters", f"{costs.param_count(cfg) / 1e6:.1f} M")
    c.metric("Context limit (tokens)", f"{cfg.block_size:,}")
    a, b, c = st.columns(3)
    a.metric("Layers", f"{cfg.n_layer}",
             help=f"{cfg.n_head} heads of {cfg.n_embd // cfg.n_head} dimensions each; width "
             f"{cfg.n_embd}")
    b.metric(f"Weights ({choice.dtype})",
             f"{costs.weight_bytes(cfg, choice.dtype) / 2**20:.0f} MiB")
    c.metric("KV cache per token",
             f"{costs.kv_bytes_per_token(cfg, choice.dtype) / 2**10:.0f} KiB")
    st.caption(f"{cfg.n_layer} layers × {cfg.n_head} heads × width {cfg.n_embd}, on "
               f"{choice.device}, {choice.dtype}. Change the model, weights, device and dtype in "
               "the sidebar; every page uses the same choice.")

st.subheader("The pages")
for path, title, what in GUIDE:
    link, text = st.columns([1, 3], vertical_alignment="center")
    link.page_link(path, label=title)
    text.markdown(what)

with st.expander("Library versions"):
    versions = {"torch (measuring process)": PROBING if probing() else
                str(machine().get("torch"))}
    versions.update({name: _version(name) for name in LIBRARIES})
    versions["python"] = platform.python_version()
    st.markdown("| library | version |\n|---|---|\n"  # a table without Arrow: no pyarrow
                + "\n".join(f"| {k} | {v} |" for k, v in versions.items()))
