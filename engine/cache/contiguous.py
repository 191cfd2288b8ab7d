"""The two contiguous KV caches: a concatenating one (as in the write-up) and a preallocated one.

Both keep every layer's keys and values in time order along dim 2, oldest first (the mask slice
and the positions depend on it), with the small interface every cache of ``engine.cache`` has:
``length``, ``update(layer, k, v)``, ``advance(T_new)``, ``crop(length)``, ``tensors()``,
``nbytes()``. ``ConcatKVCache`` grows by ``torch.cat`` every step; ``PreallocKVCache`` is sized
once for ``capacity`` tokens and written in place (static shapes: what CUDA graphs,
``torch.compile`` and the one-token steps of ``engine.models`` need).
"""

from __future__ import annotations

import torch


class ConcatKVCache:
    """Grows by ``torch.cat`` on every step: simple, allocates a new tensor per layer per step."""

    kind = "concat"

    def __init__(self, n_layer: int) -> None:
        self.n_layer = n_layer
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer
        self.length = 0

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self.k[layer], self.v[layer]
        if old_k is None or old_v is None:
            # k and v are views into the fused q|k|v projection: copy them out, or the whole
            # projection output (q included) would stay alive until the next step.
            k, v = k.contiguous(), v.contiguous()
        else:
            k, v = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v

    def advance(self, n_new: int) -> None:
        self.length += n_new

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length must be in 0..{self.length}, got {length}")
        for i in range(self.n_layer):
            if self.k[i] is not None:
                self.k[i] = self.k[i][:, :, :length]  # type: ignore[index]
                self.v[i] = self.v[i][:, :, :length]  # type: ignore[index]
        self.length = length

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self.k + self.v if t is not None]

    def nbytes(self) -> int:
        """Bytes the cache tensors hold (the payload, not the allocator's view)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


class PreallocKVCache:
    """One buffer per K and V for all layers, sized for ``capacity`` tokens, written in place.

    Shapes are static, which is what CUDA graphs and ``torch.compile`` need; a decode step
    allocates nothing for the cache.
    """

    kind = "prealloc"

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        n_kv_head: int,
        capacity: int,
        head_dim: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (n_layer, batch_size, n_kv_head, capacity, head_dim)  # (L, B, n_kv, T_max, hs)
        self.k_buf = torch.zeros(shape, device=device, dtype=dtype)
        self.v_buf = torch.zeros(shape, device=device, dtype=dtype)
        self.n_layer = n_layer
        self.capacity = capacity
        self.length = 0

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.length, self.length + k.size(2)
        if end > self.capacity:
            raise ValueError(
                f"KV cache holds at most {self.capacity} tokens; this step would need {end}"
            )
        self.k_buf[layer, :, :, start:end] = k
        self.v_buf[layer, :, :, start:end] = v
        return self.k_buf[layer, :, :, :end], self.v_buf[layer, :, :, :end]

    def advance(self, n_new: int) -> None:
        self.length += n_new

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length must be in 0..{self.length}, got {length}")
        self.length = length  # rows past `length` are overwritten by the next update

    def tensors(self) -> list[torch.Tensor]:
        return [self.k_buf, self.v_buf]

    def nbytes(self) -> int:
        """Bytes the buffers hold, including the capacity not yet filled."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def used_nbytes(self) -> int:
        per_token = self.k_buf[:, :, :, :1].numel() * self.k_buf.element_size() * 2
        return per_token * self.length


KVCache = ConcatKVCache | PreallocKVCache
