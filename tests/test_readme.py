"""The README generator: the committed tree matches its runs; a changed digit, a corrupt or
missing run file, a broken marker each fail with one line naming the block or the file; an empty
folder says "no committed run yet"; the makers of the topics still waiting for runs compute what
their rows hold. Every check that changes something works on a copy of the checkout."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from instruments import cli
from instruments.store import readme
from instruments.store.readme import BLOCKS, ReadmeError
from instruments.store.results import REPO_ROOT, collect_meta, new_run, save_run

_BODY = re.compile(r"^<!-- generated: (\S+) -->\n(.*?)^<!-- end: \1 -->$", re.S | re.M)


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """What the generator reads, copied: README.md, docs/ (no screenshots), the A40 reference,
    the device check's script."""
    root = tmp_path / "checkout"
    root.mkdir()
    shutil.copy(REPO_ROOT / "README.md", root / "README.md")
    shutil.copytree(REPO_ROOT / "docs", root / "docs", ignore=shutil.ignore_patterns("*.png"))
    shutil.copytree(REPO_ROOT / "results" / "reference", root / "results" / "reference")
    (root / "scripts").mkdir()
    shutil.copy(REPO_ROOT / "scripts" / "gpu_check.sh", root / "scripts" / "gpu_check.sh")
    return root


def blocks(root: Path) -> list[tuple[Path, str, str]]:
    """(document, block name, body) of every generated block under ``root``."""
    return [(doc, m[1], m[2]) for doc in readme.documents(root)
            for m in _BODY.finditer(doc.read_text(encoding="utf-8"))]


def test_the_committed_tree_matches_its_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert readme.check() == []
    assert cli.main(["readme", "--check"]) == 0
    assert "matches its runs" in capsys.readouterr().out
    found = {name for _, name, _ in blocks(REPO_ROOT)}
    assert found == set(BLOCKS)  # every block is published somewhere, no name is unknown


def test_changing_a_digit_in_any_block_fails_the_check_naming_it(
        copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tried = 0
    for doc, name, body in blocks(copy):
        digits = [m.start() for m in re.finditer(r"\d", body)]
        if not digits:
            continue
        text = doc.read_text(encoding="utf-8")
        start = text.index(f"<!-- generated: {name} -->\n") + len(f"<!-- generated: {name} -->\n")
        for at in sorted({digits[0], digits[len(digits) // 2], digits[-1]}):
            i = start + at
            changed = text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1:]
            doc.write_text(changed, encoding="utf-8")
            stale = readme.check(copy)
            assert len(stale) == 1 and f"block {name!r} differs" in stale[0], (name, at, stale)
            assert stale[0].startswith(doc.relative_to(copy).as_posix())
            tried += 1
        assert cli.main(["readme", "--check", "--root", str(copy)]) == 1
        assert f"block {name!r} differs" in capsys.readouterr().err
        doc.write_text(text, encoding="utf-8")
    assert tried >= 3 * 6  # the example blocks, the planner and the device check's limits
    assert readme.check(copy) == [] and readme.write(copy) == []


def test_rewriting_a_changed_block_restores_it(copy: Path) -> None:
    doc = copy / "docs" / "planner.md"
    committed = doc.read_text(encoding="utf-8")
    doc.write_text(committed.replace("| yes |", "| no |", 1), encoding="utf-8")
    assert readme.write(copy) == [doc]
    assert doc.read_text(encoding="utf-8") == committed and readme.write(copy) == []


def test_an_empty_folder_says_no_committed_run_yet(copy: Path) -> None:
    for run in (copy / "docs" / "runs" / "planner").glob("*.json"):
        run.unlink()
    assert readme.check(copy) == ["docs/planner.md: block 'planner' differs from what "
                                  "docs/runs/planner/ gives"]
    readme.write(copy)
    body = dict((n, b) for _, n, b in blocks(copy))["planner"]
    assert body.startswith("_No committed run yet: `docs/runs/planner/` holds no run file.")
    assert readme.check(copy) == []  # an empty folder passes once its block says so


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_text(p.read_text()[:200]), "not valid JSON"),
    (lambda p: p.write_text(""), "empty file"),
    (lambda p: p.write_text('{"schema_version": 1}'), "missing field"),
])
def test_a_corrupt_run_file_is_one_line_naming_it(copy: Path, damage, message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    (path,) = (copy / "docs" / "runs" / "examples").glob("*latency_sweep*.json")
    damage(path)
    with pytest.raises(ReadmeError) as err:
        readme.check(copy)
    text = str(err.value)
    assert text.startswith(f"docs/runs/examples/{path.name}: ") and message in text
    assert "\n" not in text
    assert cli.main(["readme", "--check", "--root", str(copy)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert path.name in line and line.startswith("instruments: error:")


def test_a_missing_run_file_or_folder_is_one_line_naming_it(copy: Path) -> None:
    (memory,) = (copy / "docs" / "runs" / "examples").glob("*_memory_*.json")
    memory.unlink()
    with pytest.raises(ReadmeError, match=r"^docs/runs/examples/ holds no memory run"):
        readme.check(copy)
    shutil.rmtree(copy / "docs" / "runs" / "examples")
    with pytest.raises(ReadmeError, match=r"^docs/runs/examples/ is missing"):
        readme.check(copy)


def test_the_a40_reference_is_named_when_it_is_gone(copy: Path) -> None:
    (copy / "results" / "reference" / "seed_a40.json").unlink()
    with pytest.raises(ReadmeError, match=r"^results/reference/seed_a40\.json: could not read"):
        readme.check(copy)


@pytest.mark.parametrize("text, message", [
    ("<!-- generated: planner -->\nno end\n", "block 'planner' has no `<!-- end: planner -->`"),
    ("<!-- generated: nope -->\n<!-- end: nope -->\n", "unknown generated block 'nope'"),
    ("<!-- generated: planner -->\n<!-- generated: peers -->\n<!-- end: peers -->\n"
     "<!-- end: planner -->\n", "block 'planner' holds the start of block 'peers'"),
])
def test_a_broken_marker_is_named(copy: Path, text: str, message: str) -> None:
    (copy / "docs" / "extra.md").write_text("# Extra\n\n" + text, encoding="utf-8")
    with pytest.raises(ReadmeError, match=re.escape(f"docs/extra.md: {message}")):
        readme.check(copy)


def test_the_device_checks_length_follows_its_script(copy: Path) -> None:
    script = copy / "scripts" / "gpu_check.sh"
    script.write_text(script.read_text().replace("timeout 240 ", "timeout 420 "))
    assert readme.check(copy) == ["README.md: block 'gpu-check-length' differs from what "
                                  "scripts/gpu_check.sh gives"]
    readme.write(copy)
    assert "(120 s and 420 s): it runs for at most 9 minutes" in (copy / "README.md").read_text()


# ----------------------------------------------------------- makers waiting for their runs
def _save(folder: Path, kind: str, tables: dict, when: str, **meta: object) -> None:
    run = new_run(kind, collect_meta(model="gpt2", device="cpu", device_name="Test CPU",
                                     dtype="float32", threads=1, **meta), tables)
    run["created_utc"] = when
    save_run(run, folder)


def _latency(mode: str, steps: dict[int, float], **extra: object) -> list[dict]:
    return [{"mode": mode, "context_len": t, "phase": "decode", "latency_ms": ms,
             "samples_ms": [ms, ms], **extra} for t, ms in steps.items()]


def test_the_predicted_step_table_names_each_groups_worst_miss(copy: Path) -> None:
    verdicts = [{"mode": "concat", "cached": True, "goal_share": 0.15, "worst_share": 0.141,
                 "worst_context": 273},
                {"mode": "fast", "cached": True, "goal_share": 0.15, "worst_share": 0.05,
                 "worst_context": 8},
                {"mode": "prealloc", "cached": True, "goal_share": 0.15, "worst_share": 0.105,
                 "worst_context": 10},
                {"mode": "uncached", "cached": False, "goal_share": 0.25, "worst_share": 0.199,
                 "worst_context": 1024},
                {"mode": "compiled", "cached": True, "goal_share": 0.15, "worst_share": None,
                 "worst_context": None}]
    _save(copy / "docs" / "runs" / "predicted-step", "step_prediction", {"verdicts": verdicts},
          "2026-12-01T10:00:00+00:00")
    readme.write(copy)
    body = (copy / "docs" / "predicted-step.md").read_text()
    assert "| worst miss, cached modes (goal 15%) | worst miss, uncached modes (goal 25%) |" in body
    assert "14.1% (`concat` at 273 tokens); others 5.0%–10.5%" in body
    assert "19.9% (`uncached` at 1,024 tokens) | `compiled` |" in body


def test_the_isolation_table_sets_each_run_against_the_nearest_cli_run(copy: Path) -> None:
    folder = copy / "docs" / "runs" / "isolation"
    page = _latency("concat", {8: 40.0, 16: 44.0, 24: 120.0})
    page[-1].update(set_aside_ms=[160.0], disturbed_kept=1)
    _save(folder, "latency_sweep", {"latency": page}, "2026-12-01T10:00:00+00:00",
          retakes=3)  # from a page: no command line
    _save(folder, "latency_sweep", {"latency": _latency("concat", {8: 50.0, 16: 44.0,
                                                                   24: 60.0})},
          "2026-12-01T10:05:00+00:00", retakes=3, command="latency --retakes 3")
    _save(folder, "latency_sweep", {"latency": _latency("concat", {8: 40.0, 16: 44.0,
                                                                   24: 60.0})},
          "2026-12-01T11:00:00+00:00", retakes=0, command="latency --retakes 0")
    readme.write(copy)
    rows = [line for line in (copy / "docs" / "measured-apart.md").read_text().splitlines()
            if line.startswith("| `")]
    # the page's run: median 44, largest 120 (2.73x), one set aside at 160 (3.6x), one kept;
    # against the CLI run 5 minutes later: 0.8, 1.0, 2.0
    assert rows[0].endswith("| a page | on | `concat` | 44.0 | 2.73× | 1 (3.6×); 1 | "
                            "1.000 (0.80–2.00) |")
    # the two CLI runs against each other: 50/40, 1, 1 and back
    assert rows[1].endswith("| CLI | on | `concat` | 50.0 | 1.20× | 0; 0 | 1.000 (1.00–1.25) |")
    assert rows[2].endswith("| CLI | off | `concat` | 44.0 | 1.36× | 0; 0 | 1.000 (0.80–1.00) |")


def test_the_sweep_table_reads_the_benchmarks_folders(copy: Path) -> None:
    folder = copy / "docs" / "runs" / "sweep"
    for sub in folder.iterdir():  # the committed runs make way for these
        if sub.is_dir():
            shutil.rmtree(sub)
    both = {1: 100.0, 8: 10.0}
    _save(folder / "browser-1", "latency_sweep",
          {"latency": _latency("uncached", {1: 108.0, 8: 200.0}) + _latency("concat", both)},
          "2026-12-01T10:00:00+00:00", retakes={"retaken": 2, "flagged_consistent": 5,
                                                 "disturbed_kept": 0, "confirmed_by_prediction": 0})
    _save(folder / "browser-1", "sweep_browser_timing",
          {"timing": [{"first_s": 4.2, "total_s": 95.0}]}, "2026-12-01T10:02:00+00:00")
    _save(folder / "cli", "latency_sweep",
          {"latency": _latency("uncached", {1: 100.0, 8: 200.0}) + _latency("concat", both)},
          "2026-12-01T10:05:00+00:00")
    _save(folder / "cli-again", "latency_sweep",
          {"latency": _latency("uncached", {1: 100.0, 8: 200.0}) + _latency("concat", both)},
          "2026-12-01T10:07:00+00:00", timings={"total_s": 61.0})
    readme.write(copy)
    body = (copy / "docs" / "sweep.md").read_text()
    # 95 s misses the 90 s goal; mode 1 at 1 token 8% slower than the CLI: within 10%
    assert "| browser-1 | 4.2 | 95 | no | 2 / 5 / 0 | 0 | 1.040 (1.00–1.08; 2/2 within 10%) | " \
        "1.000 (1.00–1.00; 2/2 within 10%) |" in body
    assert "| CLI again (noise floor) | – | 61 |" in body
    assert readme.check(copy) == []


def test_the_peers_table_sets_each_engine_against_the_floor_of_its_own_run(copy: Path) -> None:
    folder = copy / "docs" / "runs" / "peers"
    for p in folder.glob("*.json"):
        p.unlink()

    def rows(threads: int, fast_ms: float) -> list[dict]:
        return [{"engine": "fast", "context_len": 128, "latency_ms": fast_ms, "floor_ms": 40.0,
                 "x_floor": fast_ms / 40.0, "x_fastest_exact": 1.0},
                {"engine": "ct2_float32", "context_len": 128, "latency_ms": 60.0,
                 "floor_ms": 40.0, "x_floor": 1.5},
                {"engine": "ort_float32", "available": False, "latency_ms": None,
                 "why": "pip install onnxruntime"}]

    _save(folder, "peers", {"peers": rows(1, 50.0)}, "2026-12-01T10:00:00+00:00")
    _save(folder, "peers", {"peers": rows(1, 48.0)}, "2026-12-01T11:00:00+00:00")  # newest
    readme.write(copy)
    body = (copy / "docs" / "peers.md").read_text()
    assert "| 1 | 128 | 40.0 | 1.20× | 1.50× |" in body  # the newest run of 1 thread only
    assert "| 1 | 128 | 40.0 | 1.25× |" not in body
    assert "not timed: `ort_float32` (pip install onnxruntime)" in body
    # the README's summary: ours against CTranslate2 at the same precision, from the same run
    summary = (copy / "README.md").read_text()
    assert "| 1 | 128 | 40.0 | `fast` | 48.0 (1.20×) | 60.0 (1.50×) | 0.80 | – | – | – |" in summary
