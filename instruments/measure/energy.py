"""Energy around timed work: the device's own energy counter, or a stated reason why there is none.

``EnergyMeter.for_device(device)`` picks the counter this machine offers:
  CUDA  NVML's total-energy counter of the GPU (``nvmlDeviceGetTotalEnergyConsumption``, mJ since
        the driver loaded; Volta and newer), through ``pynvml`` (the ``nvidia-ml-py`` package),
        the GPU found the way torch finds it (``CUDA_VISIBLE_DEVICES`` respected)
  CPU   the RAPL powercap counters of the CPU packages, ``/sys/class/powercap/*/energy_uj``
        (top-level zones only: their sub-zones are parts of them), where readable. They count
        the whole package: other processes' work is in them too.
  else  none: ``meter.why`` says "not available on this device: ..." and why
``meter.start()`` then ``meter.stop() -> Energy`` (joules, seconds, watts) brackets the work; a
caller that brackets several pieces adds them up (``Energy.__add__``). With no counter every
reading is ``joules=None`` with the reason, so a row says why its column is empty. The counters
update every few to a hundred milliseconds: energy is meaningful over whole generations or many
samples, never over one short step. ``row_fields(energy, tokens)`` is what a row carries:
``energy_j``, ``joules_per_token``, ``avg_watts``, ``energy_source``, ``energy_note``.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POWERCAP = Path("/sys/class/powercap")
INSTALL = "pip install nvidia-ml-py"
_TOP_ZONE = re.compile(r"^[a-z-]+rapl:\d+$")  # "intel-rapl:0", not its sub-zone "intel-rapl:0:0"


@dataclass(frozen=True)
class Energy:
    """Energy over some seconds of work; ``joules`` None (with ``why``) when not measurable."""

    joules: float | None
    seconds: float
    source: str | None = None
    why: str | None = None

    @property
    def watts(self) -> float | None:
        return self.joules / self.seconds if self.joules is not None and self.seconds > 0 else None

    def __add__(self, other: Energy) -> Energy:
        joules = None if self.joules is None or other.joules is None else self.joules + other.joules
        return Energy(joules, self.seconds + other.seconds, self.source or other.source,
                      self.why or other.why)


NOTHING = Energy(0.0, 0.0)  # the start of a sum


class _Rapl:
    """The CPU packages' RAPL counters (µJ), summed, with each counter's wrap-around undone."""

    def __init__(self, zones: list[tuple[Path, int]]) -> None:
        self.zones = zones  # (energy_uj file, max_energy_range_uj)

    def read_j(self) -> list[int]:
        return [int(path.read_text().strip()) for path, _ in self.zones]

    def joules(self, before: list[int], after: list[int]) -> float:
        total = 0
        for (_, wrap), a, b in zip(self.zones, before, after, strict=True):
            total += b - a if b >= a else b + wrap - a
        return total / 1e6


def rapl_zones(root: Path = POWERCAP) -> tuple[list[tuple[Path, int]], str]:
    """The readable top-level RAPL zones under ``root`` (packages first), or why there are none."""
    if not root.is_dir():
        return [], f"no {root} (this machine or container exposes no RAPL powercap counters)"
    zones, unreadable = [], []
    for zone in sorted(root.iterdir()):
        energy = zone / "energy_uj"
        if not _TOP_ZONE.match(zone.name) or not energy.exists():
            continue
        try:
            int(energy.read_text().strip())
            wrap = int((zone / "max_energy_range_uj").read_text().strip())
        except (OSError, ValueError) as exc:
            unreadable.append(f"{energy}: {getattr(exc, 'strerror', None) or exc}")
            continue
        name = (zone / "name").read_text().strip() if (zone / "name").exists() else zone.name
        zones.append((energy, wrap, name))
    packages = [z for z in zones if z[2].startswith("package")]
    chosen = packages or [z for z in zones if z[2] != "psys"] or zones  # psys overlaps packages
    if chosen:
        return [(path, wrap) for path, wrap, _ in chosen], ""
    if unreadable:
        return [], f"RAPL counters are not readable here ({unreadable[0]})"
    return [], f"no RAPL energy counter under {root}"


class _Nvml:
    """The GPU's NVML total-energy counter (mJ)."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle = nvml, handle

    def read_j(self) -> int:
        return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))

    def joules(self, before: int, after: int) -> float:
        return (after - before) / 1e3


def _nvml_counter(device: Any) -> tuple[_Nvml | None, str]:
    try:
        import pynvml  # the nvidia-ml-py package
    except ImportError:
        return None, f"pynvml is not installed (install with: {INSTALL})"
    try:
        import torch

        pynvml.nvmlInit()
        getter = getattr(torch.cuda, "_get_nvml_device_index", None)  # CUDA_VISIBLE_DEVICES
        index = getter(torch.device(device)) if getter else (torch.device(device).index or 0)
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        counter = _Nvml(pynvml, handle)
        counter.read_j()  # refuses on GPUs older than Volta
    except Exception as exc:  # NVMLError and friends: any failure is "no counter", said why
        return None, f"NVML has no energy counter for {device} ({type(exc).__name__}: {exc})"
    return counter, ""


class EnergyMeter:
    """Brackets work with the device's energy counter (see the module docstring)."""

    def __init__(self, counter: Any, source: str | None, why: str | None,
                 clock: Any = time.perf_counter) -> None:
        self.counter, self.source, self.why, self._clock = counter, source, why, clock
        self._start: Any = None
        self._start_s = 0.0

    @property
    def available(self) -> bool:
        return self.counter is not None

    @classmethod
    def for_device(cls, device: Any, powercap: Path = POWERCAP) -> EnergyMeter:
        kind = str(device).split(":")[0]
        if kind == "cuda":
            counter, why = _nvml_counter(device)
            return cls(counter, "NVML GPU energy counter" if counter else None,
                       None if counter else f"not available on this device: {why}")
        if kind == "cpu":
            zones, why = rapl_zones(powercap)
            if zones:
                return cls(_Rapl(zones), "RAPL CPU package counters (whole package)", None)
            return cls(None, None, f"not available on this device: {why}")
        return cls(None, None, f"not available on this device: no energy counter for {device}")

    def start(self) -> None:
        self._start_s = self._clock()
        self._start = None
        if self.counter is not None:
            try:
                self._start = self.counter.read_j()
            except (OSError, ValueError) as exc:  # a counter that stopped answering
                self.why = f"not available on this device: the counter failed ({exc})"
                self.counter = None

    def stop(self) -> Energy:
        seconds = self._clock() - self._start_s
        if self.counter is None or self._start is None:
            return Energy(None, seconds, self.source, self.why)
        try:
            after = self.counter.read_j()
        except (OSError, ValueError) as exc:
            return Energy(None, seconds, self.source, f"the counter failed ({exc})")
        return Energy(self.counter.joules(self._start, after), seconds, self.source)

    @contextlib.contextmanager
    def measuring(self) -> Any:
        """``with meter.measuring() as got:`` ... ``got[0]`` is the ``Energy`` afterwards."""
        got: list[Energy] = []
        self.start()
        try:
            yield got
        finally:
            got.append(self.stop())


def row_fields(energy: Energy | None, tokens: float) -> dict[str, Any]:
    """What a row carries about the energy of producing ``tokens`` tokens."""
    if energy is None:
        return {"energy_j": None, "joules_per_token": None, "avg_watts": None,
                "energy_source": None, "energy_note": "not measured"}
    j = energy.joules
    return {"energy_j": j, "joules_per_token": j / tokens if j is not None and tokens else None,
            "avg_watts": energy.watts, "energy_source": energy.source,
            "energy_note": energy.why}
