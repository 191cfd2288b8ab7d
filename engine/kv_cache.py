"""The two KV caches: a concatenating one (as in the write-up) and a preallocated one.

(``engine.kv_variants`` adds a paged and a quantized one behind the same API.)
``make_cache(kind, model, batch_size, capacity)`` builds any kind of ``CACHE_KINDS`` sized for a
model's shapes, on its device and in its dtype. All expose the same small interface the
attention layers use:
  ``cache.length``              tokens already cached (positions 0..length-1)
  ``cache.update(layer, k, v)`` store the new keys/values (B, n_kv, T_new, hs) after the old
                                 ones and return all keys/values so far, old first
  ``cache.advance(T_new)``      called once per forward, after every layer has updated
  ``cache.crop(length)``        forget everything from ``length`` on (for re-using a prefill)
Time runs along dim 2 in both, oldest first: the mask slice and the positions depend on it.
A cache holds ``cfg.n_kv_head`` heads: GPT-2's every head, a GQA model's fewer (SmolLM2: 3 for
its 9 query heads), never copies repeated per query head -- attention reads each K/V head for
its whole group (``engine.attention``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from .config import ModelConfig

# cache kind -> storage dtype of the quantized cache (engine.kv_variants.QuantizedKVCache)
QUANTIZED_KINDS = {"kv_int8": "int8", "kv_float16": "float16", "kv_bfloat16": "bfloat16"}
CACHE_KINDS = ("prealloc", "concat", "paged", *QUANTIZED_KINDS)


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


class Shaped(Protocol):
    """What a cache is sized from: a model's shapes, device and dtype (a ``GPT``, a ``Llama``)."""

    @property
    def config(self) -> ModelConfig: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...


def make_cache(kind: str, model: Shaped, batch_size: int = 1,
               capacity: int | None = None) -> KVCache:
    """An empty cache of ``kind`` for ``batch_size`` sequences of ``model``; ``capacity`` tokens
    (default: the model's limit) for the kinds sized once (all but "concat"). Each layer holds
    ``cfg.n_kv_head`` heads (fewer than the query heads under GQA)."""
    cfg = model.config
    cap = cfg.block_size if capacity is None else capacity
    shape = (cfg.n_layer, batch_size, cfg.n_kv_head, cap, cfg.head_dim)
    if kind == "concat":
        return ConcatKVCache(cfg.n_layer)
    if kind == "prealloc":
        return PreallocKVCache(*shape, device=model.device, dtype=model.dtype)
    if kind == "paged" or kind in QUANTIZED_KINDS:
        from .kv_variants import PagedKVCache, QuantizedKVCache  # noqa: PLC0415 (rarely used)

        if kind == "paged":
            return PagedKVCache(*shape, device=model.device, dtype=model.dtype)
        return QuantizedKVCache(*shape, storage=QUANTIZED_KINDS[kind], device=model.device,
                                dtype=model.dtype)
    raise ValueError(f"unknown cache kind {kind!r}; allowed: {', '.join(CACHE_KINDS)}")
