#!/usr/bin/env python
"""The serving engine's batched decode step side by side, and the serving experiments' runs for
docs/serving.md, each begun only once the host is quiet.

    python scripts/bench_serving.py                     # step, then the four experiments
    python scripts/bench_serving.py --only step --out /tmp/serving --batches 1,8,64

"step": on smollm2-135m's real weights in fp32, in this one process, with --threads torch
threads (default 2). For each batch, B sequences are prefilled to --context tokens, untimed.
Then decode steps are timed in interleaved rounds, each round giving every way its --steps
steps. The ways are our engine's four:
  fast          the family's one-token step over products chosen per row count
                (``engine.serving.products``), the pool read in place by our C++ paged kernel
  fast (mode 8's products)  the same step over mode 8's products (chosen at one row)
  forward       the model's forward over the batch's tokens, read in place
  gather        the model's forward, each sequence's rows gathered for SDPA
and llama.cpp's batched decode on the same weights as an F32 GGUF: one ``llama_decode`` of B
tokens with their own sequence ids, from ``instruments.peers.serving``, when it is installed.
Each step is device-synchronised ``time.perf_counter``. The scheduler's own decision is timed
apart from the step. The floor (``instruments.experiments.serving.metrics.step_floor_ms``) comes
from peaks measured in the same process. The run (kind "serving_step") keeps every sample.

"concurrency", "load", "budget", "schedule": ``python -m instruments serving --experiment X``
on smollm2-135m (the same code and run files as the page), with peers for "concurrency".

Before each part it waits until the 1-minute load average is under --max-load (default 1.0)
for --settle-s seconds in a row. After --wait-s (default 3 h) without that, it stops and says
so, saving nothing more: a run taken beside other work is not published. Then ``python -m
instruments readme`` makes docs/serving.md's blocks from what was saved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.bench_prefix import each_when_quiet  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("step", "concurrency", "load", "budget", "schedule")
WAYS = {"fast": dict(step="fast", reads="in_place"),
        "fast (mode 8's products)": dict(step="fast", reads="in_place"),
        "forward": dict(step="forward", reads="in_place"),
        "gather": dict(step="forward", reads="gather")}


def _engine(model: Any, batch: int, context: int, steps: int, **kw: Any) -> Any:
    """An engine holding ``batch`` sequences prefilled to ``context`` tokens (untimed)."""
    import random

    from engine.serving import ServingEngine

    bt = 16
    per = -(-(context + steps + 2) // bt) + 1
    eng = ServingEngine(model, batch * per * bt * model.config.kv_bytes_per_token(4),
                        block_tokens=bt, max_seqs=batch, step_tokens=4096, **kw)
    rng = random.Random(batch)
    for i in range(batch):
        ids = [rng.randrange(model.config.vocab_size) for _ in range(context)]
        ids[0] = i + 1  # no two share a prefix
        eng.submit(ids, steps + 2)
    while any(s.computed < len(s.tokens) - 1 for s in eng.scheduler.running) or \
            eng.scheduler.waiting:
        eng.step()
    return eng


def step_rows(model: Any, batches: list[int], context: int, steps: int, rounds: int,
              peaks: dict[str, float]) -> list[dict[str, Any]]:
    """Per batch and way: the step's samples (ms), median, floor, the scheduler's median."""
    from engine.decoders.fast import fast_weights
    from instruments.experiments.serving.metrics import step_floor_ms
    from instruments.peers.serving import Stepper

    rows = []
    for batch in batches:
        engines = {w: _engine(model, batch, context, steps * rounds + 2, **kw)
                   for w, kw in WAYS.items()}
        mode8 = engines["fast (mode 8's products)"]  # the same step over products chosen at
        mode8._fast = (mode8._fast[0], fast_weights(model).step)  # one row: side by side
        try:
            llama = Stepper(model, batch, context, steps * rounds + 2)
            llama.time_steps(1)  # untimed, as ours
        except Exception as exc:  # noqa: BLE001 (not installed, refused: said, not fatal)
            print(f"llama.cpp batched at batch {batch}: unavailable: {exc}", file=sys.stderr)
            llama = None
        samples: dict[str, list[float]] = {w: [] for w in [*engines, *(["llama.cpp"]
                                                                    if llama else [])]}
        sched: dict[str, list[float]] = {w: [] for w in engines}
        for eng in engines.values():  # one untimed step each: first-call costs
            eng.step()
        for _ in range(rounds):
            for w, eng in engines.items():
                for _ in range(steps):
                    t0 = time.perf_counter()
                    works = eng.schedule()
                    t1 = time.perf_counter()
                    eng.execute(works)
                    t2 = time.perf_counter()
                    samples[w].append((t2 - t1) * 1e3)
                    sched[w].append((t1 - t0) * 1e3)
            if llama is not None:
                samples["llama.cpp"].extend(llama.time_steps(steps))
        ctxs = [context + 1] * batch
        floor = step_floor_ms(model.config, "float32", ctxs, 0, peaks)
        for w, xs in samples.items():
            med = statistics.median(xs)
            rows.append({"way": w, "batch": batch, "context": context, "step_ms": med,
                         "samples_ms": xs, "tok_s": batch / med * 1e3,
                         "schedule_ms": statistics.median(sched[w]) if w in sched else None,
                         **floor, "over_floor": med / floor["floor_ms"]})
        del engines
        if llama is not None:
            llama.close()
    return rows


def step_part(args: argparse.Namespace) -> int:
    import torch

    from engine.kernels import cpu as kernels
    from instruments.measure import device
    from instruments.spine import ModelSpec, load
    from instruments.store import results

    torch.set_num_threads(args.threads)
    kernels.available()
    loaded = load(ModelSpec(args.model, "package" if args.model == "smollm2-135m" else "random",
                            "cpu", "float32"))
    pk = device.peaks("cpu", "float32")
    peaks = {"matmul_tflops": pk.matmul_tflops, "read_gbps": pk.read_gbps}
    batches = [int(b) for b in args.batches.split(",")]
    load_start = [round(x, 2) for x in os.getloadavg()]
    rows = step_rows(loaded.model, batches, args.context, args.steps, args.rounds, peaks)
    facts = device.describe_device("cpu")
    meta = results.collect_meta(model=args.model, weights=loaded.info["weights_label"],
                                device="cpu", device_name=facts["name"], dtype="float32",
                                batch_size=max(batches), threads=args.threads,
                                config=loaded.model.config.to_dict(),
                                peaks={"listed": None, "measured": pk.to_dict()},
                                load_avg_start=load_start,
                                load_avg_end=[round(x, 2) for x in os.getloadavg()],
                                context=args.context, steps=args.steps, rounds=args.rounds)
    run = results.new_run("serving_step", meta, {"steps": rows})
    path = results.save_run(run, Path(args.out))
    for r in rows:
        print(f"{r['way']:>10s} batch {r['batch']:3d}: {r['step_ms']:8.2f} ms "
              f"({r['over_floor']:.2f}x the floor {r['floor_ms']:.2f} ms), "
              f"{r['tok_s']:8.1f} tok/s")
    print(f"saved {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--only", default=",".join(PARTS), help=", ".join(PARTS))
    p.add_argument("--out", default=str(ROOT / "docs" / "runs" / "serving"))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1,2,4,8,16,32,64")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-load", type=float, default=1.0)
    p.add_argument("--settle-s", type=float, default=60.0)
    p.add_argument("--wait-s", type=float, default=3 * 3600.0)
    args = p.parse_args(argv)
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    if unknown := [w for w in wanted if w not in PARTS]:
        print(f"unknown part {unknown[0]!r}; allowed: {', '.join(PARTS)}", file=sys.stderr)
        return 2
    from instruments import cli

    return each_when_quiet(wanted, args, lambda name: step_part(args) if name == "step" else
                           cli.main(["serving", "--experiment", name, "--model", args.model,
                                     "--threads", str(args.threads), "--results-dir",
                                     args.out, "--no-progress"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
