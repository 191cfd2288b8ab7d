"""The check that keeps timings out of hand-written tables. Torch-free.

A timing typed into a Markdown table cannot be checked against a run, nor made again when the
code changes; so a table with a timing column belongs between ``<!-- generated: NAME -->`` and
``<!-- end: NAME -->`` (made from committed runs by ``instruments.store.readme``), and prose
quotes a run file by name, host and date. ``loose(doc, root)`` names every other one:

  a table is a line starting with ``|`` followed by a ``|---|`` line, and the ``|`` lines after
  them; it has a timing column when a header cell names a unit of time or speed (``TIMING``:
  ms, s, ×, GB/s, tok/s, TFLOP/s, speedup, latency...) over a column holding a number, or when
  a cell holds a number with such a unit (``3.2 ms``, ``1.4×``, ``24 GB/s``).

Tables inside code fences count too (a fenced table of figures is still a figure); a fenced
example of a format whose cells hold no digits (``... ± ...``) does not.
"""

from __future__ import annotations

import re
from pathlib import Path

from instruments.store.readme_blocks import rel

__all__ = ["TIMING", "loose", "timing_columns"]

# a unit of time or of speed in a header cell
_UNIT = (r"(?:[µu]s|ms|ns|s|seconds?|×(?!\s*\d)|[GMK]B/s|GiB/s|tok(?:ens)?/s|t/s|"
         r"[TGM]?FLOP/s|samples?/s)")
TIMING = re.compile(rf"(?:\(\s*{_UNIT}\s*\)|(?<![\w/'’]){_UNIT}(?![\w/])|\bspeed-?ups?\b|"
                    r"\blatency\b|\bstep time\b|\bthroughput\b)", re.I)
# a number with such a unit in a cell: 3.2 ms, 1.4×, 24 GB/s, 12 s
_FIGURE = re.compile(rf"\d(?:[\d.,]*\d)?\s*{_UNIT}(?![\w/])")
_OPEN = re.compile(r"^<!-- generated: (\S+) -->$")
_RULE = re.compile(r"^\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")


def _cells(line: str) -> list[str]:
    """A table row's cells (escaped pipes stay inside their cell)."""
    inner = line.strip().removeprefix("|").removesuffix("|")
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner)]


def timing_columns(head: list[str], body: list[list[str]]) -> list[str]:
    """The columns that make a table a timing table (empty: it is not one)."""
    found = []
    for i, name in enumerate(head):
        column = [row[i] for row in body if i < len(row)]
        if (TIMING.search(name) and any(re.search(r"\d", c) for c in column)) or \
                any(_FIGURE.search(c) for c in column):
            found.append(name or f"column {i + 1}")
    return found


def loose(doc: Path, root: Path) -> list[str]:
    """One line per table with timing columns outside a generated block: file, line, columns."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    out, block, i = [], None, 0
    while i < len(lines):
        line = lines[i].strip()
        if block is None and (m := _OPEN.match(line)):
            block = m[1]
        elif block is not None:
            if line == f"<!-- end: {block} -->":
                block = None
        elif line.startswith("|") and i + 1 < len(lines) and _RULE.match(lines[i + 1].strip()):
            start, head, body = i, _cells(line), []
            i += 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                body.append(_cells(lines[i]))
                i += 1
            cols = timing_columns(head, body)
            if cols:
                out.append(f"{rel(doc, root)}:{start + 1}: a table with timing columns "
                           f"({', '.join(cols)}) outside a generated block: make it from "
                           "committed runs (a block of instruments.store.readme) or quote "
                           "a run file")
            continue
        i += 1
    return out
