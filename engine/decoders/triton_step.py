"""Rung 16, and rungs 14-15 on a GPU: the whole decode step as our Triton kernels, captured in one
CUDA graph. Five kernels a block, for every family with a one-token step (its step module's
``kernel_layout`` says what each kernel takes: ``engine.models.steps.KernelLayout``):

  q|k|v     the block's norm folded in (LayerNorm / RMSNorm), bias, RoPE (where the family
            rotates), the new K/V row written into the cache at the position read on the device
  attention ``engine.kernels.gpu.decode_attention``'s split stage over the filled rows
  out proj  the splits merged as its input is loaded, bias and the residual add folded in
  MLP up    the second norm folded in; GELU, or SwiGLU's gate and up in one pass (a second up
            weight)
  MLP down  bias and the residual add folded in

plus the embedding (and a learned position) and the final norm with the output projection:
62 kernels for gpt2's 12 blocks, 152 for SmolLM2's 30, against 150-210 launches of an eager step
(first light on an H200). Weights as the model stores them (fp32 or bf16 rows), or GGUF Q8_0 /
Q4_1 blocks read as stored (``storage``: the view of ``engine.quant.blocks``, the same blocks
rungs 14-15 multiply on a CPU), dequantized in registers.

``TritonDecoder(model, batch_size=1, capacity=None, storage=None, capture=None)`` is a
``GraphDecoder`` (``engine.decoders.captured``): the prefill (and seek, rewind) through the
model's ``forward`` into a preallocated cache; each step the token and position are written
into the graph's static buffers, the graph replays, and the logits are copied out.
``capture=False`` launches the same kernels one by one (a CPU under ``TRITON_INTERPRET=1``: how
the tests check it).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import families
from ..models.state import ModelState
from ..quant import blocks as quant_blocks
from .captured import GraphDecoder


class TritonStep:
    """One model's decode step as a list of kernel launches over static buffers (``run()``)."""

    def __init__(self, model: Any, batch_size: int, k_buf: torch.Tensor,
                 v_buf: torch.Tensor) -> None:
        from ..kernels.gpu import decode_attention as da
        from ..kernels.gpu.linear import Weight

        cfg, dev, dtype = model.config, model.device, model.dtype
        B, C, nh, hs = batch_size, cfg.n_embd, cfg.n_head, cfg.head_dim
        self.da = da
        self.k_buf, self.v_buf = k_buf, v_buf
        self.token = torch.zeros(B, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.lengths = torch.ones(B, dtype=torch.int32, device=dev)
        self.x = torch.zeros(B, C, dtype=dtype, device=dev)  # the residual stream
        self.q = torch.zeros(B, nh, hs, dtype=dtype, device=dev)
        self.part, self.lse = da.split_buffers(self.q, k_buf.size(3), k_buf.size(2))
        self.head = Weight.of(model.lm_head)
        self.logits = torch.zeros(B, self.head.out, dtype=dtype, device=dev)
        layout = families.step_of(model).kernel_layout(model, self.head)
        self.table, self.positions, self.rope = layout.table, layout.positions, layout.rope
        self.final, self.blocks, width = layout.final, layout.blocks, layout.width
        self.h = torch.zeros(B, width, dtype=dtype, device=dev)
        self.kernels = 2 + 5 * len(self.blocks)

    def run(self) -> torch.Tensor:
        """The step over the static buffers (token, pos, lengths set): logits (B, vocab)."""
        from ..kernels.gpu.embed import embed
        from ..kernels.gpu.linear import linear
        from ..kernels.gpu.qkv import qkv

        x, h = self.x, self.h
        embed(self.token, self.table, x, self.positions, self.pos)
        for i, (n1, wq, wk, wv, wo, n2, up, up2, down) in enumerate(self.blocks):
            qkv(x, wq, wk, wv, n1, self.q, self.k_buf[i], self.v_buf[i], self.pos, self.rope)
            self.da.split_attention(self.q, self.k_buf[i], self.v_buf[i], self.lengths,
                                    self.part, self.lse)
            linear(None, wo, x, residual=x, merge=(self.part, self.lse))
            if up2 is None:  # one up weight: GELU(norm(x) @ up); two: silu(gate) * up
                linear(x, up, h, norm=n2, act="gelu")
            else:
                linear(x, up, h, norm=n2, act="swiglu", w2=up2)
            linear(h, down, x, residual=x)
        return linear(x, self.head, self.logits, norm=self.final)


class TritonDecoder(GraphDecoder):
    """Rung 16 (weights as stored by the model) and rungs 14-15 on a GPU (``storage``)."""

    # Several tokens at once go through the model's forward into the captured cache, as a
    # prefill does (speculative decoding's verify step); one token goes through the graph.
    appends = True

    def __init__(self, model: Any | ModelState, *, batch_size: int = 1,
                 capacity: int | None = None, storage: str | None = None,
                 capture: bool | None = None) -> None:
        state = ModelState.of(model)
        source = quant_blocks.block_view(state, storage) if storage else state
        super().__init__(source, batch_size=batch_size, capacity=capacity)
        self.storage = storage
        dev = self.model.device
        self.capture = dev.type == "cuda" if capture is None else capture
        if self.capture and dev.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA GPU; the model is on " + str(dev))
        self.kernel_step = TritonStep(self.model, batch_size, self.cache.k_buf, self.cache.v_buf)
        if storage:
            self.extra_bytes = self.model.stored_bytes()  # the blocks, besides the model
        if self.capture:
            self._capture(warmups=2)  # compiles every kernel before the capture

    def write_inputs(self, token: torch.Tensor, pos: int) -> None:
        ks = self.kernel_step
        ks.token.copy_(token[:, 0])
        ks.pos.fill_(pos)
        ks.lengths.fill_(pos + 1)

    def run_step(self) -> torch.Tensor:
        return self.kernel_step.run()
