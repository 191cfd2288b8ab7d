"""Rungs 14 and 15's decoder: mode 8's step over GGUF blocks (``engine.quant.blocks``).

``BlockDecoder(model, storage="q8_0" | "q4_1")``: the prefill, seek, rewind and multi-token
``append`` through the model's ``forward`` over the block view (preallocated cache, fused
attention; a prefill's rows dequantize a chunk of block rows at a time), each decode step
through the family's one-token step (``engine.families.step_of``) with every product
``kernels.q8_0_linear`` / ``q4_1_linear`` over the blocks as stored, and on a CPU in fp32 with
the kernel built the whole step in ONE C++ call (the family's ``fused_step``, product kinds
Q8_0 / Q4_1). Where the blocks come from, which kernel way and why, and the bytes:
``engine.quant.blocks``. ``decoder.sources`` counts the tensors taken from the model's GGUF file
byte for byte and those quantized here.

``block_decoder(model, storage=...)`` is the rungs' factory: this decoder on a CPU, and on a GPU
the Triton step over the same blocks (``engine.decoders.triton_step``; first light measured the
CPU code's fallback there at 44-80 ms a step).
"""

from __future__ import annotations

from typing import Any

from ..models.state import ModelState
from ..quant import blocks as quant_blocks
from .weight_only import WeightOnlyDecoder, _direct, step_weights


def block_decoder(model: Any | ModelState, *, storage: str, batch_size: int = 1,
                  capacity: int | None = None) -> WeightOnlyDecoder | Any:
    """Rung 14 or 15's decoder for ``model``: the Triton step on a GPU, ``BlockDecoder`` else."""
    bare = model.model if isinstance(model, ModelState) else model
    if bare.device.type == "cuda":
        from .triton_step import TritonDecoder

        return TritonDecoder(model, storage=storage, batch_size=batch_size, capacity=capacity)
    return BlockDecoder(model, storage=storage, batch_size=batch_size, capacity=capacity)


block_decoder.appends = True  # type: ignore[attr-defined]  # both decoders it returns do


class BlockDecoder(WeightOnlyDecoder):
    """Mode 12's decoder over ``quant_blocks.block_view`` instead of an int8 / bf16 view."""

    def __init__(self, model: Any | ModelState, *, storage: str, batch_size: int = 1,
                 capacity: int | None = None) -> None:
        view = quant_blocks.block_view(model, storage)
        wrap = quant_blocks.BlockStep if _direct(view) else (lambda m: m)
        self._start(view, step_weights(view, wrap), batch_size, capacity)
        self.storage = storage
        self.sources = dict(view.sources)
        self.kernel = quant_blocks.kernel(storage, view.device.type) + "; " + ", ".join(
            f"{n} tensors {how}" for how, n in sorted(self.sources.items())) + "; " + (
            "one C++ call per step" if self.fused else "step in Python")
