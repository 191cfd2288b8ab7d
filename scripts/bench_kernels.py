#!/usr/bin/env python
"""Kernel benchmark: every way we know to multiply one token by gpt2's weights, against a read.

    python scripts/bench_kernels.py                    # 1 and 2 threads, 5 rounds
    python scripts/bench_kernels.py --threads 1 --rounds 3 --out /tmp/kernels

A cached decode step at batch 1 is a chain of matrix-vector products over every weight, so its
floor is the time to stream the weights from memory. Per kind of matrix (q|k|v, attention
projection, MLP up, MLP down: all 12 layers' matrices one after another, so that nothing stays
in the 32 MiB L3 between calls, as in a real step; and the 50257 x 768 output projection), each
candidate is timed with the ``Sampler`` (``instruments.measure.sampler.time_call``) in
interleaved rounds beside ``sum()`` of the same fp32 matrices -- the read floor:

  fp32   ``F.linear`` over the model's ``[out, in]`` weight; mode 8's packed ``[in, out]``
         copies (``engine.decoders.fast.PackedLinear``, one chunk per thread); our C++ kernel
         (``engine.kernels.cpu``) over the ``[out, in]`` weight, and over an interleaved copy
         (``kernels.interleave``: every four rows one contiguous stream)
  bf16   ``F.linear`` in bf16; the C++ kernel over bf16 rows
  int8   the plain-PyTorch chunked dequantize + mm (``engine.quant.weight_only``'s fallback); the
  C++
         kernel over int8 rows with a scale per row
Every candidate's output is checked against fp32 ``F.linear`` before it is timed. Then the
attention over the cache at 128 and 512 tokens (12 layers x 12 heads of 64, one new token):
SDPA on 4-D views with the two row writes (what ``attend_filled`` ran before) against the C++
``attend`` (write + attention in one call), beside ``sum()`` of the same cached K and V bytes
(table ``attention``). The run is saved (kind ``kernels``) into ``--out`` (default
``docs/runs/engine-speed/``, with the kernel's instruction set, ``kernels.isa()``) and its
Markdown table printed. Run it on a quiet machine. The GGUF block products have their own
benchmark over SmolLM2's matrices: ``scripts/bench_blocks.py``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KINDS = ("c_attn", "attn.c_proj", "c_fc", "mlp.c_proj", "lm_head")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per candidate per round")
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--out", default=str(ROOT / "docs" / "runs" / "engine-speed"))
    ap.add_argument("--no-save", action="store_true")
    return ap.parse_args(argv)


def matrices(model, kind: str) -> list:  # noqa: ANN001
    tr = model.transformer
    if kind == "lm_head":
        return [model.lm_head]
    attr = {"c_attn": "attn.c_attn", "attn.c_proj": "attn.c_proj", "c_fc": "mlp.c_fc",
            "mlp.c_proj": "mlp.c_proj"}[kind]
    return [b.get_submodule(attr) for b in tr.h]


def candidates(lins: list, threads: int) -> dict[str, tuple[str, int, Callable]]:
    """name -> (storage, bytes read, fn(x) over every matrix of the kind)."""
    import torch
    import torch.nn.functional as F

    from engine.decoders.fast import PackedLinear
    from engine.kernels import cpu as kernels
    from engine.quant.weight_only import int8_chunked, quantize_rows

    ws = [m.weight.detach() for m in lins]
    fp32_bytes = sum(w.numel() * 4 for w in ws)
    out: dict[str, tuple[str, int, Callable]] = {}

    def over(fn: Callable) -> Callable:
        return lambda x: [fn(x, i) for i in range(len(ws))]

    out["read: sum() fp32"] = ("float32", fp32_bytes, lambda x: [w.sum() for w in ws])
    out["F.linear fp32 [out,in]"] = ("float32", fp32_bytes, over(lambda x, i: F.linear(x, ws[i])))
    packed = [PackedLinear.from_out_in(w, None, threads) for w in ws]
    out["packed fp32 [in,out] (mode 8)"] = ("float32", fp32_bytes,
                                            over(lambda x, i: packed[i](x)))
    ok, why = kernels.available()
    if ok:
        out["C++ kernel fp32"] = ("float32", fp32_bytes,
                                  over(lambda x, i: kernels.linear(x, ws[i])))
        inter = [kernels.interleave(w) for w in ws]
        out["C++ kernel fp32, interleaved copy"] = ("float32", fp32_bytes, over(
            lambda x, i: kernels.linear_interleaved(x, inter[i], ws[i].size(0))))
    bf = [w.to(torch.bfloat16).contiguous() for w in ws]
    out["F.linear bf16"] = ("bfloat16", fp32_bytes // 2,
                            over(lambda x, i: F.linear(x.to(torch.bfloat16), bf[i]).float()))
    if ok:
        out["C++ kernel bf16"] = ("bfloat16", fp32_bytes // 2,
                                  over(lambda x, i: kernels.linear(x, bf[i])))
    q = [quantize_rows(w) for w in ws]
    int8_bytes = sum(wq.numel() + s.numel() * 4 for wq, s in q)
    out["chunked dequantize + mm int8"] = ("int8", int8_bytes,
                                           over(lambda x, i: int8_chunked(x, *q[i])))
    if ok:
        out["C++ kernel int8"] = ("int8", int8_bytes,
                                  over(lambda x, i: kernels.linear(x, q[i][0], q[i][1])))
    else:
        print(f"C++ kernel not timed: {why}", file=sys.stderr)
    return out


def check(cands: dict, lins: list, x) -> dict[str, float]:  # noqa: ANN001
    """Largest |Δ| of each candidate's outputs against fp32 F.linear, over the largest |y|."""
    import torch.nn.functional as F

    want = [F.linear(x, m.weight.detach()) for m in lins]
    scale = max(float(w.abs().max()) for w in want)
    errs = {}
    for name, (_, _, fn) in cands.items():
        if name.startswith("read"):
            continue
        got = fn(x)
        errs[name] = max(float((g.reshape(w.shape) - w).abs().max())
                         for g, w in zip(got, want, strict=True)) / scale
    return errs


def measure(args: argparse.Namespace) -> list[dict]:
    import torch

    from engine.kernels import cpu as kernels
    from instruments.measure.sampler import time_call
    from instruments.spine import ModelSpec, load

    kernels.available()
    print(f"kernel ISA: {kernels.isa()} (KVLAB_KERNEL_ISA picks another build)", flush=True)
    model = load(ModelSpec(args.model, "random", "cpu", "float32")).model
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for kind in KINDS:
            lins = matrices(model, kind)
            x = torch.randn(1, lins[0].weight.size(1))
            cands = candidates(lins, threads)
            errs = check(cands, lins, x)
            per: dict[str, list[float]] = {n: [] for n in cands}
            with torch.no_grad():
                for rnd in range(args.rounds):
                    order = list(cands) if rnd % 2 == 0 else list(cands)[::-1]
                    for name in order:
                        fn = cands[name][2]
                        t = time_call(lambda fn=fn, x=x: fn(x), warmup=1, repeats=args.repeats)
                        per[name].extend(t.samples_ms)
            floor = statistics.median(per["read: sum() fp32"])
            for name, samples in per.items():
                storage, nbytes, _ = cands[name]
                ms = statistics.median(samples)
                rows.append({"threads": threads, "kind": kind, "matrices": len(lins),
                             "shape": list(lins[0].weight.shape), "candidate": name,
                             "storage": storage, "bytes": nbytes, "latency_ms": ms,
                             "samples_ms": samples, "gbps": nbytes / ms / 1e6,
                             "x_fp32_read": ms / floor, "max_rel_err": errs.get(name)})
                print(f"{threads}t {kind:12s} {name:32s} {ms:8.2f} ms {nbytes / ms / 1e6:6.1f}"
                      f" GB/s  {ms / floor:5.2f}x read", flush=True)
    return rows


def attention_rows(threads: int, rounds: int, repeats: int) -> list[dict]:
    """SDPA (with the row writes) against the C++ ``attend`` over gpt2's 12 layers' caches."""
    import torch
    import torch.nn.functional as F

    from engine.kernels import cpu as kernels
    from instruments.measure.sampler import time_call

    if not kernels.available()[0]:
        return []
    torch.set_num_threads(threads)
    layers, nh, hs, t_max = 12, 12, 64, 1024
    gen = torch.Generator().manual_seed(0)
    k_buf = torch.randn(layers, 1, nh, t_max, hs, generator=gen)
    v_buf = torch.randn(layers, 1, nh, t_max, hs, generator=gen)
    q, k, v = torch.randn(1, 3, nh, hs, generator=gen).unbind(1)
    rows = []
    for ctx in (128, 512):
        pos = ctx - 1

        def sdpa(pos: int = pos) -> list:
            out = []
            for i in range(layers):
                k_buf[i, :, :, pos], v_buf[i, :, :, pos] = k, v
                out.append(F.scaled_dot_product_attention(
                    q.unsqueeze(2), k_buf[i, :, :, : pos + 1], v_buf[i, :, :, : pos + 1]))
            return out

        cands = {"read: sum() of the cached K and V": lambda pos=pos: [
                     (k_buf[i, :, :, : pos + 1].sum(), v_buf[i, :, :, : pos + 1].sum())
                     for i in range(layers)],
                 "SDPA, one query (+ 2 row writes)": sdpa,
                 "C++ kernel attend": lambda pos=pos: [
                     kernels.attend(q, k, v, k_buf[i], v_buf[i], pos) for i in range(layers)]}
        want = torch.stack([y.reshape(nh, hs) for y in sdpa()])
        got = torch.stack([y.reshape(nh, hs) for y in cands["C++ kernel attend"]()])
        err = float((got - want).abs().max() / want.abs().max())
        per: dict[str, list[float]] = {n: [] for n in cands}
        with torch.no_grad():
            for rnd in range(rounds):
                for name in (list(cands) if rnd % 2 == 0 else list(cands)[::-1]):
                    per[name].extend(time_call(cands[name], warmup=1,
                                               repeats=repeats).samples_ms)
        nbytes = 2 * layers * nh * ctx * hs * 4
        floor = statistics.median(per["read: sum() of the cached K and V"])
        for name, samples in per.items():
            ms = statistics.median(samples)
            rows.append({"threads": threads, "context_len": ctx, "candidate": name,
                         "bytes": nbytes, "latency_ms": ms, "samples_ms": samples,
                         "gbps": nbytes / ms / 1e6, "x_kv_read": ms / floor,
                         "max_rel_err": err if name.startswith("C++") else None})
            print(f"{threads}t attention@{ctx:<4d} {name:34s} {ms:8.2f} ms "
                  f"{ms / floor:5.2f}x read", flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    """One table per thread count: kind × candidate, ms and × the fp32 read."""
    names = list(dict.fromkeys(r["candidate"] for r in rows))
    lines = []
    for threads in sorted({r["threads"] for r in rows}):
        lines += [f"{threads} thread(s): ms per pass over the matrices (× a read of the fp32 "
                  "bytes)", "", "| candidate | " + " | ".join(KINDS) + " |",
                  "|---|" + "---|" * len(KINDS)]
        for n in names:
            cells = []
            for k in KINDS:
                r = next((r for r in rows if r["threads"] == threads and r["kind"] == k
                          and r["candidate"] == n), None)
                cells.append("–" if r is None else
                             f"{r['latency_ms']:.2f} ({r['x_fp32_read']:.2f}×)")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from instruments.store import results

    rows = measure(args)
    attention = [r for t in args.threads.split(",")
                 for r in attention_rows(int(t), args.rounds, args.repeats)]
    print()
    print(markdown(rows))
    if not args.no_save:

        from engine.kernels import cpu as kernels
        from instruments.measure.device import describe_device

        meta = results.collect_meta(model=args.model, device="cpu",
                                    device_name=describe_device("cpu").get("name"),
                                    dtype="float32", batch_size=1, weights="random",
                                    command="scripts/bench_kernels.py " + " ".join(argv or
                                                                                  sys.argv[1:]),
                                    threads=args.threads, isa=kernels.isa())
        run = results.new_run("kernels", meta, {"kernels": rows, "attention": attention})
        print(f"saved {results.save_run(run, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
