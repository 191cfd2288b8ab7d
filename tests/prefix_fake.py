"""A model stand-in whose K/V rows name their place, for the prefix cache's tree tests.

``FakeModel`` has a real model's surface for ``engine.cache`` (``config``, ``device``,
``dtype``, ``forward(idx, cache, logits=)`` that calls ``cache.update`` per layer then
``cache.advance``) and writes, for position p of a sequence, the row ``row(tokens[:p + 1])``:
the token, the position, a rolling hash of every token up to p, and the layer. Each forward
checks that every key it reads back is the row of its own sequence at that position (so a
block shared by mistake, a row one place off, or a block freed and overwritten while in use
fails the forward that reads it); ``tree_content(cache)`` checks the same of every row every
tree node holds. Its logits (one-hot of the last hash, over a vocabulary of ``VOCAB``) make
greedy streams that depend on the whole prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

VOCAB = 6
MOD = 1_000_003


@dataclass(frozen=True)
class FakeConfig:
    n_layer: int = 2
    n_kv_head: int = 1
    head_dim: int = 4
    block_size: int = 96
    vocab_size: int = VOCAB


def hashes(tokens: list[int]) -> list[int]:
    out, h = [], 7
    for t in tokens:
        h = (h * 31 + t + 1) % MOD
        out.append(h)
    return out


def rows(tokens: list[int], start: int, end: int, layer: int) -> torch.Tensor:
    """Rows (end - start, 4) for positions start..end-1 of ``tokens``."""
    h = hashes(tokens[:end])
    return torch.tensor([[tokens[p], p, h[p], layer] for p in range(start, end)],
                        dtype=torch.float64)


class FakeModel:
    def __init__(self, **shape: int) -> None:
        self.config = FakeConfig(**shape)
        self.device = torch.device("cpu")
        self.dtype = torch.float64  # exact integers up to 2**53: hashes compare exactly
        self.forwards = 0

    def __call__(self, idx: torch.Tensor, cache: Any, logits: str = "last") -> tuple:
        T, past = idx.size(1), cache.length
        tokens = cache.tokens[: past + T]  # the request's own sequence
        assert idx[0].tolist() == tokens[past:], "fed tokens differ from the request's"
        for layer in range(self.config.n_layer):
            new = rows(tokens, past, past + T, layer).view(1, 1, T, 4)
            keys, values = cache.update(layer, new, new.clone())
            want = rows(tokens, 0, past + T, layer)
            got = keys[0, 0]
            bad = (got != want).any(dim=1).nonzero().flatten().tolist()
            assert not bad, (f"layer {layer} read a wrong row at position {bad[0]}: "
                             f"{got[bad[0]].tolist()} where {want[bad[0]].tolist()} belongs")
            assert torch.equal(values[0, 0], want)
        cache.advance(T)
        self.forwards += 1
        out = torch.zeros(1, 1, VOCAB, dtype=self.dtype)
        out[0, 0, hashes(tokens)[-1] % VOCAB] = 1.0
        return out, cache


def path_tokens(node: Any) -> list[int]:
    parts = []
    while node is not None and node.parent is not None:
        parts.append(node.tokens)
        node = node.parent
    return [t for part in reversed(parts) for t in part]


def tree_content(cache: Any) -> None:
    """AssertionError unless every row of every node's blocks is its path's row there."""
    bt = cache.block_tokens
    for node in cache.nodes.values():
        tokens = path_tokens(node)
        first = node.start // bt
        for i, block in enumerate(node.blocks):
            lo, hi = (first + i) * bt, min((first + i + 1) * bt, node.end)
            for layer in range(cache.pool.k.size(0)):
                got = cache.pool.k[layer, 0, block, : hi - lo]
                want = rows(tokens, lo, hi, layer)
                assert torch.equal(got, want), (f"node {node.id} (positions {node.start}.."
                                                f"{node.end - 1}): block {block} holds rows "
                                                f"of another sequence at {lo}..{hi - 1}")


# ------------------------------------------------------------------------ planted bugs
# Each is (owner, attribute, replacement): what a test patches in to see its check fail.
def _copy_in_place(self: Any, block: int) -> int:
    """Copy-on-write skipped: the request gets the tree's block itself and writes into it."""
    self.ref(block)
    return block


def _read_floor(self: Any, ids: list[int], length: int, k_out: Any, v_out: Any) -> None:
    """Off by one at the block edge: the hit's last, partly filled block is not copied in."""
    bt = self.block_tokens
    for j in range(length // bt):  # floor where a ceiling belongs
        k_out[:, :, j * bt : (j + 1) * bt] = self.k[:, :, ids[j]]
        v_out[:, :, j * bt : (j + 1) * bt] = self.v[:, :, ids[j]]


def _evict_frees_all(self: Any, node: Any) -> int:
    """Eviction frees the leaf's blocks whoever else still holds them."""
    for b in node.blocks:
        if self.pool.refs[b]:
            self.pool.refs[b] = 0
            self.pool.free.append(b)
    del node.parent.children[node.tokens[0]]
    del self.nodes[node.id]
    self.evictions += 1
    return len(node.blocks)


def _evictable_locked(self: Any) -> list:
    """Eviction ignores the locks of running requests."""
    return sorted((n for n in self.nodes.values() if not n.children),
                  key=lambda n: (n.last_used, n.id))


def bugs() -> dict[str, tuple[Any, str, Any]]:
    from engine.cache.blocks import BlockPool
    from engine.cache.prefix import PrefixCache

    return {"shared block written in place": (BlockPool, "copy", _copy_in_place),
            "off by one at the block edge": (BlockPool, "read_into", _read_floor),
            "eviction frees a block in use": (PrefixCache, "evict_leaf", _evict_frees_all),
            "eviction of a locked leaf": (PrefixCache, "evictable", _evictable_locked)}
