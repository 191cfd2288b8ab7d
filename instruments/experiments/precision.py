"""Precision: what lower precision does to time, memory and the answers (kind "precision").

``run(loaded, PrecisionParams, progress, should_stop)`` -> run with table ``precision``: one row
per precision (fp32, TF32 on CUDA, bf16, fp16 on CUDA) with the cached step time, the uncached
forward, weight and KV bytes and, against fp32 on the same tokens (teacher forcing), the top-1
agreement and the largest logit difference. Lower precisions run on a converted copy of the
model; the loaded model is never changed.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine import dtypes
from engine.models.config import GPTConfig, ModelConfig
from instruments import lineup
from instruments.costmodel import costs
from instruments.experiments.inputs import (
    whole,
)
from instruments.experiments.scope import measure_speedup
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, no_grad, record

if TYPE_CHECKING:
    import torch

    from engine.models.base import CausalLM


def precisions_for(device: str, dtypes: list[str]) -> list[str]:
    """Precisions offered on ``device`` given the dtypes it supports: fp32 always, TF32 on CUDA,
    bf16 and fp16 where supported (fp16 only on CUDA: CPU half matmuls are emulated)."""
    cuda = str(device).startswith("cuda")
    out = ["fp32"] + (["tf32"] if cuda else [])
    if "bfloat16" in dtypes:
        out.append("bf16")
    if cuda and "float16" in dtypes:
        out.append("fp16")
    return out


@dataclass
class PrecisionParams:
    """Time, memory and agreement with fp32 for each precision."""

    precisions: list[str] | None = None  # None: every precision the device offers
    prompt_len: int = 32
    new_tokens: int = 32
    steps: int = 8

    def check(self, cfg: GPTConfig, device: str) -> None:
        if self.prompt_len + self.new_tokens + self.steps + 3 > cfg.block_size:
            raise ValueError(f"prompt + new tokens + steps must fit in {cfg.block_size} tokens")
        whole("new tokens", self.new_tokens, 2)


Params = PrecisionParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No flags of its own: every precision the device offers."""

def from_args(args: argparse.Namespace, cfg: ModelConfig) -> PrecisionParams:
    return PrecisionParams()


def summary(run: dict[str, Any]) -> list[str]:
    return [f"{r['precision']:>5}: {r.get('step_ms', float('nan')):.2f} ms a step"
            for r in run["tables"].get("precision", [])]


MODE = lineup.with_role("reference_cached")[0]  # each precision is timed and compared on it
UNCACHED = lineup.with_role("reference_uncached")[0]  # and its speed-up over this one


@contextlib.contextmanager
def _tf32(enabled: bool) -> Iterator[None]:
    """Switch TF32 matmuls on or off for the block, restoring the previous settings."""
    import torch

    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _teacher_forced(model: CausalLM, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (n, B, vocab) in fp32 for each step when ``tokens`` (B, n) are fed back."""
    import torch

    from engine.decoders import make_decoder
    from engine.loop import decode

    dec = make_decoder(model, MODE, batch_size=prompt.size(0),
                       capacity=prompt.size(1) + tokens.size(1))
    gen = decode(dec, prompt, tokens.size(1), feed=tokens, keep_logits=True)
    return torch.stack(gen.logits)


@no_grad
def run(loaded: Loaded, params: PrecisionParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    """Time, memory and agreement with fp32 for each precision (see the module docstring)."""
    import torch

    from engine.loop import random_prompt
    from instruments.checks import gate
    from instruments.measure import device

    model = loaded.model
    cfg, dev = model.config, model.device
    params.check(cfg, str(dev))
    offered = precisions_for(str(dev), device.supported_dtypes(dev))
    wanted = list(params.precisions or offered)
    bad = [p for p in wanted if p not in offered]
    if bad:
        raise ValueError(f"precision {bad[0]!r} is not offered on {dev.type}; "
                         f"allowed: {', '.join(offered)}")
    prompt_len, new_tokens, steps = params.prompt_len, params.new_tokens, params.steps
    ref_model = model if model.dtype == torch.float32 else _converted(model, torch.float32)
    prompt = random_prompt(model, 1, prompt_len)
    tr = Tracker(progress, should_stop, len(wanted), unit="precisions")
    with _tf32(False):
        ref_tokens = gate.greedy(ref_model, MODE, prompt, new_tokens)
        ref_logits = _teacher_forced(ref_model, prompt, ref_tokens)
    stopped = False
    for prec in wanted:
        if tr.stop():
            stopped = True
            tr.note("stopped: precisions already compared are kept")
            break
        tr.emit(f"{prec}: timing and comparing with fp32")
        dtype = dtypes.to_torch("fp32" if prec == "tf32" else prec)
        m = ref_model if dtype == torch.float32 else _converted(ref_model, dtype)
        with _tf32(prec == "tf32"):
            check = gate.Gate(m).check(MODE)  # against mode 1 in the same precision
            tr.tables.setdefault("checks", []).append({**check.to_row(), "precision": prec})
            if not check.passed:
                tr.note(f"{prec}: {MODE} not timed: {check.detail}")
                tr.done += 1
                continue
            logits = _teacher_forced(m, prompt, ref_tokens)
            own = gate.greedy(m, MODE, prompt, new_tokens)
            row = measure_speedup(m, 1, prompt_len, cached_mode=MODE, uncached_mode=UNCACHED,
                                  steps=steps, repeats=2)
        diff = (logits - ref_logits).abs()
        same = (own == ref_tokens)[0]
        prefix = int(same.long().cumprod(0).sum())
        tr.work += 1
        tr.row("precision", {
            "precision": prec, "dtype": str(dtype).removeprefix("torch."),
            "tf32": prec == "tf32", "step_ms": row["cached_ms"],
            "uncached_ms": row["uncached_ms"],
            "weight_bytes": sum(p.numel() * p.element_size() for p in m.parameters()),
            "kv_bytes_per_token": costs.kv_bytes_per_token(cfg, dtype),
            "top1_agreement": float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
            "max_logit_diff": float(diff.max()), "mean_logit_diff": float(diff.mean()),
            "identical_prefix_tokens": prefix, "new_tokens": new_tokens,
        }, f"{prec}: {row['cached_ms']:.2f} ms a step")
        if m is not ref_model:
            del m
    rows = tr.tables.get("precision", [])
    return record(loaded, "precision", params, {"precision": rows,
                                                "checks": tr.tables.get("checks", [])},
                  partial=stopped, notes=tr.notes)


def _converted(model: CausalLM, dtype: torch.dtype) -> CausalLM:
    """A copy of ``model`` in ``dtype`` (the shared model itself is never changed)."""
    out = type(model).empty(model.config, model.device, dtype)
    out.load_state_dict(model.state_dict())  # copies and casts; the head stays tied to wte
    return out.eval()
