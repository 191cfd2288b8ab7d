"""What this machine's devices are, and what they deliver: facts and the one peak routine.

``describe_device(device)`` -> name, kind, memory, cores/threads, capability, listed peaks (from
``instruments.measure.specs``). ``device_available`` / ``supported_dtypes`` say what can run here.
``measure_peaks(device, dtype)`` is the one peak routine every page, the CLI and the device
check use: the achieved matmul TFLOP/s and the read bandwidth, on sizes that saturate the device
(8192-square matmuls and 2 GiB reads on a GPU), several calls per timed sample, every sample
kept. ``peaks(device, dtype)`` measures once per process and reuses the result. Importing this
module, and any call naming a CPU device, never initialises CUDA.
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

from engine import dtypes
from instruments.measure.sampler import time_call
from instruments.measure.specs import lookup_peaks


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


# ---------------------------------------------------------------------------------- the peaks
@dataclass(frozen=True)
class Peaks:
    """Rates measured on this device (not datasheet numbers); 1 GB/s = 1e9 B/s."""

    device: str
    dtype: str
    matmul_tflops: float  # median achieved rate of an n x n x n matmul
    matmul_n: int
    read_gbps: float  # the best median of the read kernels below
    read_kernel: str  # which kernel reached it: "sum" | "matrix-vector"
    copy_gbps: float  # read + write: 2 x bytes per copy
    bandwidth_bytes: int
    matmul_samples_tflops: list[float] = field(default_factory=list)
    read_samples_gbps: dict[str, list[float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def peak_sizes(device: Any, quick: bool = False) -> tuple[int, int]:
    """(matmul n, bytes read): large enough to saturate the device; ``quick`` for dry runs."""
    cuda = torch.device(device).type == "cuda"
    if quick:
        return (1024, 256 * 2**20) if cuda else (256, 16 * 2**20)
    return (8192, 2 * 2**30) if cuda else (1024, 512 * 2**20)


def _check_device(device: Any) -> torch.device:
    ok, reason = device_available(device)
    if not ok:
        raise RuntimeError(f"cannot benchmark on {device!r}: {reason}")
    return torch.device(device)


def _rates(fn: Any, work: float, dev: torch.device, min_seconds: float, repeats: int
           ) -> list[float]:
    """``work`` units per second for each timed sample of ``fn`` called back to back.

    The calls per sample are calibrated so the samples together take about ``min_seconds``:
    a single call of a fast kernel would mostly measure the clock and the launch.
    """
    one = time_call(fn, warmup=2, repeats=1, device=dev).median_ms / 1e3
    count = max(1, math.ceil(min_seconds / repeats / max(one, 1e-9)))

    def run() -> None:
        for _ in range(count):
            fn()

    timing = time_call(run, warmup=0, repeats=repeats, device=dev)
    return [work * count / (ms / 1e3) for ms in timing.samples_ms]


def _matmul_rates(dev: torch.device, tdtype: torch.dtype, n: int, min_seconds: float,
                  repeats: int) -> list[float]:
    """TFLOP/s samples of n x n x n matmuls (its operands are freed on return)."""
    a = torch.randn(n, n, device=dev).to(tdtype)
    b = torch.randn(n, n, device=dev).to(tdtype)
    out = torch.empty(n, n, device=dev, dtype=tdtype)
    return _rates(lambda: torch.mm(a, b, out=out), 2 * n**3 / 1e12, dev, min_seconds, repeats)


def read_kernels(device: Any, nbytes: int) -> tuple[dict[str, Any], torch.Tensor, int]:
    """The read kernels over one fp32 tensor of about ``nbytes``: ({name: call}, the tensor,
    its exact bytes). A read floor is the best of them (either alone can under-measure the
    bandwidth on some CPUs); ``measure_peaks`` and the peers experiment both read through here.
    """
    dev = torch.device(device)
    cols = 1024
    rows = max(1, nbytes // (4 * cols))
    src = torch.ones(rows, cols, device=dev)  # ones, not empty: every page touched before timing
    vec = torch.ones(cols, device=dev)
    return ({"sum": lambda: torch.sum(src), "matrix-vector": lambda: torch.mv(src, vec)}, src,
            rows * cols * 4)


@torch.no_grad()
def measure_peaks(device: Any = "cpu", dtype: Any = "float32", *, quick: bool = False,
                  min_seconds: float = 0.4, repeats: int = 5) -> Peaks:
    """Matmul TFLOP/s in ``dtype`` and read GB/s on ``device`` (see the module docstring).

    Read bandwidth is the best of two kernels over the same bytes, a sum and a matrix-vector
    product (what a decode step runs): either alone can under-measure it on some CPUs, and a
    floor computed from an under-measured rate would sit above a real step.
    """
    dev = _check_device(device)
    tdtype = dtypes.to_torch(dtype)
    n, nbytes = peak_sizes(dev, quick)
    mm = _matmul_rates(dev, tdtype, n, min_seconds, repeats)
    kernels, src, real = read_kernels(dev, nbytes)
    dst = torch.empty_like(src)
    gb = real / 1e9
    reads = {k: _rates(fn, gb, dev, min_seconds, repeats) for k, fn in kernels.items()}
    copy = _rates(lambda: dst.copy_(src), 2 * gb, dev, min_seconds, repeats)
    kernel = max(reads, key=lambda k: statistics.median(reads[k]))
    return Peaks(str(dev), dtypes.canonical(tdtype), statistics.median(mm), n,
                 statistics.median(reads[kernel]), kernel, statistics.median(copy), real,
                 mm, reads)


_MEASURED: dict[tuple[str, str], Peaks] = {}


def peaks(device: Any, dtype: Any, *, quick: bool = False, fresh: bool = False) -> Peaks:
    """``measure_peaks`` once per (device, dtype) in this process (the last measurement is
    reused, whatever its size); ``fresh`` measures again."""
    key = (str(torch.device(device)), dtypes.canonical(dtype))
    if fresh or key not in _MEASURED:
        _MEASURED[key] = measure_peaks(device, dtype, quick=quick)
    return _MEASURED[key]
