"""The batched step: every scheduled sequence's new tokens in one forward of the model.

The step's tokens are laid end to end as one row of N tokens, ``idx`` (1, N), with their own
positions (``input_pos``, (N,)). So each linear layer runs once over all N rows, and the
weights are read once per step, whatever the batch. Only attention is per sequence. The
model's forward is the family's own, unchanged: it meets ``RaggedBatch`` as its KV cache, and
``RaggedBatch`` takes every layer's attention itself (``attends``/``attend``, the API through
which ``engine.models.attention.through_cache`` lets a cache read itself in place).

``RaggedBatch(pool, works, reads, kernel)``, for one step over one layer of a ``BlockPool`` at a
time (``kernel``: whose in-place kernels, "cpu" or "triton"; ``kernel_for(device)`` by default):
  - Every layer's new rows k, v (1, n_kv, N, hs) are written into their blocks in one
    ``index_copy_``: token i goes to slot ``table[pos // bt] * bt + pos % bt`` of its own
    sequence.
  - Decoding sequences (one new token each) attend together, each over its own rows
    0..pos:
      "in_place"  the pool read where it lies, through each sequence's block table: our C++
                  kernel on a CPU (``engine.kernels.cpu.paged_attend``, fp32), our Triton
                  split kernel on a GPU (``engine.kernels.gpu.decode_attention(table=)``)
      "gather"    every sequence's rows copied into one padded (D, n_kv, S_max, hs) tensor
                  by one ``index_select``, then SDPA under a (D, 1, 1, S_max) length mask
  - A sequence with several new tokens (a prompt or a chunk of it) attends causally, each
    token over rows 0..its position: our Triton paged prefill on a GPU in place (heads of
    16 channels or more), else its rows gathered and SDPA under the bottom-right triangle.

``default_reads(device, dtype)``: in place where our kernel runs (a CPU in fp32 with the C++
kernel built; a CUDA GPU with Triton), else gather.
``step_decodes(step, weights, pool, works)`` runs a step in which every sequence decodes
through the family's one-token step over mode 8's products (no module calls), read in place.
``forward(model, pool, works, reads, kernel=None)`` runs one step. It returns the logits
(R, vocab) of the works whose step reaches their last known token (``Work.samples``), in the
works' order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..models.attention import sdpa

READS = ("gather", "in_place")
KERNELS = ("cpu", "triton")


def kernel_for(device: torch.device | str) -> str:
    """Whose kernels read a pool on ``device`` in place: Triton's on a GPU, our C++ on a CPU
    (a test runs Triton's on a CPU too, in its interpreter)."""
    return "cpu" if torch.device(device).type == "cpu" else "triton"


def default_reads(device: torch.device | str, dtype: torch.dtype) -> str:
    """"in_place" where a paged kernel reads this pool, else "gather"."""
    device = torch.device(device)
    if device.type == "cpu":
        from ..models.attention import kernel_attends  # noqa: PLC0415

        return "in_place" if kernel_attends(device, dtype) else "gather"
    from ..kernels.gpu import triton_usable  # noqa: PLC0415 (torch-only; imports no triton)

    return "in_place" if triton_usable(device) else "gather"


def write(pool: Any, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
          ) -> None:
    """New rows k, v (n_kv, N, hs) into their slots (N,) of layer ``layer``, one
    ``index_copy_`` per tensor the pool holds (rows, and scales for int8)."""
    for t, x in zip(pool.tensors(), pool.store(k, v), strict=True):
        t[layer].flatten(1, 2).index_copy_(1, slots, x)  # (n_kv, n_blocks * bt[, hs])


def gather(pool: Any, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows at ``slots`` (S,) of layer ``layer``, (n_kv, S, hs) each for K and V, in the
    model's dtype (int8 rows times their scales)."""
    kl, vl = pool.k[layer].flatten(1, 2), pool.v[layer].flatten(1, 2)  # (n_kv, slots, hs)
    if pool.k_scale is None:
        return kl.index_select(1, slots), vl.index_select(1, slots)
    ks, vs = pool.k_scale[layer].flatten(1, 2), pool.v_scale[layer].flatten(1, 2)
    return (pool.rows(kl.index_select(1, slots), ks.index_select(1, slots)),
            pool.rows(vl.index_select(1, slots), vs.index_select(1, slots)))


class RaggedBatch:
    """The KV cache one batched step's forward is given (the module docstring)."""

    length = 0  # the forward's positions come from ``input_pos``, never from here

    def __init__(self, pool: Any, works: Sequence[Any], reads: str,
                 kernel: str | None = None) -> None:
        if reads not in READS:
            raise ValueError(f"unknown way to read the pool {reads!r}; allowed: "
                             f"{', '.join(READS)}")
        self.kernel = kernel_for(pool.k.device) if kernel is None else kernel
        if self.kernel not in KERNELS:
            raise ValueError(f"unknown paged kernel {self.kernel!r}; allowed: "
                             f"{', '.join(KERNELS)}")
        self.pool, self.reads = pool, reads
        device, bt = pool.k.device, pool.block_tokens
        slots, positions, dec_rows, dec_tables, dec_lengths = [], [], [], [], []
        # (row, start, n, its table (1, blocks), the slots of its rows 0..start + n - 1 (S,)),
        # made once a step: every layer reads the same
        self.prefills: list[tuple[int, int, int, torch.Tensor, torch.Tensor]] = []
        row = 0
        for w in works:
            table = w.seq.req.table
            for p in range(w.start, w.start + w.n):
                slots.append(table[p // bt] * bt + p % bt)
            positions.extend(range(w.start, w.start + w.n))
            if w.n == 1:
                dec_rows.append(row)
                dec_tables.append(table[: w.start // bt + 1])
                dec_lengths.append(w.start + 1)
            else:
                end = w.start + w.n
                ids = torch.tensor(table[: -(-end // bt)], dtype=torch.long, device=device)
                pos = torch.arange(end, device=device)
                self.prefills.append((row, w.start, w.n, ids[None], ids[pos // bt] * bt
                                      + pos % bt))
            row += w.n
        self.n_rows = row
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)  # (N,)
        self.positions = torch.tensor(positions, dtype=torch.long, device=device)  # (N,)
        self.dec_rows = torch.tensor(dec_rows, dtype=torch.long, device=device)  # (D,)
        width = max((len(t) for t in dec_tables), default=1)
        self.dec_table = torch.tensor([t + [0] * (width - len(t)) for t in dec_tables],
                                      dtype=torch.long, device=device).view(len(dec_tables),
                                                                            width)  # (D, M)
        self.dec_lengths = torch.tensor(dec_lengths, dtype=torch.long, device=device)  # (D,)
        if self.kernel == "triton":
            self.dec_lengths = self.dec_lengths.to(torch.int32)
        self._dec_gather: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ the KV cache API
    def attends(self, q: torch.Tensor) -> bool:
        return True  # every layer's attention is taken here

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        """q (1, nh, N, hs), k, v (1, n_kv, N, hs): the rows written, y (1, nh, N, hs)."""
        write(self.pool, layer, self.slots, k[0], v[0])
        kl, vl = self.pool.k[layer], self.pool.v[layer]  # (n_kv, n_blocks, bt, hs)
        if not self.prefills:  # decode only: no copy of q's rows
            return self._decode(layer, q[0].transpose(0, 1), kl, vl).transpose(0, 1)[None]
        y = torch.empty_like(q)
        if self.dec_rows.numel():
            qd = q[0].index_select(1, self.dec_rows).transpose(0, 1)  # (D, nh, hs)
            y[0].index_copy_(1, self.dec_rows, self._decode(layer, qd, kl, vl).transpose(0, 1))
        for row, start, n, table, slots in self.prefills:
            y[:, :, row:row + n] = self._prefill(layer, q[:, :, row:row + n], start, table,
                                                 slots)
        return y

    def advance(self, n_new: int) -> None:
        """(The engine advances each sequence itself.)"""

    # ------------------------------------------------------------------------ attention
    def _decode(self, layer: int, q: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor
                ) -> torch.Tensor:
        """y (D, nh, hs): each decoding sequence's query over its rows 0..pos."""
        if self.reads == "in_place" and self.kernel == "cpu":
            from ..kernels import cpu as kernels  # noqa: PLC0415

            return kernels.paged_attend(q.contiguous(), kl, vl, self.dec_table,
                                        self.dec_lengths)
        if self.reads == "in_place":
            from ..kernels.gpu.decode_attention import decode_attention  # noqa: PLC0415

            kp, vp = self.pool.layer_view(layer)  # (n_blocks, n_kv, bt, hs)
            return decode_attention(q.contiguous(), kp, vp, self.dec_lengths,
                                    table=self.dec_table)
        idx, mask = self._decode_index()
        D, nh, hs = q.shape
        n_kv, s_max = kl.size(0), mask.size(-1)
        keys, values = gather(self.pool, layer, idx)  # (n_kv, D * S_max, hs)
        keys, values = keys.view(n_kv, D, s_max, hs), values.view(n_kv, D, s_max, hs)
        y = sdpa(q.unsqueeze(2), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask)
        return y.squeeze(2)  # (D, nh, hs)

    def _decode_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The gathered decode's slots (D * S_max,) and its (D, 1, 1, S_max) mask, made once a
        step (every layer uses the same)."""
        if self._dec_gather is None:
            bt, device = self.pool.block_tokens, self.dec_table.device
            s_max = int(self.dec_lengths.max())
            pos = torch.arange(s_max, device=device)  # (S_max,)
            mask = pos[None, :] < self.dec_lengths[:, None].long()  # (D, S_max)
            blocks = self.dec_table.gather(1, (pos // bt)[None, :].expand(len(mask), -1)
                                           .clamp(max=self.dec_table.size(1) - 1))
            idx = torch.where(mask, blocks * bt + pos % bt, 0)  # padding reads slot 0, masked
            self._dec_gather = (idx.flatten(), mask[:, None, None, :])
        return self._dec_gather

    def _prefill(self, layer: int, q: torch.Tensor, start: int, table: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
        """y (1, nh, n, hs): n new tokens at positions start.., each over rows 0..its own."""
        n, hs = q.size(2), q.size(3)
        if self.reads == "in_place" and self.kernel == "triton" and hs >= 16:
            from ..kernels.gpu.paged_prefill import paged_prefill  # noqa: PLC0415

            kp, vp = self.pool.layer_view(layer)
            return paged_prefill(q.contiguous(), kp, vp, table, start)
        end = start + n
        keys, values = (t[None] for t in gather(self.pool, layer, slots))  # (1, n_kv, S, hs)
        if start == 0:
            return sdpa(q, keys, values, is_causal=True)
        mask = torch.ones(n, end, dtype=torch.bool, device=q.device).tril(start)
        return sdpa(q, keys, values, attn_mask=mask)


def paged_attend(pool: Any, slots: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
                 kernel: str) -> Any:
    """``attend(layer, q, k, v) -> y`` for a family's one-token step (``engine.models.*.step``)
    over the pool: each sequence's new row written to its slot, then its query over its rows
    0..pos through its table, read in place. q (B, nh, hs), k, v (B, n_kv, hs), y (B, nh, hs)."""
    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        write(pool, i, slots, k.transpose(0, 1), v.transpose(0, 1))
        kl, vl = pool.k[i], pool.v[i]  # (n_kv, n_blocks, bt, hs)
        if kernel == "cpu":
            from ..kernels import cpu as kernels  # noqa: PLC0415

            return kernels.paged_attend(q.contiguous(), kl, vl, table, lengths)
        from ..kernels.gpu.decode_attention import decode_attention  # noqa: PLC0415

        kp, vp = pool.layer_view(i)
        return decode_attention(q.contiguous(), kp, vp, lengths, table=table)

    return attend


@torch.no_grad()
def step_decodes(step: Any, weights: Any, pool: Any, works: Sequence[Any],
                 kernel: str | None = None) -> torch.Tensor:
    """A step in which every work decodes one token, through the family's one-token step
    ``step(weights, token, pos, attend)`` (mode 8's: its products chosen per role on this
    machine, no module calls) over the pool, read in place: logits (B, vocab). The same
    arithmetic as ``forward`` up to float32 rounding in the products."""
    batch = RaggedBatch(pool, works, "in_place", kernel)
    token = torch.tensor([[w.seq.tokens[w.start]] for w in works], dtype=torch.long,
                         device=pool.k.device)  # (B, 1)
    attend = paged_attend(pool, batch.slots, batch.dec_table, batch.dec_lengths, batch.kernel)
    return step(weights, token, batch.positions, attend)


@torch.no_grad()
def forward(model: Any, pool: Any, works: Sequence[Any], reads: str,
            kernel: str | None = None) -> torch.Tensor:
    """One batched step (the module docstring): logits (R, vocab) for the works that sample."""
    batch = RaggedBatch(pool, works, reads, kernel)
    ids: list[int] = []
    last, row = [], 0
    for w in works:
        ids.extend(w.seq.tokens[w.start:w.start + w.n])
        row += w.n
        if w.samples:
            last.append(row - 1)
    idx = torch.tensor([ids], dtype=torch.long, device=pool.k.device)  # (1, N)
    rows = torch.tensor(last, dtype=torch.long, device=pool.k.device)  # (R,)
    logits, _ = model(idx, batch, input_pos=batch.positions, logits=rows)
    return logits[0]  # (R, vocab)
