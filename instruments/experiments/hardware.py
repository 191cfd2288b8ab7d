"""Hardware: what this device is and what it delivers (kind "hardware").

``run(loaded, HardwareParams, progress, should_stop)`` -> run with tables ``device`` (facts),
``listed_peaks`` (the datasheet's, when the GPU is listed), ``peaks`` (one row per dtype: the
measured matmul TFLOP/s, read and copy GB/s, every sample) and ``floor`` (the model's Linear
weights over the measured read bandwidth: the time a step that streams them cannot beat).
The peaks are measured afresh and kept for the rest of the measuring process's life, so every
later experiment's run carries these numbers.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.models.config import GPTConfig, ModelConfig
from instruments.costmodel import costs
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, record

if TYPE_CHECKING:
    pass


@dataclass
class HardwareParams:
    """Device facts and measured peaks (matmul in each dtype, read and copy bandwidth)."""
    dtypes: list[str] = field(default_factory=list)  # empty: the model's dtype
    quick: bool = False  # small sizes (dry runs and tests)

    def check(self, cfg: GPTConfig, device: str) -> None:
        from engine import dtypes

        for name in self.dtypes:
            dtypes.model_dtype(name)


Params = HardwareParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No flags of its own: the model's dtype on a CPU, every dtype on a GPU."""


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> HardwareParams:
    from instruments import lineup

    cuda = str(args.device).startswith("cuda")
    return HardwareParams(["float32", "bfloat16", "float16"] if cuda else [],
                          quick=lineup.preset(args.model).test)


def summary(run: dict[str, Any]) -> list[str]:
    tables, meta = run["tables"], run["meta"]
    lines = [f"{meta['device_name']} {r['dtype']}: matmul {r['matmul_tflops']:.3f} TFLOP/s "
             f"(n={r['matmul_n']}), read {r['read_gbps']:.1f} GB/s ({r['read_kernel']})"
             for r in tables.get("peaks", [])]
    lines += [f"a step that streams the {r['linear_weight_bytes'] / 1e6:.1f} MB of Linear "
              f"weights cannot beat {r['floor_ms']:.2f} ms here" for r in tables.get("floor", [])]
    return lines



def run(loaded: Loaded, params: HardwareParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    from instruments.measure import device

    model = loaded.model
    dev = str(model.device)
    params.check(model.config, dev)
    facts = device.describe_device(dev)
    listed = facts.pop("listed_peaks")
    dtypes = params.dtypes or [loaded.spec.dtype]
    tr = Tracker(progress, should_stop, len(dtypes), unit="dtypes")
    rows = []
    for dt in dtypes:
        if tr.stop():
            tr.note("stopped: the dtypes measured are kept")
            break
        tr.emit(f"{dt}: a matmul, then reading and copying memory")
        p = device.peaks(dev, dt, quick=params.quick, fresh=True)
        tr.work += 1
        tr.row("peaks", p.to_dict(), f"{dt}: {p.matmul_tflops:.3g} TFLOP/s, "
               f"{p.read_gbps:.1f} GB/s read")
        rows.append(p.to_dict())
    own = next((r for r in rows if r["dtype"] == loaded.spec.dtype), rows[0] if rows else None)
    weights_b = costs.linear_weight_bytes(model.config, model.dtype)
    floor = [] if own is None else [{"linear_weight_bytes": weights_b,
                                     "read_gbps": own["read_gbps"],
                                     "floor_ms": weights_b / (own["read_gbps"] * 1e9) * 1e3}]
    tables = {"device": [facts], "listed_peaks": [listed] if listed else [], "peaks": rows,
              "floor": floor}
    return record(loaded, "hardware", params, tables, partial=len(rows) < len(dtypes),
                  notes=tr.notes, measured_peaks=own)
