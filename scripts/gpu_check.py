#!/usr/bin/env python
"""The device check behind scripts/gpu_check.sh: each stage isolated, bounded, in summary.json.

    python scripts/gpu_check.py --device cuda --out /tmp/gc          # the whole check (~5 min)
    python scripts/gpu_check.py --device cpu --tiny --out /tmp/gc    # a dry run of the logic
    python scripts/gpu_check.py --list-stages                        # the stages, in order
    python scripts/gpu_check.py --stages planner,peers --out /tmp/gc # a subset, in table order

Stages (``STAGES``; ``--list-stages`` prints them): the CUDA and Triton tests (at most
``--tests-timeout-s``, first); measured peaks; latency sweeps of GPT-2 in fp32 (eager modes),
of the Llama family on SmolLM2-135M's shapes, of GPT-2 in bf16, and of the torch.compile modes
(each sweep's contexts and samples sized to its share, swept shortest, longest, then between,
so a stopped sweep still spans them); step attribution; the matmul staircase; memory; the KV
planner; the predicted step; llama-bench's pp / tg; the peers installed here; speculative
decoding; every dashboard page under Streamlit's AppTest on the device (where streamlit and
plotly import), its cheap Runs pressed; each cached mode's step against the bandwidth floor.
Time: ``--total-s`` is the whole check's, tests included; a fixed-time stage (tests 120 s,
peaks 15, pages 60, floor 5) gets its seconds, every other stage its share
(``instruments.experiments.device_shares``) of what the fixed stages still to come leave, so
time a stage leaves unused goes to the later ones. A stage past its share stops after its
current point and keeps what it measured (partial); one far past it is interrupted
(scripts/device_check/runner.py says how); one that raises is recorded with its traceback and the
rows it had streamed (a partial run), and the next stage runs.
Everything goes under ``--out`` (default ``gpu-check/<UTC time>``): run files, pytest.log,
pages/ (the pages' runs), summary.json, any hang's tracebacks; gpu_check.sh adds the log.
Exit status: 0 when no stage failed (skipped ones, saying why, do not fail it), 1 when one did
-- the last line printed names them (``failed stages: planner, peers``) -- and 2 on bad input.
"""

from __future__ import annotations

import time

STARTED_S = time.monotonic()  # the check's time starts before torch is imported

import argparse  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import torch  # noqa: E402
from device_check.pages import PAGES  # noqa: E402
from device_check.runner import Runner, Stage, StageSkipped  # noqa: E402
from device_check.stages import FLOOR, HARDWARE, MEASURING, Check  # noqa: E402

from instruments.measure.device import describe_device, device_available  # noqa: E402
from instruments.store import results  # noqa: E402

TESTS_TIMEOUT_S = 120.0


def tests(check: Check) -> None:
    """The CUDA tests and our Triton kernels' tests (compiled for the GPU there; their planted
    bugs stay on the CPU, where the interpreter shows each is caught) in a process group of
    their own, killed at the stage's time. The torch.compile modes are gated by their own sweep
    stage, so their minutes of compile are not paid twice."""
    log = check.out / "pytest.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda or triton", "-k",
           "not planted_bug", "-p", "no:cacheprovider", "tests"]
    env = dict(os.environ)
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=check.runner.budget_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # also when the watchdog interrupts the wait
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log.read_text(encoding="utf-8", errors="replace")
    print(text, end="", flush=True)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    said = lines[-1].strip("= ") if lines else "no output"
    check.runner.details(exit=rc, said=said, log="pytest.log")
    if rc is None:
        raise TimeoutError(f"the CUDA tests ran past {check.runner.budget_s:.0f} s and were "
                           f"stopped; pytest.log ends: {said}")
    if rc == 5 and not check.cuda:
        raise StageSkipped(f"no CUDA test runs on {check.args.device} (collection worked: {said})")
    if rc != 0:
        failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
        raise RuntimeError(f"pytest -m cuda exited {rc} (5: none ran): {said}"
                           + "".join(f"\n{ln}" for ln in failed[:8]))


STAGES: list[Stage] = [
    Stage("tests", tests, fixed_s=TESTS_TIMEOUT_S,
          what="pytest -m 'cuda or triton': CUDA tests, Triton kernels compiled (first)"),
    HARDWARE, *MEASURING, PAGES, FLOOR,
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny config (a dry run of the logic)")
    ap.add_argument("--out", default=None,
                    help="where everything goes (default gpu-check/<UTC time>)")
    ap.add_argument("--total-s", type=float, default=345.0,
                    help="seconds for the whole check, tests included (default %(default)s)")
    ap.add_argument("--tests-timeout-s", type=float, default=TESTS_TIMEOUT_S,
                    help="the CUDA tests' cap within it (default %(default)s)")
    ap.add_argument("--stages", default=None,
                    help="a comma list of stages to run (default: all; see --list-stages)")
    ap.add_argument("--skip-tests", action="store_true", help="every stage but tests")
    ap.add_argument("--list-stages", action="store_true", help="print the stages and exit")
    ap.add_argument("--no-compile", action="store_true", help="leave out torch.compile modes")
    return ap.parse_args(argv)


def selected(args: argparse.Namespace) -> list[str]:
    """The stages to run; ValueError naming the allowed ones for an unknown name."""
    names = [s.name for s in STAGES]
    if args.stages is None:
        chosen = list(names)
    else:
        chosen = [n.strip() for n in args.stages.split(",") if n.strip()]
        unknown = [n for n in chosen if n not in names]
        if unknown or not chosen:
            raise ValueError(f"unknown stage {unknown[0] if unknown else args.stages!r}; "
                             f"allowed: {', '.join(names)}")
    return [n for n in chosen if not (args.skip_tests and n == "tests")]


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git_rev() -> str | None:
    """The revision every run file of the check names (``results``' rule: KVLAB_GIT_REV, said by
    whoever copied the tree, else this checkout's own)."""
    return results.collect_meta()["git_rev"]


def facts(args: argparse.Namespace, out: Path, argv: list[str]) -> dict[str, Any]:
    return {"command": " ".join(["scripts/gpu_check.py", *argv]), "out": str(out),
            "started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": args.device, "device_name": str(describe_device(args.device)["name"]),
            "model": "tiny" if args.tiny else "gpt2", "git_rev": _git_rev(),
            "platform": platform.platform(),
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                         "cuda": torch.version.cuda, "triton": _version("triton"),
                         **{p: _version(p) for p in ("transformers", "streamlit", "plotly")}}}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.list_stages:
        for s in STAGES:
            budget = f"{s.fixed_s:.0f} s" if s.fixed_s is not None else f"share {s.share:.2f}"
            print(f"{s.name:15s} {budget:11s} {s.what}")
        return 0
    try:
        chosen = selected(args)
    except ValueError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2
    ok, why = device_available(args.device)
    if not ok:
        print(f"cannot run on {args.device}: {why}", file=sys.stderr)
        return 2
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out) if args.out else ROOT / "gpu-check" / stamp
    out.mkdir(parents=True, exist_ok=True)
    args.out = str(out)
    stages = [s if s.name != "tests" else Stage(s.name, s.run, fixed_s=args.tests_timeout_s,
                                                what=s.what) for s in STAGES]
    known = facts(args, out, argv)
    print(f"# gpu_check on {known['device_name']} ({args.device}), torch {torch.__version__}, "
          f"{known['model']}; stages: {', '.join(chosen)}; out: {out}", flush=True)
    runner = Runner(stages, out, args.total_s, STARTED_S, known)
    return runner.run(Check(args, runner), chosen)


if __name__ == "__main__":
    raise SystemExit(main())
