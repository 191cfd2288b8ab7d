"""Every experiment, registered once: its name, the run kind it saves, its params, its code.

``EXPERIMENTS[name].run(loaded, params, progress, should_stop)`` imports the experiment's module
(torch) on first use and returns the run to save. The registry itself is torch-free: the
dashboard's server builds requests from it without importing torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from instruments import params as P


@dataclass(frozen=True)
class Experiment:
    name: str
    kind: str  # the run kind it saves (results schema)
    title: str  # shown to others waiting in the device queue
    params: type
    module: str  # instruments.experiments.<module> holds run(loaded, params, progress, stop)

    def run(self, loaded: Any, params: Any, progress: Callable[..., None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        module = importlib.import_module(f"instruments.experiments.{self.module}")
        return module.run(loaded, params, progress, should_stop)


EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (
    Experiment("latency", "latency_sweep", "latency sweep", P.LatencyParams, "latency"),
    Experiment("end_to_end", "end_to_end", "end-to-end generation", P.EndToEndParams,
               "end_to_end"),
    Experiment("memory", "memory", "memory accounting", P.MemoryParams, "memory"),
    Experiment("hardware", "hardware", "peak microbenchmarks", P.HardwareParams, "hardware"),
    Experiment("attribution", "attribution", "step attribution", P.AttributionParams,
               "attribution"),
    Experiment("staircase", "staircase", "matmul staircase", P.StaircaseParams, "staircase"),
    Experiment("scope", "scope", "scope sweep", P.ScopeParams, "scope"),
    Experiment("precision", "precision", "precision comparison", P.PrecisionParams,
               "precision"),
    Experiment("correctness", "correctness", "correctness checks", P.CorrectnessParams,
               "correctness"),
    Experiment("generation", "generation", "side-by-side generation", P.GenerationParams,
               "generation"),
    Experiment("planner", "kv_planner", "KV memory planner", P.PlannerParams, "planner"),
    Experiment("prediction", "step_prediction", "step prediction", P.PredictionParams,
               "prediction"),
)}


def get(name: str) -> Experiment:
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; allowed: {', '.join(EXPERIMENTS)}")
    return EXPERIMENTS[name]
