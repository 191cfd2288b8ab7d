"""Serving many requests at once: continuous batching over the prefix cache's block pool.

  scheduler  ``Scheduler``: waiting and running queues, a step token budget (chunked prefill
             mixed into decode steps), admission under the pool's byte budget, preemption of
             the newest running sequence by recompute; policies "fcfs" and "lpm"
  batch      the batched step: one forward over every scheduled token laid end to end (each
             linear layer once over all rows), attention per sequence over its own blocks at
             its own position (``RaggedBatch``: our C++ paged kernel on a CPU, Triton on a GPU,
             or gathered)
  engine     ``ServingEngine``: submit / step / cancel / drain, greedy tokens, ``StepOutput``

The scheduler decides, the step computes, the pool owns the blocks (``engine.cache.prefix``).
Names load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"ServingEngine": "engine", "StepOutput": "engine", "default_step": "engine",
            "STEPS": "engine", "Scheduler": "scheduler",
            "Seq": "scheduler", "Work": "scheduler", "POLICIES": "scheduler",
            "RaggedBatch": "batch", "default_reads": "batch", "READS": "batch"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine.serving' has no attribute {name!r}")
    return getattr(importlib.import_module(f"engine.serving.{_EXPORTS[name]}"), name)
