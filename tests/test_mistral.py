"""Mistral (the Llama family's blocks, a sliding window) gated against transformers past its
window: a small random ``MistralForCausalLM`` saved to a folder, loaded by our code as the model,
held to transformers' logits (fp32: 1e-4 of the largest) and greedy tokens at every mode it is
offered; its caches hold ``window`` rows per layer at any context, the bytes the formula says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from engine import families
from engine.decoders import make_decoder
from instruments import lineup
from instruments.costmodel import costs, kv_plan
from instruments.measure.memory import measure_kv_memory

from .family_gate import gate_every_mode, offered, save_tiny

pytestmark = pytest.mark.timeout(900)
WINDOW = 8
# GQA, untied, a RoPE base that is not the default; a window of 8 tokens, which a 9-token prompt
# and 16 greedy tokens leave far behind
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=128, sliding_window=WINDOW,
            rope_parameters={"rope_type": "default", "rope_theta": 30000.0}, rms_norm_eps=1e-6,
            tie_word_embeddings=False, initializer_range=0.12)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, MistralForCausalLM]:
    folder = tmp_path_factory.mktemp("mistral")
    return folder, save_tiny(MistralForCausalLM, MistralConfig, folder, **TINY)


def test_a_mistral_folder_is_its_own_family_with_its_window(mistral) -> None:
    folder, _ = mistral
    cfg = lineup.config(str(folder))
    assert (cfg.family, cfg.window, cfg.rope_theta) == ("mistral", WINDOW, 30000.0)
    assert [cfg.cache_rows(t) for t in (3, 8, 9, 100)] == [3, 8, 8, 8]
    modes = offered("mistral")
    assert modes == ["uncached", "uncached_last", "concat", "prealloc", "prealloc_fused"]
    ok, why = lineup.available("fast", "cpu", "mistral")
    assert not ok and "sliding window" in why
    ok, why = lineup.available("paged", "cpu", "mistral")
    assert not ok and "ring" in why


def test_mistral_matches_transformers_past_its_window_at_every_mode(mistral) -> None:
    folder, hf = mistral
    state = families.load(str(folder))
    prompt = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    strays = gate_every_mode(state, hf, prompt, 16)  # positions 9..24: past the window
    assert set(strays) == set(offered("mistral"))


def test_a_long_prefill_and_appends_after_it_see_the_window_only(mistral) -> None:
    """A prefill longer than the window, then several tokens at once, through the ring."""
    folder, hf = mistral
    model = families.load(str(folder)).model
    idx = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    cache = lineup.make_cache("prealloc", model, 1, 64)
    with torch.no_grad():
        parts = [model(idx[:, :20], cache)[0], model(idx[:, 20:27], cache)[0],
                 *(model(idx[:, t : t + 1], cache)[0] for t in range(27, 40))]
        ref = hf(idx).logits
    ours = torch.cat(parts, dim=1)
    assert float((ours - ref).abs().max()) <= 1e-4 * float(ref.abs().max())
    assert cache.k_buf.size(3) == WINDOW  # (L, B, n_kv, window, hs): a ring


@pytest.mark.parametrize("kind", ["prealloc", "concat"])
def test_the_cache_holds_window_rows_at_any_context(mistral, kind: str) -> None:
    folder, _ = mistral
    model = families.load(str(folder)).model
    cfg = model.config
    rows = measure_kv_memory(model, [4, 8, 16, 64, 120], cache_kind=kind)
    for row in rows:
        formula = costs.kv_bytes(cfg, model.dtype, 1, row["context_len"])
        assert row["kv_tensor_bytes"] == row["kv_used_bytes"] == formula, row
    flat = {r["kv_tensor_bytes"] for r in rows if r["context_len"] >= WINDOW}
    assert flat == {2 * cfg.n_layer * cfg.n_kv_head * WINDOW * cfg.head_dim * 4}
    assert kv_plan.held(cfg, [3, 9, 500]) == [3, WINDOW, WINDOW]


def test_a_ring_past_its_window_cannot_go_back_and_a_seek_starts_afresh(mistral) -> None:
    folder, _ = mistral
    state = families.load(str(folder))
    dec = make_decoder(state, "prealloc_fused", capacity=64)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(5))
    dec.prefill(ids[:, :20])
    with pytest.raises(ValueError, match="rows before position 12 have left the window"):
        dec.cache.crop(18)
    dec.seek(ids, 18)  # prefills afresh: the rows it would need are gone
    got = dec.step(ids[:, 18:19])
    with torch.no_grad():
        want = state.model(ids[:, :19], use_cache=False)[0][:, -1]
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
