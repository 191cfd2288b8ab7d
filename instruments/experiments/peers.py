"""Peers: other engines on the same weights, timed beside our exact modes (kind "peers").

``run(loaded, PeersParams, progress, should_stop)`` -> run with tables
  peers   one row per engine x context: latency_ms (the median over rounds of each round's
          median step), p90_ms (None with fewer than 10 samples), samples_ms, rounds_ms,
          floor_ms (the read floor at that context, same rounds), x_floor, x_fastest_exact
          (over our fastest exact mode at that context), logits_max_abs_diff and
          logits_tolerance (the gate's), weight_bytes (held by the engine), version,
          conversion_s (set-up, never in a step), threads; plus one row per peer that could
          not run (``available`` false, ``why``: the install command or the failure) or that
          failed the gate (``passed`` false, ``why``)
  floor   per context and round, each read kernel's median and the best (``floor_ms``)
  checks  the gate's verdict per engine (``instruments.checks.gate``)
Every engine is built (a peer's conversion/export timed apart), then gated against mode 1's
logits (at a short context and at 512 tokens where the model allows; a lossy peer is held to
its registered bound, its measured error kept), then timed in interleaved rounds: in each round,
at each context, the read floor (the best of ``instruments.measure.device.read_kernels`` over
the bytes of the Linear weights a step streams) and then every engine, ``steps`` samples each
through the ``Sampler`` (a seek to t - 1 tokens untimed, one timed step), the order reversed
every other round. Reading a run (the verdict, the table, llama.cpp's goals) is
``instruments.store.peers_report``'s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from engine.models.config import GPTConfig, ModelConfig
from instruments import lineup
from instruments.experiments.inputs import contexts_within, modes_usable, parse_contexts, whole
from instruments.experiments.utilization import weight_storage
from instruments.lineup import PEERS, PeerUnavailable
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, no_grad, record
from instruments.store.peers_report import llamacpp_goals, markdown, verdict

P90_MIN = 10  # fewer samples than this: no p90


def _names(text: str, known: list[str], what: str) -> list[str]:
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown {what} {bad[0]!r}; allowed: {', '.join(known)}")
    return names


@dataclass
class PeersParams:
    """Peers and our exact modes, interleaved round after round at each context."""
    contexts: list[int]
    peers: list[str]
    modes: list[str] = field(default_factory=lambda: lineup.with_role("peer_baseline"))
    threads: int | None = None  # torch / CTranslate2 / ONNX Runtime threads (None: torch's)
    rounds: int = 5
    steps: int = 8  # timed steps per engine, context and round
    warmup: int = 2  # untimed steps per engine and context, first round only
    prompt_seed: int = 0

    @classmethod
    def defaults(cls, device: str, cfg: ModelConfig) -> PeersParams:
        """Contexts 128 and 512 (within the model), every peer for this device, our modes."""
        block_size = cfg.block_size
        contexts = sorted({min(t, block_size) for t in (128, 512)})
        kind = str(device).split(":")[0]
        names = [n for n, p in PEERS.items()
                 if kind in p.devices and lineup.peer_converts(n, cfg.family)]
        ours = lineup.with_role("peer_baseline", device, cfg.family)
        return cls(contexts, names, ours)

    def check(self, cfg: GPTConfig, device: str) -> None:
        contexts_within("context lengths", self.contexts, 2, cfg.block_size)
        _names(",".join(self.peers), list(PEERS), "peer")
        if self.modes:
            if any(lineup.is_peer(m) for m in self.modes):
                raise ValueError("modes are our own decode modes; name peers under peers")
            modes_usable(self.modes, device, cfg.family)
        if not self.peers and not self.modes:
            raise ValueError(f"no engines given; allowed peers: {', '.join(PEERS)}")
        whole("rounds", self.rounds, 1, 100)
        whole("steps", self.steps, 1, 1000)
        whole("warmup", self.warmup, 0)
        if self.threads is not None:
            whole("threads", self.threads, 1, 256)


Params = PeersParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contexts", default="128,512", help="context lengths, e.g. 128,512")
    p.add_argument("--peers", default=None,
                   help=f"from: {', '.join(PEERS)} (default: every peer of the device)")
    p.add_argument("--modes", default=",".join(lineup.with_role("peer_baseline")),
                   help="our modes timed beside them (default: the exact cached ones)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=8, help="timed steps per engine per round")


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> PeersParams:
    block_size = cfg.block_size
    base = PeersParams.defaults(args.device, cfg)
    names = base.peers if args.peers is None else _names(args.peers, list(PEERS), "peer")
    ours = _names(args.modes, lineup.names(), "mode")
    return PeersParams(parse_contexts(args.contexts, block_size), names, ours, args.threads,
                       args.rounds, args.steps, prompt_seed=args.seed)


def summary(run: dict[str, Any]) -> list[str]:
    rows = run["tables"].get("peers", [])
    return [markdown(rows), *verdict(rows), *llamacpp_goals(rows)]


# ---------------------------------------------------------------------------------- running
class _Engine:
    """One engine during the run: its decoder, its gate result and its samples per context."""

    def __init__(self, name: str, dec: Any, check: Any, weight_bytes: int, version: str
                 ) -> None:
        self.name, self.dec, self.check, self.weight_bytes = name, dec, check, weight_bytes
        self.version = version
        self.samples: dict[int, list[float]] = {}
        self.rounds: dict[int, list[float]] = {}
        self.samplers: dict[int, Any] = {}


def _row(e: _Engine, t: int, floor_ms: float, threads: int, own_share: float
         ) -> dict[str, Any]:
    """``floor_ms``: the measured read of the model's fp32 weights; ``own_share``: the engine's
    own bytes a step (int8, bf16, GGUF blocks) over those, so ``own_floor_ms`` is its bytes
    divided by the same measured bandwidth."""
    spec = lineup.spec(e.name)
    own_ms = floor_ms * own_share
    samples = e.samples[t]
    median = statistics.median(e.rounds[t])
    p90 = statistics.quantiles(samples, n=10)[-1] if len(samples) >= P90_MIN else None
    return {
        "engine": e.name, "engine_label": spec.label, "mode": e.name,
        "kind": "peer" if lineup.is_peer(e.name) else "mode",
        # what its weights are stored as: a rung's or a GGUF peer's storage (so our q4_1 rung and
        # llama.cpp's Q4_1 file compare as one precision), a peer's own, else the model's dtype
        "precision": weight_storage(spec) or getattr(spec, "dtype", None)
        or e.check.get("dtype", "float32"),
        "context_len": t, "latency_ms": median, "p90_ms": p90, "min_ms": min(samples),
        "samples_ms": samples, "rounds_ms": e.rounds[t], "floor_ms": floor_ms,
        "x_floor": median / floor_ms if floor_ms > 0 else None, "x_fastest_exact": None,
        "weight_storage": weight_storage(spec), "own_floor_ms": own_ms,
        "x_own_floor": median / own_ms if own_ms > 0 else None,
        "kernel": getattr(e.dec, "kernel", None),  # what multiplied (mode 8's per-role choice)
        "logits_max_abs_diff": e.check.get("max_diff"),
        "logits_tolerance": e.check.get("tolerance"), "passed": True, "available": True,
        "why": "", "weight_bytes": e.weight_bytes, "version": e.version,
        "conversion_s": getattr(e.dec, "compile_s", 0.0), "threads": threads,
        "attended_keys": e.dec.attended_keys(t)}


def _not_run(name: str, why: str, *, available: bool, check: dict | None = None
             ) -> dict[str, Any]:
    spec = lineup.spec(name)
    return {"engine": name, "engine_label": spec.label, "mode": name,
            "kind": "peer" if lineup.is_peer(name) else "mode",
            "precision": weight_storage(spec) or getattr(spec, "dtype", None),
            "context_len": None, "latency_ms": None,
            "available": available, "passed": False if available else None, "why": why,
            "logits_max_abs_diff": (check or {}).get("max_diff"),
            "logits_tolerance": (check or {}).get("tolerance")}


@no_grad
def run(loaded: Loaded, params: PeersParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    """Build, gate and time every engine (see the module docstring)."""
    import torch

    loaded.checked(params)
    before = torch.get_num_threads()
    if params.threads:
        torch.set_num_threads(params.threads)
    try:
        return _run(loaded, params, progress, should_stop, torch.get_num_threads())
    finally:
        torch.set_num_threads(before)


def _run(loaded: Loaded, p: PeersParams, progress: ProgressFn | None,
         should_stop: StopFn | None, threads: int) -> dict[str, Any]:
    import torch

    from engine.loop import random_prompt
    from instruments.checks import gate
    from instruments.costmodel import costs
    from instruments.measure.device import read_kernels
    from instruments.measure.sampler import Sampler

    start_s = time.perf_counter()
    model, dev = loaded.model, loaded.model.device
    contexts = sorted(set(p.contexts))
    top = contexts[-1]
    names = lineup.ordered([*p.modes, *p.peers])
    tr = Tracker(progress, should_stop, p.rounds * len(contexts) * len(names))
    idx = random_prompt(model, 1, top, p.prompt_seed)
    checker = gate.Gate(model, 1, p.prompt_seed)
    params_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    engines: list[_Engine] = []
    rows: list[dict[str, Any]] = []
    for name in names:
        if tr.stop():  # out of time before timing began: the run says which were not built
            rows.append(_not_run(name, "not built: the run was stopped first", available=True))
            continue
        ok, why = lineup.available(name, str(dev))
        if not ok:
            rows.append(_not_run(name, why, available=False))
            tr.note(f"{name} not available: {why}")
            continue
        tr.emit(f"{name}: building" + (" (conversion/export, timed apart)"
                                       if lineup.is_peer(name) else ""))
        try:
            dec = lineup.make_decoder(model, name, batch_size=1, capacity=top, threads=threads)
        except (PeerUnavailable, ValueError) as exc:
            rows.append(_not_run(name, str(exc), available=False))
            tr.note(f"{name} not available: {exc}")
            continue
        tr.emit(f"{name}: checking its logits against mode 1")
        check = checker.check(name).to_row()
        check["dtype"] = getattr(lineup.spec(name), "dtype", str(model.dtype).split(".")[-1])
        tr.tables.setdefault("checks", []).append(check)
        if not check["passed"]:
            rows.append(_not_run(name, check["detail"], available=True, check=check))
            tr.note(f"{name} not timed: {check['detail']}")
            continue
        held = params_bytes if not lineup.is_peer(name) else 0
        engines.append(_Engine(name, dec, check, held + int(getattr(dec, "extra_bytes", 0)),
                               getattr(dec, "version", None) or f"torch {torch.__version__}"))

    tr.total = p.rounds * len(contexts) * len(engines)
    kernels, _, nbytes = read_kernels(dev, costs.linear_weight_bytes(model.config, model.dtype))
    floor_sampler = Sampler(dev, repeats=max(3, p.steps // 2), min_repeats=max(3, p.steps // 2),
                            spread=-1.0, warmup=1)
    floors: dict[int, list[float]] = {t: [] for t in contexts}
    stopped = tr.stop()
    for rnd in range(p.rounds if not stopped else 0):
        for t in contexts:
            best = None
            for kname, fn in kernels.items():
                got = floor_sampler.point(fn)
                if got is None:
                    stopped = True
                    break
                tr.tables.setdefault("floor", []).append(
                    {"round": rnd, "context_len": t, "kernel": kname, "bytes": nbytes,
                     "median_ms": got.median_ms, "samples_ms": got.samples_ms})
                best = got.median_ms if best is None else min(best, got.median_ms)
            if stopped:
                break
            floors[t].append(best)  # type: ignore[arg-type]
            order = engines if rnd % 2 == 0 else engines[::-1]  # nobody always goes first
            for e in order:
                got = _sample(e, t, idx, p, dev, tr, Sampler)
                if got is None:
                    stopped = True
                    break
                e.samples.setdefault(t, []).extend(got.samples_ms)
                e.rounds.setdefault(t, []).append(got.median_ms)
                tr.work += 1
                tr.emit(f"round {rnd + 1}/{p.rounds}, {t} tokens: {e.name} "
                        f"{got.median_ms:.2f} ms", points=1)
            if stopped:
                break
        if stopped:
            break
    for e in engines:
        close = getattr(e.dec, "close", None)
        if close is not None:
            close()  # CTranslate2: end its paused generation
    fp32_bytes = costs.linear_weight_bytes(model.config, model.dtype)
    timed_rows = [_row(e, t, statistics.median(floors[t]), threads,
                       costs.linear_weight_bytes(model.config, model.dtype,
                                                 weight_storage(lineup.spec(e.name))) / fp32_bytes)
                  for t in contexts for e in engines if e.rounds.get(t) and floors[t]]
    _relative(timed_rows)
    for r in timed_rows:
        tr.row("peers", r, f"{r['engine']}: {r['context_len']} tokens "
               f"{r['latency_ms']:.2f} ms", points=0)
    if stopped:
        tr.note("stopped: what was measured is kept")
    tables = {"peers": [*tr.tables.get("peers", []), *rows],
              "floor": tr.tables.get("floor", []), "checks": tr.tables.get("checks", [])}
    return record(loaded, "peers", p, tables, partial=stopped, notes=tr.notes,
                  timings={"total_s": time.perf_counter() - start_s}, floor_bytes=nbytes)


def _sample(e: _Engine, t: int, idx: Any, p: PeersParams, dev: Any, tr: Tracker,
            sampler_cls: Any) -> Any:
    """``steps`` samples of one step at context t (seek to t - 1 untimed, then one step)."""
    if t not in e.samplers:
        e.samplers[t] = sampler_cls(dev, repeats=p.steps, min_repeats=p.steps, spread=-1.0,
                                    warmup=p.warmup, should_stop=tr.stop)
    dec = e.dec
    return e.samplers[t].point(lambda: dec.step(idx[:, t - 1:t]),
                               lambda: dec.seek(idx, t - 1))


def _relative(rows: list[dict[str, Any]]) -> None:
    """x_fastest_exact: each row over our fastest exact mode at its context."""
    for t in {r["context_len"] for r in rows}:
        ours = [r for r in rows if r["context_len"] == t and r["kind"] == "mode"
                and not lineup.spec(r["engine"]).tolerance]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["latency_ms"])
        for r in rows:
            if r["context_len"] == t:
                r["x_fastest_exact"] = r["latency_ms"] / best["latency_ms"]
                r["fastest_exact"] = best["engine"]
