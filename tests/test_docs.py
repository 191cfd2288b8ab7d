"""The docs as a new reader meets them: a README of one screen and a half, docs/ short enough to
read, no diary voice ("today", "this session", "this machine": words a reader cannot check),
every page reachable from the README, every relative link and anchor landing somewhere, and every
page opening with its conclusion in at most three lines. Each rule is a function of a checkout's
root, run on this one and, with a planted fault, on a small tree of its own (so each is seen to
fail on what it guards)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from instruments.store.results import REPO_ROOT

README_LINES = 120
DOCS_WORDS = 14_000  # the guide's cap on docs/ (README aside)
DIARY = re.compile(r"\btoday\b|\bthis session\b|\bthis machine\b", re.I)
# blocks that quote the code's own docstrings and help lines verbatim (instruments.store.
# readme_code): their wording is the code's, not the docs' voice
QUOTES = ("commands", "scripts", "layout")
_QUOTED = re.compile(rf"^<!-- generated: (?:{'|'.join(QUOTES)}) -->\n.*?^<!-- end: \S+ -->$",
                     re.S | re.M)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def documents(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def words(root: Path) -> int:
    """docs/*.md by ``str.split``, generated blocks included."""
    return sum(len(p.read_text(encoding="utf-8").split()) for p in (root / "docs").glob("*.md"))


def diary(root: Path) -> list[str]:
    """file:line: phrase, for every diary phrase outside the verbatim quotes of the code."""
    found = []
    for doc in documents(root):
        text = _QUOTED.sub(lambda m: "\n" * m[0].count("\n"), doc.read_text(encoding="utf-8"))
        for i, line in enumerate(text.splitlines(), 1):
            found += [f"{doc.relative_to(root)}:{i}: {m[0]}" for m in DIARY.finditer(line)]
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    text = _FENCE.sub("", doc.read_text(encoding="utf-8"))
    return {slug(m[1]) for m in re.finditer(r"^#{1,6}\s+(.*)$", text, re.M)}


def links(doc: Path) -> list[str]:
    text = _FENCE.sub("", doc.read_text(encoding="utf-8"))
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans hold no links
    return [a or b for a, b in _LINK.findall(text)]


def broken_links(root: Path) -> list[str]:
    """Every relative link (and its #anchor, into a Markdown file) that lands nowhere."""
    bad = []
    for doc in documents(root):
        for target in links(doc):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                bad.append(f"{doc.relative_to(root)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{doc.relative_to(root)}: {target} (no such heading)")
    return bad


def unlinked(root: Path) -> list[str]:
    """docs/*.md that neither the README nor another doc links to."""
    linked = set()
    for doc in documents(root):
        for target in links(doc):
            path = target.partition("#")[0]
            if path and not re.match(r"^[a-z]+:", path):
                dest = (doc.parent / path).resolve()
                if dest != doc.resolve():
                    linked.add(dest)
    return [p.name for p in sorted((root / "docs").glob("*.md")) if p.resolve() not in linked]


def opening(doc: Path) -> list[str]:
    """The first paragraph after the title and the back link: the page's conclusion."""
    lines = doc.read_text(encoding="utf-8").splitlines()[1:]
    while lines and (not lines[0].strip() or lines[0].startswith("[← README]")):
        lines.pop(0)
    return lines[:next((i for i, ln in enumerate(lines) if not ln.strip()), len(lines))]


def long_openings(root: Path) -> list[str]:
    bad = []
    for doc in sorted((root / "docs").glob("*.md")):
        para = opening(doc)
        if not para or len(para) > 3 or para[0].startswith(("#", "|", "<!--", "-", "```")):
            bad.append(f"{doc.name}: {len(para)} line(s) before the first blank line")
    return bad


# --------------------------------------------------------------------------- this checkout
def test_the_readme_fits_one_screen_and_a_half() -> None:
    n = len((REPO_ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_LINES, f"README.md has {n} lines"


def test_the_docs_are_short_enough_to_read() -> None:
    assert words(REPO_ROOT) <= DOCS_WORDS


def test_no_diary_voice() -> None:
    assert diary(REPO_ROOT) == []


def test_every_doc_is_linked_from_the_readme_or_another_doc() -> None:
    assert unlinked(REPO_ROOT) == []


def test_every_relative_link_lands() -> None:
    assert broken_links(REPO_ROOT) == []


def test_every_doc_opens_with_its_conclusion_in_three_lines() -> None:
    assert long_openings(REPO_ROOT) == []


def test_the_readme_walks_a_new_reader_to_the_latency_sweep_and_its_doc() -> None:
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## Start here")
    assert start < text.index("## The two commands")
    first = text[start:text.index("\n## ", start + 1)]
    assert "make run" in first and "**Latency sweep**" in first and "**Run**" in first
    assert "(docs/sweep.md)" in first
    assert "<!-- generated: first-run -->" in first  # how long it takes, from committed runs
    assert "<!-- generated: hosts -->" in text  # what has run where


# ------------------------------------------------------------ each rule sees its fault
@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# R\n\nSee [a](docs/a.md#why).\n", encoding="utf-8")
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n\n[← README](../README.md)\n\nIt works.\nBecause.\n\n## Why\n\nSee [b](b.md).\n",
        encoding="utf-8")
    (tmp_path / "docs" / "b.md").write_text("# B\n\nShort.\n", encoding="utf-8")
    assert (broken_links(tmp_path), unlinked(tmp_path), diary(tmp_path),
            long_openings(tmp_path)) == ([], [], [], [])
    return tmp_path


def test_a_broken_link_or_anchor_is_found(tree: Path) -> None:
    (tree / "docs" / "b.md").write_text("# B\n\nSee [gone](gone.md), [a](a.md#how).\n",
                                         encoding="utf-8")
    assert broken_links(tree) == ["docs/b.md: gone.md (no such file)",
                                  "docs/b.md: a.md#how (no such heading)"]


def test_an_unlinked_doc_is_found(tree: Path) -> None:
    (tree / "docs" / "c.md").write_text("# C\n\nAlone; [itself](c.md).\n", encoding="utf-8")
    assert unlinked(tree) == ["c.md"]


def test_diary_voice_is_found_but_not_in_a_quote_of_the_code(tree: Path) -> None:
    doc = tree / "docs" / "b.md"
    doc.write_text("# B\n\nShort.\n\nMeasured today on This Machine.\n", encoding="utf-8")
    assert diary(tree) == ["docs/b.md:5: today", "docs/b.md:5: This Machine"]
    doc.write_text("# B\n\nShort.\n\n<!-- generated: scripts -->\n| `x.py` | on this machine |\n"
                   "<!-- end: scripts -->\n", encoding="utf-8")
    assert diary(tree) == []


def test_a_long_opening_or_an_oversized_tree_is_found(tree: Path) -> None:
    (tree / "docs" / "b.md").write_text("# B\n\none\ntwo\nthree\nfour\n", encoding="utf-8")
    (tree / "docs" / "d.md").write_text("# D\n\n## At once a heading\n", encoding="utf-8")
    assert long_openings(tree) == ["b.md: 4 line(s) before the first blank line",
                                   "d.md: 1 line(s) before the first blank line"]
    (tree / "docs" / "e.md").write_text("word " * DOCS_WORDS, encoding="utf-8")
    assert words(tree) > DOCS_WORDS
