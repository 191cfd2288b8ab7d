"""What the three prefix-cache experiments share (``prefix_ttft``, ``prefix_chat``,
``prefix_workload``): seeded token ids, the bytes a budget of tokens takes, logits held to a full
prefill's within the gate's tolerance, the host's load average, and one timed request served
through ``engine.cache`` (lookup timed apart). Torch-free at import: the dashboard's server
imports the experiments for their ``Params`` only.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Any

from engine.models.config import ModelConfig
from instruments.costmodel.kv_plan import kv_bytes_per_token


def token_ids(vocab: int, n: int, seed: int, first: int | None = None) -> list[int]:
    """``n`` seeded ids uniform over the vocabulary; ``first`` fixes the first one (prompts
    that must not share even their first token with others)."""
    rng = random.Random(seed)
    ids = [rng.randrange(vocab) for _ in range(n)]
    if first is not None and ids:
        ids[0] = first % vocab
    return ids


def budget_for(cfg: ModelConfig, dtype: Any, tokens: int) -> int:
    """Bytes of K/V ``tokens`` positions take (kv_plan's per-token formula)."""
    return kv_bytes_per_token(cfg, dtype) * tokens


def load_avg() -> list[float] | None:
    """The host's 1, 5 and 15 minute load averages (None where the OS has none)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def drift(logits: Any, full: Any) -> dict[str, Any]:
    """``logits`` (1, vocab) against a full prefill's: the largest difference, what fp32's
    tolerance allows (the gate's: a share of the largest logit), and whether the top token is
    the same."""
    from instruments.checks.gate import tolerance

    diff = float((logits.float() - full.float()).abs().max())
    allowed = tolerance(str(full.dtype)) * float(full.float().abs().max())
    return {"max_abs_logit_diff": diff, "logit_tolerance": allowed,
            "exact": diff <= allowed,
            "argmax_same": int(logits.argmax()) == int(full.argmax())}


@dataclass
class Served:
    """One request served: its request object, its logits and the lookup's share of the time."""

    request: Any
    logits: Any
    lookup_ms: float
    cached: int


def serve(model: Any, cache: Any, ids: list[int], max_new: int, reuse: bool = True) -> Served:
    """Lookup (timed apart), admit and prefill ``ids`` through ``cache``: the request is left
    running (the caller finishes or cancels it). ``reuse=False`` skips the lookup: the whole
    prompt is computed."""
    from instruments.measure.timing import synchronize

    start = time.perf_counter()
    hit = cache.lookup(ids) if reuse else None
    lookup_ms = (time.perf_counter() - start) * 1e3
    req = cache.admit(ids, max_new, hit)
    logits = req.prefill(model)
    synchronize(model.device)
    return Served(req, logits, lookup_ms, req.cached)


def full_logits(model: Any, ids: list[int]) -> Any:
    """The last position's logits (1, vocab) of one full prefill of ``ids`` (no cache kept)."""
    import torch

    out, _ = model(torch.tensor([ids], dtype=torch.long, device=model.device),
                   use_cache=False, logits="last")
    return out[:, -1, :]
