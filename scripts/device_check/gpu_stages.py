"""The device check's stages about the GPU path itself (imported by scripts/device_check/stages.py):

  batch_curve     step time and tokens/s against the batch, with the weights' and the cache's
                  reads as floors (``instruments.experiments.batch_curve``)
  sdpa_backends   mode 5 and mode 8 in bf16 decoding new lengths, with our SDPA backends and with
                  cuDNN's allowed: why the engine keeps it off (first light: mode 8 at 74-76 ms a
                  step); partial when it could not time all four decodes
  triton_tiles    gpt2's products alone under a few tile sizes beside ``blocks``' own pick
  cache_reads     modes 10 and 11 both ways, side by side: the paged cache's blocks gathered and
                  the int8 cache's rows dequantized per step, against both read in place by our
                  Triton decode attention (their default on a GPU: kept only if it wins), each
                  pair's logits compared first
  prefix          the prefix cache on SmolLM2: TTFT against the cached prefix (the served
                  request, the extend and the cold prefill in interleaved rounds), then the
                  multi-turn chat with and without reuse (``instruments.experiments.prefix``)
  serving         continuous batching on SmolLM2 (``instruments.experiments.serving``): a closed
                  loop at concurrency 64, 1 and 16 (the most telling first: a stage out of time
                  keeps them), the decode step against the batch beside its floor, and whether
                  batch 64's step is within 2x its floor (the GPU goal)
  no_sdpa, no_triton  why the last two cannot run on a device (the stages table's ``skip``)
Each is handed the check's context (``stages.Check``) and saves its run through it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from instruments import lineup
from instruments.experiments import get
from instruments.measure.device import describe_device
from instruments.spine import ModelSpec, load
from instruments.store import results


def batch_curve(check: Any) -> None:  # step and tokens/s against the batch, with the floors
    fp32, exp = check.model("float32"), get("batch_curve")
    params = exp.defaults(check.args.device, fp32.model.config)
    if check.args.tiny:
        params.contexts, params.batches, params.repeats = [16, 64], [1, 2], 2
    run = check.experiment("batch_curve", fp32, params, show=True)
    for line in exp.summary(run)[-2 * len(params.contexts):]:
        print("  " + line)


def prefix(check: Any) -> None:
    """SmolLM2's real weights where installed (the chat needs its template), else seeded random
    ones; llama-tiny in the dry run."""
    name = "llama-tiny" if check.args.tiny else "smollm2-135m"
    weights = "random" if check.args.tiny or not lineup.installed(name)[0] else "package"
    loaded = load(ModelSpec(name, weights, check.args.device, "float32"))
    cfg = loaded.model.config
    exp = get("prefix_ttft")
    params = exp.params(sorted({min(n, cfg.block_size) for n in (256, 1024, 4096)}),
                        [0.0, 0.5, 0.96875], 2048 if check.args.tiny else 8192, repeats=3)
    run = check.experiment("prefix_ttft", loaded, params, show=True)
    for line in exp.summary(run):
        print("  " + line)
    if weights == "package":
        chat = get("prefix_chat")
        run = check.experiment("prefix_chat", loaded, chat.params(turns=8, answer_tokens=32))
        for line in chat.summary(run)[-2:]:
            print("  " + line)


def serving(check: Any) -> None:
    """SmolLM2's real weights where installed, else seeded random ones; llama-tiny in the dry
    run. No peers (llama.cpp here is a CPU build)."""
    name = "llama-tiny" if check.args.tiny else "smollm2-135m"
    weights = "random" if check.args.tiny or not lineup.installed(name)[0] else "package"
    loaded = load(ModelSpec(name, weights, check.args.device, "float32"))
    exp = get("serving")
    params = exp.defaults(check.args.device, loaded.model.config)
    params.peers = False
    if not check.args.tiny:
        params.concurrency, params.rounds = [64, 1, 16], 2
    run = check.experiment("serving", loaded, params, show=True)
    for line in exp.summary(run):
        print("  " + line)
    top = [r for r in run["tables"].get("batch_steps", []) if r["label"] == "all"]
    if top and not check.args.tiny:
        last = top[-1]
        verdict = "within" if last["over_floor"] <= 2.0 else "NOT within"
        print(f"  batch {last['batch']}: step {last['step_ms']:.2f} ms, {last['over_floor']:.2f}x "
              f"its floor: {verdict} the 2x goal")


def sdpa_backends(check: Any) -> None:
    """Why the engine keeps SDPA off cuDNN on a GPU: mode 5 and mode 8 in bf16 decoding 32 new
    lengths in a row (every step a length not seen before), per-step ms with our backends and
    with cuDNN's allowed too (first light: mode 8 at 74-76 ms a step)."""
    from torch.nn.attention import SDPBackend

    import engine.models.attention as attention
    from engine.loop import decode, random_prompt
    from instruments.lineup import make_decoder
    from instruments.measure.timing import StepClock

    loaded = check.model("bfloat16")
    model, ours = loaded.model, attention.GPU_BACKENDS
    rows = []
    for label, backends in (("ours (no cuDNN)", ours),
                            ("cuDNN allowed", (SDPBackend.CUDNN_ATTENTION, *ours))):
        attention.GPU_BACKENDS = backends
        try:
            for mode in ("prealloc_fused", "fast"):
                if check.stop():
                    break
                dec = make_decoder(model, mode, capacity=160)
                gen = decode(dec, random_prompt(model, 1, 96, 1), 33,
                             timer=StepClock(model.device))
                steps = sorted(gen.step_ms[1:])  # the decode steps, the prefill left out
                rows.append({"backends": label, "mode": mode, "steps": len(steps),
                             "median_ms": steps[len(steps) // 2], "max_ms": steps[-1],
                             "samples_ms": gen.step_ms[1:]})
                print(f"  {label:16s} {mode:15s}: median {rows[-1]['median_ms']:.3f} ms, "
                      f"max {rows[-1]['max_ms']:.3f} ms over {len(steps)} new lengths")
        finally:
            attention.GPU_BACKENDS = ours
    if len(rows) < 4:  # a verdict needs both backends on both modes
        check.runner.partial(f"stopped after {len(rows)} of 4 decodes: no comparison to make")
    meta = results.collect_meta(model=check.name, device=check.args.device, dtype="bfloat16",
                                device_name=str(describe_device(check.args.device)["name"]),
                                batch_size=1, config=model.config.to_dict())
    check.save(results.new_run("sdpa_backends", meta, {"steps": rows}))


def triton_tiles(check: Any) -> None:
    """gpt2's four products alone (q|k|v's width, the MLP's up and down, the output
    projection) in fp32 and bf16 at batch 1 under a few tile sizes beside ``blocks``' own pick:
    microseconds (triton.testing.do_bench) and the read bandwidth they reach."""
    import triton

    from engine.kernels.gpu.linear import Weight, blocks, linear

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for n, k in ((2304, 768), (3072, 768), (768, 3072), (50257, 768)):
            if check.stop():
                break
            dev = check.args.device
            w = torch.randn(n, k, device=dev, dtype=dtype)
            x, out = torch.randn(1, k, device=dev, dtype=dtype), torch.empty(1, n, device=dev,
                                                                             dtype=dtype)
            picked, weight = blocks(1, n, k), Weight(w, "dense", n, k)
            for tiles in dict.fromkeys([picked, (1, 1, 1024), (1, 2, 1024), (1, 4, 512),
                                        (1, 8, 256), (1, 16, 512), (1, 32, 128)]):
                us = 1e3 * triton.testing.do_bench(
                    functools.partial(linear, x, weight, out, tiles=tiles), warmup=5, rep=20)
                gbps = w.numel() * w.element_size() / (us * 1e3)
                rows.append({"dtype": str(dtype).removeprefix("torch."), "N": n, "K": k,
                             "tiles": list(tiles), "picked": tiles == picked, "us": us,
                             "read_gbps": gbps})
                print(f"  {rows[-1]['dtype']:8s} {n:5d}x{k:4d} tiles {tiles}: {us:7.1f} us, "
                      f"{gbps:6.0f} GB/s{'  (picked)' if tiles == picked else ''}")
    meta = results.collect_meta(model=check.name, device=check.args.device, dtype="float32",
                                device_name=str(describe_device(check.args.device)["name"]),
                                batch_size=1)
    check.save(results.new_run("triton_tiles", meta, {"products": rows}))


# (mode, batch, context), the most telling first: a check out of time keeps what it measured
READ_POINTS = (("paged", 1, 1023), ("int8_kv", 1, 1023), ("paged", 32, 1023),
               ("int8_kv", 32, 1023), ("paged", 128, 1023), ("int8_kv", 128, 1023),
               ("paged", 1, 128), ("int8_kv", 1, 128))


def time_reads(model: Any, points: tuple[tuple[str, int, int], ...], rounds: int = 5,
               should_stop: Any = None) -> list[dict[str, Any]]:
    """At each (mode, batch, context): the mode's decoder with its cache read back (gathered
    or dequantized) and one reading it in place, moved to the context (untimed), their logits
    compared (the largest |diff| over the largest |logit|), then one step each timed in
    ``rounds`` interleaved rounds."""
    from engine.decoders.eager import Decoder
    from engine.loop import random_prompt
    from instruments import lineup
    from instruments.measure.sampler import Sampler

    rows: list[dict[str, Any]] = []
    for mode, batch, t in points:
        t = min(t, model.config.block_size - 1)
        ids = random_prompt(model, batch, t + 1, 0)
        decs = {r: Decoder(model, batch_size=batch, capacity=t + 1,
                           cache_kind=lineup.spec(mode).cache, reads=r)
                for r in ("gather", "in_place")}
        tok, logits = ids[:, t - 1 : t], {}
        with torch.no_grad():
            for r, d in decs.items():
                d.seek(ids, t - 1)
                logits[r] = d.step(tok)
        diff = float((logits["in_place"] - logits["gather"]).abs().max()
                     / logits["gather"].abs().max())
        sampler = Sampler(model.device, warmup=2, should_stop=should_stop)
        got = sampler.rounds({r: (lambda d=d, tok=tok: d.step(tok),
                                  lambda d=d, n=t - 1: d.rewind(n)) for r, d in decs.items()},
                             rounds)
        if got is None:
            break
        gather_ms, in_place_ms = got["gather"].median_ms, got["in_place"].median_ms
        rows.append({"mode": mode, "batch_size": batch, "context_len": t,
                     "logits_rel_diff": diff, "gather_ms": gather_ms,
                     "in_place_ms": in_place_ms, "speedup": gather_ms / in_place_ms,
                     "gather_samples_ms": got["gather"].samples_ms,
                     "in_place_samples_ms": got["in_place"].samples_ms})
    return rows


def cache_reads(check: Any) -> None:
    """Modes 10 and 11 in fp32 both ways at ``READ_POINTS``: the verdict on their GPU
    default (read in place)."""
    loaded = check.model("float32")
    points = (("paged", 1, 16), ("int8_kv", 2, 40)) if check.args.tiny else READ_POINTS
    rows = time_reads(loaded.model, points, 3 if check.args.tiny else 7, check.stop)
    for r in rows:
        print(f"  {r['mode']:8s} batch {r['batch_size']:4d} ctx {r['context_len']:5d}: read "
              f"back {r['gather_ms']:8.3f} ms, in place {r['in_place_ms']:8.3f} ms = "
              f"{r['speedup']:.2f}x; logits differ by {r['logits_rel_diff']:.1e} of the largest")
    wins = sum(r["speedup"] > 1 for r in rows)
    exact = all(r["logits_rel_diff"] < 1e-4 for r in rows)
    print(f"  in place faster at {wins} of {len(rows)} points; logits "
          f"{'agree' if exact else 'DIFFER'}")
    if len(rows) < len(points) or not exact or wins < len(rows):
        check.runner.partial(f"in place faster at {wins} of {len(rows)} points of "
                             f"{len(points)}; logits {'agree' if exact else 'differ'}")
    meta = results.collect_meta(model=check.name, device=check.args.device, dtype="float32",
                                device_name=str(describe_device(check.args.device)["name"]),
                                batch_size=max(b for _, b, _ in points),
                                config=loaded.model.config.to_dict())
    check.save(results.new_run("cache_reads", meta, {"points": rows}))


def no_triton(args: Any) -> str | None:
    from engine.kernels.gpu import triton_usable

    return None if triton_usable(args.device) else "Triton compiles for a CUDA GPU only here"


def no_sdpa(args: Any) -> str | None:
    return None if args.device.startswith("cuda") else "cuDNN's attention exists on a GPU only"
