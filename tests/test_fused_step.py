"""The fused decode step (``engine.models.gpt2.step.fused_step``: one C++ call, ``layers.cpp``)
against ``decode_step`` with ``attend_filled``: the same ops in the same order, so the logits and
the written cache must be equal bit for bit -- for every way a product can be stored (mode 8's four
ways, chunked copies with padding, the weight-only int8 and bf16 rows), 1 and 3 sequences, at
the first position and after a filled cache. Also GGUF Q8_0 / Q4_1 blocks (rungs 14, 15: kinds
5 and 6, the integer way). The Llama family's fused step: tests/test_fast_llama.py."""

from __future__ import annotations

import shutil

import pytest
import torch

from engine.decoders import fast, weight_only
from engine.decoders.blocks import BlockDecoder
from engine.kernels import cpu as kernels
from engine.models.attention import attend_filled
from engine.models.gpt2.step import StepWeights, decode_step, fused_step, layer_norm_call
from engine.quant import blocks as quant_blocks
from engine.quant import weight_only as quant

from .conftest import small_model


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler on this machine: the kernel cannot be built")
    ok, why = kernels.build()
    assert ok, why


def _model() -> torch.nn.Module:
    model = small_model(seed=3)
    with torch.no_grad():  # biases start at zero: give them values a dropped bias would show
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    return model


def _weights(model: torch.nn.Module, way: str) -> StepWeights:
    """The model's step weights with every product stored ``way``."""
    if way in ("int8", "bfloat16"):
        return weight_only.step_weights(quant.weight_only(model, way))
    if way in ("q8_0", "q4_1"):
        return weight_only.step_weights(quant_blocks.block_view(model, way),
                                        quant_blocks.BlockStep)
    tr = model.transformer

    def lin(m: torch.nn.Linear) -> fast.Linear:
        w, b = m.weight.detach(), None if m.bias is None else m.bias.detach()
        if way.startswith("packed"):
            return fast.PackedLinear.from_out_in(w, b, int(way.removeprefix("packed")))
        if way == "kernel":
            return fast.KernelLinear(w, b)
        if way == "interleaved":
            return fast.InterleavedLinear(w, kernels.interleave(w), b)
        return fast.OwnLinear(w, b)

    layers = [(layer_norm_call(b.ln_1), lin(b.attn.c_attn), lin(b.attn.c_proj),
               layer_norm_call(b.ln_2), lin(b.mlp.c_fc), lin(b.mlp.c_proj)) for b in tr.h]
    return StepWeights(tr.wte.weight.detach(), tr.wpe.weight.detach(), layers,
                       layer_norm_call(tr.ln_f), lin(model.lm_head), model.config.n_head)


# packed3: the 512-row head and 192-wide q|k|v split in three chunks, the head padded to 513
WAYS = ["packed1", "packed3", "kernel", "interleaved", "linear", "int8", "bfloat16", "q8_0",
        "q4_1"]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("batch, pos", [(1, 0), (1, 37), (3, 37)])
def test_fused_step_equals_decode_step_bit_for_bit(way: str, batch: int, pos: int) -> None:
    model = _model()
    w = _weights(model, way)
    step = fused_step(w)
    assert step is not None, way
    cfg = model.config
    shape = (cfg.n_layer, batch, cfg.n_head, 64, cfg.n_embd // cfg.n_head)
    gen = torch.Generator().manual_seed(pos)
    k0, v0 = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)  # a filled past
    token = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)
    k_a, v_a, k_b, v_b = k0.clone(), v0.clone(), k0.clone(), v0.clone()
    with torch.no_grad():
        want = decode_step(w, token, pos, attend_filled(k_a, v_a, pos))
        got = step(token, pos, k_b, v_b)
    assert got.shape == (batch, cfg.vocab_size)
    assert torch.equal(got, want), float((got - want).abs().max())
    assert torch.equal(k_b, k_a) and torch.equal(v_b, v_a)  # the new row written, nothing else
    assert not torch.equal(k_b, k0)


def test_a_part_without_a_fused_form_keeps_the_python_step() -> None:
    model = _model()
    w = _weights(model, "kernel")
    tr = model.transformer
    modules = w._replace(head=model.lm_head)  # a module: no ``product``
    assert fused_step(modules) is None
    norms = w._replace(ln_f=tr.ln_f)  # a LayerNorm module, not an F.layer_norm partial
    assert fused_step(norms) is None
    assert fused_step(_weights(model.to(torch.bfloat16), "linear")) is None  # not fp32


@pytest.mark.parametrize("storage", [None, "int8", "q4_1"])
def test_decoders_step_through_the_fused_call_up_to_its_rows(storage: str | None,
                                                            monkeypatch) -> None:  # noqa: ANN001
    """Modes 8 and 12 step through one ``decode_layers`` call per step (tests/test_fast.py and
    test_quant.py hold their tokens to mode 1's), and more sequences than the kernel takes go
    through ``decode_step``."""
    model = _model()
    calls = []
    real = kernels.decode_layers
    monkeypatch.setattr(kernels, "decode_layers", lambda *a: calls.append(1) or real(*a))
    for batch, fused_calls in ((1, 3), (9, 0)):
        calls.clear()
        if storage is None:
            dec = fast.FastDecoder(model, batch_size=batch, capacity=64)
        elif storage in quant_blocks.FORMATS:
            dec = BlockDecoder(model, storage=storage, batch_size=batch, capacity=64)
        else:
            dec = weight_only.WeightOnlyDecoder(model, storage=storage, batch_size=batch,
                                                capacity=64)
        assert dec.fused is not None
        logits = dec.prefill(torch.randint(0, 512, (batch, 9)))
        with torch.no_grad():
            for _ in range(3):
                logits = dec.step(logits.argmax(-1, keepdim=True))
        assert len(calls) == fused_calls, batch
