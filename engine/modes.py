"""The ladder of decode modes: each registered once, with its rung, label, colour and factory.

``MODES[name]`` is a ``ModeSpec``; ``ordered(names)`` sorts names by rung; ``available(name,
device)`` says whether a mode can run on a device type ("cpu" | "cuda") and why not. This module
is torch-free (the dashboard's server reads it to draw choices and colours); the decoders
themselves are built in the measuring process by ``engine.decoders.make_decoder``, which imports
each factory named here on first use (modes 6-9 pull in ``torch._dynamo``, slow to import).

Every decoder has the same two calls (``engine.decoders.Decoder``):
  decoder.prefill(idx)  -> logits (B, vocab) for the token after ``idx`` (B, T)
  decoder.step(token)   -> logits (B, vocab) after appending ``token`` (B, 1)
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModeSpec:
    name: str
    rung: int  # position on the ladder: the order everywhere, and the number in the label
    label: str  # shown in the UI and in saved rows
    color: str  # one colour per mode in every chart
    cached: bool
    description: str
    factory: str  # "module:callable" building the decoder: factory(model, **options, **kw)
    options: dict[str, object] = field(default_factory=dict)
    needs: str = ""  # "" | "cuda" | "compiler": what the device must offer
    slow_setup: bool = False  # first use compiles for minutes on a CPU: opt-in, never a default
    # Not exact by design (a lossy cache): the share of mode 1's largest |logit| its logits may
    # stray by, used by the gate when larger than the dtype's own tolerance. 0: exact.
    tolerance: float = 0.0
    # How the Linear weights are stored ("" = the model dtype; "int8" = int8 with one fp32
    # scale per output channel; "bfloat16"): the bytes a step streams, so the mode's own floor.
    weight_storage: str = ""


_EAGER = "engine.decoders:Decoder"
MODES: dict[str, ModeSpec] = {spec.name: spec for spec in (
    ModeSpec("uncached", 1, "1 · no cache, logits at every position", "#d62728", False,
             "The naive loop: the whole sequence re-run every step, output projection on every "
             "position.", _EAGER, dict(cache_kind=None, mask="seed", logits="all")),
    ModeSpec("uncached_last", 2, "2 · no cache, last-position logits", "#ff7f0e", False,
             "Still re-runs the sequence, but projects only the last position onto the "
             "vocabulary.", _EAGER, dict(cache_kind=None, mask="seed", logits="last")),
    ModeSpec("concat", 3, "3 · concatenating KV cache (the write-up's)", "#1f77b4", True,
             "torch.cat grows the cache every step; explicit attention with the fp32 mask "
             "buffers.", _EAGER, dict(cache_kind="concat", mask="seed")),
    ModeSpec("prealloc", 4, "4 · preallocated cache, written in place", "#2ca02c", True,
             "Cache buffers sized once, new keys/values written at their position; same "
             "attention.", _EAGER, dict(cache_kind="prealloc", mask="seed")),
    ModeSpec("prealloc_fused", 5, "5 · preallocated cache + fused attention, no stored mask",
             "#17becf", True, "scaled_dot_product_attention applies causality itself: no mask "
             "buffers at all.", _EAGER, dict(cache_kind="prealloc", mask="none")),
    ModeSpec("cuda_graph", 6, "6 · CUDA graph of the whole decode step", "#9467bd", True,
             "The decode step is captured once over the preallocated cache and replayed with "
             "one launch; positions live in a tensor, attention spans the whole capacity under "
             "a mask.", "engine.compiled:CudaGraphDecoder", needs="cuda"),
    ModeSpec("compiled", 7, "7 · torch.compile of the decode step", "#8c564b", True,
             "torch.compile (reduce-overhead on a GPU, inductor on a CPU) of a step that only "
             "reads the cache; the caller writes the new key/value row. Compile time is "
             "reported apart.", "engine.compiled:CompiledDecoder", dict(variant="compiled"),
             needs="compiler", slow_setup=True),
    ModeSpec("fast", 8, "8 · fast CPU path (transposed weights, split matmuls)", "#e377c2", True,
             "Per role of matrix, the fastest of four ways measured when the weights load "
             "([in, out] copies split across the cores, F.linear, our C++ kernel over the "
             "weights or an interleaved copy); preallocated cache, one-call attention, and on a "
             "CPU the whole step in one C++ call: streams the weights faster.",
             "engine.fast:FastDecoder"),
    ModeSpec("fast_compiled", 9, "9 · step compiled with freezing + max-autotune",
             "#bcbd22", True, "torch.compile with freezing and max_autotune of mode 7's "
             "read-only step over the model's own [out, in] weights (not mode 8's packed "
             "copies): inductor packs them itself and generates matrix-vector kernels. Minutes "
             "to compile on a CPU; holds packed weight copies.", "engine.compiled:CompiledDecoder",
             dict(variant="fast_compiled"), needs="compiler", slow_setup=True),
    ModeSpec("paged", 10, "10 · paged KV cache (blocks of 16 tokens, gathered per step)",
             "#393b79", True, "Keys/values in 16-token blocks of a shared pool, handed out as "
             "positions need them (a block table per sequence, as vLLM does); every step gathers "
             "the blocks back in order for fused attention -- the copy a paged-attention kernel "
             "avoids. Exact.", _EAGER, dict(cache_kind="paged", mask="none")),
    ModeSpec("int8_kv", 11, "11 · int8 KV cache (a scale per token and head)", "#637939", True,
             "Keys/values stored as int8 with one absmax scale per token and head (a quarter of "
             "fp32's bytes), dequantized every step for fused attention. Not exact: its logits "
             "error is measured and must stay within 5% of the largest logit.", _EAGER,
             dict(cache_kind="kv_int8", mask="none"), tolerance=0.05),
    ModeSpec("int8_weights", 12, "12 · int8 weights (a scale per output channel)", "#8c6d31",
             True, "Every Linear weight, the tied embedding/output projection included, stored "
             "as int8 with one fp32 scale per output channel: a quarter of fp32's bytes to "
             "stream. Activations and the KV cache stay in the model dtype (mode 5's cache and "
             "attention). Not exact: its logits error is measured and must stay within 5% of "
             "the largest logit.", "engine.quant:WeightOnlyDecoder", dict(storage="int8"),
             tolerance=0.05, weight_storage="int8"),
    ModeSpec("bf16_weights", 13, "13 · bf16 weights (bf16 matmuls)", "#843c39", True,
             "Every Linear weight (and the tied embedding/output projection) stored in bfloat16, "
             "half of fp32's bytes; each matmul runs in bf16 and returns the model dtype. "
             "Activations and the KV cache stay in the model dtype (mode 5's cache and "
             "attention). Not exact: its logits error must stay within 3% of the largest "
             "logit.", "engine.quant:WeightOnlyDecoder", dict(storage="bfloat16"),
             tolerance=0.03, weight_storage="bfloat16"),
)}
UNCACHED = tuple(name for name, spec in MODES.items() if not spec.cached)
SEED_PAIR = ("uncached", "concat")  # what the write-up compared as "no cache" vs "KV cache"
ALIASES = {"cached": "concat"}  # the write-up's published rows call mode 3 "cached"
OTHER_COLOR = "#7f7f7f"


def spec(name: str) -> ModeSpec:
    if name not in MODES:
        raise ValueError(f"unknown mode {name!r}; allowed: {', '.join(MODES)}")
    return MODES[name]


def color(name: str) -> str:
    name = ALIASES.get(name, name)
    return MODES[name].color if name in MODES else OTHER_COLOR


def label(name: str) -> str:
    return MODES[name].label if name in MODES else name


def ordered(names: Iterable[str]) -> list[str]:
    """Names in ladder order (known ones by rung), unknown ones after in their order, unique."""
    seen = list(dict.fromkeys(str(m) for m in names))

    def rank(m: str) -> tuple[int, int]:
        known = MODES.get(ALIASES.get(m, m))
        return (known.rung if known else len(MODES) + 1, seen.index(m))

    return sorted(seen, key=rank)


def available(name: str, device: str) -> tuple[bool, str]:
    """(can it run on ``device`` ("cpu", "cuda", "cuda:1"), why not). Torch-free."""
    if name not in MODES:
        return False, f"unknown mode {name!r}; allowed: {', '.join(MODES)}"
    kind = str(device).split(":")[0]
    needs = MODES[name].needs
    if needs == "cuda" and kind != "cuda":
        return False, "needs a CUDA GPU"
    if needs == "compiler":
        if kind == "cuda" and importlib.util.find_spec("triton") is None:
            return False, "torch.compile on a GPU needs triton, which is not installed"
        if kind == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
            return False, "torch.compile on a CPU needs a C++ compiler (g++ or clang++)"
    if kind not in ("cpu", "cuda"):
        return False, f"device {device!r} is not supported; use cpu or cuda"
    return True, ""


def choices(device: str) -> tuple[list[str], dict[str, str]]:
    """Modes that can run on ``device`` (ladder order), and why each other one cannot."""
    usable, missing = [], {}
    for name in MODES:
        ok, why = available(name, device)
        if ok:
            usable.append(name)
        else:
            missing[name] = why
    return usable, missing


def fastest_exact(device: str) -> str:
    """The default cached mode where one mode is offered as "the KV cache": mode 8 on a CPU (our
    fastest exact step there: docs/peers.md), mode 5 elsewhere."""
    return "fast" if str(device).startswith("cpu") else "prealloc_fused"


def defaults(device: str) -> list[str]:
    """Modes available on ``device`` that are cheap to set up (no minutes of compile)."""
    return [n for n in choices(device)[0] if not MODES[n].slow_setup]
