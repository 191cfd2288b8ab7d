"""Reading GGUF files (llama.cpp's format) with our own parser and our own dequantizer: a
weights format every family's reader shares (a family's own names and shapes are its folder's).

  with GGUFFile(path) as f:              header, metadata and tensor table, validated on open
      f.metadata["llama.block_count"]    every key/value as Python values (arrays as lists)
      f.tensors[name]                    a ``TensorInfo``: torch-order shape, ggml type, bytes
      f.dequantize(name, dtype)          the tensor as floats in ``dtype`` (torch's dim order)
      f.raw(name)                        a ``RawTensor``: its blocks as stored (uint8 rows) with
                                         their ggml type and shape, for a later rung that
                                         multiplies by Q4_1 / Q8_0 blocks without expanding them
  dequantize_blocks(blocks, "Q4_1")      (n, bytes per block) uint8 -> (n, 32) float32
  GGUFLayout                             what a family writes into a GGUF file llama.cpp loads
                                         (its weights module's ``gguf_layout(model)``, the
                                         inverse of its reader; ``instruments.peers.gguf_out``
                                         quantizes and writes it); ``float_params(model)``

A GGUF file: the magic b"GGUF", a version (2 or 3), the tensor and key/value counts, the
key/value pairs, the tensor table (name, dims fastest-first, ggml type, offset), then the tensor
data, aligned (``general.alignment``, default 32). Nothing is unpickled: a file that is not
GGUF, is truncated or holds garbage raises ``engine.models.loader.WeightsError`` naming the
file and what is wrong with it, on open (every tensor's bytes are checked to lie inside the file).

Dequantized here: F32, F16, Q8_0 (34-byte blocks: fp16 scale d, 32 int8; x = d * q), Q4_1
(20-byte blocks: fp16 d, fp16 m, 16 bytes of nibbles, the low nibbles weights 0-15 and the high
ones 16-31; x = d * q + m), and the two K-quants llama.cpp's Q4_K_M files hold: Q4_K (144-byte
super-blocks of 256: fp16 d and dmin, 12 bytes packing eight 6-bit scales and mins, 128 bytes
of nibbles; x = d * sc * q - dmin * m per sub-block of 32) and Q6_K (210 bytes: 128 bytes of low
nibbles, 64 of high 2-bit pairs, sixteen int8 scales, fp16 d; x = d * sc * (q - 32) per 16). In
fp32 with one rounding per multiply and per add, in gguf-py's order, so the results equal
``gguf.quants.dequantize`` bit for bit (tests/test_llama_gguf.py, tests/test_gguf_families.py).
Other types are read (their blocks are sized, ``raw`` works) but not dequantized: loading a
model holding one is refused, naming it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .loader import WeightsError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# ggml type id -> (name, elements per block, bytes per block), as in ggml.h / gguf-py
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
    28: ("F64", 1, 8), 30: ("BF16", 1, 2),
}
DEQUANTIZED = ("F32", "F16", "Q8_0", "Q4_1", "Q4_K", "Q6_K")
KEPT = ("Q8_0", "Q4_1")  # the block types a rung multiplies as stored (rungs 14-15)
# metadata value types: scalars as struct formats (little-endian); 8 string, 9 array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch's order (GGUF lists dims fastest first: reversed here)
    ggml_type: str  # "Q4_1", "F32", ...
    offset: int  # absolute byte offset of its data in the file
    nbytes: int

    @property
    def block(self) -> tuple[int, int]:
        """(elements, bytes) of one block of its type."""
        _, elements, size = GGML_TYPES[_TYPE_IDS[self.ggml_type]]
        return elements, size


_TYPE_IDS = {name: tid for tid, (name, _, _) in GGML_TYPES.items()}


@dataclass(frozen=True)
class RawTensor:
    """A tensor's bytes as stored: ``blocks`` (rows, bytes per row) uint8, each row being
    ``shape[-1] / block_elements`` blocks of ``ggml_type``; ``shape`` is what dequantizing it
    gives (torch's order: a Linear weight is (out_features, in_features))."""

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    blocks: torch.Tensor

    @property
    def block_elements(self) -> int:
        return GGML_TYPES[_TYPE_IDS[self.ggml_type]][1]

    @property
    def block_bytes(self) -> int:
        return GGML_TYPES[_TYPE_IDS[self.ggml_type]][2]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        per_block = self.blocks.reshape(-1, self.block_bytes)
        return dequantize_blocks(per_block, self.ggml_type).reshape(self.shape).to(dtype)


@dataclass
class GGUFLayout:
    """A model's weights in llama.cpp's layout of one architecture: everything of a GGUF file
    that is the family's, in the order it is written. Keys are ``gguf.GGUFWriter``'s methods
    less "add_" (``("block_count", 30)`` is ``add_block_count(30)``), so their value types are
    the writer's; the file type and quantization version come after ``metadata``, then
    ``vocabulary``."""

    arch: str  # general.architecture: llama.cpp's name of the layout ("gpt2", "llama", ...)
    metadata: list[tuple[str, Any]]
    tensors: dict[str, np.ndarray]  # GGUF name -> float32 values in torch's (out, in) order
    vocabulary: list[tuple[str, Any]] = field(default_factory=list)
    # a GGUF file whose "tokenizer." keys are copied as stored when its token list is as long
    # as the model's vocabulary (a shipped model's own); with no vocabulary, none: "none"
    tokenizer_from: Path | None = None
    # matrices written F32 whatever the file's type: tables read by row, never multiplied
    unquantized: tuple[str, ...] = ()


def float_params(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """``model``'s state dict as float32 numpy arrays on the host (what a layout is cut from)."""
    with torch.no_grad():
        return {k: v.detach().to("cpu", torch.float32).numpy()  # host: written to a file
                for k, v in model.state_dict().items()}


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte ``start`` of every block, as fp32 (n, 1)."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def dequantize_blocks(blocks: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """(n, bytes per block) uint8 blocks of ``ggml_type`` -> (n, elements per block) float32."""
    if ggml_type not in DEQUANTIZED:
        raise WeightsError(f"cannot dequantize ggml type {ggml_type}; allowed: "
                           f"{', '.join(DEQUANTIZED)}")
    blocks = blocks.contiguous()
    if ggml_type == "F32":
        return blocks.view(torch.float32).clone()
    if ggml_type == "F16":
        return blocks.view(torch.float16).float()
    if ggml_type == "Q8_0":
        d = _half(blocks, 0)  # (n, 1) the block's scale
        q = blocks[:, 2:].contiguous().view(torch.int8).float()  # (n, 32)
        return q * d
    if ggml_type == "Q4_K":
        return _q4_k(blocks)
    if ggml_type == "Q6_K":
        return _q6_k(blocks)
    d, m = _half(blocks, 0), _half(blocks, 2)  # Q4_1: (n, 1) scale and minimum
    nibbles = blocks[:, 4:]  # (n, 16): byte j holds weight j (low) and weight j + 16 (high)
    q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=1).float()  # (n, 32)
    return d * q + m  # two roundings, as gguf-py's (d * qs) + m


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """(n, 144) Q4_K super-blocks -> (n, 256): eight sub-blocks of 32, each d * sc and
    dmin * m (6-bit sc, m packed in 12 bytes), its weights the 4-bit q of 32 bytes' low
    nibbles then the next sub-block's their high ones."""
    n = blocks.size(0)
    d, dmin = _half(blocks, 0), _half(blocks, 2)  # (n, 1) each
    packed = blocks[:, 4:16].reshape(n, 3, 4)  # scales 0-3 | mins 0-3 | the high bits & 4-7
    lo, mid, hi = packed[:, 0], packed[:, 1], packed[:, 2]  # (n, 4) each
    sc = torch.cat((lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)), dim=1).float()  # (n, 8)
    m = torch.cat((mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)), dim=1).float()  # (n, 8)
    qs = blocks[:, 16:].reshape(n, 4, 1, 32)  # four runs of 32 bytes, two sub-blocks each
    q = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n, 8, 32).float()  # (n, 8, 32)
    scale = (d * sc).unsqueeze(-1)  # (n, 8, 1): one rounding, as gguf-py's d * sc
    shift = (dmin * m).unsqueeze(-1)
    return (scale * q - shift).reshape(n, 256)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """(n, 210) Q6_K super-blocks -> (n, 256): sixteen sub-blocks of 16, each d * sc (int8),
    its 6-bit q from a low nibble (128 bytes: runs of 64, low then high nibbles) and a 2-bit
    pair (64 bytes: runs of 32, four pairs a byte), minus 32."""
    n = blocks.size(0)
    ql = blocks[:, :128].reshape(n, 2, 1, 64)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    sc = blocks[:, 192:208].contiguous().view(torch.int8).float()  # (n, 16)
    d = _half(blocks, 208)  # (n, 1)
    low = torch.cat((ql & 0x0F, ql >> 4), dim=2).reshape(n, 2, 4, 32)  # (n, 2, 4, 32)
    high = torch.cat([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2)  # (n, 2, 4, 32)
    q = ((low | (high << 4)).to(torch.int16) - 32).reshape(n, 16, 16).float()
    return ((d * sc).unsqueeze(-1) * q).reshape(n, 256)


class GGUFFile:
    """One GGUF file, memory-mapped; see the module docstring. Close it (or use ``with``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                self.file_size = self.path.stat().st_size
                if self.file_size < 24:
                    raise WeightsError(f"{self.path}: not a GGUF file: {self.file_size} bytes, "
                                       "shorter than a GGUF header (24 bytes)")
                self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise WeightsError(f"{self.path}: cannot be read ({exc.strerror or exc})") from exc
        try:
            self._parse()
        except WeightsError:
            self.close()
            raise
        except (struct.error, ValueError, UnicodeDecodeError, IndexError, OverflowError,
                MemoryError, RecursionError) as exc:  # what garbage can make the parser raise
            self.close()
            raise WeightsError(f"{self.path}: not a readable GGUF file ({type(exc).__name__}: "
                               f"{exc}); is it truncated or corrupt?") from exc

    # -- parsing -------------------------------------------------------------------------------
    def _bad(self, what: str) -> WeightsError:
        return WeightsError(f"{self.path}: not a readable GGUF file: {what}")

    def _take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self._pos + size > self.file_size:
            raise self._bad(f"it ends at byte {self.file_size} inside its header (truncated?)")
        (value,) = struct.unpack_from(fmt, self._mm, self._pos)
        self._pos += size
        return value

    def _string(self) -> str:
        n = self._take("<Q")
        if self._pos + n > self.file_size:
            raise self._bad(f"a string of {n} bytes at byte {self._pos} runs past its end "
                            f"({self.file_size} bytes: truncated?)")
        raw = self._mm[self._pos : self._pos + n]
        self._pos += n
        return raw.decode("utf-8")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            value = self._take(_SCALARS[vtype])
            # A float32 as the shortest decimal that round-trips it: 1e-05, not 9.9999997e-06.
            return float(str(np.float32(value))) if vtype == _FLOAT32 else value
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise self._bad(f"unknown metadata value type {vtype} at byte {self._pos}")
        etype, count = self._take("<I"), self._take("<Q")
        if count > self.file_size - self._pos:  # every element takes at least a byte
            raise self._bad(f"an array of {count} items at byte {self._pos} cannot fit in it")
        if etype in _NUMPY:  # numbers: read in one go
            dt = np.dtype(_NUMPY[etype]).newbyteorder("<")
            end = self._pos + count * dt.itemsize
            if end > self.file_size:
                raise self._bad(f"an array runs past its end at byte {self.file_size}")
            out = np.frombuffer(self._mm, dtype=dt, count=count, offset=self._pos).tolist()
            self._pos = end
            return out
        return [self._value(etype) for _ in range(count)]

    def _parse(self) -> None:
        self._pos = 0
        magic = bytes(self._mm[:4])
        if magic != MAGIC:
            raise WeightsError(f"{self.path}: not a GGUF file: it starts with {magic!r}; a GGUF "
                               f"file starts with {MAGIC!r}")
        self._pos = 4
        self.version = self._take("<I")
        if self.version not in VERSIONS:
            raise self._bad(f"GGUF version {self.version}; allowed: "
                            f"{', '.join(map(str, VERSIONS))}")
        n_tensors, n_kv = self._take("<Q"), self._take("<Q")
        if n_tensors > self.file_size or n_kv > self.file_size:
            raise self._bad(f"it claims {n_tensors} tensors and {n_kv} keys in "
                            f"{self.file_size} bytes")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._take("<I"))
        table = []
        for _ in range(n_tensors):
            name, n_dims = self._string(), self._take("<I")
            if not 1 <= n_dims <= 4:
                raise self._bad(f"tensor {name!r} has {n_dims} dimensions; allowed: 1..4")
            dims = [self._take("<Q") for _ in range(n_dims)]
            table.append((name, dims, self._take("<I"), self._take("<Q")))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if align < 1 or align & (align - 1):
            raise self._bad(f"general.alignment is {align}; allowed: a power of two")
        self.data_offset = -(-self._pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, tid, rel in table:
            self.tensors[name] = self._tensor_info(name, dims, tid, rel)

    def _tensor_info(self, name: str, dims: list[int], tid: int, rel: int) -> TensorInfo:
        if tid not in GGML_TYPES:
            raise self._bad(f"tensor {name!r} has ggml type {tid}, which this reader does not "
                            f"know; known: {', '.join(t[0] for t in GGML_TYPES.values())}")
        type_name, elements, size = GGML_TYPES[tid]
        if dims[0] % elements:
            raise self._bad(f"tensor {name!r}: its rows of {dims[0]} values are not whole "
                            f"{type_name} blocks of {elements}")
        count = int(np.prod(dims, dtype=np.uint64))
        nbytes = count // elements * size
        start = self.data_offset + rel
        if start + nbytes > self.file_size:
            raise WeightsError(f"{self.path}: truncated: tensor {name!r} needs bytes up to "
                               f"{start + nbytes}, the file has {self.file_size}")
        return TensorInfo(name, tuple(reversed(dims)), type_name, start, nbytes)

    # -- tensors -------------------------------------------------------------------------------
    def _info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise WeightsError(f"{self.path} holds no tensor {name!r}")
        return self.tensors[name]

    def raw(self, name: str) -> RawTensor:
        """Tensor ``name``'s bytes as stored (a copy: the file can be closed after)."""
        info = self._info(name)
        rows = int(np.prod(info.shape[:-1], dtype=np.int64))  # 1 for a vector
        data = np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        # host: the file's bytes; whoever multiplies by them moves them to the model's device
        blocks = torch.from_numpy(data.copy()).view(rows, info.nbytes // rows)
        return RawTensor(name, info.ggml_type, info.shape, blocks)

    def dequantize(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tensor ``name`` as floats in ``dtype`` (dequantized in fp32, then cast once)."""
        return self.raw(name).dequantize(dtype)

    def close(self) -> None:
        mm = getattr(self, "_mm", None)
        if mm is not None:
            mm.close()
            self._mm = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
