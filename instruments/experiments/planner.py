"""The KV memory planner: what fits on this device, by formula and allocated (kind "kv_planner").

``run(loaded, PlannerParams, progress, should_stop)`` -> run with tables
  fit            per context: sequences that fit in the budget by formula, then a cache of that
                 many (capped at ``max_alloc_mib``) allocated for real: tensor bytes against the
                 formula, and what the allocator (CUDA) or the process (CPU) gained; freed after
  layouts        the drawn mixed-length batch held three ways (``kv_plan.LAYOUTS``), each
                 allocated with the engine's own caches (a paged pool sized to exactly the blocks
                 the lengths need, blocks handed out per sequence): reserved / in use / wasted
  against_batch  reserved bytes of each layout for the first b sequences of the same draw
                 continued (formula), b = 1, 2, 4, ... 4096
  storages       KV stored in the model dtype, fp16, bf16, int8: bytes per token (formula and
                 measured) and the logits error against fp32 on the loaded model
  kv_heads       fewer KV heads (grouped / multi-query attention): a what-if, formula only
The budget is ``kv_plan.HEADROOM`` of the free memory (the weights already loaded) less one
full-length prefill's activations at batch 1 and, on a GPU, a workspace estimate. Meta carries
free_bytes, overhead_bytes, budget_bytes, alloc_cap_bytes, weights_bytes and the drawn lengths.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from engine import dtypes
from engine.models.config import GPTConfig, ModelConfig
from instruments import lineup
from instruments.costmodel import costs, kv_plan
from instruments.experiments.inputs import (
    contexts_within,
    parse_contexts,
    whole,
)
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, no_grad, record

if TYPE_CHECKING:
    import torch

    from engine.models.base import CausalLM


@dataclass
class PlannerParams:
    """What fits (formula, then allocated), a mixed-length batch held three ways, KV storage
    types with their logits error against fp32, and the KV-head what-if
    (``instruments.costmodel.kv_plan``).
    """
    distribution: str = "long-tailed"
    sequences: int = 32
    mean_len: int | None = None  # None: a quarter of the model's limit
    block_tokens: int = 16
    seed: int = 0
    contexts: list[int] | None = None  # fit points; None: limit/8, /4, /2, the limit
    # the most one allocation may take, MiB; None: 2 GiB on a CPU (the machine keeps working),
    # the plan's whole budget on a GPU
    max_alloc_mib: int | None = None
    error_tokens: int = 64  # decode steps whose logits are compared with fp32, per storage

    def resolved(self, cfg: GPTConfig) -> PlannerParams:
        """A copy with every None filled in for ``cfg``."""
        block = cfg.block_size
        return replace(self, mean_len=self.mean_len or max(1, block // 4),
                       contexts=self.contexts or sorted({max(1, block // 8), max(1, block // 4),
                                                         max(1, block // 2), block}))

    def check(self, cfg: GPTConfig, device: str) -> None:
        from instruments.costmodel.kv_plan import DISTRIBUTIONS

        if self.distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {', '.join(DISTRIBUTIONS)}, got "
                             f"{self.distribution!r}")
        whole("sequences", self.sequences, 1, 4096)
        if self.mean_len is not None:
            whole("mean length", self.mean_len, 1, cfg.block_size)
        whole("block size (tokens)", self.block_tokens, 1, cfg.block_size)
        if self.contexts is not None:
            contexts_within("context lengths", self.contexts, 1, cfg.block_size)
        if self.max_alloc_mib is not None:
            whole("largest allocation (MiB)", self.max_alloc_mib, 1)
        whole("error tokens", self.error_tokens, 1, max(1, cfg.block_size // 2))


Params = PlannerParams


def add_arguments(p: argparse.ArgumentParser) -> None:
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


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> PlannerParams:
    block_size = cfg.block_size
    fit = parse_contexts(args.fit_contexts, block_size) if args.fit_contexts else None
    return PlannerParams(args.distribution, args.sequences, args.mean_len, args.block_tokens,
                         args.seed, fit, args.max_alloc_mib)


def summary(run: dict[str, Any]) -> list[str]:
    tables = run["tables"]
    lines = [f"{r['label']:>40}: {r['reserved_bytes'] / 2**20:,.1f} MiB reserved, "
             f"{r['waste_share']:.0%} wasted, {r['fits_sequences']} sequences fit"
             for r in tables.get("layouts", [])]
    for r in tables.get("storages", []):
        err = r.get("rel_error")
        lines.append(f"KV in {r['storage']:>8}: {r['bytes_per_token']:,} B/token" +
                     ("" if err is None else f", logits error {err:.2g} of the largest logit"))
    return lines


MIB = 2**20
CPU_ALLOC_CAP_MIB = 2048
AGAINST_BATCH_MAX = 4096
ERROR_PROMPT = 128  # tokens prefilled before the decode steps whose logits are compared


def _cap_bytes(p: PlannerParams, device: torch.device, budget: int | None) -> int:
    if p.max_alloc_mib is not None:
        return p.max_alloc_mib * MIB
    if device.type == "cuda" and budget is not None:
        return budget
    return CPU_ALLOC_CAP_MIB * MIB


def _fit_rows(model: CausalLM, p: PlannerParams, budget: int | None, cap: int,
              tr: Tracker) -> None:
    from instruments.measure import memory

    cfg, dev = model.config, model.device
    bpt = kv_plan.kv_bytes_per_token(cfg, model.dtype)
    for t in p.contexts or []:
        if tr.stop():
            return
        rows = cfg.cache_rows(t)  # a sliding window holds its window's rows at most
        fit = None if budget is None else kv_plan.max_batch(budget, bpt, rows)
        batch = min(fit if fit is not None else 1, cap // (bpt * rows))
        row: dict[str, Any] = {"context_len": t, "bytes_per_token": bpt, "formula_batch": fit,
                               "allocated_batch": batch, "capped": fit is not None and
                               batch < fit, "formula_bytes": bpt * rows * batch}
        if batch < 1:
            row.update(fits=None, error=f"one sequence needs {bpt * rows / MIB:,.0f} MiB, over "
                       f"the {cap / MIB:,.0f} MiB allowed per allocation")
        else:
            row.update(memory.allocation(dev, lambda b=batch, t=t: lineup.make_cache(
                "prealloc", model, b, t)))
        tr.work += 1
        tr.row("fit", row, f"{t} tokens: {fit if fit is not None else '?'} sequences fit by "
               f"formula; allocated {batch}")


def _layout(model: CausalLM, layout: str, lengths: list[int], block_tokens: int) -> Any:
    from engine.cache.paged import PagedKVCache

    cfg = model.config
    if layout == "contiguous":
        return lineup.make_cache("prealloc", model, len(lengths), cfg.block_size)
    if layout == "exact":
        return [lineup.make_cache("prealloc", model, 1, n) for n in lengths]
    blocks = kv_plan.reserved_tokens("paged", kv_plan.held(cfg, lengths), cfg.block_size,
                                     block_tokens)
    cache = PagedKVCache(cfg.n_layer, len(lengths), cfg.n_kv_head, cfg.block_size, cfg.head_dim,
                         block_tokens=block_tokens, pool_blocks=blocks // block_tokens,
                         device=model.device, dtype=model.dtype)
    for seq, n in enumerate(kv_plan.held(cfg, lengths)):  # every block of the pool is handed
        cache.reserve(seq, n)  # out, none is left
    return cache


def _layout_rows(model: CausalLM, p: PlannerParams, lengths: list[int], budget: int | None,
                 cap: int, tr: Tracker) -> None:
    from instruments.measure import memory

    bpt = kv_plan.kv_bytes_per_token(model.config, model.dtype)
    cfg = model.config
    for row in kv_plan.layouts(kv_plan.held(cfg, lengths), cfg.cache_rows(cfg.block_size),
                               p.block_tokens, bpt, budget):
        if tr.stop():
            return
        if row["reserved_bytes"] > cap:
            row.update(fits=None, error=f"{row['reserved_bytes'] / MIB:,.0f} MiB is over the "
                       f"{cap / MIB:,.0f} MiB allowed per allocation: formula only")
        else:
            row.update(memory.allocation(model.device, lambda r=row: _layout(
                model, r["layout"], lengths, p.block_tokens)))
        tr.work += 1
        tr.row("layouts", row, f"{row['label']}: {row['reserved_bytes'] / MIB:,.1f} MiB reserved")


def _reference(model: CausalLM, tokens: torch.Tensor, free: int | None) -> tuple[torch.Tensor, str]:
    """fp32 logits (B, T, vocab) of ``tokens``: the model itself, or an fp32 copy of it."""
    import torch

    if model.dtype == torch.float32:
        return model(tokens, use_cache=False, logits="all")[0].float(), "the model"
    need = costs.weight_bytes(model.config, torch.float32)
    if free is not None and need > kv_plan.HEADROOM * free:
        raise MemoryError(f"an fp32 copy of the weights needs {need / MIB:,.0f} MiB")
    ref = copy.deepcopy(model).float()
    try:
        return ref(tokens, use_cache=False, logits="all")[0], "an fp32 copy"
    finally:
        del ref


def _storage_rows(model: CausalLM, p: PlannerParams, free: int | None, budget: int | None,
                  tr: Tracker) -> None:
    import torch

    from engine.decoders import Decoder
    from engine.loop import decode, random_prompt

    cfg = model.config
    prompt = max(1, min(ERROR_PROMPT, cfg.block_size - p.error_tokens))
    steps = min(p.error_tokens, cfg.block_size - prompt)
    tokens = random_prompt(model, 1, prompt + steps, p.seed)
    try:
        want, against = _reference(model, tokens, free)
        # (steps + 1, B, vocab) in fp32 on the CPU, as decode keeps the logits it compares
        want = want[:, prompt - 1:].transpose(0, 1).float().cpu()
    except MemoryError as exc:
        want, against = None, str(exc)
        tr.note(f"logits errors not measured: {exc}")
    own = dtypes.canonical(model.dtype)
    for row in kv_plan.storage_rows(cfg, model.dtype, budget):
        storage = row["storage"]
        if tr.stop():
            return
        if storage == "float32" and own != "float32":
            continue  # wider than the model's own: nothing to save
        kind = "prealloc" if storage == own else f"kv_{storage}"
        dec = Decoder(model, capacity=prompt + steps, cache_kind=kind, mask="none")
        gen = decode(dec, tokens[:, :prompt], steps + 1, feed=tokens[:, prompt:],
                     keep_logits=True)
        row.update(cache_kind=kind, measured_bytes_per_token=dec.cache.nbytes()
                   // (prompt + steps), compared_tokens=steps + 1, reference=against)
        if want is not None:
            got = torch.stack(gen.logits).float()
            err = (got - want).abs()
            row.update(max_abs_error=float(err.max()),
                       rel_error=float(err.max() / want.abs().max()),
                       top1_agree=float((got.argmax(-1) == want.argmax(-1)).float().mean()))
        del dec, gen
        tr.work += 1
        tr.row("storages", row, f"KV in {storage}: {row['bytes_per_token']:,} B/token")


@no_grad
def run(loaded: Loaded, params: PlannerParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    from instruments.measure import memory

    model = loaded.model
    cfg, dev = model.config, model.device
    params.check(cfg, str(dev))
    p = params.resolved(cfg)
    est = costs.peak_memory_estimate(cfg, model.dtype, 1, cfg.block_size, "prealloc",
                                     logits_all=False, device=str(dev), mask="none")
    overhead = est["total_bytes"] - est["weights_bytes"] - est["kv_bytes"]
    free = memory.free_bytes(dev)
    budget = kv_plan.budget(free, overhead)
    cap = _cap_bytes(p, dev, budget)
    lengths = kv_plan.draw_lengths(p.distribution, p.sequences, p.mean_len, cfg.block_size,
                                   p.seed)
    n_storages = len(kv_plan.storage_rows(cfg, model.dtype, None))
    tr = Tracker(progress, should_stop, len(p.contexts) + len(kv_plan.LAYOUTS) + n_storages)
    _fit_rows(model, p, budget, cap, tr)
    _layout_rows(model, p, lengths, budget, cap, tr)
    _storage_rows(model, p, free, budget, tr)
    stopped = tr.stop()
    if stopped:
        tr.note("stopped: what was measured is kept")
    bpt = kv_plan.kv_bytes_per_token(cfg, model.dtype)
    # The same draw continued (its first sequences are the batch above), far enough for the
    # layouts' lines to cross this device's budget.
    many = kv_plan.draw_lengths(p.distribution, max(p.sequences, AGAINST_BATCH_MAX),
                                p.mean_len, cfg.block_size, p.seed)
    batches = sorted({2**k for k in range(13) if 2**k <= len(many)} | {p.sequences})
    tables = {name: tr.tables.get(name, []) for name in ("fit", "layouts", "storages")}
    tables["against_batch"] = kv_plan.memory_against_batch(many, cfg.block_size,
                                                           p.block_tokens, bpt, batches)
    tables["kv_heads"] = kv_plan.kv_head_rows(cfg, model.dtype, budget)
    return record(loaded, "kv_planner", p, tables, partial=stopped, notes=tr.notes,
                  free_bytes=free, overhead_bytes=overhead, budget_bytes=budget,
                  alloc_cap_bytes=cap, weights_bytes=memory.weights_bytes(model),
                  lengths=lengths)
