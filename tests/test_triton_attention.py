"""The Triton decode attention (engine/kernels/gpu/decode_attention.py) against torch on a CPU,
under TRITON_INTERPRET=1: multi-head and grouped-query heads, a context of 1, the last slot,
lengths that differ across the batch, tiles and splits cut at ragged edges, fp32 and bf16; the
same over a paged pool read through a shuffled block table; and each check fails on a planted
bug (a mask edge off by one, a wrong GQA group, a split's start, a wrong block or sequence)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from .triton_util import DEVICE, planted

pytestmark = pytest.mark.triton

da = pytest.importorskip("engine.kernels.gpu.decode_attention")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
              ) -> torch.Tensor:
    """Softmax attention of each sequence's query over its first ``lengths[b]`` rows, in fp64."""
    B, nh, hs = q.shape
    group = nh // k.size(1)
    out = []
    for b in range(B):
        n = int(lengths[b])
        kb = k[b, :, :n].double().repeat_interleave(group, 0)  # (nh, n, hs)
        vb = v[b, :, :n].double().repeat_interleave(group, 0)
        w = torch.softmax(torch.einsum("hd,hnd->hn", q[b].double(), kb) / hs ** 0.5, -1)
        out.append(torch.einsum("hn,hnd->hd", w, vb))
    return torch.stack(out).cpu()


def case(n_kv: int, lengths: list[int], t_max: int = 80, nh: int = 4, hs: int = 16,
         dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)
    q = torch.randn(B, nh, hs, generator=gen).to(dtype)
    k = torch.randn(B, n_kv, t_max, hs, generator=gen).to(dtype)
    v = torch.randn(B, n_kv, t_max, hs, generator=gen).to(dtype)
    for b, n in enumerate(lengths):  # rows past the length hold garbage a kernel must not read
        k[b, :, n:] = 50.0
        v[b, :, n:] = 1e4
    return (q.to(DEVICE), k.to(DEVICE), v.to(DEVICE),
            torch.tensor(lengths, dtype=torch.int32, device=DEVICE))


CASES = [  # (K/V heads of 4 query heads, lengths of the batch, cache rows)
    (4, [1], 80), (4, [80], 80), (4, [37, 64], 80), (2, [33, 1], 80), (1, [65, 80], 80),
    (2, [5], 7), (4, [300], 300),
]


def worst_error(mod: ModuleType, n_kv: int, lengths: list[int], t_max: int,
                dtype: torch.dtype = torch.float32) -> float:
    q, k, v, lens = case(n_kv, lengths, t_max, dtype=dtype)
    got = mod.decode_attention(q, k, v, lens)
    assert got.shape == q.shape and got.dtype == dtype
    return float((got.double().cpu() - reference(q, k, v, lens)).abs().max())


@pytest.mark.parametrize(("n_kv", "lengths", "t_max"), CASES)
def test_decode_attention_matches_torch(n_kv: int, lengths: list[int], t_max: int) -> None:
    assert worst_error(da, n_kv, lengths, t_max) < 1e-5


def test_decode_attention_in_bf16_is_within_bf16_rounding() -> None:
    assert worst_error(da, 2, [37, 80], 80, torch.bfloat16) < 2e-2


def paged(k: torch.Tensor, v: torch.Tensor, bt: int, seed: int = 1
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cache (B, n_kv, T_max, hs) cut into blocks of ``bt`` rows, stored in a pool in a
    shuffled order among spare blocks of garbage: (k_pool, v_pool, table)."""
    B, n_kv, t_max, hs = k.shape
    per_seq = -(-t_max // bt)
    n_blocks = B * per_seq + 3  # three blocks nobody holds
    order = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(seed))
    table = order[: B * per_seq].view(B, per_seq)
    pools = []
    for src, junk in ((k, 50.0), (v, 1e4)):
        pool = torch.full((n_blocks, n_kv, bt, hs), junk, dtype=src.dtype)
        padded = torch.full((B, n_kv, per_seq * bt, hs), junk, dtype=src.dtype)
        padded[:, :, :t_max] = src.cpu()
        pool[table.flatten()] = padded.view(B, n_kv, per_seq, bt, hs).transpose(1, 2).reshape(
            B * per_seq, n_kv, bt, hs)
        pools.append(pool.to(DEVICE))
    return pools[0], pools[1], table.to(DEVICE)


def worst_paged_error(mod: ModuleType, n_kv: int, lengths: list[int], t_max: int,
                      bt: int = 16) -> float:
    q, k, v, lens = case(n_kv, lengths, t_max)
    k_pool, v_pool, table = paged(k, v, bt)
    got = mod.decode_attention(q, k_pool, v_pool, lens, table=table)
    assert got.shape == q.shape
    return float((got.double().cpu() - reference(q, k, v, lens)).abs().max())


PAGED_CASES = [  # (K/V heads, lengths, cache rows, block rows): block edges, 2 blocks a tile
    (4, [16], 80, 16), (4, [17, 1], 80, 16), (2, [80, 33], 80, 16), (1, [65], 80, 16),
    (2, [5, 7], 7, 4), (4, [300, 129], 300, 16),
]


@pytest.mark.parametrize(("n_kv", "lengths", "t_max", "bt"), PAGED_CASES)
def test_paged_decode_attention_reads_the_blocks_in_table_order(
        n_kv: int, lengths: list[int], t_max: int, bt: int) -> None:
    assert worst_paged_error(da, n_kv, lengths, t_max, bt) < 1e-5


def test_a_paged_call_with_a_bad_table_says_what_is_allowed() -> None:
    q, k, v, lens = case(2, [4, 4], 16)
    k_pool, v_pool, table = paged(k, v, 4)
    with pytest.raises(ValueError, match="table \\(B, blocks\\) of block ids"):
        da.decode_attention(q, k_pool, v_pool, lens, table=table[:1])


@pytest.mark.parametrize(("old", "new", "bug"), [
    ("b * st_b + t // PAGE, mask", "b * st_b + t // PAGE // 2, mask", "wrong block of the table"),
    ("tab_ptr + b * st_b", "tab_ptr + 0 * st_b", "every sequence reads the first one's table"),
    ("k_rows = blk * sk_b + (t % PAGE) * sk_t", "k_rows = blk * sk_b + (t % PAGE // 2) * sk_t",
     "wrong row inside a block"),
])
def test_each_paged_check_fails_on_a_planted_bug(old: str, new: str, bug: str,
                                                 tmp_path: Path) -> None:
    mod = planted(da, old, new, tmp_path)
    worst = max(worst_paged_error(mod, *c) for c in PAGED_CASES)
    assert not worst < 1e-3, f"the checks missed a planted bug: {bug}"


def worst_int8_error(mod: ModuleType, n_kv: int, lengths: list[int], t_max: int) -> float:
    """The kernel over int8 rows and their per-token, per-head scales, against fp64 attention
    over the same rows dequantized."""
    q, k, v, lens = case(n_kv, lengths, t_max)
    stored = []
    for x in (k, v):
        s = (x.abs().amax(-1) / 127).clamp_min(1e-12)  # (B, n_kv, T_max)
        stored.append(((x / s[..., None]).round().clamp(-127, 127).to(torch.int8), s))
    (kq, ks), (vq, vs) = stored
    got = mod.decode_attention(q, kq, vq, lens, scales=(ks, vs))
    want = reference(q, kq.double() * ks[..., None], vq.double() * vs[..., None], lens)
    return float((got.double().cpu() - want).abs().max())


@pytest.mark.parametrize(("n_kv", "lengths", "t_max"), CASES)
def test_decode_attention_over_int8_rows_matches_torch(n_kv: int, lengths: list[int],
                                                       t_max: int) -> None:
    assert worst_int8_error(da, n_kv, lengths, t_max) < 1e-5


def test_the_int8_check_fails_on_a_planted_bug(tmp_path: Path) -> None:
    mod = planted(da, "s_rows = b * ss_b + g * ss_h + t", "s_rows = b * ss_b + t", tmp_path)
    worst = max(worst_int8_error(mod, *c) for c in CASES)
    assert not worst < 1e-3, "the checks missed every head reading the first head's scales"


def test_the_grid_depends_on_the_capacity_only() -> None:
    """A CUDA graph replays one grid at every position: splits come from T_max, not lengths."""
    assert da.splits_for(1024, 12) == da.splits_for(1024, 12)
    split_t, n = da.splits_for(1024, 12)
    assert split_t % da.BLOCK_T == 0 and split_t * n >= 1024 > split_t * (n - 1)
    assert n * 12 >= da.MIN_PROGRAMS // 2  # whole tiles per split: within 2x of the aim
    assert da.splits_for(8192, 256 * 12)[1] == 1  # a large batch needs no split


def test_bad_shapes_say_what_is_allowed() -> None:
    q, k, v, lens = case(3, [4], 16, nh=4)
    with pytest.raises(ValueError, match="n_kv dividing nh"):
        da.decode_attention(q, k, v, lens)


@pytest.mark.parametrize(("old", "new", "bug"), [
    ("tmask = t < end", "tmask = t <= end", "reads the row past the length"),
    ("heads = g * GROUP + j", "heads = g + j * N_KV", "wrong GQA group"),
    ("start = split * split_t", "start = split * split_t + 1", "a split skips its first row"),
    ("w = tl.exp(lse - tl.max(lse, axis=0))", "w = tl.exp(lse - tl.max(lse, axis=0)) * 0 + 1",
     "splits merged unweighted"),
])
def test_each_check_fails_on_a_planted_bug(old: str, new: str, bug: str,
                                           tmp_path: Path) -> None:
    mod = planted(da, old, new, tmp_path)
    worst = max(worst_error(mod, n_kv, lengths, t_max) for n_kv, lengths, t_max in CASES)
    assert not worst < 1e-3, f"the checks missed a planted bug: {bug}"  # NaN counts as caught


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_mode_6_with_the_kernel_gives_mode_1s_tokens(family: str) -> None:
    """Mode 6's step with the decode kernel (its GPU attention), run eagerly: mode 1's tokens,
    GPT-2's heads and the Llama family's grouped ones."""
    from engine import decode, make_decoder
    from engine.decoders.captured import CudaGraphDecoder
    from engine.models.llama.model import Llama, LlamaConfig

    from .conftest import random_prompt, small_model

    if family == "gpt2":
        model = small_model(n_layer=2, block_size=64).to(DEVICE)
    else:
        model = Llama.random(LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                                         n_hidden=64, block_size=64, vocab_size=256), seed=0,
                             std=0.2).to(DEVICE)
    prompt = random_prompt(5, vocab=model.config.vocab_size).to(DEVICE)
    want = decode(make_decoder(model, "uncached"), prompt, 12).tokens
    dec = CudaGraphDecoder(model, capture=DEVICE == "cuda", triton=True)
    assert dec.attended_keys(9) == 9  # it reads the filled rows, not the capacity
    assert torch.equal(decode(dec, prompt, 12).tokens, want)


def in_place_model(family: str) -> torch.nn.Module:
    """A 2-layer model on ``DEVICE``: GPT-2's test shape (heads of 16), or a Llama with grouped
    heads of 16 ("llama") or of 8 ("llama-narrow": too narrow for the prefill kernel)."""
    from engine.models.llama.model import Llama, LlamaConfig

    from .conftest import small_model

    if family == "gpt2":
        return small_model(n_layer=2, block_size=64).to(DEVICE)
    cfg = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2,
                      n_embd=32 if family == "llama-narrow" else 64, n_hidden=64, block_size=64,
                      vocab_size=256)
    return Llama.random(cfg, seed=0, std=0.2).to(DEVICE)


def counted_updates(monkeypatch: pytest.MonkeyPatch, cache_class: type) -> list[int]:
    """The new-row count of every ``cache_class.update`` call from now on (a read-back: the
    gather or the dequantized copy that reading in place avoids)."""
    calls: list[int] = []
    real = cache_class.update

    def update(self: object, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(k.size(2))
        return real(self, layer, k, v)

    monkeypatch.setattr(cache_class, "update", update)
    return calls


@pytest.mark.parametrize("family", ["gpt2", "llama", "llama-narrow"])
def test_the_paged_cache_read_in_place_gives_mode_1s_tokens(
        family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mode 10's cache read in place (its GPU path): every forward's attention through the block
    table -- the prefill by the prefill kernel, each step by the split kernel, never
    ``update``'s gather -- gives mode 1's tokens and logits, GPT-2's heads and the Llama
    family's grouped ones, a batch of 2, across block edges (prompt 5, 20 steps). Heads of 8
    channels (too narrow for the prefill kernel's products) gather their prefill only."""
    from engine import decode, make_decoder
    from engine.cache.paged import PagedKVCache
    from engine.decoders.eager import Decoder

    from .conftest import random_prompt

    model = in_place_model(family)
    prompt = random_prompt(5, batch=2, vocab=model.config.vocab_size).to(DEVICE)
    want = decode(make_decoder(model, "uncached"), prompt, 20, keep_logits=True)
    gathers = counted_updates(monkeypatch, PagedKVCache)
    dec = Decoder(model, batch_size=2, capacity=64, cache_kind="paged", reads="in_place")
    got = decode(dec, prompt, 20, keep_logits=True)
    assert set(gathers) == ({5} if family == "llama-narrow" else set())  # no step gathered
    assert dec.cache.reads == "in_place" and dec.cache.allocated == 2  # 24 rows: 2 blocks
    assert torch.equal(got.tokens, want.tokens)
    worst = max(float((a.cpu() - b.cpu()).abs().max())
                for a, b in zip(got.logits, want.logits, strict=True))
    assert worst < 1e-4


def test_a_paged_cache_reads_in_place_only_where_triton_compiles() -> None:
    from engine.cache import make_cache
    from engine.cache.paged import default_reads

    from .conftest import small_model

    assert default_reads("cpu") == "gather"  # the interpreter is for tests, not for timing
    assert default_reads("cuda") == "in_place"  # triton is installed here
    model = small_model(n_layer=1, block_size=32)
    assert make_cache("paged", model, 1, 32).reads == "gather"
    with pytest.raises(ValueError, match="allowed: gather, in_place"):
        make_cache("paged", model, 1, 32, reads="scatter")
    with pytest.raises(ValueError, match="only a paged or quantized cache"):
        make_cache("prealloc", model, 1, 32, reads="in_place")
    assert make_cache("kv_int8", model, 1, 32).reads == "gather"


def test_the_device_checks_read_comparison_times_both_ways_after_comparing_logits() -> None:
    """The ``cache-reads`` stage's measurement (a GPU stage) run here under the interpreter:
    one row per point, both ways' samples interleaved, the logits compared first."""
    from scripts.device_check.gpu_stages import time_reads

    from .conftest import small_model

    model = small_model(n_layer=2, block_size=64).to(DEVICE)
    rows = time_reads(model, (("paged", 2, 20), ("int8_kv", 1, 100)), rounds=2)
    assert [(r["mode"], r["batch_size"], r["context_len"]) for r in rows] == [
        ("paged", 2, 20), ("int8_kv", 1, 63)]
    for r in rows:
        assert r["logits_rel_diff"] < 1e-5
        assert len(r["gather_samples_ms"]) == len(r["in_place_samples_ms"]) == 2
        assert r["speedup"] == r["gather_ms"] / r["in_place_ms"] > 0


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_int8_cache_read_in_place_gives_its_gathered_logits(
        family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mode 11's cache read in place (its GPU path): every step by the kernel over the int8
    rows as stored -- never ``update``'s dequantized copy -- gives the logits and tokens of the
    same cache read back dequantized (the same stored values: fp32 rounding apart)."""
    from engine import decode
    from engine.cache.quantized import QuantizedKVCache
    from engine.decoders.eager import Decoder

    from .conftest import random_prompt

    model = in_place_model(family)
    prompt = random_prompt(5, batch=2, vocab=model.config.vocab_size).to(DEVICE)
    want = decode(Decoder(model, batch_size=2, capacity=64, cache_kind="kv_int8",
                          reads="gather"), prompt, 16, keep_logits=True)
    steps = counted_updates(monkeypatch, QuantizedKVCache)
    got = decode(Decoder(model, batch_size=2, capacity=64, cache_kind="kv_int8",
                         reads="in_place"), prompt, 16, keep_logits=True)
    assert set(steps) == {5}  # the prefill dequantized; no step did
    assert torch.equal(got.tokens, want.tokens)
    worst = max(float((a.cpu() - b.cpu()).abs().max() / b.abs().max())
                for a, b in zip(got.logits, want.logits, strict=True))
    assert worst < 1e-4
