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


def test_a_mode_without_its_gpu_implementation_is_not_offered_on_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """First light: the GGUF block rungs, CPU code, were offered on cuda and timed a fallback
    (44-80 ms a step). On a GPU they run our Triton step: without triton they are not offered
    there, saying why, nor is rung 16; on a CPU the block rungs still are."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real(name, *a))
    usable, missing = modes.choices("cuda")
    for name in ("q8_0_weights", "q4_1_weights", "triton"):
        assert name not in usable and "triton is not installed" in missing[name]
    assert modes.available("q8_0_weights", "cpu")[0] and modes.available("q4_1_weights", "cpu")[0]
    assert "prealloc_fused" in usable and "cuda_graph" in usable
    assert modes.spec("q8_0_weights").factory.endswith(":block_decoder")
    with pytest.raises(ValueError, match="unknown gpu_path"):
        modes.ModeSpec("toy", 99, "toy", "#000000", "", "x:y", gpu_path="cpu")
