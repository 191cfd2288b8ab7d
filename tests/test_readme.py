"""The README generator: the committed tree matches its runs; a changed digit, a corrupt or
missing run file, a broken marker each fail with one line naming the block or the file; an empty
folder says "no committed run yet"; a hand-written timing table fails the check, naming its file
and line; the blocks made from the checkout (commands, scripts, layout) follow it; each maker
computes what its rows hold. Every check that changes something works on a copy of the
checkout."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from instruments import cli
from instruments.store import readme
from instruments.store.readme import BLOCKS, ReadmeError
from instruments.store.results import REPO_ROOT, collect_meta, load_runs, new_run, save_run
from instruments.store.sweep_bench import first_rows

_BODY = re.compile(r"^<!-- generated: (\S+) -->\n(.*?)^<!-- end: \1 -->$", re.S | re.M)


CODE = ("app.py", "engine", "instruments", "pages", "scripts", "ui")


def _tracked(*paths: str) -> list[str]:
    """The files git tracks under ``paths`` (what a clean checkout holds), else those on disk."""
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files", "-z", "--", *paths],
                             capture_output=True, text=True, check=True).stdout
        return [p for p in out.split("\0") if p and (REPO_ROOT / p).is_file()]
    except (OSError, subprocess.SubprocessError):
        found = [p for path in paths for p in ([REPO_ROOT / path] if (REPO_ROOT / path).is_file()
                                                else (REPO_ROOT / path).rglob("*"))]
        return [p.relative_to(REPO_ROOT).as_posix() for p in found
                if p.is_file() and "__pycache__" not in p.parts]


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """What the generator reads, copied: README.md, docs/ (no screenshots), the A40 reference,
    and the code the checkout-made blocks describe (its tracked files: no git in the copy),
    every block made again there."""
    root = tmp_path / "checkout"
    root.mkdir()
    shutil.copy(REPO_ROOT / "README.md", root / "README.md")
    shutil.copytree(REPO_ROOT / "docs", root / "docs", ignore=shutil.ignore_patterns("*.png"))
    shutil.copytree(REPO_ROOT / "results" / "reference", root / "results" / "reference")
    for rel_path in _tracked(*CODE):
        (root / rel_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO_ROOT / rel_path, root / rel_path)
    # start from blocks that match (code changed but not yet regenerated fails one test, the
    # first below, not every test of a copy)
    readme.write(root)
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
    assert readme.check(copy) == ["README.md: block 'hosts' differs from what docs/runs/ gives",
                                  "docs/planner.md: block 'planner' differs from what "
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
    script.write_text(script.read_text().replace("LIMIT_S=360", "LIMIT_S=540").replace(
        "TESTS_S=120", "TESTS_S=90"))
    assert readme.check(copy) == ["docs/running.md: block 'gpu-check-length' differs from what "
                                  "scripts/gpu_check.sh gives"]
    readme.write(copy)
    said = (copy / "docs" / "running.md").read_text()
    assert "stops at 540 s (9 minutes), its CUDA tests at 90 s." in said


# ----------------------------------------------------------- makers waiting for their runs
def _save(folder: Path, kind: str, tables: dict, when: str, **meta: object) -> None:
    fields = {"model": "gpt2", "device": "cpu", "device_name": "Test CPU", "dtype": "float32",
              "threads": 1, **meta}
    run = new_run(kind, collect_meta(**fields), tables)
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
    verdicts[0]["within"], verdicts[2]["within"] = True, False
    prediction = [{"mode": "concat", "context_len": t, "residual_ms": ms}
                  for t, ms in ((8, 4.5), (273, 9.9), (1024, -1.25))]
    _save(copy / "docs" / "runs" / "predicted-step", "step_prediction",
          {"verdicts": verdicts, "prediction": prediction}, "2026-12-09T10:00:00+00:00")
    readme.write(copy)
    body = (copy / "docs" / "predicted-step.md").read_text()
    assert "| worst miss, cached modes (goal 15%) | worst miss, uncached modes (goal 25%) |" in body
    assert "14.1% (`concat` at 273 tokens); others 5.0%–10.5%" in body
    assert "19.9% (`uncached` at 1,024 tokens) | `compiled` |" in body
    # the newest run per mode: its residuals over the contexts, from the smallest to the largest
    assert "| `concat` | 14.1% at 273 tokens | -1.2 to +9.9 | yes |" in body
    assert "| `prealloc` | 10.5% at 10 tokens | — | **no** |" in body  # no residual rows
    assert "| `compiled` | — | — | — |" in body


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
    # the README's first-run line for this host: one browser run, its two times
    first = (copy / "README.md").read_text()
    assert "| Test CPU (" in first and "| 2026-12-01 | 1 | 4.2–4.2 | 95–95 | `sweep/` |" in first
    assert readme.check(copy) == []


def test_the_first_minutes_table_spans_its_days_and_keeps_hosts_and_runs_apart(copy: Path
                                                                               ) -> None:
    folder = copy / "docs" / "runs" / "sweep-first"
    shutil.rmtree(folder)

    def timing(paint_s: float, **how: object) -> dict:
        row = {"read_every_s": 0.1, "server_up_s": 0.8, "bare_title_s": 1.8,
               "page_title_s": 1.9, "page_settled_s": 2.5, "page_filled_s": 6.0,
               "settled_point_s": 1.5, "paint_point_s": paint_s, "paint_run_s": 1.0, **how}
        return {"timing": [{k: v for k, v in row.items() if v is not None}]}

    _save(folder / "every-0.1s-run-9", "sweep_first_timing", timing(4.0),
          "2026-12-01T10:00:00+00:00")
    _save(folder / "every-0.1s-run-10", "sweep_first_timing",  # 0.6 s over the bare app: missed
          timing(6.0, page_title_s=2.4), "2026-12-02T10:00:00+00:00")
    _save(folder / "every-0.1s-run-13", "sweep_first_timing",  # no bare app timed: not judged
          timing(5.0, bare_title_s=None, settled_point_s=3.5), "2026-12-02T10:30:00+00:00")
    _save(folder / "every-0.1s-run-11", "sweep_first_timing", timing(9.0),
          "2026-12-02T11:00:00+00:00", device_name="Other CPU")
    _save(folder / "every-0.1s-run-12", "sweep_first_timing",
          timing(3.0, started_with="make run"), "2026-12-02T12:00:00+00:00")
    readme.write(copy)
    body = (copy / "README.md").read_text()
    # one row per host and way of starting the app, each with the days of its own runs only;
    # the first page judged against the bare app beside it, the first point against 3 s
    before = "| `streamlit run app.py` | 0.1 s |"
    assert f"| 2026-12-01 – 2026-12-02 {before} 3 |" in body
    assert "| +0.1 – +0.6 | 1.5–3.5 | 4.0–6.0 | 1 of 2 (1 without a bare app) | 2 of 3 |" in body
    assert "| 2026-12-02 | `make run` | 0.1 s | 1 |" in body
    assert "| +0.1 | 1.5 | 3.0 | 1 of 1 | 1 of 1 |" in body
    assert "| Other CPU (" in body and f"| 2026-12-02 {before} 1 |" in body
    assert "first page ≤ a bare Streamlit app's title + 0.5 s" in body and "≤ 2 s" not in body
    # the verdict over every committed run (here beside the copy's make-run ones): run 13 alone
    # could not judge the first page
    assert " runs (and 1 timed no bare app), the first point in " in body
    # run 9 before run 10, not after it as a string sort would put it
    order = [t["folder"] for t in first_rows(load_runs(folder, recursive=True).runs)]
    assert order == [f"every-0.1s-run-{n}" for n in (9, 10, 11, 12, 13)]


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
    # the gate's line: each engine's largest logit error and what it was allowed
    rows_gate = [r | {"logits_max_abs_diff": 2e-6, "logits_tolerance": 2.6e-4}
                 for r in rows(1, 47.0)]
    _save(folder, "peers", {"peers": rows_gate}, "2026-12-01T12:00:00+00:00")
    readme.write(copy)
    assert "- the gate, largest logit error against mode 1 (allowed): `fast` 2e-06 (0.00026), " \
        "`ct2_float32` 2e-06 (0.00026)" in (copy / "docs" / "peers.md").read_text()


def test_the_speculation_table_names_the_model_and_counts_the_predictions(copy: Path) -> None:
    folder = copy / "docs" / "runs" / "speculate"
    for p in folder.glob("*.json"):
        p.unlink()

    def rows(measured: tuple[float, float], predicted: tuple[float, float]) -> list[dict]:
        return [{"k": k, "acceptance": a, "speedup_measured": m, "speedup_predicted_drafts": p,
                 "identical": True} for k, a, m, p in zip((1, 4), (0.5, 0.25), measured,
                                                            predicted, strict=True)]

    _save(folder, "speculate", {"speculative": rows((1.2, 1.5), (1.3, 2.0))},
          "2026-12-01T10:00:00+00:00", weights="local checkpoint (bytes_stdlib)",
          bench_prompt="code", distinct_tokens=1, mode="prealloc_fused", new_tokens=96)
    random = rows((2.0, 3.0), (2.0, 3.3))
    random[1]["identical"] = False
    _save(folder, "speculate", {"speculative": random}, "2026-12-01T10:01:00+00:00",
          weights="random (seed 0)", bench_prompt="prose", distinct_tokens=2,
          mode="prealloc_fused", new_tokens=96)
    readme.write(copy)
    body = (copy / "docs" / "past-the-floor.md").read_text()
    assert "Draft lengths k = 1/4; mode `prealloc_fused`, 96 new tokens per prompt" in body
    # the fixture is named by its checkpoint, not by the gpt2 its config is shaped like;
    # 1.3 over 1.2 is within 15%, 2.0 over 1.5 is not
    assert "| `bytes_stdlib` (trained fixture) | code | 1 | 50/25% | 1.20/1.50× | 1 of 2 | yes |" \
        in body
    assert "| gpt2, random (seed 0) weights | prose | 2 | 50/25% | 2.00/3.00× | 2 of 2 | **no** |" \
        in body


def test_the_hosts_table_counts_the_runs_of_each_host_and_a_gpu(copy: Path) -> None:
    before = int(re.search(r"\*\*On a GPU: (\d+) committed runs?\.\*\*",
                           (copy / "README.md").read_text())[1])
    run = new_run("hardware", collect_meta(model="gpt2", device="cuda", device_name="Test GPU",
                                           dtype="float32", platform="Linux-1.0-x86_64-x"), {})
    run["created_utc"] = "2026-12-05T10:00:00+00:00"
    save_run(run, copy / "docs" / "runs" / "gpu-check")  # a folder no other block reads
    assert readme.check(copy) == ["README.md: block 'hosts' differs from what docs/runs/ gives"]
    readme.write(copy)
    text = (copy / "README.md").read_text()
    assert "| Test GPU (Linux-1.0) | cuda | 1 | `gpu-check/` | 2026-12-05 |" in text
    assert f"**On a GPU: {before + 1} committed runs.**" in text


# ------------------------------------------------------------- tables typed by hand
TIMING_TABLES = [
    "| context | step (ms) |\n|---|---|\n| 128 | 41.2 |\n",  # a unit in the header
    "| attempt | measured |\n|---|---|\n| prefetch | 18.0 → 12.0 ms |\n",  # in a cell
    "| progress every | share of a core |\n|---|---|\n| 5 s | 17% |\n",
    "```\n| model | t/s |\n| --- | --: |\n| gpt2 | 41.5 ± 0.3 |\n```\n",  # fenced
]


@pytest.mark.parametrize("table", TIMING_TABLES)
def test_a_hand_written_timing_table_fails_the_check_naming_file_and_line(
        copy: Path, table: str, capsys: pytest.CaptureFixture[str]) -> None:
    doc = copy / "docs" / "sweep.md"
    text = doc.read_text(encoding="utf-8")
    line = text[:text.index("## What a point is")].count("\n") + 1
    doc.write_text(text.replace("## What a point is", table + "\n## What a point is", 1),
                   encoding="utf-8")
    at = line + (1 if table.startswith("```") else 0)
    (found,) = readme.check(copy)
    assert found.startswith(f"docs/sweep.md:{at}: a table with timing columns (")
    assert cli.main(["readme", "--check", "--root", str(copy)]) == 1
    assert f"docs/sweep.md:{at}: a table with timing columns" in capsys.readouterr().err
    readme.write(copy)  # regenerating cannot fix it: only a block or a quoted run can
    assert readme.check(copy) == [found]


@pytest.mark.parametrize("table", [
    "| mode | what changes |\n|---|---|\n| 1 `uncached` | the naive loop, 16 × 128 bytes |\n",
    "| field | meaning |\n|---|---|\n| `p50_ms`, `tpot_ms` | time per output token |\n",
    "```\n| model | t/s |\n| --- | --: |\n| gpt2 | ... ± ... |\n```\n",  # a format, no figure
])
def test_a_table_without_timings_passes(copy: Path, table: str) -> None:
    doc = copy / "docs" / "sweep.md"
    doc.write_text(doc.read_text(encoding="utf-8") + "\n" + table, encoding="utf-8")
    assert readme.check(copy) == []


# ------------------------------------------------------------ blocks made from the code
def _block(root: Path, doc: str, name: str) -> str:
    return dict((n, b) for d, n, b in blocks(root) if d.name == doc)[name]


def test_the_command_list_is_the_clis_parser() -> None:
    sub = cli.build_parser()._subparsers._group_actions[0]
    body = _block(REPO_ROOT, "running.md", "commands")
    listed = re.findall(r"^\| `(\S+)`", body, re.M)
    assert listed == [a.dest for a in sub._choices_actions]
    for action in sub._choices_actions:
        assert (action.help or "").replace("|", "\\|") in body
    for old in ("sweep", "e2e", "predict"):  # the older names are shown beside the new
        assert f"({old})" in body


def test_a_new_script_or_module_makes_the_lists_stale(copy: Path) -> None:
    (copy / "scripts" / "bench_new.py").write_text('"""A new benchmark: it times things."""\n')
    (copy / "engine" / "newpart.py").write_text('"""A new part."""\n')
    assert readme.check(copy) == [
        "docs/running.md: block 'scripts' differs from what the docstrings of scripts/ gives",
        "docs/running.md: block 'layout' differs from what the package tree gives"]
    readme.write(copy)
    assert "| `scripts/bench_new.py` | A new benchmark: it times things. |" in \
        _block(copy, "running.md", "scripts")
    assert re.search(r"^\| `engine/` \|.*\bnewpart\b", _block(copy, "running.md", "layout"),
                     re.M)
    (copy / "scripts" / "bench_new.py").unlink()
    assert readme.check(copy) == [
        "docs/running.md: block 'scripts' differs from what the docstrings of scripts/ gives"]


def test_a_new_command_makes_the_command_list_stale(copy: Path) -> None:
    path = copy / "instruments" / "cli.py"
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace('    _store_parsers(sub)\n', '    _store_parsers(sub)\n'
                                 '    sub.add_parser("brand-new", help="a command just added")\n',
                                 1), encoding="utf-8")
    assert readme.check(copy) == ["docs/running.md: block 'commands' differs from what the "
                                  "CLI's parser (instruments/cli.py) gives"]
    readme.write(copy)
    assert "| `brand-new` | a command just added |" in _block(copy, "running.md", "commands")
