#!/usr/bin/env python
"""Peers benchmark: every available peer and our exact cached modes, 1 and 2 threads, saved runs.

    python scripts/bench_peers.py                      # gpt2 shapes, contexts 128 and 512
    python scripts/bench_peers.py --model smollm2-135m # SmolLM2's real weights: llama.cpp on
                                                       # its very file, our GGUF rungs beside
    python scripts/bench_peers.py --tiny               # the tiny test shape: a smoke run
    python scripts/bench_peers.py --threads 2 --rounds 3 --out /tmp/peers

For each thread count it runs the "peers" experiment in a process of its own (``python -m
instruments peers --threads N``: torch, CTranslate2 and ONNX Runtime then all get that
setting, and nothing else runs beside the timed steps): every engine is gated on mode 1's
logits, then timed in interleaved rounds with the read floor (``instruments.experiments.peers``
-- no timer of its own here). The runs are saved into ``--out`` (default ``docs/runs/peers/``);
the Markdown table the README quotes and the verdict are printed from them. Run it on a quiet
machine: other work on the cores moves every number.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from instruments import lineup  # noqa: E402
from instruments.store.peers_report import llamacpp_goals, markdown, verdict  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny test shape, one short round")
    ap.add_argument("--model", default=None, help="default gpt2 (random weights); "
                    "smollm2-135m runs on its package's real weights")
    ap.add_argument("--threads", default="1,2", help="thread counts, one process each")
    ap.add_argument("--contexts", default=None, help="default 128,512 (tiny: 64,128)")
    ap.add_argument("--rounds", type=int, default=None, help="default 5 (tiny: 1)")
    ap.add_argument("--steps", type=int, default=None, help="per engine per round: 24 (tiny 2)")
    ap.add_argument("--peers", default=None, help="default: every peer of the CPU")
    ap.add_argument("--modes", default=",".join([*lineup.with_role("peer_baseline"),
                                                *lineup.with_role("peer_rung")]),
                    help="our modes beside them (default: the exact cached ones and the "
                    "weight-only rungs)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "runs" / "peers"))
    return ap.parse_args(argv)


def one(args: argparse.Namespace, threads: int) -> dict:
    """One thread count in its own process; the run it saved."""
    model = args.model or ("tiny" if args.tiny else "gpt2")
    weights = lineup.offline_weights(model)  # gpt2's "auto" would reach for the hub
    cmd = [sys.executable, "-m", "instruments", "peers", "--model", model,
           "--weights", weights, "--threads", str(threads),
           "--contexts", args.contexts or ("64,128" if args.tiny else "128,512"),
           "--rounds", str(args.rounds or (1 if args.tiny else 5)),
           "--steps", str(args.steps or (2 if args.tiny else 24)), "--modes", args.modes,
           "--results-dir", args.out, "--no-progress"]
    if args.peers:
        cmd += ["--peers", args.peers]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[2:])} failed:\n{out.stderr[-3000:]}")
    saved = [ln.split(": ", 1)[1] for ln in out.stdout.splitlines()
             if ln.startswith("saved peers")]
    return json.loads(Path(saved[-1]).read_text())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runs = {int(n): one(args, int(n)) for n in args.threads.split(",") if n.strip()}
    first = next(iter(runs.values()))["meta"]
    print(f"# {first['model']} ({first.get('weights')}), fp32 weights, batch 1, "
          f"{first.get('device_name') or platform.processor()}, torch "
          f"{first.get('torch_version')}; {time.perf_counter() - t0:.0f} s; runs in {args.out}")
    for threads, run in runs.items():
        rows = run["tables"]["peers"]
        print(f"\n## {threads} thread{'s' * (threads > 1)} "
              f"(`{run['meta'].get('command', '')}`)\n")
        print(markdown(rows))
        print()
        for line in [*verdict(rows), *llamacpp_goals(rows)]:
            print(line)
        for note in run["meta"].get("notes") or []:
            print(f"note: {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
