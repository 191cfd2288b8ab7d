"""The serving engine's pool stays whole under random request streams (hypothesis): after every
step no block is leaked, every reference count equals its holders (``PrefixCache.check``), a
cancelled request's blocks are back at once, and a drained engine holds nothing but the tree.
Bad requests are refused at submission with one message, and the others go on. The C++ paged
kernel agrees with fp64 attention over shuffled tables at every block edge."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.cache.prefix import BudgetError
from engine.kernels import cpu as kernels
from engine.serving import ServingEngine
from tests.test_serving import BT, block_bytes, tiny

pytestmark = pytest.mark.timeout(900)

OPS = st.lists(st.tuples(st.sampled_from(["submit", "submit", "step", "step", "step",
                                          "cancel"]),
                         st.integers(0, 10**6)), min_size=5, max_size=60)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.integers(8, 30), max_seqs=st.integers(1, 6), step_tokens=st.integers(1, 40),
       policy=st.sampled_from(["fcfs", "lpm"]), ops=OPS)
def test_random_streams_keep_the_pool_whole(blocks: int, max_seqs: int, step_tokens: int,
                                            policy: str, ops: list[tuple[str, int]]) -> None:
    model = tiny("gpt2")
    eng = ServingEngine(model, blocks * block_bytes(model), block_tokens=BT,
                        max_seqs=max_seqs, step_tokens=step_tokens, policy=policy)
    live = []
    heads = [[7] * 9, [11] * 20]  # shared prefixes, ending mid-block
    for op, r in ops:
        rng = random.Random(r)
        if op == "submit":
            prompt = rng.choice([[], *heads]) + [rng.randrange(500) for _ in
                                                 range(rng.randint(1, 30))]
            new = rng.randint(1, 12)
            try:
                live.append(eng.submit(prompt, new))
            except BudgetError:
                assert -(-(len(prompt) + new) // BT) + 1 > blocks  # only when it cannot fit
        elif op == "cancel" and live:
            seq = live[r % len(live)]
            if seq.status in ("waiting", "running"):
                held = set(seq.req.table) if seq.req else set()
                private = {b for b in held if eng.cache.pool.refs[b] == 1}
                free = len(eng.cache.pool.free)
                eng.cancel(seq)
                assert len(eng.cache.pool.free) == free + len(private)  # back at once
        else:
            eng.step()
        eng.cache.check()
    eng.drain()
    eng.cache.check()
    assert not eng.cache.running
    while eng.cache.evictable():  # the tree alone holds what is not free
        eng.cache.evict_leaf(eng.cache.evictable()[0])
    assert eng.cache.pool.used == 0 and not eng.cache.nodes


def test_bad_requests_are_refused_and_the_others_go_on() -> None:
    model = tiny("llama")
    bb = block_bytes(model)
    with pytest.raises(BudgetError, match="holds no block"):
        ServingEngine(model, bb - 1, block_tokens=BT)
    eng = ServingEngine(model, 10 * bb, block_tokens=BT)
    ok = eng.submit([1, 2, 3], 4)
    context = model.config.block_size
    for prompt, new, says in (([], 4, "empty"), ([1] * context, 4, "beyond the model's context"),
                              ([1] * 70, 20, "budget holds"), ([1, 2], 0, "1 or more"),
                              ([10**6], 3, "outside the vocabulary")):
        with pytest.raises(ValueError, match=says):
            eng.submit(prompt, new)
    eng.drain()
    assert ok.status == "finished" and len(ok.generated) == 4
    assert len(eng.scheduler.waiting) == 0


def test_reads_and_kernels_are_checked() -> None:
    model = tiny("gpt2")
    with pytest.raises(ValueError, match="allowed: gather, in_place"):
        ServingEngine(model, 10 * block_bytes(model), reads="dense")
    with pytest.raises(ValueError, match="allowed: fcfs, lpm"):
        ServingEngine(model, 10 * block_bytes(model), policy="random")


def reference(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, table: torch.Tensor,
              lengths: torch.Tensor) -> torch.Tensor:
    """fp64 attention of query b over rows 0..lengths[b]-1 of its blocks."""
    n_kv, _, bt, hs = kp.shape
    out = []
    for b in range(q.size(0)):
        n = int(lengths[b])
        ids = table[b, : -(-n // bt)]
        k = kp[:, ids].reshape(n_kv, -1, hs)[:, :n].double()
        v = vp[:, ids].reshape(n_kv, -1, hs)[:, :n].double()
        g = q.size(1) // n_kv
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        att = (q[b].double().unsqueeze(1) @ k.transpose(1, 2)) / math.sqrt(hs)
        out.append((att.softmax(-1) @ v).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("n_kv, nh, hs, bt", [(3, 9, 64, 16), (4, 4, 16, 4), (2, 8, 32, 16),
                                              (1, 4, 24, 8)])
def test_the_cpu_paged_kernel_reads_each_sequence_through_its_own_table(n_kv, nh, hs, bt
                                                                        ) -> None:
    ok, why = kernels.available()
    if not ok:
        pytest.skip(f"the C++ kernel is not built: {why}")
    g = torch.Generator().manual_seed(n_kv * 100 + hs)
    nb = 48
    kp, vp = torch.randn(n_kv, nb, bt, hs, generator=g), torch.randn(n_kv, nb, bt, hs,
                                                                     generator=g)
    lengths = torch.tensor([1, bt, bt + 1, 7 * bt - 3, 2 * bt, 129], dtype=torch.long)
    width = -(-int(lengths.max()) // bt) + 1
    perm = torch.randperm(nb, generator=g).tolist()
    table = torch.full((len(lengths), width), -1, dtype=torch.long)
    at = 0
    for b, n in enumerate(lengths.tolist()):
        used = -(-n // bt)
        run = perm[at:at + used] if b % 2 else list(range(at, at + used))  # runs and shuffles
        table[b, :used] = torch.tensor(run)
        at += used
        if at + width > nb:
            at = 0
    q = torch.randn(len(lengths), nh, hs, generator=g)
    y = kernels.paged_attend(q, kp, vp, table, lengths)
    assert float((y.double() - reference(q, kp, vp, table, lengths)).abs().max()) < 1e-5
    shifted = table.roll(1, 0)  # another sequence's table: caught
    bad = kernels.paged_attend(q, kp, vp, shifted, torch.minimum(lengths, lengths.roll(1)))
    assert float((bad.double() - reference(q, kp, vp, table, lengths)).abs().max()) > 1e-2
    with pytest.raises(RuntimeError, match="allowed: 0.."):
        kernels.paged_attend(q, kp, vp, table.clamp(max=nb) + nb * (table >= 0), lengths)
    with pytest.raises(RuntimeError, match="length"):
        kernels.paged_attend(q, kp, vp, table, lengths * 0)


def test_int8_blocks_hold_four_times_the_tokens_and_batching_stays_exact() -> None:
    """int8 K/V (a scale per token and head): the same budget holds ~4x fp32's blocks; each
    request served among others gets what it gets served alone on the same int8 pool."""
    from tests.test_serving import prompts

    model = tiny("llama")
    budget = 40 * block_bytes(model)
    fp32 = ServingEngine(model, budget, block_tokens=BT)
    int8 = ServingEngine(model, budget, block_tokens=BT, kv_storage="int8", keep_logits=True,
                         max_seqs=8, step_tokens=24)
    hs = model.config.head_dim
    assert int8.cache.pool.n_blocks == budget // (block_bytes(model) * (hs + 4) // (4 * hs))
    assert int8.cache.pool.n_blocks >= 3 * fp32.cache.pool.n_blocks
    seqs = [int8.submit(p, 8) for p in prompts(10, seed=4)]
    int8.drain()
    int8.cache.check()
    for s in seqs:
        alone = ServingEngine(model, budget, block_tokens=BT, kv_storage="int8",
                              keep_logits=True)
        one = alone.submit(s.prompt, 8)
        alone.drain()
        assert s.generated == one.generated
        for a, b in zip(int8.logits[s.id], alone.logits[one.id], strict=True):
            assert float((a - b).abs().max()) <= 1e-4 * float(b.abs().max())
    with pytest.raises(ValueError, match="read gathered"):
        ServingEngine(model, budget, kv_storage="int8", reads="in_place")


def test_an_int8_pool_reads_back_what_it_stored_within_its_rounding() -> None:
    from engine.cache.blocks import BlockPool

    pool = BlockPool(2, 3, 16, 4, 10, storage="int8")
    k, v = torch.randn(2, 3, 9, 16), torch.randn(2, 3, 9, 16)
    ids = [pool.take() for _ in range(3)]
    pool.write(ids, 0, k, v)
    copy = pool.copy(ids[1])
    ko, vo = torch.zeros(2, 3, 9, 16), torch.zeros(2, 3, 9, 16)
    pool.read_into([ids[0], copy, ids[2]], 9, ko, vo)
    step = k.abs().amax(-1, keepdim=True) / 127  # half a step of rounding at most
    assert bool(((ko - k).abs() <= step / 2 + 1e-6).all())
    assert bool(((vo - v).abs() <= v.abs().amax(-1, keepdim=True) / 254 + 1e-6).all())
    assert pool.block_bytes == 2 * 2 * 3 * 4 * (16 + 4)


def test_a_sliding_window_model_is_refused_with_why() -> None:
    from engine import families

    cfg = families.config("llama-tiny")
    mistral = families.FAMILIES["mistral"].config(**{**cfg.to_dict(), "window": 8})
    model = families.model_class(mistral).random(mistral, seed=0)
    with pytest.raises(ValueError, match="last 8 tokens only"):
        ServingEngine(model, 40 * block_bytes(model))
