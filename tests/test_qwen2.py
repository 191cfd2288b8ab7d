"""Qwen2 (the Llama family's blocks with q/k/v biases) gated against transformers: a small
random ``Qwen2ForCausalLM`` saved to a folder, loaded by our code as the model, held to
transformers' logits (fp32: 1e-4 of the largest) and greedy tokens at every mode it is offered."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from engine import families
from instruments import lineup

from .family_gate import gate_every_mode, offered, save_tiny

pytestmark = pytest.mark.timeout(900)
# GQA, untied, RoPE base 20,000 (not the default), biases of a visible size (transformers
# initialises them at zero: drawn here so that dropping them shows)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rope_parameters={"rope_type": "default", "rope_theta": 20000.0}, rms_norm_eps=1e-6,
            tie_word_embeddings=False, initializer_range=0.12)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen2ForCausalLM]:
    folder = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**TINY)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    hf.save_pretrained(folder)
    return folder, hf


def test_a_qwen2_folder_is_its_own_family(qwen2) -> None:
    folder, _ = qwen2
    assert lineup.family_of(str(folder)).name == "qwen2"
    cfg = lineup.config(str(folder))
    assert (cfg.family, cfg.rope_theta, cfg.n_kv_head, cfg.tied) == ("qwen2", 20000.0, 2, False)
    biased = [role for role, _, _, bias in cfg.matrices() if bias]
    assert biased == ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    model = families.load(str(folder)).model
    n = sum(p.numel() for p in model.parameters())
    # other_params: the embedding (twice: untied), norms and the q/k/v biases
    assert n == cfg.n_layer * sum(o * i for _, o, i, _ in cfg.matrices()) + cfg.other_params()


def test_qwen2_matches_transformers_at_every_mode(qwen2) -> None:
    folder, hf = qwen2
    state = families.load(str(folder))
    prompt = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    strays = gate_every_mode(state, hf, prompt, 12)
    assert set(strays) == set(offered("qwen2"))
    assert {"fast", "cuda_graph", "compiled", "q4_1_weights", "paged"} <= set(strays)


def test_random_qwen2_weights_match_their_reference(qwen2) -> None:
    """Random weights of the folder's config, through our own reference copy."""
    folder, _ = qwen2
    model = families.load(str(folder), "random", seed=3).model
    ref = lineup.reference(model)
    idx = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs = model(idx)[0], ref(idx).logits
    assert float((ours - theirs).abs().max()) <= 1e-4 * float(theirs.abs().max())


def test_a_qwen2_with_its_sliding_window_on_is_refused(tmp_path: Path) -> None:
    save_tiny(Qwen2ForCausalLM, Qwen2Config, tmp_path, **dict(
        TINY, use_sliding_window=True, sliding_window=16))
    with pytest.raises(ValueError, match="use_sliding_window true; allowed: false"):
        lineup.preset(str(tmp_path))
