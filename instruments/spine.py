"""The spine every experiment shares: what is measured on, how progress flows, what is saved.

  ModelSpec      which model a request names (preset, weights, device, dtype, seed); torch-free
  Loaded         a model loaded in the measuring process, with its spec and facts, and all that
                 is kept for it: its ``engine.models.state.ModelState`` (packed copies, compiled
                 steps, mask buffers, the weights' provenance) and ``memo`` (what experiments keep
                 between runs); the measuring process drops all of it with the model
  Event          the one progress type: points done / total, a message, the time left, and
                 optionally one row of one table (rows, generated tokens and progress alike)
  Tracker        what an experiment uses to emit events, count work for the time left, poll
                 Stop, and keep the rows it streamed (the tables of the run it returns)
  Collector      what a watcher uses to keep the streamed rows (a partial run if it all fails)
  no_grad        ``torch.no_grad`` as a decorator that imports torch only when called, so an
                 experiment module stays importable by the torch-free server
  base_meta / record / partial_record   the one result type: a results-schema run (dict)

Each experiment is ``run(loaded, params, progress, should_stop) -> run`` (``instruments.
experiments``). The same call runs in the measuring process, the CLI and the device check.
Importing this module does not import torch.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from instruments.store import results

if TYPE_CHECKING:
    from engine.models.base import CausalLM
    from engine.models.state import ModelState


@dataclass(frozen=True)
class ModelSpec:
    name: str = "gpt2"  # a preset of engine.families (or a test shape: "tiny", "llama-tiny")
    weights: str = "random"  # one of the preset's weight choices, or a checkpoint folder
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0

    def describe(self) -> str:
        return f"{self.name} ({self.weights}) on {self.device}, {self.dtype}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Loaded:
    """A model as the measuring process holds it; replaced, with everything below, when a
    request names another model."""

    model: CausalLM
    spec: ModelSpec
    info: dict[str, Any] = field(default_factory=dict)  # weights label, fallback, shapes
    state: ModelState | None = None  # the model's state (found or made from it when not given)
    # what experiments keep for this model between runs (e.g. the step prediction's
    # calibrations), by a key of their own
    memo: dict[Any, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from engine.models.state import ModelState

        self.state = ModelState.of(self.state or self.model)
        if self.state.model is not self.model:
            raise ValueError("Loaded.state holds another model than Loaded.model")

    def checked(self, params: Any) -> CausalLM:
        """The model, once ``params.check(config, device)`` found the parameters possible on it
        (ValueError naming what is allowed otherwise): how every experiment's run begins."""
        params.check(self.model.config, str(self.model.device))
        return self.model


def load(spec: ModelSpec) -> Loaded:
    """The model a spec names, in eval mode, and what the pages need to know about it."""
    from instruments.lineup import load_model

    state = load_model(spec.name, spec.weights, device=spec.device, dtype=spec.dtype,
                         seed=spec.seed)
    model = state.model
    info = {"weights_label": state.provenance.label,
            "weights_fallback": state.provenance.fallback,
            "config": model.config.to_dict(), "family": model.config.family,
            "params": model.num_params(),
            "device": str(model.device), "dtype": spec.dtype}
    return Loaded(model, spec, info, state)


@dataclass
class Event:
    """One progress report. ``row`` (with its ``table``) is a finished row, or a token."""

    done: int
    total: int
    unit: str = "points"
    message: str = ""
    elapsed_s: float = 0.0
    eta_s: float | None = None
    table: str | None = None
    row: dict[str, Any] | None = None


ProgressFn = Callable[[Event], None]
StopFn = Callable[[], bool]


class Tracker:
    """Emits ``Event``s for one experiment and keeps the rows it streamed, table by table.

    ``work`` counts units of effort for the time-left estimate (``total_work`` of them in all);
    progress callbacks between rows are throttled to two a second.
    """

    def __init__(self, progress: ProgressFn | None, should_stop: StopFn | None, total: int,
                 unit: str = "points", total_work: float | None = None) -> None:
        self.progress, self.should_stop = progress, should_stop
        self.total, self.unit = total, unit
        self.total_work = max(total_work if total_work is not None else float(total), 1e-9)
        self.done, self.work = 0, 0.0
        self.tables: dict[str, list[dict[str, Any]]] = {}
        self.notes: list[str] = []
        self.start_s = time.perf_counter()
        self._last_emit_s = 0.0

    def stop(self) -> bool:
        return bool(self.should_stop and self.should_stop())

    def emit(self, message: str, *, table: str | None = None, row: dict | None = None,
             points: int = 0, force: bool = True) -> None:
        self.done += points
        if table is not None and row is not None:
            self.tables.setdefault(table, []).append(row)
        now = time.perf_counter()
        if self.progress is None or (not force and now - self._last_emit_s < 0.5):
            return
        self._last_emit_s = now
        elapsed = now - self.start_s
        frac = min(self.work / self.total_work, 1.0)
        eta = elapsed * (1 - frac) / frac if frac > 0 else None
        self.progress(Event(self.done, self.total, self.unit, message, elapsed, eta, table, row))

    def row(self, table: str, row: dict[str, Any], message: str = "", points: int = 1) -> None:
        """A finished row: kept for the run, streamed to whoever watches, counted as points."""
        self.emit(message or f"{table}: row {len(self.tables.get(table, [])) + 1}",
                  table=table, row=row, points=points)

    def note(self, text: str) -> None:
        """Something the user must read (a mode not timed, points clipped): kept and shown."""
        self.notes.append(text)
        self.emit(text)


class Collector:
    """Keeps the rows a stream of ``Event``s carried, table by table (a partial run's tables)."""

    def __init__(self) -> None:
        self.tables: dict[str, list[dict[str, Any]]] = {}

    def __call__(self, event: Event) -> None:
        if event.table is not None and event.row is not None:
            self.tables.setdefault(event.table, []).append(event.row)


def no_grad(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` under ``torch.no_grad()``; torch is imported at the call, not here."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper




def _kernel_isa() -> str | None:
    """The instruction set our CPU kernel library was built for (None: not built)."""
    from engine.kernels import cpu as kernels

    try:
        return kernels.isa()
    except (OSError, RuntimeError, ValueError):  # a build that cannot load: torch's kernels ran
        return None


def base_meta(loaded: Loaded, kind: str, params: Any) -> dict[str, Any]:
    """Meta every run of ``kind`` starts with: model, device, versions, and the params."""
    import torch

    from instruments.measure.device import describe_device

    facts = describe_device(str(loaded.model.device))
    p = asdict(params) if params is not None else {}
    spec = loaded.spec
    meta = {**p, "batch_size": p.get("batch_size", 1)}  # the params, flattened into meta
    meta.update(
        experiment=kind, model=spec.name, family=loaded.model.config.family,
        weights=loaded.info.get("weights_label"),
        device=spec.device, device_name=facts["name"], dtype=spec.dtype,
        config=loaded.model.config.to_dict(), threads=torch.get_num_threads(),
        kernel_isa=_kernel_isa() if spec.device == "cpu" else None,  # which build multiplied
        tf32=bool(torch.backends.cuda.matmul.allow_tf32) if spec.device.startswith("cuda")
        else None,
        peaks={"listed": facts.get("listed_peaks"), "measured": None})
    return results.collect_meta(**meta)


def record(loaded: Loaded, kind: str, params: Any, tables: dict[str, list[dict]], *,
           partial: bool = False, notes: list[str] | None = None,
           **extra: Any) -> dict[str, Any]:
    """The run an experiment returns: ``base_meta`` + ``extra`` meta, and its tables.

    ``measured_peaks`` (a dict, or None) is stored as meta.peaks.measured, next to the listed
    datasheet peaks: a saved run carries the peaks its shares were computed with.
    """
    meta = base_meta(loaded, kind, params)
    measured = extra.pop("measured_peaks", None)
    if measured is not None:
        meta["peaks"] = {**meta["peaks"], "measured": measured}
    meta.update(extra)
    meta["partial"] = partial
    meta["notes"] = list(notes or [])  # each one a sentence for the user
    meta["note"] = "; ".join(meta["notes"])
    return results.new_run(kind, meta, {k: v for k, v in tables.items()})


def partial_record(kind: str, meta: dict[str, Any], tables: dict[str, list[dict]],
                   note: str) -> dict[str, Any]:
    """A run from what was streamed before something went wrong, marked partial. Torch-free."""
    meta = {**meta, "partial": True, "note": note, "notes": [note]}
    return results.new_run(kind, meta, {k: list(v) for k, v in tables.items()})
