"""Analytic cost model: FLOPs and bytes per generation step, computed from a model's config alone.

Any family's config (``engine.models.config``: GPT-2's or the Llama family's) describes its own
Linears (``cfg.matrices()``: q|k|v fused or apart, GQA's narrower k and v, a 4x GELU MLP or SwiGLU's
three), its head, its other parameters and the activations a block writes; the formulas below
sum those, so GQA, SwiGLU and a 49,152-row head are costed as they are, not as GPT-2's shapes.

Every number here is a formula, never a measurement. FLOPs count only matrix products (2 FLOPs
per multiply-add); LayerNorm / RMSNorm, RoPE's rotations, softmax, GELU / SiLU, adds and embedding
lookups are left out, so the
result matches what `torch.utils.flop_counter.FlopCounterMode` reports for the same forward.
Bytes are a lower bound on the traffic a step cannot avoid (weights once, K/V rows touched).
The Linear weights are counted at their *stored* size: the model dtype's, unless a mode stores
them otherwise (``storage``, a mode's ``engine.modes.ModeSpec.weight_storage``: "int8" is one
byte a weight plus one fp32 scale per output channel, "bfloat16" two bytes), so each mode's
byte floor is its own bytes / the measured bandwidth.
Names carry their unit: `*_flops`, `*_bytes`, `context_len` in tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine import dtypes
from engine.models.config import ModelConfig
from instruments.costmodel import kv_plan

MASK_BYTE_KINDS = ("seed", "shared_bool", "none")
# Transient bytes an estimate adds on a GPU for cuBLAS/cuBLASLt workspaces (conservative).
GPU_WORKSPACE_ESTIMATE_BYTES = 32 * 2**20


def _check_positive(name: str, value: int, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = "a non-negative integer" if allow_zero else "a positive integer"
        raise ValueError(f"{name} must be {what}, got {value!r}")


# ---------------------------------------------------------------------------------------- FLOPs
def block_params(cfg: ModelConfig) -> int:
    """Weights of one block's Linears (``cfg.matrices()``): gpt2 12 d^2; SmolLM2 2 d^2 + 2 d x
    (3 heads x 64) + 3 d x 1,536."""
    return sum(out * inp for _, out, inp, _ in cfg.matrices())


def linear_params(cfg: ModelConfig) -> int:
    """N: weights of every Linear layer, including the output projection (tied or not).

    Every block's matrices plus the output projection d x V. Biases, norms and the position
    table are excluded: they add no matrix-product FLOPs. gpt2 -> 123,532,032; smollm2-135m ->
    134,479,872 (the 49,152 x 576 head alone 28,311,552).
    """
    return cfg.n_layer * block_params(cfg) + _head_params(cfg)


def _head_params(cfg: ModelConfig) -> int:
    out, inp = cfg.head
    return out * inp


def _attention_width(cfg: ModelConfig) -> int:
    """Query heads x head size: what each query's score and weighted sum span (GQA shares the
    keys, not the queries: the FLOPs are those of every query head)."""
    return cfg.n_head * cfg.head_dim


def step_flops(
    cfg: ModelConfig,
    context_len: int,
    cached: bool,
    batch_size: int = 1,
    last_only: bool = False,
    keys: int | None = None,
) -> int:
    """FLOPs of one generation step that ends with `context_len` tokens in view.

    Uncached: all t tokens go through the model: 2*N*t + 4*L*d*t^2 (the t x t score and
    weighted-sum products per layer, full matrices as a matmul computes them, not half).
    With `last_only` the output projection runs on the final position only:
    2*(N - d*V)*t + 2*d*V + 4*L*d*t^2.
    Cached: one new token through the Linear layers, one query against t keys: 2*N + 4*L*d*t
    (t includes the new token; `last_only` changes nothing here). A cached step that attends
    over more keys than it has context (a static-shape step over the whole cache, masked)
    passes `keys`: the attention term is charged for those. Times `batch_size`.
    """
    _check_positive("context_len", context_len)
    _check_positive("batch_size", batch_size)
    t = context_len
    n = linear_params(cfg)
    attention = 4 * cfg.n_layer * _attention_width(cfg) * t
    if cached:
        per_seq = 2 * n + 4 * cfg.n_layer * _attention_width(cfg) * (keys or t)
    elif last_only:
        head = _head_params(cfg)
        per_seq = 2 * (n - head) * t + 2 * head + attention * t
    else:
        per_seq = 2 * n * t + attention * t
    return per_seq * batch_size


def lm_head_share(cfg: ModelConfig, context_len: int, wasted_only: bool = False) -> float:
    """Fraction of an uncached step's FLOPs spent in the output projection (~0.27 for gpt2).

    With `wasted_only` only the t-1 positions whose predictions generation throws away count
    (the saving that slicing to the last position buys).
    """
    total = step_flops(cfg, context_len, cached=False)
    positions = context_len - 1 if wasted_only else context_len
    return 2 * _head_params(cfg) * positions / total


def attention_share(cfg: ModelConfig, context_len: int, cached: bool = False) -> float:
    """Fraction of a step's FLOPs in the two attention products (~0.13 at t=1000 for gpt2).

    The uncached step is exactly t times the cached one term by term, so both give the same
    share; the flag is kept so callers state which step they mean.
    """
    total = step_flops(cfg, context_len, cached=cached)
    t = context_len
    attention = 4 * cfg.n_layer * _attention_width(cfg) * t * (1 if cached else t)
    return attention / total


def _generation_step_flops(
    cfg: ModelConfig,
    prompt_len: int,
    new_tokens: int,
    cached: bool,
    batch_size: int,
    last_only: bool,
) -> list[int]:
    _check_positive("prompt_len", prompt_len)
    _check_positive("new_tokens", new_tokens, allow_zero=True)
    steps: list[int] = []
    for k in range(new_tokens):
        # Step k produces new token k from prompt_len + k tokens of context.
        t = prompt_len + k
        if cached and k > 0:
            steps.append(step_flops(cfg, t, cached=True, batch_size=batch_size))
        else:
            # Uncached steps, and the cached path's prefill (one full pass over the prompt).
            steps.append(step_flops(cfg, t, False, batch_size=batch_size, last_only=last_only))
    return steps


def generation_flops(
    cfg: ModelConfig,
    prompt_len: int,
    new_tokens: int,
    cached: bool,
    batch_size: int = 1,
    last_only: bool = False,
) -> int:
    """Total FLOPs to generate `new_tokens` after a `prompt_len`-token prompt.

    Cached: one prefill (an uncached pass over the prompt, which yields the first new token)
    then new_tokens - 1 cached steps. Uncached: new_tokens full passes over a growing context.
    """
    return sum(_generation_step_flops(cfg, prompt_len, new_tokens, cached, batch_size, last_only))


# ---------------------------------------------------------------------------------------- bytes
def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a torch dtype or a name ("float32", "bf16", "torch.float16", ...)."""
    return dtypes.itemsize(dtype)


def param_count(cfg: ModelConfig) -> int:
    """Every parameter of the model, a tied output projection counted once (gpt2: 124,439,808;
    smollm2-135m: 134,515,008): the blocks' matrices plus ``cfg.other_params()`` (embeddings,
    norms, biases)."""
    return cfg.n_layer * block_params(cfg) + cfg.other_params()


def weight_bytes(cfg: ModelConfig, dtype: Any) -> int:
    """Bytes of all parameters (tied `wte`/output projection once): gpt2 fp32 ~ 475 MiB."""
    return param_count(cfg) * dtype_bytes(dtype)


WEIGHT_STORAGES = ("", "int8", "bfloat16", "q8_0", "q4_1")  # "": the model dtype
SCALE_BYTES = 4  # one fp32 scale per output channel of an int8 weight
# GGUF's blocks of 32 weights (rungs 14, 15: engine.quant.blocks): Q8_0 32 int8 + an fp16
# scale = 34 bytes (8.5 bits a weight); Q4_1 16 bytes of nibbles + fp16 scale and minimum = 20
# (5 bits). The head (tied embedding) stays Q8_0 in both, as llama.cpp's Q4_1 files store it.
BLOCK_WEIGHTS = 32
BLOCK_BYTES = {"q8_0": 34, "q4_1": 20}
HEAD_BLOCK = "q8_0"


def output_channels(cfg: ModelConfig) -> int:
    """Output channels of every Linear, the output projection's included: gpt2 L*9d + V
    (133,201); an int8 weight stores one scale per channel."""
    return cfg.n_layer * sum(out for _, out, _, _ in cfg.matrices()) + cfg.head[0]


def linear_weight_bytes(cfg: ModelConfig, dtype: Any, storage: str = "") -> int:
    """The weights a decode step must stream, as stored: N * element size of ``dtype`` (gpt2
    fp32: 494 MB), or of ``storage`` -- "int8" (gpt2: 124 MB, scales included),
    "bfloat16" (247 MB), or GGUF's blocks: "q8_0" (8.5 bits a weight), "q4_1" (5 bits, the
    head in Q8_0: smollm2-135m 96,436,224 B: its shipped file's
    matrices to the byte)."""
    if storage not in WEIGHT_STORAGES:
        raise ValueError(f"unknown weight storage {storage!r}; allowed: "
                         f"{', '.join(repr(s) for s in WEIGHT_STORAGES)}")
    if storage == "int8":
        return linear_params(cfg) + SCALE_BYTES * output_channels(cfg)
    if storage in BLOCK_BYTES:
        blocks = cfg.n_layer * block_params(cfg) // BLOCK_WEIGHTS * BLOCK_BYTES[storage]
        return blocks + _head_params(cfg) // BLOCK_WEIGHTS * BLOCK_BYTES[HEAD_BLOCK]
    return linear_params(cfg) * dtype_bytes(storage or dtype)


def kv_bytes_per_token(cfg: ModelConfig, dtype: Any) -> int:
    """One key and one value vector per layer and K/V head: 2*L*n_kv_head*hs*bytes (gpt2 fp32:
    73,728 = 72 KiB; smollm2-135m's 3 K/V heads: 46,080)."""
    return cfg.kv_bytes_per_token(dtype_bytes(dtype))


def kv_bytes(cfg: ModelConfig, dtype: Any, batch_size: int, context_len: int) -> int:
    """KV cache payload for `batch_size` sequences of `context_len` tokens each (the rows a
    cache holds: a sliding window's at most, ``cfg.cache_rows``)."""
    _check_positive("batch_size", batch_size)
    _check_positive("context_len", context_len, allow_zero=True)
    return kv_bytes_per_token(cfg, dtype) * batch_size * cfg.cache_rows(context_len)


def activation_bytes(cfg: ModelConfig, dtype: Any, context_len: int, cached: bool,
                     batch_size: int = 1, last_only: bool = False,
                     keys: int | None = None) -> int:
    """Lower bound on the activation traffic of one step: every activation written once and
    read once, the logits written once.

    Per layer, for T new tokens attending to t keys: ``cfg.activations_per_token()`` per token
    (gpt2: q/k/v 3d, the attention output d, the MLP's hidden layer 4d), and the T x t scores
    per query head (explicit attention materialises them); then the logits, T x V (one row with
    ``last_only`` or a cache).
    Uncached (T = t) this is far from small: gpt2 fp32 at 1,000 tokens writes 201 MB of logits
    alone and ~1.7 GB of attention scores, more than its 494 MB of weights. Cached (T = 1) it is
    ~1.9 MB at 1,000 tokens, 0.4% of the weights. Biases and LayerNorm parameters are left out.
    """
    _check_positive("context_len", context_len)
    t = context_len
    new = 1 if cached else t
    per_layer = 2 * (cfg.activations_per_token() * new + cfg.n_head * new * (keys or t))
    logits = cfg.vocab_size * (1 if cached or last_only else t)
    return (cfg.n_layer * per_layer + logits) * batch_size * dtype_bytes(dtype)


def step_bytes(
    cfg: ModelConfig, dtype: Any, context_len: int, cached: bool, batch_size: int = 1,
    last_only: bool = False, keys: int | None = None, storage: str = "",
) -> int:
    """Lower bound on bytes one step moves to or from memory.

    Both modes read the Linear weights once (the batch shares them), at their stored size
    (``storage``: see ``linear_weight_bytes``). Cached: read t-1 cached
    K/V rows and write the new one (t rows; ``keys`` rows for a step that reads the whole
    cache). Uncached: write t K/V rows and read them back once (2t rows). Plus
    ``activation_bytes`` (each activation written and read once).
    """
    _check_positive("context_len", context_len)
    kv_rows = (keys or context_len) if cached else 2 * context_len
    return (linear_weight_bytes(cfg, dtype, storage) + kv_bytes(cfg, dtype, batch_size, kv_rows)
            + activation_bytes(cfg, dtype, context_len, cached, batch_size, last_only,
                               keys if cached else None))


def step_read_bytes(cfg: ModelConfig, dtype: Any, context_len: int, batch_size: int = 1,
                    keys: int | None = None, storage: str = "",
                    kv_storage: str | None = None) -> int:
    """Bytes a step must read, the numerator of MBU (gpt-fast's and Databricks' definition).

    The Linear weights once (the output projection tied to ``wte`` counted once: the embedding
    lookup reads one row per token), as ``storage`` (a weight-only rung's own bytes per weight:
    ``linear_weight_bytes``; default the model's dtype), plus the K/V rows the step attends to,
    ``keys`` of them (default ``context_len``), per sequence, stored as ``kv_storage`` ("int8"
    adds its scales; default the model's dtype). Activations are left out: MBU counts the
    model's bytes, not the traffic of its scratch.
    gpt2 fp32, one sequence at 1,000 tokens: 494 MB + 74 MB.
    """
    _check_positive("context_len", context_len)
    _check_positive("batch_size", batch_size)
    weights = linear_weight_bytes(cfg, dtype, storage)
    per_token = kv_plan.kv_bytes_per_token(cfg, dtype, kv_storage)  # int8: with its scales
    return weights + per_token * batch_size * (keys or context_len)


def utilization(flops: float | None, read_bytes: float | None, seconds: float | None,
                peak_gbps: float | None, peak_tflops: float | None
                ) -> tuple[float | None, float | None]:
    """(MBU, MFU): the share of a peak bandwidth the step's bytes reached, and of a peak FLOP
    rate its FLOPs reached, over ``seconds``; None where a number is missing or not positive."""
    def share(work: float | None, peak: float | None, scale: float) -> float | None:
        if not work or not peak or not seconds or seconds <= 0 or peak <= 0:
            return None
        return work / seconds / (peak * scale)

    return share(read_bytes, peak_gbps, 1e9), share(flops, peak_tflops, 1e12)


def mask_bytes(cfg: ModelConfig, kind: str | None = None) -> int:
    """Bytes of stored causal masks for a mask kind (default: the config's own).

    "seed": one fp32 block_size^2 buffer per layer (gpt2: 48 MiB); "shared_bool": one bool
    block_size^2 buffer for the whole model (1 MiB); "none": attention applies causality itself.
    """
    kind = cfg.mask if kind is None else kind
    square = cfg.block_size * cfg.block_size
    if kind == "seed":
        return cfg.n_layer * square * 4
    if kind == "shared_bool":
        return square
    if kind == "none":
        return 0
    raise ValueError(f"unknown mask kind {kind!r}; allowed: {', '.join(MASK_BYTE_KINDS)}")


def kv_overtakes_weights_tokens(cfg: ModelConfig, dtype: Any, kv_dtype: Any = None) -> float:
    """batch x context (in tokens) at which the KV cache outweighs all weights (gpt2 fp32: ~6,750).

    `kv_dtype` defaults to `dtype`; pass a smaller one to see a lower-precision cache.
    """
    kv_per_token = kv_bytes_per_token(cfg, dtype if kv_dtype is None else kv_dtype)
    return weight_bytes(cfg, dtype) / kv_per_token


# ---------------------------------------------------------------------------- memory
def crossover_grid(cfg: ModelConfig, dtype: Any, batch_sizes: Sequence[int],
                   contexts: Sequence[int]) -> list[dict]:
    """KV cache vs weights for each batch x context; crossover_tokens is where KV = weights."""
    w = weight_bytes(cfg, dtype)
    cross = kv_overtakes_weights_tokens(cfg, dtype)
    rows = []
    for b in batch_sizes:
        for t in contexts:
            kv = kv_bytes(cfg, dtype, b, t)
            rows.append({"batch_size": b, "context_len": t, "kv_bytes": kv, "weights_bytes": w,
                         "kv_over_weights": kv / w, "crossover_tokens": cross})
    return rows


def peak_memory_estimate(cfg: ModelConfig, dtype: Any, batch_size: int, context_len: int,
                         cache_kind: str | None = "prealloc", *, logits_all: bool = True,
                         device: Any = "cuda", mask: str = "seed") -> dict[str, int]:
    """A generous upper estimate of the bytes one run needs at its largest step (a prefill).

    cache_kind None is an uncached run (no cache kept; mode 1 projects every position, hence
    logits_all). Activations: the t x t scores of explicit attention (about three live copies),
    the MLP's 4d hidden layer and the logits. Weights are included: subtract them if loaded.
    """
    b, t, d = batch_size, context_len, cfg.n_embd
    el = dtype_bytes(dtype)
    scores = 3 * b * cfg.n_head * t * t * el
    hidden = b * t * (cfg.activations_per_token() + 6 * d) * el
    logits = b * (t if logits_all or cache_kind is None else 1) * cfg.vocab_size * el
    kv = 0 if cache_kind is None else kv_bytes(cfg, dtype, b, t)
    if cache_kind == "concat":
        kv += kv // cfg.n_layer  # torch.cat holds the old and the new copy of one layer
    est = {
        "weights_bytes": weight_bytes(cfg, dtype), "kv_bytes": kv,
        "activation_bytes": scores + hidden + logits, "mask_bytes": mask_bytes(cfg, mask),
        "workspace_bytes": GPU_WORKSPACE_ESTIMATE_BYTES if str(device).startswith("cuda") else 0,
    }
    est["total_bytes"] = sum(est.values())
    return est


def breakdown_formula(cfg: ModelConfig, dtype: Any, batch_size: int, context_len: int,
                      mask: str | None = None, device: str = "cpu") -> list[dict[str, Any]]:
    """Rows (component, bytes, source, note) of a run's memory by formula: the bar drawn beside
    the measured one (``instruments.measure.memory.memory_breakdown``)."""
    ws = GPU_WORKSPACE_ESTIMATE_BYTES if str(device).startswith("cuda") else 0
    kinds = {k: mask_bytes(cfg, k) for k in MASK_BYTE_KINDS}
    return [
        {"component": "weights", "bytes": weight_bytes(cfg, dtype), "source": "formula",
         "note": "parameters, tied embedding counted once"},
        {"component": "causal-mask buffers", "bytes": mask_bytes(cfg, mask), "source": "formula",
         "note": f"{mask or cfg.mask} variant; per kind: {kinds}"},
        {"component": "KV cache", "bytes": kv_bytes(cfg, dtype, batch_size, context_len),
         "source": "formula", "note": f"2·L·{cfg.n_kv_head} K/V heads·{cfg.head_dim}·bytes × "
         f"batch {batch_size} × {context_len} tokens"},
        {"component": "cuBLAS workspace", "bytes": ws, "source": "formula",
         "note": "upper estimate" if ws else "none on a CPU"},
    ]
