"""The block pool under the prefix cache: K/V rows in fixed-size blocks, reference-counted.

``BlockPool(n_layer, n_kv_head, head_dim, block_tokens, n_blocks, device=, dtype=, storage=)``
holds every block of every layer in two tensors (K and V) of shape (L, n_kv, n_blocks,
block_tokens, hs), on the model's device and in its dtype -- or, with ``storage="int8"``, as int8
rows with one scale per token and head (``k_scale``, ``v_scale``: (L, n_kv, n_blocks,
block_tokens), in the model's dtype; ``engine.cache.quantized.quantize_rows``), read back in
the model's dtype: about a quarter of fp32's bytes, so four times the tokens fit a budget. A
block id names the same slot in every layer, so one id stands for a block of ``block_tokens``
positions of a whole model (as vLLM's block tables do).

  take() -> id          a free block, its count 1 (``PoolExhausted`` when none is free)
  ref(id) / unref(id)   one more / one fewer holder; at 0 the block goes back to the free list
  copy(id) -> id        a fresh block holding the same rows (copy-on-write: a holder that must
                        write into a shared block writes into its copy instead)
  write(ids, start, k, v, layer=None)   rows (L, n_kv, T, hs) written at positions
                        start..start+T-1 of the sequence whose block table is ``ids`` (one id
                        per ``block_tokens`` positions, from position 0); with ``layer``, that
                        layer's rows (n_kv, T, hs) alone
  read_into(ids, length, k_out, v_out)  the first ``length`` rows of that table copied into
                        contiguous (L, n_kv, >= length, hs) tensors
  block_bytes, used, used_bytes(), nbytes(); ``bytes_per_block(...)`` before a pool exists

Nothing here knows about tokens or trees: ``engine.cache.prefix`` decides who holds what. The
pool only refuses what would corrupt it (taking from an empty free list, unref of a free block).
"""

from __future__ import annotations

import torch


class PoolExhausted(RuntimeError):
    """No free block is left; the caller evicts, or says the budget is too small."""


STORAGES = ("model", "int8")  # the model's dtype, or int8 rows scaled per token and head


def bytes_per_block(n_layer: int, n_kv_head: int, head_dim: int, block_tokens: int,
                    dtype: torch.dtype, storage: str = "model") -> int:
    """K and V of one block of every layer, scales included."""
    rows = 2 * n_layer * n_kv_head * block_tokens
    if storage == "int8":
        return rows * (head_dim + dtype.itemsize)  # an int8 row and its scale
    return rows * head_dim * dtype.itemsize


class BlockPool:
    """Fixed-size K/V blocks of a whole model, each with a reference count."""

    def __init__(self, n_layer: int, n_kv_head: int, head_dim: int, block_tokens: int,
                 n_blocks: int, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, storage: str = "model") -> None:
        if block_tokens < 1 or n_blocks < 1:
            raise ValueError(f"a pool needs blocks of at least 1 token and at least 1 block; "
                             f"got {block_tokens} tokens x {n_blocks} blocks")
        if storage not in STORAGES:
            raise ValueError(f"unknown K/V storage {storage!r}; allowed: {', '.join(STORAGES)}")
        shape = (n_layer, n_kv_head, n_blocks, block_tokens, head_dim)
        held = torch.int8 if storage == "int8" else dtype
        # empty, not zeros: a block's rows are written before any holder reads them, and an
        # untouched page of a large budget then costs no memory until a block lands on it
        self.k = torch.empty(shape, device=device, dtype=held)
        self.v = torch.empty(shape, device=device, dtype=held)
        self.k_scale = self.v_scale = None
        if storage == "int8":
            self.k_scale = torch.empty(shape[:-1], device=device, dtype=dtype)
            self.v_scale = torch.empty(shape[:-1], device=device, dtype=dtype)
        self.storage, self.dtype = storage, dtype
        self.block_tokens, self.n_blocks = block_tokens, n_blocks
        self.refs = [0] * n_blocks
        self.free = list(range(n_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self.block_bytes = bytes_per_block(n_layer, n_kv_head, head_dim, block_tokens, dtype,
                                           storage)

    @property
    def used(self) -> int:
        """Blocks held by someone (the tree or a running request)."""
        return self.n_blocks - len(self.free)

    def used_bytes(self) -> int:
        return self.used * self.block_bytes

    def nbytes(self) -> int:
        """Bytes of the whole pool: the budget it was sized to."""
        return self.n_blocks * self.block_bytes

    def take(self) -> int:
        if not self.free:
            raise PoolExhausted(f"all {self.n_blocks} blocks of {self.block_tokens} tokens "
                                "are in use")
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def ref(self, block: int) -> None:
        if self.refs[block] < 1:
            raise ValueError(f"block {block} is free; only a held block gains a holder")
        self.refs[block] += 1

    def unref(self, block: int) -> bool:
        """One holder fewer; True when that was the last and the block is free again."""
        if self.refs[block] < 1:
            raise ValueError(f"block {block} is already free")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)
            return True
        return False

    def copy(self, block: int) -> int:
        """A fresh block with ``block``'s rows (every layer, K and V)."""
        new = self.take()
        for t in self.tensors():
            t[:, :, new] = t[:, :, block]
        return new

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the pool holds (rows, and scales for int8)."""
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows k, v (..., hs) as the pool holds them: (k, v) in its dtype, or (k int8, v
        int8, k scales, v scales) for int8 (the scales without the last axis)."""
        if self.storage != "int8":
            return k.to(self.k.dtype), v.to(self.v.dtype)
        from .quantized import quantize_rows  # noqa: PLC0415

        (kq, ks), (vq, vs) = quantize_rows(k), quantize_rows(v)
        return kq, vq, ks[..., 0], vs[..., 0]

    def rows(self, q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """Stored rows (..., hs) back in the model's dtype (int8: times their scales)."""
        if scale is None:
            return q
        return q.to(self.dtype) * scale[..., None]

    def _runs(self, ids: list[int], start: int, end: int
              ) -> list[tuple[int, int, int, int, int]]:
        """Positions start..end-1 of table ``ids`` as runs of consecutive block ids: (first
        block, blocks in the run, first and last + 1 row in the run's flattened rows, the
        position of its first row)."""
        bt, out, pos = self.block_tokens, [], start
        while pos < end:
            j = pos // bt
            run = 1
            while (j + run) * bt < end and ids[j + run] == ids[j] + run:
                run += 1
            hi = min((j + run) * bt, end)
            out.append((ids[j], run, pos - j * bt, hi - j * bt, pos))
            pos = hi
        return out

    def write(self, ids: list[int], start: int, k: torch.Tensor, v: torch.Tensor,
              layer: int | None = None) -> None:
        """Rows k, v (L, n_kv, T, hs) -- or, with ``layer``, that layer's (n_kv, T, hs) --
        written at positions start..start+T-1 of table ``ids``: one slice per run of
        consecutive blocks, no index tensors."""
        if layer is not None:
            k, v = k.unsqueeze(0), v.unsqueeze(0)
        dst = [t if layer is None else t[layer : layer + 1] for t in self.tensors()]
        src = self.store(k, v)
        for first, run, lo, hi, pos in self._runs(ids, start, start + k.size(2)):
            at = pos - start
            for d, x in zip(dst, src, strict=True):
                d[:, :, first : first + run].flatten(2, 3)[:, :, lo:hi] = x[:, :, at:at + hi - lo]

    def layer_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V as (n_blocks, n_kv, block_tokens, hs) views, the layout
        ``engine.kernels.gpu``'s paged attention reads through a block table."""
        return self.k[layer].transpose(0, 1), self.v[layer].transpose(0, 1)

    def read_into(self, ids: list[int], length: int, k_out: torch.Tensor,
                  v_out: torch.Tensor) -> None:
        """Rows 0..length-1 of table ``ids`` copied into k_out, v_out (L, n_kv, >= length, hs):
        one slice per run of consecutive block ids (a request's blocks are handed out in
        order), so one pass over the rows and no gathered temporary."""
        ks = vs = None
        for first, run, lo, hi, pos in self._runs(ids, 0, length):
            if self.k_scale is not None and self.v_scale is not None:
                ks = self.k_scale[:, :, first : first + run].flatten(2, 3)[:, :, lo:hi]
                vs = self.v_scale[:, :, first : first + run].flatten(2, 3)[:, :, lo:hi]
            k_out[:, :, pos:pos + hi - lo] = self.rows(
                self.k[:, :, first : first + run].flatten(2, 3)[:, :, lo:hi], ks)
            v_out[:, :, pos:pos + hi - lo] = self.rows(
                self.v[:, :, first : first + run].flatten(2, 3)[:, :, lo:hi], vs)
