"""The generated blocks made from the checkout itself, not from runs: the CLI's commands, the
scripts, the package tree. Torch-free; nothing here imports the code it describes.

Makers as in ``instruments.store.readme_blocks`` (``make(runs, root) -> str``; ``runs`` is
empty):
  commands  every subcommand of ``python -m instruments`` with its help line, read from
            ``instruments.cli.build_parser()`` of the checkout at ``root`` -- in a process of
            its own, as ``--help`` would be (the store sits below the CLI: it never imports it)
  scripts   every ``scripts/*.py`` and ``*.sh`` with the first sentence of its docstring
            (or of its opening comment)
  layout    every package of the app (``engine``, ``instruments``, ``ui`` and their
            subpackages) with the first sentence of its ``__init__`` docstring and its files;
            ``app.py`` and ``views/`` besides
  modes     every decode mode's label, the model families it runs (and why not the others)
            and its error bound, read off its ``ModeSpec`` through ``instruments.lineup`` in a
            process of its own (the one description of a mode: docs cannot drift from it)
  models    every model preset: family, shapes, K/V bytes a token, where its weights come from
Files are the ones git tracks where ``root`` is a git checkout (work in progress that is not
committed yet does not change a block), else the ones on disk.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from instruments.store.readme_blocks import ReadmeError, Run, md_table, rel

__all__ = ["commands", "first_sentence", "layout", "models", "modes", "scripts"]

PACKAGES = ("engine", "instruments", "ui")
_PARSER = """
import json
from instruments.cli import build_parser
sub = build_parser()._subparsers._group_actions[0]
print(json.dumps([[a.dest, a.metavar or a.dest, a.help or ""] for a in sub._choices_actions]))
"""
_MODES = """
import json
from instruments import lineup
fams = list(lineup.families.FAMILIES)
out = []
for name in lineup.mode_names():
    s = lineup.spec(name)
    out.append([name, s.label, [f for f in fams if s.runs(f)[0]], s.why_not, s.tolerance,
                s.needs, fams])
print(json.dumps(out))
"""
_MODELS = """
import json
from instruments import lineup
out = []
for name in lineup.models():
    c, p = lineup.config(name), lineup.preset(name)
    out.append([name, lineup.family_of(name).title, c.n_layer, c.n_head, c.n_kv_head, c.n_embd,
                c.kv_bytes_per_token(4), p.source or "random weights"])
print(json.dumps(out))
"""
_parsed: dict[str, list[list[str]]] = {}


def first_sentence(text: str | None) -> str:
    """The first sentence of a docstring's first paragraph, on one line ("" when none)."""
    if not text:
        return ""
    para = " ".join(text.strip().split("\n\n")[0].split())
    m = re.search(r"(?<=[.!?])\s+(?=[A-Z`(])", para)
    return para[:m.start()] if m else para


_read: dict[tuple[str, int, int], str] = {}  # first sentences, by path, mtime and size


def _docstring(path: Path, root: Path) -> str:
    try:
        st = path.stat()
        key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
        if key not in _read:
            _read[key] = _first_of(path, path.read_text(encoding="utf-8"), root)
    except OSError as exc:
        raise ReadmeError(f"{rel(path, root)}: could not read: {exc.strerror or exc}") from exc
    return _read[key]


def _first_of(path: Path, source: str, root: Path) -> str:
    if path.suffix == ".sh":  # the opening comment, after the shebang
        comment = []
        for line in source.splitlines()[1:]:
            if not line.startswith("#"):
                break
            comment.append(line.lstrip("#").strip())
        return _clip(first_sentence("\n".join(comment)))
    try:
        return _clip(first_sentence(ast.get_docstring(ast.parse(source))))
    except SyntaxError as exc:
        raise ReadmeError(f"{rel(path, root)}: not valid Python: {exc.msg}") from exc


def _clip(sentence: str, words: int = 30) -> str:
    """A sentence of more than ``words`` words cut before its first aside (" (", " -- ", ": ",
    "; ") that leaves at least six, else after ``words`` words with an ellipsis."""
    if len(sentence.split()) <= words:
        return sentence
    cuts = [i for sep in (" (", " -- ", ": ", "; ") if (i := sentence.find(sep)) > 0
            and len(sentence[:i].split()) >= 6]
    return sentence[:min(cuts)] + "…" if cuts else " ".join(sentence.split()[:words]) + "…"


def _files(root: Path, folder: str) -> list[Path]:
    """The files under ``root/folder``: git's tracked ones in a git checkout, else on disk."""
    if (root / ".git").exists():
        try:
            got = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--", folder],
                                 capture_output=True, text=True, timeout=30, check=True)
            return sorted(root / p for p in got.stdout.split("\0") if p and (root / p).is_file())
        except (OSError, subprocess.SubprocessError):
            pass
    base = root / folder
    return sorted(p for p in base.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


# ---------------------------------------------------------------------------------- commands
def _fingerprint(root: Path) -> str:
    """What the parser is made from: every Python file of the two packages, by content (two
    copies of one checkout share the answer)."""
    h = hashlib.sha1()
    for pkg in ("instruments", "engine"):
        for p in sorted((root / pkg).rglob("*.py")):
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def parser_commands(root: Path) -> list[list[str]]:
    """[name, name with its aliases, help] per subcommand, from the checkout's own parser."""
    return _asked(root, _PARSER, "instruments/cli.py", "build_parser()")


def _asked(root: Path, code: str, where: str, what: str) -> list[list[Any]]:
    """What ``code`` prints as JSON, run in a process of its own over the checkout at ``root``
    (the store sits below what it describes: it never imports it), once per checkout state."""
    key = _fingerprint(root) + hashlib.sha1(code.encode()).hexdigest()
    if key not in _parsed:
        env = {**os.environ, "PYTHONPATH": str(root.resolve())}
        try:
            got = subprocess.run([sys.executable, "-c", code], cwd=root, env=env,
                                 capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as exc:
            raise ReadmeError(f"{where}: could not run {what}: {exc}") from exc
        if got.returncode != 0:
            last = (got.stderr.strip().splitlines() or ["no output"])[-1]
            raise ReadmeError(f"{where}: {what} failed: {last}")
        _parsed[key] = json.loads(got.stdout)
    return _parsed[key]


# ------------------------------------------------------------------------- modes and models
def modes(runs: list[Run], root: Path) -> str:
    rows, whys = [], []
    for name, label, fams, why_not, tol, needs, every in _asked(
            root, _MODES, "engine/modes.py", "the lineup's modes"):
        rung, _, what = label.partition(" · ")
        missing = [f for f in every if f not in fams]  # (the family row says why)
        runs_on = "not " + ", ".join(missing) if missing else "every family"
        if why_not:
            whys += [why_not] if why_not not in whys else []
            runs_on += "†" * (whys.index(why_not) + 1)
        rows.append([rung, f"`{name}`", what.replace("|", "\\|"), runs_on
                     + (f", needs {needs}" if needs else ""), f"{tol:.0%}" if tol else "exact"])
    notes = ["", *(f"{'†' * (i + 1)} {why}." for i, why in enumerate(whys))] if whys else []
    return "\n".join([*md_table(["#", "mode", "what changes", "families", "bound"], rows),
                      *notes])


def models(runs: list[Run], root: Path) -> str:
    rows = [[f"`{name}`", fam, f"{layers} × {heads} heads ({kv} K/V) × {width}",
             f"{kv_bytes:,}", source.split(" (")[0]]
            for name, fam, layers, heads, kv, width, kv_bytes, source
            in _asked(root, _MODELS, "engine/families.py", "the family table")]
    return "\n".join(md_table(["model", "family", "layers × heads × width",
                              "KV bytes a token (fp32)", "weights"], rows))


def commands(runs: list[Run], root: Path) -> str:
    rows = [[f"`{name}`" + (f" ({shown[len(name):].strip(' ()')})" if shown != name else ""),
             help_.replace("|", "\\|")] for name, shown, help_ in parser_commands(root)]
    return "\n".join(["`python -m instruments COMMAND --help` lists a command's flags; older "
                      "names in brackets still work.", "",
                      *md_table(["command", "what it does"], rows)])


# ----------------------------------------------------------------------------------- scripts
def scripts(runs: list[Run], root: Path) -> str:
    paths = [p for p in _files(root, "scripts") if p.suffix in (".py", ".sh")
             and p.parent == root / "scripts"]
    if not paths:
        raise ReadmeError(f"{rel(root / 'scripts', root)}/ holds no script")
    rows = [[f"`{rel(p, root)}`", _docstring(p, root).replace("|", "\\|") or "–"]
            for p in paths]
    return "\n".join(["Each script's docstring says how to run it and what it prints "
                      "(`head` it).", "", *md_table(["script", "what it is"], rows)])


# ------------------------------------------------------------------------------------ layout
LAYOUT_NAMES = 9  # a folder of more files is counted, not listed


def layout(runs: list[Run], root: Path) -> str:
    rows = [["`app.py`", _docstring(root / "app.py", root), "–"]]
    pages = [p for p in _files(root, "views") if p.suffix == ".py"]
    rows.append(["`views/`", "One thin page each: inputs, a request to the measuring process, "
                 "figures.", ", ".join(p.stem for p in pages)])
    for pkg in PACKAGES:
        files = [p for p in _files(root, pkg) if p.suffix in (".py", ".cpp", ".h")]
        folders = sorted({p.parent for p in files if (p.parent / "__init__.py") in files})
        for folder in folders:
            mine = [p for p in files if p.parent == folder and p.name != "__init__.py"]
            names = [p.stem if p.suffix == ".py" else p.name for p in mine]
            rows.append([f"`{rel(folder, root)}/`",
                         _docstring(folder / "__init__.py", root).replace("|", "\\|"),
                         ", ".join(names) if len(names) <= LAYOUT_NAMES else
                         f"{len(names)} files (`ls` them)"])
    return "\n".join(md_table(["folder", "what it holds", "files"], rows))
