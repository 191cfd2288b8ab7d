"""Headless CLI: the dashboard's experiments, the same code and the same run files, no browser.

  python -m instruments latency --contexts "log-spaced (16)" --modes uncached,concat
  python -m instruments end_to_end --new-tokens 120 --prompt-len 8
  python -m instruments memory --memory-contexts 64-1024:64
  python -m instruments hardware | attribution | staircase | scope | precision
  python -m instruments planner --distribution long-tailed --sequences 32 --block-tokens 16
  python -m instruments prediction --modes uncached,concat,prealloc_fused,fast --passes 3
  python -m instruments bench --modes concat,prealloc_fused -p 512 -n 128 --depth 0,512 -r 5
  python -m instruments all      (hardware, latency with its end-to-end part, memory)
  python -m instruments export RUN --format jsonl|csv|md [--table NAME] [--out FILE]
  python -m instruments compare OLD NEW [--noise-floor 0.02]   (exit 1: a point regressed)
  python -m instruments readme [--check]   (the README's and docs' generated blocks)
  python -m instruments gguf --model gpt2 --weights random --type q8_0 OUT.gguf   (a GGUF file
                        of the model's weights for llama.cpp: f32 | q8_0 | q4_1)
  python -m instruments server --model smollm2-135m [--port 8000]   (the serving engine behind
                        an OpenAI-compatible endpoint: ``instruments.server``)
Each command is an experiment of ``instruments.experiments`` (the older names sweep, e2e and
predict still work); its flags, defaults and printed summary come from the experiment's own
module. It runs in this process (its own process: nothing else runs beside the timed steps)
and saves the run it returns into
--results-dir, printing a short summary. Bad input: one line on stderr, exit code 2. Ctrl-C
stops after the current step and saves what was measured, marked partial (a second Ctrl-C
aborts at once and still saves the rows streamed so far). HTML figures of saved runs:
``python -m ui.plots``. ``export`` and ``compare`` are not experiments: they read saved runs
(``instruments.store.exports`` / ``instruments.store.compare``; RUN, OLD and NEW are run files,
or run ids / file names in --results-dir), load no model and measure nothing. ``readme``
rewrites (or, with --check, compares) the blocks of README.md and docs/*.md made from the runs
under docs/runs/ (``instruments.store.readme``); exit 1 when a block differs, 2 when a run file
cannot be read.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import uuid
from collections.abc import Iterator
from typing import Any

from instruments import experiments, lineup
from instruments.experiments.inputs import MAX_BATCH
from instruments.spine import Collector, Event, Loaded, ModelSpec, base_meta, partial_record
from instruments.store import results


class CliError(Exception):
    """Bad input: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise CliError(message)  # one line, no usage dump


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt2", help=", ".join(lineup.models(tests=True))
                   + ", or PATH: a checkpoint folder (config.json + *.safetensors) or a .gguf "
                   "file of these architectures")
    p.add_argument("--weights", default=None,
                   help="random | auto | pretrained | FOLDER (GPT-2); package | random "
                   "(SmolLM2); checkpoint | random (a PATH model); default: the model's own "
                   "where they are local, random where they would need the network")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--batch", type=int, default=1, help=f"sequences per step (1..{MAX_BATCH})")
    p.add_argument("--seed", type=int, default=0, help="weights and prompt seed")
    p.add_argument("--results-dir", default="results")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's, one per core)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m instruments", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    for exp in experiments.EXPERIMENTS.values():
        p = sub.add_parser(exp.name, aliases=list(exp.aliases), help=exp.title)
        _common(p)
        exp.add_arguments(p)
    p = sub.add_parser("all", help=" + ".join(experiments.in_all()))
    _common(p)
    for name in experiments.in_all():
        experiments.get(name).add_arguments(p)
    _store_parsers(sub)
    from instruments.server import cli as server_cli

    server_cli.add_parser(sub, lineup.models(tests=True))
    return parser


# ------------------------------------------------------------- store commands (no model)
STORE_COMMANDS = ("export", "compare", "readme", "gguf")


def _store_parsers(sub: Any) -> None:
    from instruments.store.compare import DEFAULT_FLOOR
    from instruments.store.exports import FORMATS

    p = sub.add_parser("export", help="a saved run as CSV, JSON Lines (one record per timed "
                       "sample) or a Markdown table")
    p.add_argument("run", help="a run file, or a run id / file name in --results-dir")
    p.add_argument("--format", default="jsonl", choices=FORMATS)
    p.add_argument("--table", default=None, help="default: the table the run is about")
    p.add_argument("--out", default=None, help="a file to write (default: standard output)")
    p.add_argument("--results-dir", default="results")
    p = sub.add_parser("compare", help="two runs of one experiment, new / old per point against "
                       "their noise; exit code 1 when a point regressed beyond it")
    p.add_argument("old", help="the earlier run: a file, or a run id / file name")
    p.add_argument("new", help="the later run")
    p.add_argument("--noise-floor", type=float, default=DEFAULT_FLOOR,
                   help="the least drift between runs called noise, a share (0.05 = 5%%; "
                   f"default {DEFAULT_FLOOR:g})")
    p.add_argument("--results-dir", default="results")
    p = sub.add_parser("readme", help="rewrite the blocks of README.md and docs/*.md made from "
                       "the runs committed under docs/runs/")
    p.add_argument("--check", action="store_true",
                   help="change nothing; exit 1 naming each block that differs from its runs")
    p.add_argument("--root", default=None, help="the checkout to read (default: this one)")
    p = sub.add_parser("gguf", help="write the model's weights as a GGUF file llama.cpp loads")
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--model", default="gpt2", help=", ".join(lineup.models(tests=True))
                   + ", or a checkpoint's PATH")
    p.add_argument("--weights", default=None, help="as for the experiments (default: the "
                   "model's own where they are local, else random)")
    p.add_argument("--type", default="f32", help="f32 | q8_0 | q4_1")
    p.add_argument("--seed", type=int, default=0, help="random weights' seed")


def store_command(args: argparse.Namespace) -> int:
    """Run ``export``, ``compare`` or ``readme``; 1 when compare finds a regression."""
    from instruments.store import compare, exports

    if args.command == "readme":
        return readme(args.check, args.root)
    if args.command == "gguf":
        return gguf(args)

    try:
        if args.command == "export":
            text = exports.export(results.find_run(args.run, args.results_dir), args.format,
                                  args.table)
            if args.out:
                with open(args.out, "w", encoding="utf-8") as fh:
                    fh.write(text)
                print(f"wrote {args.out}", file=sys.stderr)
            else:
                sys.stdout.write(text)
            return 0
        got = compare.compare(results.find_run(args.old, args.results_dir),
                              results.find_run(args.new, args.results_dir), args.noise_floor)
    except (results.ResultsError, ValueError, OSError) as exc:
        raise CliError(str(exc).splitlines()[0]) from exc
    print(compare.markdown(got))
    return 1 if got.regressions else 0


def readme(check_only: bool, root: str | None) -> int:
    """``python -m instruments readme [--check]``: 0 when the blocks match (or were rewritten),
    1 when --check finds a block that differs, 2 when a block cannot be made."""
    from pathlib import Path

    from instruments.store import readme as gen

    where = Path(root) if root else results.REPO_ROOT
    try:
        if check_only:
            stale = gen.check(where)
            for line in stale:
                print(f"instruments: {line}", file=sys.stderr)
            if stale:
                print("instruments: run `python -m instruments readme` and commit the result",
                      file=sys.stderr)
                return 1
            print("every generated block matches its runs")
            return 0
        changed = gen.write(where)
    except gen.ReadmeError as exc:
        print(f"instruments: error: {exc}", file=sys.stderr)
        return 2
    for doc in changed:
        print(f"rewrote {doc.relative_to(where) if doc.is_relative_to(where) else doc}")
    if not changed:
        print("every generated block already matches its runs")
    return 0


def gguf(args: argparse.Namespace) -> int:
    """``python -m instruments gguf OUT``: the model's weights as a GGUF file (SmolLM2 with its
    package's weights: the shipped file re-written, ``instruments.peers.gguf_out``)."""
    import os
    import time
    from pathlib import Path

    from instruments.peers import gguf_out

    out = Path(args.out)
    try:
        gguf_out.qtype_of(args.type)
        lineup.preset(args.model)  # ValueError naming the models allowed
        if out.is_dir() or not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
            raise ValueError(f"cannot write {out}: give a file in a writable folder")
        weights = args.weights or lineup.offline_weights(args.model)
        t0 = time.perf_counter()
        shipped = gguf_out.package_file()
        if weights == "package" and shipped is not None:  # the shipped file, re-written
            gguf_out.rewrite_gguf(shipped, out, args.type)
        else:
            from engine.models.loader import WeightsError

            try:
                model = lineup.load_model(args.model, weights, seed=args.seed).model
            except WeightsError as exc:
                raise ValueError(str(exc)) from exc
            gguf_out.write_gguf(model, out, args.type)
    except (ValueError, OSError) as exc:
        raise CliError(str(exc).strip().splitlines()[0]) from exc
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, {args.type.lower()}, "
          f"{args.model} {weights} weights) in {time.perf_counter() - t0:.1f} s")
    return 0


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
    exp = experiments.get(command)
    try:
        p = exp.from_args(args, loaded.model.config)
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
    for note in run["meta"].get("notes") or []:
        print(f"note: {note}")
    for line in exp.summary(run):
        print(line)
    return partial


def load(args: argparse.Namespace) -> Loaded:
    from instruments.measure.device import device_available
    from instruments.spine import load as load_model

    try:
        lineup.preset(args.model)  # a preset's name, or a checkpoint's path
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    if args.weights is None:  # what is local: random where the real weights need the hub
        args.weights = lineup.offline_weights(args.model)
    ok, why = device_available(args.device)
    if not ok:
        raise CliError(f"device {args.device!r} cannot be used: {why}")
    if not 1 <= args.batch <= MAX_BATCH:
        raise CliError(f"--batch must be within 1..{MAX_BATCH}, got {args.batch}")
    from engine.models.loader import WeightsError

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
            every = [*experiments.EXPERIMENTS, "all", *STORE_COMMANDS, "server"]
            raise CliError(f"choose a command: {', '.join(every)}")
        if args.command in STORE_COMMANDS:
            return store_command(args)
        if args.command == "server":
            from instruments.server import cli as server_cli

            try:
                return server_cli.run(args)
            except ValueError as exc:
                raise CliError(str(exc).strip().splitlines()[0]) from exc
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        loaded = load(args)
        names = experiments.in_all() if args.command == "all" else [args.command]
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
