"""Sidebar choices shared by every page, and small session helpers. Torch-free.

Contract: ``sidebar()`` draws the model / weights / device / dtype pickers (their widget keys keep
the choice across page switches) and stores a ``Choice`` in ``st.session_state["choice"]``. The
models and the weights each offers come from the family table (``instruments.lineup``: every
preset of every family, its weight choices, where its real weights come from).
The devices and dtypes offered come from the device probe (``instruments.process.client``: asked
once per server, in the background; the server never imports torch). While it runs the sidebar
offers the CPU (and its dtypes) at once, its Device label says "probing…" where a GPU may yet
appear, pages show "probing…" where they need the facts, and a fragment at the sidebar's foot
reruns the page when the answer lands (nothing moves but what the answer fills in). The
model itself lives in the device's measuring process, never here. ``results_dir()`` is
``$KVLAB_RESULTS_DIR`` or ``results/``; ``shown_path(path)`` is how a page names a saved file:
relative to the project (``results/...``), or to ``$KVLAB_RESULTS_DIR``, never this machine's
absolute path (it ends up in screenshots).
With ``KVLAB_TINY=1`` the test shapes ("tiny", "llama-tiny") are offered first: tests and smoke
runs use them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import streamlit as st

from instruments import lineup
from instruments.process import client, probe
from instruments.spine import ModelSpec

REPO_ROOT = Path(__file__).resolve().parent.parent
FOLDER = "local folder"  # a checkpoint folder, for the families whose loader reads one
PATH_CHOICE = "a checkpoint at a path…"  # the Model list's last entry: a folder or .gguf file
RUN_ICON = ":material/play_arrow:"  # material icons render everywhere; emoji need a font


@dataclass(frozen=True)
class Choice:
    model: str
    weights: str
    device: str
    dtype: str

    def spec(self) -> ModelSpec:
        return ModelSpec(self.model, self.weights, self.device, self.dtype)

    @property
    def family(self) -> str:
        return lineup.family_of(self.model).name


def tiny_enabled() -> bool:
    return os.environ.get("KVLAB_TINY", "") not in ("", "0", "false", "no")


def presets() -> list[str]:
    """The models offered: the test shapes first when enabled, then every real preset."""
    real = lineup.models()
    tests = [m for m in lineup.models(tests=True) if m not in real]
    return (tests if tiny_enabled() else []) + real


def weight_choices(model: str) -> list[str]:
    """The weights offered for ``model``: its preset's choices (the default first), and a local
    folder where its family reads checkpoints (GPT-2)."""
    p = lineup.preset(model)
    return [*p.weights, *([FOLDER] if "pretrained" in p.weights else [])]


def results_dir() -> Path:
    """Where runs are saved and listed: $KVLAB_RESULTS_DIR, else the repository's results/."""
    env = os.environ.get("KVLAB_RESULTS_DIR")
    return Path(env) if env else REPO_ROOT / "results"


def shown_path(path: str | Path) -> str:
    """``path`` as a page shows it: ``results/x.json`` inside the project,
    ``$KVLAB_RESULTS_DIR/x.json`` inside that folder, else its name under ``~`` or bare."""
    full = Path(path).resolve()
    env = os.environ.get("KVLAB_RESULTS_DIR")
    for root, name in ((REPO_ROOT, ""), (Path(env) if env else None, "$KVLAB_RESULTS_DIR/"),
                       (Path.home(), "~/")):
        if root is not None and full.is_relative_to(root.resolve()):
            return name + full.relative_to(root.resolve()).as_posix()
    return full.name


PROBE_POLL_S = 0.5  # while the probe runs, how often the sidebar looks whether it has landed


def machine() -> dict:
    """This machine's devices: the probe's answer (asked once per server, in the background),
    or until it lands the CPU alone, marked ``"probing": True``. Never waits."""
    return client.machine_now()


def probing() -> bool:
    """Whether the device probe is still running (its facts are not in yet)."""
    return bool(machine().get("probing"))


def more_devices_pending() -> bool:
    """Whether a device may still join the list: the probe runs and torch could drive a GPU."""
    return probing() and probe.gpu_build()


def available_devices() -> list[str]:
    found = machine()["devices"]
    return [d for d in ("cuda", "cpu") if d in found] or ["cpu"]


def available_dtypes(device: str) -> list[str]:
    dtypes = machine()["devices"].get(device, {}).get("dtypes") or ["float32"]
    return [d for d in ("float32", "bfloat16", "float16") if d in dtypes]


def device_facts(device: str) -> dict:
    """The probe's facts of ``device`` (name, kind, memory, cores, ...); while it runs, the CPU's
    name and kind only, with ``"probing": True``."""
    return machine()["devices"].get(device, {"name": device, "kind": device})


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
    names = [*presets(), PATH_CHOICE]
    asked = st.session_state.get("model")
    if asked not in (None, *names) and lineup.is_path(asked):  # a path asked for (deep link)
        st.session_state["model_path"], st.session_state["model"] = asked, PATH_CHOICE
    _keep_valid("model", names, "Model preset")
    model = sb.selectbox("Preset", names, key="model", format_func=_model_label,
                         help="gpt2 is the write-up's 124M model; smollm2-135m a Llama-family "
                         "model (GQA, RoPE, SwiGLU) with real weights from a package; or any "
                         "checkpoint of these architectures at a path.")
    if model == PATH_CHOICE:
        model = _checkpoint_path(sb)
    offered = weight_choices(model)
    there, install = lineup.installed(model)
    if not there:  # its real weights are missing: offer what loads, and say how to get them
        offered = [w for w in offered if w == "random"] or offered
        sb.warning(f"{model}'s real weights are {install}")
    # one Weights widget per preset: a widget kept across presets would show the last preset's
    # choice (gpt2's "auto") after the switch, while the run used the new preset's default
    key = f"weights:{model}"
    if "weights" in st.session_state:  # a choice asked for by name (a test, a deep link)
        st.session_state[key] = st.session_state.pop("weights")
    _keep_valid(key, offered, f"Weights for {model}")
    preset = lineup.preset(model)
    weights = sb.selectbox(
        "Weights", offered, key=key,
        help=(f"{preset.weights[0]}: {preset.source}" if preset.source else "")
        + ("; auto: OpenAI's weights when they can be loaded, else seeded random weights of "
           "the same shapes" if "auto" in offered else "")
        + ". Timings and memory do not depend on weight values; text does.",
    )
    if preset.note:
        sb.caption(preset.note)
    if weights == FOLDER:
        weights = sb.text_input("Checkpoint folder", key="weights_path",
                                placeholder="/path/to/save_pretrained/folder") or "random"
    devices = available_devices()
    pending = more_devices_pending()
    _device_before_picker(devices, pending)
    device = sb.selectbox("Device (GPU: probing…)" if pending else "Device", devices,
                          key="device", on_change=_device_chosen)  # the key is its identity
    dtypes = available_dtypes(device)
    _keep_valid("dtype", dtypes, "dtype")
    dtype = sb.selectbox("dtype", dtypes, key="dtype")
    choice = Choice(model, weights, device, dtype)
    st.session_state["choice"] = choice
    pid = client.running_pid(device)
    threads = client.measuring_threads()
    sb.caption("Measurements run in a process of their own"
               + (f" (pid {pid} on {device})" if pid else "")
               + f" with {threads} torch thread{'s' * (threads > 1)}. $KVLAB_THREADS sets how "
               "many (default: every core but one, kept for this page and the browser).")
    if probing() and client.measuring(device):  # its panel reruns the page: no polling
        sb.caption("Device facts: probing… (the CPU is ready)")
    elif probing():  # last: nothing below it moves when it goes
        with sb:
            _probe_note()
    return choice


def _checkpoint_path(sb: Any) -> str:
    """The checkpoint path typed under the Model list: the model when it reads as one (its
    family and shapes from its config), else the first preset, the reason shown."""
    path = sb.text_input("Checkpoint path", key="model_path",
                         placeholder="/path/to/folder (config.json + *.safetensors) or .gguf",
                         help="Resolved to a family by the architecture its config names; "
                         "config.json alone (no weights) plans and runs with random weights.")
    if path:
        try:
            lineup.preset(path)
            return path
        except ValueError as exc:
            sb.error(str(exc))
    return presets()[0]


def _device_chosen() -> None:
    st.session_state["_device_chosen"] = True


def _device_before_picker(devices: list[str], pending: bool) -> None:
    """The Device picker's state before it draws. While a GPU may still appear, a device asked
    for that is not offered yet waits aside, unrefused. Once the probe has landed it comes back
    (refused with a warning if still not offered), and where the probe found a GPU it becomes
    the choice of a session that saw the CPU alone offered and has not picked a device itself."""
    state = st.session_state
    if pending:
        if state.get("device") not in (None, *devices):
            state["_device_asked"] = state.pop("device")
        state["_device_seen_pending"] = True
        return
    if "_device_asked" in state:
        state["device"] = state.pop("_device_asked")
    elif state.pop("_device_seen_pending", False) and not state.get("_device_chosen"):
        state["device"] = devices[0]
    _keep_valid("device", devices, "Device")


@st.fragment(run_every=PROBE_POLL_S)
def _probe_note() -> None:
    """While the device probe runs: "probing…" at the sidebar's foot, and a rerun of the page
    the moment the answer lands, so it draws the facts (and a GPU joins the Device list)."""
    if not probing():
        st.rerun()
    st.caption("Device facts: probing… (the CPU is ready)")


def first_choice(device: str) -> Choice:
    """What the sidebar offers first on ``device``: the first preset, its default weights,
    float32."""
    model = presets()[0]
    return Choice(model, weight_choices(model)[0], device, "float32")


def current_choice() -> Choice:
    return st.session_state.get("choice") or first_choice(available_devices()[0])


def mode_choices(device: str, family: str | None = None) -> tuple[list[str], dict[str, str]]:
    """Decode modes and peers that can run on ``device`` (and a model of ``family``) now, and
    why each other one cannot."""
    return lineup.choices(device, family)


def _model_label(name: str) -> str:
    if name == PATH_CHOICE:
        return name
    p = lineup.preset(name)
    return f"{name} ({lineup.family_of(name).title}{', test shape' if p.test else ''})"


def mode_label(name: str) -> str:
    try:
        spec = lineup.spec(name)
    except ValueError:
        return name
    return spec.label + (" ⏳" if spec.slow_setup else "")


def is_cpu(choice: Choice | None = None) -> bool:
    return (choice or current_choice()).device == "cpu"


def session_id() -> str | None:
    try:
        from streamlit.runtime.scriptrunner_utils.script_run_context import get_script_run_ctx

        ctx = get_script_run_ctx(suppress_warning=True)
        return ctx.session_id if ctx is not None else None
    except Exception:  # no runtime (bare mode, tests): never orphaned
        return None


def session_alive(sid: str | None) -> bool:
    """False once the browser session ``sid`` has gone (a closed tab)."""
    if sid is None:
        return True
    try:
        from streamlit.runtime import Runtime

        if not Runtime.exists():
            return True
        return Runtime.instance().is_active_session(sid)
    except Exception:
        return True
