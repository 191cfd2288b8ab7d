"""The README generator: every published table made again from run files committed under docs/runs/.

Torch-free. In README.md and in every docs/*.md, a measured table sits between the lines
``<!-- generated: NAME -->`` and ``<!-- end: NAME -->``; ``BLOCKS[NAME]`` says which folder under
docs/runs/ it is made from and which maker (``instruments.store.readme_blocks``) turns that
folder's runs, read with the store's tolerant loader, into Markdown.

  write(root)  rewrite every block from its runs; the documents that changed
  check(root)  one line per block that differs from what its runs give, and one per Markdown
               table with timing columns outside a generated block (``readme_tables``):
               a hand-written timing table can neither be checked nor regenerated (empty: all
               good)

``python -m instruments readme`` writes; ``python -m instruments readme --check`` exits non-zero
naming each block that differs and each loose timing table by file and line (CI runs it after
the tests). A block reads one folder under docs/runs/ (``folder``; ``""``: all of it), maybe
more (``more``), or none: the blocks made from the checkout itself -- the CLI's commands, the
scripts, the package tree (``readme_code``), the device check's limits. A folder with no run
file yet gives "no committed run yet" and the command that fills it (its runs are taken on a
quiet machine, never on a shared one); a missing folder, a corrupt or unreadable run file, a
block without its end marker or an unknown block name raises ``ReadmeError``: one line naming
the file.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from instruments.store import device_checks as gpu
from instruments.store import readme_blocks as mk
from instruments.store import readme_code as code
from instruments.store import readme_llama as llama
from instruments.store import readme_prefix as prefix
from instruments.store import readme_serving as serving
from instruments.store import readme_serving_http as http
from instruments.store import readme_speed as speed
from instruments.store import readme_tables
from instruments.store.readme_blocks import ReadmeError, Run, rel
from instruments.store.results import REPO_ROOT, RUNS_PATH, ResultsError, load_run

__all__ = ["BLOCKS", "ReadmeError", "check", "documents", "write"]


@dataclass(frozen=True)
class Block:
    folder: str | None  # under docs/runs/ ("": all of it); None: the block reads no run
    make: Callable[[list[Run], Path], str]
    fills: str = ""  # the command whose run files belong in the folder
    recursive: bool = False  # the folder's runs sit in subfolders (a benchmark's layout)
    more: tuple[str, ...] = ()  # further folders whose runs the maker gets too (same layout)
    source: str = ""  # what a block that reads no run is made from (named when it differs)

    def folders(self) -> tuple[str, ...]:
        return () if self.folder is None else (self.folder, *self.more)


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
    "engine-speed": Block("engine-speed", speed.kernels,
                          f"`python scripts/bench_kernels.py` {_QUIET}"),
    "peers": Block("peers", speed.peers, f"`python scripts/bench_peers.py` {_QUIET}"),
    "speculate": Block("speculate", speed.speculation, "`python scripts/bench_speculate.py` "
                       f"{_QUIET}"),
    "first-run": Block("sweep", speed.first_run, "`python scripts/bench_sweep.py`",
                       recursive=True, more=("sweep-slow-host", "sweep-epyc",
                                                       "sweep-first", "sweep-first-make-run")),
    "hosts": Block("", mk.hosts, "a script or command named in docs/runs/README.md",
                   recursive=True),
    "gpu-check-length": Block(None, mk.gpu_check_length, source="scripts/gpu_check.sh"),
    "commands": Block(None, code.commands, source="the CLI's parser (instruments/cli.py)"),
    "scripts": Block(None, code.scripts, source="the docstrings of scripts/"),
    "layout": Block(None, code.layout, source="the package tree"),
    "modes": Block(None, code.modes, source="each mode's ModeSpec (engine/modes.py)"),
    "llama-checks": Block("smollm2", llama.llama_checks, "`python -m instruments correctness "
                          "--model smollm2-135m --results-dir docs/runs/smollm2`"),
    "llama-runs": Block("smollm2", llama.llama_runs, "`python -m instruments sweep --model "
                        "smollm2-135m --modes uncached,concat,prealloc_fused,fast --contexts "
                        "16,256,1024` and `memory --model smollm2-135m --memory-contexts 1024`, "
                        "each `--threads 1 --results-dir docs/runs/smollm2`"),
    "llamacpp": Block("peers-llamacpp", llama.llamacpp, "`python scripts/bench_peers.py --model "
                      "smollm2-135m --out docs/runs/peers-llamacpp` (GPT-2's: `python scripts/"
                      f"bench_peers.py --out docs/runs/peers`) {_QUIET}", more=("peers",)),
    "llamacpp-summary": Block("peers-llamacpp", llama.llamacpp_summary, "`python scripts/"
                              "bench_peers.py --model smollm2-135m --out docs/runs/"
                              f"peers-llamacpp` (and GPT-2's into `peers/`) {_QUIET}",
                              more=("peers",)),
    "speculate-smollm2": Block("speculate-smollm2", speed.speculation, "`python scripts/"
                               "bench_speculate.py --models smollm2-135m --threads 1 "
                               f"--results-dir docs/runs/speculate-smollm2` {_QUIET}"),
    "models": Block(None, code.models, source="the family table (engine/families.py)"),
    "serving-http": Block("serving-http", http.serving_http, "`python scripts/bench_server.py "
                          f"--out docs/runs/serving-http` {_QUIET}"),
    **{f"prefix-{part}": Block("prefix", getattr(prefix, f"prefix_{part}"),
                               "`python scripts/bench_prefix.py` (it waits for a quiet host and "
                               "writes its runs here)")
       for part in ("targets", "ttft", "chat", "workload")},
    **{f"serving-{part}": Block("serving", getattr(serving, f"serving_{part}"),
                                "`python scripts/bench_serving.py` (it waits for a quiet host "
                                "and writes its runs here)")
       for part in ("targets", "step", "concurrency", "load", "budget", "schedule")},
    "gpu-checks": Block("gpu", gpu.checks_block, "`scripts/gpu_check.sh --out docs/runs/gpu/"
                        "<date>-<gpu>` on a GPU machine (its run files and logs)",
                        recursive=True),
    "gpu-brief": Block("gpu", gpu.brief_block, "`scripts/gpu_check.sh --out docs/runs/gpu/"
                       "<date>-<gpu>` on a GPU machine", recursive=True),
    "gpu-kernels": Block("gpu", gpu.kernels_block, "the device check's `triton-tiles`, "
                         "`cache-reads`, `sdpa-backends` and `batch-curve` stages on a GPU "
                         "(`scripts/gpu_check.sh --out docs/runs/gpu/<date>-<gpu>`)",
                         recursive=True),
    "gpu-modes": Block("gpu-first-light", gpu.modes_block, "first light's sweeps (../shared/"
                       "gpu-runs/2026-12-04/README.md) and each device check's",
                       recursive=True, more=("gpu",)),
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
        self.runs: dict[tuple[str, bool], list[Run]] = {}
        self.made: dict[str, str] = {}

    def folder_runs(self, folder: str, recursive: bool = False) -> list[Run]:
        if (folder, recursive) not in self.runs:
            path = self.root / RUNS_DIR / folder
            if not path.is_dir():
                raise ReadmeError(f"{rel(path, self.root)}/ is missing (a block reads its runs)")
            self.runs[folder, recursive] = _load_runs(path, recursive, self.root)
        return self.runs[folder, recursive]

    def __call__(self, name: str) -> str:
        if name not in self.made:
            block = BLOCKS[name]
            runs = [r for f in block.folders() for r in self.folder_runs(f, block.recursive)]
            if block.folder is not None and not runs:
                body = (f"_No committed run yet: `{_where(block)}` holds "
                        f"no run file. Run {block.fills}._")
            else:
                body = block.make(runs, self.root).rstrip("\n")
            self.made[name] = body + "\n"
        return self.made[name]


_LOADED: dict[tuple[str, int, int], Run] = {}  # run files read before, by path, mtime and size


def _load_runs(folder: Path, recursive: bool, root: Path) -> list[Run]:
    """``results.load_runs`` for a block (oldest first), each file read once while it is
    unchanged (a check reads every folder again); an unreadable file raises, naming it."""
    paths = sorted(folder.rglob("*.json") if recursive else folder.glob("*.json"))
    runs = []
    for path in paths:
        if path.name.startswith(".") or not path.is_file():
            continue
        st = path.stat()
        key = (str(path.resolve()), st.st_mtime_ns, st.st_size)
        if key not in _LOADED:
            try:
                _LOADED[key] = load_run(path)
            except ResultsError as exc:
                raise ReadmeError(f"{rel(path, root)}: {exc}") from exc
        runs.append({**_LOADED[key], "path": str(path)})
    return sorted(runs, key=lambda r: (str(r["created_utc"]), r["path"]))


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


def _where(block: Block) -> str:
    """What a block is made from, as its messages name it: ``docs/runs/peers/`` or its source."""
    if block.folder is None:
        return block.source
    return " and ".join(f"{(RUNS_DIR / f).as_posix()}/" for f in block.folders())


def check(root: Path = REPO_ROOT) -> list[str]:
    """One line per generated block that differs from what its runs give, then one per table
    with timing columns outside a generated block (empty: all good)."""
    lines = []
    for doc, _text, _new, stale in _regenerated(root):
        for name in stale:
            lines.append(f"{rel(doc, root)}: block {name!r} differs from what "
                         f"{_where(BLOCKS[name])} gives")
    for doc in documents(root):
        lines += readme_tables.loose(doc, root)
    return lines
