"""Scope: does the cached-vs-uncached speedup move toward the FLOP ratio as work per launch grows?

Contract (all return a ``ScopeResult`` with ``rows``, ``cancelled`` and ``notes``; each polls
``should_stop()`` between points and reports ``on_progress(done, total, message)`` and
``on_row(row)``):

  batch_sweep(model, batch_sizes, context_len)      one row per batch size
  model_size_sweep(names, context_len, device, dtype)  one row per preset, random weights
  precision_compare(model, precisions, ...)         one row per precision

Speedup rows carry ``cached_ms`` (median decode step at ``context_len`` tokens in view),
``uncached_ms`` (median full forward of ``context_len`` tokens, last-position logits = mode 2),
``speedup`` = uncached / cached and ``flop_ratio`` from ``engine.costs``. A point whose memory
estimate exceeds half of what is free, or whose predicted time exceeds ``max_seconds`` per
call, is skipped with the reason in its row (``skipped``). Precision rows carry the step time
and memory of each precision and, against fp32 on the same tokens (teacher forcing), the
top-1 agreement and the largest logit difference.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import costs
from .config import GPTConfig
from .model import GPT
from .modes import MODES, make_decoder
from .timing import StepClock, time_call

ProgressFn = Callable[[int, int, str], None]
StopFn = Callable[[], bool]
RowFn = Callable[[dict[str, Any]], None]
BATCH_SIZES = (1, 2, 4, 8, 16, 32)
MODEL_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


@dataclass
class ScopeResult:
    rows: list[dict[str, Any]] = field(default_factory=list)
    cancelled: bool = False
    notes: list[str] = field(default_factory=list)


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def step_memory_estimate(cfg: GPTConfig, dtype: Any, batch: int, context_len: int) -> int:
    """Bytes a cached + an uncached step at this size need beyond the weights (rough, high)."""
    el = costs.dtype_bytes(dtype)
    kv = costs.kv_bytes(cfg, dtype, batch, context_len + 16)
    scores = 3 * batch * cfg.n_head * context_len * context_len * el  # mode 2's explicit scores
    acts = 16 * batch * context_len * cfg.n_embd * el + 2 * batch * cfg.vocab_size * el
    return kv + scores + acts


def _prompt(cfg: GPTConfig, batch: int, length: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=gen).to(device)


@torch.no_grad()
def measure_speedup(model: GPT, batch: int, context_len: int, *, cached_mode: str,
                    uncached_mode: str, steps: int = 6, repeats: int = 3) -> dict[str, Any]:
    """Cached step and uncached forward at ``context_len`` tokens in view, batch ``batch``."""
    cfg, dev = model.config, model.device
    warm = 2
    start_len = max(1, context_len - 1 - warm)
    dec = make_decoder(model, cached_mode, batch_size=batch,
                       capacity=min(cfg.block_size, start_len + warm + steps))
    logits = dec.prefill(_prompt(cfg, batch, start_len, dev))
    clock = StepClock(dev)
    for i in range(warm + steps):
        token = logits.argmax(-1, keepdim=True)
        clock.start()
        logits = dec.step(token)
        clock.stop()
        if i == warm - 1:
            clock.reset()  # warm-up steps are not samples
    cached_ms = statistics.median(clock.samples_ms)
    del dec, logits
    full = make_decoder(model, uncached_mode, batch_size=batch)
    idx = _prompt(cfg, batch, context_len, dev)
    timing = time_call(lambda: full.prefill(idx), warmup=1, repeats=repeats, device=dev)
    uncached_ms = timing.median_ms
    last_only = getattr(full, "logits", "last") == "last"
    flops_c = costs.step_flops(cfg, context_len, cached=True, batch_size=batch)
    flops_u = costs.step_flops(cfg, context_len, cached=False, batch_size=batch,
                               last_only=last_only)
    return {"batch_size": batch, "context_len": context_len, "cached_mode": cached_mode,
            "uncached_mode": uncached_mode, "cached_ms": cached_ms, "uncached_ms": uncached_ms,
            "speedup": uncached_ms / cached_ms, "flop_ratio": flops_u / flops_c,
            "cached_tflops": flops_c / (cached_ms / 1e3) / 1e12,
            "uncached_tflops": flops_u / (uncached_ms / 1e3) / 1e12,
            "tokens_per_s": batch / (cached_ms / 1e3), "skipped": None}


def _add(result: ScopeResult, on_row: RowFn | None, row: dict[str, Any]) -> None:
    result.rows.append(row)
    if on_row:
        on_row(row)


def _skip(row: dict[str, Any], why: str) -> dict[str, Any]:
    return {**row, "cached_ms": None, "uncached_ms": None, "speedup": None, "skipped": why}


def batch_sweep(
    model: GPT, batch_sizes: Sequence[int] = BATCH_SIZES, context_len: int = 128, *,
    cached_mode: str = "prealloc_fused", uncached_mode: str = "uncached_last",
    steps: int = 6, repeats: int = 3, max_seconds: float = 20.0,
    on_progress: ProgressFn | None = None, should_stop: StopFn | None = None,
    on_row: RowFn | None = None,
) -> ScopeResult:
    """Cached vs uncached at one context length as the batch grows (see module docstring)."""
    cfg = model.config
    if not 4 <= context_len <= cfg.block_size - steps - 1:
        raise ValueError(f"context length must be within 4..{cfg.block_size - steps - 1}")
    for name in (cached_mode, uncached_mode):
        if name not in MODES:
            raise ValueError(f"unknown mode {name!r}; allowed: {', '.join(MODES)}")
    result = ScopeResult()
    budget = free_memory_bytes(model.device) // 2
    per_row_ms: float | None = None  # uncached ms per sequence, to predict the next batch
    for i, b in enumerate(sorted(set(batch_sizes))):
        if should_stop and should_stop():
            result.cancelled = True
            break
        if on_progress:
            on_progress(i, len(batch_sizes), f"batch {b}: timing cached and uncached steps")
        base = {"batch_size": b, "context_len": context_len, "model": _name(cfg),
                "flop_ratio": costs.step_flops(cfg, context_len, False, b, True)
                / costs.step_flops(cfg, context_len, True, b)}
        need = step_memory_estimate(cfg, model.dtype, b, context_len)
        if need > budget:
            _add(result, on_row, _skip(base, f"needs ~{need / 2**20:.0f} MiB, "
                                           f"{budget / 2**20:.0f} MiB allowed"))
            continue
        if per_row_ms is not None and per_row_ms * b / 1e3 > max_seconds:
            _add(result, on_row, _skip(base, f"predicted {per_row_ms * b / 1e3:.0f} s per "
                                           f"uncached step > {max_seconds:.0f} s budget"))
            continue
        row = measure_speedup(model, b, context_len, cached_mode=cached_mode,
                              uncached_mode=uncached_mode, steps=steps, repeats=repeats)
        per_row_ms = row["uncached_ms"] / b
        _add(result, on_row, {**base, **row, "model": _name(cfg)})
    if on_progress and not result.cancelled:
        on_progress(len(batch_sizes), len(batch_sizes), "done")
    return result


def _name(cfg: GPTConfig) -> str:
    from .config import PRESETS

    for name, shape in PRESETS.items():
        if all(getattr(cfg, k) == v for k, v in shape.items()):
            return name
    return f"L{cfg.n_layer}-d{cfg.n_embd}"


def model_size_sweep(
    names: Sequence[str] = MODEL_NAMES, context_len: int = 128, *, device: Any = "cpu",
    dtype: Any = "float32", cached_mode: str = "prealloc_fused",
    uncached_mode: str = "uncached_last", steps: int = 6, repeats: int = 3,
    max_seconds: float = 30.0, config_overrides: dict[str, int] | None = None,
    on_progress: ProgressFn | None = None, should_stop: StopFn | None = None,
    on_row: RowFn | None = None,
) -> ScopeResult:
    """Each preset with seeded random weights, batch 1 (timings don't depend on the values)."""
    from .hardware import to_torch_dtype

    dev, tdtype = torch.device(device), to_torch_dtype(dtype)
    result = ScopeResult()
    prev: tuple[int, float] | None = None  # (linear params, uncached ms) of the last model
    for i, name in enumerate(names):
        if should_stop and should_stop():
            result.cancelled = True
            break
        cfg = GPTConfig.from_name(name, **(config_overrides or {}))
        n = costs.linear_params(cfg)
        base = {"model": name, "params": costs.param_count(cfg), "batch_size": 1,
                "context_len": context_len,
                "flop_ratio": costs.step_flops(cfg, context_len, False, 1, True)
                / costs.step_flops(cfg, context_len, True, 1)}
        need = 2 * costs.weight_bytes(cfg, tdtype) + step_memory_estimate(cfg, tdtype, 1,
                                                                         context_len)
        if need > free_memory_bytes(dev) // 2:
            _add(result, on_row, _skip(base, f"needs ~{need / 2**30:.1f} GiB; not enough free"))
            continue
        if prev is not None and prev[1] * n / prev[0] / 1e3 > max_seconds:
            _add(result, on_row, _skip(base, "predicted uncached step over the time budget"))
            continue
        if on_progress:
            on_progress(i, len(names), f"{name}: random weights, then timing")
        model = GPT.random(cfg, seed=0, device=dev, dtype=tdtype)
        try:
            row = measure_speedup(model, 1, context_len, cached_mode=cached_mode,
                                  uncached_mode=uncached_mode, steps=steps, repeats=repeats)
        finally:
            del model
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        prev = (n, row["uncached_ms"])
        _add(result, on_row, {**base, **row})
    if on_progress and not result.cancelled:
        on_progress(len(names), len(names), "done")
    return result


# ------------------------------------------------------------------------------- precision
def precisions_for(device: Any) -> list[str]:
    """fp32 always; TF32 and fp16 on CUDA; bf16 where the device supports it."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return ["fp32", "bf16"]
    out = ["fp32", "tf32"]
    if torch.cuda.is_bf16_supported():
        out.append("bf16")
    return [*out, "fp16"]


_PRECISION_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                     "fp16": torch.float16}


@contextlib.contextmanager
def _tf32(enabled: bool) -> Iterator[None]:
    """Switch TF32 matmuls on or off for the block, restoring the previous settings."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@torch.no_grad()
def _teacher_forced(model: GPT, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (n, B, vocab) in fp32 for each step when ``tokens`` (B, n) are fed back."""
    dec = make_decoder(model, "prealloc_fused", batch_size=prompt.size(0),
                       capacity=prompt.size(1) + tokens.size(1))
    out = [dec.prefill(prompt).float()]
    for i in range(tokens.size(1) - 1):
        out.append(dec.step(tokens[:, i : i + 1]).float())
    return torch.stack(out)


@torch.no_grad()
def precision_compare(
    model: GPT, precisions: Sequence[str] | None = None, *, prompt_len: int = 32,
    new_tokens: int = 32, steps: int = 8,
    on_progress: ProgressFn | None = None, should_stop: StopFn | None = None,
    on_row: RowFn | None = None,
) -> ScopeResult:
    """Time, memory and agreement with fp32 for each precision (see the module docstring)."""
    cfg, dev = model.config, model.device
    wanted = list(precisions or precisions_for(dev))
    bad = [p for p in wanted if p not in _PRECISION_DTYPES or p not in precisions_for(dev)]
    if bad:
        raise ValueError(f"precision {bad[0]!r} is not offered on {dev.type}; "
                         f"allowed: {', '.join(precisions_for(dev))}")
    if prompt_len + new_tokens + steps + 3 > cfg.block_size:
        raise ValueError(f"prompt + new tokens + steps must fit in {cfg.block_size} tokens")
    ref_model = model if model.dtype == torch.float32 else _converted(model, torch.float32)
    prompt = _prompt(cfg, 1, prompt_len, dev)
    result = ScopeResult()
    with _tf32(False):
        ref_tokens = _greedy(ref_model, prompt, new_tokens)
        ref_logits = _teacher_forced(ref_model, prompt, ref_tokens)
    for i, prec in enumerate(wanted):
        if should_stop and should_stop():
            result.cancelled = True
            break
        if on_progress:
            on_progress(i, len(wanted), f"{prec}: timing and comparing with fp32")
        dtype = _PRECISION_DTYPES[prec]
        m = ref_model if dtype == torch.float32 else _converted(ref_model, dtype)
        with _tf32(prec == "tf32"):
            logits = _teacher_forced(m, prompt, ref_tokens)
            own = _greedy(m, prompt, new_tokens)
            row = measure_speedup(m, 1, prompt_len, cached_mode="prealloc_fused",
                                  uncached_mode="uncached_last", steps=steps, repeats=2)
        diff = (logits - ref_logits).abs()
        same = (own == ref_tokens)[0]
        prefix = int(same.long().cumprod(0).sum())
        _add(result, on_row, {
            "precision": prec, "dtype": str(dtype).removeprefix("torch."),
            "tf32": prec == "tf32", "step_ms": row["cached_ms"],
            "uncached_ms": row["uncached_ms"],
            "weight_bytes": sum(p.numel() * p.element_size() for p in m.parameters()),
            "kv_bytes_per_token": costs.kv_bytes_per_token(cfg, dtype),
            "top1_agreement": float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
            "max_logit_diff": float(diff.max()), "mean_logit_diff": float(diff.mean()),
            "identical_prefix_tokens": prefix, "new_tokens": new_tokens,
        })
        if m is not ref_model:
            del m
    if on_progress and not result.cancelled:
        on_progress(len(wanted), len(wanted), "done")
    return result


def _converted(model: GPT, dtype: torch.dtype) -> GPT:
    """A copy of ``model`` in ``dtype`` (the shared model itself is never changed)."""
    out = GPT.empty(model.config, model.device, dtype)
    out.load_state_dict(model.state_dict())  # copies and casts; the head stays tied to wte
    out.weights_label = model.weights_label
    return out.eval()


def _greedy(model: GPT, prompt: torch.Tensor, n: int) -> torch.Tensor:
    from .modes import greedy_tokens

    return greedy_tokens(make_decoder(model, "prealloc_fused", batch_size=prompt.size(0),
                                      capacity=prompt.size(1) + n), prompt, n)
