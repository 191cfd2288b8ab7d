"""Results store: one JSON file per run, written atomically, loaded tolerantly, read as DataFrames.

A run (schema 1) is `{"schema_version": 1, "run_id", "kind", "created_utc", "meta": {...},
"tables": {name: [row, ...]}}`; row fields carry units (`latency_ms`, `context_len`, `tflops`).
`save_run` validates, writes to a temp file in the target folder, fsyncs, then `os.replace`s, so a
crash leaves either the old file or the new one; names can never leave `results_dir`.
`load_runs` never raises on a bad file: it skips it and says why. Both the app and the CLI use this.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
# fmt: off
# Kinds the app knows how to draw; any lowercase identifier is accepted (the CLI may add more).
KINDS = (
    "latency_sweep", "end_to_end", "memory", "hardware", "attribution", "staircase", "reference",
)
REQUIRED_FIELDS = ("schema_version", "run_id", "kind", "created_utc", "meta", "tables")
META_FIELDS = (
    "model", "weights", "device", "device_name", "dtype", "batch_size", "torch_version",
    "transformers_version", "python_version", "platform", "git_rev", "warmup", "repeats", "peaks",
    "partial", "note",
)
# fmt: on
MAX_FILE_BYTES = 256 * 2**20  # a results file is kilobytes; anything huge is not one of ours
REPO_ROOT = Path(__file__).resolve().parents[2]
REFERENCE_PATH = REPO_ROOT / "results" / "reference" / "seed_a40.json"
# Committed runs behind the published numbers (instruments.store.readme); examples/ is one CLI
# `all` run, which the Results page lists beside the user's own runs.
RUNS_PATH = REPO_ROOT / "docs" / "runs"
EXAMPLES_PATH = RUNS_PATH / "examples"
_KIND_RE = re.compile(r"^[a-z0-9_]{1,40}$")


class ResultsError(Exception):
    """A run could not be saved or is malformed; the message is meant for the user."""


@dataclass
class LoadResult:
    runs: list[dict[str, Any]] = field(default_factory=list)  # each has "path"
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)


# ----------------------------------------------------------------------------------- building
def _git_rev() -> str | None:
    """The commit of the code that runs: ``KVLAB_GIT_REV`` when the caller that copied the tree
    says it (a GPU machine gets a copy whose ``.git``, if any, may be older than the tree:
    runs there carried the session's first commit), else the checkout's own, never that of a
    repository enclosing a copy (first light's runs carried another repository's commit)."""
    if os.environ.get("KVLAB_GIT_REV"):
        return os.environ["KVLAB_GIT_REV"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "--short=12", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        out = None
    lines = out.stdout.split() if out is not None and out.returncode == 0 else []
    if len(lines) == 2 and Path(lines[0]).resolve() == REPO_ROOT.resolve():
        return lines[1]
    return None


def _package_version(name: str) -> str | None:
    module = sys.modules.get(name)  # an imported module knows its exact build ("2.13.0+cpu")
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def collect_meta(**fields: Any) -> dict[str, Any]:
    """Meta for a new run: the given fields plus versions, platform and git revision.

    Every name in META_FIELDS is present (None when unknown); extra fields are kept as given.
    """
    meta: dict[str, Any] = {name: None for name in META_FIELDS}
    meta.update(
        torch_version=_package_version("torch"),
        transformers_version=_package_version("transformers"),
        python_version=platform.python_version(),
        platform=platform.platform(),
        git_rev=_git_rev(),
        partial=False,
        note="",
    )
    meta.update(fields)
    return meta


def to_jsonable(value: Any) -> Any:
    """Plain JSON types: numpy/torch scalars -> Python, NaN/inf -> None (JSON has no NaN)."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy scalar/array, torch tensor
        return to_jsonable(value.tolist())
    if hasattr(value, "isoformat"):
        return value.isoformat()
    raise ResultsError(f"cannot store a {type(value).__name__} in a results file: {value!r}")


def new_run(kind: str, meta: dict[str, Any], tables: dict[str, list[dict]] | None = None) -> dict:
    """A fresh run with a random id and the current UTC time; `meta` usually from collect_meta."""
    run = {
        "schema_version": SCHEMA_VERSION,
        "run_id": uuid.uuid4().hex,
        "kind": kind,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "meta": dict(meta),
        "tables": {name: list(rows) for name, rows in (tables or {}).items()},
    }
    _raise_if_invalid(run)
    return run


# --------------------------------------------------------------------------------- validation
def validate_run(run: Any) -> list[str]:
    """Problems that make `run` unusable (empty list = valid)."""
    if not isinstance(run, dict):
        return [f"top level is a JSON {type(run).__name__}, expected an object"]
    missing = [name for name in REQUIRED_FIELDS if name not in run]
    if missing:
        return [f"missing field(s): {', '.join(missing)}"]
    problems: list[str] = []
    version = run["schema_version"]
    if isinstance(version, bool) or not isinstance(version, int):
        problems.append(f"schema_version must be an integer, got {version!r}")
    elif version > SCHEMA_VERSION:
        problems.append(
            f"schema_version {version} is newer than this app reads ({SCHEMA_VERSION}); "
            "update the app to load it"
        )
    elif version < 1:
        problems.append(f"schema_version {version} is not valid (must be >= 1)")
    if not isinstance(run["run_id"], str) or not run["run_id"]:
        problems.append("run_id must be a non-empty string")
    if not isinstance(run["kind"], str) or not _KIND_RE.match(run["kind"]):
        problems.append(f"kind must be lowercase letters, digits or '_', got {run['kind']!r}")
    created = run["created_utc"]
    try:
        datetime.fromisoformat(created)
    except (TypeError, ValueError):
        problems.append(f"created_utc must be an ISO 8601 time, got {created!r}")
    if not isinstance(run["meta"], dict):
        problems.append("meta must be an object")
    tables = run["tables"]
    if not isinstance(tables, dict):
        problems.append("tables must be an object of name -> list of rows")
    else:
        for name, rows in tables.items():
            if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                problems.append(f"table {name!r} must be a list of row objects")
    return problems


def _raise_if_invalid(run: Any) -> None:
    problems = validate_run(run)
    if problems:
        raise ResultsError("invalid run: " + "; ".join(problems))


# ------------------------------------------------------------------------------------- saving
def _os_error_message(exc: OSError, path: Path) -> str:
    reasons = {
        errno.EROFS: "the file system is read-only",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.ENOSPC: "the disk is full",
        errno.EDQUOT: "the disk quota is exceeded",
    }
    why = reasons.get(exc.errno or -1, exc.strerror or str(exc))
    return f"could not save results to {path}: {why}. Nothing was overwritten."


def safe_filename(name: str) -> str:
    """A user-given name reduced to one plain file name: no folders, no '..', ends in .json."""
    stem = str(name).strip()
    if stem.lower().endswith(".json"):
        stem = stem[:-5]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", stem)  # slashes, backslashes, spaces, ':' ...
    stem = re.sub(r"\.{2,}", ".", stem).strip("._-")  # no '..', no hidden or leading-dot names
    if not stem:
        raise ResultsError(f"{name!r} cannot be used as a file name; use letters and digits")
    return stem[:120] + ".json"


def _default_filename(run: dict) -> str:
    created = datetime.fromisoformat(run["created_utc"]).astimezone(timezone.utc)
    short_id = re.sub(r"[^A-Za-z0-9]", "", run["run_id"])[:8] or "run"
    return f"{created:%Y%m%dT%H%M%SZ}_{run['kind']}_{short_id}.json"


def _same_run_on_disk(path: Path, run_id: str) -> bool:
    """True only when `path` holds a valid run with this id (then overwriting updates it)."""
    try:
        existing = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return not validate_run(existing) and existing.get("run_id") == run_id


def _choose_target(folder: Path, filename: str, run_id: str) -> Path:
    # A partial sweep re-saves the same run as rows arrive, so the same run may replace itself;
    # anything else already there (another run, or a file that fails to load) is left alone.
    stem = filename[:-5]
    for attempt in range(1, 1000):
        candidate = folder / (filename if attempt == 1 else f"{stem}-{attempt}.json")
        if not candidate.exists() or _same_run_on_disk(candidate, run_id):
            return candidate
    raise ResultsError(f"too many files named like {filename} in {folder}")


def save_run(
    run: dict, results_dir: str | os.PathLike = "results", name: str | None = None
) -> Path:
    """Validate and atomically write `run` into `results_dir`; return the path written.

    Default name `<created>_<kind>_<shortid>.json`. Raises ResultsError (never a bare OSError)
    when the run is invalid or the folder is read-only, full or missing permissions.
    """
    _raise_if_invalid(run)
    payload = {k: v for k, v in run.items() if k != "path"}  # "path" is added by load_runs
    # Serialise before touching the disk, so an unstorable value can't leave a half file.
    text = json.dumps(to_jsonable(payload), indent=1, allow_nan=False) + "\n"
    folder = Path(results_dir)
    filename = safe_filename(name) if name is not None else _default_filename(run)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        target = _choose_target(folder, filename, run["run_id"])
        if target.resolve().parent != folder.resolve():  # belt and braces after safe_filename
            raise ResultsError(f"refusing to write outside {folder}: {target}")
        fd, tmp_name = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    except OSError as exc:
        raise ResultsError(_os_error_message(exc, folder)) from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, target)
    except BaseException as exc:  # incl. KeyboardInterrupt: never leave the temp file behind
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        if isinstance(exc, OSError):
            raise ResultsError(_os_error_message(exc, target)) from exc
        raise
    _fsync_dir(folder)
    return target


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable; best effort (not every platform can open a directory)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------ loading
def _json_problem(text: str, exc: json.JSONDecodeError) -> str:
    if exc.pos >= len(text.rstrip()):
        return f"truncated: the JSON ends early ({exc.msg} at line {exc.lineno})"
    return f"not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"


def load_run(path: str | os.PathLike) -> dict[str, Any]:
    """One run from a file, with "path" added; raises ResultsError saying why it can't be used."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ResultsError(f"file is {size / 2**20:.0f} MiB; results files are far smaller")
        raw = path.read_bytes()
    except OSError as exc:
        raise ResultsError(f"could not read: {exc.strerror or exc}") from exc
    if not raw.strip():
        raise ResultsError("empty file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ResultsError("not UTF-8 text") from exc
    try:
        run = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultsError(_json_problem(text, exc)) from exc
    problems = validate_run(run)
    if problems:
        raise ResultsError("; ".join(problems))
    run["path"] = str(path)
    return run


def load_runs(results_dir: str | os.PathLike = "results", recursive: bool = False) -> LoadResult:
    """Every loadable run in `results_dir` (oldest first); bad files go to `.skipped` with why.

    Hidden files (our own `.tmp-*` leftovers) are ignored. Never raises: a missing folder is an
    empty result. `results/reference/` is a subfolder, so it is only read with recursive=True.
    """
    result = LoadResult()
    folder = Path(results_dir)
    if not folder.is_dir():
        return result
    try:
        paths = sorted(folder.rglob("*.json") if recursive else folder.glob("*.json"))
    except OSError as exc:
        result.skipped.append((str(folder), f"could not list folder: {exc.strerror or exc}"))
        return result
    for path in paths:
        if path.name.startswith(".") or not path.is_file():
            continue
        try:
            result.runs.append(load_run(path))
        except ResultsError as exc:
            result.skipped.append((str(path), str(exc)))
    result.runs.sort(key=lambda r: (str(r["created_utc"]), r["path"]))
    return result


# ---------------------------------------------------------------------------------- reading
def reference_run(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The seed write-up's published A40 figures as a run (kind "reference"), shipped with us.

    Reads `results/reference/seed_a40.json` (in this schema); raises ResultsError if it is gone.
    """
    return load_run(REFERENCE_PATH if path is None else path)


def find_run(ref: str | os.PathLike, results_dir: str | os.PathLike = "results") -> dict[str, Any]:
    """A run named by its file path, its file name or run id (or a unique start of either) in
    ``results_dir`` and its subfolders; ResultsError saying what was found otherwise."""
    path = Path(ref)
    if path.is_file():
        return load_run(path)
    text = str(ref).removesuffix(".json")
    runs = load_runs(results_dir, recursive=True).runs
    hits = [r for r in runs if str(r.get("run_id", "")).startswith(text)
            or Path(r["path"]).stem.startswith(text)]
    if len(hits) == 1:
        return hits[0]
    if not hits:
        raise ResultsError(f"no run file or run id {str(ref)!r} in {results_dir}; give a path "
                           "to a run file, or a run id as `ls results` shows it")
    names = ", ".join(Path(r["path"]).name for r in hits[:3])
    raise ResultsError(f"{str(ref)!r} names {len(hits)} runs ({names}...); give more of it")
