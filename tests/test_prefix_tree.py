"""The prefix cache's tree and blocks (``engine.cache``), on a stand-in model whose K/V rows name
their sequence and position (``tests/prefix_fake.py``): a hit at a block edge shares every
block, a hit mid-block copies the block where it diverges and never writes the tree's, finished
requests leave their blocks to the tree, eviction takes the least recently used unlocked leaf
and never a block in use, bad input is refused with the tree intact, and random request streams
(hypothesis) keep every invariant and every row in its place after each operation. Each check
is also run with its bug planted (``prefix_fake.bugs``) and must fail there."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.cache import BudgetError, PoolExhausted, PrefixCache, RequestCancelled
from tests.prefix_fake import FakeModel, bugs, tree_content

BASES = [random.Random(b).choices(range(5), k=80) for b in range(3)]  # fixed, seeded


def cache_of(bt: int, blocks: int, **shape: int) -> tuple[FakeModel, PrefixCache]:
    model = FakeModel(**shape)
    per_block = 2 * model.config.n_layer * bt * model.config.head_dim * 8
    return model, PrefixCache(model, blocks * per_block, block_tokens=bt)


def serve(model: FakeModel, cache: PrefixCache, ids: list[int], new: int = 0,
          finish: bool = True):  # noqa: ANN201
    req = cache.admit(ids, new, cache.lookup(ids))
    logits = req.prefill(model)
    req.greedy(model, logits, new)
    cache.check()
    if finish:
        cache.finish(req)
        cache.check()
        tree_content(cache)
    return req


# ----------------------------------------------------------------- the behaviours, as checks
def hit_at_block_edge_shares_every_block() -> None:
    model, cache = cache_of(4, 64)
    a = BASES[0][:12]
    serve(model, cache, a)
    (leaf,) = cache.nodes.values()
    first_blocks = leaf.blocks[:2]
    b = a[:8] + [5, 5, 5, 5]
    req = cache.admit(b, 0, cache.lookup(b))
    assert req.cached == 8
    upper = cache.nodes[req.node.id]
    assert req.table[:2] == upper.blocks == first_blocks  # the same blocks, not copies
    assert [cache.pool.refs[x] for x in req.table[:2]] == [2, 2]  # the tree and the request
    req.prefill(model)
    cache.check()
    cache.finish(req)
    cache.check()
    tree_content(cache)


def hit_mid_block_copies_the_diverging_block() -> None:
    model, cache = cache_of(4, 64)
    a = BASES[0][:12]
    serve(model, cache, a)
    before = cache.pool.k.clone()
    b = a[:10] + [5, 5, 5]
    req = cache.admit(b, 2, cache.lookup(b))
    upper = req.node
    assert req.cached == 10 and upper.end == 10
    assert req.table[:2] == upper.blocks[:2]
    assert req.table[2] != upper.blocks[2]  # block index 2 holds positions 8..11: copied
    assert cache.pool.refs[upper.blocks[2]] == 2  # kept by both halves of the split node
    assert cache.pool.refs[req.table[2]] == 1
    assert (cache.pool.k[:, :, req.table[2], :2] == before[:, :, upper.blocks[2], :2]).all()
    cache.check()
    req.greedy(model, req.prefill(model), 2)
    for n in cache.nodes.values():  # not a row of the tree's blocks changed
        assert (cache.pool.k[:, :, n.blocks] == before[:, :, n.blocks]).all()
    cache.finish(req)
    cache.check()
    tree_content(cache)
    again = serve(model, cache, a[:11] + [5])  # the tree's rows 8..10 are still a's
    assert again.cached == 11


def eviction_spares_blocks_in_use() -> None:
    """A split leaves the boundary block to both halves; evicting the lower half must leave it
    to the upper one, which a running request is reading."""
    model, cache = cache_of(4, 16)
    a = BASES[0][:40]
    serve(model, cache, a[:30])  # 8 blocks
    r = cache.admit(a[:18] + [5, 5], 0, cache.lookup(a[:18] + [5, 5]))  # splits at 18
    cache.check()
    other = serve(model, cache, BASES[1][:32], finish=False)  # needs room: evicts the lower
    assert cache.evictions >= 1
    cache.check()
    tree_content(cache)
    cache.finish(other)
    r.prefill(model)
    cache.finish(r)
    cache.check()
    tree_content(cache)
    assert serve(model, cache, a[:19] + [5]).cached == 18  # reads the boundary block


def eviction_is_least_recently_used_and_never_locked() -> None:
    model, cache = cache_of(4, 12)
    a, b, c = ([k, *BASES[k][1:12]] for k in range(3))  # three leaves under the root, 3 blocks
    for ids in (a, b, c):
        serve(model, cache, ids)
    leaf = {n.tokens[0]: n.id for n in cache.nodes.values()}
    running = cache.admit(a + [5], 0, cache.lookup(a + [5]))  # a locked while it runs
    cache.lookup(b + [5])
    cache.lookup(c + [5])  # b and c used since: a is the least recently used, but locked
    serve(model, cache, [5] * 12)  # one block more than is free: b goes (oldest unlocked)
    serve(model, cache, [3] * 12)  # and again: c goes ([5] * 12 is newer); never a
    assert [e["node"] for e in cache.events] == [leaf[1], leaf[2]]
    assert [e["blocks_freed"] for e in cache.events] == [3, 3]
    assert leaf[0] in cache.nodes
    cache.check()
    cache.finish(running)
    cache.check()
    tree_content(cache)


CHECKS: dict[str, Callable[[], None]] = {
    "shared block written in place": hit_mid_block_copies_the_diverging_block,
    "off by one at the block edge": hit_mid_block_copies_the_diverging_block,
    "eviction frees a block in use": eviction_spares_blocks_in_use,
    "eviction of a locked leaf": eviction_is_least_recently_used_and_never_locked,
}


@pytest.mark.parametrize("check", [hit_at_block_edge_shares_every_block,
                                   hit_mid_block_copies_the_diverging_block,
                                   eviction_spares_blocks_in_use,
                                   eviction_is_least_recently_used_and_never_locked])
def test_the_prefix_cache_behaves(check: Callable[[], None]) -> None:
    check()


@pytest.mark.parametrize("bug", list(CHECKS))
def test_each_check_fails_on_its_planted_bug(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    owner, attr, planted = bugs()[bug]
    monkeypatch.setattr(owner, attr, planted)
    with pytest.raises(AssertionError):
        CHECKS[bug]()


# ----------------------------------------------------------------------------- bad input
def test_bad_input_is_refused_and_leaves_the_tree_intact() -> None:
    model, cache = cache_of(4, 8, block_size=40)
    serve(model, cache, BASES[0][:20])
    held = (cache.pool.used, sorted(cache.nodes))
    with pytest.raises(BudgetError, match="allowed: a budget of at least"):
        cache.admit(BASES[1][:36], 0)  # 9 blocks + 1 where the budget holds 8
    with pytest.raises(ValueError, match="beyond the model's context of 40"):
        cache.admit(BASES[1][:30], 11)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        cache.admit([1, 2, 99])
    with pytest.raises(BudgetError, match="holds no block"):
        PrefixCache(model, 10, block_tokens=4)
    cache.check()
    assert (cache.pool.used, sorted(cache.nodes)) == held
    calls = iter(range(1000))
    ids = [*BASES[0][:10], 5, *BASES[2][:13]]
    # polled before each layer (2 a forward): the 4th poll stops the second chunk mid-forward
    req = cache.admit(ids, 0, cache.lookup(ids), should_stop=lambda: next(calls) >= 3)
    with pytest.raises(RequestCancelled, match="cancelled after 4 of its 14 uncached prompt "
                       "tokens \\(10 came from the cache\\).*nothing of it entered the tree"):
        req.prefill(model, chunk_tokens=4)
    assert req.state == "cancelled" and not cache.running
    cache.check()
    tree_content(cache)  # (its admission evicted the leaf it split off to make room)
    assert cache.pool.used == len({b for n in cache.nodes.values() for b in n.blocks})
    assert cache.lookup(ids).length == 10
    with pytest.raises(ValueError, match="already ended"):
        cache.finish(req)


def test_a_full_pool_says_what_holds_it() -> None:
    model, cache = cache_of(4, 6)
    running = cache.admit(BASES[0][:16], 0)  # 4 blocks, running
    with pytest.raises(PoolExhausted, match="held by running requests"):
        cache.admit(BASES[1][:12], 0)
    cache.check()
    cache.cancel(running)
    cache.check()
    assert cache.pool.used == 0


# ------------------------------------------------------------------- random request streams
REQUEST = st.tuples(st.just("request"), st.integers(0, 2), st.integers(0, 40),
                    st.lists(st.integers(0, 5), max_size=6), st.integers(0, 5),
                    st.sampled_from(["finish", "finish", "finish", "cancel", "keep"]))
OPS = st.lists(st.one_of(
    REQUEST, REQUEST, REQUEST,
    st.tuples(st.just("end"), st.integers(0, 3), st.sampled_from(["finish", "cancel"])),
    st.tuples(st.just("stop"), st.integers(0, 2), st.integers(2, 40), st.integers(0, 5))),
    min_size=4, max_size=30)


def apply(model: FakeModel, cache: PrefixCache, running: list, op: tuple) -> None:
    """One operation of a stream; a refusal or a stop raises (the caller checks the rest)."""
    if op[0] == "end" and running:
        req = running.pop(op[1] % len(running))
        (cache.finish if op[2] == "finish" else cache.cancel)(req)
    elif op[0] == "stop":
        calls = iter(range(10**6))
        ids = BASES[op[1]][: op[2]]
        req = cache.admit(ids, 0, cache.lookup(ids), should_stop=lambda: next(calls) >= op[3])
        req.prefill(model, chunk_tokens=3)
        cache.finish(req)  # (when the stop came too late to stop it)
    elif op[0] == "request":
        ids = BASES[op[1]][: op[2]] + list(op[3]) or [0]
        req = cache.admit(ids, op[4], cache.lookup(ids))
        req.greedy(model, req.prefill(model), op[4])
        if op[5] == "keep" and len(running) < 3:
            running.append(req)
        else:
            (cache.cancel if op[5] == "cancel" else cache.finish)(req)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bt=st.sampled_from([1, 3, 4, 8]), room=st.integers(24, 80), ops=OPS)
def test_random_request_streams_keep_every_invariant(bt: int, room: int, ops: list) -> None:
    model, cache = cache_of(bt, room // bt)  # room for about ``room`` tokens
    running: list = []
    for op in ops:
        # refused or stopped: what follows checks that nothing was left behind
        with contextlib.suppress(BudgetError, PoolExhausted, RequestCancelled):
            apply(model, cache, running, op)
        running[:] = [r for r in running if r.state == "running"]
        cache.check()
        tree_content(cache)
    for req in running:
        cache.finish(req)
    event(f"evictions: {min(cache.evictions, 3)}+")
    event(f"nodes: {min(len(cache.nodes), 4)}+")
    cache.check()
    tree_content(cache)
    held = {b for n in cache.nodes.values() for b in n.blocks}
    assert cache.pool.used == len(held)  # with nothing running, the tree holds every block
