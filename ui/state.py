"""Sidebar choices shared by every page, and the model cache.

The model is cached per (model, weights, device, dtype, mask) with a bounded number of entries;
nothing per-run (no KV cache, no results) is ever cached or shared between sessions.
"""

from __future__ import annotations

from dataclasses import dataclass

import streamlit as st
import torch

from engine import PRESETS, load_model
from engine.model import GPT
from engine.weights import WeightsError

MODEL_CACHE_ENTRIES = 2  # a gpt2-xl in fp32 is 6 GB: keep at most two models resident


@dataclass(frozen=True)
class Choice:
    model: str
    weights: str
    device: str
    dtype: str


def available_devices() -> list[str]:
    return ["cuda", "cpu"] if torch.cuda.is_available() else ["cpu"]


def available_dtypes(device: str) -> list[str]:
    if device == "cuda":
        out = ["float32", "float16"]
        if torch.cuda.is_bf16_supported():
            out.insert(1, "bfloat16")
        return out
    return ["float32", "bfloat16"]


@st.cache_resource(max_entries=MODEL_CACHE_ENTRIES, show_spinner=False)
def cached_model(model: str, weights: str, device: str, dtype: str) -> GPT:
    return load_model(model, weights=weights, device=device, dtype=dtype)


def sidebar() -> Choice:
    """Draw the shared sidebar; the keys keep the choice across page switches."""
    sb = st.sidebar
    sb.header("Model")
    model = sb.selectbox("Preset", list(PRESETS), key="model")
    weights = sb.selectbox(
        "Weights", ["auto", "random", "pretrained", "local folder"], key="weights",
        help="auto: OpenAI's weights when they can be loaded, else seeded random weights "
        "of the same shapes. Timings and memory do not depend on weight values.",
    )
    if weights == "local folder":
        weights = sb.text_input("Checkpoint folder", key="weights_path",
                                placeholder="/path/to/save_pretrained/folder") or "random"
    devices = available_devices()
    device = sb.selectbox("Device", devices, key="device")
    dtype = sb.selectbox("dtype", available_dtypes(device), key="dtype")
    choice = Choice(model, weights, device, dtype)
    st.session_state["choice"] = choice
    return choice


def get_model(choice: Choice | None = None) -> GPT | None:
    """Load (once) the model the sidebar names; show an error and return None if it fails."""
    choice = choice or st.session_state.get("choice")
    if choice is None:
        return None
    try:
        with st.spinner(f"Loading {choice.model} ({choice.weights}) on {choice.device}…"):
            model = cached_model(choice.model, choice.weights, choice.device, choice.dtype)
    except (WeightsError, ValueError) as exc:
        st.error(f"Could not load the model: {exc}")
        return None
    label = model.weights_label
    if label.startswith("random"):
        reason = getattr(model, "weights_fallback", None)
        st.warning(
            f"**Random weights** ({label}). Text will be gibberish; timings and memory are "
            "the real ones for these shapes." + (f" Pretrained weights: {reason}." if reason
                                                 else "")
        )
    return model
