"""The batch curve: a decode step's time and tokens/s against the batch, at a few contexts, with
the two reads it cannot beat drawn beside it (kind "batch_curve").

``run(loaded, BatchCurveParams, progress, should_stop)`` -> run with tables
  curve     per mode, context and batch: the step's samples and median (ms), tokens/s
            (batch / step), the weights' read and the K/V cache's read at that batch and
            context (ms, formula bytes / the measured read bandwidth), their sum (the floor)
            and the step over it
  skipped   (mode, context, batch) points not measured, and why (the memory budget, a mode
            the gate refused)
  crossover per context and mode: the batch at which the K/V cache's bytes a step reads
            overtake the weights' (formula)
Meta carries read_gbps (the bandwidth the floors use) and the weights' bytes per mode.

Why: at batch 1 a step reads the weights once and the cache barely counts; each sequence added
reads its own cache rows, so past the crossover the cache, not the weights, sets the step -- the
lesson of a KV cache at scale, and the reason for paged and int8 caches. Every mode is gated
against mode 1 first (at the smallest batch); a batch whose cache and activations would not fit
in the device's free memory (the planner's headroom) is skipped, saying so. Each point is a
decoder of that batch moved to the context (prefill, then extended: untimed) and one step timed
by the one Sampler, warmed up.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from engine.models.config import ModelConfig
from instruments import lineup
from instruments.costmodel import costs
from instruments.experiments.inputs import (
    MAX_BATCH,
    contexts_within,
    modes_usable,
    parse_contexts,
    parse_modes,
    whole,
)
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, no_grad, record

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class BatchCurveParams:
    """Modes timed at each context and batch (ascending), samples per point."""
    modes: list[str]
    contexts: list[int]
    batches: list[int] = field(default_factory=lambda: list(BATCHES))
    repeats: int = 3
    warmup: int = 2
    seed: int = 0

    @classmethod
    def defaults(cls, device: str, cfg: ModelConfig) -> BatchCurveParams:
        """On a GPU the Triton rung, paged and int8 caches at 128, 512 and 1,024 tokens (within
        the model), batches 1-256; on a CPU the paged and int8 caches, small batches."""
        usable = lineup.choices(device, cfg.family, with_peers=False)[0]
        gpu = str(device).startswith("cuda")
        wanted = ("triton", "paged", "int8_kv") if gpu else ("prealloc_fused", "paged", "int8_kv")
        contexts = sorted({min(t, cfg.block_size - 1) for t in (128, 512, 1024)})
        return cls([m for m in wanted if m in usable], contexts,
                   list(BATCHES) if gpu else [1, 2, 4])

    def check(self, cfg: ModelConfig, device: str) -> None:
        modes_usable(self.modes, device, cfg.family)
        if not all(lineup.spec(m).cached for m in self.modes):
            raise ValueError("the batch curve times cached modes only (a step over a cache)")
        contexts_within("context lengths", self.contexts, 2, cfg.block_size - 1)
        contexts_within("batch sizes", self.batches, 1, MAX_BATCH)
        whole("repeats", self.repeats, 1, 100)
        whole("warm-up calls", self.warmup, 0, 100)


Params = BatchCurveParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default=None, help="cached modes (default: per device)")
    p.add_argument("--contexts", default=None, help="context lengths, e.g. 128,512,1024")
    p.add_argument("--batches", default=None, help="batch sizes, e.g. 1,2,4,8")
    p.add_argument("--repeats", type=int, default=3)


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> BatchCurveParams:
    base = BatchCurveParams.defaults(args.device, cfg)
    return BatchCurveParams(
        parse_modes(args.modes) if args.modes else base.modes,
        parse_contexts(args.contexts, cfg.block_size) if args.contexts else base.contexts,
        parse_contexts(args.batches, MAX_BATCH, "batch size") if args.batches else base.batches,
        args.repeats)


def summary(run: dict[str, Any]) -> list[str]:
    lines = []
    for r in run["tables"].get("curve", []):
        lines.append(f"{r['mode']:15s} ctx {r['context_len']:5d} batch {r['batch_size']:4d}: "
                     f"{r['latency_ms']:8.3f} ms, {r['tokens_per_s']:10,.0f} tok/s, floor "
                     f"{r['floor_ms']:.3f} ms (weights {r['weights_read_ms']:.3f} + KV "
                     f"{r['kv_read_ms']:.3f}) = {r['over_floor']:.1f}x")
    for c in run["tables"].get("crossover", []):
        lines.append(f"{c['mode']}: the cache's read overtakes the weights' at batch "
                     f"{c['batch_crossover']:.1f} at {c['context_len']} tokens")
    lines += [f"skipped {s['mode']} ctx {s['context_len']} batch {s['batch_size']}: {s['why']}"
              for s in run["tables"].get("skipped", [])]
    return lines


def floors(cfg: ModelConfig, dtype: Any, mode: str, context: int, batch: int,
           read_gbps: float) -> tuple[float, float]:
    """(weights' read, K/V cache's read) in ms for one step of ``mode`` (formula bytes at the
    measured read bandwidth): the weights once for the batch, each sequence its own rows."""
    spec = lineup.spec(mode)
    weights = costs.linear_weight_bytes(cfg, dtype, spec.weight_storage)
    total = costs.step_read_bytes(cfg, dtype, context, batch, storage=spec.weight_storage,
                                  kv_storage=spec.kv_storage or None)
    return weights / (read_gbps * 1e6), (total - weights) / (read_gbps * 1e6)


def _time_batch(model: Any, mode: str, batch: int, contexts: list[int],
                params: BatchCurveParams, read_gbps: float, tr: Tracker) -> bool:
    """One decoder of ``batch`` sequences timed at each context, a row each; True if stopped."""
    from engine.loop import random_prompt
    from instruments.lineup import make_decoder
    from instruments.measure.sampler import Sampler

    dec = make_decoder(model, mode, batch_size=batch, capacity=contexts[-1])
    ids = random_prompt(model, batch, contexts[-1], params.seed)
    sampler = Sampler(model.device, repeats=params.repeats, warmup=params.warmup,
                      should_stop=tr.stop)
    for t in contexts:
        got = sampler.point(lambda t=t: dec.step(ids[:, t - 1 : t]),
                            lambda t=t: dec.seek(ids, t - 1))
        if got is None:
            return True
        weights_ms, kv_ms = floors(model.config, model.dtype, mode, t, batch, read_gbps)
        ms = got.median_ms
        row = {"mode": mode, "context_len": t, "batch_size": batch,
               "samples_ms": got.samples_ms, "latency_ms": ms, "tokens_per_s": batch / ms * 1e3,
               "weights_read_ms": weights_ms, "kv_read_ms": kv_ms,
               "floor_ms": weights_ms + kv_ms, "over_floor": ms / (weights_ms + kv_ms)}
        tr.row("curve", row, f"{mode}: batch {batch} at {t} tokens took {ms:.3f} ms "
               f"({row['tokens_per_s']:,.0f} tokens/s)")
    return False


@no_grad
def run(loaded: Loaded, params: BatchCurveParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    """Step time against the batch (see the module docstring)."""
    from instruments.checks import gate
    from instruments.measure import device, memory

    model = loaded.checked(params)
    cfg, dtype = model.config, model.dtype
    contexts, batches = sorted(set(params.contexts)), sorted(set(params.batches))
    read_gbps = float(device.peaks(model.device, dtype).read_gbps)
    tr = Tracker(progress, should_stop, len(params.modes) * len(contexts) * len(batches))
    skipped = tr.tables.setdefault("skipped", [])
    stopped = False
    for mode in params.modes:
        check = gate.Gate(model, batches[0], params.seed).check(mode)
        tr.tables.setdefault("checks", []).append(check.to_row())
        if not check.passed:
            skipped.append({"mode": mode, "context_len": None, "batch_size": None,
                            "why": f"refused by the gate: {check.detail}"})
            tr.done += len(contexts) * len(batches)
            continue
        for batch in batches:
            est = costs.peak_memory_estimate(cfg, dtype, batch, contexts[-1], "prealloc",
                                             logits_all=False, device=str(model.device),
                                             mask="none")
            ok, why = memory.fits(model.device, est, resident_bytes=est["weights_bytes"])
            if not ok:
                skipped += [{"mode": mode, "context_len": t, "batch_size": batch, "why": why}
                            for t in contexts]
                tr.done += len(contexts)
                continue
            stopped = _time_batch(model, mode, batch, contexts, params, read_gbps, tr)
            if stopped:
                break
        if stopped:
            break
    tr.tables["crossover"] = [
        {"mode": m, "context_len": t,
         "batch_crossover": floors(cfg, dtype, m, t, 1, read_gbps)[0]
         / floors(cfg, dtype, m, t, 1, read_gbps)[1]}
        for m in params.modes for t in contexts]
    if stopped:
        tr.note("stopped: what was measured is kept")
    return record(loaded, "batch_curve", params, tr.tables, partial=stopped, notes=tr.notes,
                  read_gbps=read_gbps,
                  weight_bytes={m: costs.linear_weight_bytes(cfg, dtype,
                                                             lineup.spec(m).weight_storage)
                                for m in params.modes})
