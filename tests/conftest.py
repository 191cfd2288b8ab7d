"""Shared fixtures: small lively models, and the offline tokenizer cache when it exists.

On a machine without the dashboard's packages (a GPU node with only torch, transformers, pandas,
psutil, tiktoken and pytest), test files that import streamlit, plotly, playwright, ``ui`` or
hypothesis -- directly or through another test file -- are not collected when that package is
absent, so the rest (the CUDA tests among them) still run. Test modules marked ``native``
(llama.cpp, CTranslate2, ONNX Runtime, OpenVINO driven in-process) run in a child pytest
process, so a crash fails a test, not the suite (``tests/isolate.py``).
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from engine import GPT, GPTConfig
from instruments.spine import Loaded, ModelSpec
from tests import isolate

_SHARED_TOKENIZER = Path(__file__).resolve().parents[2] / "shared/gpt2_tokenizer/tiktoken_cache"
if "TIKTOKEN_CACHE_DIR" not in os.environ and _SHARED_TOKENIZER.is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(_SHARED_TOKENIZER)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
if not torch.cuda.is_available():  # Triton kernels run in its interpreter (read at import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

UI_PACKAGES = {"streamlit", "plotly", "playwright", "ui"}
# Packages a test file may import at its top that a GPU node lacks: such a file is left out there.
OPTIONAL_PACKAGES = UI_PACKAGES | {"hypothesis"}


def pytest_configure(config: pytest.Config) -> None:
    isolate.register(config)


def needs_ui(path: Path, seen: frozenset[Path] = frozenset(),
             packages: frozenset[str] = frozenset(UI_PACKAGES)) -> bool:
    """Whether a test file imports one of ``packages`` (the UI's by default), itself or through a
    sibling test file."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level and node.module:
                sibling = path.parent / f"{node.module}.py"
                if (sibling.exists() and sibling not in seen
                        and needs_ui(sibling, seen | {path}, packages)):
                    return True
                continue
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip":
            names = [a.value for a in node.args if isinstance(a, ast.Constant)]
        if any(str(n).split(".")[0] in packages for n in names):
            return True
    return False


_UI_MISSING = any(importlib.util.find_spec(p) is None for p in ("streamlit", "plotly"))
_ABSENT = frozenset((UI_PACKAGES if _UI_MISSING else set())
                    | {p for p in OPTIONAL_PACKAGES - UI_PACKAGES
                       if importlib.util.find_spec(p) is None})
collect_ignore = [p.name for p in Path(__file__).parent.glob("test_*.py")
                  if _ABSENT and needs_ui(p, packages=_ABSENT)]

SMALL = dict(n_layer=2, n_head=4, n_embd=64, block_size=256, vocab_size=512)


def small_model(mask: str = "none", seed: int = 1, **shape: int) -> GPT:
    """A tiny model whose random weights are large enough to give varied greedy tokens."""
    cfg = GPTConfig(**{**SMALL, **shape, "mask": mask})
    return GPT.random(cfg, seed=seed, std=0.2)


def random_prompt(n: int, batch: int = 1, vocab: int = 512, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def model() -> GPT:
    return small_model()


def loaded_model(model: GPT, name: str = "tiny") -> Loaded:
    """A model as the measuring process holds it (what every experiment's run takes)."""
    dtype = str(model.dtype).removeprefix("torch.")
    return Loaded(model, ModelSpec(name, "random", str(model.device), dtype),
                  {"weights_label": "random (test model)"})
