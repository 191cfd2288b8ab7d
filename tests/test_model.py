"""Our GPT-2 against transformers' GPT2LMHeadModel, the loading paths, and bad input."""

from __future__ import annotations

import pytest
import torch

from engine import GPT, GPTConfig, WeightsError, families, generate
from engine.families import load
from engine.models.attention import make_attention
from engine.models.gpt2.weights import gpt_from_transformers
from instruments.checks.correctness import logits_vs_transformers

from .conftest import random_prompt, small_model


def test_presets_and_small_shapes() -> None:
    cfg = families.config("gpt2")
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size) == (
        12, 12, 768, 1024, 50257)
    assert families.config("gpt2-xl").n_embd == 1600
    small = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=256, vocab_size=1000)
    assert small.head_dim == 32
    with pytest.raises(ValueError, match="allowed"):
        families.config("gpt5")


def test_checkpoint_names_and_tied_head() -> None:
    model = GPT.random(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=50))
    names = set(model.state_dict())
    for key in ["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.ln_1.weight",
                "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight",
                "transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight",
                "transformer.ln_f.weight", "lm_head.weight"]:
        assert key in names
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.slow
def test_logits_match_transformers_full_gpt2_shapes() -> None:
    """Same random weights in both, the real 124M shapes: max |Δlogit| ≤ 1e-4 in fp32."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config()).eval()  # transformers' own init, its own weights
    ours = gpt_from_transformers(hf)
    idx = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(idx).logits
        got, _ = ours(idx, use_cache=False)
    assert float((got - want).abs().max()) <= 1e-4
    # Decode through the cache lands on the same logits too.
    with torch.no_grad():
        _, cache = ours(idx[:, :60])
        step, _ = ours(idx[:, 60:61], cache)
    assert float((step[:, 0] - want[:, 60]).abs().max()) <= 1e-4


def test_round_trip_to_transformers_check(model) -> None:
    result = logits_vs_transformers(model, random_prompt(30)[0].tolist())
    assert result.passed, result.detail
    assert result.value is not None and result.value < 1e-4


def test_load_local_checkpoint_folder(tmp_path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=128,
                                    vocab_size=300)).eval()
    hf.save_pretrained(tmp_path)
    state = load("gpt2", weights=str(tmp_path))
    model = state.model
    assert model.config.n_layer == 2 and model.config.block_size == 128
    assert "local checkpoint" in state.provenance.label
    idx = torch.randint(0, 300, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(idx, use_cache=False)[0], hf(idx).logits,
                                   atol=1e-4, rtol=0)


def test_local_folder_that_is_not_a_checkpoint(tmp_path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"holds no config.json \(found: notes.txt\); "
                       "allowed: a folder with config.json"):
        load("gpt2", weights=str(tmp_path))
    with pytest.raises(ValueError, match="missing: no such file or folder; allowed"):
        load("gpt2", weights=str(tmp_path / "missing"))


def test_pickled_checkpoint_is_refused(tmp_path) -> None:
    """A .bin is read with torch.load(weights_only=True): a pickled object is refused."""
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=16, vocab_size=50).save_pretrained(
        tmp_path)
    torch.save({"x": torch.zeros(1), "code": tmp_path}, tmp_path / "pytorch_model.bin")
    with pytest.raises(WeightsError, match="weights_only.*allowed: \\*.safetensors"):
        load("gpt2", weights=str(tmp_path))


def test_pretrained_unavailable_offline(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", "/nonexistent-hf-home")
    with pytest.raises(WeightsError, match="could not be loaded.*random weights"):
        load("gpt2", weights="pretrained", hub_id="no-such-org/no-such-model")
    loaded = load("gpt2", weights="auto", hub_id="no-such-org/no-such-model").provenance
    assert loaded.label.startswith("random")
    assert loaded.fallback and "unavailable" in loaded.fallback


_FROM_CACHE = """
import sys
from engine.families import load
state = load("gpt2", weights="auto", hub_id="kvlab-test/not-cached")
print(state.provenance.label, "|", state.provenance.fallback, "transformers" in sys.modules,
      "huggingface_hub.file_download" in sys.modules)
state = load("gpt2", weights="auto", hub_id="kvlab-test/tiny-gpt2")
print(state.provenance.label, state.model.config.n_layer, "transformers" in sys.modules)
"""


def test_auto_finds_a_cached_copy_and_skips_transformers_without_one(tmp_path) -> None:
    """"auto" loads pretrained weights from the Hugging Face cache (a tiny model saved into a
    cache of the hub's layout), and with no copy and no network falls back to random weights
    without importing transformers or the hub's file functions: asked of a fresh interpreter,
    whose hub settings are read at import."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from transformers import GPT2Config, GPT2LMHeadModel

    repo = tmp_path / "hub" / "models--kvlab-test--tiny-gpt2"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=128,
                               vocab_size=300)).save_pretrained(repo / "snapshots" / commit)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", _FROM_CACHE], env=env, capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    missing, found = out.stdout.strip().splitlines()[-2:]
    assert missing == ("random (seed 0) | pretrained weights for 'kvlab-test/not-cached' "
                       "unavailable (no network and no cached copy) False False")
    assert found == "pretrained (kvlab-test/tiny-gpt2) 2 True"


_NO_SYMPY = """
import sys
from engine.families import load
gpt, llama = load("tiny", weights="random").model, load("llama-tiny", weights="random").model
print(gpt.lm_head.weight is gpt.transformer.wte.weight,
      llama.lm_head.weight is llama.model.embed_tokens.weight,
      sorted(m for m in ("sympy", "torch._dynamo", "transformers") if m in sys.modules))
"""


def test_building_a_model_imports_neither_sympy_nor_dynamo() -> None:
    """A measuring process's first model is on its first point's path: ``to_empty`` imported
    sympy (0.5 s on a 2-core CPU) and ``normal_`` on the meta device torch._dynamo (1.7 s).
    Asked of a fresh interpreter; the tied head stays tied in both families."""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", _NO_SYMPY], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "[]"]


def test_random_weights_are_seeded_and_labelled() -> None:
    a, b = load("gpt2", weights="random", seed=5), load("gpt2", weights="random", seed=5)
    assert a.provenance.label == "random (seed 5)" and a.provenance.fallback is None
    a, b = a.model, b.model
    assert torch.equal(a.transformer.h[3].mlp.c_fc.weight, b.transformer.h[3].mlp.c_fc.weight)
    assert a.num_params() == 124_439_808


def test_bad_input_raises_value_errors(model) -> None:
    with pytest.raises(ValueError, match="beyond the model's limit of 256"):
        model(torch.zeros(1, 257, dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        generate(model, [], 5)
    with pytest.raises(ValueError, match=r"outside the vocabulary; allowed: 0\.\.511"):
        generate(model, [1, 2, 600], 5)
    with pytest.raises(ValueError, match=r"outside the vocabulary"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="0 or more"):
        generate(model, [1, 2], -1)
    with pytest.raises(ValueError, match=r"max_new_tokens ≤ 246"):
        generate(model, list(range(10)), 247)
    _, cache = model(torch.zeros(1, 250, dtype=torch.long))
    with pytest.raises(ValueError, match="250 cached \\+ 7 new"):
        model(torch.zeros(1, 7, dtype=torch.long), cache)


def test_mask_variants_cost_and_hold_nothing_in_the_model() -> None:
    m = small_model("seed")
    cost = {kind: make_attention(kind, m.config, m.device).nbytes()
            for kind in ("seed", "shared_bool", "none")}
    assert cost == {"seed": 2 * 256 * 256 * 4, "shared_bool": 256 * 256, "none": 0}
    assert not list(m.buffers())  # the write-up's buffers belong to the variant, not the model
    with pytest.raises(ValueError, match="allowed"):
        make_attention("triangle", m.config, m.device)


def test_fused_attention_after_a_cache_equals_causal_lower_right_bit_for_bit() -> None:
    """On a CPU the fused mask kind writes out the bottom-right triangle instead of importing
    torch.nn.attention.bias (1.5 s of torch._dynamo); it must be what that bias computes there,
    bit for bit, for several new tokens after a cache -- and not the top-left triangle."""
    from torch.nn.attention.bias import causal_lower_right

    from engine.models.attention import FUSED

    gen = torch.Generator().manual_seed(0)
    for t, s in ((2, 9), (5, 133), (16, 40)):
        q = torch.randn(1, 3, t, 16, generator=gen)
        k, v = torch.randn(2, 1, 3, s, 16, generator=gen)
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_lower_right(t, s))
        got = FUSED(q, k, v, layer=0, offset=s - t)
        assert torch.equal(got, want), (t, s)
        top_left = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert not torch.allclose(got, top_left)  # the test can see the wrong triangle
