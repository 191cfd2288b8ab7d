"""The Triton products and the whole Triton step (engine/kernels/gpu/linear.py,
engine/decoders/triton_step.py) against torch, on a CPU under TRITON_INTERPRET=1 (on a GPU when
there is one): every fold (norms, bias, GELU, SwiGLU, residual, RoPE, the cache write, the
attention's merge), GGUF Q8_0 / Q4_1 blocks read as stored, ragged edges, a batch; both
families' steps give mode 1's tokens and logits. Each check fails on a planted bug (a mask edge,
a GQA group, a block's scale, a nibble's order)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from engine import LlamaConfig, decode, make_decoder
from engine.models.llama.model import Llama, apply_rope, rope_angles
from engine.quant import blocks as quant_blocks

from .conftest import random_prompt, small_model
from .triton_util import DEVICE, planted

pytestmark = pytest.mark.triton

L = pytest.importorskip("engine.kernels.gpu.linear")
Q = pytest.importorskip("engine.kernels.gpu.qkv")
E = pytest.importorskip("engine.kernels.gpu.embed")
da = pytest.importorskip("engine.kernels.gpu.decode_attention")
TS = pytest.importorskip("engine.decoders.triton_step")
GEN = torch.Generator().manual_seed(0)


def rnd(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def guarded(t: torch.Tensor) -> torch.Tensor:
    """``t`` on ``DEVICE``, inside a buffer three times its size: a planted bug's stray access
    (a row, a head, a column past the edge) lands in the guard, never in memory the process
    does not own (Triton's interpreter reads and writes real addresses)."""
    buf = torch.zeros(3 * t.numel(), dtype=t.dtype, device=DEVICE)
    view = buf[t.numel() : 2 * t.numel()].view(t.shape)
    view.copy_(t)
    return view


def on(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [guarded(t) for t in ts]


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.cpu().double() - b.cpu().double()).abs().max())


TILES = (4, 16, 64)  # rows, outputs, inputs a program: every edge of the shapes below is ragged


def product_errors(mod: ModuleType) -> dict[str, float]:
    """Each product of ``mod`` (the kernels, or a planted copy) against torch: worst errors."""
    M, K, N = 3, 96, 81  # three rows, widths that leave ragged tiles
    x, w, w2, b, lw, lb, res = on(rnd(M, K), rnd(N, K), rnd(N, K), rnd(N), rnd(K), rnd(K),
                                  rnd(M, N))
    (out,) = on(torch.zeros(M, N))
    got: dict[str, float] = {}
    mod.linear(x, mod.Weight(w, "dense", N, K, b), out, norm=("layer", lw, lb, 1e-5),
               act="gelu", tiles=TILES)
    got["layernorm, bias, gelu"] = err(out, F.gelu(F.layer_norm(x, (K,), lw, lb, 1e-5) @ w.T
                                                   + b, approximate="tanh"))
    rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * lw
    mod.linear(x, mod.Weight(w, "dense", N, K), out, norm=("rms", lw, 1e-6), act="swiglu",
               w2=mod.Weight(w2, "dense", N, K), tiles=TILES)
    got["rmsnorm, swiglu"] = err(out, F.silu(rms @ w.T) * (rms @ w2.T)) / 10
    out2 = res.clone()
    mod.linear(x, mod.Weight(w, "dense", N, K), out2, residual=out2, tiles=TILES)
    got["residual in place"] = err(out2, res + x @ w.T)
    for fmt in ("Q8_0", "Q4_1"):
        (blocks,) = on(quant_blocks.quantize(w.cpu(), fmt))
        wide = quant_blocks.dequantize(blocks.cpu(), fmt, K).to(DEVICE)
        mod.linear(x, mod.Weight(blocks, fmt, N, K, b), out, tiles=TILES)
        got[fmt] = err(out, x @ wide.T + b)
    return got


def qkv_errors(mod: ModuleType, n_kv: int = 2) -> dict[str, float]:
    """q|k|v with RMSNorm and RoPE (the Llama family's, GQA) and GPT-2's (LayerNorm, bias)."""
    M, C, nh, hs, T = 2, 48, 4, 12, 10
    x, wq, wk, wv, lw, lb = on(rnd(M, C), rnd(nh * hs, C), rnd(n_kv * hs, C),
                               rnd(n_kv * hs, C), rnd(C), rnd(C))
    q, kc, vc = on(torch.zeros(M, nh, hs), torch.zeros(M, n_kv, T, hs),
                   torch.zeros(M, n_kv, T, hs))
    pos = torch.tensor([6], device=DEVICE)
    cos, sin = rope_angles(torch.arange(T, device=DEVICE), hs, 10000.0, torch.float32)
    dense = (lambda w: L.Weight(w, "dense", w.size(0), C))
    mod.qkv(x, dense(wq), dense(wk), dense(wv), ("rms", lw, 1e-6), q, kc, vc, pos,
            (cos.contiguous(), sin.contiguous()), tiles=(2, 32, 32))
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * lw
    want_q = apply_rope((h @ wq.T).view(M, nh, hs), cos[6], sin[6])
    want_k = apply_rope((h @ wk.T).view(M, n_kv, hs), cos[6], sin[6])
    got = {"rope q": err(q, want_q), "rope k": err(kc[:, :, 6], want_k),
           "v": err(vc[:, :, 6], (h @ wv.T).view(M, n_kv, hs)),
           "other rows untouched": float(kc[:, :, 7:].abs().max() + kc[:, :, :6].abs().max())}
    w, b = on(rnd(3 * nh * hs, C), rnd(3 * nh * hs))
    whole, n = L.Weight(w, "dense", 3 * nh * hs, C, b), nh * hs
    kc2, vc2 = on(torch.zeros(M, nh, T, hs), torch.zeros(M, nh, T, hs))
    mod.qkv(x, whole.rows(0, n), whole.rows(n, 2 * n), whole.rows(2 * n, 3 * n),
            ("layer", lw, lb, 1e-5), q, kc2, vc2, pos, tiles=(2, 32, 32))
    ref = (F.layer_norm(x, (C,), lw, lb, 1e-5) @ w.T + b).view(M, 3, nh, hs)
    got["gpt2 q|k|v"] = max(err(q, ref[:, 0]), err(kc2[:, :, 6], ref[:, 1]),
                            err(vc2[:, :, 6], ref[:, 2]))
    return got


def test_every_fold_of_the_products_matches_torch() -> None:
    worst = {**product_errors(L), **qkv_errors(Q)}
    assert all(e < 1e-4 for e in worst.values()), worst


def test_the_output_projection_merges_the_attention_splits() -> None:
    M, nh, n_kv, hs, C = 2, 4, 2, 12, 40
    q, k, v, wo, bo = on(rnd(M, nh, hs), rnd(M, n_kv, 70, hs), rnd(M, n_kv, 70, hs),
                         rnd(C, nh * hs), rnd(C))
    lens = torch.tensor([33, 70], dtype=torch.int32, device=DEVICE)
    part, lse = da.split_attention(q, k, v, lens)
    assert part.size(2) > 1  # several splits to merge
    out = torch.empty(M, C, device=DEVICE)
    L.linear(None, L.Weight(wo, "dense", C, nh * hs, bo), out, merge=(part, lse))
    y = da.merge(part, lse, torch.float32).reshape(M, -1)
    assert err(out, y @ wo.T + bo) < 1e-4


def test_the_embedding_reads_dense_rows_and_blocks() -> None:
    table, pe = on(rnd(50, 64), rnd(20, 64))
    tok, pos = on(torch.tensor([3, 7, 49]), torch.tensor([5]))
    out = torch.empty(3, 64, device=DEVICE)
    E.embed(tok, L.Weight(table, "dense", 50, 64), out, pe, pos)
    assert err(out, table[tok] + pe[5]) == 0
    blocks = quant_blocks.quantize(table.cpu(), "Q8_0").to(DEVICE)
    E.embed(tok, L.Weight(blocks, "Q8_0", 50, 64), out)
    assert err(out, quant_blocks.dequantize(blocks.cpu(), "Q8_0", 64)[tok.cpu()]) == 0


@pytest.mark.parametrize(("module", "old", "new", "bug"), [
    ("linear", "kmask = k < K\n        if MERGE:", "kmask = k <= K\n        if MERGE:",
     "reads a row past its last input"),
    ("linear", "omask = mmask[:, None] & nmask[None, :]",
     "omask = mmask[:, None] & (n <= N)[None, :]", "writes a column past the last output"),
    ("linear", "q.to(tl.float32) * _f16_at(base, mask)\n    base", "q.to(tl.float32)\n    base",
     "Q8_0 block scale dropped"),
    ("linear", "q = tl.where(idx[None, :] < 16, byte & 15, byte >> 4)",
     "q = tl.where(idx[None, :] < 16, byte >> 4, byte & 15)", "Q4_1 nibbles swapped"),
    ("qkv", "local = tl.where(is_q, head, tl.where(is_k, head - NQ, head - NQ - NKV))",
     "local = tl.where(is_q, head, tl.where(is_k, head - NQ, head - NQ))", "v rows from k's"),
    ("qkv", "r1 = tl.where(turn, acc1 * c - acc2 * s, acc1)",
     "r1 = tl.where(turn, acc1 * c + acc2 * s, acc1)", "RoPE turned the wrong way"),
])
def test_each_check_fails_on_a_planted_bug(module: str, old: str, new: str, bug: str,
                                           tmp_path: Path) -> None:
    if module == "linear":
        worst = product_errors(planted(L, old, new, tmp_path))
    else:
        worst = qkv_errors(planted(Q, old, new, tmp_path))
    assert not all(e < 1e-4 for e in worst.values()), f"the checks missed a planted bug: {bug}"


def small_llama() -> Llama:
    cfg = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, n_hidden=64, block_size=64,
                      vocab_size=256)
    return Llama.random(cfg, seed=0, std=0.2)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_triton_step_gives_mode_1s_tokens_and_logits(family: str) -> None:
    model = (small_model(n_layer=2, block_size=64) if family == "gpt2" else small_llama())
    model = model.to(DEVICE)
    prompt = random_prompt(5, batch=2, vocab=model.config.vocab_size).to(DEVICE)
    want = decode(make_decoder(model, "uncached"), prompt, 8, keep_logits=True)
    dec = TS.TritonDecoder(model, batch_size=2, capacity=64, capture=DEVICE == "cuda")
    got = decode(dec, prompt, 8, keep_logits=True)
    assert torch.equal(got.tokens, want.tokens)
    assert max(err(a, b) for a, b in zip(got.logits, want.logits, strict=True)) < 1e-4
    assert dec.kernel_step.kernels == 2 + 5 * model.config.n_layer


@pytest.mark.parametrize("storage", ["q8_0", "q4_1"])
def test_the_triton_step_over_gguf_blocks_is_exact_over_them(
        storage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the blocks as stored: the logits of a forward over the same blocks widened (the
    view's own forward), to fp32 rounding -- the rung's error is its blocks', nothing more. (The
    CPU kernel rounds a few rows' activations to int8, as llama.cpp does: kept out of it here,
    as it is on a GPU.)"""
    monkeypatch.setattr(quant_blocks, "kernel_takes", lambda x: False)
    model = small_model(n_layer=2, block_size=64).to(DEVICE)
    prompt = random_prompt(5, vocab=model.config.vocab_size).to(DEVICE)
    dec = TS.TritonDecoder(model, capacity=64, storage=storage, capture=DEVICE == "cuda")
    got = decode(dec, prompt, 6, keep_logits=True)
    seq = torch.cat([prompt, got.tokens[:, :-1]], dim=1)
    with torch.no_grad():
        want, _ = dec.model(seq, use_cache=False, logits="all")  # the view: widened blocks
    for i, logits in enumerate(got.logits):
        assert err(logits, want[:, 4 + i]) < 1e-4
    assert dec.extra_bytes > 0


def test_the_triton_decoder_appends_several_tokens_through_the_forward() -> None:
    """Speculative decoding's verify step on rungs 14-16 on a GPU: several tokens at once into
    the captured cache, then a step through the kernels reads them."""
    model = small_model(n_layer=2, block_size=64).to(DEVICE)
    ids = random_prompt(12, vocab=model.config.vocab_size).to(DEVICE)
    dec = TS.TritonDecoder(model, capacity=64, capture=DEVICE == "cuda")
    dec.prefill(ids[:, :5])
    got = dec.append(ids[:, 5:9])  # (1, 4, vocab)
    step = dec.step(ids[:, 9:10])
    with torch.no_grad():
        want, _ = model(ids[:, :10], use_cache=False, logits="all")
    assert err(got, want[:, 5:9]) < 1e-4 and err(step, want[:, 9]) < 1e-4
