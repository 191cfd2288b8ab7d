"""The quantized KV cache: rows stored in a smaller type, read back in the model's dtype; the
same small API as ``engine.cache.contiguous``'s caches.

``QuantizedKVCache``: keys/values stored in a smaller type -- int8 with one scale per token and
head (absmax / 127), or float16 / bfloat16 -- and returned dequantized in the model's dtype.
Not exact: the logits move, by an amount the planner measures and the gate bounds. It holds
``n_kv_head`` heads per layer (``engine.cache.make_cache`` passes the model's ``cfg.n_kv_head``).
How a step reads it (``reads``, as ``engine.cache.paged``'s): "gather" -- ``update`` returns every
row dequantized, a copy in the model's dtype each call; "in_place" (the default on a CUDA GPU
with Triton) -- a one-token step's ``attend`` quantizes and writes its row, then our Triton
decode attention reads the stored rows and scales as they are, dequantizing in registers.
"""

from __future__ import annotations

import torch

from .paged import resolve_reads, step_lengths

INT8_MAX = 127.0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., hs) as int8 rows and one scale per row (absmax / 127), the scale in x's dtype:
    (q (..., hs), scale (..., 1)). Row r reads back as q[r] * scale[r]."""
    s = (x.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp_min(1e-12)
    return torch.round(x / s).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), s


class QuantizedKVCache:
    """Rows stored as ``storage`` ("int8", "float16" or "bfloat16"), read in ``dtype``."""

    def __init__(self, n_layer: int, batch_size: int, n_kv_head: int, capacity: int,
                 head_dim: int, *, storage: str = "int8", device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, reads: str | None = None) -> None:
        if storage not in ("int8", "float16", "bfloat16"):
            raise ValueError(f"storage must be int8, float16 or bfloat16, got {storage!r}")
        self.reads = resolve_reads(reads, device, "a quantized cache")
        self.in_place = self.reads == "in_place"
        self._lengths: torch.Tensor | None = None  # (B,) int32: the in-place step's lengths
        self.kind = f"kv_{storage}"
        self.storage, self.dtype = storage, dtype
        shape = (n_layer, batch_size, n_kv_head, capacity, head_dim)  # (L, B, n_kv, T_max, hs)
        held = torch.int8 if storage == "int8" else getattr(torch, storage)
        self.k_q = torch.zeros(shape, device=device, dtype=held)
        self.v_q = torch.zeros(shape, device=device, dtype=held)
        self.k_scale = self.v_scale = None
        if storage == "int8":  # one scale per token and head
            self.k_scale = torch.zeros(shape[:-1] + (1,), device=device, dtype=dtype)
            self.v_scale = torch.zeros(shape[:-1] + (1,), device=device, dtype=dtype)
        self.n_layer, self.capacity, self.length = n_layer, capacity, 0

    def _store(self, q: torch.Tensor, scale: torch.Tensor | None, x: torch.Tensor,
               start: int, end: int) -> None:
        if scale is None:
            q[:, :, start:end] = x.to(q.dtype)
            return
        q[:, :, start:end], scale[:, :, start:end] = quantize_rows(x)

    def _read(self, q: torch.Tensor, scale: torch.Tensor | None, end: int) -> torch.Tensor:
        rows = q[:, :, :end].to(self.dtype)
        return rows if scale is None else rows * scale[:, :, :end]

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """The new rows stored (quantized); (the length after them, this layer's scales)."""
        start, end = self.length, self.length + k.size(2)
        if end > self.capacity:
            raise ValueError(f"KV cache holds at most {self.capacity} tokens; this step would "
                             f"need {end}")
        ks = None if self.k_scale is None else self.k_scale[layer]
        vs = None if self.v_scale is None else self.v_scale[layer]
        self._store(self.k_q[layer], ks, k, start, end)
        self._store(self.v_q[layer], vs, v, start, end)
        return end, ks, vs

    def attends(self, q: torch.Tensor) -> bool:
        """Does ``attend`` take these queries (B, nh, T, hs): read in place, one token each."""
        return self.in_place and q.size(2) == 1

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> torch.Tensor:
        """A one-token step read in place: the row k, v (B, n_kv, 1, hs) stored, then y (B,
        nh, 1, hs) over the stored rows as they are (``reads`` "in_place")."""
        from ..kernels.gpu.decode_attention import decode_attention  # noqa: PLC0415 (triton)

        end, ks, vs = self._write(layer, k, v)
        self._lengths = step_lengths(self._lengths, layer, k.size(0), end, q.device)
        scales = None if ks is None or vs is None else (ks[..., 0], vs[..., 0])
        y = decode_attention(q[:, :, 0].contiguous(), self.k_q[layer], self.v_q[layer],
                             self._lengths, scales=scales)  # (B, nh, hs)
        return y.unsqueeze(2)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        end, ks, vs = self._write(layer, k, v)
        return self._read(self.k_q[layer], ks, end), self._read(self.v_q[layer], vs, end)

    def advance(self, n_new: int) -> None:
        self.length += n_new

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length must be in 0..{self.length}, got {length}")
        self.length = length

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k_q, self.v_q, self.k_scale, self.v_scale) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def used_nbytes(self) -> int:
        per_token = sum(t[:, :, :, :1].numel() * t.element_size() for t in self.tensors())
        return per_token * self.length
