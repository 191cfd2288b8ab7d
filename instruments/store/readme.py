"""The README generator: every published table made again from run files committed under docs/runs/.

Torch-free. In README.md and in every docs/*.md, a measured table sits between the lines
``<!-- generated: NAME -->`` and ``<!-- end: NAME -->``; ``BLOCKS[NAME]`` says which folder under
docs/runs/ it is made from and which maker (``instruments.store.readme_blocks``) turns that
folder's runs, read with the store's tolerant loader, into Markdown.

  write(root)  rewrite every block from its runs; the documents that changed
  check(root)  one line per block that differs from what its runs give (empty: all match)

``python -m instruments readme`` writes; ``python -m instruments readme --check`` exits non-zero
naming each block that differs (CI runs it after the tests). A folder with no run file yet gives
"no committed run yet" and the command that fills it (its runs are taken on a quiet machine,
never on a shared one); a missing folder, a corrupt or unreadable run file, a block without its
end marker or an unknown block name raises ``ReadmeError``: one line naming the file.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from instruments.store import readme_blocks as mk
from instruments.store import readme_speed as speed
from instruments.store.readme_blocks import ReadmeError, Run, rel
from instruments.store.results import REPO_ROOT, RUNS_PATH, load_runs

__all__ = ["BLOCKS", "ReadmeError", "check", "documents", "write"]


@dataclass(frozen=True)
class Block:
    folder: str | None  # under docs/runs/; None: the block reads no run (the device check's limits)
    make: Callable[[list[Run], Path], str]
    fills: str = ""  # the command whose run files belong in the folder
    recursive: bool = False  # the folder's runs sit in subfolders (a benchmark's layout)


_QUIET = "on a quiet machine, then copy its run files here"
_EXAMPLE = "`python -m instruments all --results-dir docs/runs/examples`"
BLOCKS: dict[str, Block] = {
    "example-sweep": Block("examples", mk.example_sweep, _EXAMPLE),
    "example-end-to-end": Block("examples", mk.example_end_to_end, _EXAMPLE),
    "example-memory": Block("examples", mk.example_memory, _EXAMPLE),
    "example-hardware": Block("examples", mk.example_hardware, _EXAMPLE),
    "planner": Block("planner", mk.planner, "`python -m instruments planner --model gpt2 "
                     "--weights random --results-dir docs/runs/planner`"),
    "predicted-step": Block("predicted-step", mk.predicted_step,
                            "`python scripts/bench_predict.py --keep docs/runs/predicted-step` "
                            "on a quiet machine"),
    "isolation": Block("isolation", mk.isolation, f"`python scripts/bench_isolation.py` {_QUIET}"),
    "sweep-time": Block("sweep", speed.sweep_bench,
                        f"`python scripts/bench_sweep.py --out /tmp/sweep` {_QUIET} (its "
                        "folders: browser-N/, cli/, cli-again/)", recursive=True),
    "sweep-time-epyc": Block("sweep-epyc", speed.sweep_bench, "`python scripts/bench_sweep.py` "
                             "on the 2-core AMD EPYC (kept as measured)", recursive=True),
    "sweep-time-slow-host": Block("sweep-slow-host", speed.sweep_bench, "`python scripts/"
                                  "bench_sweep.py` on a second, slower host of the Xeon kind "
                                  "(kept as measured)", recursive=True),
    "engine-speed": Block("engine-speed", speed.kernels,
                          f"`python scripts/bench_kernels.py` {_QUIET}"),
    "peers": Block("peers", speed.peers, f"`python scripts/bench_peers.py` {_QUIET}"),
    "peers-summary": Block("peers", speed.peers_summary,
                           f"`python scripts/bench_peers.py` {_QUIET}"),
    "peers-epyc": Block("peers-epyc", speed.peers, "`python scripts/bench_peers.py` on the "
                        "2-core AMD EPYC, before CTranslate2 had its own OpenMP runtime (kept as "
                        "measured)"),
    "engine-speed-epyc": Block("engine-speed-epyc", speed.kernels, "`python scripts/"
                               "bench_kernels.py` on the 2-core AMD EPYC (kept as measured)"),
    "peers-before": Block("peers-before", speed.peers, "`python scripts/bench_peers.py` before "
                          "the kernel went into mode 8 (kept as measured)"),
    "speculate": Block("speculate", mk.listing, "`python scripts/bench_speculate.py` "
                       f"{_QUIET}"),
    "speculate-epyc": Block("speculate-epyc", mk.listing, "`python scripts/bench_speculate.py` "
                            "on the 2-core AMD EPYC (kept as measured)"),
    "gpu-check-length": Block(None, mk.gpu_check_length),
}
# A marker is a line of its own (a marker quoted inside a sentence is prose, not a block).
_BLOCK = re.compile(r"^<!-- generated: (?P<name>\S+) -->\n(?P<body>.*?)^<!-- end: (?P=name) -->$",
                    re.S | re.M)
_OPEN = re.compile(r"^<!-- generated: (?P<name>\S+) -->$", re.M)
RUNS_DIR = RUNS_PATH.relative_to(REPO_ROOT)  # docs/runs, inside whichever checkout is read


def documents(root: Path = REPO_ROOT) -> list[Path]:
    """README.md and every docs/*.md: the documents whose blocks are generated."""
    readme = root / "README.md"
    if not readme.is_file():
        raise ReadmeError(f"{readme} is missing")
    return [readme, *sorted((root / "docs").glob("*.md"))]


class _Maker:
    """Makes each block once per command; each folder's runs are loaded once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: dict[str, list[Run]] = {}
        self.made: dict[str, str] = {}

    def folder_runs(self, folder: str, recursive: bool = False) -> list[Run]:
        if folder not in self.runs:
            path = self.root / RUNS_DIR / folder
            if not path.is_dir():
                raise ReadmeError(f"{rel(path, self.root)}/ is missing (a block reads its runs)")
            loaded = load_runs(path, recursive=recursive)
            if loaded.skipped:
                bad, why = loaded.skipped[0]
                raise ReadmeError(f"{rel(bad, self.root)}: {why}")
            self.runs[folder] = loaded.runs
        return self.runs[folder]

    def __call__(self, name: str) -> str:
        if name not in self.made:
            block = BLOCKS[name]
            runs = [] if block.folder is None else self.folder_runs(block.folder,
                                                                     block.recursive)
            if block.folder is not None and not runs:
                body = (f"_No committed run yet: `{(RUNS_DIR / block.folder).as_posix()}/` holds "
                        f"no run file. Run {block.fills}._")
            else:
                body = block.make(runs, self.root).rstrip("\n")
            self.made[name] = body + "\n"
        return self.made[name]


def _blocks(doc: Path, text: str, root: Path) -> list[re.Match[str]]:
    """The document's blocks; a block without its end or with an unknown name is an error."""
    found = list(_BLOCK.finditer(text))
    for m in found:
        inner = _OPEN.search(m["body"])
        if inner:
            raise ReadmeError(f"{rel(doc, root)}: block {m['name']!r} holds the start of block "
                              f"{inner['name']!r}; blocks cannot nest")
    closed = {m.start() for m in found}
    for m in _OPEN.finditer(text):
        if m.start() not in closed:
            raise ReadmeError(f"{rel(doc, root)}: block {m['name']!r} has no "
                              f"`<!-- end: {m['name']} -->` after it")
    for m in found:
        if m["name"] not in BLOCKS:
            raise ReadmeError(f"{rel(doc, root)}: unknown generated block {m['name']!r}; "
                              f"known: {', '.join(BLOCKS)}")
    return found


def _regenerated(root: Path) -> list[tuple[Path, str, str, list[str]]]:
    """(document, text, text with every block made again, names of the blocks that differ)."""
    make = _Maker(root)
    out = []
    for doc in documents(root):
        text = doc.read_text(encoding="utf-8")
        stale = [m["name"] for m in _blocks(doc, text, root) if m["body"] != make(m["name"])]
        new = _BLOCK.sub(lambda m: f"<!-- generated: {m['name']} -->\n{make(m['name'])}"
                         f"<!-- end: {m['name']} -->", text)
        out.append((doc, text, new, stale))
    return out


def write(root: Path = REPO_ROOT) -> list[Path]:
    """Rewrite every generated block from its runs; the documents that changed."""
    changed = []
    for doc, text, new, _stale in _regenerated(root):
        if new != text:
            doc.write_text(new, encoding="utf-8")
            changed.append(doc)
    return changed


def check(root: Path = REPO_ROOT) -> list[str]:
    """One line per generated block that differs from what its runs give (empty: all match)."""
    lines = []
    for doc, _text, _new, stale in _regenerated(root):
        for name in stale:
            folder = BLOCKS[name].folder
            src = "scripts/gpu_check.sh" if folder is None else f"{(RUNS_DIR / folder).as_posix()}/"
            lines.append(f"{rel(doc, root)}: block {name!r} differs from what {src} gives")
    return lines
