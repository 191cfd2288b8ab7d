"""The KV memory planner's formulas: bytes per token, layouts of a mixed-length batch, what fits.

Torch-free (the page draws these at once; the "planner" experiment measures the same layouts by
allocating them). Every size is a formula of the config:
  bytes per token   2 (K and V) x n_layer x kv_heads x head_dim x element bytes, plus for int8 one
                    scale per token, layer and head for K and V in the model's dtype
                    (gpt2 fp32: 73,728 B; bf16 36,864; int8 18,432 + 288 of scales)
  layouts           for sequences of final lengths l_i, a cache limit T and blocks of b tokens:
                    "contiguous"  every sequence reserves T tokens      (what a static cache does)
                    "exact"       every sequence reserves l_i tokens    (needs knowing the future)
                    "paged"       every sequence reserves ceil(l_i/b)*b (blocks handed out on use)
                    in use = sum l_i tokens; wasted = reserved - in use
  what fits         sequences = budget // (reserved bytes per sequence, averaged over the draw)
  a sliding window  a model whose attention sees only its last W tokens holds at most W rows
                    per layer (``cfg.cache_rows``): a length of l tokens reserves min(l, W), so
                    memory stays flat past the window (``held``)
Grouped / multi-query attention (fewer KV heads than query heads): every K/V-head count that
divides the query heads, the model's own marked -- GPT-2 caches one K/V head per query head,
SmolLM2 3 for its 9 (grouped-query attention: 46,080 B a token in fp32 where 9 heads would
need 138,240). The other rows are formulas only: what-ifs of the same model.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from engine import dtypes
from engine.models.config import ModelConfig

DISTRIBUTIONS = ("long-tailed", "uniform", "fixed")
LAYOUTS = {"contiguous": "contiguous, sized for the model's limit",
           "exact": "contiguous, sized for each final length",
           "paged": "paged blocks"}
STORAGES = ("float32", "bfloat16", "float16", "int8")
HEADROOM = 0.9  # the share of free memory a plan may use (as instruments.measure.memory.fits)


def kv_bytes_per_token(cfg: ModelConfig, dtype: Any, storage: str | None = None,
                       kv_heads: int | None = None) -> int:
    """Bytes one token adds to the cache: K and V, every layer, every K/V head the model caches
    (or ``kv_heads``) (gpt2 fp32: 73,728; smollm2-135m: 46,080)."""
    heads = cfg.n_kv_head if kv_heads is None else kv_heads
    if storage == "int8":  # int8 values + one scale per (layer, head, token) in the model dtype
        return 2 * cfg.n_layer * heads * (cfg.head_dim + dtypes.itemsize(dtype))
    return 2 * cfg.n_layer * heads * cfg.head_dim * dtypes.itemsize(storage or dtype)


def held(cfg: ModelConfig, lengths: Sequence[int]) -> list[int]:
    """Rows per layer each sequence's cache holds: its length, or its window's (a sliding
    window's ring of W rows)."""
    return [cfg.cache_rows(n) for n in lengths]


def draw_lengths(distribution: str, n: int, mean_len: int, limit: int, seed: int = 0
                 ) -> list[int]:
    """``n`` final sequence lengths within 1..``limit``: "fixed" (all ``mean_len``), "uniform"
    (1..2·mean-1) or "long-tailed" (log-normal, sigma 1, mean ``mean_len`` before clipping)."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {', '.join(DISTRIBUTIONS)}, "
                         f"got {distribution!r}")
    if n < 1 or not 1 <= mean_len <= limit:
        raise ValueError(f"need at least one sequence and a mean length within 1..{limit}")
    rng = random.Random(seed)
    if distribution == "fixed":
        raw = [float(mean_len)] * n
    elif distribution == "uniform":
        raw = [rng.uniform(1, 2 * mean_len - 1) for _ in range(n)]
    else:
        raw = [rng.lognormvariate(math.log(mean_len) - 0.5, 1.0) for _ in range(n)]
    return [min(limit, max(1, round(x))) for x in raw]


def reserved_tokens(layout: str, lengths: Sequence[int], limit: int, block_tokens: int) -> int:
    """Token slots a layout holds for ``lengths``."""
    if layout == "contiguous":
        return len(lengths) * limit
    if layout == "exact":
        return sum(lengths)
    if layout == "paged":
        return sum(math.ceil(n / block_tokens) for n in lengths) * block_tokens
    raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def layouts(lengths: Sequence[int], limit: int, block_tokens: int, bytes_per_token: int,
            budget_bytes: int | None = None) -> list[dict[str, Any]]:
    """One row per layout: reserved / in-use / wasted bytes and the sequences that would fit."""
    used = sum(lengths) * bytes_per_token
    rows = []
    for layout, label in LAYOUTS.items():
        reserved = reserved_tokens(layout, lengths, limit, block_tokens) * bytes_per_token
        per_seq = reserved / len(lengths)
        rows.append({"layout": layout, "label": label, "sequences": len(lengths),
                     "reserved_bytes": reserved, "used_bytes": used,
                     "wasted_bytes": reserved - used, "waste_share": (reserved - used) / reserved,
                     "fits_sequences": None if budget_bytes is None
                     else int(max(0, budget_bytes) // per_seq)})
    return rows


def memory_against_batch(lengths: Sequence[int], limit: int, block_tokens: int,
                         bytes_per_token: int, batches: Sequence[int]) -> list[dict[str, Any]]:
    """Reserved bytes of each layout for the first b drawn sequences, for each b in ``batches``."""
    rows = []
    for b in batches:
        for layout in LAYOUTS:
            reserved = reserved_tokens(layout, lengths[:b], limit, block_tokens)
            rows.append({"batch_size": b, "layout": layout, "label": LAYOUTS[layout],
                         "reserved_bytes": reserved * bytes_per_token,
                         "used_bytes": sum(lengths[:b]) * bytes_per_token})
    return rows


def max_batch(budget_bytes: int, bytes_per_token: int, context_len: int) -> int:
    """Sequences of ``context_len`` tokens whose caches fit in ``budget_bytes``."""
    return int(max(0, budget_bytes) // (bytes_per_token * context_len))


def storage_rows(cfg: ModelConfig, dtype: Any, budget_bytes: int | None) -> list[dict[str, Any]]:
    """Bytes per token of each KV storage type, and full-length sequences that fit."""
    rows = []
    for storage in dict.fromkeys([dtypes.canonical(dtype), *STORAGES]):
        bpt = kv_bytes_per_token(cfg, dtype, storage)
        rows.append({"storage": storage, "bytes_per_token": bpt,
                     "fits_full_length": None if budget_bytes is None
                     else max_batch(budget_bytes, bpt, cfg.cache_rows(cfg.block_size))})
    return rows


def kv_head_rows(cfg: ModelConfig, dtype: Any, budget_bytes: int | None) -> list[dict[str, Any]]:
    """Every KV-head count dividing n_head, from multi-head down to multi-query: the model's own
    (``cfg.n_kv_head``) marked "this model", the others what-ifs."""
    rows = []
    for heads in [h for h in range(cfg.n_head, 0, -1) if cfg.n_head % h == 0]:
        bpt = kv_bytes_per_token(cfg, dtype, kv_heads=heads)
        shape = ("multi-head" if heads == cfg.n_head else "multi-query" if heads == 1
                 else "grouped")
        rows.append({"kv_heads": heads, "group": cfg.n_head // heads,
                     "kind": f"{shape} (this model)" if heads == cfg.n_kv_head
                     else f"{shape} (what-if)", "own": heads == cfg.n_kv_head,
                     "bytes_per_token": bpt,
                     "full_length_bytes": bpt * cfg.cache_rows(cfg.block_size),
                     "fits_full_length": None if budget_bytes is None
                     else max_batch(budget_bytes, bpt, cfg.cache_rows(cfg.block_size))})
    return rows


def budget(free_bytes: int | None, overhead_bytes: int = 0) -> int | None:
    """Bytes a plan may give to KV caches: HEADROOM of what is free, less a step's overhead."""
    if free_bytes is None:
        return None
    return max(0, int(HEADROOM * free_bytes) - overhead_bytes)
