"""Rungs 12 and 13: weight-only int8 and bf16 -- fewer bytes per weight, the same model around them.

A cached decode step streams every Linear weight once, so its floor is (bytes per weight x
weights) / bandwidth; these rungs lower the first factor and leave everything else alone:
activations, LayerNorms / RMSNorms, biases, the position table and the KV cache stay in the
model dtype. Any family: the view's class is made from the model's own (``WeightOnlyGPT``,
``WeightOnlyLlama``, ...: every ``nn.Linear`` and the embedding tied to the head; an untied
embedding is only looked up, never streamed, and stays the model's).

  int8_weights  every Linear weight stored int8 with one fp32 scale per output channel
                (symmetric absmax / 127, ``quantize_rows``). The tied embedding / output
                projection is quantized ONCE, per vocabulary row (= per output channel of the
                projection): the output projection multiplies by it, and the embedding lookup
                dequantizes the one row it reads (row x its scale). Not exact: the gate holds it
                to its registered tolerance.
  bf16_weights  every Linear weight (and the tied matrix) stored in bfloat16; a decode step's
                rows on a CPU go through the C++ kernel (fp32 input, bf16 rows widened in
                registers, fp32 sums); elsewhere the product runs in bf16 (the input rounded to
                bf16, fp32 accumulation in oneDNN/cuBLAS). Results in the model dtype.

How: as gpt-fast's ``quantize.py`` does, a handler swaps each ``nn.Linear`` (and the embedding
tied to one) for a weight-only module over the same model, which never learns about it. The
loaded model is shared by every mode, so it is never changed: ``weight_only(model, storage)``
returns a *view* -- a shallow copy of the module tree in which only the containers above a
swapped module are copied and every other module (LayerNorms, ``wpe``) and tensor is the
model's own. The view reads ``config`` from the model. A view is kept in the model's state
(``engine.models.state.ModelState``) while its weights are unchanged, and dropped with the state.

The decoder (``WeightOnlyDecoder``) is mode 8's over the view: the prefill, seek, rewind and the
multi-token ``append`` run the model's ``forward`` over it (preallocated cache, fused attention),
and each decode step runs the family's one-token step over the view's weights
(the family's ``decode_step``, ``engine.families.step_of``; on a CPU each Linear's stored rows,
scale and bias go straight into the C++ kernel, and the whole step is one C++ call, its
``fused_step``), so a step pays for its weights and not for a
forward's per-module Python. ``stored_view(model, storage, convert)`` is the same view for any
storage (``engine.quant.blocks``' GGUF blocks use it): every Linear is a ``StoredLinear``.

The per-token matrix-vector product lives in ONE function per storage, ``int8_linear(x, wq,
scale)`` and ``bf16_linear(x, w)``; ``kernel(storage, device_type)`` names what each runs, for
the rows that time them. On a CPU, a decode step's few fp32 rows go through ``engine.kernels.cpu``'
C++ matrix-vector product, which converts int8 or bf16 rows to fp32 in registers as it streams
them (``scripts/bench_kernels.py`` measured it against every other path; docs/engine-speed.md).
Without the built kernel (or with ``KVLAB_NO_KERNEL`` set), the plain-PyTorch int8 path on a CPU
dequantizes ``CHUNK_BYTES`` of weight rows at a time into a scratch that stays in the core's cache
and multiplies there: memory sees the int8 bytes once (a whole-matrix ``wq.to(float32)`` would
write and re-read four bytes per weight, and ``torch.ops.aten._weight_int8pack_mm`` measured 36 ms
against fp32 ``F.linear``'s 13.9 ms on gpt2's output projection here). On CUDA it is
``_weight_int8pack_mm`` where the build has it, else a whole-matrix dequantize.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels import cpu as kernels
from ..models.base import CausalLM
from ..models.state import ModelState, weights_version

INT8_MAX = 127.0
STORAGES = ("int8", "bfloat16")
CHUNK_BYTES = 1 << 20  # fp32 scratch per chunk of rows: stays in a core's L2
FEW_ROWS = 16  # more input rows than this (a prefill): dequantize once, one big matmul


# ------------------------------------------------------------------------------ the kernels
def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(wq int8 (out, in), scale fp32 (out,)) with w ~= wq * scale[:, None]: absmax per row."""
    w32 = w.detach().float()
    scale = (w32.abs().amax(dim=1) / INT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    wq = torch.round(w32 / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return wq.contiguous(), scale.contiguous()


def kernel_takes(x: torch.Tensor) -> bool:
    """Does ``engine.kernels.cpu``' C++ matrix-vector product take this input (a CPU, 1 to
    ``kernels.MAX_ROWS`` fp32 rows, no gradient) and is it built? ``KVLAB_NO_KERNEL`` switches
    it off."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or x.size(0) > kernels.MAX_ROWS
            or (x.requires_grad and torch.is_grad_enabled())):
        return False
    return kernels.available()[0]


def int8_linear(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y (N, out) = x (N, in) @ (wq * scale[:, None]).T, in x's dtype. The one int8 kernel."""
    if kernel_takes(x):
        return kernels.linear(x.contiguous(), wq, scale)
    if x.device.type == "cuda":
        got = checked_int8pack(x, wq, scale)
        if got is not None:
            return got
    if x.size(0) > FEW_ROWS or x.device.type != "cpu" or (x.requires_grad
                                                          and torch.is_grad_enabled()):
        return F.linear(x, wq.to(x.dtype)) * scale.to(x.dtype)  # (out= cannot record grads)
    return int8_chunked(x, wq, scale)


def int8_chunked(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The plain-PyTorch CPU path for a few rows: dequantize ``CHUNK_BYTES`` of rows at a time
    into a scratch that stays in cache, and multiply there."""
    rows = max(1, CHUNK_BYTES // (wq.size(1) * 4))
    out = x.new_empty(x.size(0), wq.size(0))
    for i in range(0, wq.size(0), rows):
        torch.mm(x, wq[i : i + rows].to(x.dtype).t(), out=out[:, i : i + rows])
    return out.mul_(scale.to(x.dtype))


# Per (rows, weight shape, dtype): does torch's _weight_int8pack_mm give the dequantized
# product? On an H200 (torch 2.11) it gave logits 107% off mode 1's on a 64-wide test shape while
# passing gpt2's: a library kernel is trusted per shape, once checked, never blindly.
_INT8PACK_OK: dict[tuple, bool] = {}


def checked_int8pack(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor,
                     fn: Callable[..., torch.Tensor] | None = None) -> torch.Tensor | None:
    """``fn`` (default torch's ``_weight_int8pack_mm``) for x (N, in) @ (wq * scale).T where it
    agrees with the dequantized product: checked against it on the first call of each shape
    (that call returns the dequantized product either way), None once it raised or disagreed
    there (the caller dequantizes)."""
    fn = fn or torch.ops.aten._weight_int8pack_mm
    key = (x.size(0), tuple(wq.shape), x.dtype, x.device.type)
    if _INT8PACK_OK.get(key) is False:
        return None
    try:
        got = fn(x, wq, scale.to(x.dtype))
    except (RuntimeError, NotImplementedError):  # not in this build
        _INT8PACK_OK[key] = False
        return None
    if key not in _INT8PACK_OK:
        want = F.linear(x, wq.to(x.dtype)) * scale.to(x.dtype)
        tol = 1e-2 if x.dtype != torch.float32 else 1e-4  # summation order, not a wrong product
        _INT8PACK_OK[key] = bool((got - want).abs().max() <= tol * want.abs().max().clamp_min(1))
        return want
    return got


def kernel(storage: str, device_type: str) -> str:
    """What ``int8_linear`` / ``bf16_linear`` run on a device type for a decode step, in words
    (the rows that time them and the device check print it)."""
    if device_type == "cpu" and kernels.available()[0] and storage == "int8":
        return "engine.kernels.cpu C++ matrix-vector (int8 rows, fp32 accumulation)"
    if device_type == "cpu" and kernels.available()[0]:
        return "engine.kernels.cpu C++ matrix-vector (bf16 rows, fp32 accumulation)"
    if storage == "bfloat16":
        return "F.linear in bf16"
    if device_type == "cuda":
        checked = set(_INT8PACK_OK.values())
        return ("torch.ops.aten._weight_int8pack_mm where it gave the dequantized product, "
                "checked per shape" if checked != {False} else
                "dequantize the whole matrix + F.linear (torch's int8 kernel failed its check)")
    if device_type == "cpu":
        why = kernels.available()[1]
        return (f"dequantize {CHUNK_BYTES >> 10} KiB of rows at a time + mm (plain PyTorch; "
                f"the C++ kernel: {why})")
    return "dequantize the whole matrix + F.linear"


def bf16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y (N, out) = x (N, in) @ w.T with w in bf16, returned in x's dtype. The one bf16 kernel."""
    if kernel_takes(x):  # faster than F.linear in bf16 on every gpt2 matrix (bench_kernels)
        return kernels.linear(x.contiguous(), w)
    return F.linear(x.to(w.dtype), w).to(x.dtype)


# ----------------------------------------------------------------------- the swapped modules
class StoredLinear(nn.Module):
    """A Linear whose weight a rung stores its own way (int8 here, bf16, GGUF blocks in
    ``engine.quant.blocks``): ``stored_bytes()`` what its weight takes (the bytes a step
    streams), ``embedding(dtype)`` the embedding tied to it, reading the same stored rows. A
    storage says how it multiplies (``matmul``: (N, in) rows -> (N, out), bias added) and how
    it reads rows back (``rows``)."""

    in_features: int
    out_features: int

    def stored_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weight's rows ``idx`` (any shape) as floats in ``dtype``: (*idx.shape, in)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, self.in_features))
        return y.view(*x.shape[:-1], self.out_features)

    def embedding(self, dtype: torch.dtype) -> nn.Module:
        return TiedEmbedding(self, dtype)


class TiedEmbedding(nn.Module):
    """The embedding tied to a ``StoredLinear`` (the head): reads the head's stored rows, so the
    matrix is stored once and used twice."""

    def __init__(self, head: StoredLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.head, self.dtype = [head], dtype  # a list: not registered twice as a submodule

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head[0].rows(idx, self.dtype)


class Int8Linear(StoredLinear):
    """A Linear whose weight is int8 with an fp32 scale per output channel."""

    def __init__(self, wq: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = wq.size(1), wq.size(0)
        self.register_buffer("wq", wq)
        self.register_buffer("scale", scale)
        self.bias = bias  # the model's own tensor (model dtype), not a copy

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_linear(x, self.wq, self.scale)
        return y if self.bias is None else y + self.bias

    def rows(self, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.wq[idx].to(dtype) * self.scale[idx].unsqueeze(-1).to(dtype)  # row x scale


class Bf16Linear(StoredLinear):
    """A Linear whose weight is stored in bfloat16."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.size(1), weight.size(0)
        self.register_buffer("weight", weight)
        self.bias = bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = bf16_linear(x, self.weight)
        return y if self.bias is None else y + self.bias

    def rows(self, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.embedding(idx, self.weight).to(dtype)


def _convert_linear(lin: nn.Linear, storage: str) -> StoredLinear:
    bias = None if lin.bias is None else lin.bias.detach()
    if storage == "int8":
        return Int8Linear(*quantize_rows(lin.weight), bias)
    return Bf16Linear(lin.weight.detach().to(torch.bfloat16).contiguous(), bias)


# ------------------------------------------------------------------------------- the view
class WeightOnlyView:
    """What a weight-only view adds to the model class it takes (see the module docstring):
    the model it was made of (weakly), its config, its stored bytes. A view's class is
    ``WeightOnly<its model's class>``, a subclass of both."""

    storage: str
    version: tuple[Any, ...]  # the model's weights and module classes when the view was made

    @property
    def base(self) -> nn.Module:
        base = self.__dict__["_base"]()  # weak: the cache of views must not keep models alive
        if base is None:
            raise RuntimeError("the model this weight-only view was made of is gone")
        return base

    @property
    def config(self):  # type: ignore[no-untyped-def]  # the model's: one config for both
        return self.base.config

    @config.setter
    def config(self, value: Any) -> None:
        self.base.config = value

    # The head is swapped for its stored form: device and dtype (those of the activations and
    # the KV cache) are read off the final norm, which stays the model's.
    @property
    def device(self) -> torch.device:
        return self.trunk()[1].weight.device  # type: ignore[attr-defined]

    @property
    def dtype(self) -> torch.dtype:
        return self.trunk()[1].weight.dtype  # type: ignore[attr-defined]

    def stored_bytes(self) -> int:
        """Bytes of the weight-only copies (int8 weights + scales, bf16 weights, GGUF blocks):
        the weights a decode step streams."""
        return sum(m.stored_bytes() for m in self.modules()  # type: ignore[attr-defined]
                   if isinstance(m, StoredLinear))


WeightOnlyModel = WeightOnlyView  # (a CausalLM too: its class subclasses the model's)
_VIEW_CLASSES: dict[type, type] = {}


def _view_class(own: type) -> type:
    """The view's class: a subclass of ``WeightOnlyView`` and the model's own class, made once
    per class (for a model whose class a check's silent bug swapped, the bugged one: the
    override is then in the view too)."""
    if own not in _VIEW_CLASSES:
        _VIEW_CLASSES[own] = type(f"WeightOnly{own.__name__}", (WeightOnlyView, own), {})
    return _VIEW_CLASSES[own]


Convert = Callable[[str, nn.Linear], StoredLinear]  # (qualified name, Linear) -> its stored form


def _swap(module: nn.Module, convert: Convert, tied: dict[int, nn.Module], prefix: str = ""
          ) -> nn.Module:
    """``module`` itself when nothing under it changes, else a shallow copy with its swapped
    children. ``tied`` maps a weight's id to the module that now holds it (the head)."""
    if isinstance(module, nn.Linear):
        new = convert(prefix, module)
        tied[id(module.weight)] = new
        return new
    children = {name: _swap(child, convert, tied, f"{prefix}.{name}" if prefix else name)
                if child is not None else None for name, child in module._modules.items()}
    if all(children[n] is c for n, c in module._modules.items()):
        return module
    out = copy.copy(module)  # shares every tensor; only the child table is its own
    out._modules = type(module._modules)(children)
    out._parameters = type(module._parameters)(module._parameters)
    out._buffers = type(module._buffers)(module._buffers)
    return out


def _tie_embeddings(view: nn.Module, base: nn.Module, tied: dict[int, nn.Module],
                    dtype: torch.dtype) -> None:
    """Every embedding of the base whose weight a swapped Linear holds reads that Linear's
    copy (GPT-2's ``wte``/``lm_head``, a tied Llama's ``embed_tokens``): stored once, used
    twice."""
    for name, emb in base.named_modules():
        if isinstance(emb, nn.Embedding) and id(emb.weight) in tied:
            head = tied[id(emb.weight)]
            parent_name, _, attr = name.rpartition(".")
            parent = view.get_submodule(parent_name) if parent_name else view
            original = base.get_submodule(parent_name) if parent_name else base
            if parent is original:
                raise RuntimeError(f"{parent_name!r} was not copied: the tie cannot be swapped")
            parent._modules[attr] = head.embedding(dtype)  # type: ignore[operator]


def weight_only(model: CausalLM | ModelState, storage: str) -> WeightOnlyModel:
    """The view of ``model`` with its Linear weights in ``storage`` ("int8" | "bfloat16"),
    built once per model state while the weights are unchanged."""
    if storage not in STORAGES:
        raise ValueError(f"unknown weight storage {storage!r}; allowed: {', '.join(STORAGES)}")
    return stored_view(model, storage, lambda name, lin: _convert_linear(lin, storage))


def stored_view(model: CausalLM | ModelState, storage: str,
                convert: Callable[[str, nn.Linear], StoredLinear]) -> WeightOnlyModel:
    """The view of ``model`` in which every ``nn.Linear`` is ``convert(name, linear)`` (its
    qualified name, e.g. "model.layers.3.self_attn.q_proj" or "lm_head"), kept in the model's
    state under ("weight_only", ``storage``) while the weights are unchanged
    (``engine.quant.blocks`` makes its GGUF-block views with it)."""
    state = ModelState.of(model)
    # The weights' version, and the class of every module: a module whose class was swapped
    # (the checks' silent bugs, ``instruments.checks.bugs``) is copied into the view as it is
    # then, so a view made with a bug on is not reused once the bug is off, nor the reverse.
    version = (weights_version(state.model), tuple(type(m) for m in state.model.modules()))
    return state.cached(("weight_only", storage),
                        lambda: _view(state.model, storage, version, convert),
                        keep=lambda v: v.version == version)


@torch.no_grad()
def _view(model: CausalLM, storage: str, version: tuple[Any, ...], convert: Convert
          ) -> WeightOnlyModel:
    dtype = model.dtype
    # The head and the embedding are converted through the head alone (the tie is restored
    # below): seen from the container, the tied Embedding is not a Linear.
    tied: dict[int, nn.Module] = {}
    view = _swap(model, convert, tied)
    if view is model:
        raise ValueError("the model has no Linear layers to store in " + storage)
    _tie_embeddings(view, model, tied, dtype)
    view.__class__ = _view_class(type(model))
    view.__dict__["_base"] = weakref.ref(model)
    view.storage = storage
    view.version = version
    return view  # type: ignore[return-value]
