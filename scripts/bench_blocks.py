#!/usr/bin/env python
"""GGUF block products over SmolLM2-135M's matrices, against a plain read of the same bytes.

    python scripts/bench_blocks.py                       # 1 and 2 threads, batch 1, 9 rounds
    python scripts/bench_blocks.py --threads 1 --rounds 5 --batch 1,2 --out docs/runs/blocks

A decode step at batch 1 streams every weight once, so each way of multiplying is timed over the
whole model's matrices in step order -- 30 layers x (q 576x576, k 192x576, v 192x576, o 576x576,
gate 1536x576, up 1536x576, down 576x1536), then the 49152x576 tied head -- in three storages:

  Q4_1 set  every layer matrix Q4_1 (20 bytes per 32 weights), the head Q8_0 (llama.cpp's
            usual mix): ``kernels.q4_1_linear`` / ``q8_0_linear``, integer (x rounded to int8
            per 32, ``exact=False``) and exact (blocks widened to fp32, ``exact=True``)
  Q8_0 set  everything Q8_0 (34 bytes per 32 weights), both ways
  fp32 set  ``kernels.linear`` over fp32 rows (the project's exact path)

beside a read of each set's own bytes (``kernels.read_bytes``: every byte summed once, on the
same threads) and ``sum()`` of the fp32 set (the floor the docs measure every step against).
With ``--context`` (default 128) also whole fused decode steps (``decode_layers_llama``: the
same products plus RMSNorms, RoPE, grouped-query attention over the cache, SwiGLU) in each
storage, and the Q4_1 one with q|k|v and gate|up stacked into one product each.
One process; each round times every candidate (``--repeats`` calls after one warm-up) in an
order reversed every other round; the table gives medians (and minima), each median as a
multiple of its own set's read and of the fp32 read floor, and GB/s over its own bytes; the
raw samples are kept with ``--out``. A 211-call pass over 4-row matrices measures what the
calls themselves cost from Python (the fused C++ step does not pay it). Weights are random bytes
under typical fp16 scales: the kernels' speed does not depend on the values. The machine's load
average is recorded at the start and end: run it in a quiet window (load below ~0.3 on these
2-core hosts) and compare multiples, not milliseconds, across machines. Where no quiet window
comes, ``--clock cpu`` times each call by the process's CPU seconds divided by the threads: time
spent descheduled by other processes is left out (torch's OpenMP threads spin while they wait
for each other, so a thread that waits on a descheduled one is still counted: an upper bound);
the memory bus is still shared, so it is a stand-in, not a measurement of an idle machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LAYERS = 30
LAYER = [("q", 576, 576), ("k", 192, 576), ("v", 192, 576), ("o", 576, 576),
         ("gate", 1536, 576), ("up", 1536, 576), ("down", 576, 1536)]
HEAD = ("head", 49152, 576)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batch", default="1", help="rows of x (sequences), e.g. 1,2")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per candidate per round")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the process's CPU seconds over the threads (a busy host's "
                         "stand-in for an idle one's wall time; see the docstring)")
    ap.add_argument("--context", type=int, default=128,
                    help="also time whole fused steps at this context (0: none)")
    ap.add_argument("--out", default=None, help="save the run (kind 'blocks') into this folder")
    return ap.parse_args(argv)


def step_shapes() -> list[tuple[str, int, int]]:
    return [s for _ in range(LAYERS) for s in LAYER] + [HEAD]


def random_blocks(fmt: str, out: int, inn: int, gen) -> object:  # noqa: ANN001
    """(out, in/32*bytes) uint8 of random q under fp16 scales of a trained matrix's size."""
    import torch

    from engine.kernels import cpu as kernels

    nbytes = kernels.BLOCK_BYTES[fmt]
    b = torch.randint(0, 256, (out, inn // 32, nbytes), dtype=torch.uint8, generator=gen)
    d = (torch.rand(out, inn // 32, 1, generator=gen) * 2e-3 + 1e-3).half()
    b[..., 0:2] = d.view(torch.uint8)
    if fmt == "Q4_1":
        b[..., 2:4] = (-d.float() * 8).half().view(torch.uint8)
    return b.reshape(out, -1)


def weight_sets(gen) -> dict[str, list[tuple[str, object]]]:  # noqa: ANN001
    """storage -> [(format, tensor)] in step order."""
    import torch

    shapes = step_shapes()
    q41 = [("Q4_1", random_blocks("Q4_1", o, i, gen)) for _, o, i in shapes[:-1]]
    head8 = ("Q8_0", random_blocks("Q8_0", HEAD[1], HEAD[2], gen))
    q80 = [("Q8_0", random_blocks("Q8_0", o, i, gen)) for _, o, i in shapes[:-1]]
    fp32 = [("fp32", torch.randn(o, i, generator=gen) * 0.02) for _, o, i in shapes]
    return {"Q4_1": q41 + [head8], "Q8_0": q80 + [head8], "fp32": fp32}


def candidates(sets: dict, xs: dict[int, object]) -> dict[str, tuple[str, Callable]]:
    """name -> (the set whose bytes it reads, fn())."""
    from engine.kernels import cpu as kernels

    def blocks(ws: list, exact: bool) -> Callable:
        fns = {"Q8_0": kernels.q8_0_linear, "Q4_1": kernels.q4_1_linear}

        def run() -> None:
            for fmt, w in ws:
                fns[fmt](xs[w.size(1) // kernels.BLOCK_BYTES[fmt] * 32], w, None, exact)
        return run

    def reads(ws: list) -> Callable:
        return lambda: [kernels.read_bytes(w) for _, w in ws]

    tiny = [(fmt, w[:4]) for fmt, w in sets["Q4_1"]]  # the same calls, next to no bytes
    out = {
        "read Q4_1 set (read_bytes)": ("Q4_1", reads(sets["Q4_1"])),
        "Q4_1 set, integer (x int8)": ("Q4_1", blocks(sets["Q4_1"], False)),
        "Q4_1 set, exact (fp32 x)": ("Q4_1", blocks(sets["Q4_1"], True)),
        "read Q8_0 set (read_bytes)": ("Q8_0", reads(sets["Q8_0"])),
        "Q8_0 set, integer (x int8)": ("Q8_0", blocks(sets["Q8_0"], False)),
        "Q8_0 set, exact (fp32 x)": ("Q8_0", blocks(sets["Q8_0"], True)),
        "read fp32 set (read_bytes)": ("fp32", reads(sets["fp32"])),
        "read fp32 set (sum())": ("fp32", lambda: [w.sum() for _, w in sets["fp32"]]),
        "fp32 set, kvlab.linear": ("fp32", lambda: [
            kernels.linear(xs[w.size(1)], w) for _, w in sets["fp32"]]),
        "211 calls on 4-row Q4_1 matrices": ("calls", blocks(tiny, False)),
    }
    return out


def step_candidates(sets: dict, batch: int, ctx: int, gen) -> dict[str, tuple[str, Callable]]:  # noqa: ANN001
    """Whole SmolLM2 decode steps after the embedding in one call (``decode_layers_llama``) at
    context ``ctx``: every product of a set, RMSNorms, RoPE, grouped-query attention over the
    (30, B, 3, ctx + 1, 64) caches, SwiGLU, the head."""
    import torch

    from engine.kernels import cpu as kernels

    c, nh, nkv, hs = 576, 9, 3, 64
    norms = [torch.ones(c) for _ in range(2 * LAYERS + 1)]
    k_buf = torch.randn(LAYERS, batch, nkv, ctx + 1, hs, generator=gen)
    v_buf = torch.randn(LAYERS, batch, nkv, ctx + 1, hs, generator=gen)
    ang = torch.arange(ctx + 1.0)[:, None] * 100000.0 ** -(torch.arange(0, hs, 2) / hs)[None]
    cos, sin = ang.cos(), ang.sin()
    x = torch.randn(batch, c, generator=gen) * 0.1
    kinds = {"fp32": 0, "Q8_0": kernels.Q8_0, "Q4_1": kernels.Q4_1}  # 0: kvlab::linear
    exact = {kernels.Q8_0: kernels.Q8_0_EXACT, kernels.Q4_1: kernels.Q4_1_EXACT, 0: 0}

    def step(ws: list, use_exact: bool = False) -> Callable:
        kind = [kinds[f] for f, _ in ws]
        kind = [exact[k] for k in kind] if use_exact else kind
        mats = [w for _, w in ws]
        outs = [w.size(0) for w in mats]
        nothing = [None] * len(mats)
        return lambda: kernels.decode_layers_llama(x, norms, mats, nothing, nothing, kind, outs,
                                                   k_buf, v_buf, cos, sin, ctx, nh, nkv, 1e-5)

    def stacked(ws: list) -> list:  # q|k|v and gate|up as one product each
        out = []
        for i in range(LAYERS):
            layer = ws[7 * i: 7 * i + 7]
            out += [(layer[0][0], torch.cat([w for _, w in layer[0:3]])), layer[3],
                    (layer[4][0], torch.cat([layer[4][1], layer[5][1]])), layer[6]]
        return out + [ws[-1]]

    q41_stacked = stacked(sets["Q4_1"])
    return {
        f"Q4_1 step @{ctx}, integer": ("Q4_1", step(sets["Q4_1"])),
        f"Q4_1 step @{ctx}, integer, q|k|v + gate|up": ("Q4_1", step(q41_stacked)),
        f"Q4_1 step @{ctx}, exact": ("Q4_1", step(sets["Q4_1"], True)),
        f"Q8_0 step @{ctx}, integer": ("Q8_0", step(sets["Q8_0"])),
        f"fp32 step @{ctx}, kvlab.linear": ("fp32", step(sets["fp32"])),
    }


def check() -> None:
    """The integer and exact ways agree to the activation's rounding on one matrix of each."""
    import torch

    from engine.kernels import cpu as kernels

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 576, generator=gen)
    for fmt, fn in (("Q4_1", kernels.q4_1_linear), ("Q8_0", kernels.q8_0_linear)):
        w = random_blocks(fmt, 64, 576, gen)
        a, b = fn(x, w, None, False), fn(x, w, None, True)
        rel = float((a - b).abs().max() / b.abs().max())
        assert rel < 0.05, f"{fmt}: integer and exact ways differ by {rel:.3f} of the output"


def load() -> list[float]:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else []


def measure(args: argparse.Namespace) -> tuple[list[dict], dict]:
    import torch

    from engine.kernels import cpu as kernels

    ok, why = kernels.build()
    if not ok:
        raise SystemExit(f"the kernel is not built: {why}")
    gen = torch.Generator().manual_seed(0)
    sets = weight_sets(gen)
    nbytes = {k: sum(w.numel() * w.element_size() for _, w in ws) for k, ws in sets.items()}
    nbytes["calls"] = sum(w[:4].numel() for _, w in sets["Q4_1"])
    conditions = {"isa": kernels.isa(), "load_before": load(), "cpu_count": os.cpu_count(),
                  "bytes": nbytes}
    print(f"ISA {kernels.isa()}; bytes per set: " + ", ".join(
        f"{k} {v / 1e6:.1f} MB" for k, v in nbytes.items()) + f"; load {load()}", flush=True)
    rows = []
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    conditions["clock"] = args.clock
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        share = 1 if args.clock == "wall" else threads
        for batch in [int(b) for b in args.batch.split(",")]:
            xs = {n: torch.randn(batch, n, generator=gen) for n in (576, 1536)}
            cands = candidates(sets, xs)
            if args.context:
                cands.update(step_candidates(sets, batch, args.context, gen))
            check()
            per: dict[str, list[float]] = {n: [] for n in cands}
            with torch.no_grad():
                for rnd in range(args.rounds):
                    for name in (list(cands) if rnd % 2 == 0 else list(cands)[::-1]):
                        fn = cands[name][1]
                        fn()
                        for _ in range(args.repeats):
                            t0 = clock()
                            fn()
                            per[name].append((clock() - t0) * 1e3 / share)
            med = {n: statistics.median(s) for n, s in per.items()}
            floor = {"Q4_1": med["read Q4_1 set (read_bytes)"],
                     "Q8_0": med["read Q8_0 set (read_bytes)"],
                     "fp32": min(med["read fp32 set (read_bytes)"],
                                 med["read fp32 set (sum())"])}
            for name, samples in per.items():
                storage, ms = cands[name][0], med[name]
                rows.append({
                    "threads": threads, "batch": batch, "candidate": name, "storage": storage,
                    "bytes": nbytes[storage], "latency_ms": ms, "min_ms": min(samples),
                    "samples_ms": samples, "gbps": nbytes[storage] / ms / 1e6,
                    "x_own_read": ms / floor[storage] if storage in floor else None,
                    "x_fp32_read": ms / floor["fp32"]})
                own = f"{ms / floor[storage]:5.2f}x own read" if storage in floor else " " * 18
                print(f"{threads}t B={batch} {name:34s} {ms:7.2f} ms (min {min(samples):6.2f})"
                      f" {own} {ms / floor['fp32']:5.2f}x fp32 read "
                      f"{nbytes[storage] / ms / 1e6:6.1f} GB/s", flush=True)
    conditions["load_after"] = load()
    return rows, conditions


def markdown(rows: list[dict], conditions: dict) -> str:
    lines = [f"ISA `{conditions['isa']}`, {conditions['clock']} clock, load average "
             f"{conditions['load_before']} before, {conditions['load_after']} after.", "",
             "| threads | batch | candidate | ms (median) | ms (min) | × own read | × fp32 read "
             "| GB/s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        own = "–" if r["x_own_read"] is None else f"{r['x_own_read']:.2f}×"
        lines.append(f"| {r['threads']} | {r['batch']} | {r['candidate']} | "
                     f"{r['latency_ms']:.2f} | {r['min_ms']:.2f} | {own} | "
                     f"{r['x_fp32_read']:.2f}× | {r['gbps']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, conditions = measure(args)
    print()
    print(markdown(rows, conditions))
    if args.out:
        from instruments.measure.device import describe_device
        from instruments.store import results

        meta = results.collect_meta(model="SmolLM2-135M shapes", device="cpu",
                                    device_name=describe_device("cpu").get("name"),
                                    dtype="Q4_1/Q8_0/float32", batch_size=args.batch,
                                    weights="random", threads=args.threads,
                                    command="scripts/bench_blocks.py " + " ".join(
                                        argv if argv is not None else sys.argv[1:]),
                                    **conditions)
        run = results.new_run("blocks", meta, {"blocks": rows})
        print(f"saved {results.save_run(run, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
