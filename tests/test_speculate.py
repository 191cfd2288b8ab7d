"""Speculative decoding (``engine.decoders.speculative``) gives plain greedy decoding's tokens,
token for token, on a lively random model, on gpt2 with random weights and on the small trained
model (``tests/fixtures/bytes_stdlib``), where its acceptance is real and varied; the verify-curve
formulas (``instruments.costmodel.speculation``); the ``speculate`` experiment and its refusals."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from engine import families, modes
from engine.decoders import Decoder, make_decoder
from engine.decoders.speculative import propose, speculative_decode
from engine.loop import decode
from engine.models.gpt2.model import GPT
from instruments.costmodel.speculation import (
    VerifyCurve,
    break_even,
    expected_tokens,
    loop_ms,
    speedups,
)
from instruments.experiments import speculate

from .conftest import loaded_model, random_prompt, small_model

FIXTURE = Path(__file__).parent / "fixtures" / "bytes_stdlib"
PROMPTS = ["    def __init__(self, name, value):\n        self.name = name\n        self.",
           "import os\nimport sys\n\n\ndef main(argv):\n    for arg in argv:\n        if "]


def both(model: GPT, prompt: torch.Tensor, n: int, k: int, mode: str = "prealloc_fused"
         ) -> tuple[torch.Tensor, object]:
    """Plain greedy tokens and the speculative run, each on a fresh decoder."""
    cap = prompt.size(1) + n
    want = decode(make_decoder(model, mode, capacity=cap), prompt, n).tokens
    return want, speculative_decode(make_decoder(model, mode, capacity=cap), prompt, n, k)


@pytest.fixture(scope="module")
def trained() -> GPT:
    from engine.families import load

    return load("gpt2", weights=str(FIXTURE)).model


def test_prompt_lookup_drafts_what_followed_the_longest_match() -> None:
    h = torch.tensor([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 8, 1, 2, 3])
    assert propose(h, 3) == [4, 9, 2]  # the trigram 1 2 3 seen at the start
    assert propose(h, 3, ngram=2) == [5, 6, 7]  # the most recent "2 3" with 3 tokens after it
    assert propose(torch.tensor([5, 6, 7, 8]), 4) == []  # nothing seen before
    assert propose(torch.tensor([5, 5, 5, 5]), 4) == [5]  # only what is there
    assert propose(h, 0) == []


def test_speculation_equals_greedy_on_a_lively_random_model() -> None:
    model = small_model()
    for seed in range(2):
        prompt = random_prompt(12, seed=seed)
        for k in (1, 5):
            want, got = both(model, prompt, 40, k)
            assert torch.equal(got.tokens, want), (seed, k)
            assert len(got.forwards) <= 39 and got.tokens.size(1) == 40


def test_speculation_equals_greedy_on_gpt2_with_random_weights() -> None:
    model = GPT.random(families.config("gpt2", block_size=64), seed=0)
    prompt = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(0))
    want, got = both(model, prompt, 24, 4)
    assert torch.equal(got.tokens, want)
    # the degenerate stream: a token or two repeated, so the drafts are mostly right
    assert want.unique().numel() <= 3 and got.acceptance is not None
    assert got.acceptance > 0.5, got.acceptance


def test_speculation_equals_greedy_on_the_trained_model_with_real_acceptance(
        trained: GPT) -> None:
    rates = []
    for text in PROMPTS:
        prompt = torch.tensor([families.tokenizer(trained.config).encode(text)])
        for k in (2, 8):
            want, got = both(trained, prompt, 96, k)
            assert torch.equal(got.tokens, want), (text, k)
            assert want.unique().numel() >= 8  # not one token repeated
            assert got.acceptance is not None and 0.05 < got.acceptance < 0.95, got.acceptance
            assert got.tokens_per_forward is not None and got.tokens_per_forward > 1.05
            rates.append(round(got.acceptance, 3))
    assert len(set(rates)) >= 3, rates  # varied, by prompt and by draft length


def test_a_cache_not_rewound_after_a_rejected_draft_breaks_equality(
        trained: GPT, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the equality test guards: keeping the rejected draft's keys changes the tokens."""
    prompt = torch.tensor([families.tokenizer(trained.config).encode(PROMPTS[0])])
    want = decode(make_decoder(trained, "prealloc_fused", capacity=160), prompt, 64).tokens

    def forget_rows_only(self: Decoder, length: int) -> None:
        self.seq = self._tokens[:, :length]  # the cache keeps the rejected rows

    monkeypatch.setattr(Decoder, "rewind", forget_rows_only)
    dec = make_decoder(trained, "prealloc_fused")  # the whole context: room for stale rows
    try:
        got = speculative_decode(dec, prompt, 64, 4)
    except ValueError:  # the stale rows piled up past the model's context
        return
    assert not torch.equal(got.tokens, want)


def test_speculation_refuses_a_batch_and_a_mode_that_steps_one_token() -> None:
    model = small_model()
    with pytest.raises(ValueError, match="one sequence"):
        speculative_decode(make_decoder(model, "prealloc_fused", batch_size=2),
                           random_prompt(8, batch=2), 8, 2)
    with pytest.raises(ValueError, match="one token per step"):
        speculative_decode(make_decoder(model, "fast"), random_prompt(8), 8, 2)


def test_the_experiment_knows_which_modes_append_without_torch() -> None:
    for name, spec in modes.MODES.items():
        module, attr = spec.factory.split(":")
        cls = getattr(importlib.import_module(module), attr)
        assert speculate.appends(name) == cls.appends, name


def test_expected_tokens_and_break_even() -> None:
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    for k, ratio in ((1, 1.3), (4, 2.0), (8, 3.5)):
        alpha = break_even(ratio, k)
        assert alpha is not None and expected_tokens(alpha, k) == pytest.approx(ratio)
    assert break_even(0.9, 4) == 0.0  # memory-bound: any acceptance wins
    assert break_even(5.0, 4) is None  # compute-bound: k + 1 tokens cost k + 1 steps
    with pytest.raises(ValueError):
        expected_tokens(1.5, 2)


def test_the_verify_curve_interpolates_and_predicts() -> None:
    rows = [{"context_len": c, "k": k, "latency_ms": 10.0 + k * (1 if c == 100 else 3)}
            for c in (100, 300) for k in (1, 2, 4, 8)]
    curve = VerifyCurve(rows)
    assert curve.ms(100, 3) == pytest.approx(13.0)  # between k = 2 and 4
    assert curve.ms(200, 1) == pytest.approx(12.0)  # between the contexts
    assert curve.ms(50, 1) == pytest.approx(11.0)  # clamped to the nearest context
    flat = VerifyCurve([{"context_len": 10, "k": k, "latency_ms": 5.0} for k in (1, 8)])
    got = speedups(flat, k=4, acceptance=1.0, prompt_len=10, new_tokens=11,
                   forwards=[(10, 4), (15, 4)], prefill_ms=0.0)
    assert got["speedup_predicted"] == pytest.approx(5.0)  # E = 5 tokens a forward, same cost
    assert got["speedup_predicted_drafts"] == pytest.approx(5.0)  # 10 tokens in 2 forwards
    assert got["break_even_acceptance"] == 0.0
    # The loop's own work per step (2 ms) and each forward's drafting (3 ms) shrink the gain:
    # plain 10 x (5 + 2) = 70 ms, speculative 2 x (5 + 2 + 3) = 20 ms.
    paid = speedups(flat, k=4, acceptance=1.0, prompt_len=10, new_tokens=11,
                    forwards=[(10, 4), (15, 4)], prefill_ms=0.0, step_loop_ms=2.0,
                    draft_ms=[3.0, 3.0])
    assert paid["speedup_predicted_drafts"] == pytest.approx(3.5)
    assert paid["speedup_predicted"] == pytest.approx(3.5)
    assert loop_ms(flat, prompt_len=10, new_tokens=11, prefill_ms=4.0, plain_ms=74.0) == \
        pytest.approx(2.0)  # (74 - 4 - 10 x 5) / 10
    assert loop_ms(flat, prompt_len=10, new_tokens=11, prefill_ms=4.0, plain_ms=40.0) == 0.0


def test_the_experiment_measures_both_tables_on_the_tiny_model() -> None:
    from engine.families import load

    model = load("tiny", "random").model
    p = speculate.SpeculateParams([16], [1, 2, 4], new_tokens=12, repeats=1)
    run = speculate.run(loaded_model(model), p)
    verify, spec = run["tables"]["verify"], run["tables"]["speculative"]
    # the asked k, and k + 1 (what a draft of k appends), measured: 3 and 5 besides 1, 2, 4
    assert [r["k"] for r in verify] == [1, 2, 3, 4, 5] and verify[0]["t_ratio"] == 1.0
    assert [r["k"] for r in spec] == [1, 2, 4] and all(r["identical"] for r in spec)
    assert all(r["speedup_measured"] > 0 and r["break_even_acceptance"] is not None
               or r["verify_ratio"] >= r["k"] + 1 for r in spec)
    assert run["tables"]["checks"][0]["passed"] and run["meta"]["distinct_tokens"] >= 1
    assert run["meta"]["output_text"] and not run["meta"]["partial"]
    assert speculate.summary(run)


def test_bad_speculate_input_says_what_is_allowed() -> None:
    cfg = families.config("tiny")
    with pytest.raises(ValueError, match="allowed: uncached"):
        speculate.SpeculateParams([16], mode="fast").check(cfg, "cpu")
    with pytest.raises(ValueError, match="outside 1..96"):
        speculate.SpeculateParams([100]).check(cfg, "cpu")  # + 32 appended > 128
    from instruments import cli

    assert cli.main(["speculate", "--model", "tiny", "--batch", "2", "--no-progress"]) == 2


def test_a_verify_sample_is_per_forward_of_several_run_back_to_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each verify sample runs BACK_TO_BACK forwards at the same context (appended, then
    rewound), as the decoding loops run them, and its row is per forward: on a clock that
    counts 1 ms per forward, every t(k) is 1 ms, not BACK_TO_BACK ms, and every forward of a
    point appended after the same held tokens."""
    from engine.families import load
    from instruments.measure.sampler import Sampler

    model = load("tiny", "random").model
    ticks = {"ms": 0.0}
    held: dict[int, set[int]] = {}
    append = Decoder.append

    def counted(self: Decoder, tokens: torch.Tensor) -> torch.Tensor:
        ticks["ms"] += 1.0
        held.setdefault(tokens.size(1), set()).add(self.length)
        return append(self, tokens)

    monkeypatch.setattr(Decoder, "append", counted)
    monkeypatch.setattr(speculate, "_sampler", lambda model, p, tr: Sampler(
        "cpu", repeats=2, min_repeats=2, watch=None, clock=lambda: ticks["ms"] / 1e3))
    run = speculate.run(loaded_model(model),
                        speculate.SpeculateParams([16], [1, 2, 4], new_tokens=0, repeats=2))
    verify = run["tables"]["verify"]
    assert speculate.BACK_TO_BACK > 1
    assert [r["k"] for r in verify] == [1, 2, 3, 4, 5]
    assert all(r["latency_ms"] == pytest.approx(1.0) for r in verify), verify
    assert all(held[k] == {16} for k in (1, 2, 4)), held  # (the gate appends 3 at 8 first)
