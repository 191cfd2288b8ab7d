"""The field's numbers: percentiles and their minimum sample counts, MBU/MFU's bytes and shares,
and the energy meter (RAPL on a fake powercap tree, NVML's absence said, never a traceback)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import families
from instruments.costmodel import costs
from instruments.experiments.utilization import add_shares, kv_storage, listed_peaks
from instruments.measure.energy import Energy, EnergyMeter, rapl_zones, row_fields
from instruments.store import stats

GPT2 = families.config("gpt2")


# ------------------------------------------------------------------------------ percentiles
@pytest.mark.parametrize("n, given", [
    (1, {50}), (3, {50}), (9, {50}), (10, {50, 90}), (99, {50, 90}), (100, {50, 90, 99}),
])
def test_a_percentile_needs_its_minimum_count_of_samples(n: int, given: set[int]) -> None:
    xs = list(np.random.default_rng(n).normal(10, 1, n))
    got = {q for q in stats.PERCENTILES if stats.percentile(xs, q) is not None}
    assert got == given
    fields = stats.percentile_fields(xs)
    assert fields["samples_n"] == n
    assert (fields["p99_ms"] is None) == (n < 100) and (fields["p90_ms"] is None) == (n < 10)
    if given != set(stats.PERCENTILES):
        assert "p99 needs at least 100 samples" in fields["percentiles_note"]
        assert f"{n} kept" in fields["percentiles_note"]
    else:
        assert fields["percentiles_note"] is None


def test_a_p99_of_three_samples_is_not_a_p99() -> None:
    assert stats.percentile([1.0, 2.0, 3.0], 99) is None
    assert stats.why_missing(3, 99) == "p99 needs at least 100 samples, 3 kept"
    assert stats.percentile([1.0, 2.0, 3.0], 50) == 2.0


@pytest.mark.parametrize("q", [50, 90, 99])
def test_percentiles_match_numpys_linear_method(q: int) -> None:
    xs = list(np.random.default_rng(q).exponential(3.0, 250))
    assert stats.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_missing_and_odd_samples_are_left_out() -> None:
    assert stats.percentile([], 50) is None and stats.percentile(None, 50) is None
    assert stats.percentile([2.0, None, float("nan"), "x", 4.0], 50) == 3.0
    assert stats.mean_sd([5.0]) == (5.0, None)
    mean, sd = stats.mean_sd([1.0, 2.0, 3.0])
    assert mean == 2.0 and sd == pytest.approx(1.0)
    assert stats.relative_spread([9.0, 10.0, 11.0]) == pytest.approx(0.2)
    assert stats.relative_spread([4.0]) == 0.0 and stats.relative_spread([]) is None


def test_a_tooltip_says_how_many_samples_and_which_percentiles_are_missing() -> None:
    words = stats.describe([1.0, 2.0, 3.0])
    assert words.startswith("3 samples · median 2 ms · spread 2 ms · p50 2 ms")
    assert "p90, p99: too few samples (p90 needs 10)" in words
    many = stats.describe(list(range(1, 101)), sep="<br>")
    assert "p99 " in many and "too few" not in many and "<br>" in many


# ------------------------------------------------------------------------------- MBU / MFU
def test_the_bytes_a_step_reads_are_the_weights_once_and_the_kv_it_attends_to() -> None:
    weights = costs.linear_weight_bytes(GPT2, "float32")
    assert weights == 494_128_128  # the tied output projection once
    per_token = costs.kv_bytes_per_token(GPT2, "float32")
    assert costs.step_read_bytes(GPT2, "float32", 1000) == weights + 1000 * per_token
    assert costs.step_read_bytes(GPT2, "float32", 10, batch_size=4, keys=1024) == \
        weights + 4 * 1024 * per_token
    int8 = costs.step_read_bytes(GPT2, "float32", 1000, kv_storage="int8")
    assert int8 == weights + 1000 * (18_432 + 1_152)  # int8 values, fp32 scale per head
    assert costs.step_read_bytes(GPT2, "float32", 1, storage="bfloat16") == \
        weights // 2 + per_token
    assert costs.step_read_bytes(GPT2, "float32", 1, storage="int8") == \
        costs.linear_weight_bytes(GPT2, "float32", "int8") + per_token
    assert kv_storage("int8_kv") == "int8" and kv_storage("concat") is None


def test_mbu_and_mfu_are_shares_of_the_peaks() -> None:
    rows = [{"latency_ms": 10.0, "flops": 2e9, "read_bytes": 5e8},
            {"latency_ms": None, "flops": 2e9, "read_bytes": 5e8}]
    add_shares(rows, {"read_gbps": 100.0, "matmul_tflops": 1.0}, (200.0, None))
    assert rows[0]["mbu"] == pytest.approx(0.5)  # 5e8 B / 10 ms = 50 GB/s of 100
    assert rows[0]["mfu"] == pytest.approx(0.2)  # 2e9 / 10 ms = 0.2 TFLOP/s of 1
    assert rows[0]["mbu_listed"] == pytest.approx(0.25) and rows[0]["mfu_listed"] is None
    assert rows[1]["mbu"] is None and rows[1]["mfu"] is None
    add_shares(rows, None)
    assert rows[0]["mbu"] is None


def test_listed_peaks_follow_the_dtype_and_tf32() -> None:
    assert listed_peaks("NVIDIA H100 80GB HBM3", "float32", tf32=False) == (3350, 67)
    assert listed_peaks("NVIDIA H100 80GB HBM3", "float32", tf32=True) == (3350, 494.7)
    assert listed_peaks("NVIDIA H100 80GB HBM3", "bfloat16", tf32=False) == (3350, 989.4)
    assert listed_peaks("AMD EPYC", "float32", tf32=False) == (None, None)
    assert listed_peaks("NVIDIA H100 80GB HBM3", "float32", False, "cpu") == (None, None)


# ---------------------------------------------------------------------------------- energy
def _zone(root: Path, name: str, label: str | None, uj: int, wrap: int = 10_000_000) -> Path:
    zone = root / name
    zone.mkdir(parents=True)
    if label is not None:
        (zone / "name").write_text(label + "\n")
    (zone / "energy_uj").write_text(f"{uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{wrap}\n")
    return zone / "energy_uj"


def test_rapl_counts_the_packages_once_and_undoes_the_wrap(tmp_path: Path) -> None:
    pkg0 = _zone(tmp_path, "intel-rapl:0", "package-0", 9_000_000)
    pkg1 = _zone(tmp_path, "intel-rapl:1", "package-1", 1_000_000)
    _zone(tmp_path, "intel-rapl:0:0", "core", 5)  # a part of package 0: not counted again
    _zone(tmp_path, "intel-rapl:2", "psys", 7)  # the platform: overlaps the packages
    zones, why = rapl_zones(tmp_path)
    assert [p.parent.name for p, _ in zones] == ["intel-rapl:0", "intel-rapl:1"] and not why
    clock = iter([0.0, 2.0])
    meter = EnergyMeter.for_device("cpu", powercap=tmp_path)
    meter._clock = lambda: next(clock)
    assert meter.available and "RAPL" in meter.source
    meter.start()
    pkg0.write_text("1000000\n")  # wrapped at 10 J: 2 J used
    pkg1.write_text("4000000\n")  # 3 J
    got = meter.stop()
    assert got.joules == pytest.approx(5.0) and got.seconds == 2.0 and got.watts == 2.5
    fields = row_fields(got, 10)
    assert fields["joules_per_token"] == pytest.approx(0.5) and fields["energy_note"] is None
    unnamed = tmp_path / "unnamed"  # zones that do not say what they are: top level only
    _zone(unnamed, "intel-rapl:0", None, 1)
    _zone(unnamed, "intel-rapl:0:0", None, 1)
    assert [p.parent.name for p, _ in rapl_zones(unnamed)[0]] == ["intel-rapl:0"]


def test_no_counter_is_a_reason_not_a_traceback(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    meter = EnergyMeter.for_device("cpu", powercap=tmp_path / "absent")
    meter.start()
    got = meter.stop()
    assert got.joules is None and got.why.startswith("not available on this device: no ")
    assert row_fields(got, 10)["joules_per_token"] is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # as if nvidia-ml-py were not installed
    gpu = EnergyMeter.for_device("cuda")
    assert not gpu.available and "pip install nvidia-ml-py" in gpu.why
    assert (Energy(1.0, 1.0) + Energy(None, 1.0, why="gone")).joules is None


def test_this_machine_says_what_it_offers() -> None:
    meter = EnergyMeter.for_device("cpu")
    assert meter.available or meter.why.startswith("not available on this device: ")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nvml_counts_the_energy_of_gpu_work() -> None:
    meter = EnergyMeter.for_device("cuda")
    if not meter.available:  # nvidia-ml-py missing, or a GPU older than Volta: said, not raised
        assert meter.why.startswith("not available on this device: ")
        pytest.skip(meter.why)
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    meter.start()
    end = time.perf_counter() + 1.0
    while time.perf_counter() < end:
        a = a @ a
        a /= a.norm()
    torch.cuda.synchronize()
    got = meter.stop()
    assert got.joules is not None and got.joules > 0
    assert 5 < got.watts < 2000, got  # a busy GPU draws tens to hundreds of watts
