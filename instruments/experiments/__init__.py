"""Every experiment, registered once; each one a module that owns everything about itself.

An experiment module (``instruments/experiments/<module>.py``) holds, torch-free at import:
  ``Params``              its parameters' dataclass: defaults (``Params.defaults(device,
                          block_size)`` where they depend on the device), ``check(cfg, device)``
  ``add_arguments(p)``    its CLI flags (the CLI command is the experiment's name)
  ``from_args(args, block_size)``  its ``Params`` from those flags
  ``summary(run)``        the lines the CLI prints after a run
  ``run(loaded, params, progress, should_stop)``  the measurement (torch is imported inside:
                          the dashboard's server imports the module for its ``Params`` only)
Pages, the CLI, the measuring process and the device check all read defaults and checks from
there, so each exists once. ``EXPERIMENTS[name]`` is the registry entry; ``get(name)`` accepts
the older CLI names too (``ALIASES``).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Experiment:
    name: str  # the CLI command and the request's experiment
    kind: str  # the run kind it saves (results schema)
    title: str  # shown to others waiting in the device queue
    aliases: tuple[str, ...] = ()  # older CLI command names

    @property
    def module(self) -> ModuleType:
        return importlib.import_module(f"instruments.experiments.{self.name}")

    @property
    def params(self) -> type:
        return self.module.Params

    def defaults(self, device: str, block_size: int) -> Any:
        """The experiment's default ``Params`` on ``device`` for a model of ``block_size``."""
        cls = self.params
        if hasattr(cls, "defaults"):
            return cls.defaults(device, block_size)
        return cls()

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        self.module.add_arguments(parser)

    def from_args(self, args: argparse.Namespace, block_size: int) -> Any:
        return self.module.from_args(args, block_size)

    def summary(self, run: dict[str, Any]) -> list[str]:
        return list(self.module.summary(run))

    def run(self, loaded: Any, params: Any, progress: Callable[..., None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        return self.module.run(loaded, params, progress, should_stop)


EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (
    Experiment("latency", "latency_sweep", "latency sweep", ("sweep",)),
    Experiment("end_to_end", "end_to_end", "end-to-end generation", ("e2e",)),
    Experiment("memory", "memory", "memory accounting"),
    Experiment("hardware", "hardware", "peak microbenchmarks"),
    Experiment("attribution", "attribution", "step attribution"),
    Experiment("staircase", "staircase", "matmul staircase"),
    Experiment("scope", "scope", "scope sweep"),
    Experiment("precision", "precision", "precision comparison"),
    Experiment("correctness", "correctness", "correctness checks"),
    Experiment("generation", "generation", "side-by-side generation"),
    Experiment("planner", "kv_planner", "KV memory planner"),
    Experiment("prediction", "step_prediction", "step prediction", ("predict",)),
    Experiment("bench", "bench", "pp / tg throughput (llama-bench)"),
    Experiment("peers", "peers", "peers on the same weights"),
    Experiment("speculate", "speculate", "verify curve and speculative decoding"),
)}
ALIASES = {alias: e.name for e in EXPERIMENTS.values() for alias in e.aliases}


def get(name: str) -> Experiment:
    name = ALIASES.get(name, name)
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; allowed: {', '.join(EXPERIMENTS)}")
    return EXPERIMENTS[name]


def to_dict(params: Any) -> dict[str, Any]:
    """A ``Params`` as the plain dict a request carries."""
    return asdict(params)


def from_dict(cls: type, data: dict[str, Any]) -> Any:
    """``cls(**data)``, refusing unknown fields with a message that names the allowed ones."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown parameter {unknown[0]!r} for {cls.__name__}; allowed: "
                         f"{', '.join(sorted(names))}")
    return cls(**data)
