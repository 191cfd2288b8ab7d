"""The GGUF block products (``engine.kernels.cpu.q8_0_linear`` / ``q4_1_linear``) against the fp64
product over the same blocks dequantized here, in a few lines of numpy.

Both ways the kernel offers are held to the bound it states (``kernels.block_error_bound``):
``exact=True`` (blocks widened to fp32) to float32 rounding alone; ``exact=False`` (llama.cpp's
way: x rounded to int8 per 32 values) to that rounding plus the activation's. The integer way is
also checked tightly against a reference fed the same rounded x (reproduced here in float32),
where only float32 rounding remains: a tolerance that sees one weight dropped. Shapes are
SmolLM2-135M's (576 -> 576, 192, 1536; 1536 -> 576; the 49152 x 576 head in Q8_0), odd row
counts, 1 to 8 rows of x, a bias; bad input is refused with what is allowed. The ISA test
compiles the AVX-512 / AVX-VNNI / plain paths into object files without running them.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.kernels import cpu as kernels

BYTES = kernels.BLOCK_BYTES


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler on this machine: the kernel cannot be built")
    ok, why = kernels.build()
    assert ok, why


def quantize(w: np.ndarray, fmt: str) -> np.ndarray:
    """GGUF blocks (out, in/32*bytes) uint8 of fp32 rows, the way llama.cpp rounds them."""
    out = w.shape[0]
    wb = w.astype(np.float32).reshape(out, -1, 32)
    if fmt == "Q8_0":
        d = np.abs(wb).max(-1, keepdims=True) / 127
        q = np.round(wb / np.where(d == 0, 1, d)).clip(-127, 127).astype(np.int8)
        parts = [d.astype(np.float16).view(np.uint8), q.view(np.uint8)]
    else:
        lo, hi = wb.min(-1, keepdims=True), wb.max(-1, keepdims=True)
        d = (hi - lo) / 15
        q = np.round((wb - lo) / np.where(d == 0, 1, d)).clip(0, 15).astype(np.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)
        parts = [d.astype(np.float16).view(np.uint8), lo.astype(np.float16).view(np.uint8),
                 packed]
    return np.concatenate(parts, axis=-1).reshape(out, -1)


def dequantize(blocks: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """(w, |w~|) in fp64 (out, in): the blocks' weights exactly, and |d q| + |m| per weight."""
    b = blocks.reshape(blocks.shape[0], -1, BYTES[fmt])
    d = b[..., 0:2].copy().view(np.float16).astype(np.float64)
    if fmt == "Q8_0":
        dq = d * b[..., 2:].copy().view(np.int8)
        return dq.reshape(len(b), -1), np.abs(dq).reshape(len(b), -1)
    m = b[..., 2:4].copy().view(np.float16).astype(np.float64)
    dq = d * np.concatenate([b[..., 4:] & 15, b[..., 4:] >> 4], axis=-1)
    return (dq + m).reshape(len(b), -1), (np.abs(dq) + np.abs(m)).reshape(len(b), -1)


def rounded_x(x: np.ndarray) -> np.ndarray:
    """x as the integer way sees it, in fp64: per 32 values q = rint(x * (127 / max|x|)) in
    float32, times max|x| / 127 -- the kernel's own float32 steps."""
    xb = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    am = np.abs(xb).max(-1, keepdims=True)
    dx = am / np.float32(127)
    inv = np.where(am != 0, np.float32(127) / np.where(am == 0, 1, am), np.float32(0))
    q = np.rint(xb * inv.astype(np.float32))
    return (q.astype(np.float64) * dx.astype(np.float64)).reshape(x.shape)


def case(fmt: str, out: int, inn: int, batch: int, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    # rows of different scales and offsets, as trained matrices have
    w = rng.standard_normal((out, inn)) * rng.uniform(0.01, 0.1, (out, 1)) \
        + rng.uniform(-0.02, 0.02, (out, 1))
    blocks = quantize(w, fmt)
    x = rng.standard_normal((batch, inn)).astype(np.float32) * 2
    return torch.from_numpy(blocks), torch.from_numpy(x), *dequantize(blocks, fmt)


def product(fmt: str):  # noqa: ANN201
    return kernels.q8_0_linear if fmt == "Q8_0" else kernels.q4_1_linear


SMOL = [(576, 576), (192, 576), (1536, 576), (576, 1536)]


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize("out, inn, batch", [
    *[(o, i, 1) for o, i in SMOL], (576, 576, 2), (192, 576, 8), (576, 1536, 3),
    (7, 64, 5), (33, 96, 2), (130, 32, 1), (1, 576, 4)])
@pytest.mark.parametrize("exact", [False, True])
def test_within_the_stated_bound(fmt: str, out: int, inn: int, batch: int, exact: bool) -> None:
    blocks, x, w, w_abs = case(fmt, out, inn, batch, seed=out * 7 + inn + batch)
    bias = torch.randn(out, generator=torch.Generator().manual_seed(out))
    ref = x.double().numpy() @ w.T + bias.double().numpy()
    got = product(fmt)(x, blocks, bias, exact)
    assert got.shape == (batch, out) and got.dtype == torch.float32
    err = np.abs(got.double().numpy() - ref)
    bound = kernels.block_error_bound(x, torch.from_numpy(w_abs), exact).numpy()
    assert (err <= bound).all(), float((err / bound).max())
    if exact:  # float32 rounding only: far below the product's own size
        assert bound.max() < 1e-3 * np.abs(ref).max()
    else:  # the same rounded x in fp64: float32 rounding is all that is left
        ref_q = rounded_x(x.numpy()) @ w.T + bias.double().numpy()
        tight = kernels.block_error_bound(torch.from_numpy(rounded_x(x.numpy())),
                                          torch.from_numpy(w_abs), exact=True).numpy()
        assert (np.abs(got.double().numpy() - ref_q) <= tight).all()


@pytest.mark.parametrize("exact", [False, True])
def test_the_tied_head_in_q8_0(exact: bool) -> None:
    """SmolLM2's 49152 x 576 output projection, 1 and 2 rows."""
    blocks, x, w, w_abs = case("Q8_0", 49152, 576, 2, seed=5)
    for rows in (x[:1], x):
        got = kernels.q8_0_linear(rows, blocks, None, exact).double().numpy()
        err = np.abs(got - rows.double().numpy() @ w.T)
        assert (err <= kernels.block_error_bound(rows, torch.from_numpy(w_abs), exact)
                .numpy()).all()


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])
def test_any_bytes_are_read_as_llama_cpp_defines_them(fmt: str) -> None:
    """Random q bytes (Q8_0's -128 included, which no quantizer writes) under small scales."""
    rng = np.random.default_rng(3)
    out, inn = 37, 256
    raw = rng.integers(0, 256, (out, inn // 32, BYTES[fmt]), dtype=np.uint8)
    raw[..., 0:2] = rng.uniform(1e-3, 3e-3, (out, inn // 32, 1)).astype(np.float16).view(np.uint8)
    if fmt == "Q4_1":
        raw[..., 2:4] = rng.uniform(-0.02, 0.0, (out, inn // 32, 1)).astype(np.float16).view(
            np.uint8)
    blocks = raw.reshape(out, -1)
    w, w_abs = dequantize(blocks, fmt)
    x = torch.from_numpy(rng.standard_normal((3, inn)).astype(np.float32))
    for exact in (False, True):
        got = product(fmt)(x, torch.from_numpy(blocks), None, exact).double().numpy()
        err = np.abs(got - x.double().numpy() @ w.T)
        assert (err <= kernels.block_error_bound(x, torch.from_numpy(w_abs), exact).numpy()).all()


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])
def test_gguf_reads_these_blocks_as_we_do(fmt: str) -> None:
    """gguf's own quantizer and dequantizer agree with the layout read here (and the kernel)."""
    gguf = pytest.importorskip("gguf")
    kind = getattr(gguf.GGMLQuantizationType, fmt)
    rng = np.random.default_rng(4)
    w32 = (rng.standard_normal((64, 576)) * 0.05).astype(np.float32)
    blocks = gguf.quants.quantize(w32, kind)
    ours, w_abs = dequantize(blocks, fmt)
    assert np.allclose(gguf.quants.dequantize(blocks, kind), ours, rtol=0, atol=1e-6)
    x = torch.from_numpy(rng.standard_normal((2, 576)).astype(np.float32))
    got = product(fmt)(x, torch.from_numpy(blocks), None, True).double().numpy()
    assert (np.abs(got - x.double().numpy() @ ours.T) <=
            kernels.block_error_bound(x, torch.from_numpy(w_abs), True).numpy()).all()


def test_a_wrong_weight_would_be_seen() -> None:
    """The tight check above sees one weight of one row changed (one nibble off by one)."""
    blocks, x, w, w_abs = case("Q4_1", 64, 576, 1, seed=9)
    changed = blocks.clone()
    changed[5, 4 + 20 * 7] ^= 1  # row 5, block 7, weight 0: q off by one
    ref_q = rounded_x(x.numpy()) @ w.T
    tight = kernels.block_error_bound(torch.from_numpy(rounded_x(x.numpy())),
                                      torch.from_numpy(w_abs), exact=True).numpy()
    got = kernels.q4_1_linear(x, changed).double().numpy()
    assert (np.abs(got - ref_q) > tight).any()


@pytest.mark.parametrize("make, message", [
    (lambda: (torch.randn(1, 64), torch.zeros(4, 67, dtype=torch.uint8)),
     "Q8_0 blocks for in = 64 take 68 bytes per row"),
    (lambda: (torch.randn(1, 40), torch.zeros(4, 34, dtype=torch.uint8)),
     "must be a multiple of 32, got 40"),
    (lambda: (torch.randn(1, 64), torch.zeros(4, 68, dtype=torch.int8)), "uint8"),
    (lambda: (torch.randn(1, 64).double(), torch.zeros(4, 68, dtype=torch.uint8)),
     "contiguous fp32"),
    (lambda: (torch.randn(9, 64), torch.zeros(4, 68, dtype=torch.uint8)), "1 to 8 rows"),
    (lambda: (torch.randn(1, 64), torch.zeros(4, 68, 1, dtype=torch.uint8)), "(out, in / 32"),
])
def test_bad_input_says_what_is_allowed(make, message: str) -> None:  # noqa: ANN001
    with pytest.raises(RuntimeError, match=re.escape(message)):
        kernels.q8_0_linear(*make())
    with pytest.raises(RuntimeError, match="Q4_1 blocks for in = 64 take 40 bytes"):
        kernels.q4_1_linear(torch.randn(1, 64), torch.zeros(4, 68, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match=re.escape("bias must be (out,)")):
        kernels.q4_1_linear(torch.randn(1, 64), torch.zeros(4, 40, dtype=torch.uint8),
                            torch.zeros(5))


def test_read_bytes_reads_every_byte() -> None:
    for n in (1, 127, 1 << 16, (1 << 18) + 77):
        t = torch.randint(0, 256, (n,), dtype=torch.uint8)
        assert kernels.read_bytes(t) == int(t.sum())


def test_isa_names_what_this_cpu_runs() -> None:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    isa = kernels.isa()
    assert isa in kernels.ISA_NAMES
    if os.environ.get("KVLAB_KERNEL_ISA", "native") == "native" and " avx2 " in flags:
        assert isa.startswith("avx512") == (" avx512f " in flags)


def test_each_isa_builds_under_its_own_name_and_stamp(monkeypatch) -> None:  # noqa: ANN001
    """KVLAB_KERNEL_ISA: a separate library name and folder per instruction set, its flags in
    the source stamp; an unknown name is refused with the known ones."""
    monkeypatch.delenv("KVLAB_KERNEL_ISA", raising=False)
    native = (kernels._name(), kernels._cflags(), kernels._source_hash())
    monkeypatch.setenv("KVLAB_KERNEL_ISA", "avx2")
    assert kernels._name() == "kvlab_kernels_avx2" != native[0]
    assert "-mno-avx512f" in kernels._cflags() and kernels._source_hash() != native[2]
    monkeypatch.setenv("KVLAB_KERNEL_DIR", "/tmp/kvlab-isa-test")
    assert kernels._build_dir().name == "kvlab_kernels_avx2"
    monkeypatch.setenv("KVLAB_KERNEL_ISA", "sse9")
    with pytest.raises(ValueError, match="one of native, avx2, avx-vnni, scalar"):
        kernels._cflags()


# the paths this host may not run, each compiled, never run (AVX-512 without VNNI differs from
# the first only in blocks.cpp's integer dot, which is the AVX2 one this host builds anyway; AVX-
# VNNI changes only blocks.cpp)
ISA_FLAGS = {"avx512-vnni": ["-march=x86-64-v3", "-mavx512f", "-mavx512bw", "-mavx512vl",
                             "-mavx512vnni"],
             "avx-vnni": ["-march=x86-64-v3", "-mavxvnni"],
             "scalar": ["-march=x86-64"]}


@pytest.mark.slow
@pytest.mark.parametrize("isa", list(ISA_FLAGS))
def test_every_isa_path_compiles(isa: str, tmp_path: Path) -> None:
    """The sources with SIMD paths compile for every instruction set, so none can rot unseen
    (20-40 s each on 2 cores); where objdump is at hand, the VNNI builds are seen to use
    ``vpdpbusd`` and the plain one no 256-bit register. Nothing here is run."""
    from torch.utils.cpp_extension import include_paths

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    if platform.machine().lower() not in ("x86_64", "amd64"):  # the flags are x86's
        pytest.skip(f"the x86 instruction sets compile on an x86-64 host, not {platform.machine()}")
    incs = [f"-I{p}" for p in include_paths()]
    procs = []
    for src in ("blocks.cpp",) if isa == "avx-vnni" else ("blocks.cpp", "gemv.cpp", "attend.cpp",
                                                           "probe.cpp"):
        cmd = [cxx, "-std=c++20", "-O1", "-fPIC", *ISA_FLAGS[isa], *incs, "-c",
               str(Path(kernels.__file__).with_name(src)), "-o", str(tmp_path / f"{src}.o")]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for p in procs:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0, out.decode()[-3000:]
    if shutil.which("objdump"):
        asm = subprocess.run(["objdump", "-d", str(tmp_path / "blocks.cpp.o")],
                             capture_output=True, text=True, check=True).stdout
        assert ("vpdpbusd" in asm) == isa.endswith("vnni")
        assert ("%ymm" in asm) == (isa != "scalar")
