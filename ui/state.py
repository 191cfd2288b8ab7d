"""Sidebar choices shared by every page, the model cache, and small session helpers.

Contract: ``sidebar()`` draws the model / weights / device / dtype pickers (their widget keys keep
the choice across page switches) and stores a ``Choice`` in ``st.session_state["choice"]``;
``get_model()`` loads that choice once per server (``st.cache_resource``, bounded entries) or
shows a one-line error and returns None. The cached model is SHARED by every browser session:
pages must never change it; ``private_view`` gives a copy whose switches (the bug switch) are
its own. ``results_dir()`` is ``$KVLAB_RESULTS_DIR`` or ``results/``. With ``KVLAB_TINY=1`` a
"tiny" preset (2 layers, width 64, 128 tokens, GPT-2's vocabulary) is offered first: tests and
smoke runs use it.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

import streamlit as st
import torch

from engine import PRESETS, GPTConfig, load_model
from engine.model import GPT
from engine.modes import MODES
from engine.weights import WeightsError

MODEL_CACHE_ENTRIES = 2  # a gpt2-xl in fp32 is 6 GB: keep at most two models resident
REPO_ROOT = Path(__file__).resolve().parent.parent
TINY = dict(n_layer=2, n_head=2, n_embd=64, block_size=128, vocab_size=50257)
WEIGHT_CHOICES = ["auto", "random", "pretrained", "local folder"]
RUN_ICON = ":material/play_arrow:"  # material icons render everywhere; emoji need a font


@dataclass(frozen=True)
class Choice:
    model: str
    weights: str
    device: str
    dtype: str


def tiny_enabled() -> bool:
    return os.environ.get("KVLAB_TINY", "") not in ("", "0", "false", "no")


def presets() -> list[str]:
    return (["tiny"] if tiny_enabled() else []) + list(PRESETS)


def results_dir() -> Path:
    """Where runs are saved and listed: $KVLAB_RESULTS_DIR, else the repository's results/."""
    env = os.environ.get("KVLAB_RESULTS_DIR")
    return Path(env) if env else REPO_ROOT / "results"


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
    if model == "tiny":  # a testing shape: always seeded random weights, lively enough to differ
        torch_dtype = getattr(torch, dtype)
        tiny = GPT.random(GPTConfig(**TINY), seed=0, device=device, dtype=torch_dtype, std=0.2)
        tiny.weights_fallback = None  # type: ignore[assignment]
        return tiny.requires_grad_(False)
    return load_model(model, weights=weights, device=device, dtype=dtype)


def _keep_valid(key: str, options: list[str], what: str) -> None:
    """Replace a requested choice that is not offered here (cuda without a GPU, say), saying so."""
    if key in st.session_state and st.session_state[key] not in options:
        bad = st.session_state.pop(key)
        st.sidebar.warning(f"{what} {bad!r} is not available here; allowed: "
                           f"{', '.join(options)}. Using {options[0]}.")


def sidebar() -> Choice:
    """Draw the shared sidebar; the keys keep the choice across page switches."""
    sb = st.sidebar
    sb.header("Model")
    names = presets()
    _keep_valid("model", names, "Model preset")
    model = sb.selectbox("Preset", names, key="model",
                         help="GPT-2 shapes: gpt2 is the write-up's 124M model.")
    weights = sb.selectbox(
        "Weights", WEIGHT_CHOICES, key="weights",
        help="auto: OpenAI's weights when they can be loaded, else seeded random weights "
        "of the same shapes. Timings and memory do not depend on weight values.",
    )
    if weights == "local folder":
        weights = sb.text_input("Checkpoint folder", key="weights_path",
                                placeholder="/path/to/save_pretrained/folder") or "random"
    devices = available_devices()
    _keep_valid("device", devices, "Device")
    device = sb.selectbox("Device", devices, key="device")
    dtypes = available_dtypes(device)
    _keep_valid("dtype", dtypes, "dtype")
    dtype = sb.selectbox("dtype", dtypes, key="dtype")
    choice = Choice(model, weights, device, dtype)
    st.session_state["choice"] = choice
    return choice


def current_choice() -> Choice:
    return st.session_state.get("choice") or Choice(presets()[0], "auto", available_devices()[0],
                                                    "float32")


def get_model(choice: Choice | None = None, quiet: bool = False) -> GPT | None:
    """Load (once) the model the sidebar names; show an error and return None if it fails."""
    choice = choice or current_choice()  # the sidebar's, or the defaults on a page's first load
    try:
        with st.spinner(f"Loading {choice.model} ({choice.weights}) on {choice.device}…"):
            model = cached_model(choice.model, choice.weights, choice.device, choice.dtype)
    except (WeightsError, ValueError, RuntimeError, OSError) as exc:
        st.error(f"Could not load the model: {exc} Choose random weights in the sidebar to "
                 "measure with the same shapes.")
        return None
    label = model.weights_label
    if label.startswith("random") and not quiet:
        reason = getattr(model, "weights_fallback", None)
        st.warning(
            f"**Random weights** ({label}). Text will be gibberish; timings and memory are "
            "the real ones for these shapes." + (f" Pretrained weights: {reason}." if reason
                                                 else "")
        )
    return model


def private_view(model: GPT) -> GPT:
    """A GPT object of its own that shares the (read-only) weights of ``model``.

    ``copy.copy`` of an nn.Module copies its attribute dict, not its parameters: switches set on
    the view (``bugs``) stay on the view, while sessions using the shared model see none of
    them. It costs no memory, unlike a deepcopy (500 MB for gpt2), and keeps the real weights.
    """
    view = copy.copy(model)
    view.bugs = frozenset()
    return view


def mode_choices(model: GPT) -> tuple[list[str], dict[str, str]]:
    """Decode modes this model can run now, and why each other one cannot."""
    usable: list[str] = []
    missing: dict[str, str] = {}
    for name, spec in MODES.items():
        try:
            ok, why = spec.available(model)
        except Exception as exc:  # a mode module that fails to import is just unavailable
            ok, why = False, f"{type(exc).__name__}: {exc}"
        if ok:
            usable.append(name)
        else:
            missing[name] = why
    return usable, missing


def mode_label(name: str) -> str:
    spec = MODES.get(name)
    if spec is None:
        return name
    return spec.label + (" ⏳" if getattr(spec, "slow_setup", False) else "")


def is_cpu(choice: Choice | None = None) -> bool:
    return (choice or current_choice()).device == "cpu"


CPU_NOTE = (
    "On this CPU a decode step is **memory-bandwidth bound**: each token must stream every "
    "weight from RAM, so the floor is bytes ÷ bandwidth. The write-up's A40 floor was per-step "
    "**overhead** (Python and kernel launches), not bandwidth — compare shapes, not the numbers."
)
