"""What every family's weight loading does around its own weights: ``load_preset``.

  load_preset(preset, cfg, model_class, read, weights, device=..., dtype=..., mask=..., seed=...)
      -> ModelState
      ``preset`` (an ``engine.families.Preset``) of shapes ``cfg``, built as ``model_class``,
      with ``weights``:
        a test shape   random weights only (drawn with std ``TEST_STD``, so that a tiny random
                       model's greedy stream is lively enough for a wrong cache to change the
                       tokens)
        "random"       seeded random weights of the preset's shapes (the family's
                       ``init_weights``)
        anything else  the family's own reader: ``read(weights, device=, dtype=, mask=) ->
                       (model, label, file)`` (GPT-2: the hub, a local folder; the Llama
                       family: a GGUF file, which ``file`` names); when it raises
                       ``WeightsError`` and ``weights`` is "auto", random weights instead, the
                       error kept as the reason
      in a ``ModelState`` whose ``provenance`` says where the weights came from (shown wherever
      the model is), the model in eval mode without gradients.

``WeightsError``: weights could not be loaded; the message says why and what to do instead
(``check_fits``: a model larger than the memory its device has available is refused before
anything is allocated).
``engine.families.load`` is the one entry point: it looks the preset, its config, its model
class and its family's reader up in the family table and hands them here (this module names
no family and imports nothing above ``engine.models``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from .. import dtypes
from .base import CausalLM
from .state import ModelState, Provenance

TEST_STD = 0.2  # a test shape's random weights: peaked, varied greedy streams


class WeightsError(RuntimeError):
    """Weights could not be loaded; the message says why and what to do instead."""


def available_bytes(device: torch.device | str) -> int:
    """Memory ``device`` has free now: a GPU's free bytes, or the host's available memory."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_fits(model_class: type[CausalLM], cfg: Any, device: torch.device | str,
               dtype: torch.dtype, what: str) -> None:
    """WeightsError when a ``model_class`` of ``cfg`` in ``dtype`` cannot fit the memory
    ``device`` has available now (counted on the meta device: nothing is allocated)."""
    with torch.device("meta"):
        numel = sum(p.numel() for p in model_class(cfg).parameters())
    nbytes = numel * dtype.itemsize
    free = available_bytes(device)
    if nbytes > free:
        raise WeightsError(f"{what} needs {nbytes / 2**30:.2f} GiB of weights; {device} has "
                           f"{free / 2**30:.2f} GiB available; allowed: a checkpoint that fits "
                           "(a smaller model, or a 2-byte dtype), or plan it without loading "
                           "(the planner reads its config alone)")


# read(weights, device=, dtype=, mask=) -> (model, label, file): a family's own weights, and the
# GGUF file they were read from (None: none)
Real = Callable[..., tuple[CausalLM, str, str | None]]


def load_preset(
    preset: Any,
    cfg: Any,
    model_class: type[CausalLM],
    read: Real,
    weights: str,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    seed: int = 0,
    checkpoint: str | None = None,
) -> ModelState:
    """``preset`` of shapes ``cfg`` with the asked-for weights (see the module docstring);
    ``checkpoint``: the path it was read as (its tokenizer is read from there)."""
    torch_dtype = dtypes.to_torch(dtype)
    check_fits(model_class, cfg, device, torch_dtype, repr(preset.name))  # before building

    def random(std: float = 0.02) -> CausalLM:
        return model_class.random(cfg, seed=seed, device=device, dtype=torch_dtype, std=std)

    fallback = file = None
    if preset.test:
        if weights not in ("random", "auto"):
            raise ValueError(f"{preset.name!r} is a test shape with random weights only; "
                             "choose random weights")
        model, label = random(TEST_STD), f"random (seed {seed}, test shape)"
    elif weights == "random":
        model, label = random(), f"random (seed {seed})"
    else:
        try:
            model, label, file = read(weights, device=device, dtype=torch_dtype, mask=cfg.mask)
        except WeightsError as exc:
            if weights != "auto":
                raise
            fallback = str(exc)
            model, label = random(), f"random (seed {seed})"
    return ModelState(model.eval().requires_grad_(False), Provenance(label, fallback, file,
                                                                   checkpoint))
