"""Headless CLI: the dashboard's experiments, the same code and the same run files, no browser.

  python -m instruments sweep --contexts "log-spaced (16)" --modes uncached,concat
  python -m instruments e2e --new-tokens 120 --prompt-len 8
  python -m instruments memory --memory-contexts 64-1024:64
  python -m instruments hardware | attribution | staircase | scope | precision
  python -m instruments planner --distribution long-tailed --sequences 32 --block-tokens 16
  python -m instruments predict --modes uncached,concat,prealloc_fused,fast --passes 3
  python -m instruments all      (hardware, sweep with its end-to-end part, memory)
Each command runs one experiment of ``instruments.experiments`` in this process (it is its own
process: nothing else runs beside the timed steps) and saves the run it returns into
--results-dir, printing a short summary. Bad input: one line on stderr, exit code 2. Ctrl-C
stops after the current step and saves what was measured, marked partial (a second Ctrl-C
aborts at once and still saves the rows streamed so far). HTML figures of saved runs:
``python -m ui.plots``.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from engine import modes
from engine.config import PRESETS, TEST_PRESETS
from instruments import experiments, params, results
from instruments.contexts import parse_contexts
from instruments.spine import Collector, Event, Loaded, ModelSpec, base_meta, partial_record
from instruments.tables import format_summary


class CliError(Exception):
    """Bad input: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise CliError(message)  # one line, no usage dump


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2", help=f"{', '.join([*PRESETS, *TEST_PRESETS])}")
    p.add_argument("--weights", default="random", help="random | auto | pretrained | PATH")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--batch", type=int, default=1,
                   help=f"sequences per step (1..{params.MAX_BATCH})")
    p.add_argument("--seed", type=int, default=0, help="weights and prompt seed")
    p.add_argument("--results-dir", default="results")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's, one per core)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _sweep_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default="log-spaced (16)",
                   help='a preset ("log-spaced (16)", "every length 8..1024") or "8,16,100-200:10"')
    p.add_argument("--modes", default="uncached,concat", help=f"from: {', '.join(modes.MODES)}")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=None,
                   help="the most timed samples per point (at least 2, more while they "
                   "disagree by more than 10%%): default 3 on CPU, 5 on CUDA")
    p.add_argument("--method", default="crop", choices=["crop", "generate"],
                   help="crop: fill the cache once and crop it to each context (default); "
                   "generate: one whole generation per repeat, the write-up's way")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="steps per cached warm-up run (default: 32 on CPU, a full run on CUDA)")
    p.add_argument("--no-peaks", action="store_true", help="do not measure the device's peaks")
    p.add_argument("--retakes", type=int, default=3,
                   help="CPU: samples per point set aside and taken again when another process "
                   "used the CPU during them (0 keeps every sample)")


def _e2e_opts(p: argparse.ArgumentParser, own_modes: bool) -> None:
    if own_modes:
        p.add_argument("--modes", default="uncached,concat")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=None,
                   help="default: up to the block size on CUDA (1016, as the write-up), 64 on "
                   "CPU; 0 leaves the end-to-end part out of a sweep")
    p.add_argument("--e2e-repeats", type=int, default=1)


def _memory_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-contexts", default=None,
                   help="default: 64-1024:64 on CUDA, 64,128,256,384,512,768,1024 on CPU")
    p.add_argument("--cache-kind", default="concat", choices=["concat", "prealloc"])
    p.add_argument("--fill", default=None, choices=["prefill", "decode"],
                   help="default: decode on CUDA (as the write-up), prefill on CPU (faster)")
    p.add_argument("--crossover-batches", default="1,2,4,8,16,32,64,128,256")


def _floor_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default="concat,prealloc_fused,fast")
    p.add_argument("--contexts", default="16,64,256,512", help="attribution context lengths")
    p.add_argument("--steps", type=int, default=8, help="timed steps per point")


def _staircase_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ts", default=None, help="T values (default: every T on a GPU, 32 apart "
                   "on a CPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--with-forward", action="store_true", help="time the whole forward too")


def _scope_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grow", default="batch", choices=["batch", "model"])
    p.add_argument("--points", default=None, help="batch sizes, or model names")
    p.add_argument("--context", type=int, default=128)


def _planner_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--distribution", default="long-tailed",
                   choices=["long-tailed", "uniform", "fixed"])
    p.add_argument("--sequences", type=int, default=32, help="sequences in the mixed batch")
    p.add_argument("--mean-len", type=int, default=None,
                   help="their mean final length (default: a quarter of the block size)")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per paged block")
    p.add_argument("--fit-contexts", default=None,
                   help="contexts to fit (default: block/8, /4, /2, block)")
    p.add_argument("--max-alloc-mib", type=int, default=None,
                   help="the most one allocation may take (default: 2048 on a CPU, the whole "
                   "budget on a GPU)")


def _predict_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default=None, help="default: every mode that can be predicted "
                   "and runs here without minutes of compiling")
    p.add_argument("--contexts", default="log-spaced (16)")
    p.add_argument("--repeats", type=int, default=3, help="most samples per point and pass")
    p.add_argument("--passes", type=int, default=3, help="passes over the cached modes")


COMMAND_OPTS: dict[str, list[Callable[[argparse.ArgumentParser], None]]] = {
    "sweep": [_sweep_opts, lambda p: _e2e_opts(p, False)], "e2e": [lambda p: _e2e_opts(p, True)],
    "memory": [_memory_opts], "hardware": [], "attribution": [_floor_opts],
    "staircase": [_staircase_opts], "scope": [_scope_opts], "precision": [],
    "planner": [_planner_opts], "predict": [_predict_opts],
    "all": [_sweep_opts, lambda p: _e2e_opts(p, False), _memory_opts],
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m instruments", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for name, adders in COMMAND_OPTS.items():
        p = sub.add_parser(name)
        _common(p)
        for add in adders:
            add(p)
    return parser


# ------------------------------------------------------------------------ params from flags
def _cuda(args: argparse.Namespace) -> bool:
    return str(args.device).startswith("cuda")


def _modes(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in modes.MODES]
    if not names or unknown:
        raise CliError(f"unknown mode {unknown[0] if unknown else text!r}; "
                       f"allowed: {', '.join(modes.MODES)}")
    return names


def _new_tokens(args: argparse.Namespace, block: int) -> int:
    if args.new_tokens is not None:
        return args.new_tokens
    return block - args.prompt_len if _cuda(args) else min(64, block - args.prompt_len)


def _params(command: str, args: argparse.Namespace, block: int) -> Any:
    """The experiment's params from the flags (ValueError for unreadable lists)."""
    if command == "sweep":
        base = params.LatencyParams.defaults(args.device, block)
        return params.LatencyParams(
            parse_contexts(args.contexts, block), _modes(args.modes), args.batch, args.warmup,
            args.repeats if args.repeats is not None else base.repeats, args.seed,
            args.warmup_steps if args.warmup_steps is not None else base.warmup_steps,
            e2e_new_tokens=_new_tokens(args, block), e2e_prompt_len=args.prompt_len,
            measure_peaks=not args.no_peaks, method=args.method, retakes=args.retakes)
    if command == "e2e":
        return params.EndToEndParams(_modes(args.modes), args.prompt_len, _new_tokens(args, block),
                                     args.batch, args.e2e_repeats, prompt_seed=args.seed)
    if command == "memory":
        default = "64-1024:64" if _cuda(args) else "64,128,256,384,512,768,1024"
        try:
            batches = parse_contexts(args.crossover_batches, params.MAX_BATCH)
        except ValueError as exc:
            raise ValueError(f"--crossover-batches: {exc}".replace("context length",
                                                                   "batch size")) from exc
        return params.MemoryParams(parse_contexts(args.memory_contexts or default, block),
                                   args.batch, args.cache_kind,
                                   args.fill or ("decode" if _cuda(args) else "prefill"),
                                   crossover_batches=batches)
    if command == "hardware":
        return params.HardwareParams(["float32", "bfloat16", "float16"] if _cuda(args) else [],
                                     quick=args.model in TEST_PRESETS)
    if command == "attribution":
        return params.AttributionParams(_modes(args.modes), parse_contexts(args.contexts, block),
                                        args.steps, batch_size=args.batch)
    if command == "staircase":
        ts = parse_contexts(args.ts, block) if args.ts else None
        return params.StaircaseParams(ts, args.repeats, args.with_forward)
    if command == "scope":
        if args.grow == "batch":
            points: list[Any] = parse_contexts(args.points or "1,2,4,8,16,32", params.MAX_BATCH)
        else:
            points = [p.strip() for p in (args.points or ",".join(PRESETS)).split(",")]
        return params.ScopeParams(args.grow, points, args.context)
    if command == "precision":
        return params.PrecisionParams()
    if command == "planner":
        fit = parse_contexts(args.fit_contexts, block) if args.fit_contexts else None
        return params.PlannerParams(args.distribution, args.sequences, args.mean_len,
                                    args.block_tokens, args.seed, fit, args.max_alloc_mib)
    if command == "predict":
        base = params.PredictionParams.defaults(args.device, block)
        return params.PredictionParams(
            _modes(args.modes) if args.modes else base.modes, parse_contexts(args.contexts,
                                                                             block),
            args.batch, args.repeats, passes=args.passes)
    raise CliError(f"unknown command {command!r}")


# ---------------------------------------------------------------------------------- running
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


class _Progress:
    """Progress on stderr (a tqdm bar when tqdm is installed) and the streamed rows kept."""

    def __init__(self, desc: str, disable: bool) -> None:
        self.rows = Collector()
        self.bar: Any = None
        if not disable:
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self.bar = tqdm(total=1, desc=desc, file=sys.stderr, leave=True,
                                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}] "
                                "{postfix}")

    def __call__(self, event: Event) -> None:
        self.rows(event)
        if self.bar is not None:
            self.bar.total, self.bar.n = max(event.total, 1), event.done
            eta = f"~{event.eta_s:.0f}s left" if event.eta_s is not None else "?"
            self.bar.set_postfix_str(f"{eta} · {event.message[:50]}", refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_one(command: str, loaded: Loaded, args: argparse.Namespace, stop: _Stop) -> bool:
    """Run one command's experiment and save its run; True if it ended early (partial)."""
    exp = experiments.get({"sweep": "latency", "e2e": "end_to_end",
                           "predict": "prediction"}.get(command, command))
    try:
        p = _params(command, args, loaded.model.config.block_size)
        p.check(loaded.model.config, args.device)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    bar = _Progress(command, args.no_progress)
    try:
        run = exp.run(loaded, p, bar, stop)
    except KeyboardInterrupt:
        run = partial_record(exp.kind, base_meta(loaded, exp.kind, p), bar.rows.tables,
                             "aborted with a second Ctrl-C")
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    finally:
        bar.close()
    run["meta"].update(group=getattr(args, "group", None), command=" ".join(args.argv))
    path = results.save_run(run, args.results_dir)
    partial = bool(run["meta"].get("partial"))
    print(f"saved {exp.kind}{' (partial)' if partial else ''}: {path}")
    _summary(run)
    return partial


def _summary(run: dict[str, Any]) -> None:
    tables, meta = run["tables"], run["meta"]
    for note in meta.get("notes") or []:
        print(f"note: {note}")
    if run["kind"] == "latency_sweep":
        print(format_summary(tables.get("summary", [])))
    for row in tables.get("end_to_end", []):
        print(f"{row['mode']:>16}: {row['new_tokens']} tokens in {row['total_s']:.3f} s")
    for row in tables.get("peaks", []):
        print(f"{meta['device_name']} {row['dtype']}: matmul {row['matmul_tflops']:.3f} TFLOP/s "
              f"(n={row['matmul_n']}), read {row['read_gbps']:.1f} GB/s ({row['read_kernel']})")
    for row in tables.get("floor", []):
        print(f"a step that streams the {row['linear_weight_bytes'] / 1e6:.1f} MB of Linear "
              f"weights cannot beat {row['floor_ms']:.2f} ms here")
    for row in tables.get("layouts", []):
        print(f"{row['label']:>40}: {row['reserved_bytes'] / 2**20:,.1f} MiB reserved, "
              f"{row['waste_share']:.0%} wasted, {row['fits_sequences']} sequences fit")
    for row in tables.get("storages", []):
        err = row.get("rel_error")
        print(f"KV in {row['storage']:>8}: {row['bytes_per_token']:,} B/token" +
              ("" if err is None else f", logits error {err:.2g} of the largest logit"))
    for row in tables.get("verdicts", []):
        print(row["sentence"])
    for row in tables.get("kv_memory", [])[-1:]:
        print(f"KV cache at {row['context_len']} tokens: formula {row['kv_formula_bytes']:,} B, "
              f"tensors {row['kv_tensor_bytes']:,} B")


def load(args: argparse.Namespace) -> Loaded:
    from instruments.device import device_available
    from instruments.spine import load as load_model

    is_path = args.weights not in ("random", "auto", "pretrained")
    if args.model not in PRESETS and args.model not in TEST_PRESETS and not is_path:
        raise CliError(f"unknown model {args.model!r}; allowed: "
                       f"{', '.join([*PRESETS, *TEST_PRESETS])}")
    ok, why = device_available(args.device)
    if not ok:
        raise CliError(f"device {args.device!r} cannot be used: {why}")
    if not 1 <= args.batch <= params.MAX_BATCH:
        raise CliError(f"--batch must be within 1..{params.MAX_BATCH}, got {args.batch}")
    from engine.weights import WeightsError

    try:
        return load_model(ModelSpec(args.model, args.weights, args.device, args.dtype,
                                    args.seed))
    except (ValueError, WeightsError) as exc:
        raise CliError(str(exc).splitlines()[0]) from exc


def main(argv: list[str] | None = None) -> int:
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        args = build_parser().parse_args(argv)
        args.argv = argv
        if args.command is None:
            raise CliError(f"choose a command: {', '.join(COMMAND_OPTS)}")
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        loaded = load(args)
        names = ["hardware", "sweep", "memory"] if args.command == "all" else [args.command]
        args.group = uuid.uuid4().hex[:12] if args.command == "all" else None
        stop = _Stop()
        with stop.installed():
            for name in names:
                if stop() or run_one(name, loaded, args, stop):
                    print("stopped early: the saved results are marked partial", file=sys.stderr)
                    return 130
    except KeyboardInterrupt:
        print("instruments: aborted", file=sys.stderr)
        return 130
    except CliError as exc:
        print(f"instruments: error: {exc}", file=sys.stderr)
        return 2
    except results.ResultsError as exc:
        print(f"instruments: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
