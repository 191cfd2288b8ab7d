"""The decode loop: sampling reproducibility, steps, timing, cancellation, teacher forcing, the
logits switch, and the tokenizer."""

from __future__ import annotations

import pytest
import torch

from engine import Decoder, decode, generate, make_decoder
from engine.loop import first_difference
from engine.models.gpt2.tokenizer import decode as detokenize
from engine.models.gpt2.tokenizer import encode
from instruments.measure.timing import StepClock

from .conftest import random_prompt


def test_sampling_is_reproducible_with_seed(model) -> None:
    p = random_prompt(5)
    a = generate(model, p, 30, temperature=0.8, top_k=20, seed=7)
    b = generate(model, p, 30, temperature=0.8, top_k=20, seed=7)
    c = generate(model, p, 30, temperature=0.8, top_k=20, seed=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # Sampling with the cache equals sampling without it (same seed, same draws).
    d = generate(model, p, 30, use_cache=False, temperature=0.8, top_k=20, seed=7)
    assert torch.equal(a, d)


def test_top_k_one_is_greedy(model) -> None:
    p = random_prompt(5)
    assert torch.equal(generate(model, p, 20, temperature=1.0, top_k=1, seed=0),
                       generate(model, p, 20))


def test_loop_reports_each_step_times_it_and_stops(model) -> None:
    events = []
    prompt = torch.tensor([[1, 2, 3]])
    clock = StepClock()
    out = decode(Decoder(model, capacity=13), prompt, 10, timer=clock, on_step=events.append)
    assert [e.index for e in events] == list(range(10))
    assert [e.context_len for e in events] == list(range(3, 13))
    assert events[0].phase == "prefill" and events[1].phase == "decode"
    assert all(e.step_ms > 0 for e in events) and out.step_ms == clock.samples_ms
    assert out.tokens[0].tolist() == [e.token_ids[0] for e in events]
    stopped = decode(Decoder(model), prompt, 10, should_stop=lambda: len(events) >= 13,
                     on_step=events.append)
    assert stopped.stopped_early and stopped.tokens.shape == (1, 3)
    uncached = decode(make_decoder(model, "uncached"), prompt, 3, on_step=events.append)
    assert events[-1].phase == "uncached" and uncached.step_ms == []  # no timer, no times


def test_skipped_calls_are_not_samples(model) -> None:
    clock = StepClock(skip=3)
    gen = decode(Decoder(model, capacity=20), torch.tensor([[5, 6]]), 8, timer=clock)
    assert len(gen.step_ms) == len(clock.samples_ms) == 5


def test_teacher_forcing_feeds_the_given_tokens(model) -> None:
    prompt = random_prompt(4)
    free = decode(Decoder(model, capacity=40), prompt, 12, keep_logits=True)
    forced = decode(Decoder(model, capacity=40), prompt, 12, feed=free.tokens,
                    keep_logits=True)
    assert torch.equal(free.tokens, forced.tokens)  # fed its own picks: the same run
    other = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(3))
    steered = decode(Decoder(model, capacity=40), prompt, 12, feed=other, keep_logits=True)
    assert torch.equal(steered.logits[0], free.logits[0])  # the prefill sees no fed token
    assert not torch.equal(steered.logits[2], free.logits[2])
    # The fed tokens are what a cached step sees: the same as the uncached loop fed the same.
    naive = decode(make_decoder(model, "uncached"), prompt, 12, feed=other, keep_logits=True)
    assert torch.allclose(torch.stack(naive.logits), torch.stack(steered.logits), atol=1e-4)


def test_last_only_projection_gives_same_tokens(model) -> None:
    p = random_prompt(6, batch=2)
    assert torch.equal(generate(model, p, 40, use_cache=False, logits="all"),
                       generate(model, p, 40, use_cache=False, logits="last"))


def test_prompt_as_lists_and_full_context(model) -> None:
    assert generate(model, [[1, 2], [3, 4]], 3).shape == (2, 3)
    with pytest.raises(ValueError, match="same number"):
        generate(model, [[1, 2], [3]], 3)
    out = generate(model, [1] * 6, 250)  # exactly fills block_size 256
    assert out.shape == (1, 250)


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_tokenizer_round_trip() -> None:
    ids = encode("Hello, I'm a language model,")
    assert ids == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    assert detokenize(ids) == "Hello, I'm a language model,"


def test_tokenizer_missing_files_message(monkeypatch, tmp_path) -> None:
    import tiktoken.load

    from engine.models.gpt2 import tokenizer

    def offline(*_a, **_k):
        raise ConnectionError("no network")

    tokenizer.get_tokenizer.cache_clear()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    import tiktoken.registry

    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    try:
        with pytest.raises(tokenizer.TokenizerError, match="TIKTOKEN_CACHE_DIR"):
            tokenizer.get_tokenizer()
    finally:
        tokenizer.get_tokenizer.cache_clear()
