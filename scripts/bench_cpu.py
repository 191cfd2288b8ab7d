#!/usr/bin/env python
"""CPU benchmark: our decode modes against transformers' GPT-2, side by side in one process.

    python scripts/bench_cpu.py            # gpt2 shapes, random weights (~1-2 minutes)
    python scripts/bench_cpu.py --tiny     # a tiny config: smoke run, ratios printed, no goals
    python scripts/bench_cpu.py --compile  # also modes 7 and 9 (compiles for minutes first)

Both engines hold the same random weights (``engine.weights.to_transformers``). Every variant
is timed in rounds, interleaved with the others and with a weight-read floor (summing a tensor
as large as the Linear weights a step must stream), so all of them see the same bandwidth
regime; results are quoted as multiples of transformers and of that floor. A cached step is
re-timed at the same context by rewinding the cache after it (untimed). Before timing, every
mode's greedy tokens are checked against mode 1 and the fast path's logits against
transformers'; after timing, each cached mode's memory growth per step is measured with the
profiler. Prints a markdown table for the README and checks the goals of issue 5 (unless
``--tiny``). Do not run it while other heavy work shares the cores: the numbers would lie.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine import GPT, GPTConfig, make_decoder  # noqa: E402
from engine.modes import MODES  # noqa: E402
from engine.weights import to_transformers  # noqa: E402
from instruments.checks.gate import Gate  # noqa: E402
from instruments.costmodel import costs  # noqa: E402
from instruments.measure.memory import step_memory_growth  # noqa: E402

CACHED = ["concat", "prealloc", "prealloc_fused", "fast"]
COMPILED = ["compiled", "fast_compiled"]
PREALLOCATED = {"prealloc", "prealloc_fused", "fast", "compiled", "fast_compiled"}
VARIANT_ONE_CHUNK = "8 · fast path, unsplit (addmm on [in, out], one core)"
TINY = dict(n_layer=2, n_head=2, n_embd=64, block_size=256, vocab_size=512)


@dataclass
class Bench:
    row: str  # table row
    ctx: int  # context length (tokens in view)
    timed: Callable[[], Any]
    reset: Callable[[], None] = lambda: None
    samples: list[float] = field(default_factory=list)

    @property
    def ms(self) -> float:
        return statistics.median(self.samples)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny config smoke run; no goals")
    ap.add_argument("--compile", action="store_true", help="include modes 7 and 9 (slow)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    ap.add_argument("--per-round", type=int, default=3, help="calls per variant per round")
    ap.add_argument("--contexts", type=int, nargs="+", default=None)
    ap.add_argument("--memory-steps", type=int, default=None, help="steps for memory growth")
    ap.add_argument("--variants", action="store_true",
                    help="also the fast path unsplit (one chunk), to see what the split buys")
    ap.add_argument("--save", action="store_true", help="also write a run into results/")
    ap.add_argument("--strict", action="store_true", help="exit 1 if a goal is missed")
    return ap.parse_args(argv)


def _hf_cached(hf: Any, ids: torch.Tensor, ctx: int) -> Bench:
    with torch.no_grad():
        pkv = hf(input_ids=ids[:, : ctx - 1], use_cache=True).past_key_values
    token = ids[:, ctx - 1 : ctx]

    def timed() -> Any:
        with torch.no_grad():
            return hf(input_ids=token, past_key_values=pkv, use_cache=True).logits

    return Bench("transformers, cached (DynamicCache)", ctx, timed, lambda: pkv.crop(-1))


def _ours(model: GPT, mode: str, ids: torch.Tensor, contexts: list[int], label: str | None = None,
          **kwargs: Any) -> list[Bench]:
    """One bench per context, each with its own decoder prefilled to context - 1 tokens.

    Slow-setup (compiled) modes share one static cache per model, so they get one decoder
    prefilled to the longest context and moved to each context by setting the cache length:
    rows past it keep stale values, which changes the logits but not the work of a step.
    """
    label = label or MODES[mode].label
    if not MODES[mode].slow_setup:
        out = []
        for ctx in contexts:
            dec = make_decoder(model, mode, capacity=ctx + 8, **kwargs)
            token = dec.prefill(ids[:, : ctx - 1]).argmax(-1, keepdim=True)
            out.append(Bench(label, ctx, lambda dec=dec, t=token: dec.step(t),
                             lambda dec=dec, n=ctx - 1: dec.rewind(n)))
        return out
    dec = make_decoder(model, mode)
    token = dec.prefill(ids[:, : max(contexts) - 1]).argmax(-1, keepdim=True)

    def seek(n: int) -> None:
        dec.cache.length = n
        dec.seq = dec._tokens[:, :n]

    return [Bench(label, ctx, lambda: dec.step(token), lambda n=ctx - 1: seek(n))
            for ctx in contexts]


def build(model: GPT, hf: Any, ids: torch.Tensor, contexts: list[int],
          modes: list[str], variants: bool = False) -> list[Bench]:
    benches: list[Bench] = []
    floor_numel = costs.linear_weight_bytes(model.config, model.dtype) // 4
    big = torch.ones(floor_numel)  # ones: every page touched before timing
    for ctx in contexts:
        benches.append(Bench("weight-read floor", ctx, lambda: big.sum()))
        benches.append(_hf_cached(hf, ids, ctx))
    c0 = contexts[0]
    with torch.no_grad():
        benches.append(Bench("transformers, use_cache=False", c0,
                             lambda: hf(input_ids=ids[:, :c0], use_cache=False).logits))
    full = make_decoder(model, "uncached_last")
    benches.append(Bench(MODES["uncached_last"].label, c0, lambda: full.prefill(ids[:, :c0])))
    for mode in modes:
        benches += _ours(model, mode, ids, contexts)
    if variants and "fast" in modes:  # what the split buys: the same path on one core
        benches += _ours(model, "fast", ids, contexts, VARIANT_ONE_CHUNK, chunks=1)
    return benches


@torch.no_grad()
def run_rounds(benches: list[Bench], rounds: int, per_round: int) -> None:
    for b in benches:  # warm-up, untimed (and each bench moved to its context)
        b.reset()
        b.timed()
        b.reset()
    for r in range(rounds):
        order = benches if r % 2 == 0 else benches[::-1]  # no variant always goes first
        for b in order:
            for _ in range(per_round):
                b.reset()  # untimed: back to the bench's context (shared decoders move)
                t0 = time.perf_counter()
                b.timed()
                b.samples.append((time.perf_counter() - t0) * 1e3)


def checks(model: GPT, hf: Any, modes: list[str], ids: torch.Tensor) -> list[str]:
    lines = []
    gate = Gate(model)
    for mode in ["uncached_last", *modes]:
        c = gate.check(mode)
        lines.append(f"{mode}: {'ok' if c.passed else 'FAILED'} ({c.detail})")
    with torch.no_grad():
        want = hf(input_ids=ids[:, :33], use_cache=False).logits[:, -1]
        for mode in [m for m in ("prealloc_fused", "fast", "fast_compiled") if m in modes]:
            dec = make_decoder(model, mode)
            dec.prefill(ids[:, :32])
            got = dec.step(ids[:, 32:33])
            lines.append(f"{mode} step logits vs transformers: max |diff| "
                         f"{float((got - want).abs().max()):.2e}")
    return lines


def memory(model: GPT, modes: list[str], ids: torch.Tensor, steps: int) -> dict[str, Any]:
    out = {}
    for mode in modes:
        dec = make_decoder(model, mode, capacity=16 + steps + 2)
        out[mode] = step_memory_growth(dec, ids[:, :16], steps)["net_bytes_per_step"]
    return out


def fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if x is None else f"{x:{spec}}{suffix}"


def table(benches: list[Bench], contexts: list[int], mem: dict[str, Any],
          compile_s: dict[str, float]) -> str:
    def one(row: str, ctx: int) -> Bench | None:
        return next((b for b in benches if b.row == row and b.ctx == ctx), None)

    head = "| variant |"
    for ctx in contexts:
        head += f" ctx {ctx} (ms) | × transformers | × floor |"
    head += " net bytes / step |"
    lines = [head, "|" + "---|" * (1 + 3 * len(contexts) + 1)]
    rows = list(dict.fromkeys(b.row for b in benches))
    by_label = {MODES[m].label: m for m in MODES}
    for row in rows:
        line = f"| {row} |"
        for ctx in contexts:
            b = one(row, ctx)
            floor = one("weight-read floor", ctx)
            uncached = row in ("transformers, use_cache=False", MODES["uncached_last"].label)
            ref = one("transformers, use_cache=False" if uncached else
                      "transformers, cached (DynamicCache)", ctx)
            if b is None or floor is None or ref is None:
                line += " | | |"
                continue
            vs_ref = "" if row == "weight-read floor" else f"{b.ms / ref.ms:.2f}"
            line += f" {b.ms:.2f} | {vs_ref} | {b.ms / floor.ms:.2f} |"
        mode = by_label.get(row)
        note = fmt(mem.get(mode), ".0f") if mode in mem else ""
        if mode in compile_s:
            note += f" (compile {compile_s[mode]:.0f} s)"
        lines.append(line + f" {note} |")
    return "\n".join(lines)


def goals(benches: list[Bench], contexts: list[int], mem: dict[str, Any],
          ok_modes: list[str]) -> list[tuple[str, bool]]:
    def ms(row: str, ctx: int) -> float:
        return next(b.ms for b in benches if b.row == row and b.ctx == ctx)

    out = []
    labels = [MODES[m].label for m in ok_modes if MODES[m].cached]
    for ctx in contexts:
        best_label = min(labels, key=lambda lab: ms(lab, ctx))
        best = ms(best_label, ctx)
        hf = ms("transformers, cached (DynamicCache)", ctx)
        floor = ms("weight-read floor", ctx)
        out.append((f"ctx {ctx}: fastest exact cached ({best_label}) {best:.2f} ms ≤ 0.6 × "
                    f"transformers {hf:.2f} ms → {best / hf:.2f}×", best <= 0.6 * hf))
        out.append((f"ctx {ctx}: same ≤ 1.6 × weight-read floor {floor:.2f} ms → "
                    f"{best / floor:.2f}×", best <= 1.6 * floor))
    c0 = contexts[0]
    m2 = ms(MODES["uncached_last"].label, c0)
    hfu = ms("transformers, use_cache=False", c0)
    out.append((f"ctx {c0}: mode 2 {m2:.2f} ms ≤ 0.8 × transformers use_cache=False "
                f"{hfu:.2f} ms → {m2 / hfu:.2f}×", m2 <= 0.8 * hfu))
    for mode, net in mem.items():
        if mode in PREALLOCATED:
            out.append((f"{mode}: a decode step keeps {fmt(net, '.0f')} new bytes",
                        net is not None and net == 0))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = GPTConfig(**TINY) if args.tiny else GPTConfig.from_name("gpt2")
    contexts = args.contexts or ([32, 96] if args.tiny else [128, 512])
    rounds = args.rounds or (2 if args.tiny else 12)
    mem_steps = args.memory_steps or (20 if args.tiny else 100)
    modes = CACHED + (COMPILED if args.compile else [])
    if max(contexts) + mem_steps + 8 > cfg.block_size:
        raise SystemExit(f"contexts must leave room for the steps within {cfg.block_size}")
    torch.manual_seed(0)
    model = GPT.random(cfg, seed=0, std=0.2 if args.tiny else 0.02)
    hf = to_transformers(model)
    ids = torch.randint(0, cfg.vocab_size, (1, cfg.block_size),
                        generator=torch.Generator().manual_seed(1))
    what = "tiny config" if args.tiny else "gpt2 shapes"
    print(f"# {what}, random weights, fp32, batch 1, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}")
    t0 = time.perf_counter()
    check_lines = checks(model, hf, modes, ids)
    print("\n".join("check: " + line for line in check_lines))
    ok_modes = [m for m, line in zip(["uncached_last", *modes], check_lines, strict=False)
                if ": ok" in line]
    compile_s = {}
    for m in modes:
        if MODES[m].slow_setup:
            compile_s[m] = make_decoder(model, m).compile_s
    benches = build(model, hf, ids, contexts, [m for m in modes if m in ok_modes],
                    args.variants)
    run_rounds(benches, rounds, args.per_round)
    mem = memory(model, modes, ids, mem_steps)
    floor_ms = statistics.median(b.ms for b in benches if b.row == "weight-read floor")
    nbytes = costs.linear_weight_bytes(cfg, "float32")
    cmd = "python scripts/bench_cpu.py" + (" " + " ".join(sys.argv[1:]) if argv is None
                                           and sys.argv[1:] else "")
    print(f"\nCommand: `{cmd}` ({time.perf_counter() - t0:.0f} s). Weight-read floor: "
          f"{nbytes / 1e6:.0f} MB summed in {floor_ms:.2f} ms ({nbytes / floor_ms / 1e6:.1f} "
          f"GB/s). Uncached rows are against transformers use_cache=False.\n")
    md = table(benches, contexts, mem, compile_s)
    print(md)
    results = goals(benches, contexts, mem, ok_modes)
    print()
    for text, ok in results:
        verdict = "info" if args.tiny else ("PASS" if ok else "MISS")
        print(f"{verdict}: {text}")
    if args.save:
        from instruments.store.results import collect_meta, new_run, save_run

        meta = collect_meta(model=what, weights="random", device="cpu", dtype="float32",
                            batch_size=1, note=cmd)
        rows = [{"variant": b.row, "context_len": b.ctx, "latency_ms": b.ms,
                 "samples_ms": b.samples} for b in benches]
        print("saved", save_run(new_run("cpu_bench", meta, {"bench": rows})))
    missed = not args.tiny and not all(ok for _, ok in results)
    return 1 if (args.strict and missed) else 0


if __name__ == "__main__":
    raise SystemExit(main())
