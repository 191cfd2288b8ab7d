"""Mistral's KV caches: at most ``window`` rows per layer, so memory stays flat past the window.

  RingKVCache      the preallocated kind: (L, B, n_kv, rows, hs) buffers of min(capacity,
                   window) rows, position p written at row p % window, in place
  WindowedConcat   the concatenating kind (the write-up's): grows by ``torch.cat`` and keeps the
                   last ``window`` rows of every layer
  make_cache(kind, model, batch_size, capacity)
                   the family's cache of ``kind`` ("prealloc" | "concat"), or None (no window:
                   the engine's)

Both have the interface of ``engine.cache``'s (``length``, ``update``, ``advance``, ``crop``,
``tensors``, ``nbytes``, ``used_nbytes``). ``update`` returns the keys a new token may read, oldest
first: the window's rows before the new ones and the new ones (one new token on a full ring:
the ring itself, in ring order -- one query reads every row, so order does not matter).
``crop`` cannot go back once rows have left the window (they were overwritten): ``can_crop``
says so, and a decoder's ``seek`` then prefills afresh. Bytes: 2 x n_layer x batch x n_kv_head
x min(tokens, window) x head_dim x element bytes -- ``cfg.cache_rows``' formula.
"""

from __future__ import annotations

from typing import Any

import torch

from ...cache.contiguous import ConcatKVCache

_LOST = ("rows before position {lost} have left the window (overwritten); allowed: crop to "
         "{length} or 0, or anywhere while nothing has left it")


def _croppable(length: int, held: int, window: int) -> bool:
    """Can a windowed cache holding ``held`` rows go back to ``length``: to nothing, to where it
    is, or anywhere while no row has left the window yet."""
    return length in (0, held) or held <= window


def _check_crop(length: int, held: int, window: int) -> None:
    if not 0 <= length <= held or not _croppable(length, held, window):
        raise ValueError(f"crop length {length}: " + _LOST.format(lost=held - window,
                                                                   length=held))


class RingKVCache:
    """The preallocated kind, as a ring of ``window`` rows (module docstring)."""

    kind = "prealloc"

    def __init__(self, n_layer: int, batch_size: int, n_kv_head: int, capacity: int,
                 head_dim: int, window: int, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.window, self.capacity = window, capacity
        rows = min(capacity, window)
        shape = (n_layer, batch_size, n_kv_head, rows, head_dim)  # (L, B, n_kv, rows, hs)
        self.k_buf = torch.zeros(shape, device=device, dtype=dtype)
        self.v_buf = torch.zeros(shape, device=device, dtype=dtype)
        self.n_layer = n_layer
        self.length = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        past, new, w = self.length, k.size(2), self.window
        if past + new > self.capacity:
            raise ValueError(f"KV cache holds at most {self.capacity} tokens; this step would "
                             f"need {past + new}")
        kb, vb = self.k_buf[layer], self.v_buf[layer]  # (B, n_kv, rows, hs)
        if past + new <= w:  # nothing leaves the window: rows in position order, as prealloc's
            kb[:, :, past : past + new], vb[:, :, past : past + new] = k, v
            return kb[:, :, : past + new], vb[:, :, : past + new]
        if new == 1:  # a full ring after this row: every row is in the new token's window
            kb[:, :, past % w], vb[:, :, past % w] = k[:, :, 0], v[:, :, 0]
            return kb, vb
        order = torch.arange(past - min(past, w), past, device=kb.device) % w  # oldest first
        keys = torch.cat([kb.index_select(2, order), k], dim=2)  # (B, n_kv, held + new, hs)
        values = torch.cat([vb.index_select(2, order), v], dim=2)
        n = min(new, w)  # the new rows that stay: the last n
        slots = torch.arange(past + new - n, past + new, device=kb.device) % w
        kb.index_copy_(2, slots, k[:, :, new - n :])
        vb.index_copy_(2, slots, v[:, :, new - n :])
        return keys, values

    def advance(self, n_new: int) -> None:
        self.length += n_new

    def can_crop(self, length: int) -> bool:
        return _croppable(length, self.length, self.window)

    def crop(self, length: int) -> None:
        _check_crop(length, self.length, self.window)
        self.length = length  # rows past it are overwritten by the next update

    def tensors(self) -> list[torch.Tensor]:
        return [self.k_buf, self.v_buf]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def used_nbytes(self) -> int:
        per_row = self.k_buf[:, :, :, :1].numel() * self.k_buf.element_size() * 2
        return per_row * min(self.length, self.window)


class WindowedConcat(ConcatKVCache):
    """The concatenating kind, keeping the last ``window`` rows of every layer."""

    def __init__(self, n_layer: int, window: int) -> None:
        super().__init__(n_layer)
        self.window = window

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(layer, k, v)  # (B, n_kv, held + T, hs), oldest first
        if keys.size(2) > self.window:  # a copy: a view would keep the whole tensor alive
            self.k[layer] = keys[:, :, -self.window :].clone()
            self.v[layer] = values[:, :, -self.window :].clone()
        return keys, values

    def can_crop(self, length: int) -> bool:
        return _croppable(length, self.length, self.window)

    def crop(self, length: int) -> None:
        _check_crop(length, self.length, self.window)
        if length == 0:
            self.k, self.v = [None] * self.n_layer, [None] * self.n_layer
            self.length = 0
        elif length < self.length:
            super().crop(length)

    def used_nbytes(self) -> int:
        return self.nbytes()


def make_cache(kind: str, model: Any, batch_size: int = 1,
               capacity: int | None = None) -> RingKVCache | WindowedConcat | None:
    """Mistral's cache of ``kind`` for ``model`` (module docstring); None without a window."""
    cfg = model.config
    if cfg.window is None:
        return None
    if kind == "concat":
        return WindowedConcat(cfg.n_layer, cfg.window)
    if kind == "prealloc":
        cap = cfg.block_size if capacity is None else capacity
        return RingKVCache(cfg.n_layer, batch_size, cfg.n_kv_head, cap, cfg.head_dim,
                           cfg.window, device=model.device, dtype=model.dtype)
    return None
