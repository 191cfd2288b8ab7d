"""Every experiment, registered once; each one a module that owns everything about itself.

An experiment module (``instruments/experiments/<module>.py``, or a package's module:
``prefix/ttft.py``, ``serving/``) holds, torch-free at import:
  ``Params``              its parameters' dataclass: defaults (``Params.defaults(device, cfg)``
                          where they depend on the device or the model's config and family),
                          ``check(cfg, device)``
  ``add_arguments(p)``    its CLI flags (the CLI command is the experiment's name)
  ``from_args(args, cfg)``  its ``Params`` from those flags, for a model of config ``cfg``
  ``summary(run)``        the lines the CLI prints after a run
  ``run(loaded, params, progress, should_stop)``  the measurement (torch is imported inside:
                          the dashboard's server imports the module for its ``Params`` only)
Pages, the CLI, the measuring process and the device check all read defaults and checks from
there, so each exists once. ``EXPERIMENTS[name]`` is the registry entry -- the one list of
experiments: the CLI's commands and what ``all`` runs (``in_all``), the device check's stages
and their shares of its budget (``device_shares``), the Results page's names for the kinds of
run (``title_of``) -- and ``get(name)`` accepts the older CLI names too (``ALIASES``).
``register(experiment)`` adds one.
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
    in_all: bool = False  # part of ``python -m instruments all`` (in registry order)
    # the device check's stages of this experiment: (stage name, share of the budget its
    # fixed-time stages leave -- relative to the later stages' shares), in the order they run
    device_shares: tuple[tuple[str, float], ...] = ()
    path: str = ""  # its module under instruments.experiments ("" = its name)

    @property
    def module(self) -> ModuleType:
        return importlib.import_module(f"instruments.experiments.{self.path or self.name}")

    @property
    def params(self) -> type:
        return self.module.Params

    def defaults(self, device: str, cfg: Any) -> Any:
        """The experiment's default ``Params`` on ``device`` for a model of config ``cfg``."""
        cls = self.params
        if hasattr(cls, "defaults"):
            return cls.defaults(device, cfg)
        return cls()

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        self.module.add_arguments(parser)

    def from_args(self, args: argparse.Namespace, cfg: Any) -> Any:
        return self.module.from_args(args, cfg)

    def summary(self, run: dict[str, Any]) -> list[str]:
        return list(self.module.summary(run))

    def run(self, loaded: Any, params: Any, progress: Callable[..., None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        return self.module.run(loaded, params, progress, should_stop)


EXPERIMENTS: dict[str, Experiment] = {}
ALIASES: dict[str, str] = {}


def register(experiment: Experiment) -> Experiment:
    EXPERIMENTS[experiment.name] = experiment
    ALIASES.update({alias: experiment.name for alias in experiment.aliases})
    return experiment


for _e in (
    Experiment("hardware", "hardware", "peak microbenchmarks", in_all=True),
    Experiment("latency", "latency_sweep", "latency sweep", ("sweep",), in_all=True,
               device_shares=(("sweep-float32", 0.17), ("sweep-llama", 0.20),
                              ("sweep-bfloat16", 0.10), ("sweep-compiled", 0.12))),
    Experiment("end_to_end", "end_to_end", "end-to-end generation", ("e2e",)),
    Experiment("attribution", "attribution", "step attribution",
               device_shares=(("attribution", 0.07),)),
    Experiment("staircase", "staircase", "matmul staircase", device_shares=(("staircase", 0.09),)),
    Experiment("memory", "memory", "memory accounting", in_all=True,
               device_shares=(("memory", 0.04),)),
    Experiment("scope", "scope", "scope sweep"),
    Experiment("precision", "precision", "precision comparison"),
    Experiment("correctness", "correctness", "correctness checks"),
    Experiment("generation", "generation", "side-by-side generation"),
    Experiment("planner", "kv_planner", "KV memory planner", device_shares=(("planner", 0.03),)),
    Experiment("prediction", "step_prediction", "step prediction", ("predict",),
               device_shares=(("prediction", 0.10),)),
    Experiment("bench", "bench", "pp / tg throughput (llama-bench)",
               device_shares=(("bench", 0.04),)),
    Experiment("peers", "peers", "peers on the same weights", device_shares=(("peers", 0.10),)),
    Experiment("speculate", "speculate", "verify curve and speculative decoding",
               device_shares=(("speculate", 0.03),)),
    Experiment("prefix_ttft", "prefix_ttft", "TTFT against the cached prefix",
               device_shares=(("prefix", 0.05),), path="prefix.ttft"),
    Experiment("prefix_chat", "prefix_chat", "a multi-turn chat with and without prefix reuse",
               path="prefix.chat"),
    Experiment("prefix_workload", "prefix_workload",
               "a shared-prefix workload under KV budgets", path="prefix.workload"),
    Experiment("serving", "serving", "serving many requests (continuous batching)",
               device_shares=(("serving", 0.08),)),
    Experiment("batch_curve", "batch_curve", "step time against the batch",
               device_shares=(("batch-curve", 0.06), ("sdpa-backends", 0.02),
                              ("triton-tiles", 0.03), ("cache-reads", 0.03))),
):
    register(_e)


def in_all() -> list[str]:
    """What ``python -m instruments all`` runs, in order."""
    return [e.name for e in EXPERIMENTS.values() if e.in_all]


def device_shares() -> dict[str, float]:
    """The device check's stages, in the order they run, with their shares of its budget."""
    return {stage: share for e in EXPERIMENTS.values() for stage, share in e.device_shares}


def title_of(kind: str) -> str:
    """What a run of ``kind`` is, as the Results page names it (the kind itself when no
    experiment saves it: the published reference, a benchmark's own runs)."""
    return next((e.title for e in EXPERIMENTS.values() if e.kind == kind), kind)


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
