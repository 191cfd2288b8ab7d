#!/usr/bin/env python
"""Whole decode steps of modes 8, 12, 13, 14 and 15 on real model shapes, against reads of
their own bytes and of the fp32 weights.

    python scripts/bench_rungs.py                          # smollm2-135m and gpt2, ctx 128 and
                                                           # 512, 1 and 2 threads, 7 rounds
    python scripts/bench_rungs.py --models smollm2-135m --threads 1 --contexts 128 --rounds 3
    python scripts/bench_rungs.py --gate                   # also each mode's logits error
    python scripts/bench_rungs.py --out docs/runs/rungs    # save the run (kind "rungs")
    python scripts/bench_rungs.py --exact --modes q8_0_weights,q4_1_weights  # the other way

Per model (SmolLM2-135M with the package's weights, gpt2 with ``auto`` weights: pretrained where
the Hugging Face cache holds them, random otherwise -- the speed does not depend on the values)
and thread count, each mode's decoder (``instruments.lineup.make_decoder``: mode 8 chooses its
products per role for this thread count when it is built) is filled to the context with one
fixed random sequence, then a step at that context is timed over and over (``rewind`` puts the
cache back, so every sample is the same step: the new token at position ``ctx``). Beside the
steps, in the same rounds: a read of each mode's own bytes (``kernels.read_bytes`` over the very
tensors its step multiplies by, in step order: the packed / int8 / bf16 copies or the GGUF
blocks) and of the fp32 Linear weights (the better of ``read_bytes`` and ``sum()``). Each round
times every candidate (one warm-up call, then ``--repeats`` timed calls) in an order reversed
every other round; the table gives medians, each step as a multiple of its own read and of the
fp32 read, and GB/s over its own weight bytes. The attention's K/V bytes at the context are
listed apart (``kv MB``): the reads do not include them.

The machine's load average is recorded before and after, with the ISA, the CPU and the thread
counts: run it in a quiet window (load below ~0.3 on a 2-core host) and compare multiples, not
milliseconds, across machines. llama.cpp's own SmolLM2 Q4_1 step on these hosts, for scale:
26.8 ms at 1 thread, 17.5 ms at 2 (context 128; scripts/bench_peers.py measures it afresh).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = ("fast", "int8_weights", "bf16_weights", "q8_0_weights", "q4_1_weights")
WEIGHTS = {"smollm2-135m": "package", "gpt2": "auto"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m,gpt2")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--contexts", default="128,512")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per candidate per round")
    ap.add_argument("--gate", action="store_true",
                    help="also run the gate per model and mode: max |Δ logit| / largest |logit|")
    ap.add_argument("--exact", action="store_true",
                    help="the block rungs through the kernel's exact way (blocks widened to fp32 "
                         "in registers) instead of the integer way they use: to re-measure the "
                         "choice (engine.quant.blocks.EXACT)")
    ap.add_argument("--out", default=None, help="save the run (kind 'rungs') into this folder")
    return ap.parse_args(argv)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def step_tensors(dec) -> list:  # noqa: ANN001
    """The tensors a decoder's step multiplies by, in step order (weights, then scales)."""
    w = dec.step_weights
    if hasattr(w, "n_kv_head"):  # the Llama family's step weights
        fns = [f for layer in w.layers for f in (layer.q, layer.k, layer.v, layer.o, layer.gate,
                                                 layer.up, layer.down)] + [w.head]
    else:
        fns = [f for layer in w.layers for f in (layer[1], layer[2], layer[4], layer[5])]
        fns.append(w.head)
    out = []
    for f in fns:
        p = f.product
        out += [t for t in (p.weight, p.scale) if t is not None]
    return out


def fp32_weights(model) -> list:  # noqa: ANN001
    """The model's own Linear weights (the tied head once), in module order."""
    import torch

    seen, out = set(), []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            out.append(m.weight.detach())
    return out


def nbytes(ts: list) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def gate_shares(state, modes: list[str]) -> dict[str, float]:  # noqa: ANN001
    from instruments.checks.gate import Gate

    gate = Gate(state)
    out = {}
    for name in modes:
        verdict = gate.check(name)
        out[name] = verdict.max_diff / gate.reference()["scale"] if verdict.max_diff is not None \
            else float("nan")
        print(f"  gate {name:14s} {'passed' if verdict.passed else 'FAILED'}: "
              f"{out[name]:.4f} of the largest logit ({verdict.detail})", flush=True)
    return out


def measure(args: argparse.Namespace) -> tuple[list[dict], dict]:
    import torch

    from engine.kernels import cpu as kernels
    from instruments import lineup

    ok, why = kernels.build()
    if not ok:
        raise SystemExit(f"the kernel is not built: {why}")
    if args.exact:
        from engine.quant import blocks as quant_blocks

        quant_blocks.EXACT = True
    modes = args.modes.split(",")
    contexts = [int(c) for c in args.contexts.split(",")]
    conditions: dict = {"isa": kernels.isa(), "cpu": cpu_name(), "cpu_count": os.cpu_count(),
                        "block_way": "exact" if args.exact else "integer",
                        "load_before": load(), "torch": torch.__version__, "gate": {},
                        "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    print(f"ISA {conditions['isa']}, {conditions['cpu']}, {os.cpu_count()} CPUs, load "
          f"{conditions['load_before']}", flush=True)
    rows: list[dict] = []
    for name in args.models.split(","):
        state = lineup.load_model(name, WEIGHTS.get(name, "auto"))
        model, cfg = state.model, state.model.config
        label = state.provenance.label
        print(f"\n{name}: {label}", flush=True)
        if args.gate:
            torch.set_num_threads(max(int(t) for t in args.threads.split(",")))
            conditions["gate"][name] = gate_shares(state, modes)
        fp32 = fp32_weights(model)
        ids = torch.randint(0, cfg.vocab_size, (1, max(contexts) + 1),
                            generator=torch.Generator().manual_seed(0))
        kv_per_token = cfg.kv_bytes_per_token(4)
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)
            decs = {}
            for mode in modes:
                t0 = time.perf_counter()
                decs[mode] = lineup.make_decoder(state, mode, capacity=max(contexts) + 2)
                print(f"  {threads}t built {mode} in {time.perf_counter() - t0:.1f} s: "
                      f"{decs[mode].kernel}", flush=True)
                tuned = getattr(getattr(decs[mode], "weights", None), "tuned_ms", {})
                for role, ms in tuned.items():  # mode 8's per-role timings that chose its ways
                    print(f"      {role:12s} " + ", ".join(f"{how} {t:.2f}" for how, t in
                                                        sorted(ms.items(), key=lambda x: x[1]))
                          + " ms", flush=True)
                    conditions.setdefault("fast_tuned_ms", {}).setdefault(
                        f"{name} {threads}t", {})[role] = ms
            own = {m: step_tensors(d) for m, d in decs.items()}
            for ctx in contexts:
                token = ids[:, ctx : ctx + 1]

                def stepper(dec, ctx=ctx, token=token, ids=ids) -> Callable[[], None]:  # noqa: ANN001
                    dec.seek(ids, ctx)

                    def run() -> None:
                        dec.step(token)
                        dec.rewind(ctx)
                    return run

                cands: dict[str, tuple[str, int, Callable[[], object]]] = {
                    "read fp32 weights (read_bytes)": ("fp32", nbytes(fp32), lambda w=fp32: [
                        kernels.read_bytes(t) for t in w]),
                    "read fp32 weights (sum())": ("fp32", nbytes(fp32),
                                                  lambda w=fp32: [t.sum() for t in w])}
                for mode, dec in decs.items():
                    ts = own[mode]
                    cands[f"read {mode}'s own bytes"] = (
                        f"own:{mode}", nbytes(ts), lambda ts=ts: [kernels.read_bytes(t)
                                                                  for t in ts])
                    cands[f"step {mode}"] = (mode, nbytes(ts), stepper(dec))
                per: dict[str, list[float]] = {n: [] for n in cands}
                with torch.no_grad():
                    for rnd in range(args.rounds):
                        for cand in (list(cands) if rnd % 2 == 0 else list(cands)[::-1]):
                            fn = cands[cand][2]
                            fn()
                            for _ in range(args.repeats):
                                t0 = time.perf_counter()
                                fn()
                                per[cand].append((time.perf_counter() - t0) * 1e3)
                med = {n: statistics.median(s) for n, s in per.items()}
                floor = min(med["read fp32 weights (read_bytes)"],
                            med["read fp32 weights (sum())"])
                for cand, (what, size, _) in cands.items():
                    ms = med[cand]
                    own_read = None
                    if cand.startswith("step "):
                        own_read = med[f"read {what}'s own bytes"]
                    row = {"model": name, "weights": label, "threads": threads, "context": ctx,
                           "candidate": cand, "bytes": size, "kv_bytes": kv_per_token * (ctx + 1),
                           "latency_ms": ms, "min_ms": min(per[cand]), "samples_ms": per[cand],
                           "x_own_read": None if own_read is None else ms / own_read,
                           "x_fp32_read": ms / floor, "gbps": size / ms / 1e6}
                    rows.append(row)
                    xo = f"{row['x_own_read']:5.2f}x own read" if own_read else " " * 14
                    print(f"  {threads}t ctx {ctx:4d} {cand:34s} {ms:8.2f} ms (min "
                          f"{min(per[cand]):7.2f}) {xo} {ms / floor:5.2f}x fp32 read "
                          f"{size / 1e6:7.1f} MB {size / ms / 1e6:5.1f} GB/s", flush=True)
            del decs
    conditions["load_after"] = load()
    return rows, conditions


def markdown(rows: list[dict], conditions: dict) -> str:
    lines = [f"ISA `{conditions['isa']}`, {conditions['cpu']} ({conditions['cpu_count']} CPUs), "
             f"block rungs' way: {conditions['block_way']}, "
             f"torch {conditions['torch']}, load average {conditions['load_before']} before, "
             f"{conditions['load_after']} after.", "",
             "| model | threads | ctx | step | ms (median) | × own read | × fp32 read | "
             "weights MB | GB/s | kv MB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["candidate"].startswith("step "):
            continue
        lines.append(f"| {r['model']} | {r['threads']} | {r['context']} | "
                     f"{r['candidate'].removeprefix('step ')} | {r['latency_ms']:.2f} | "
                     f"{r['x_own_read']:.2f}× | {r['x_fp32_read']:.2f}× | "
                     f"{r['bytes'] / 1e6:.1f} | {r['gbps']:.1f} | {r['kv_bytes'] / 1e6:.1f} |")
    for model, shares in conditions.get("gate", {}).items():
        lines += ["", f"Gate on {model}: " + ", ".join(
            f"{m} {s:.4f}" for m, s in shares.items()) + " of the largest logit"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, conditions = measure(args)
    print()
    print(markdown(rows, conditions))
    if args.out:
        from instruments.measure.device import describe_device
        from instruments.store import results

        meta = results.collect_meta(model=args.models, device="cpu",
                                    device_name=describe_device("cpu").get("name"),
                                    dtype="float32", batch_size=1, weights="see rows",
                                    threads=args.threads,
                                    command="scripts/bench_rungs.py " + " ".join(
                                        argv if argv is not None else sys.argv[1:]),
                                    **conditions)
        run = results.new_run("rungs", meta, {"rungs": rows})
        print(f"saved {results.save_run(run, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
