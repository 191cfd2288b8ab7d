"""Overview: the device, the model and its weights, library versions, and a guide to the pages.

Device facts come from ``engine.hardware.describe_device`` and ``lookup_peaks``; the quick
microbenchmarks run only when asked (``ui.device.run_bench``) and stay in the session.
"""

from __future__ import annotations

import platform
from importlib import metadata

import streamlit as st

from engine import costs
from engine.hardware import describe_device, lookup_peaks
from ui.device import get_bench, run_bench
from ui.state import CPU_NOTE, current_choice, get_model, is_cpu

GUIDE = [
    ("pages/generate.py", "Generate side by side",
     "One prompt, generated with and without the cache; are the tokens identical?"),
    ("pages/sweep.py", "Latency sweep",
     "Time per token against context for each decode mode, drawn live (Figures 1–3)."),
    ("pages/flops.py", "FLOPs vs time",
     "1000× fewer FLOPs, a few × less time: achieved TFLOP/s and a roofline (Figures 4–5)."),
    ("pages/floor.py", "Floor lab",
     "What sets the cached step's floor: profiler attribution, matmul staircase, batch and size."),
    ("pages/memory.py", "Memory",
     "Weights, KV cache, masks and workspace; when the cache outgrows the weights (Figure 6)."),
    ("pages/correctness.py", "Correctness lab",
     "Checks against transformers, and the silent bugs each check can or cannot see."),
    ("pages/results.py", "Results",
     "Every saved run, overlaid across machines, with the write-up's A40 numbers."),
]
LIBRARIES = ("torch", "transformers", "streamlit", "plotly", "pandas", "numpy", "tiktoken")


def _gib(n: float | None) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "?"


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


st.title("KV Cache Lab")
st.markdown("A GPT-2 written from scratch, with a KV cache, measured live on this machine: "
            "where the time and the memory of text generation actually go.")
choice = current_choice()
if is_cpu(choice):
    st.info(CPU_NOTE, icon=":material/memory:")

dev_col, model_col = st.columns(2)
with dev_col:
    st.subheader("Device")
    try:
        facts = describe_device(choice.device)
    except (RuntimeError, ValueError) as exc:
        st.error(f"The device {choice.device!r} cannot be used: {exc}")
        facts = None
    if facts is not None:
        st.markdown(f"**{facts['name']}** ({facts['kind']})")
        a, b, c = st.columns(3)
        a.metric("Memory", _gib(facts.get("total_memory_bytes")))
        if facts["kind"] == "cpu":
            b.metric("Cores / threads", f"{facts.get('cores') or '?'} / {facts.get('threads')}")
            c.metric("torch threads", str(facts.get("torch_threads")))
            if facts.get("capability"):
                st.caption(f"Vector extensions: {facts['capability']}")
        else:
            b.metric("Compute capability", str(facts.get("capability")))
            c.metric("SMs", str(facts.get("multiprocessors")))
        spec = lookup_peaks(facts["name"]) if facts["kind"] == "cuda" else None
        if spec is not None:
            peak = spec.peak_tflops(choice.dtype) or spec.fp32_tflops
            st.markdown(f"Listed peaks ({spec.source}): **{peak:g} TFLOP/s** {choice.dtype}, "
                        f"**{spec.mem_bandwidth_gbps:g} GB/s** memory bandwidth.")
        else:
            st.caption("No datasheet peaks are listed for this device; measure them below.")
        bench = get_bench(choice.device, choice.dtype)
        if st.button("Measure peaks here (about 3 s)", key="overview_bench"):
            bench = run_bench(choice.device, choice.dtype)
        if bench:
            a, b = st.columns(2)
            a.metric(f"matmul {bench['matmul_n']}³ ({bench['dtype']})",
                     f"{bench['matmul_tflops']:.3g} TFLOP/s")
            b.metric("read bandwidth", f"{bench['read_gbps']:.1f} GB/s",
                     help=f"sum of a {bench['bytes'] / 2**20:.0f} MiB tensor; copy: "
                     f"{bench['copy_gbps']:.1f} GB/s (read + write)")
            st.caption("Measured peaks are what a large matmul and a streaming read reach "
                       "here; the FLOPs page draws them as the roofline.")

with model_col:
    st.subheader("Model")
    model = get_model(quiet=True)
    if model is not None:
        cfg = model.config
        label = model.weights_label
        if label.startswith("random"):
            st.warning(f"**Random weights** — {label}. Generated text is gibberish; timings and "
                       "memory are those of the real shapes.")
        else:
            st.success(f"**{label}**")
        a, b, c = st.columns(3)
        a.metric("Preset", choice.model)
        b.metric("Parameters", f"{model.num_params() / 1e6:.1f} M")
        c.metric("Context limit (tokens)", f"{cfg.block_size:,}")
        a, b, c = st.columns(3)
        a.metric("Layers × heads × width", f"{cfg.n_layer} × {cfg.n_head} × {cfg.n_embd}")
        b.metric(f"Weights ({choice.dtype})",
                 f"{costs.weight_bytes(cfg, choice.dtype) / 2**20:.0f} MiB")
        c.metric("KV cache per token",
                 f"{costs.kv_bytes_per_token(cfg, choice.dtype) / 2**10:.0f} KiB")
        st.caption(f"On {choice.device}, {choice.dtype}. Change the model, weights, device and "
                   "dtype in the sidebar; every page uses the same choice.")

st.subheader("The pages")
for path, title, what in GUIDE:
    link, text = st.columns([1, 3], vertical_alignment="center")
    link.page_link(path, label=title)
    text.markdown(what)

with st.expander("Library versions"):
    versions = {name: _version(name) for name in LIBRARIES}
    versions["python"] = platform.python_version()
    st.dataframe([{"library": k, "version": v} for k, v in versions.items()], hide_index=True)
