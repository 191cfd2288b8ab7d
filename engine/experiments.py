"""Headless CLI: run the write-up's experiments and save each as a results file (JSON).

  python -m engine.experiments sweep --contexts "log-spaced (16)" --modes uncached,concat
  python -m engine.experiments e2e      --new-tokens 120 --prompt-len 8
  python -m engine.experiments memory   --memory-contexts 64-1024:64
  python -m engine.experiments hardware
  python -m engine.experiments all      (hardware, sweep, e2e, memory: one file each)
  python -m engine.experiments plot     (or --plots-only): HTML figures from saved files
Every run writes one file via engine.results.save_run into --results-dir and prints a short
summary. Bad input: one line on stderr, exit code 2. Ctrl-C stops after the current step and
saves what was measured, marked partial (a second Ctrl-C aborts at once). `--model tiny` is a
2-layer, 64-wide shape with random weights, for smoke tests.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from . import costs, hardware, memory, results, sweep
from .config import PRESETS, GPTConfig
from .model import GPT
from .modes import MODES

TINY = dict(n_layer=2, n_head=2, n_embd=64, block_size=128, vocab_size=256)


class CliError(Exception):
    """Bad input: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise CliError(message)  # one line, no usage dump


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2", help=f"{', '.join(PRESETS)} or tiny")
    p.add_argument("--weights", default="random", help="random | auto | pretrained | PATH")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (1..256)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompt seed")
    p.add_argument("--results-dir", default=None, help="default: results")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _sweep_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default="log-spaced (16)",
                   help='a preset ("log-spaced (16)", "every length 8..1024") or "8,16,100-200:10"')
    p.add_argument("--modes", default="uncached,concat", help=f"from: {', '.join(MODES)}")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=None, help="default 3 on CPU, 5 on CUDA")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="steps per cached warm-up run (default: 32 on CPU, a full run on CUDA)")
    p.add_argument("--no-peaks", action="store_true", help="skip the quick peak measurement")


def _e2e_opts(p: argparse.ArgumentParser, own_modes: bool) -> None:
    if own_modes:
        p.add_argument("--modes", default="uncached,concat")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=None,
                   help="default: up to the block size on CUDA (1016, as the write-up), 120 on CPU")
    p.add_argument("--e2e-repeats", type=int, default=1)


def _memory_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-contexts", default=None,
                   help="default: 64-1024:64 on CUDA, 64,128,256,384,512,768,1024 on CPU")
    p.add_argument("--cache-kind", default="concat", choices=["concat", "prealloc"])
    p.add_argument("--fill", default=None, choices=["prefill", "decode"],
                   help="default: decode on CUDA (as the write-up), prefill on CPU (faster)")
    p.add_argument("--crossover-batches", default="1,2,4,8,16,32,64,128,256")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m engine.experiments", description=__doc__.split("\n")[0])
    parser.add_argument("--plots-only", action="store_true", help="same as the plot command")
    parser.add_argument("--results-dir", default=None, dest="top_results_dir")
    parser.add_argument("--figures-dir", default=None, dest="top_figures_dir")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    specs: dict[str, list[Callable[..., None]]] = {
        "sweep": [_sweep_opts], "e2e": [lambda p: _e2e_opts(p, True)], "memory": [_memory_opts],
        "hardware": [], "all": [_sweep_opts, lambda p: _e2e_opts(p, False), _memory_opts]}
    for name, adders in specs.items():
        p = sub.add_parser(name)
        _common(p)
        for add in adders:
            add(p)
    p = sub.add_parser("plot")
    p.add_argument("--results-dir", default=None, help="default: results")
    p.add_argument("--figures-dir", default=None, help="default: RESULTS_DIR/figures")
    return parser


# ------------------------------------------------------------------------------- helpers
def load(args: argparse.Namespace) -> GPT:
    is_path = args.weights not in ("random", "auto", "pretrained")
    if args.model not in PRESETS and args.model != "tiny" and not is_path:
        raise CliError(f"unknown model {args.model!r}; allowed: {', '.join(PRESETS)}, tiny")
    ok, why = hardware.device_available(args.device)
    if not ok:
        raise CliError(f"device {args.device!r} cannot be used: {why}")
    if not 1 <= args.batch <= sweep.MAX_BATCH:
        raise CliError(f"--batch must be within 1..{sweep.MAX_BATCH}, got {args.batch}")
    from .weights import WeightsError, load_model, parse_dtype

    try:
        dtype = parse_dtype(args.dtype)
        if args.model == "tiny":
            if args.weights not in ("random", "auto"):
                raise CliError("--model tiny has random weights only; use --weights random")
            return GPT.random(GPTConfig(**TINY), seed=args.seed, device=args.device, dtype=dtype)
        return load_model(args.model, weights=args.weights, device=args.device, dtype=dtype,
                          seed=args.seed)
    except (ValueError, WeightsError) as exc:
        raise CliError(str(exc).splitlines()[0]) from exc


def _is_cuda(args: argparse.Namespace) -> bool:
    return str(args.device).startswith("cuda")


class _Stop:
    """First Ctrl-C asks the run to stop after the current step; the second aborts at once."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self) -> bool:
        return self.requested

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        def handler(signum: int, frame: Any) -> None:
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True
            print("\nstopping after this step (Ctrl-C again to abort)", file=sys.stderr)

        try:
            old = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread: leave Ctrl-C as it is
            yield
            return
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, old)


class _Bar:
    """tqdm progress bar on stderr, fed by sweep.Progress; collects finished rows."""

    def __init__(self, desc: str, disable: bool) -> None:
        from tqdm import tqdm

        self.rows: list[dict] = []
        self.bar = tqdm(total=1, desc=desc, file=sys.stderr, disable=disable, leave=True,
                        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}] {postfix}")

    def __call__(self, p: sweep.Progress) -> None:
        if p.row is not None:
            self.rows.append(p.row)
        self.bar.total, self.bar.n = p.total, p.done
        eta = f"~{p.eta_s:.0f}s left" if p.eta_s is not None else "?"
        self.bar.set_postfix_str(f"{eta} · {p.message[:50]}", refresh=True)

    def close(self) -> None:
        self.bar.close()


def _meta(args: argparse.Namespace, model: GPT, **extra: Any) -> dict[str, Any]:
    facts = hardware.describe_device(args.device)
    return results.collect_meta(
        model=args.model, weights=model.weights_label, device=args.device,
        device_name=facts["name"], dtype=sweep.dtype_name(model), batch_size=args.batch,
        threads=torch.get_num_threads(), config=model.config.to_dict(),
        tf32=bool(torch.backends.cuda.matmul.allow_tf32) if _is_cuda(args) else None,
        group=getattr(args, "group", None), command=" ".join(args.argv), **extra)


def _save(kind: str, meta: dict, tables: dict[str, list[dict]], args: argparse.Namespace) -> Path:
    path = results.save_run(results.new_run(kind, meta, tables), args.results_dir)
    print(f"saved {kind}{' (partial)' if meta.get('partial') else ''}: {path}")
    return path


def quick_peaks(device: str, listed_only: bool = False) -> dict[str, Any]:
    """Listed datasheet peaks (GPU) plus a quick measurement of matmul FLOP/s and read GB/s."""
    name = hardware.describe_device(device)["name"]
    spec = hardware.lookup_peaks(name) if device.startswith("cuda") else None
    out: dict[str, Any] = {"listed": spec.to_dict() if spec else None, "measured": None}
    if not listed_only:
        n, nbytes = (4096, 2**30) if device.startswith("cuda") else (1024, 256 * 2**20)
        mm = hardware.measure_matmul_tflops(device, n=n, min_seconds=0.3, repeats=3)
        bw = hardware.measure_read_bandwidth_gbps(device, nbytes=nbytes, repeats=3)
        out["measured"] = {"matmul_tflops": mm.median_tflops, "matmul_n": n,
                           "read_gbps": bw.read_median_gbps, "copy_gbps": bw.copy_median_gbps}
    return out


# ----------------------------------------------------------------------------- experiments
def cmd_hardware(args: argparse.Namespace, model: GPT, stop: _Stop) -> bool:
    facts = hardware.describe_device(args.device)
    listed = facts.pop("listed_peaks")
    dtypes = ["float32"] + (["bfloat16", "float16"] if _is_cuda(args) else [])
    n = 4096 if _is_cuda(args) else 1024
    nbytes = 2**30 if _is_cuda(args) else 512 * 2**20
    if args.model == "tiny":  # smoke tests: small benchmarks too
        n, nbytes = 256, 16 * 2**20
    matmul = []
    for dt in dtypes:
        mm = hardware.measure_matmul_tflops(args.device, dtype=dt, n=n,
                                            min_seconds=0.05 if n < 1024 else 0.3)
        matmul.append({"dtype": dt, "n": n, "tflops": mm.median_tflops,
                       "samples_tflops": mm.samples_tflops, "samples_ms": mm.samples_ms})
    bw = hardware.measure_read_bandwidth_gbps(args.device, nbytes=nbytes)
    weights_b = costs.linear_weight_bytes(model.config, model.dtype)
    floor_ms = weights_b / (bw.read_median_gbps * 1e9) * 1e3
    tables = {
        "device": [facts], "listed_peaks": [listed] if listed else [], "matmul": matmul,
        "bandwidth": [{"nbytes": bw.nbytes, "read_gbps": bw.read_median_gbps,
                       "copy_gbps": bw.copy_median_gbps, "read_samples_gbps":
                       bw.read_samples_gbps, "copy_samples_gbps": bw.copy_samples_gbps}],
        "floor": [{"linear_weight_bytes": weights_b, "read_gbps": bw.read_median_gbps,
                   "floor_ms": floor_ms}],
    }
    peaks = {"listed": listed, "measured": {"matmul_tflops": matmul[0]["tflops"], "matmul_n": n,
                                            "read_gbps": bw.read_median_gbps}}
    args.peaks = peaks
    _save("hardware", _meta(args, model, peaks=peaks), tables, args)
    print(f"{facts['name']}: matmul {matmul[0]['tflops']:.3f} TFLOP/s fp32 (n={n}), read "
          f"{bw.read_median_gbps:.1f} GB/s -> a decode step that streams the {weights_b / 1e6:.1f}"
          f" MB of Linear weights cannot beat {floor_ms:.2f} ms")
    if listed:
        print(f"listed: {listed['fp32_tflops']} TFLOP/s fp32, {listed['mem_bandwidth_gbps']} GB/s "
              f"({listed['source']})")
    return False


def _parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown:
        raise CliError(f"unknown mode {unknown[0] if unknown else text!r}; "
                       f"allowed: {', '.join(MODES)}")
    return modes


def cmd_sweep(args: argparse.Namespace, model: GPT, stop: _Stop) -> bool:
    block = model.config.block_size
    base = sweep.default_spec(args.device, block)
    try:
        spec = sweep.SweepSpec(
            sweep.parse_contexts(args.contexts, block), _parse_modes(args.modes),
            batch_size=args.batch, warmup=args.warmup,
            repeats=args.repeats if args.repeats is not None else base.repeats,
            prompt_seed=args.seed,
            warmup_steps=args.warmup_steps if args.warmup_steps is not None else base.warmup_steps)
        spec.validate(model)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    peaks = getattr(args, "peaks", None) or quick_peaks(args.device, listed_only=args.no_peaks)
    bar = _Bar("sweep", args.no_progress)
    res, interrupted = None, False
    try:
        res = sweep.run_latency_sweep(model, spec, bar, stop)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
    rows = res.rows if res is not None else bar.rows
    partial = interrupted or (res is not None and res.cancelled)
    checks = [c.__dict__ for c in res.checks] if res is not None else []
    notes = res.notes if res is not None else []
    table = sweep.summary_table(rows)
    meta = _meta(args, model, warmup=spec.warmup, repeats=spec.repeats, peaks=peaks,
                 partial=partial, contexts=spec.contexts, modes=spec.modes,
                 warmup_steps=spec.warmup_steps, note="; ".join(notes))
    _save("latency_sweep", meta, {"latency": rows, "checks": checks, "summary": table}, args)
    for note in notes:
        print(f"NOT TIMED: {note}")
    print(sweep.format_summary(table))
    return partial


def cmd_e2e(args: argparse.Namespace, model: GPT, stop: _Stop) -> bool:
    block = model.config.block_size
    new = args.new_tokens
    if new is None:
        new = block - args.prompt_len if _is_cuda(args) else min(120, block - args.prompt_len)
    modes = _parse_modes(args.modes)
    if args.prompt_len < 1 or new < 1 or args.prompt_len + new - 1 > block:
        raise CliError(f"--prompt-len + --new-tokens - 1 must be within 1..{block}, got "
                       f"{args.prompt_len} + {new}")
    bar = _Bar("end to end", args.no_progress)
    res, interrupted = None, False
    try:
        res = sweep.run_end_to_end(model, modes, args.prompt_len, new, args.batch,
                                   args.e2e_repeats, bar, stop, prompt_seed=args.seed)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
    totals = res.totals if res is not None else bar.rows
    partial = interrupted or (res is not None and res.cancelled)
    meta = _meta(args, model, warmup=1, repeats=args.e2e_repeats, partial=partial, modes=modes,
                 prompt_len=args.prompt_len, new_tokens=new,
                 note="; ".join(res.notes) if res is not None else "")
    _save("end_to_end", meta, {"end_to_end": totals,
                               "cumulative": res.cumulative if res is not None else [],
                               "checks": [c.__dict__ for c in res.checks] if res else []}, args)
    for row in totals:
        print(f"{row['mode']:>16}: {row['new_tokens']} tokens in {row['total_s']:.3f} s")
    if len(totals) >= 2 and totals[-1]["total_s"]:
        print(f"end-to-end speedup {totals[0]['mode']} -> {totals[-1]['mode']}: "
              f"{totals[0]['total_s'] / totals[-1]['total_s']:.2f}x")
    return partial


def cmd_memory(args: argparse.Namespace, model: GPT, stop: _Stop) -> bool:
    block = model.config.block_size
    try:
        default = "64-1024:64" if _is_cuda(args) else "64,128,256,384,512,768,1024"
        contexts = sweep.parse_contexts(args.memory_contexts or default, block)
    except ValueError as exc:
        raise CliError(f"--memory-contexts: {exc}") from exc
    try:
        batches = sweep.parse_contexts(args.crossover_batches, sweep.MAX_BATCH)
    except ValueError as exc:
        msg = f"--crossover-batches: {exc}".replace("context length", "batch size")
        raise CliError(msg) from exc
    fill = args.fill or ("decode" if _is_cuda(args) else "prefill")
    cfg, dt = model.config, model.dtype
    first = [t for t in (64, 384, 1024) if t <= block] or contexts[:3]
    tables: dict[str, list[dict]] = {}
    steps: list[tuple[str, Callable[[], list[dict]]]] = [
        ("kv_memory", lambda: memory.measure_kv_memory(model, contexts, args.batch,
                                                       args.cache_kind, True, fill)),
        ("kv_memory_first_attempt", lambda: memory.measure_kv_memory(
            model, first, args.batch, args.cache_kind, False, fill)),
        ("breakdown", lambda: memory.memory_breakdown(model, args.batch, contexts[-1],
                                                      "prealloc", True, "seed")),
        ("breakdown_formula", lambda: memory.memory_breakdown(model, args.batch, contexts[-1],
                                                              "prealloc", False, "seed")),
    ]
    partial = False
    try:
        for name, fn in steps:
            if stop():
                partial = True
                break
            print(f"memory: {name} ...", file=sys.stderr)
            tables[name] = fn()
    except KeyboardInterrupt:
        partial = True
    mm = memory.model_memory(model)
    tables["model"] = [{k: v for k, v in mm.items() if k != "mask_bytes_by_kind"}]
    tables["masks"] = [{"kind": k, "bytes": v} for k, v in mm["mask_bytes_by_kind"].items()]
    tables["crossover"] = memory.crossover_grid(cfg, dt, batches, contexts)
    meta = _meta(args, model, partial=partial, contexts=contexts, cache_kind=args.cache_kind,
                 fill=fill, cublas_workspace_bytes=memory.cublas_workspace_bytes(args.device))
    _save("memory", meta, tables, args)
    per_token = costs.kv_bytes_per_token(cfg, dt)
    print(f"KV cache: {per_token:,} B per token per sequence; weights {mm['weights_bytes']:,} B; "
          f"the cache outgrows the weights at batch x context = "
          f"{costs.kv_overtakes_weights_tokens(cfg, dt):,.0f} tokens")
    print(f"mask buffers per kind (B): {mm['mask_bytes_by_kind']}")
    for row in tables.get("kv_memory", [])[-1:]:
        print(f"at {row['context_len']} tokens: formula {row['kv_formula_bytes']:,} B, tensors "
              f"{row['kv_tensor_bytes']:,} B, storages {row['kv_storage_bytes']:,} B, "
              f"allocated delta {row['allocated_delta_bytes']}, RSS delta {row['rss_delta_bytes']}")
    return partial


# ------------------------------------------------------------------------------------ plots
# (run kind, table, file suffix, ui module, builder): pure DataFrame -> Figure functions
FIGURES = [
    ("latency_sweep", "latency", "latency", "figures", "latency_figure"),
    ("latency_sweep", "latency", "reduction", "figures_perf", "reduction_figure"),
    ("latency_sweep", "latency", "throughput", "figures_perf", "throughput_figure"),
    ("end_to_end", "cumulative", "cumulative", "figures", "cumulative_figure"),
    ("end_to_end", "cumulative", "steps", "figures", "step_latency_figure"),
    ("memory", "kv_memory", "kv_memory", "figures_memory", "kv_memory_figure"),
    ("memory", "kv_memory_first_attempt", "kv_first_attempt", "figures_memory",
     "kv_memory_figure"),
    ("memory", "breakdown", "breakdown", "figures_memory", "breakdown_figure"),
    ("memory", "crossover", "crossover", "figures_memory", "crossover_figure"),
    ("memory", "masks", "masks", "figures_memory", "mask_figure"),
]


def _builder(module: str, name: str) -> Callable[..., Any]:
    import importlib

    try:
        return getattr(importlib.import_module(f"ui.{module}"), name)
    except (ImportError, AttributeError) as exc:
        raise CliError(f"figure builder ui.{module}.{name} is missing ({exc})") from exc


def _ceilings(run: dict) -> list[Any]:
    """Figure 5's roofs from the run's meta: listed datasheet peak and/or measured here."""
    from ui.figures_perf import Ceiling

    peaks = run["meta"].get("peaks") or {}
    out = []
    if peaks.get("listed"):
        out.append(Ceiling("listed", peaks["listed"]["fp32_tflops"],
                           peaks["listed"]["mem_bandwidth_gbps"]))
    if peaks.get("measured"):
        out.append(Ceiling("measured here", peaks["measured"]["matmul_tflops"],
                           peaks["measured"].get("read_gbps")))
    return out


def write_figures(results_dir: str | Path, figures_dir: str | Path | None = None
                  ) -> tuple[list[Path], list[tuple[str, str]]]:
    """HTML figures for every saved run (one file per run and figure) plus a latency overlay
    of all sweeps and the write-up's reference run. Nothing is measured."""
    loaded = results.load_runs(results_dir)
    out = Path(figures_dir) if figures_dir else Path(results_dir) / "figures"
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def write(fig: Any, name: str) -> None:
        if fig is not None:
            path = out / name
            fig.write_html(path, include_plotlyjs="directory")  # plotly.min.js once, offline
            written.append(path)

    for run in loaded.runs:
        short = f"{run['created_utc'][:19].replace(':', '')}_{run['run_id'][:6]}"
        for kind, table, fig_name, module, fn_name in FIGURES:
            df = results.table_frame([run], table)
            if run["kind"] != kind or df.empty:
                continue
            if fig_name == "breakdown" and "breakdown_formula" in run["tables"]:
                formula = results.table_frame([run], "breakdown_formula")
                df = pd.concat([df.assign(bar="measured"), formula.assign(bar="formula")],
                               ignore_index=True)
            extra = {"ceilings": _ceilings(run)} if fn_name == "throughput_figure" else {}
            write(_builder(module, fn_name)(df, **extra), f"{kind}_{short}_{fig_name}.html")
    sweeps = [r for r in loaded.runs if r["kind"] == "latency_sweep"]
    if sweeps:
        overlay = _builder("figures", "overlay_figure")
        with contextlib.suppress(results.ResultsError):
            sweeps = sweeps + [results.reference_run()]
        write(overlay(results.table_frame(sweeps, "latency"), log_x=True), "latency_overlay.html")
    return written, loaded.skipped


COMMANDS = {"hardware": cmd_hardware, "sweep": cmd_sweep, "e2e": cmd_e2e, "memory": cmd_memory}


def main(argv: list[str] | None = None) -> int:
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        args = build_parser().parse_args(argv)
        args.argv = argv
        # --results-dir may come before or after the command
        args.results_dir = getattr(args, "results_dir", None) or args.top_results_dir or "results"
        if args.plots_only or args.command == "plot":
            folder = args.results_dir
            out = getattr(args, "figures_dir", None) or args.top_figures_dir
            paths, skipped = write_figures(folder, out)
            for path, why in skipped:
                print(f"skipped {path}: {why}", file=sys.stderr)
            print(f"wrote {len(paths)} figures to {Path(out or Path(folder) / 'figures')}")
            return 0
        if args.command is None:
            raise CliError("choose a command: sweep, e2e, memory, hardware, all, plot")
        model = load(args)
        names = list(COMMANDS) if args.command == "all" else [args.command]
        args.group = uuid.uuid4().hex[:12] if args.command == "all" else None
        stop = _Stop()
        with stop.installed():
            for name in names:
                if stop() or COMMANDS[name](args, model, stop):
                    print("stopped early: the saved results are marked partial", file=sys.stderr)
                    return 130
    except KeyboardInterrupt:
        print("engine.experiments: aborted", file=sys.stderr)
        return 130
    except CliError as exc:
        print(f"engine.experiments: error: {exc}", file=sys.stderr)
        return 2
    except results.ResultsError as exc:
        print(f"engine.experiments: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
