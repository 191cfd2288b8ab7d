"""The layers' arrows point one way, the dashboard's server never imports torch, files stay small.

  engine       imports nothing of instruments, ui, views, streamlit or plotly (no module of
               the project imports one that imports it back: tests/test_registry.py)
  instruments  imports neither streamlit, plotly, ui nor views; inside it, each part imports only
               the parts below it (``INSTRUMENT_PARTS``, lowest first)
  ui, views    import no torch -- not directly, and not through anything they import: every page
               is rendered in a fresh interpreter and torch must not be in sys.modules after;
               ui never imports views
  scripts      never import tests or views (a script stands on the library, not on test code)
A measuring experiment runs in a process of its own; nothing that draws may even load torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 420  # "no file over ~400 lines"


def sources(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


def imported(path: Path) -> set[str]:
    """Top-level package names a file imports (absolute imports; relative ones stay inside)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("folder, forbidden", [
    ("engine", {"instruments", "ui", "views", "streamlit", "plotly"}),
    ("instruments", {"streamlit", "plotly", "ui", "views"}),
    ("ui", {"torch", "views"}),
    ("views", {"torch"}),
    ("scripts", {"tests", "views"}),
])
def test_arrows_point_one_way(folder: str, forbidden: set[str]) -> None:
    bad = {str(p.relative_to(ROOT)): sorted(imported(p) & forbidden) for p in sources(folder)}
    assert not {k: v for k, v in bad.items() if v}


# The parts of instruments, lowest first: a part may import itself and the parts before it.
INSTRUMENT_PARTS = ("store", "lineup", "costmodel", "measure", "spine", "peers", "checks",
                    "experiments", "process", "server", "cli", "__main__")


def modules_imported(path: Path, package: str) -> set[str]:
    """Dotted names of ``package``'s modules a file imports anywhere (functions included);
    relative imports resolved against the file's own package."""
    here = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                if path.name != "__init__.py":
                    parts = parts[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return {n for n in names if n == package or n.startswith(package + ".")}


def part_of(dotted: str) -> str | None:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else None


def test_each_part_of_instruments_imports_only_the_parts_below_it() -> None:
    bad = {}
    for path in sources("instruments"):
        mine = part_of(".".join(path.relative_to(ROOT).with_suffix("").parts))
        if mine in (None, "__init__"):
            continue
        assert mine in INSTRUMENT_PARTS, f"{path}: a part the layer test does not know"
        rank = INSTRUMENT_PARTS.index(mine)
        wrong = sorted(m for m in modules_imported(path, "instruments")
                       if (p := part_of(m)) in INSTRUMENT_PARTS
                       and INSTRUMENT_PARTS.index(p) > rank)
        if wrong:
            bad[str(path.relative_to(ROOT))] = wrong
    assert not bad


def test_the_arrow_check_sees_a_wrong_import(tmp_path: Path) -> None:
    wrong = tmp_path / "page.py"
    wrong.write_text("import os\nfrom torch.nn import functional as F\nimport streamlit as st\n")
    assert imported(wrong) == {"os", "torch", "streamlit"}


def test_the_part_check_sees_an_upward_import(tmp_path: Path) -> None:
    pkg = tmp_path / "instruments" / "measure"
    pkg.mkdir(parents=True)
    f = pkg / "x.py"
    f.write_text("def f():\n    from instruments.experiments import latency\n"
                 "from . import sampler\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        got = modules_imported(f, "instruments")
    finally:
        ROOT = saved
    assert "instruments.experiments.latency" in got and "instruments.measure.sampler" in got
    assert INSTRUMENT_PARTS.index(part_of("instruments.experiments.latency")) > \
        INSTRUMENT_PARTS.index("measure")


def test_no_source_file_over_about_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in sources("engine", "instruments", "ui", "views",
                                                        "scripts")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long


SERVER = """
import os, sys
os.environ["KVLAB_TINY"] = "1"
os.environ["KVLAB_RESULTS_DIR"] = sys.argv[1]
from streamlit.testing.v1 import AppTest
first = AppTest.from_file("app.py", default_timeout=120)
first.run()  # the Overview, as a fresh server's first page: no pandas (0.5 s of a 2-core CPU)
print("pandas after the first page:", "pandas" in sys.modules)
for page in ["overview", "generate", "sweep", "peers", "flops", "floor", "memory", "correctness",
             "results"]:
    at = AppTest.from_file("app.py", default_timeout=120)
    at.run()
    at.switch_page(f"views/{page}.py")
    at.run()
    assert not at.exception, (page, [e.message for e in at.exception])
    assert at.title[0].value, page
print("torch loaded:", "torch" in sys.modules)
"""


@pytest.mark.timeout(300)
def test_every_page_renders_without_torch_in_the_server(tmp_path: Path) -> None:
    pytest.importorskip("streamlit")
    out = subprocess.run([sys.executable, "-c", SERVER, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torch loaded: False" in out.stdout, out.stdout
    assert "pandas after the first page: False" in out.stdout, out.stdout


BLOCKED = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("streamlit", "plotly", "playwright", "ui", "views"):
            raise ImportError(f"{name} is not installed here")
sys.meta_path.insert(0, Block())
import pkgutil, importlib, engine, instruments
for pkg in (engine, instruments):
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
from instruments import cli
sys.exit(cli.main(["sweep", "--model", "tiny", "--contexts", "4,8", "--repeats", "1",
                   "--new-tokens", "3", "--no-peaks", "--no-progress", "--results-dir",
                   sys.argv[1]]))
"""


@pytest.mark.timeout(180)
def test_engine_and_instruments_run_without_the_ui_packages(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", BLOCKED, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-2000:]
    assert list(tmp_path.glob("*.json"))


def test_ui_test_files_are_known_so_a_gpu_node_can_skip_them() -> None:
    from tests.conftest import needs_ui

    tests = ROOT / "tests"
    ui_files = sorted(p.name for p in tests.glob("test_*.py") if needs_ui(p))
    assert {"test_app.py", "test_bad_input.py", "test_browser.py", "test_figures.py",
            "test_floor.py", "test_verdicts.py", "test_experiments.py"} <= set(ui_files)
    assert "test_fast.py" not in ui_files and "test_memory.py" not in ui_files
    assert "test_arrows.py" in ui_files  # its server test imports streamlit via importorskip
