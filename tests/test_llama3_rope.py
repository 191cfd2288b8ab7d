"""Llama 3's RoPE scaling (transformers' rope_type "llama3": the slow pairs turn ``factor`` times
slower, the fast ones as before, those between blended), read from a checkpoint's config.json and
gated against transformers at every mode the Llama family is offered.

The checkpoint: a small random ``LlamaForCausalLM`` whose original context (32) makes the scaling
touch most of its head's pairs, so that a model ignoring the scaling strays at every position.
Bugs seen to fail: the scaling dropped (the config read without it), the blend's two ends swapped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine import families
from engine.models.rope import llama3_frequencies
from instruments import lineup

from .family_gate import gate_every_mode, offered, save_tiny

pytestmark = pytest.mark.timeout(900)
SCALING = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rope_parameters=SCALING, rms_norm_eps=1e-6, tie_word_embeddings=True,
            initializer_range=0.12)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    folder = tmp_path_factory.mktemp("llama3")
    return folder, save_tiny(LlamaForCausalLM, LlamaConfig, folder, **TINY)


def test_the_scaling_is_read_and_is_transformers_own(llama3) -> None:
    folder, hf = llama3
    cfg = lineup.config(str(folder))
    assert cfg.rope_scaling == (8.0, 1.0, 4.0, 32.0)
    base = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    ours = llama3_frequencies(base, *cfg.rope_scaling)
    theirs = hf.model.rotary_emb.inv_freq
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    scaled = int((ours != base).sum())
    assert 0 < scaled < len(base), scaled  # some pairs slowed, the fastest kept
    saved = families.config_from_dict(json.loads(json.dumps(cfg.to_dict())), "llama")
    assert saved == cfg  # a run's JSON reads back (a list becomes the tuple again)


def test_llama3_scaling_matches_transformers_at_every_mode(llama3) -> None:
    folder, hf = llama3
    state = families.load(str(folder))
    prompt = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    strays = gate_every_mode(state, hf, prompt, 12)  # past the original context of 32
    assert set(strays) == set(offered("llama"))
    ref = lineup.reference(state.model)  # our transformers copy carries the scaling too
    with torch.no_grad():
        assert torch.allclose(ref(prompt).logits, hf(prompt).logits, atol=1e-5)


def test_other_scalings_are_refused_naming_what_is_allowed(tmp_path: Path) -> None:
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 32}
    save_tiny(LlamaForCausalLM, LlamaConfig, tmp_path, **dict(TINY, rope_parameters=yarn))
    with pytest.raises(ValueError, match=r"RoPE scaling 'yarn'; allowed: .*'llama3'"):
        lineup.preset(str(tmp_path))


def test_a_scaled_model_has_no_gguf_layout_and_says_why(llama3) -> None:
    folder, _ = llama3
    with pytest.raises(ValueError, match="Llama 3's RoPE scaling has no GGUF layout"):
        lineup.gguf_layout(families.load(str(folder)).model)
