"""Our CPU kernels for a decode step: ``torch.ops.kvlab.linear``, ``.attend`` and
``.decode_layers``, a small C++ extension built once per machine (``gemv.cpp``, ``attend.cpp``,
``layers.cpp``, their ``simd.h`` and ``ops.h``, compiled with ``-O3 -march=native`` for the CPU
at hand).

  build()        compile it now (about 15-30 s on 2 cores; ``make`` does it while installing,
                 ``python -m engine.kernels build`` by hand); returns (ok, why not)
  available()    (True, "") once it is built and loaded, else (False, why): never compiles
  linear(x, w, scale=None, bias=None) -> y
                 y (B, out) = (x (B, in) @ w.T) * scale + bias for 1..8 rows of fp32 ``x``, with
                 ``w`` (out, in) contiguous in fp32, bf16 or int8 (int8 needs ``scale``, one fp32
                 per output row). The same results as ``F.linear`` up to float32 summation order.
  interleave(w) -> wi; linear_interleaved(x, wi, out, bias=None) -> y
                 the fp32 product over a copy of w in which every four rows are one contiguous
                 stream (a thread then reads its rows in one sequential pass; mode 8 takes it
                 per role where it times fastest)
  attend(q, k, v, k_buf, v_buf, pos) -> y (B, nh, hs)
                 writes one new token's k, v (B, nh, hs) at row ``pos`` of a layer's cache
                 (B, nh, T, hs) and attends its q over rows 0..pos (no mask): SDPA's result up
                 to float32 rounding, without its per-call set-up (``attend.cpp``).
  decode_layers(x, ...) -> logits
                 a whole decode step after the embedding -- every block, ln_f, the output
                 projection -- in one call over the kernels above and ATen (``layers.cpp``;
                 ``engine.step.fused_step`` is its one caller).

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
from pathlib import Path
from typing import Any

SOURCES = [Path(__file__).with_name(n) for n in ("gemv.cpp", "attend.cpp", "layers.cpp")]
HEADERS = [Path(__file__).with_name(n) for n in ("simd.h", "ops.h")]
NAME = "kvlab_kernels"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_state: dict[str, Any] = {"loaded": False, "why": "not built yet: run `python -m engine.kernels "
                          "build` (make does it while installing)"}


def _build_dir() -> Path:
    """Where the compiled library lives: ``KVLAB_KERNEL_DIR``, else torch's extension cache."""
    from torch.utils.cpp_extension import _get_build_directory

    env = os.environ.get("KVLAB_KERNEL_DIR")
    path = Path(env) if env else Path(_get_build_directory(NAME, verbose=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _library(build_dir: Path) -> Path:
    return build_dir / f"{NAME}.so"


def _source_hash() -> str:
    """What the built library must have been built from: the source's bytes, our flags and the
    torch it links against (a checkout's file times say nothing: a fresh clone makes an old
    source look new)."""
    import torch

    code = b"".join(p.read_bytes() for p in [*SOURCES, *HEADERS])
    return hashlib.sha256(code + " ".join([*CFLAGS, torch.__version__]).encode()).hexdigest()


def _stamp(build_dir: Path) -> Path:
    return build_dir / f"{NAME}.source-sha256"


def build(verbose: bool = False) -> tuple[bool, str]:
    """Compile (or find up to date) and load the kernel; (ok, why not)."""
    if _state["loaded"]:
        return True, ""
    try:
        from torch.utils.cpp_extension import load

        where = _build_dir()
        load(name=NAME, sources=[str(p) for p in SOURCES], build_directory=str(where),
             extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], is_python_module=False,
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


def linear(x: Any, w: Any, scale: Any = None, bias: Any = None) -> Any:
    """``torch.ops.kvlab.linear`` (see the module docstring); load it with ``available()``."""
    import torch

    return torch.ops.kvlab.linear(x, w, scale, bias)


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


def decode_layers(x: Any, ln_w: Any, ln_b: Any, w: Any, scale: Any, bias: Any, kind: Any,
                  out: Any, k_buf: Any, v_buf: Any, pos: int, n_head: int, eps: float) -> Any:
    """``torch.ops.kvlab.decode_layers``: every block and the output projection of one decode
    step in one call (``layers.cpp``; ``engine.step.fused_step`` builds its arguments)."""
    import torch

    return torch.ops.kvlab.decode_layers(x, ln_w, ln_b, w, scale, bias, kind, out, k_buf, v_buf,
                                         pos, n_head, eps)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["build"]:
        print("usage: python -m engine.kernels build", file=sys.stderr)
        return 2
    ok, why = build(verbose="-v" in args)
    print("kernel built and loaded" if ok else f"kernel not built: {why}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
