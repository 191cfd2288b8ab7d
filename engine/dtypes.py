"""The one dtype parser: names in, canonical names or torch dtypes out.

``canonical("bf16") -> "bfloat16"``; ``to_torch("fp16") -> torch.float16``; ``itemsize("float32")
-> 4``. Names are what the sidebar, the CLI and results files carry; anything else raises a
one-line ValueError saying what is allowed. Importing this module does not import torch (the
dashboard's server process never does): only ``to_torch`` needs it.
"""

from __future__ import annotations

from typing import Any

# The dtypes a model can be loaded in, with their element sizes (int8 and float64 are sizes only).
MODEL_DTYPES = ("float32", "bfloat16", "float16")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int8": 1}
ALIASES = {
    "fp32": "float32", "float": "float32", "f32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16", "half": "float16", "f16": "float16",
    "fp64": "float64", "double": "float64",
}


def canonical(dtype: Any) -> str:
    """'float32' | 'bfloat16' | 'float16' | 'float64' | 'int8' from a name or a torch dtype."""
    name = str(dtype).strip().lower().removeprefix("torch.")
    name = ALIASES.get(name, name)
    if name not in ITEMSIZE:
        allowed = ", ".join(sorted(set(ITEMSIZE) | set(ALIASES)))
        raise ValueError(f"unknown dtype {dtype!r}; allowed: {allowed}")
    return name


def model_dtype(dtype: Any) -> str:
    """A canonical name a model can be loaded in (float32, bfloat16 or float16)."""
    name = canonical(dtype)
    if name not in MODEL_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; allowed: {', '.join(MODEL_DTYPES)}")
    return name


def itemsize(dtype: Any) -> int:
    """Bytes per element."""
    return ITEMSIZE[canonical(dtype)]


def to_torch(dtype: Any):  # -> torch.dtype
    """The torch dtype for a model dtype name (or a torch dtype, checked)."""
    import torch

    return getattr(torch, model_dtype(dtype))
