"""One description per mode and per model family: adding either touches one file and one test.

A toy mode (a ``ModeSpec`` and a decoder defined here, nothing else edited) and a toy model family
(a config, a model, a loader defined here) are registered, then looked for everywhere a user meets
modes and models: the CLI's choices and a real CLI run, the sidebar, the gate, the step
predictor, the KV planner and the Results page's names. And the import graph of every project
file has no circle (type-only imports included), and nothing outside ``engine/`` looks a mode,
a peer or a family up but through ``instruments.lineup``.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import families, modes
from engine.decoders.eager import Decoder
from engine.models.config import GPTConfig
from engine.models.gpt2.model import GPT
from engine.modes import ModeSpec
from instruments import cli, experiments, lineup
from instruments.checks.gate import Gate
from instruments.costmodel import kv_plan, predict

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------- a toy mode
class ToyDecoder(Decoder):
    """Mode 5's arithmetic through a decoder of its own (the file a new way of stepping adds)."""

    def __init__(self, model: object, *, batch_size: int = 1, capacity: int | None = None,
                 cache_kind: str | None = "prealloc") -> None:
        super().__init__(model, batch_size=batch_size, capacity=capacity,  # type: ignore[arg-type]
                         cache_kind=cache_kind, mask="none", logits="last")


TOY_MODE = ModeSpec("toy", 50, "50 · toy mode (registered by a test)", "#123456",
                    "Mode 5's step through a decoder defined in the test.",
                    "tests.test_registry:ToyDecoder", roles=frozenset({"planner_step"}))


@pytest.fixture
def toy_mode() -> Iterator[str]:
    modes.register(TOY_MODE)
    try:
        yield TOY_MODE.name
    finally:
        modes.MODES.pop(TOY_MODE.name, None)


def test_a_registered_mode_is_offered_gated_predicted_and_timed(toy_mode: str,
                                                                 tmp_path: Path) -> None:
    # the CLI: a --modes choice, then a real sweep that gates and times it
    sweep = cli.build_parser()._subparsers._group_actions[0].choices["latency"]  # type: ignore
    assert toy_mode in next(a.help for a in sweep._actions if "--modes" in a.option_strings)
    rc = cli.main(["sweep", "--model", "tiny", "--modes", f"uncached,{toy_mode}", "--contexts",
                   "4,8", "--repeats", "1", "--new-tokens", "3", "--no-peaks", "--no-progress",
                   "--results-dir", str(tmp_path)])
    assert rc == 0
    run = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert {r["mode"] for r in run["tables"]["latency"]} == {"uncached", toy_mode}
    assert any(c["mode"] == toy_mode and c["passed"] for c in run["tables"]["checks"])
    # the sidebar
    from ui import state
    assert toy_mode in state.mode_choices("cpu", "gpt2")[0]
    assert state.mode_label(toy_mode) == TOY_MODE.label
    # the gate, on its own
    model = GPT.random(families.config("tiny"), seed=0, std=0.2)
    assert Gate(model).check(toy_mode).passed
    # the predictor: predicted from its spec (prealloc cache, fused attention, own weights)
    recipe = predict.recipe(toy_mode)
    assert recipe == predict.Recipe(True, "out_in", "prealloc_fused", False)
    not_predicted = dataclasses.replace(TOY_MODE, name="toy_graph", predicted="captured: fused")
    modes.register(not_predicted)
    try:
        assert predict.recipe("toy_graph") is None
        why = predict.predict_point(None, "toy_graph", 8)["why"]  # type: ignore[arg-type]
        assert why == "captured: fused"
    finally:
        modes.MODES.pop("toy_graph")
    # the KV planner times the modes of its role
    assert toy_mode in lineup.with_role("planner_step", "cpu", "gpt2")
    # the Results page redraws the saved run with its label, in its colour
    from ui.figures import mode_color, mode_names
    from ui.runs import latency_frame
    assert mode_names(latency_frame(run))[toy_mode] == TOY_MODE.label
    assert mode_color(toy_mode) == "#123456"


def test_a_mode_for_one_family_says_why_not_for_the_others(toy_mode: str) -> None:
    only = dataclasses.replace(TOY_MODE, name="toy_only", families=("llama",),
                               why_not="its step is written for the Llama blocks")
    modes.register(only)
    try:
        ok, why = lineup.available("toy_only", "cpu", "gpt2")
        assert not ok and "Llama blocks" in why
        assert "toy_only" not in lineup.choices("cpu", "gpt2")[0]
        assert lineup.choices("cpu", "gpt2")[1]["toy_only"] == why
        assert cli.main(["sweep", "--model", "tiny", "--modes", "toy_only", "--contexts", "4",
                         "--no-progress"]) == 2
    finally:
        modes.MODES.pop("toy_only")
    with pytest.raises(ValueError, match="say why not"):
        dataclasses.replace(TOY_MODE, families=("gpt2",))


# ------------------------------------------------------------------------- a toy model family
@dataclasses.dataclass(frozen=True)
class ToyConfig(GPTConfig):
    family = "toyfam"


class ToyModel(GPT):
    """GPT-2's arithmetic under another family's name (what a new family's model file adds)."""


@pytest.fixture
def toy_family() -> Iterator[str]:
    families.register_family(families.Family(
        "toyfam", "Toy", "GPT-2's blocks under a test's name.", ToyConfig,
        "tests.test_registry:ToyModel", "engine.models.gpt2.weights",
        "engine.models.gpt2.tokenizer:for_config", step="engine.models.gpt2.step"))
    families.register_preset(families.Preset(
        "toy-1", "toyfam", dict(n_layer=2, n_head=2, n_embd=64, block_size=64,
                                vocab_size=50257), ("random",), "seeded random weights"))
    try:
        yield "toy-1"
    finally:
        families.PRESETS.pop("toy-1", None)
        families.FAMILIES.pop("toyfam", None)


def test_a_registered_family_is_offered_loaded_gated_planned_and_saved(
        toy_family: str, tmp_path: Path) -> None:
    assert toy_family in lineup.models()
    common = ["--model", toy_family, "--no-progress", "--results-dir", str(tmp_path)]
    assert cli.main(["sweep", *common, "--contexts", "4,8", "--repeats", "1", "--new-tokens",
                     "3", "--no-peaks"]) == 0
    run = json.loads(next(tmp_path.glob("*.json")).read_text())
    meta = run["meta"]
    assert meta["model"] == toy_family and meta["family"] == "toyfam"
    # what is written for GPT-2's checkpoints alone (a peer's adapter) is not offered; the
    # modes gate and run
    assert "hf_static" in lineup.choices("cuda", "toyfam")[1]
    assert all(c["passed"] for c in run["tables"]["checks"])
    # saved runs read back as this family's config (the Results page redraws from them)
    cfg = lineup.config_from_dict(meta["config"], meta["family"])
    assert isinstance(cfg, ToyConfig) and cfg.family == "toyfam"
    from ui.runs import latency_frame
    assert latency_frame(run)["bytes"].notna().all()
    # the sidebar offers it with its own weights
    from ui import state
    assert toy_family in state.presets() and state.weight_choices(toy_family) == ["random"]
    # the planner's formulas take its config
    assert kv_plan.kv_bytes_per_token(cfg, "float32") == cfg.kv_bytes_per_token(4)
    # the predictor: its recipes do not depend on the family; the gate holds its modes
    state_ = lineup.load_model(toy_family, "random")
    assert Gate(state_).check("prealloc_fused").passed
    assert experiments.title_of(run["kind"]) == "latency sweep"


# ----------------------------------------------------------------------- the import graph
def _module(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Every project module -> the project modules it imports anywhere (functions and
    ``if TYPE_CHECKING`` blocks included), relative imports resolved."""
    files = [p for f in ("engine", "instruments", "ui", "views", "scripts")
             for p in (root / f).rglob("*.py")] + [p for p in [root / "app.py"] if p.exists()]
    mods = {_module(p, root): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*pkg[: len(pkg) - node.level + 1], *([base] if base else [])])
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
        edges = set()
        for target in found:
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_project_file_imports_one_that_imports_it_back() -> None:
    assert circles(import_graph(ROOT)) == []


def test_the_circle_check_sees_a_type_only_circle(tmp_path: Path) -> None:
    pkg = tmp_path / "instruments"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from instruments import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from .a import thing\n")
    assert circles(import_graph(tmp_path)) == [["instruments.a", "instruments.b"]]


def test_only_the_lineup_looks_modes_and_families_up_outside_the_engine() -> None:
    registries = {"engine.modes", "engine.families"}
    bad = {}
    for folder in ("instruments", "ui", "views", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.parent.name == "lineup":
                continue
            names = set()
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module:
                    names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
                elif isinstance(node, ast.Import):
                    names |= {a.name for a in node.names}
            if names & registries:
                bad[str(path.relative_to(ROOT))] = sorted(names & registries)
    assert not bad
