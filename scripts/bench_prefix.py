#!/usr/bin/env python
"""The prefix cache's three runs for docs/prefix.md, each begun only once the host is quiet.

    python scripts/bench_prefix.py                       # all three, into docs/runs/prefix
    python scripts/bench_prefix.py --only ttft,chat --out /tmp/prefix --max-load 1.0

On smollm2-135m's real weights, in this process, with --threads torch threads (default 2):
``prefix_ttft`` (prompts of 256 and 1,024 tokens, shares 0 to 1 of each held in the tree, 8,192
other tokens in it), ``prefix_chat`` (eight turns, answers of at most 48 tokens) and
``prefix_workload`` (100 requests at 1 a second, the default budgets), each the CLI's command
(``python -m instruments prefix_ttft ...``: the same code and run files as the page). Before
each, it waits until the 1-minute load average is under --max-load (default 1.0) for --settle-s
seconds in a row; after --wait-s (default 3 h) without that it stops and says so, saving
nothing more: a run taken beside other work is not published. Each run records the load
average at its start and end. Then ``python -m instruments readme`` makes docs/prefix.md's
blocks from what was saved.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from instruments import cli  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RUNS = {
    "ttft": ["prefix_ttft", "--prompt-lens", "256,1024", "--tree-tokens", "8192",
             "--repeats", "5"],
    "chat": ["prefix_chat", "--turns", "8", "--answer-tokens", "48"],
    "workload": ["prefix_workload", "--requests", "100", "--rate", "1.0"],
}


def wait_quiet(max_load: float, settle_s: float, wait_s: float) -> bool:
    """True once the 1-minute load average has stayed under ``max_load`` for ``settle_s``."""
    end, since = time.monotonic() + wait_s, None
    while time.monotonic() < end:
        load = os.getloadavg()[0]
        if load < max_load:
            since = since or time.monotonic()
            if time.monotonic() - since >= settle_s:
                return True
        else:
            since = None
        time.sleep(5)
    return False


def each_when_quiet(names: list[str], args: argparse.Namespace,
                    run: Callable[[str], int]) -> int:
    """``run(name)`` for each name in turn, each begun once ``wait_quiet`` says the host is
    quiet (``args``: max_load, settle_s, wait_s); the first nonzero status stops it, and a
    host that never quietens stops it with 1, saying so."""
    for name in names:
        if not wait_quiet(args.max_load, args.settle_s, args.wait_s):
            print(f"{name}: the load average never stayed under {args.max_load} for "
                  f"{args.settle_s:.0f} s within {args.wait_s:.0f} s; nothing more was run",
                  file=sys.stderr)
            return 1
        print(f"{name}: load average {os.getloadavg()[0]:.2f}, starting", flush=True)
        if rc := run(name):
            return rc
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--only", default=",".join(RUNS), help="ttft, chat, workload")
    p.add_argument("--out", default=str(ROOT / "docs" / "runs" / "prefix"))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-load", type=float, default=1.0)
    p.add_argument("--settle-s", type=float, default=60.0)
    p.add_argument("--wait-s", type=float, default=3 * 3600.0)
    args = p.parse_args(argv)
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in RUNS]
    if unknown:
        print(f"unknown run {unknown[0]!r}; allowed: {', '.join(RUNS)}", file=sys.stderr)
        return 2
    return each_when_quiet(wanted, args, lambda name: cli.main(
        [*RUNS[name], "--model", args.model, "--threads", str(args.threads),
         "--results-dir", args.out, "--no-progress"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
