"""The one page header: the title, and what the chosen model is.

``page(title, caption)`` -> the sidebar's ``Choice``. ``model(choice)`` -> the model's shape
(``ModelConfig``) without waiting for the model: a preset's shapes come from its config
(torch-free) while the model loads in its device's measuring process in the background, and
``await_model(choice)`` says "Loading…" and reruns the page once the load has ended; then a
yellow banner for random weights, or the error (the page stops) when the model cannot be loaded.
A page is therefore drawn, and its Run pressable, at once on a fresh server: a run asked for
meanwhile queues behind the load. ``model(choice, wait=True)`` (and a model without preset shapes,
a local folder) waits for the load instead. Nothing here imports torch.
"""

from __future__ import annotations

import streamlit as st

from engine.models.config import ModelConfig
from instruments import lineup
from instruments.process import client
from ui.state import Choice, current_choice


def page(title: str, caption: str) -> Choice:
    st.title(title)
    st.caption(caption)
    return current_choice()


def _preset_config(choice: Choice) -> ModelConfig | None:
    if choice.model in lineup.models(tests=True) and not _is_folder(choice):
        return lineup.config(choice.model)
    return None


def _is_folder(choice: Choice) -> bool:
    return choice.weights not in lineup.preset(choice.model).weights


def model(choice: Choice | None = None, quiet: bool = False, wait: bool = False) -> ModelConfig:
    """The chosen model's shape: a preset's at once, its load started in the background (see
    the top; ``quiet`` leaves the weights' banner and the "Loading…" line to the caller).
    ``wait=True``, or a model without preset shapes (a local folder): loaded first."""
    choice = choice or current_choice()
    spec = choice.spec()
    info = client.known_info(spec)
    if info is None and not wait and _preset_config(choice) is not None:
        client.load_soon(spec)
        error = client.load_error(spec)
        if error is not None:
            _cannot_load(error)
    elif info is None:
        try:
            with st.spinner(f"Loading {spec.describe()} in the measuring process…"):
                info = client.model_info(spec)
        except ValueError as exc:
            _cannot_load(str(exc))
    cfg = (lineup.config_from_dict(info["config"], info.get("family")) if info
           else _preset_config(choice))
    if cfg is None:
        st.info(f"The device is busy; {spec.describe()} loads when it is free.")
        st.stop()
    label = (info or {}).get("weights_label") or ("random" if choice.weights == "random"
                                                  else None)
    if not quiet:
        if label and label.startswith("random"):
            reason = (info or {}).get("weights_fallback")
            st.warning(f"**Random weights** ({label}). Text will be gibberish; timings and "
                       "memory are the real ones for these shapes."
                       + fallback_note(reason))
        elif label is None:
            loading_note(choice)
        else:  # real weights: say which, so a reader knows the text is the model's own
            st.caption(f"Weights: {label}.")
    return cfg


def _cannot_load(why: str) -> None:
    st.error(f"Could not load the model: {why} Choose random weights in the sidebar to "
             "measure with the same shapes.")
    st.stop()


LOAD_POLL_S = 0.5  # while the model loads in the background, how often a page looks


def loading_note(choice: Choice) -> None:
    """Where the weights' banner will be: "Loading…", rerun when the load ends
    (``await_model``); while a measurement holds or waits for the device, a line without the
    polling (that measurement's panel reruns the page)."""
    if client.measuring(choice.device):
        st.caption(f"Which weights {choice.spec().describe()} has is said once it is loaded "
                   "(the run waits for it).")
    else:
        await_model(choice)


@st.fragment(run_every=LOAD_POLL_S)
def await_model(choice: Choice) -> None:
    """While ``choice``'s model is not loaded: "loading…" (or why not yet), the load started
    once the device is free, and a rerun of the page once it has ended (loaded or failed), so
    the page draws what was loaded."""
    spec = choice.spec()
    if client.known_info(spec) is not None or client.load_error(spec) is not None:
        st.rerun()
    client.load_soon(spec)  # the device may have been busy until now
    st.caption(f"Loading {spec.describe()} in the measuring process…" if client.loading(spec)
               else f"{spec.describe()} loads when the device is free (a run holds it now).")


def fallback_note(reason: str | None) -> str:
    """Why "auto" fell back to random weights, as a sentence ("" when it did not)."""
    return f" {reason[0].upper()}{reason[1:]}." if reason else ""


def weights_label(choice: Choice) -> str | None:
    info = client.known_info(choice.spec())
    return info.get("weights_label") if info else None
