"""Every mode of the ladder available on this machine gives mode 1's greedy tokens."""

from __future__ import annotations

import os

import pytest

from engine.checks import inject_bug
from engine.modes import MODES, check_mode, mode_available

from .conftest import random_prompt, small_model


@pytest.mark.parametrize("name", list(MODES))
def test_mode_equals_naive_loop(name: str) -> None:
    model = small_model()
    ok, why = mode_available(model, name)
    if not ok:
        pytest.skip(why)
    if MODES[name].slow_setup and not os.environ.get("KV_LAB_COMPILE_TESTS"):
        pytest.skip("compiles for minutes on 2 cores; set KV_LAB_COMPILE_TESTS=1 to run")
    result = check_mode(model, name, random_prompt(8, batch=2), n=40)
    assert result.passed, result.detail


def test_check_mode_catches_a_broken_mode() -> None:
    model = small_model()
    with inject_bug(model, "positions"):
        assert not check_mode(model, "prealloc", random_prompt(8), n=20).passed
