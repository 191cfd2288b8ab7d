"""Listed peaks by device name, device facts, and the one peak routine on the CPU."""

from __future__ import annotations

import pytest
import torch

from instruments.measure import device as hardware
from instruments.measure.specs import PEAKS, lookup_peaks


@pytest.mark.parametrize(
    "device_name, expected",
    [
        ("NVIDIA A40", "NVIDIA A40"),
        ("NVIDIA H200", "NVIDIA H200 SXM"),
        ("NVIDIA H200 NVL", "NVIDIA H200 NVL"),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB SXM"),
        ("NVIDIA A100-SXM4-40GB", "NVIDIA A100 40GB SXM"),
        ("NVIDIA A100-PCIE-40GB", "NVIDIA A100 40GB PCIe"),
        ("NVIDIA A100 80GB PCIe", "NVIDIA A100 80GB PCIe"),
        ("a100 80 gb pcie", "NVIDIA A100 80GB PCIe"),
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),
        ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"),
        ("NVIDIA L4", "NVIDIA L4"),
        ("NVIDIA L40S", "NVIDIA L40S"),
        ("NVIDIA A10", "NVIDIA A10"),
        ("Tesla T4", "NVIDIA T4"),
        ("NVIDIA GeForce RTX 3090", "NVIDIA GeForce RTX 3090"),
        ("NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090"),
    ],
)
def test_lookup_by_device_name_spellings(device_name, expected):
    spec = lookup_peaks(device_name)
    assert spec is not None and spec.name == expected


@pytest.mark.parametrize(
    "device_name",
    ["NVIDIA GeForce RTX 3090 Ti", "NVIDIA A10G", "AMD EPYC 9R14", "", None, "NVIDIA B200"],
)
def test_unlisted_or_different_products_are_not_guessed(device_name):
    assert lookup_peaks(device_name) is None


def test_listed_numbers_and_sources():
    a40 = lookup_peaks("NVIDIA A40")
    assert (a40.fp32_tflops, a40.mem_bandwidth_gbps) == (37.4, 696)
    h200 = lookup_peaks("NVIDIA H200")
    assert (h200.fp32_tflops, h200.mem_bandwidth_gbps) == (67, 4800)
    assert h200.peak_tflops("bfloat16") == pytest.approx(989, abs=1)
    assert h200.peak_tflops(torch.float32) == 67
    assert h200.peak_tflops("float32", allow_tf32=True) == h200.tf32_tflops
    assert lookup_peaks("Tesla T4").peak_tflops("bfloat16") is None
    # Ridge point = peak FLOP/s over bandwidth: A40 fp32 ~ 37.4e12 / 696e9 ~ 54 FLOP/B.
    assert a40.ridge_flops_per_byte() == pytest.approx(53.7, abs=0.1)
    for spec in PEAKS.values():
        assert spec.source and spec.fp32_tflops > 0 and spec.mem_bandwidth_gbps > 0
        assert lookup_peaks(spec.name) is spec  # each entry's own name finds itself


def test_describe_cpu():
    facts = hardware.describe_device("cpu")
    assert facts["kind"] == "cpu" and isinstance(facts["name"], str) and facts["name"]
    assert facts["threads"] is None or facts["threads"] >= 1
    assert facts["total_memory_bytes"] is None or facts["total_memory_bytes"] > 2**20
    assert facts["listed_peaks"] is None


def test_device_availability_and_dtypes_on_cpu():
    assert hardware.device_available("cpu") == (True, "CPU is always available")
    ok, reason = hardware.device_available("not-a-device")
    assert not ok and "not a device name" in reason
    ok, reason = hardware.device_available("cuda:0")
    assert ok == torch.cuda.is_available() and reason
    assert hardware.supported_dtypes("cpu")[0] == "float32"


def test_peak_routine_on_a_cpu_keeps_every_sample():
    p = hardware.measure_peaks("cpu", "float32", quick=True, min_seconds=0.05, repeats=3)
    assert p.matmul_n == 256 and len(p.matmul_samples_tflops) == 3 and p.matmul_tflops > 0
    assert set(p.read_samples_gbps) == {"sum", "matrix-vector"}
    assert all(len(v) == 3 and min(v) > 0 for v in p.read_samples_gbps.values())
    # The read rate is the better of the two kernels, not one of them by fiat.
    medians = {k: sorted(v)[1] for k, v in p.read_samples_gbps.items()}
    assert p.read_gbps == pytest.approx(max(medians.values()))
    assert p.read_kernel == max(medians, key=medians.get) and p.copy_gbps > 0
    assert p.bandwidth_bytes == 16 * 2**20


def test_peak_sizes_saturate_a_large_gpu():
    assert hardware.peak_sizes("cpu") == (1024, 512 * 2**20)
    n, nbytes = hardware.peak_sizes("cuda")  # sizes only: no GPU needed to ask
    assert n >= 8192 and nbytes >= 2 * 2**30


def test_peaks_are_measured_once_per_process(monkeypatch):
    calls = []
    monkeypatch.setattr(hardware, "_MEASURED", {})
    monkeypatch.setattr(hardware, "measure_peaks",
                        lambda d, dt, quick=False: calls.append(dt) or f"peaks {len(calls)}")
    assert hardware.peaks("cpu", "fp32") == hardware.peaks("cpu", "float32") == "peaks 1"
    assert hardware.peaks("cpu", "float32", fresh=True) == "peaks 2"
    assert hardware.peaks("cpu", "bfloat16") == "peaks 3"


def test_benchmark_on_missing_device_raises_clearly():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="cannot benchmark"):
        hardware.measure_peaks("cuda", quick=True)


def test_cpu_use_never_initialises_cuda():
    """In a fresh interpreter: on a GPU machine other tests in this one may have used CUDA."""
    import subprocess
    import sys

    code = ("import torch; from instruments.measure import device as d; d.describe_device('cpu'); "
            "d.supported_dtypes('cpu'); d.measure_peaks('cpu', quick=True, min_seconds=0.001, "
            "repeats=1); print(torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
