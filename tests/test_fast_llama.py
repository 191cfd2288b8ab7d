"""The Llama family through modes 8 (fast), 12 (int8 weights) and 13 (bf16 weights):
``engine.models.llama.step``'s one-token step, mode 8's per-role products, the weight-only views,
and the fused one-call step (``decode_layers_llama``).

Exact (mode 8): mode 1's greedy tokens over 40+ tokens and the gate, on llama-tiny and on
SmolLM2's real weights with a real prompt. Lossy (12, 13): the gate, within each rung's stated
tolerance. The Python step equals the model's forward to float32 rounding (each product a
different summation order); the fused step equals the Python step to float32 rounding too --
not bit for bit: its RMSNorm sums squares in double and its RoPE / SiLU are C++ loops, each an
ulp away from torch's ops here and there (measured below: <= 1.3e-6 of the largest logit, every
way of storing the products), while its products and attention are the same kernels.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from engine import families, modes
from engine.cache import make_cache
from engine.decoders import make_decoder
from engine.decoders import weight_only as wo_decoder
from engine.decoders.fast import (
    FastDecoder,
    FastWeights,
    InterleavedLinear,
    KernelLinear,
    OwnLinear,
    PackedLinear,
)
from engine.kernels import cpu as kernels
from engine.loop import decode
from engine.models.attention import attend_filled
from engine.models.llama.model import Llama
from engine.models.llama.step import ROLES, decode_step, fused_step, role_modules, step_weights
from engine.models.llama.weights import INSTALL, package_gguf
from engine.models.loader import WeightsError
from engine.models.state import ModelState
from engine.quant import blocks as quant_blocks
from engine.quant import weight_only as quant
from instruments.checks.gate import Gate
from instruments.costmodel import costs

pytestmark = pytest.mark.timeout(900)
EXACT_MODES = ["fast"]
LOSSY_MODES = ["int8_weights", "bf16_weights"]


def _smollm2() -> bool:
    try:
        package_gguf()
        return True
    except WeightsError:
        return False


needs_smollm2 = pytest.mark.skipif(not _smollm2(),
                                   reason=f"SmolLM2's weights are not installed: {INSTALL}")
needs_kernel = pytest.mark.skipif(not any(shutil.which(c) for c in ("c++", "g++", "clang++")),
                                  reason="no C++ compiler: the kernel cannot be built")


@pytest.fixture(scope="module")
def built() -> bool:
    return kernels.build()[0] if any(shutil.which(c) for c in ("c++", "g++", "clang++")) \
        else False


@pytest.fixture(scope="module")
def tiny() -> ModelState:
    return families.load("llama-tiny", "random", seed=0)


@pytest.fixture(scope="module")
def normed() -> ModelState:
    """llama-tiny with its RMSNorm weights drawn around 1 (``Llama.random`` sets them to 1): a
    step that mixes its norms up, or drops one's weight, shows."""
    state = families.load("llama-tiny", "random", seed=0)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in state.model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
    return state


def _prompt(batch: int = 2, n: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 49152, (batch, n), generator=torch.Generator().manual_seed(seed))


# -- registry --------------------------------------------------------------------------------
def test_every_mode_runs_the_llama_family() -> None:
    for name in modes.MODES:
        assert modes.MODES[name].runs("llama") == (True, ""), name
    for name in ("fast", "int8_weights", "bf16_weights", "q8_0_weights", "q4_1_weights",
                 "compiled", "fast_compiled"):
        assert modes.available(name, "cpu", "llama") == (True, ""), name
    assert modes.available("cuda_graph", "cuda", "llama") == (True, "")
    assert modes.fastest_exact("cpu", "llama") == "fast"


@pytest.mark.parametrize("batch, n", [(2, 12), (1, 1)])
def test_the_compiled_modes_step_gives_mode1s_tokens_on_a_llama_run_eagerly(
        normed: ModelState, batch: int, n: int) -> None:
    """Modes 7 and 9's read-only step for the Llama family, uncompiled: grouped-query heads
    over a cache it only reads, RoPE from its own buffers, the row written by the caller."""
    from engine.decoders.compiled import CompiledDecoder

    p = _prompt(batch, n)
    want = decode(make_decoder(normed, "uncached", batch_size=batch), p, 40).tokens
    dec = CompiledDecoder(normed, batch_size=batch, variant="eager")
    assert dec.runner.k_buf.size(2) == normed.model.config.n_kv_head  # the cache's own heads
    assert torch.equal(decode(dec, p, 40).tokens, want)


@pytest.mark.parametrize("batch, n", [(2, 12), (1, 1)])
def test_mode_6s_step_gives_mode1s_tokens_on_a_llama_run_eagerly(
        normed: ModelState, batch: int, n: int) -> None:
    """Mode 6's captured step for the Llama family, uncaptured: RoPE from a position tensor,
    the row written by ``index_copy_``, grouped-query SDPA over every slot under a mask."""
    from engine.decoders.captured import CudaGraphDecoder

    p = _prompt(batch, n)
    want = decode(make_decoder(normed, "uncached", batch_size=batch), p, 40).tokens
    dec = CudaGraphDecoder(normed, batch_size=batch, capacity=64, capture=False, triton=False)
    assert dec.attended_keys(9) == 64  # SDPA over every slot, masked
    assert torch.equal(decode(dec, p, 40).tokens, want)


# -- mode 8 and the rungs on llama-tiny ------------------------------------------------------
@pytest.mark.parametrize("batch, n", [(2, 12), (1, 1)])
def test_fast_gives_mode1s_greedy_tokens(tiny: ModelState, batch: int, n: int) -> None:
    p = _prompt(batch, n)
    want = decode(make_decoder(tiny, "uncached", batch_size=batch), p, 48).tokens
    assert all(len(set(row.tolist())) >= 20 for row in want)  # lively: a wrong step shows
    got = decode(make_decoder(tiny, "fast", batch_size=batch), p, 48).tokens
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", EXACT_MODES + LOSSY_MODES)
def test_the_gate_passes_on_llama_tiny(tiny: ModelState, name: str) -> None:
    verdict = Gate(tiny, batch=2).check(name)
    assert verdict.passed, verdict.detail
    if name in EXACT_MODES:
        assert verdict.tokens.startswith("identical")
        assert verdict.max_diff < 1e-5 * 10  # fp32 rounding (largest logit ~8)


def test_the_gate_fails_a_step_that_forgets_rope(tiny: ModelState, monkeypatch) -> None:  # noqa: ANN001
    """The exact tolerance sees a step that skips the rotation (the gate would pass a broken
    Llama step otherwise)."""
    from engine.models.llama import step as step_llama

    monkeypatch.setattr(step_llama, "rope", lambda x, cos, sin: x)
    ModelState.of(tiny).drop(("packed",))
    dec = FastDecoder(tiny, capacity=32)
    dec.fused = None  # the Python step, where the broken rope lives
    p = _prompt(1, 8)
    dec.prefill(p)
    with torch.no_grad():
        want, _ = tiny.model(torch.cat([p, p[:, :1]], 1), use_cache=False, logits="last")
    got = dec.step(p[:, :1])
    assert (got - want[:, -1]).abs().max() > 1e-2


def test_fast_reports_its_choice_per_role_and_its_copies(tiny: ModelState) -> None:
    ModelState.of(tiny).drop(("packed",))
    dec = make_decoder(tiny, "fast")
    w = dec.weights
    assert isinstance(w, FastWeights) and set(w.choice) == set(ROLES)
    assert all(f"{role} {how}" in dec.kernel for role, how in w.choice.items())
    cfg = tiny.model.config
    sizes = {r: o * i for r, o, i, _ in [(m.rsplit(".", 1)[-1], o, i, b)
                                         for m, o, i, b in cfg.matrices()]}
    sizes["lm_head"] = cfg.vocab_size * cfg.n_embd
    copied = 4 * sum(sizes[r] * (1 if r == "lm_head" else cfg.n_layer)
                     for r, how in w.choice.items() if how in ("packed", "interleaved"))
    assert copied <= dec.extra_bytes <= 1.1 * copied + 4096
    assert make_decoder(tiny, "fast").weights is w  # chosen once per model


def _forced_products(model: Llama, way: str, chunks: int = 2) -> dict:
    out = {}
    for role, mods in role_modules(model).items():
        fns = []
        for m in mods:
            w = m.weight.detach()
            fns.append({"packed": lambda w=w: PackedLinear.from_out_in(w, None, chunks),
                        "kernel": lambda w=w: KernelLinear(w, None),
                        "linear": lambda w=w: OwnLinear(w, None),
                        "interleaved": lambda w=w: InterleavedLinear(
                            w, kernels.interleave(w), None)}[way]())
        out[role] = fns
    return out


def _step_logits(model: Llama, w, token: torch.Tensor, pos: int, cache: tuple,
                 fused: bool = False) -> torch.Tensor:
    k, v = cache
    with torch.no_grad():
        if fused:
            step = fused_step(w)
            assert step is not None
            return step(token, pos, k, v)
        return decode_step(w, token, pos, attend_filled(k, v, pos))


def _filled_cache(model: Llama, batch: int, prompt: torch.Tensor, capacity: int = 64):
    cache = make_cache("prealloc", model, batch, capacity)
    with torch.no_grad():
        model(prompt, cache, logits="last")
    return cache


@pytest.mark.parametrize("way", ["packed", "kernel", "linear", "interleaved"])
def test_every_way_of_mode_8_gives_the_models_logits(normed: ModelState, built: bool,
                                                     way: str) -> None:
    """Whichever way a role takes (timing decides, so a test cannot), the Python step over it
    gives the model's own forward to float32 rounding: 11 tokens cached, the 12th stepped."""
    if way in ("kernel", "interleaved") and not built:
        pytest.skip("the C++ kernel is not built")
    model = normed.model
    p = _prompt(2, 12)
    cache = _filled_cache(model, 2, p[:, :11])
    w = step_weights(model, _forced_products(model, way))
    got = _step_logits(model, w, p[:, 11:], 11, (cache.k_buf, cache.v_buf))
    with torch.no_grad():
        want, _ = model(p, use_cache=False, logits="last")
    scale = float(want.abs().max())
    assert float((got - want[:, -1]).abs().max()) <= 2e-6 * scale, way


def test_the_sdpa_path_attends_grouped_queries_as_the_kernel_does(normed: ModelState,
                                                                  built: bool) -> None:
    """Off the kernel (a GPU, no build, gradients on) ``attend_filled`` runs SDPA with
    ``enable_gqa``: 4 query heads over 2 K/V heads, the same as the kernel's attend."""
    model = normed.model
    p = _prompt(2, 12)
    w = step_weights(model, _forced_products(model, "linear"))
    c1, c2 = _filled_cache(model, 2, p[:, :11]), _filled_cache(model, 2, p[:, :11])
    with torch.enable_grad():  # attend_filled takes SDPA's path
        sdpa = decode_step(w, p[:, 11:], 11, attend_filled(c1.k_buf, c1.v_buf, 11))
    with torch.no_grad():
        want, _ = model(p, use_cache=False, logits="last")
    assert float((sdpa.detach() - want[:, -1]).abs().max()) <= 2e-6 * float(want.abs().max())
    if built:
        kern = _step_logits(model, w, p[:, 11:], 11, (c2.k_buf, c2.v_buf))
        assert float((sdpa.detach() - kern).abs().max()) <= 2e-6 * float(kern.abs().max())
        # the same rows, up to the rounding of the first layer's two attentions
        assert torch.allclose(c1.k_buf, c2.k_buf, rtol=1e-5, atol=1e-5)
        assert torch.allclose(c1.v_buf, c2.v_buf, rtol=1e-5, atol=1e-5)


# -- the fused step against the Python step --------------------------------------------------
def _stored_weights(state: ModelState, way: str):  # noqa: ANN202
    model = state.model
    if way in ("int8", "bfloat16"):
        return wo_decoder.step_weights(quant.weight_only(state, way))
    if way in ("q8_0", "q4_1"):
        return wo_decoder.step_weights(quant_blocks.block_view(state, way),
                                       quant_blocks.BlockStep)
    how, chunks = (way[:-1], int(way[-1])) if way[-1].isdigit() else (way, 1)
    return step_weights(model, _forced_products(model, how, chunks))


# fused vs Python, max |Δ| / largest |logit| measured on these cases (llama-tiny, norms drawn
# around 1): 0.8-1.3e-6 for mode 8's ways, 5-9e-7 int8 / bf16, 2-3e-7 Q8_0 / Q4_1 -- never bit for
# bit. The block kinds round x to 8 bits per 32: an ulp of difference in an RMSNorm output could
# move one x value across a rounding step (not seen here), so they are allowed 1e-3
FUSED_TOL = {"q8_0": 1e-3, "q4_1": 1e-3}
WAYS = ["packed1", "packed3", "kernel", "interleaved", "linear", "int8", "bfloat16", "q8_0",
        "q4_1"]


@needs_kernel
@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("batch, pos", [(1, 0), (1, 37), (3, 37)])
def test_fused_step_equals_the_python_step(normed: ModelState, built: bool, way: str,
                                           batch: int, pos: int) -> None:
    assert built
    model = normed.model
    w = _stored_weights(normed, way)
    cfg = model.config
    shape = (cfg.n_layer, batch, cfg.n_kv_head, 64, cfg.head_dim)
    gen = torch.Generator().manual_seed(pos)
    k0, v0 = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    token = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)
    k_a, v_a, k_b, v_b = k0.clone(), v0.clone(), k0.clone(), v0.clone()
    want = _step_logits(model, w, token, pos, (k_a, v_a))
    got = _step_logits(model, w, token, pos, (k_b, v_b), fused=True)
    assert got.shape == (batch, cfg.vocab_size)
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= FUSED_TOL.get(way, 2e-6) * scale, way
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    row = torch.zeros(64, dtype=torch.bool)
    row[pos] = True
    assert torch.equal(k_b[:, :, :, ~row], k0[:, :, :, ~row])  # only row ``pos`` written
    assert torch.allclose(k_b, k_a, atol=FUSED_TOL.get(way, 2e-6) * 10)
    assert torch.allclose(v_b, v_a, atol=FUSED_TOL.get(way, 2e-6) * 10)


@needs_kernel
@pytest.mark.parametrize("name", ["fast", "int8_weights", "q4_1_weights"])
def test_decoders_step_through_one_fused_call(tiny: ModelState, built: bool, name: str,
                                              monkeypatch) -> None:  # noqa: ANN001
    """Up to ``kernels.MAX_ROWS`` sequences a step is one ``decode_layers_llama`` call; more go
    through the Python step."""
    assert built
    calls = []
    real = kernels.decode_layers_llama
    monkeypatch.setattr(kernels, "decode_layers_llama", lambda *a: calls.append(1) or real(*a))
    for batch, fused_calls in ((1, 3), (9, 0)):
        calls.clear()
        dec = make_decoder(tiny, name, batch_size=batch, capacity=32)
        assert dec.fused is not None
        logits = dec.prefill(_prompt(batch, 9))
        for _ in range(3):
            logits = dec.step(logits.argmax(-1, keepdim=True))
        assert len(calls) == fused_calls, (name, batch)


# -- the weight-only views of a Llama -------------------------------------------------------
def test_the_llama_view_shares_everything_but_the_linears(tiny: ModelState) -> None:
    model = tiny.model
    view = quant.weight_only(tiny, "int8")
    assert isinstance(view, quant.WeightOnlyView) and isinstance(view, Llama)
    assert view.model.norm is model.model.norm
    assert view.model.layers[1].input_layernorm is model.model.layers[1].input_layernorm
    assert isinstance(view.model.layers[0].mlp.gate_proj, quant.Int8Linear)
    assert view.model.embed_tokens.head[0] is view.lm_head  # tied: quantized once
    assert isinstance(model.lm_head, torch.nn.Linear)  # the shared model never changes
    assert view.dtype == model.dtype and view.device == model.device
    for storage in quant.STORAGES:
        v = quant.weight_only(tiny, storage)
        assert v.stored_bytes() == costs.linear_weight_bytes(model.config, model.dtype, storage)


def test_a_bug_at_the_top_of_a_llama_is_in_its_view() -> None:
    """A check's silent bug that swaps the model's own class (the Llama family's positions
    bug) is in a view made while it is on: the view subclasses the bugged class."""
    from instruments.checks.bugs import inject_bug, private_view

    model = private_view(families.load("llama-tiny", "random", seed=1).model)
    idx = _prompt(1, 12)

    def last() -> torch.Tensor:
        view = quant.weight_only(model, "bfloat16")
        cache = make_cache("prealloc", view, 1, 16)
        view(idx[:, :11], cache)
        return view(idx[:, 11:], cache)[0][0, -1]

    clean = last()
    with inject_bug(model, "positions"):
        assert type(quant.weight_only(model, "bfloat16")).__name__ != "WeightOnlyLlama"
        assert not torch.allclose(last(), clean, atol=1e-3)
    assert torch.equal(last(), clean)


# -- SmolLM2's real weights ------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2() -> ModelState:
    return families.load("smollm2-135m", "package")


@pytest.fixture(scope="module")
def smollm2_gate(smollm2: ModelState) -> Gate:
    return Gate(smollm2)


@needs_smollm2
def test_fast_gives_mode1s_tokens_on_smollm2_for_a_real_prompt(smollm2: ModelState) -> None:
    """48 greedy tokens of mode 8 after a real prompt: each is the token the uncached model
    picks after the same prefix (one uncached forward checks them all), and the stream is
    varied (a stuck stream would prove little)."""
    from engine.models.llama.tokenizer import load_tokenizer

    ids = load_tokenizer().encode("The key-value cache in a transformer")
    prompt = torch.tensor([ids])
    got = decode(make_decoder(smollm2, "fast", capacity=len(ids) + 48), prompt, 48).tokens
    with torch.no_grad():
        full, _ = smollm2.model(torch.cat([prompt, got[:, :-1]], 1), use_cache=False)
    picks = full[0, len(ids) - 1:].argmax(-1)
    assert torch.equal(picks, got[0])
    assert len(set(got[0].tolist())) >= 20


@needs_smollm2
@pytest.mark.parametrize("name", EXACT_MODES + LOSSY_MODES)
def test_the_gate_passes_on_smollm2(smollm2_gate: Gate, name: str) -> None:
    verdict = smollm2_gate.check(name)
    assert verdict.passed, verdict.detail
    if name in EXACT_MODES:
        assert verdict.tokens.startswith("identical")


@pytest.mark.parametrize("variant", ["compiled", "fast_compiled"])
def test_the_compiled_modes_compile_the_llama_step(normed: ModelState, variant: str) -> None:
    """torch.compile of the Llama family's read-only step (inductor on a CPU): mode 1's tokens.
    Mode 7 compiles llama-tiny in ~15 s on 2 cores, so it always runs; mode 9 (freezing +
    max-autotune) with KV_LAB_COMPILE_TESTS=1 like the others."""
    import os

    from engine.decoders.compiled import CompiledDecoder

    if variant == "fast_compiled" and not os.environ.get("KV_LAB_COMPILE_TESTS"):
        pytest.skip("compiles with max-autotune; set KV_LAB_COMPILE_TESTS=1 to run")
    p = _prompt(2, 12)
    want = decode(make_decoder(normed, "uncached", batch_size=2), p, 30).tokens
    dec = CompiledDecoder(normed, batch_size=2, variant=variant)
    assert dec.compile_s > 0
    assert torch.equal(decode(dec, p, 30).tokens, want)
