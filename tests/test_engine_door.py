"""Each family behind one door: inside ``engine/`` the arrows point down, and nothing outside a
family's folder (and the family table) names a family or imports from its folder.

  layers       ``engine``'s rooms, lowest first (``LAYERS``): a module imports only its own room
               and the rooms below it
  family door  no engine module outside ``engine/models/<family>/`` and ``engine/families.py``
               imports a family's folder, and the shared modules of ``engine/models`` none
  names        no code of engine/ (outside those) or instruments/ names a family: no import of
               its folder, no literal of its name, no class of it (``NAMED_FAMILIES``: the few
               left, each with why)
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from .test_arrows import ROOT, modules_imported, sources

# engine's rooms, lowest first; the family table and the mode table sit together above the models
LAYERS = {"dtypes": 0, "kernels": 1, "cache": 2, "models": 3, "families": 4, "checkpoints": 4,
          "modes": 4, "quant": 5, "decoders": 6, "loop": 7, "serving": 7}
KNOWN_UP: set[tuple[str, str]] = set()  # (file, module) allowed to point up: none today


def room(dotted: str) -> str | None:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "engine" else None


def family_folders() -> set[str]:
    return {p.name for p in (ROOT / "engine" / "models").iterdir()
            if p.is_dir() and (p / "__init__.py").exists()}


def upward(path: Path) -> list[str]:
    here = room(".".join(path.relative_to(ROOT).with_suffix("").parts))
    if here not in LAYERS:
        return []
    rel = str(path.relative_to(ROOT))
    return sorted(m for m in modules_imported(path, "engine")
                  if (r := room(m)) in LAYERS and LAYERS[r] > LAYERS[here]
                  and (rel, m) not in KNOWN_UP)


def test_every_module_of_the_engine_is_in_a_known_room() -> None:
    rooms = {room(".".join(p.relative_to(ROOT).with_suffix("").parts))
             for p in sources("engine")}
    assert rooms - {"__init__"} <= set(LAYERS)


def test_no_arrow_points_up_inside_the_engine() -> None:
    bad = {str(p.relative_to(ROOT)): up for p in sources("engine") if (up := upward(p))}
    assert not bad


def test_the_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    import tests.test_arrows as arrows

    f = tmp_path / "engine" / "models" / "loader.py"
    f.parent.mkdir(parents=True)
    f.write_text("from .. import families\nfrom ..cache import make_cache\n")
    saved, arrows.ROOT = arrows.ROOT, tmp_path
    try:
        got = modules_imported(f, "engine")
    finally:
        arrows.ROOT = saved
    assert "engine.families" in got
    assert LAYERS[room("engine.families")] > LAYERS["models"] > LAYERS[room("engine.cache")]


def test_only_a_familys_folder_and_the_table_reach_into_a_family() -> None:
    folders = family_folders()
    assert {"gpt2", "llama"} <= folders
    bad = {}
    for path in sources("engine"):
        rel = path.relative_to(ROOT)
        mine = rel.parts[2] if rel.parts[:2] == ("engine", "models") and len(rel.parts) > 3 \
            else None
        if str(rel) in ("engine/families.py", "engine/checkpoints.py") or mine in folders:
            continue  # the table, and a family's own folder (which may build on another's)
        reached = sorted(m for m in modules_imported(path, "engine")
                         if len(m.split(".")) > 2 and m.split(".")[1] == "models"
                         and m.split(".")[2] in folders)
        if reached:
            bad[str(rel)] = reached
    assert not bad


# ---------------------------------------------- no family named outside its folder and the table
# Outside engine/models/ and engine/families.py the code (docstrings, comments and prose aside)
# names no family: no import of a family's folder, no literal that is a family's name (a
# comparison, a table key), no identifier or bare name of a family's classes. What is left is
# listed here, each with why; a new hit fails, and so does an exception no longer needed.
CLASS_PREFIXES = ("GPT2", "Llama", "Qwen2", "Mistral")  # transformers' classes of our families
NAMED_FAMILIES = {  # (file, the literal or identifier) -> why it may stay
    **{(f"instruments/{f}", "gpt2"): "a preset's name (the default --model), not the family"
       for f in ("cli.py", "spine.py", "store/device_checks.py")},
    ("instruments/lineup/peers.py", "gpt2"): "llama.cpp's GGUF architecture a peer accepts",
    ("instruments/lineup/peers.py", "llama"): "llama.cpp's GGUF architecture a peer accepts",
    ("instruments/lineup/peers.py", "GPT2LMHeadModel"): "transformers' architecture a peer's "
    "converter accepts, matched against Family.architectures",
    ("instruments/lineup/peers.py", "LlamaForCausalLM"): "the same",
    ("instruments/lineup/peers.py", "Qwen2ForCausalLM"): "the same",
    ("instruments/lineup/peers.py", "instruments.peers.llamacpp:LlamaCppDecoder"): "llama.cpp",
    ("instruments/peers/llamacpp.py", "LlamaCppDecoder"): "llama.cpp (the engine), no family",
    ("instruments/peers/gguf_out.py", "LlamaFileType"): "the gguf package's name of file types",
    ("engine/__init__.py", "LlamaConfig"): "engine's lazy re-exports (tests' convenience)",
    ("engine/__init__.py", "models.gpt2.model"): "the same: ``from engine import GPT``",
}


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                and isinstance(first.value.value, str):
            lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def family_names_in(path: Path, families: set[str]) -> list[str]:
    """Identifiers and literals of ``path``'s code naming a family (prose strings aside: a
    literal with a space in it is a sentence)."""
    text = path.read_text(encoding="utf-8")
    docs, found = _docstring_lines(ast.parse(text)), []
    folders = re.compile(r"models\.({})\b".format("|".join(families)))
    classes = re.compile(r"\b({})[A-Za-z]*\b".format("|".join(CLASS_PREFIXES)))
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NAME and tok.string.startswith(CLASS_PREFIXES):
            found.append(tok.string)
        elif tok.type == tokenize.STRING and tok.start[0] not in docs:
            value = tok.string.strip("rbfRBF").strip("'\"")
            if " " in value:
                continue
            if value in families or folders.search(value) or classes.search(value):
                found.append(value)
    for m in modules_imported(path, "engine"):  # a family's folder, imported
        parts = m.split(".")
        if len(parts) > 2 and parts[1] == "models" and parts[2] in families:
            found.append(m)
    return found


def named_families(root: Path) -> dict[tuple[str, str], int]:
    from engine import families as table

    families = set(table.FAMILIES)
    assert all(f.architectures[0].startswith(CLASS_PREFIXES) for f in table.FAMILIES.values())
    hits: dict[tuple[str, str], int] = {}
    for path in sorted([*(root / "engine").rglob("*.py"), *(root / "instruments").rglob("*.py"),
                        root / "app.py"]):
        rel = str(path.relative_to(root))
        if rel.startswith("engine/models/") or rel == "engine/families.py":
            continue
        for name in family_names_in(path, families):
            hits[(rel, name)] = hits.get((rel, name), 0) + 1
    return hits


def test_no_code_outside_the_families_folders_and_the_table_names_a_family() -> None:
    hits = named_families(ROOT)
    assert set(hits) - set(NAMED_FAMILIES) == set()  # a new hit: go through the table
    assert set(NAMED_FAMILIES) - set(hits) == set()  # an exception no longer needed: drop it


def test_the_family_name_check_sees_a_comparison_an_import_and_a_class(tmp_path: Path) -> None:
    import tests.test_arrows as arrows

    (tmp_path / "instruments").mkdir()
    f = tmp_path / "instruments" / "x.py"
    f.write_text('"""Docstrings may say gpt2 and GPT2LMHeadModel."""\n'
                 'from engine.models.llama.model import Llama  # a comment may say "gpt2"\n'
                 'ok = cfg.family == "gpt2"\nhf = GPT2LMHeadModel\nwhy = "not for llama models"\n')
    saved, arrows.ROOT = arrows.ROOT, tmp_path
    try:
        got = family_names_in(f, {"gpt2", "llama"})
    finally:
        arrows.ROOT = saved
    assert sorted(got) == sorted(["Llama", "gpt2", "GPT2LMHeadModel", "engine.models.llama.model",
                                  "engine.models.llama.model.Llama"])
