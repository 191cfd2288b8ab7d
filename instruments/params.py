"""What each experiment takes: one dataclass per experiment, torch-free, with its own checks.

Pages build these from widgets, the CLI from flags, the device check from its stages; the
request to the measuring process carries them as plain dicts (``asdict`` / ``from_dict``).
``params.check(cfg, device)`` raises a one-line ValueError saying what is allowed, before any
work starts (the measuring process checks again, with the model in hand).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from engine import modes
from engine.config import BUG_KINDS, GPTConfig
from instruments.contexts import preset_contexts

MAX_BATCH = 256
# A memory measurement's two baselines, as the page offers them; the run measures the second
# first (before any warm-up of its own), as the write-up's first attempt did.
MEMORY_BASELINES = ("after warm-up", "before warm-up")


def _whole(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (
            hi is not None and value > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be a whole number {rng}, got {value!r}")


def _contexts(name: str, values: list[int], lo: int, hi: int) -> None:
    if not values:
        raise ValueError(f"no {name} given; allowed: {lo}..{hi}")
    bad = [t for t in values if isinstance(t, bool) or not isinstance(t, int)
           or not lo <= t <= hi]
    if bad:
        raise ValueError(f"{name.rstrip('s')} {bad[0]!r} is outside {lo}..{hi}")


def _modes(names: list[str], device: str) -> None:
    if not names:
        raise ValueError(f"no modes given; allowed: {', '.join(modes.MODES)}")
    for name in names:
        ok, why = modes.available(name, device)
        if not ok:
            raise ValueError(f"mode {name!r} cannot run: {why}")


@dataclass
class LatencyParams:
    """Per-token latency against context, per mode; optionally a whole generation per mode.

    Each point takes ``min_repeats`` timed samples, more while they disagree by more than
    ``spread`` (max - min over the median), up to ``repeats``. ``method`` "crop" fills each cached
    mode's cache once and crops it back to each context; "generate" is the write-up's way: one
    generation per repeat, read as it passes each context (``warmup_steps`` sizes its warm-up).
    On a CPU, a sample during which another process used the CPU is set aside and taken again
    once the machine is quiet, up to ``retakes`` times per point ("crop" only).
    """

    contexts: list[int]
    modes: list[str]
    batch_size: int = 1
    warmup: int = 1  # untimed calls per mode before its first point (per run: "generate")
    repeats: int = 3  # the most timed samples per point
    prompt_seed: int = 0
    warmup_steps: int | None = None  # "generate": decode steps per warm-up run; None = a full run
    e2e_new_tokens: int = 0  # > 0: also time a whole generation per mode (end-to-end tables)
    e2e_prompt_len: int = 8
    measure_peaks: bool = True  # the device's peaks go into the run (measured once a process)
    min_repeats: int = 2
    spread: float = 0.10
    method: str = "crop"
    retakes: int = 3  # CPU: disturbed samples set aside and taken again, per point (0: keep all)

    @classmethod
    def defaults(cls, device: str, block_size: int) -> LatencyParams:
        """~16 log-spaced points; more samples allowed on a GPU."""
        contexts = preset_contexts("log-spaced (16)", block_size)
        if str(device).startswith("cuda"):
            return cls(contexts, ["uncached", "concat"], repeats=5, warmup=2)
        return cls(contexts, ["uncached", "concat"], repeats=3, warmup=1, warmup_steps=32)

    def check(self, cfg: GPTConfig, device: str) -> None:
        _contexts("context lengths", self.contexts, 1, cfg.block_size)
        _modes(self.modes, device)
        _whole("batch size", self.batch_size, 1, MAX_BATCH)
        _whole("repeats", self.repeats, 1)
        _whole("fewest repeats", self.min_repeats, 1)
        _whole("warmup", self.warmup, 0)
        _whole("retakes", self.retakes, 0)
        if self.method not in ("crop", "generate"):
            raise ValueError(f"method must be 'crop' or 'generate', got {self.method!r}")
        if not 0 < self.spread < 10:
            raise ValueError(f"spread must be a share above 0 (0.1 = 10%), got {self.spread!r}")
        if self.warmup_steps is not None:
            _whole("warmup steps", self.warmup_steps, 0)
        if self.e2e_new_tokens:
            EndToEndParams(self.modes, self.e2e_prompt_len, self.e2e_new_tokens,
                           self.batch_size).check(cfg, device)


@dataclass
class EndToEndParams:
    """Time to generate ``new_tokens`` after a ``prompt_len`` prompt, per mode."""

    modes: list[str]
    prompt_len: int = 8
    new_tokens: int = 120
    batch_size: int = 1
    repeats: int = 1
    warmup_tokens: int = 8
    prompt_seed: int = 0

    def check(self, cfg: GPTConfig, device: str) -> None:
        _modes(self.modes, device)
        _whole("batch size", self.batch_size, 1, MAX_BATCH)
        _whole("repeats", self.repeats, 1)
        if self.prompt_len < 1 or self.new_tokens < 1 or \
                self.prompt_len + self.new_tokens - 1 > cfg.block_size:
            raise ValueError(f"prompt length + new tokens - 1 must be within 1..{cfg.block_size}"
                             f" (got {self.prompt_len} + {self.new_tokens}), with at least one "
                             "new token")


@dataclass
class MemoryParams:
    """The KV cache three ways at each context, both baselines; a breakdown; the formulas."""

    contexts: list[int]
    batch_size: int = 1
    cache_kind: str = "concat"
    fill: str = "prefill"  # a fresh cache per point | "decode": one generation passing them
    breakdown_context: int | None = None  # None: the largest context
    breakdown_mask: str = "seed"
    breakdown_cache: str = "prealloc"
    crossover_batches: list[int] = field(
        default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256])

    def check(self, cfg: GPTConfig, device: str) -> None:
        _contexts("context lengths", self.contexts, 1, cfg.block_size)
        _whole("batch size", self.batch_size, 1, MAX_BATCH)
        for name, value, allowed in (("cache kind", self.cache_kind, ("concat", "prealloc")),
                                     ("breakdown cache", self.breakdown_cache,
                                      ("concat", "prealloc")),
                                     ("fill", self.fill, ("prefill", "decode")),
                                     ("mask", self.breakdown_mask,
                                      ("none", "shared_bool", "seed"))):
            if value not in allowed:
                raise ValueError(f"{name} {value!r} is not one of {', '.join(allowed)}")
        if self.breakdown_context is not None:
            _whole("breakdown context", self.breakdown_context, 1, cfg.block_size)
        _contexts("batch sizes", self.crossover_batches, 1, MAX_BATCH)


@dataclass
class HardwareParams:
    """Device facts and measured peaks (matmul in each dtype, read and copy bandwidth)."""

    dtypes: list[str] = field(default_factory=list)  # empty: the model's dtype
    quick: bool = False  # small sizes (dry runs and tests)

    def check(self, cfg: GPTConfig, device: str) -> None:
        from engine import dtypes

        for name in self.dtypes:
            dtypes.model_dtype(name)


@dataclass
class AttributionParams:
    """Where a decode step's time goes, per mode and context (profiler, floors)."""

    modes: list[str]
    contexts: list[int]
    steps: int = 8
    warmup: int = 3
    batch_size: int = 1

    def check(self, cfg: GPTConfig, device: str) -> None:
        _modes(self.modes, device)
        _contexts("context lengths", self.contexts, 1, cfg.block_size)
        _whole("steps", self.steps, 1, 200)
        _whole("warm-up steps", self.warmup, 0, 50)
        _whole("batch size", self.batch_size, 1, MAX_BATCH)


@dataclass
class StaircaseParams:
    """The uncached step's matmuls timed alone at each T."""

    ts: list[int] | None = None  # None: every T on a GPU, a stride of 32 on a CPU
    repeats: int = 3
    include_forward: bool = False
    forward_every: int = 1

    def check(self, cfg: GPTConfig, device: str) -> None:
        if self.ts is not None:
            _contexts("T values", self.ts, 1, cfg.block_size)
        _whole("repeats", self.repeats, 1, 50)
        _whole("forward every", self.forward_every, 1)


@dataclass
class ScopeParams:
    """Cached vs uncached as the batch (``grow="batch"``) or the model (``"model"``) grows."""

    grow: str = "batch"
    points: list[Any] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    context_len: int = 128
    cached_mode: str = "prealloc_fused"
    uncached_mode: str = "uncached_last"
    max_seconds: float = 20.0  # a point whose uncached step is predicted longer is skipped
    steps: int = 6
    repeats: int = 3

    def check(self, cfg: GPTConfig, device: str) -> None:
        from engine.config import PRESETS

        if self.grow not in ("batch", "model"):
            raise ValueError(f"grow must be 'batch' or 'model', got {self.grow!r}")
        if not self.points:
            raise ValueError("no points given")
        if self.grow == "batch":
            _contexts("batch sizes", list(self.points), 1, MAX_BATCH)
        else:
            bad = [p for p in self.points if p not in PRESETS]
            if bad:
                raise ValueError(f"unknown model {bad[0]!r}; allowed: {', '.join(PRESETS)}")
        _modes([self.cached_mode, self.uncached_mode], device)
        if not 4 <= self.context_len <= cfg.block_size - self.steps - 1:
            raise ValueError(f"context length must be within 4..{cfg.block_size - self.steps - 1}")


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
        _whole("new tokens", self.new_tokens, 2)


@dataclass
class CorrectnessParams:
    """The checks with no bug and with each silent bug switched on, and the text each way."""

    prompt_ids: list[int]
    new_tokens: int = 40
    bugs: list[str] = field(default_factory=lambda: list(BUG_KINDS))
    append: list[int] = field(default_factory=lambda: [1, 2, 3, 7])

    def check(self, cfg: GPTConfig, device: str) -> None:
        if not self.prompt_ids:
            raise ValueError("The prompt is empty: type at least one word.")
        bad = [b for b in self.bugs if b not in BUG_KINDS]
        if bad:
            raise ValueError(f"unknown bug {bad[0]!r}; allowed: {', '.join(BUG_KINDS)}")
        _whole("new tokens", self.new_tokens, 2)
        room = cfg.block_size - max(self.new_tokens, max(self.append))
        if len(self.prompt_ids) > room:
            raise ValueError(f"The prompt is {len(self.prompt_ids)} tokens; with "
                             f"{self.new_tokens} new tokens this model ({cfg.block_size} tokens)"
                             f" allows at most {max(room, 0)} prompt tokens.")


@dataclass
class GenerationParams:
    """One prompt generated greedily through two modes, token by token, and the verdict."""

    prompt_ids: list[int]
    new_tokens: int = 40
    modes: list[str] = field(default_factory=lambda: ["prealloc_fused", "uncached"])

    def check(self, cfg: GPTConfig, device: str) -> None:
        if not self.prompt_ids:
            raise ValueError("The prompt is empty: type at least one character.")
        _whole("new tokens", self.new_tokens, 1)
        if len(self.modes) != 2 or self.modes[0] == self.modes[1]:
            raise ValueError("Pick two different modes to compare (left and right are the "
                             "same).")
        _modes(self.modes, device)
        n, limit = len(self.prompt_ids), cfg.block_size
        if n + self.new_tokens > limit:
            raise ValueError(
                f"Prompt ({n} tokens) + {self.new_tokens} new tokens is beyond the model's limit"
                f" of {limit} tokens; allowed: at most {max(limit - n, 0)} new tokens.")


@dataclass
class PredictionParams:
    """Calibrate the parts of a step on this device, then measure each mode and predict it
    (``instruments.predict``). The calibration is kept in the measuring process and reused
    unless ``recalibrate``."""

    modes: list[str]
    contexts: list[int]
    batch_size: int = 1
    repeats: int = 3  # the most timed samples per measured point and pass (at least 2)
    calibration_repeats: int = 3
    recalibrate: bool = False
    # Cached modes are measured in this many passes over the contexts, their samples pooled:
    # a burst of machine noise then owns no point (uncached forwards, long, take one pass).
    passes: int = 3

    @classmethod
    def defaults(cls, device: str, block_size: int) -> PredictionParams:
        from instruments.predict import RECIPES

        usable = [m for m in modes.defaults(device) if m in RECIPES]
        return cls(usable, preset_contexts("log-spaced (16)", block_size))

    def check(self, cfg: GPTConfig, device: str) -> None:
        _modes(self.modes, device)
        _contexts("context lengths", self.contexts, 1, cfg.block_size)
        _whole("batch size", self.batch_size, 1, MAX_BATCH)
        _whole("repeats", self.repeats, 1, 50)
        _whole("calibration repeats", self.calibration_repeats, 1, 20)
        _whole("passes", self.passes, 1, 10)


@dataclass
class PlannerParams:
    """What fits (formula, then allocated), a mixed-length batch held three ways, KV storage
    types with their logits error against fp32, and the KV-head what-if (``instruments.kv_plan``).
    """

    distribution: str = "long-tailed"
    sequences: int = 32
    mean_len: int | None = None  # None: a quarter of the model's limit
    block_tokens: int = 16
    seed: int = 0
    contexts: list[int] | None = None  # fit points; None: limit/8, /4, /2, the limit
    # the most one allocation may take, MiB; None: 2 GiB on a CPU (the machine keeps working),
    # the plan's whole budget on a GPU
    max_alloc_mib: int | None = None
    error_tokens: int = 64  # decode steps whose logits are compared with fp32, per storage

    def resolved(self, cfg: GPTConfig) -> PlannerParams:
        """A copy with every None filled in for ``cfg``."""
        block = cfg.block_size
        return replace(self, mean_len=self.mean_len or max(1, block // 4),
                       contexts=self.contexts or sorted({max(1, block // 8), max(1, block // 4),
                                                         max(1, block // 2), block}))

    def check(self, cfg: GPTConfig, device: str) -> None:
        from instruments.kv_plan import DISTRIBUTIONS

        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {', '.join(DISTRIBUTIONS)}, got "
                             f"{self.distribution!r}")
        _whole("sequences", self.sequences, 1, 4096)
        if self.mean_len is not None:
            _whole("mean length", self.mean_len, 1, cfg.block_size)
        _whole("block size (tokens)", self.block_tokens, 1, cfg.block_size)
        if self.contexts is not None:
            _contexts("context lengths", self.contexts, 1, cfg.block_size)
        if self.max_alloc_mib is not None:
            _whole("largest allocation (MiB)", self.max_alloc_mib, 1)
        _whole("error tokens", self.error_tokens, 1, max(1, cfg.block_size // 2))


def to_dict(params: Any) -> dict[str, Any]:
    return asdict(params)


def from_dict(cls: type, data: dict[str, Any]) -> Any:
    """``cls(**data)``, refusing unknown fields with a message that names the allowed ones."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown parameter {unknown[0]!r} for {cls.__name__}; allowed: "
                         f"{', '.join(sorted(names))}")
    return cls(**data)
