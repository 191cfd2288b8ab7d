"""Every mode of the ladder available on this machine gives mode 1's greedy tokens; the
registry holds each mode once with its rung, label and colour."""

from __future__ import annotations

import os

import pytest
import torch

from engine import decode, make_decoder, modes
from engine.modes import MODES
from instruments.checks.bugs import inject_bug
from instruments.checks.gate import Gate

from .conftest import random_prompt, small_model


@pytest.mark.parametrize("name", list(MODES))
def test_mode_equals_naive_loop(name: str) -> None:
    model = small_model()
    ok, why = modes.available(name, str(model.device))
    if not ok:
        pytest.skip(why)
    if MODES[name].slow_setup and not os.environ.get("KV_LAB_COMPILE_TESTS"):
        pytest.skip("compiles for minutes on 2 cores; set KV_LAB_COMPILE_TESTS=1 to run")
    result = Gate(model, batch=2).check(name)
    assert result.passed, result.detail
    if MODES[name].tolerance:
        return  # a lossy cache (int8): its logits are bounded, its greedy tokens may part ways
    same = decode(make_decoder(model, name, batch_size=2), random_prompt(8, batch=2), 40)
    want = decode(make_decoder(model, "uncached", batch_size=2), random_prompt(8, batch=2), 40)
    assert torch.equal(same.tokens, want.tokens)  # a lively model: the greedy tokens agree too


def test_the_gate_catches_a_broken_mode() -> None:
    model = small_model()
    gate = Gate(model)
    gate.reference()
    with inject_bug(model, "positions"):
        assert not gate.check("prealloc").passed


def test_the_gate_refuses_a_mode_that_crashes(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.decoders.fast

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(engine.decoders.fast.FastDecoder, "step", broken)
    verdict = Gate(small_model()).check("fast")
    assert not verdict.passed and "kernel exploded" in verdict.detail
    assert Gate(small_model()).check("uncached").passed  # mode 1 is the reference


def test_registry_rungs_labels_colours_and_order() -> None:
    assert [s.rung for s in MODES.values()] == list(range(1, len(MODES) + 1))
    assert all(s.label.startswith(f"{s.rung} · ") for s in MODES.values())
    assert len({s.color for s in MODES.values()}) == len(MODES)
    assert modes.color("cached") == modes.color("concat")  # the write-up's name for mode 3
    assert modes.ordered(["fast", "zzz", "uncached", "concat"]) == ["uncached", "concat", "fast",
                                                                    "zzz"]
    assert modes.uncached() == ("uncached", "uncached_last")
    # Mode 9 is named for what it compiles: the model's own weights, not mode 8's packed ones.
    assert "fast path" not in MODES["fast_compiled"].label
    assert "not mode 8's packed" in MODES["fast_compiled"].description


def test_availability_is_decided_without_torch() -> None:
    import subprocess
    import sys

    code = ("import sys; from engine import modes; "
            "print(modes.available('cuda_graph', 'cpu'), modes.defaults('cpu')); "
            "assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "needs a CUDA GPU" in out and "'fast'" in out and "'compiled'" not in out


def test_a_mode_without_a_gpu_implementation_is_not_offered_on_cuda() -> None:
    """First light: the GGUF block rungs, CPU code, were offered on cuda and timed a fallback
    (44-80 ms a step). Not offered there now, each saying why; still offered on a CPU."""
    usable, missing = modes.choices("cuda")
    for name in ("q8_0_weights", "q4_1_weights"):
        assert name not in usable and "CPU code" in missing[name]
        assert modes.available(name, "cpu")[0]
    assert "prealloc_fused" in usable and "cuda_graph" in usable
    with pytest.raises(ValueError, match="why_not_devices"):
        modes.ModeSpec("toy", 99, "toy", "#000000", "", "x:y", devices=("cpu",))
