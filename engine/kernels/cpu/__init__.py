"""Our CPU kernels for a decode step: ``torch.ops.kvlab.linear``, ``.attend``,
``.decode_layers``, the GGUF block products and the Llama step, a small C++ extension built once
per machine (``gemv.cpp``, ``attend.cpp``, ``layers.cpp``, ``blocks.cpp``, ``probe.cpp``, their
``simd.h`` and ``ops.h``, compiled with ``-O3 -march=native`` for the CPU at hand).

  build()        compile it now (about 30-60 s on 2 cores; ``make`` does it while installing,
                 ``python -m engine.kernels.cpu build`` by hand); returns (ok, why not)
  available()    (True, "") once it is built and loaded, else (False, why): never compiles
  isa()          the instruction set the loaded library was compiled for: "avx512-vnni",
                 "avx512", "avx-vnni", "avx2" or "scalar" (None when none is loaded).
                 ``KVLAB_KERNEL_ISA`` picks the build: unset or "native" (-march=native),
                 "avx2" (native without AVX-512 and AVX-VNNI: an AVX-512 host runs the AVX2
                 path), "avx-vnni" (without AVX-512), "scalar" (without AVX); each non-native
                 build lives under its own name and folder, so builds coexist, and the source
                 stamp holds the flags. One build per process (they share ``torch.ops.kvlab``).
  linear(x, w, scale=None, bias=None) -> y
                 y (B, out) = (x (B, in) @ w.T) * scale + bias for 1..8 rows of fp32 ``x``, with
                 ``w`` (out, in) contiguous in fp32, bf16 or int8 (int8 needs ``scale``, one fp32
                 per output row). The same results as ``F.linear`` up to float32 summation order.
  q8_0_linear(x, blocks, bias=None, exact=False) -> y; q4_1_linear(...) -> y
                 y (B, out) = x (B, in) @ W.T + bias over llama.cpp's GGUF blocks as stored:
                 ``blocks`` (out, in/32*34) uint8 for Q8_0, (out, in/32*20) for Q4_1 (a GGUF
                 tensor's bytes, rows back to back). ``exact=False``: x rounded to int8 per 32
                 values (llama.cpp's way, integer dot products); True: the blocks widened to
                 fp32 in registers. Bound against the fp64 product over the dequantized blocks,
                 per output: sum_j |w~_j| dx_j / 2 + (in/32 + 40) 2^-23 sum_j |w~_j| (|x_j| + dx_j),
                 |w~_j| = |d q_j| + |m| (Q8_0: |d q_j|), dx_j = max|x| / 127 over the 32-block
                 of x holding j (0 when exact). ``block_error_bound`` computes it.
  read_bytes(t) -> int
                 a plain read of a tensor's bytes (what the block products are measured against)
  interleave(w) -> wi; linear_interleaved(x, wi, out, bias=None) -> y
                 the fp32 product over a copy of w in which every four rows are one contiguous
                 stream (a thread then reads its rows in one sequential pass; mode 8 takes it
                 per role where it times fastest)
  attend(q, k, v, k_buf, v_buf, pos) -> y (B, nh, hs)
                 writes one new token's k, v (B, n_kv, hs) at row ``pos`` of a layer's cache
                 (B, n_kv, T, hs) and attends its q (B, nh, hs) over rows 0..pos (no mask), query
                 head h reading K/V head h // (nh / n_kv) (grouped-query attention; n_kv = nh is
                 multi-head): SDPA's result up to float32 rounding, without its per-call set-up
                 (``attend.cpp``).
  paged_attend(q, k_pool, v_pool, table, lengths) -> y (B, nh, hs)
                 query b (B, nh, hs) over rows 0..lengths[b]-1 of its block table (B, M) int64,
                 read in place from one layer of a block pool (n_kv, n_blocks, bt, hs): the
                 serving engine's batched decode step (``paged.cpp``)
  decode_layers(x, ...) -> logits
                 a whole GPT-2 decode step after the embedding -- every block, ln_f, the output
                 projection -- in one call over the kernels above and ATen (``layers.cpp``;
                 ``engine.models.gpt2.step.fused_step`` is its one caller).
  decode_layers_llama(x, ...) -> logits
                 the same for a Llama-family model (RMSNorm, RoPE, grouped-query attention,
                 SwiGLU; ``layers.cpp``; ``engine.models.llama.step.fused_step_llama``)
  Product(kind, weight, scale, bias, out)
                 one matrix product as ``decode_layers`` takes it; ``kind`` one of KERNEL,
                 INTERLEAVED, PACKED, CHUNKED, LINEAR, Q8_0, Q4_1, Q8_0_EXACT, Q4_1_EXACT
                 (the product a ``product`` attribute of a step's callable names)

Why: at batch 1 a decode step reads every weight once, so its time is the speed at which the
weights stream from memory. On these 2-core machines ``F.linear`` over ``[out, in]`` weights
streamed at 11-16 GB/s while a plain ``sum()`` of the same bytes reached 26-29 GB/s, and the
low-precision library calls were slower still (bf16 ``F.linear`` 10.7 ms and
``_weight_int8pack_mm`` 36 ms against fp32's 13.9 ms on the 50257 x 768 output projection; see
the notes). The kernel reads each row once, front to back, on every core (torch's own thread
pool), converting bf16/int8 in registers. Nothing here runs on a GPU.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

SOURCES = [Path(__file__).with_name(n)
           for n in ("gemv.cpp", "attend.cpp", "paged.cpp", "layers.cpp", "blocks.cpp",
                     "probe.cpp")]
HEADERS = [Path(__file__).with_name(n) for n in ("simd.h", "ops.h")]
NAME = "kvlab_kernels"  # the native build's; another ISA's is NAME + "_" + its name
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# KVLAB_KERNEL_ISA -> the flags after -march=native that take the newer instruction sets away
ISAS = {"native": [], "avx2": ["-mno-avx512f", "-mno-avxvnni"], "avx-vnni": ["-mno-avx512f"],
        "scalar": ["-mno-avx"]}
_state: dict[str, Any] = {"loaded": False, "why": "not built yet: run `python -m "
                          "engine.kernels.cpu build` (make does it while installing)"}


def _isa_wanted() -> str:
    """``KVLAB_KERNEL_ISA`` (default "native"); ValueError for a name we do not build."""
    want = os.environ.get("KVLAB_KERNEL_ISA", "").strip().lower() or "native"
    if want not in ISAS:
        raise ValueError(f"KVLAB_KERNEL_ISA={want!r}: one of {', '.join(ISAS)}")
    return want


def _name() -> str:
    want = _isa_wanted()
    return NAME if want == "native" else f"{NAME}_{want.replace('-', '_')}"


def _cflags() -> list[str]:
    return ["-O3", "-march=native", *ISAS[_isa_wanted()], "-fopenmp"]


def _build_dir() -> Path:
    """Where the compiled library lives: ``KVLAB_KERNEL_DIR``, else torch's extension cache
    (a non-native build in a folder of its own name inside ``KVLAB_KERNEL_DIR``)."""
    from torch.utils.cpp_extension import _get_build_directory

    env, name = os.environ.get("KVLAB_KERNEL_DIR"), _name()
    if env:
        path = Path(env) if name == NAME else Path(env) / name
    else:
        path = Path(_get_build_directory(name, verbose=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _library(build_dir: Path) -> Path:
    return build_dir / f"{_name()}.so"


def _source_hash() -> str:
    """What the built library must have been built from: the source's bytes, our flags (the
    instruction set's among them) and the torch it links against (a checkout's file times say
    nothing: a fresh clone makes an old source look new)."""
    import torch

    code = b"".join(p.read_bytes() for p in [*SOURCES, *HEADERS])
    return hashlib.sha256(code + " ".join([*_cflags(), torch.__version__]).encode()).hexdigest()


def _stamp(build_dir: Path) -> Path:
    return build_dir / f"{_name()}.source-sha256"


def build(verbose: bool = False) -> tuple[bool, str]:
    """Compile (or find up to date) and load the kernel; (ok, why not)."""
    if _state["loaded"]:
        return True, ""
    try:
        from torch.utils.cpp_extension import load

        where = _build_dir()
        load(name=_name(), sources=[str(p) for p in SOURCES], build_directory=str(where),
             extra_cflags=_cflags(), extra_ldflags=["-fopenmp"], is_python_module=False,
             verbose=verbose)
        _stamp(where).write_text(_source_hash())
    except Exception as exc:  # no compiler, no ninja, a compile error: say which, never crash
        _state["why"] = f"the C++ kernel could not be built: {type(exc).__name__}: " + \
            str(exc).strip().splitlines()[-1][:300]
        return False, _state["why"]
    _state.update(loaded=True, why="")
    return True, ""


def available() -> tuple[bool, str]:
    """Is the kernel loaded, or built and loadable now (never compiles)? (ok, why not)."""
    if _state["loaded"]:
        return True, ""
    if _state.get("checked"):  # asked on every matrix product: look at the files once
        return False, _state["why"]
    _state["checked"] = True
    if os.environ.get("KVLAB_NO_KERNEL"):
        _state["why"] = "switched off (KVLAB_NO_KERNEL is set)"
        return False, _state["why"]
    try:
        _isa_wanted()
    except ValueError as exc:
        _state["why"] = str(exc)
        return False, _state["why"]
    try:
        where = _build_dir()
        lib, stamp = _library(where), _stamp(where)
        built_from = stamp.read_text().strip() if stamp.exists() else None
    except Exception as exc:
        _state["why"] = f"no build directory: {exc}"
        return False, _state["why"]
    if not lib.exists() or built_from != _source_hash():
        return False, _state["why"]
    try:
        import torch

        torch.ops.load_library(str(lib))
    except Exception as exc:
        _state["why"] = f"the built kernel did not load: {exc}"
        return False, _state["why"]
    _state.update(loaded=True, why="")
    return True, ""


ISA_NAMES = ("avx512-vnni", "avx512", "avx-vnni", "avx2", "scalar")  # isa()'s, widest first


def isa() -> str | None:
    """The instruction set the loaded library runs (one of ``ISA_NAMES``), or None when none is
    loaded (``available()`` loads a built one)."""
    if not available()[0]:
        return None
    import torch

    return str(torch.ops.kvlab.isa())


def linear(x: Any, w: Any, scale: Any = None, bias: Any = None) -> Any:
    """``torch.ops.kvlab.linear`` (see the module docstring); load it with ``available()``."""
    import torch

    return torch.ops.kvlab.linear(x, w, scale, bias)


BLOCK = 32  # weights per GGUF Q8_0 / Q4_1 block
BLOCK_BYTES = {"Q8_0": 34, "Q4_1": 20}  # fp16 d (+ fp16 m for Q4_1), then the 32 q


def q8_0_linear(x: Any, blocks: Any, bias: Any = None, exact: bool = False) -> Any:
    """``torch.ops.kvlab.q8_0_linear``: y (B, out) over Q8_0 blocks (out, in/32*34) uint8."""
    import torch

    return torch.ops.kvlab.q8_0_linear(x, blocks, bias, exact)


def q4_1_linear(x: Any, blocks: Any, bias: Any = None, exact: bool = False) -> Any:
    """``torch.ops.kvlab.q4_1_linear``: y (B, out) over Q4_1 blocks (out, in/32*20) uint8."""
    import torch

    return torch.ops.kvlab.q4_1_linear(x, blocks, bias, exact)


def block_error_bound(x: Any, w_abs: Any, exact: bool) -> Any:
    """The bound the block products keep to, per output (B, out), against the fp64 product over
    the dequantized blocks: ``w_abs`` (out, in) is |d q_j| + |m| (Q8_0: |d q_j|), x (B, in)."""
    import torch

    x64, w64 = x.double(), w_abs.double()
    if exact:
        dx = torch.zeros_like(x64)
    else:  # the scale of x's 32-block holding j: max |x| / 127, rounding error dx / 2
        dx = (x64.abs().reshape(x.size(0), -1, BLOCK).amax(-1) / 127).repeat_interleave(BLOCK, 1)
    gamma = (x.size(1) // BLOCK + 40) * 2.0**-23
    return dx @ w64.T / 2 + gamma * ((x64.abs() + dx) @ w64.T)


def read_bytes(t: Any) -> int:
    """``torch.ops.kvlab.read_bytes``: the sum of a contiguous tensor's bytes, each read once on
    torch's threads: the floor the block products are measured against."""
    import torch

    return int(torch.ops.kvlab.read_bytes(t))


STRIP, GROUP = 16, 4  # gemv.cpp's kStrip and kRows
MAX_ROWS = 8  # the most rows of x (sequences of a decode step) every kernel here takes


def interleave(w: Any) -> Any:
    """fp32 ``w`` (out, in) repacked for ``linear_interleaved``: (groups, in/16, 4, 16), each
    group of 4 rows one contiguous stream (rows padded with zeros to a multiple of 4). ``in``
    must be a multiple of 16."""
    import torch

    out_f, in_f = w.shape
    if in_f % STRIP:
        raise ValueError(f"in_features must be a multiple of {STRIP}, got {in_f}")
    pad = -out_f % GROUP
    wp = torch.cat([w.detach(), w.new_zeros(pad, in_f)]) if pad else w.detach()
    return (wp.reshape(-1, GROUP, in_f // STRIP, STRIP).permute(0, 2, 1, 3).contiguous()
            .float())


def linear_interleaved(x: Any, wi: Any, out_features: int, bias: Any = None) -> Any:
    """y (B, out) = x @ W.T + bias over ``interleave(W)``: the same sums as ``linear``."""
    import torch

    return torch.ops.kvlab.linear_interleaved(x, wi, out_features, bias)


def attend(q: Any, k: Any, v: Any, k_buf: Any, v_buf: Any, pos: int) -> Any:
    """``torch.ops.kvlab.attend`` (see the module docstring); load it with ``available()``."""
    import torch

    return torch.ops.kvlab.attend(q, k, v, k_buf, v_buf, pos)


def paged_attend(q: Any, k_pool: Any, v_pool: Any, table: Any, lengths: Any) -> Any:
    """``torch.ops.kvlab.paged_attend`` (see the module docstring); load it with ``available()``."""
    import torch

    return torch.ops.kvlab.paged_attend(q, k_pool, v_pool, table, lengths)


def decode_layers(x: Any, ln_w: Any, ln_b: Any, w: Any, scale: Any, bias: Any, kind: Any,
                  out: Any, k_buf: Any, v_buf: Any, pos: int, n_head: int, eps: float) -> Any:
    """``torch.ops.kvlab.decode_layers``: every block and the output projection of one decode
    step in one call (``layers.cpp``; ``engine.models.gpt2.step.fused_step`` builds its
    arguments)."""
    import torch

    return torch.ops.kvlab.decode_layers(x, ln_w, ln_b, w, scale, bias, kind, out, k_buf, v_buf,
                                         pos, n_head, eps)


# How layers.cpp multiplies by one matrix (decode_layers' ``kind``): the C++ kernel over
# [out, in] rows (fp32, bf16 or int8 with a scale), over an interleaved copy, addmm over an
# [in, out] copy, baddbmm over chunked copies, F.linear over [out, in]; then GGUF Q8_0 / Q4_1
# blocks, the integer or the exact way (engine.quant.blocks uses them).
KERNEL, INTERLEAVED, PACKED, CHUNKED, LINEAR = range(5)
Q8_0, Q4_1, Q8_0_EXACT, Q4_1_EXACT = 5, 6, 7, 8


class Product(NamedTuple):
    """One matrix product as the fused step takes it (see layers.cpp)."""

    kind: int
    weight: torch.Tensor
    scale: torch.Tensor | None
    bias: torch.Tensor | None
    out: int  # the product's width (chunked and interleaved copies are padded)


# A whole decode step after the embedding in one call: fn(token, pos, k_buf, v_buf) -> logits
Fused = Callable[["torch.Tensor", int, "torch.Tensor", "torch.Tensor"], "torch.Tensor"]


def product_lists(products: list[Product]) -> tuple[list[Any], ...]:
    """``decode_layers``' per-product arguments: the weights, scales, biases, kinds, widths."""
    return ([p.weight for p in products], [p.scale for p in products],
            [p.bias for p in products], [p.kind for p in products], [p.out for p in products])


def decode_layers_llama(x: Any, norm_w: Any, w: Any, scale: Any, bias: Any, kind: Any, out: Any,
                        k_buf: Any, v_buf: Any, cos: Any, sin: Any, pos: int, n_head: int,
                        n_kv_head: int, eps: float, neox: bool = True) -> Any:
    """``torch.ops.kvlab.decode_layers_llama``: a Llama-family decode step after the embedding
    in one call (``layers.cpp`` says what each argument holds): x (B, C); 2L + 1 RMSNorm
    weights; 7L + 1 products (q, k, v, o, gate, up, down, ..., head) or 4L + 1 (q|k|v, o,
    gate|up, down, ..., head), each with its kind (0-8) and width; the (L, B, n_kv, T, hs)
    caches; the rotary cos / sin tables (T, hs/2) or (T, hs); returns logits (B, vocab).
    ``neox``: RoPE pairs channel i with i + hs/2 (HF's rotate_half); False: 2i with 2i + 1, the
    layout of q and k rows in a GGUF llama file (llama.cpp's converter permutes them)."""
    import torch

    return torch.ops.kvlab.decode_layers_llama(x, norm_w, w, scale, bias, kind, out, k_buf,
                                               v_buf, cos, sin, pos, n_head, n_kv_head, eps,
                                               neox)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["build"]:
        print("usage: python -m engine.kernels.cpu build", file=sys.stderr)
        return 2
    ok, why = build(verbose="-v" in args)
    print("kernel built and loaded" if ok else f"kernel not built: {why}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
