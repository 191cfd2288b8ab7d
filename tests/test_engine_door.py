"""Each family behind one door: inside ``engine/`` the arrows point down, and nothing outside a
family's folder (and the family table) names a family or imports from its folder.

  layers       ``engine``'s rooms, lowest first (``LAYERS``): a module imports only its own room
               and the rooms below it
  family door  no engine module outside ``engine/models/<family>/`` and ``engine/families.py``
               imports a family's folder, and the shared modules of ``engine/models`` none
"""

from __future__ import annotations

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
