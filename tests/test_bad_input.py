"""Bad input on every page gives a one-line message saying what is allowed, never a traceback.

Drives AppTest sessions with odd values: widget values the browser would clamp are checked at
their bounds (and the engine's own validation behind them), requested choices the machine lacks
(cuda without a GPU, an unknown preset, a dtype the device lacks) and bad weights folders show a
message. On the command line each list says which quantity it could not read (batch sizes,
context lengths, prompt lengths, token counts). (Out of memory and a crashed measuring process:
tests/test_worker.py, test_app.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

from engine import families
from instruments.experiments.inputs import MAX_BATCH
from instruments.experiments.latency import LatencyParams
from ui.apptest import APP, configure_sweep, no_traceback, open_page, wait_job

from .test_app import results

__all__ = ["results"]  # the fixture, re-exported for pytest
pytestmark = pytest.mark.timeout(180)


def messages(at: AppTest) -> list[str]:
    return [m.value for m in [*at.error, *at.warning, *at.sidebar.warning]]


@pytest.mark.parametrize("key, value, what", [
    ("device", "cuda", "Device 'cuda' is not available here; allowed: cpu"),
    ("model", "gpt5", "Model preset 'gpt5' is not available here"),
    ("dtype", "float16", "dtype 'float16' is not available here; allowed: float32, bfloat16"),
])
def test_choices_this_machine_lacks(results: Path, key: str, value: str, what: str) -> None:
    if key == "device" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    at = AppTest.from_file(APP, default_timeout=60)
    if key == "dtype":
        at.session_state["device"] = "cpu"  # on a GPU machine cuda would offer float16
    at.session_state[key] = value
    at.run()
    no_traceback(at)
    assert any(what in m for m in messages(at)), messages(at)
    assert at.session_state["choice"].__getattribute__(key) != value


def test_weights_folder_that_is_not_a_checkpoint(results: Path, tmp_path: Path) -> None:
    at = AppTest.from_file(APP, default_timeout=60)
    at.session_state["model"] = "gpt2"
    at.session_state["weights"] = "local folder"
    at.session_state["weights_path"] = str(tmp_path)  # an empty folder
    at.run()
    no_traceback(at)
    errors = [e.value for e in at.error]
    assert any("holds no config.json (found: nothing); allowed: a folder with config.json" in e
               for e in errors), errors


@pytest.mark.parametrize("prompt, n, says", [
    ("", 5, "The prompt is empty"),
    ("Hello, I'm a language model," * 20, 10, "beyond the model's limit of 128 tokens"),
])
def test_generate_rejects_bad_prompts(results: Path, prompt: str, n: int, says: str) -> None:
    at = open_page("generate")
    at.text_area(key="gen_prompt").set_value(prompt)
    at.number_input(key="gen_new").set_value(n)
    at.button[0].click().run()
    no_traceback(at)
    if "gen_job" in at.session_state:  # only the measuring process holds the tokenizer
        assert wait_job(at, "gen_job").state == "failed"
    assert any(says in e.value for e in at.error), [e.value for e in at.error]
    assert not any("Traceback" in e.value for e in at.error)


def test_sweep_widgets_bound_batch_and_repeats(results: Path) -> None:
    at = open_page("sweep")
    batch, repeats = at.number_input(key="sweep_batch"), at.number_input(key="sweep_repeats")
    assert (batch.min, batch.max) == (1, MAX_BATCH)
    assert repeats.min == 1 and at.number_input(key="sweep_warmup").min == 0


@pytest.mark.parametrize("kwargs, says", [
    (dict(batch_size=0), "batch"), (dict(batch_size=10_000), "batch"),
    (dict(repeats=0), "repeats"), (dict(warmup=-1), "warmup"),
    (dict(modes=["warp_drive"]), "unknown mode"), (dict(modes=[]), "mode"),
    (dict(contexts=[]), "context"), (dict(contexts=[0, 8]), "1.."),
    (dict(contexts=[8, 999]), "1.."),
    (dict(point_ms=-5.0), "point ms"), (dict(point_ms=1e9), "point ms"),
    (dict(cheap_repeats=0), "cheap repeats"),
])
def test_sweep_params_reject_bad_values(kwargs: dict, says: str) -> None:
    params = LatencyParams(**{**dict(contexts=[4, 8], modes=["uncached"]), **kwargs})
    with pytest.raises(ValueError, match=says) as info:
        params.check(families.config("tiny"), "cpu")
    assert "\n" not in str(info.value)


def test_duplicate_contexts_are_measured_once_and_said(results: Path) -> None:
    at = open_page("sweep")
    configure_sweep(at, "4, 8, 8, 4-8:4")
    at.button[0].click().run()
    no_traceback(at)
    assert any("measured once: 4, 8" in i.value for i in at.info), [i.value for i in at.info]
    job = wait_job(at, "sweep_job")
    assert sorted({r["context_len"] for r in job.tables["latency"]}) == [4, 8]


def test_another_presets_weights_choice_is_dropped_unsaid(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt2's "auto" is no choice of smollm2-135m's: switching presets takes the new one's
    default without a warning (a requested choice that is not offered is still said)."""
    monkeypatch.setenv("KVLAB_RESULTS_DIR", str(tmp_path))
    monkeypatch.delenv("KVLAB_TINY", raising=False)
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    assert at.session_state["choice"].weights == "auto"  # gpt2's default
    at.sidebar.selectbox(key="model").set_value("smollm2-135m").run()
    no_traceback(at)
    assert at.session_state["choice"].weights == families.preset("smollm2-135m").weights[0]
    # the Weights box shows the new preset's own choice, not gpt2's
    assert at.sidebar.selectbox(key="weights:smollm2-135m").value == "package"
    assert not [m for m in messages(at) if "not available here" in m], messages(at)


@pytest.mark.parametrize(("argv", "says"), [
    (["batch_curve", "--batches", "0,100000"], "batch size 0 is outside 1..256"),
    (["batch_curve", "--contexts", "0"], "context length 0 is outside 1..128"),
    (["memory", "--crossover-batches", "x"], "cannot read 'x' as a batch size"),
    (["scope", "--grow", "batch", "--points", "999"], "batch size 999 is outside 1..256"),
    (["staircase", "--ts", "0"], "token count 0 is outside 1..128"),
    (["prefix_ttft", "--prompt-lens", "0"], "prompt length 0 is outside 1..256"),
])
def test_each_list_on_the_command_line_names_its_own_quantity(
        argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    from instruments import cli

    model = "llama-tiny" if argv[0].startswith("prefix") else "tiny"
    assert cli.main([*argv, "--model", model, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert says in err and "allowed:" in err, err
