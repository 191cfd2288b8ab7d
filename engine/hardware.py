"""What the hardware promises (listed peaks) and what it delivers here (microbenchmarks).

`PEAKS` lists vendor-datasheet peaks per GPU: FP32 (non-tensor), dense TF32/BF16/FP16 tensor
TFLOP/s (datasheets often quote 2x "with sparsity"; these are halved back to dense) and memory
bandwidth in GB/s (1e9 B/s). `lookup_peaks` maps a device name as torch reports it to an entry.
`measure_*` time real kernels on the given device with sync, warm-up and repeats and return every
raw sample. Importing this module, and any call naming a CPU device, never initialises CUDA.
"""

from __future__ import annotations

import math
import os
import platform
import re
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from engine.timing import time_call


@dataclass(frozen=True)
class PeakSpec:
    """Listed peaks of one GPU model. None = the datasheet lists no such mode for this GPU."""

    name: str
    family: str  # token that must appear in the device name, e.g. "a100"
    variant: tuple[str, ...]  # tokens that pick this variant within the family ("sxm", "80gb")
    fp32_tflops: float
    tf32_tflops: float | None
    bf16_tflops: float | None
    fp16_tflops: float | None
    mem_bandwidth_gbps: float
    memory_gb: float
    source: str
    note: str = ""

    def peak_tflops(self, dtype: Any = "float32", allow_tf32: bool = False) -> float | None:
        """Listed peak for a dtype; fp32 matmuls use TF32 tensor cores only when allowed."""
        name = _dtype_name(dtype)
        if name == "float32":
            return self.tf32_tflops if allow_tf32 and self.tf32_tflops else self.fp32_tflops
        return {"bfloat16": self.bf16_tflops, "float16": self.fp16_tflops}.get(name)

    def ridge_flops_per_byte(self, dtype: Any = "float32", allow_tf32: bool = False) -> float:
        """Arithmetic intensity where the roofline turns: below it, bandwidth bounds a kernel."""
        peak = self.peak_tflops(dtype, allow_tf32) or self.fp32_tflops
        return peak * 1e12 / (self.mem_bandwidth_gbps * 1e9)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["variant"] = list(self.variant)
        return out


_AMPERE_DC = "NVIDIA A100 Tensor Core GPU datasheet"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet"
_GA102 = "NVIDIA Ampere GA102 GPU Architecture whitepaper (GeForce RTX 3090)"
_ADA = "NVIDIA Ada Lovelace GPU Architecture whitepaper (GeForce RTX 4090)"
_GEFORCE_NOTE = "GeForce tensor rates are with FP32 accumulate (what PyTorch uses)"

# Order matters: when a name does not say which variant it is, the first entry of the family wins.
# Columns: name, family, variant, fp32, tf32, bf16, fp16 (TFLOP/s), GB/s, memory GB, source, note.
# fmt: off
_SPECS = [
    PeakSpec("NVIDIA A40", "a40", (), 37.4, 74.8, 149.7, 149.7, 696, 48, "NVIDIA A40 datasheet"),
    PeakSpec("NVIDIA A100 40GB SXM", "a100", ("sxm", "40gb"), 19.5, 156, 312, 312, 1555, 40,
             _AMPERE_DC),
    PeakSpec("NVIDIA A100 80GB SXM", "a100", ("sxm", "80gb"), 19.5, 156, 312, 312, 2039, 80,
             _AMPERE_DC),
    PeakSpec("NVIDIA A100 40GB PCIe", "a100", ("pcie", "40gb"), 19.5, 156, 312, 312, 1555, 40,
             _AMPERE_DC),
    PeakSpec("NVIDIA A100 80GB PCIe", "a100", ("pcie", "80gb"), 19.5, 156, 312, 312, 1935, 80,
             _AMPERE_DC),
    PeakSpec("NVIDIA A10", "a10", (), 31.2, 62.5, 125, 125, 600, 24, "NVIDIA A10 datasheet"),
    PeakSpec("NVIDIA H100 SXM", "h100", ("sxm", "hbm3"), 67, 494.7, 989.4, 989.4, 3350, 80, _H100),
    PeakSpec("NVIDIA H100 PCIe", "h100", ("pcie",), 51, 378, 756, 756, 2000, 80, _H100),
    PeakSpec("NVIDIA H100 NVL", "h100", ("nvl",), 60, 417.5, 835.5, 835.5, 3900, 94, _H100),
    PeakSpec("NVIDIA H200 SXM", "h200", ("sxm",), 67, 494.7, 989.4, 989.4, 4800, 141, _H200),
    PeakSpec("NVIDIA H200 NVL", "h200", ("nvl",), 60, 417.5, 835.5, 835.5, 4800, 141, _H200),
    PeakSpec("NVIDIA L4", "l4", (), 30.3, 60, 121, 121, 300, 24, "NVIDIA L4 datasheet"),
    PeakSpec("NVIDIA L40S", "l40s", (), 91.6, 183, 362, 362, 864, 48, "NVIDIA L40S datasheet"),
    PeakSpec("NVIDIA T4", "t4", (), 8.1, None, None, 65, 320, 16, "NVIDIA T4 datasheet",
             "Turing: no TF32 or BF16 tensor cores; FP16 is mixed precision"),
    PeakSpec("NVIDIA V100 SXM2", "v100", ("sxm",), 15.7, None, None, 125, 900, 32,
             "NVIDIA V100 Tensor Core GPU datasheet", "Volta: no TF32 or BF16 tensor cores"),
    PeakSpec("NVIDIA V100 PCIe", "v100", ("pcie",), 14, None, None, 112, 900, 32,
             "NVIDIA V100 Tensor Core GPU datasheet", "Volta: no TF32 or BF16 tensor cores"),
    PeakSpec("NVIDIA GeForce RTX 3090", "3090", (), 35.6, 35.6, 71, 71, 936, 24, _GA102,
             _GEFORCE_NOTE),
    PeakSpec("NVIDIA GeForce RTX 4090", "4090", (), 82.6, 82.6, 165.2, 165.2, 1008, 24, _ADA,
             _GEFORCE_NOTE),
]
# fmt: on
PEAKS: dict[str, PeakSpec] = {spec.name: spec for spec in _SPECS}

# Tokens naming a different product that shares a family number (3090 Ti, laptop 4090, ...).
_EXCLUDE_TOKENS = {"ti", "d", "laptop", "mobile", "max", "super"}


def _tokens(name: str) -> list[str]:
    text = re.sub(r"(\d+)\s*gb\b", r"\1gb", name.lower())  # "80 GB" -> "80gb"
    return [tok for tok in re.split(r"[^a-z0-9]+", text) if tok]


def lookup_peaks(device_name: str | None) -> PeakSpec | None:
    """Listed peaks for a device name as torch reports it, or None when the GPU isn't listed.

    Matches whole tokens ("NVIDIA A100-SXM4-80GB" -> a100, sxm4, 80gb), so "A10" never matches
    "A100" and "L4" never matches "L40S"; variant tokens match as prefixes ("sxm" ~ "sxm4").
    A name that names no variant ("NVIDIA H200") gets the family's first (most common) entry.
    """
    if not device_name:
        return None
    tokens = _tokens(device_name)
    if _EXCLUDE_TOKENS.intersection(tokens):
        return None
    best: PeakSpec | None = None
    best_score = -1
    for spec in _SPECS:
        if spec.family not in tokens:
            continue
        score = sum(any(tok.startswith(v) for tok in tokens) for v in spec.variant)
        if score > best_score:  # strict: ties keep the earlier (default) entry
            best, best_score = spec, score
    return best


# ------------------------------------------------------------------------------- device facts
def _dtype_name(dtype: Any) -> str:
    name = str(dtype).lower().removeprefix("torch.")
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(
        name, name
    )


def to_torch_dtype(dtype: Any) -> torch.dtype:
    """torch dtype from a torch dtype or a name ("float32", "bf16", ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    name = _dtype_name(dtype)
    if name not in table:
        raise ValueError(f"unsupported dtype {dtype!r}; allowed: {', '.join(table)}")
    return table[name]


def device_available(device: Any) -> tuple[bool, str]:
    """(usable?, human reason). Only "cpu" and "cuda[:i]" are supported."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return False, f"{device!r} is not a device name; use 'cpu' or 'cuda[:index]'"
    if dev.type == "cpu":
        return True, "CPU is always available"
    if dev.type != "cuda":
        return False, f"device type {dev.type!r} is not supported; use 'cpu' or 'cuda'"
    if torch.version.cuda is None:
        return False, "this PyTorch build has no CUDA support (CPU-only wheel)"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU is visible (driver missing or CUDA_VISIBLE_DEVICES empty)"
    index = dev.index if dev.index is not None else 0
    count = torch.cuda.device_count()
    if index >= count:
        return False, f"cuda:{index} does not exist; {count} GPU(s) visible"
    return True, torch.cuda.get_device_name(index)


def supported_dtypes(device: Any) -> list[str]:
    """Dtypes worth offering on `device`: fp32 always; bf16 on CPU and on GPUs that support it."""
    if torch.device(device).type != "cuda":
        return ["float32", "bfloat16"]
    dtypes = ["float32"]
    if torch.cuda.is_bf16_supported():
        dtypes.append("bfloat16")
    dtypes.append("float16")
    return dtypes


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def _cpu_facts() -> dict[str, Any]:
    info = _read_text("/proc/cpuinfo") or ""
    name = None
    cores: set[tuple[str, str]] = set()
    flags: set[str] = set()
    physical = core = ""
    for line in info.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and name is None:
            name = value
        elif key == "physical id":
            physical = value
        elif key == "core id":
            core = value
            cores.add((physical, core))
        elif key == "flags" and not flags:
            flags = set(value.split())
    try:
        threads = len(os.sched_getaffinity(0))  # what this process may use, not the host total
    except (AttributeError, OSError):
        threads = os.cpu_count()
    memory = None
    meminfo = _read_text("/proc/meminfo") or ""
    match = re.search(r"MemTotal:\s+(\d+)\s*kB", meminfo)
    if match:
        memory = int(match.group(1)) * 1024
    limit = (_read_text("/sys/fs/cgroup/memory.max") or "").strip()
    if limit.isdigit() and (memory is None or int(limit) < memory):
        memory = int(limit)  # a container limit is the memory we can really use
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {
        "name": name or platform.processor() or platform.machine() or "unknown CPU",
        "kind": "cpu",
        "total_memory_bytes": memory,
        "cores": len(cores) or None,
        "threads": threads,
        "torch_threads": torch.get_num_threads(),
        "capability": " ".join(f for f in wanted if f in flags) or None,
        "multiprocessors": None,
    }


def describe_device(device: str) -> dict[str, Any]:
    """Name, kind ("cpu"/"cuda"), total memory in bytes, cores/threads and capability."""
    dev = torch.device(device)
    if dev.type == "cpu":
        facts = _cpu_facts()
    elif dev.type == "cuda":
        ok, reason = device_available(dev)
        if not ok:
            raise RuntimeError(reason)
        props = torch.cuda.get_device_properties(dev)
        facts = {
            "name": props.name,
            "kind": "cuda",
            "total_memory_bytes": int(props.total_memory),
            "cores": None,
            "threads": None,
            "torch_threads": None,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
        }
    else:
        raise ValueError(f"device type {dev.type!r} is not supported; use 'cpu' or 'cuda'")
    peaks = lookup_peaks(facts["name"]) if dev.type == "cuda" else None
    facts["device"] = str(dev)
    facts["listed_peaks"] = peaks.to_dict() if peaks else None
    return facts


# ---------------------------------------------------------------------------- microbenchmarks
@dataclass(frozen=True)
class MatmulBench:
    device: str
    dtype: str
    n: int
    matmuls_per_sample: int
    flops_per_sample: int
    samples_ms: list[float]
    samples_tflops: list[float] = field(default_factory=list)
    tf32_enabled: bool | None = None

    @property
    def median_tflops(self) -> float:
        return statistics.median(self.samples_tflops)


@dataclass(frozen=True)
class BandwidthBench:
    device: str
    nbytes: int
    read_samples_ms: list[float]
    read_samples_gbps: list[float]
    copy_samples_ms: list[float]
    copy_samples_gbps: list[float]  # counts read + write: 2 * nbytes per copy

    @property
    def read_median_gbps(self) -> float:
        return statistics.median(self.read_samples_gbps)

    @property
    def copy_median_gbps(self) -> float:
        return statistics.median(self.copy_samples_gbps)


def _check_device(device: Any) -> torch.device:
    ok, reason = device_available(device)
    if not ok:
        raise RuntimeError(f"cannot benchmark on {device!r}: {reason}")
    return torch.device(device)


def measure_matmul_tflops(
    device: Any = "cpu",
    dtype: Any = "float32",
    n: int = 512,
    min_seconds: float = 0.3,
    repeats: int = 5,
    warmup: int = 2,
) -> MatmulBench:
    """Achieved TFLOP/s of an n x n x n matmul (2 n^3 FLOPs each), several per timed sample.

    The number of matmuls per sample is calibrated so all samples together take about
    `min_seconds`; short samples would mostly measure launch and clock overhead.
    """
    dev = _check_device(device)
    tdtype = to_torch_dtype(dtype)
    a = torch.randn(n, n, device=dev).to(tdtype)
    b = torch.randn(n, n, device=dev).to(tdtype)
    out = torch.empty(n, n, device=dev, dtype=tdtype)
    one = time_call(lambda: torch.mm(a, b, out=out), warmup=warmup, repeats=1, device=dev)
    per_sample_s = max(min_seconds, 1e-6) / repeats
    count = max(1, math.ceil(per_sample_s / max(one.median_ms / 1000.0, 1e-9)))

    def run() -> None:
        for _ in range(count):
            torch.mm(a, b, out=out)

    timing = time_call(run, warmup=1, repeats=repeats, device=dev)
    flops = 2 * n**3 * count
    tf32 = bool(torch.backends.cuda.matmul.allow_tf32) if dev.type == "cuda" else None
    return MatmulBench(
        device=str(dev),
        dtype=_dtype_name(tdtype),
        n=n,
        matmuls_per_sample=count,
        flops_per_sample=flops,
        samples_ms=timing.samples_ms,
        samples_tflops=[flops / (ms / 1000.0) / 1e12 for ms in timing.samples_ms],
        tf32_enabled=tf32,
    )


def measure_read_bandwidth_gbps(
    device: Any = "cpu",
    nbytes: int = 128 * 2**20,
    repeats: int = 5,
    warmup: int = 2,
) -> BandwidthBench:
    """Memory bandwidth from summing an fp32 tensor (bytes read / s) and copying it (read+write).

    Choose `nbytes` well above the last-level cache, or the result measures the cache. 1 GB/s is
    1e9 B/s. A decode step must at least stream its weights, so `linear_weight_bytes / read rate`
    is the floor a bandwidth-bound step cannot beat.
    """
    dev = _check_device(device)
    numel = max(1, nbytes // 4)
    real_bytes = numel * 4
    src = torch.ones(numel, device=dev)  # ones, not empty: touch every page before timing
    dst = torch.empty_like(src)
    read = time_call(lambda: torch.sum(src), warmup=warmup, repeats=repeats, device=dev)
    copy = time_call(lambda: dst.copy_(src), warmup=warmup, repeats=repeats, device=dev)
    return BandwidthBench(
        device=str(dev),
        nbytes=real_bytes,
        read_samples_ms=read.samples_ms,
        read_samples_gbps=[real_bytes / (ms / 1000.0) / 1e9 for ms in read.samples_ms],
        copy_samples_ms=copy.samples_ms,
        copy_samples_gbps=[2 * real_bytes / (ms / 1000.0) / 1e9 for ms in copy.samples_ms],
    )
