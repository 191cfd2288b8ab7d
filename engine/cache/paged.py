"""The paged KV cache: keys and values in fixed-size blocks of one shared pool, handed out as
positions need them (as vLLM does); the same small API as ``engine.cache.contiguous``'s caches.

``PagedKVCache``: keys/values live in fixed-size blocks of ``block_tokens`` tokens in one pool;
each sequence has a block table, and a block is taken from the free list only when a position
first needs it (as vLLM hands out blocks). Exact: the same values as a contiguous cache. It
holds ``n_kv_head`` heads per layer (``engine.cache.make_cache`` passes the model's
``cfg.n_kv_head``: GPT-2's every head, a GQA model's fewer). How a step reads it (``reads``):

  "gather"    ``update`` gathers the sequence's blocks into contiguous (B, n_kv, S, hs) tensors
              every call for torch's attention -- the copy a paged-attention kernel avoids, and
              what this cache's step time shows on a CPU
  "in_place"  a forward writes its rows and attends over the blocks where they lie: ``attend``
              runs our Triton kernels through the block table -- one new token per sequence
              ``engine.kernels.gpu.decode_attention``'s split kernel, several (a prefill, an
              append) ``engine.kernels.gpu.paged_prefill`` (heads of 16 channels or more: a
              narrower one, the hollow model's, gathers). The default on a CUDA GPU with Triton
              (``default_reads``)
"""

from __future__ import annotations

import math

import torch

READS = ("gather", "in_place")


def default_reads(device: torch.device | str) -> str:
    """How a paged cache on ``device`` is read unless told: in place where our Triton kernels
    compile (a CUDA GPU with ``triton``), else gathered."""
    from ..kernels.gpu import triton_usable  # noqa: PLC0415 (torch-only; imports no triton)

    return "in_place" if triton_usable(device) else "gather"


def resolve_reads(reads: str | None, device: torch.device | str, what: str) -> str:
    """``reads`` checked against ``READS`` (None: ``default_reads(device)``); ``what`` names the
    cache in the error."""
    reads = default_reads(device) if reads is None else reads
    if reads not in READS:
        raise ValueError(f"unknown way to read {what} {reads!r}; allowed: {', '.join(READS)}")
    return reads


def step_lengths(lengths: torch.Tensor | None, layer: int, batch: int, end: int,
                 device: torch.device) -> torch.Tensor:
    """The (batch,) int32 lengths an in-place step's kernel reads on the device: set once a
    step (at layer 0), in the tensor made the first time (no allocation a step)."""
    if lengths is None or lengths.numel() != batch:
        return torch.full((batch,), end, dtype=torch.int32, device=device)
    if layer == 0:
        lengths.fill_(end)
    return lengths


class PagedKVCache:
    kind = "paged"

    def __init__(self, n_layer: int, batch_size: int, n_kv_head: int, capacity: int,
                 head_dim: int, *, block_tokens: int = 16, pool_blocks: int | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 reads: str | None = None) -> None:
        self.reads = resolve_reads(reads, device, "a paged cache")
        self.in_place = self.reads == "in_place"
        self._lengths: torch.Tensor | None = None  # (B,) int32: the in-place step's lengths
        self.block_tokens = block_tokens
        self.blocks_per_seq = math.ceil(capacity / block_tokens)
        # By default the pool can hold every sequence at full capacity; a smaller pool (what a
        # server sizes to its memory) runs out when the sequences together need more blocks.
        n_blocks = batch_size * self.blocks_per_seq if pool_blocks is None else pool_blocks
        shape = (n_layer, n_blocks, n_kv_head, block_tokens, head_dim)  # (L, blocks, n_kv, bt, hs)
        self.k_pool = torch.zeros(shape, device=device, dtype=dtype)
        self.v_pool = torch.zeros(shape, device=device, dtype=dtype)
        self.table = torch.full((batch_size, self.blocks_per_seq), -1, dtype=torch.long,
                                device=device)  # block ids of each sequence, in order
        self.free = list(range(n_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self.held = [0] * batch_size  # blocks handed out to each sequence
        self.n_layer, self.capacity, self.length = n_layer, capacity, 0

    @property
    def allocated(self) -> int:
        return max(self.held)

    def reserve(self, seq: int, tokens: int) -> None:
        """Hand sequence ``seq`` the blocks for its first ``tokens`` positions (on demand: only
        those it does not hold yet). Sequences of a batch can hold different numbers of blocks
        (the planner's mixed-length batch does); a forward reserves for all of them alike."""
        need = math.ceil(tokens / self.block_tokens)
        if tokens > self.capacity:
            raise ValueError(f"KV cache holds at most {self.capacity} tokens; this step would "
                             f"need {tokens}")
        if need - self.held[seq] > len(self.free):
            raise ValueError(f"the paged pool is out of blocks ({self.k_pool.size(1)} blocks of "
                             f"{self.block_tokens} tokens, {len(self.free)} free)")
        for j in range(self.held[seq], need):
            self.table[seq, j] = self.free.pop()
        self.held[seq] = max(self.held[seq], need)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """The new rows into their blocks (reserved at layer 0); the length after them."""
        B, n_kv, T, hs = k.shape
        start, end = self.length, self.length + T
        if layer == 0:
            for seq in range(B):
                self.reserve(seq, end)
        pos = torch.arange(start, end, device=self.table.device)
        blk = self.table[:, pos // self.block_tokens]  # (B, T) block of each new position
        off = (pos % self.block_tokens).expand(B, T)  # (B, T) its slot in the block
        self.k_pool[layer][blk, :, off] = k.transpose(1, 2)  # (B, T, n_kv, hs)
        self.v_pool[layer][blk, :, off] = v.transpose(1, 2)
        return end

    def attends(self, q: torch.Tensor) -> bool:
        """Does ``attend`` take these queries (B, nh, T, hs): read in place, and one token or
        heads wide enough for the prefill kernel's products (16 channels)?"""
        return self.in_place and (q.size(2) == 1 or q.size(3) >= 16)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        """A forward's attention read in place (``reads`` "in_place"): write k, v (B, n_kv, T,
        hs), then y (B, nh, T, hs), each of q's T tokens (B, nh, T, hs) over the rows up to its
        own position, through the block table."""
        B, T = k.size(0), k.size(2)
        start = self.length
        end = self._write(layer, k, v)
        if T > 1:
            from ..kernels.gpu.paged_prefill import paged_prefill  # noqa: PLC0415 (triton)

            return paged_prefill(q.contiguous(), self.k_pool[layer], self.v_pool[layer],
                                 self.table, start)
        from ..kernels.gpu.decode_attention import decode_attention  # noqa: PLC0415 (triton)

        self._lengths = step_lengths(self._lengths, layer, B, end, q.device)
        y = decode_attention(q[:, :, 0].contiguous(), self.k_pool[layer], self.v_pool[layer],
                             self._lengths, table=self.table)  # (B, nh, hs)
        return y.unsqueeze(2)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        B, n_kv, T, hs = k.shape
        end = self._write(layer, k, v)
        n = math.ceil(end / self.block_tokens)
        ids = self.table[:, :n]  # (B, n) -> gather the blocks in order: (B, n, n_kv, bt, hs)
        keys = self.k_pool[layer][ids].permute(0, 2, 1, 3, 4).reshape(B, n_kv, -1, hs)
        values = self.v_pool[layer][ids].permute(0, 2, 1, 3, 4).reshape(B, n_kv, -1, hs)
        return keys[:, :, :end], values[:, :, :end]  # (B, n_kv, S, hs), oldest first

    def advance(self, n_new: int) -> None:
        self.length += n_new

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length must be in 0..{self.length}, got {length}")
        keep = math.ceil(length / self.block_tokens)
        for seq, held in enumerate(self.held):  # blocks past the new end go back to the pool
            for j in range(keep, held):
                self.free.append(int(self.table[seq, j]))
                self.table[seq, j] = -1
            self.held[seq] = min(held, keep)
        self.length = length

    def tensors(self) -> list[torch.Tensor]:
        return [self.k_pool, self.v_pool]

    def nbytes(self) -> int:
        """Bytes of the pool: every block, handed out or free."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def used_nbytes(self) -> int:
        """Bytes of the blocks handed out (a partly filled last block counts whole)."""
        per_block = self.k_pool[:, :1].numel() * self.k_pool.element_size() * 2
        return per_block * sum(self.held)
