"""The prefix cache: a radix tree of token ids over reference-counted KV blocks, LRU-evicted.

``PrefixCache(model, budget_bytes, block_tokens=16, reads=None, buffers=True, storage="model")``
keeps the K/V rows of the prompts it has seen, in an ``engine.cache.blocks.BlockPool`` of
``budget_bytes // block_bytes`` blocks on the model's device and in its dtype (``storage``
"int8": int8 rows scaled per token and head, read back in its dtype). ``reads``
(``engine.cache.paged``'s: None, the device's default): "gather" copies a request's cached rows
into buffers it attends over; "in_place" (on a GPU) attends through its block table, no copy.
A request starts the same way SGLang's RadixAttention serves one:

  hit = cache.lookup(ids)           the longest cached prefix of ``ids`` (at most len - 1
                                    tokens: the last prompt token is always computed, so the
                                    request has logits); pure tree work, no tensor touched
  req = cache.admit(ids, max_new_tokens, hit)   an ``engine.cache.request.Request``: it shares
                                    the hit's full blocks (one more reference each), copies the
                                    block where the hit ends mid-block (its rows up to the hit
                                    are kept, the rest is the request's to write: a shared block
                                    is never written in place), takes fresh blocks for the rest
                                    of its prompt, and locks the hit's path against eviction
  req.prefill(model) / req.step(model, token)    (``engine.cache.request``)
  cache.finish(req)                 the request's rows enter the tree: what the tree lacked
                                    becomes a new leaf holding the request's own blocks; its
                                    other references are dropped; the path is unlocked
  cache.cancel(req)                 every reference dropped, nothing enters the tree

The tree: every node holds a span of token ids at absolute positions ``start..end-1`` and the
blocks of the block indices that span touches (``start // bt`` .. ``(end - 1) // bt``). Children
are keyed by their first token. A node split mid-block leaves the boundary block to both halves
(one more reference); a leaf added from a request that diverged mid-block holds its own copy of
that block. A block's count is the number of nodes and running requests holding it; at 0 it is
free. Eviction takes whole leaves, least recently used first (a logical clock ticked by every
lookup and insert along the path), never a node a running request locks, until the blocks asked
for are free; a request that would need more blocks than the pool has is refused before it
touches the tree (``BudgetError``), and so is a prompt that does not fit the model.

``check()`` raises ``InvariantError`` naming the first broken invariant (spans, children keys,
block counts per node, reference counts = holders, free list = blocks at 0, locks = running
requests' paths, a running request's writable blocks private, LRU clock monotone up the tree,
bytes within the budget); the tests run it after every operation of random request streams.
``snapshot()`` is the tree as rows (one per node: span, blocks, their counts, lock, last use) and
``events`` the evictions as they happened: what the page draws.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .blocks import BlockPool, PoolExhausted, bytes_per_block
from .invariants import InvariantError, check
from .paged import resolve_reads
from .request import Request

__all__ = ["BudgetError", "Hit", "InvariantError", "Node", "PoolExhausted", "PrefixCache"]


class BudgetError(ValueError):
    """A request the budget cannot hold, or a budget that holds no block."""


@dataclass(eq=False)
class Node:
    id: int
    parent: Node | None
    start: int  # absolute position of the first token
    tokens: list[int]
    blocks: list[int]  # one block id per block index from start // bt to (end - 1) // bt
    children: dict[int, Node] = field(default_factory=dict)
    lock: int = 0  # running requests whose cached prefix runs through this node
    last_used: int = 0  # logical clock of the last lookup or insert that passed here

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class Hit:
    """A lookup's answer: ``length`` tokens cached, ending at the end of ``node``."""

    node: Node
    length: int


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common start of two token lists (slices compared 64 at a time in C)."""
    n, i = min(len(a), len(b)), 0
    while i < n and a[i : i + 64] == b[i : i + 64]:
        i += 64
    i = min(i, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """A radix tree of token ids over one block pool (see the module docstring)."""

    def __init__(self, model: Any, budget_bytes: int, *, block_tokens: int = 16,
                 reads: str | None = None, buffers: bool = True,
                 storage: str = "model") -> None:
        cfg = model.config
        reads = resolve_reads(reads, model.device, "the prefix cache")
        # in place: our Triton kernels through each request's table (their products need heads
        # of 16 channels or more; int8 rows are not read in place); else each request copies
        # its cached rows into buffers
        self.in_place = reads == "in_place" and cfg.head_dim >= 16 and storage == "model"
        # buffers=False: requests hold none and are never run through the model one by one
        # (the serving engine's batched step reads and writes the pool itself)
        self.buffers = buffers and not self.in_place
        block_bytes = bytes_per_block(cfg.n_layer, cfg.n_kv_head, cfg.head_dim, block_tokens,
                                      model.dtype, storage)
        n_blocks = int(budget_bytes) // block_bytes
        if n_blocks < 1:
            raise BudgetError(f"a budget of {int(budget_bytes):,} B holds no block of "
                              f"{block_tokens} tokens ({block_bytes:,} B for this model); "
                              f"allowed: at least {block_bytes:,} B")
        self.pool = BlockPool(cfg.n_layer, cfg.n_kv_head, cfg.head_dim, block_tokens, n_blocks,
                              device=model.device, dtype=model.dtype, storage=storage)
        self.block_tokens, self.context, self.vocab = block_tokens, cfg.block_size, cfg.vocab_size
        self.model_shape = (cfg.n_layer, cfg.n_kv_head, cfg.head_dim, model.device, model.dtype)
        self._ids = itertools.count(1)
        self.root = Node(0, None, 0, [], [])
        self.nodes: dict[int, Node] = {}
        self.running: set[Request] = set()
        self.clock = 0
        self.evictions = 0
        self.events: list[dict[str, Any]] = []  # one row per evicted leaf, in order
        self._scratch: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ----------------------------------------------------------------------------- the tree
    def tokens_held(self) -> int:
        return sum(len(n.tokens) for n in self.nodes.values())

    def _touch(self, node: Node | None) -> None:
        self.clock += 1
        while node is not None:
            node.last_used = self.clock
            node = node.parent

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after its first ``k`` tokens; the new upper half is returned (it takes
        the node's place under its parent, its lock and last use)."""
        bt, s = self.block_tokens, node.start
        cut = s + k
        upper_n = (cut - 1) // bt - s // bt + 1
        upper = Node(next(self._ids), node.parent, s, node.tokens[:k], node.blocks[:upper_n],
                     {node.tokens[k]: node}, node.lock, node.last_used)
        lower_from = cut // bt - s // bt
        if cut % bt:  # the boundary block holds rows of both halves: both keep it
            self.pool.ref(node.blocks[lower_from])
        node.parent.children[node.tokens[0]] = upper  # type: ignore[union-attr]
        node.tokens, node.start, node.parent = node.tokens[k:], cut, upper
        node.blocks = node.blocks[lower_from:]
        self.nodes[upper.id] = upper
        return upper

    def _walk(self, ids: list[int]) -> Hit:
        """The deepest match of ``ids``, the node it ends in split so that it ends at a node."""
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            k = common_prefix(child.tokens, ids[pos : pos + len(child.tokens)])
            if k < len(child.tokens):
                node, pos = self._split(child, k), pos + k
                break
            node, pos = child, pos + k
        return Hit(node, pos)

    def lookup(self, ids: list[int]) -> Hit:
        """The longest cached prefix of ``ids``, at most ``len(ids) - 1`` tokens."""
        hit = self._walk(list(ids[: max(len(ids) - 1, 0)]))
        self._touch(hit.node)
        return hit

    def path_blocks(self, node: Node) -> list[int]:
        """Block ids for positions 0..node.end-1: the deepest node's block at every index."""
        path = []
        while node is not None and node is not self.root:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        table: list[int] = []
        for n in reversed(path):
            first = n.start // self.block_tokens
            table[first:] = n.blocks
        return table

    # ---------------------------------------------------------------------------- requests
    def peek(self, ids: list[int]) -> int:
        """How many of ``ids`` a ``lookup`` would find cached (at most len - 1), without
        splitting a node or touching the LRU clock: what a scheduler ranks requests by."""
        node, pos, want = self.root, 0, list(ids[: max(len(ids) - 1, 0)])
        while pos < len(want):
            child = node.children.get(want[pos])
            if child is None:
                break
            k = common_prefix(child.tokens, want[pos : pos + len(child.tokens)])
            pos += k
            if k < len(child.tokens):
                break
            node = child
        return pos

    def check_request(self, ids: list[int], max_new_tokens: int) -> None:
        """ValueError / ``BudgetError`` for a request that can never run: an empty prompt, a
        token outside the vocabulary, more tokens than the model's context, more blocks than
        the whole budget. Nothing is touched."""
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab:
            raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary; "
                             f"allowed: 0..{self.vocab - 1}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be 0 or more, got {max_new_tokens}")
        total = len(ids) + max_new_tokens
        if total > self.context:
            raise ValueError(f"prompt ({len(ids)} tokens) + {max_new_tokens} new tokens = "
                             f"{total} is beyond the model's context of {self.context}; "
                             f"allowed: at most {self.context} tokens in all")
        # its own blocks, and the one a hit ending mid-block keeps in the tree beside its copy
        need = -(-total // self.block_tokens) + 1
        if need > self.pool.n_blocks:
            bb = self.pool.block_bytes
            raise BudgetError(f"a request of {total} tokens needs up to {need} blocks of "
                              f"{self.block_tokens} tokens ({need * bb:,} B); the budget holds "
                              f"{self.pool.n_blocks} ({self.pool.nbytes():,} B); allowed: a "
                              f"budget of at least {need * bb:,} B")

    def admit(self, ids: list[int], max_new_tokens: int = 0, hit: Hit | None = None,
              should_stop: Callable[[], bool] | None = None) -> Request:
        """A running request for prompt ``ids`` (see the module docstring); ``hit`` is a
        ``lookup`` made just before (None: no reuse, the whole prompt is computed)."""
        ids = ids if isinstance(ids, list) else [int(t) for t in ids]
        self.check_request(ids, max_new_tokens)
        hit = hit if hit is not None else Hit(self.root, 0)
        bt, m = self.block_tokens, hit.length
        if m >= len(ids) or hit.node.end != m:
            raise ValueError(f"a hit of {m} tokens ending at position {hit.node.end} does not "
                             f"fit a prompt of {len(ids)}; allowed: a lookup of this prompt")
        self._lock(hit.node, +1)
        try:
            self.make_room(1 if m % bt else 0)
            table = self.path_blocks(hit.node)[: -(-m // bt)]
            if m % bt:  # copy-on-write of the diverging block (first: nothing is held yet)
                table[-1] = self.pool.copy(table[-1])
        except BaseException:
            self._lock(hit.node, -1)
            raise
        for b in table[: m // bt]:
            self.pool.ref(b)  # shared: the request reads these, never writes them
        req = Request(self, ids, max_new_tokens, table, hit.node, m, should_stop)
        self.running.add(req)
        try:
            self.reserve(req, len(ids))
            req.start(self._take_scratch(len(ids) + max_new_tokens) if self.buffers else None)
        except BaseException:
            self.cancel(req)
            raise
        return req

    def reserve(self, req: Request, length: int) -> None:
        """Fresh blocks in ``req``'s table until it covers ``length`` positions."""
        need = -(-length // self.block_tokens) - len(req.table)
        self.make_room(need)
        req.table.extend(self.pool.take() for _ in range(max(need, 0)))

    def finish(self, req: Request) -> None:
        """Leave ``req``'s computed rows to the tree and release the rest."""
        self._end(req, keep=True)

    def cancel(self, req: Request) -> None:
        """Release everything ``req`` holds; the tree is as if it never ran."""
        self._end(req, keep=False)

    def _end(self, req: Request, keep: bool) -> None:
        if req not in self.running:
            raise ValueError(f"this request has already ended ({req.state}); a request ends "
                             "once")
        self.running.discard(req)
        donated: set[int] = set()
        if keep and req.length:
            seq = req.tokens[: req.length]
            hit = self._walk(seq)
            if hit.length < len(seq):
                bt = self.block_tokens
                first, last = hit.length // bt, (len(seq) - 1) // bt
                leaf = Node(next(self._ids), hit.node, hit.length, seq[hit.length :],
                            req.table[first : last + 1])
                hit.node.children[seq[hit.length]] = leaf
                self.nodes[leaf.id] = leaf
                donated = set(range(first, last + 1))
                self._touch(leaf)
            else:
                self._touch(hit.node)
        for j, b in enumerate(req.table):
            if j not in donated:
                self.pool.unref(b)
        req.table = []
        self._lock(req.node, -1)
        if req.k is not None:  # (a request refused at admission never took its buffers)
            self._scratch.append(req.release())
        req.state = "finished" if keep else "cancelled"

    def _lock(self, node: Node | None, delta: int) -> None:
        while node is not None and node is not self.root:
            node.lock += delta
            node = node.parent

    def _take_scratch(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous (L, 1, n_kv, >= capacity, hs) buffers a request attends over, kept for
        the next request: torch has no attention that reads blocks in place."""
        fits = [s for s in self._scratch if s[0].size(3) >= capacity]
        if fits:
            self._scratch.remove(fits[0])
            return fits[0]
        self._scratch.clear()  # too small: drop, so at most one spare pair is kept
        n_layer, n_kv, hs, device, dtype = self.model_shape
        # room to grow (a chat's next turn is longer): the next power of two, at least 256
        rounded = min(max(256, 1 << (capacity - 1).bit_length()), max(self.context, capacity))
        shape = (n_layer, 1, n_kv, rounded, hs)
        return (torch.empty(shape, device=device, dtype=dtype),
                torch.empty(shape, device=device, dtype=dtype))

    def scratch_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self._scratch for t in pair)

    # ---------------------------------------------------------------------------- eviction
    def evictable(self) -> list[Node]:
        """Leaves no running request locks, least recently used first."""
        leaves = [n for n in self.nodes.values() if not n.children and n.lock == 0]
        return sorted(leaves, key=lambda n: (n.last_used, n.id))

    def evict_leaf(self, node: Node) -> int:
        """Drop one unlocked leaf; the blocks that became free."""
        if node.children or node.lock:  # a victim chosen wrongly: the tree would break
            raise InvariantError(f"node {node.id} is {'locked' if node.lock else 'not a leaf'}"
                                 "; only an unlocked leaf is evicted")
        freed = sum(self.pool.unref(b) for b in node.blocks)
        del node.parent.children[node.tokens[0]]  # type: ignore[union-attr]
        del self.nodes[node.id]
        self.evictions += 1
        self.events.append({"node": node.id, "parent": node.parent.id,  # type: ignore[union-attr]
                            "start": node.start, "end": node.end, "blocks": len(node.blocks),
                            "blocks_freed": freed, "last_used": node.last_used,
                            "clock": self.clock})
        return freed

    def make_room(self, blocks: int) -> None:
        """Evict least recently used leaves until ``blocks`` blocks are free."""
        while len(self.pool.free) < blocks:
            leaves = self.evictable()
            if not leaves:
                raise PoolExhausted(
                    f"{blocks} free blocks are needed and {len(self.pool.free)} are free; the "
                    f"other {self.pool.used} are held by running requests and the tree nodes "
                    "they read; allowed: a larger budget, or fewer requests at once")
            self.evict_leaf(leaves[0])

    # ----------------------------------------------------------------------- what it holds
    def used_bytes(self) -> int:
        return self.pool.used_bytes()

    def snapshot(self) -> list[dict[str, Any]]:
        """One row per node: span, blocks, their reference counts, lock and last use."""
        refs = self.pool.refs
        return [{"node": n.id, "parent": n.parent.id if n.parent else 0,  # type: ignore
                 "start": n.start, "end": n.end, "tokens": len(n.tokens),
                 "blocks": list(n.blocks), "refs": [refs[b] for b in n.blocks],
                 "shared_blocks": sum(refs[b] > 1 for b in n.blocks), "lock": n.lock,
                 "last_used": n.last_used} for n in sorted(self.nodes.values(),
                                                           key=lambda n: n.id)]

    def check(self) -> None:
        """Raise ``InvariantError`` at the first broken invariant (module docstring)."""
        check(self)
