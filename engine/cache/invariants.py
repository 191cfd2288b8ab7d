"""The prefix cache's invariants, checked all at once: ``check(cache)`` raises ``InvariantError``
naming the first one broken (``PrefixCache.check`` calls it; the tests call it after every
operation of random request streams, and after every refused or cancelled request).

  tree      every node is reachable from the root exactly once and listed in ``cache.nodes``;
            its span is non-empty, starts where its parent's ends, and it is keyed under its
            parent by its first token; it holds one block per block index its span touches;
            a parent was used no earlier than its children (LRU evicts leaves first)
  locks     a node's lock is the number of running requests whose cached prefix runs through it
  requests  a running request's path ends where its cached prefix does; its table covers every
            position it has computed or reserved; the blocks below its hit's block index are
            the tree's own blocks along its path, the rest are private (counted once, by it)
  counts    every block's reference count is the number of nodes and requests holding it; the
            free list holds each block at 0 exactly once and nothing else
"""

from __future__ import annotations

from collections import Counter
from typing import Any


class InvariantError(AssertionError):
    """The tree or the pool is inconsistent: the message names the invariant and the node."""


def _fail(message: str) -> None:
    raise InvariantError(message)


def _tree(cache: Any) -> dict[int, Any]:
    """The nodes reachable from the root, by id, each checked against its parent."""
    bt, seen, stack = cache.block_tokens, {}, [cache.root]  # (a PrefixCache: its fields)
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            if child.id in seen:
                _fail(f"node {child.id} is reached twice")
            if child.parent is not node:
                _fail(f"node {child.id} is listed under node {node.id} but names another parent")
            if not child.tokens or key != child.tokens[0]:
                _fail(f"node {child.id} is keyed by token {key} but starts with "
                      f"{child.tokens[:1]}")
            if child.start != node.end:
                _fail(f"node {child.id} starts at {child.start}; its parent ends at {node.end}")
            want = (child.end - 1) // bt - child.start // bt + 1
            if len(child.blocks) != want:
                _fail(f"node {child.id} spans {child.start}..{child.end - 1} ({want} block "
                      f"indices) but holds {len(child.blocks)} blocks")
            if node is not cache.root and node.last_used < child.last_used:
                _fail(f"node {node.id} was used at {node.last_used}, before its child "
                      f"{child.id} ({child.last_used})")
            seen[child.id] = child
            stack.append(child)
    if set(seen) != set(cache.nodes):
        _fail(f"nodes listed {sorted(cache.nodes)} differ from the nodes reachable "
              f"{sorted(seen)}")
    return seen


def check(cache: Any) -> None:
    """Raise ``InvariantError`` at the first broken invariant (module docstring)."""
    pool, bt = cache.pool, cache.block_tokens
    nodes = _tree(cache)
    holders: Counter[int] = Counter(b for n in nodes.values() for b in n.blocks)
    locks: Counter[int] = Counter()
    for req in cache.running:
        if req.state != "running":
            _fail(f"a request marked {req.state} is still among the running")
        node = req.node
        if node is not cache.root and node.id not in nodes:
            _fail(f"a running request's cached prefix ends in node {node.id}, which left the "
                  "tree (evicted while in use)")
        if node.end != req.cached:
            _fail(f"a request cached {req.cached} tokens but its path ends at {node.end}")
        while node is not cache.root:
            locks[node.id] += 1
            node = node.parent  # type: ignore[assignment]
        covered = -(-max(req.prompt_len, req.length) // bt)
        if len(req.table) != covered:
            _fail(f"a request of {max(req.prompt_len, req.length)} positions holds "
                  f"{len(req.table)} blocks, not {covered}")
        shared = req.cached // bt
        if req.table[:shared] != cache.path_blocks(req.node)[:shared]:
            _fail(f"a request's first {shared} blocks are not the tree's along its path")
        for b in req.table[shared:]:
            if holders[b] or pool.refs[b] != 1:
                _fail(f"block {b}, written by a running request, is shared "
                      f"({pool.refs[b]} references, {holders[b]} of them tree nodes)")
        holders.update(req.table)
    for node in nodes.values():
        if node.lock != locks[node.id]:
            _fail(f"node {node.id} is locked {node.lock} times; {locks[node.id]} running "
                  "requests pass through it")
    for b in range(pool.n_blocks):
        if pool.refs[b] != holders[b]:
            _fail(f"block {b} counts {pool.refs[b]} references; {holders[b]} hold it")
    free = pool.free
    if len(set(free)) != len(free):
        _fail("the free list holds a block twice")
    if set(free) != {b for b in range(pool.n_blocks) if holders[b] == 0}:
        held = sorted(set(free) & set(holders))
        _fail(f"the free list and the blocks at 0 differ (free but held: {held[:5]})")
