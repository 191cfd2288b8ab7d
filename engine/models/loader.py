"""What every family's weight loader does around its own weights: ``load_preset``.

  load_preset(name, weights, family, real, device=..., dtype=..., mask=..., seed=...)
      -> ModelState
      the preset ``name`` (ValueError naming the presets; another family's preset is refused),
      with ``weights``:
        a test shape   random weights only (drawn with std ``TEST_STD``, so that a tiny random
                       model's greedy stream is lively enough for a wrong cache to change the
                       tokens)
        "random"       seeded random weights of the preset's shapes (the family's
                       ``init_weights``)
        anything else  the family's own: ``real(weights, device=, dtype=, mask=) -> (model,
                       label)`` (GPT-2: the hub, a local folder; the Llama family: a GGUF
                       file); when it raises
                       ``WeightsError`` and ``weights`` is "auto", random weights instead, the
                       error kept as the reason
      in a ``ModelState`` whose ``provenance`` says where the weights came from (shown wherever
      the model is), the model in eval mode without gradients.

``WeightsError``: weights could not be loaded; the message says why and what to do instead.
Each family's loader (``engine.models.gpt2.weights.load_gpt2``,
``engine.models.llama.weights.load_llama``; ``engine.families.load`` is the one entry point) is
this with its ``real``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import dtypes, families
from .base import CausalLM
from .state import ModelState, Provenance

TEST_STD = 0.2  # a test shape's random weights: peaked, varied greedy streams


class WeightsError(RuntimeError):
    """Weights could not be loaded; the message says why and what to do instead."""


# real(weights, device=, dtype=, mask=) -> (model, label): a family's own weights
Real = Callable[..., tuple[CausalLM, str]]


def load_preset(
    name: str,
    weights: str,
    family: str,
    real: Real,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    mask: str = "none",
    seed: int = 0,
) -> ModelState:
    """Preset ``name`` of ``family`` with the asked-for weights (see the module docstring)."""
    torch_dtype = dtypes.to_torch(dtype)
    preset = families.preset(name)  # ValueError naming the presets
    if preset.family != family:
        raise ValueError(f"{name!r} is not a {families.family_of(family).title} preset; load it "
                         "with engine.families.load")
    cfg = families.config(name, mask=mask)

    def random(std: float = 0.02) -> CausalLM:
        return families.model_class(cfg).random(cfg, seed=seed, device=device,
                                                dtype=torch_dtype, std=std)

    fallback = None
    if preset.test:
        if weights not in ("random", "auto"):
            raise ValueError(f"{name!r} is a test shape with random weights only; "
                             "choose random weights")
        model, label = random(TEST_STD), f"random (seed {seed}, test shape)"
    elif weights == "random":
        model, label = random(), f"random (seed {seed})"
    else:
        try:
            model, label = real(weights, device=device, dtype=torch_dtype, mask=mask)
        except WeightsError as exc:
            if weights != "auto":
                raise
            fallback = str(exc)
            model, label = random(), f"random (seed {seed})"
    return ModelState(model.eval().requires_grad_(False), Provenance(label, fallback))
