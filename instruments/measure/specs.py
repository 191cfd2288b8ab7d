"""What the hardware promises: datasheet peaks per GPU model. Torch-free; nothing is measured.

`PEAKS` lists vendor-datasheet peaks per GPU: FP32 (non-tensor), dense TF32/BF16/FP16 tensor
TFLOP/s (datasheets often quote 2x "with sparsity"; these are halved back to dense) and memory
bandwidth in GB/s (1e9 B/s). `lookup_peaks` maps a device name as torch reports it to an entry.
What the device delivers here is measured by `instruments.measure.device.measure_peaks`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from engine import dtypes


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
        name = dtypes.canonical(dtype)
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
