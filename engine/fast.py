"""Mode 8: the fastest exact cached decode step we know for a CPU, in eager PyTorch.

Contract: ``FastDecoder(model, batch_size=1, capacity=None, chunks=None)`` is a ``Decoder``
(``prefill(idx) -> (B, vocab)``, ``step(token) -> (B, vocab)``) that gives mode 1's greedy
tokens in fp32; its logits match ``GPT.forward`` (and so ``transformers``) to ~1e-5.
``decoder.extra_bytes`` is the memory of the weight copies it holds besides the model.

Why it is faster (see the measured notes): at batch 1 a decode step is a chain of
matrix-vector products that must stream all 494 MB of gpt2's Linear weights. The ``[out, in]``
``nn.Linear`` layout and the tied output projection stream slowly, and the default kernel uses
one core. Here every weight is copied once to ``[in, out]`` and split column-wise into one
chunk per core, ``(chunks, in, out/chunks)``: one ``baddbmm`` then runs the chunks on different
cores, each streaming its own contiguous slab. The output projection gets the same treatment
(a transposed, padded copy of ``wte``). Each output is still one full dot product over ``in``,
so results differ from ``F.linear`` by float32 rounding only. With one thread, ``chunks=1``
falls back to ``torch.addmm`` on the ``[in, out]`` copy. Attention is SDPA on 4-D views of a
preallocated cache, with no mask: the new token may see every cached key.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .decoders import Decoder
from .model import GPT

MAX_CHUNKS = 8  # beyond this the per-chunk slabs get too thin to stream well


def default_chunks(device: torch.device) -> int:
    """One chunk per intra-op thread on a CPU (capped); a GPU needs no manual split."""
    if device.type != "cpu":
        return 1
    return max(1, min(torch.get_num_threads(), MAX_CHUNKS))


@dataclass
class PackedLinear:
    """y = x @ W + b for x (B, in), with W stored [in, out], optionally split into chunks."""

    weight: torch.Tensor  # (in, out) when chunks == 1, else (chunks, in, out_padded/chunks)
    bias: torch.Tensor | None  # (out,) or (chunks, 1, out_padded/chunks)
    out_features: int
    chunks: int

    @classmethod
    def from_out_in(cls, w: torch.Tensor, b: torch.Tensor | None, chunks: int) -> PackedLinear:
        """Pack an ``nn.Linear``-layout weight (out, in) and bias (out,)."""
        out_f, in_f = w.shape
        wt = w.detach().t()  # (in, out), a view: the copy below makes it contiguous
        if chunks <= 1:
            bias = None if b is None else b.detach().clone()
            return cls(wt.contiguous(), bias, out_f, 1)
        padded = -(-out_f // chunks) * chunks  # pad so every chunk has the same width
        pad = padded - out_f
        if pad:
            wt = torch.cat([wt, wt.new_zeros(in_f, pad)], dim=1)
        w3 = wt.reshape(in_f, chunks, padded // chunks).permute(1, 0, 2).contiguous()
        bias = None
        if b is not None:
            bias = torch.cat([b.detach(), b.new_zeros(pad)]).view(chunks, 1, padded // chunks)
        return cls(w3, bias, out_f, chunks)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.chunks == 1:
            if self.bias is None:
                return torch.mm(x, self.weight)
            return torch.addmm(self.bias, x, self.weight)
        batch = x.size(0)
        xs = x.unsqueeze(0).expand(self.chunks, batch, x.size(1))  # no copy: stride 0
        if self.bias is None:
            y = torch.bmm(xs, self.weight)
        else:
            y = torch.baddbmm(self.bias, xs, self.weight)  # (chunks, B, width)
        # Chunk-major is already the right column order for one row; B > 1 needs a transpose.
        y = y.view(1, -1) if batch == 1 else y.transpose(0, 1).reshape(batch, -1)
        return y if y.size(1) == self.out_features else y[:, : self.out_features]

    def nbytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() * self.weight.element_size() + extra


@dataclass
class FastLayer:
    ln_1: tuple[torch.Tensor, torch.Tensor]
    qkv: PackedLinear
    proj: PackedLinear
    ln_2: tuple[torch.Tensor, torch.Tensor]
    fc: PackedLinear
    fc_proj: PackedLinear


class FastWeights:
    """The packed copies of one model's weights (built once per model and chunk count)."""

    def __init__(self, model: GPT, chunks: int) -> None:
        self.chunks = chunks
        self.version = _weights_version(model)
        tr = model.transformer
        self.layers = [
            FastLayer(
                ln_1=(blk.ln_1.weight.detach(), blk.ln_1.bias.detach()),
                qkv=PackedLinear.from_out_in(blk.attn.c_attn.weight, blk.attn.c_attn.bias, chunks),
                proj=PackedLinear.from_out_in(blk.attn.c_proj.weight, blk.attn.c_proj.bias, chunks),
                ln_2=(blk.ln_2.weight.detach(), blk.ln_2.bias.detach()),
                fc=PackedLinear.from_out_in(blk.mlp.c_fc.weight, blk.mlp.c_fc.bias, chunks),
                fc_proj=PackedLinear.from_out_in(blk.mlp.c_proj.weight, blk.mlp.c_proj.bias,
                                                 chunks),
            )
            for blk in tr.h
        ]
        self.ln_f = (tr.ln_f.weight.detach(), tr.ln_f.bias.detach())
        self.head = PackedLinear.from_out_in(model.lm_head.weight, None, chunks)
        self.wte = tr.wte.weight.detach()
        self.wpe = tr.wpe.weight.detach()

    @property
    def extra_bytes(self) -> int:
        """Memory of the copies (weights transposed/split, padded head, copied biases)."""
        total = self.head.nbytes()
        for layer in self.layers:
            total += sum(p.nbytes() for p in (layer.qkv, layer.proj, layer.fc, layer.fc_proj))
        return total


def _weights_version(model: GPT) -> tuple[int, ...]:
    # Bumped by any in-place write to a parameter: then the packed copies are stale.
    return tuple(p._version for p in model.parameters())


_PACKED: weakref.WeakKeyDictionary[GPT, dict[int, FastWeights]] = weakref.WeakKeyDictionary()


@torch.no_grad()
def fast_weights(model: GPT, chunks: int | None = None) -> FastWeights:
    """Packed copies for ``model``, cached while the model lives and its weights are unchanged."""
    n = default_chunks(model.device) if chunks is None else max(1, int(chunks))
    per_model = _PACKED.setdefault(model, {})
    packed = per_model.get(n)
    if packed is None or packed.version != _weights_version(model):
        per_model.clear()  # one packing per model at a time: they are as big as the weights
        packed = per_model[n] = FastWeights(model, n)
    return packed


@torch.no_grad()
def fast_decode_step(
    w: FastWeights, cfg_n_head: int, k_buf: torch.Tensor, v_buf: torch.Tensor,
    token: torch.Tensor, pos: int,
) -> torch.Tensor:
    """Logits (B, vocab) for ``token`` (B, 1) at position ``pos``; writes its K/V row in place.

    ``k_buf``/``v_buf`` are a ``PreallocKVCache``'s (L, B, nh, T_max, hs) buffers holding
    positions 0..pos-1.
    """
    batch = token.size(0)
    n_embd = w.wte.size(1)
    hs = n_embd // cfg_n_head
    eps = 1e-5
    x = w.wte[token[:, 0]] + w.wpe[pos]  # (B, C)
    for i, layer in enumerate(w.layers):
        h = F.layer_norm(x, (n_embd,), layer.ln_1[0], layer.ln_1[1], eps)
        qkv = layer.qkv(h).view(batch, 3, cfg_n_head, hs)  # q | k | v, heads side by side
        k_buf[i, :, :, pos] = qkv[:, 1]
        v_buf[i, :, :, pos] = qkv[:, 2]
        q = qkv[:, 0].unsqueeze(2)  # (B, nh, 1, hs): SDPA's fused kernels need 4-D
        y = F.scaled_dot_product_attention(
            q, k_buf[i, :, :, : pos + 1], v_buf[i, :, :, : pos + 1]
        )  # one new token sees every key, itself included: no mask
        x = x + layer.proj(y.reshape(batch, n_embd))
        h = F.layer_norm(x, (n_embd,), layer.ln_2[0], layer.ln_2[1], eps)
        x = x + layer.fc_proj(F.gelu(layer.fc(h), approximate="tanh"))
    x = F.layer_norm(x, (n_embd,), w.ln_f[0], w.ln_f[1], eps)
    return w.head(x)


class FastDecoder(Decoder):
    """Prefill through ``GPT.forward`` into a preallocated cache, then ``fast_decode_step``."""

    appends = False  # its step is its own, not GPT.forward

    def __init__(
        self, model: GPT, *, batch_size: int = 1, capacity: int | None = None,
        chunks: int | None = None,
    ) -> None:
        super().__init__(model, batch_size=batch_size, capacity=capacity,
                         cache_kind="prealloc", mask="none", logits="last")
        self.weights = fast_weights(model, chunks)
        self.extra_bytes = self.weights.extra_bytes

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        assert self.seq is not None and self.cache is not None, "prefill first"
        cache = self.cache
        pos = cache.length
        if pos + 1 > cache.capacity:
            raise ValueError(
                f"KV cache holds at most {cache.capacity} tokens; this step would need {pos + 1}"
            )
        logits = fast_decode_step(self.weights, self.model.config.n_head, cache.k_buf,
                                  cache.v_buf, token, pos)
        cache.advance(1)
        self._push(token)
        return logits
