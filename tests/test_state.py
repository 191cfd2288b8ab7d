"""What is built on a model lives in its ``ModelState``, never on the model, and goes with it:
decoders given the bare model share the live state's packed copies and compiled steps; the
measuring process drops all of it (and the experiments' memo) when another model is asked for."""

from __future__ import annotations

import gc
import io
import weakref

import pytest

from engine import make_decoder, modes
from engine.decoders.compiled import CompiledDecoder
from engine.models.state import ModelState
from instruments.spine import ModelSpec

from .conftest import random_prompt, small_model


def test_running_every_eager_mode_leaves_nothing_on_the_model() -> None:
    model = small_model()
    before = set(vars(model))
    for mode in ("uncached", "concat", "prealloc", "prealloc_fused", "fast", "paged"):
        dec = make_decoder(model, mode)
        dec.step(dec.prefill(random_prompt(8)).argmax(-1, keepdim=True))
    CompiledDecoder(model, variant="eager").prefill(random_prompt(8))
    assert set(vars(model)) == before  # no runner, packing or mask hidden in the model
    assert not list(model.buffers())  # the write-up's mask buffers are the state's
    assert dec.state.mask_nbytes("seed") > 0  # modes 1-4 built them there, once


def test_decoders_of_a_bare_model_share_its_live_state() -> None:
    model = small_model()
    state = ModelState(model)
    fast = make_decoder(model, "fast")
    assert fast.state is state and ModelState.of(model) is state
    assert make_decoder(model, "fast").weights is fast.weights
    a = CompiledDecoder(model, variant="eager")
    assert CompiledDecoder(state, variant="eager").runner is a.runner
    packed = weakref.ref(fast.weights)
    del fast, a, state
    gc.collect()
    assert packed() is None  # nothing but the state kept the copies alive


def test_the_measuring_process_drops_everything_built_on_the_old_model() -> None:
    from engine.decoders.fast import fast_weights
    from instruments.process.worker import Channel, Worker

    worker = Worker("cpu", Channel(io.StringIO()))
    old = worker.ensure(ModelSpec("tiny", seed=1))
    packed = weakref.ref(fast_weights(old.model))  # given the bare model, as experiments are
    seed = weakref.ref(old.state.attention("seed"))
    old.memo["calibration"] = ["rows"]
    model = weakref.ref(old.model)
    assert worker.ensure(ModelSpec("tiny", seed=1)) is old  # the same model: all of it kept
    assert packed() is not None
    new = worker.ensure(ModelSpec("tiny", seed=2))
    assert new.memo == {} and old.memo == {}
    del old
    gc.collect()
    assert packed() is None and seed() is None and model() is None
    assert new.state.mask_nbytes() == 0


def test_what_is_built_with_a_release_is_released_when_dropped_replaced_or_gone() -> None:
    released: list[str] = []
    state = ModelState(small_model())
    state.cached(("peer", "a"), lambda: "a1", release=released.append)
    state.cached(("peer", "a"), lambda: "a2", keep=lambda v: False, release=released.append)
    assert released == ["a1"]  # replaced: the stale one goes first
    state.drop(("peer", "a"))
    assert released == ["a1", "a2"]
    state.cached(("peer", "b"), lambda: "b1", release=released.append)
    del state
    gc.collect()
    assert released == ["a1", "a2", "b1"]  # the state itself gone (the measuring process
    # dropped it for another model): what it built is released with it


def _decoder(state: ModelState, name: str):  # noqa: ANN202 (any Decoder)
    if name == "compiled":  # mode 7's shared buffers and ownership, without minutes of compile
        return CompiledDecoder(state, variant="eager")
    return make_decoder(state, name)


@pytest.mark.parametrize("name", [*modes.defaults("cpu", "gpt2"), "compiled"])
def test_a_decoder_steps_after_another_of_its_mode_started_a_sequence(name: str) -> None:
    """First light (H200): the sweep's decoder seeks, the gate's decoder of the same mode has
    prefilled meanwhile on the same model; mode 7 then refused to step. Every decoder must seek
    back to its own sequence, whoever used the model's shared buffers since."""
    state = ModelState(small_model())
    ids = random_prompt(12)
    sweep = _decoder(state, name)
    sweep.seek(ids, 8)
    gate = _decoder(state, name)
    gate.prefill(random_prompt(5, seed=3))  # another sequence on the same model
    sweep.seek(ids, 9)
    got = sweep.step(ids[:, 9:10])
    want = state.model(ids[:, :10], use_cache=False, logits="last")[0][:, -1, :]
    tol = 1e-4 if not modes.spec(name).tolerance else modes.spec(name).tolerance * float(
        want.abs().max())
    assert float((got - want).abs().max()) <= tol
