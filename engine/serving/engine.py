"""The serving engine: requests in, tokens out, many sequences decoded together over one block
pool under a byte budget.

  engine = ServingEngine(model, budget_bytes, block_tokens=16, max_seqs=64, step_tokens=512,
                         policy="fcfs", reads=None, prefix_reuse=True, keep_logits=False,
                         kernel=None, step="forward", kv_storage="model")
                 kv_storage: "model" (the model's dtype) | "int8" (rows scaled per token and
                 head: about a quarter of fp32's bytes; read gathered, dequantized);
                 step: "forward" | "fast" (``STEPS``), how an all-decode step runs;
                 reads: "in_place" | "gather" (``engine.serving.batch``; None: the device's
                 default); kernel: "cpu" | "triton", whose in-place kernels (None: the
                 device's; a test runs Triton's on a CPU in its interpreter); keep_logits: each
                 generated token's logits kept in ``engine.logits[seq.id]`` (for the tests)
  seq = engine.submit(prompt_ids, max_new_tokens, eos_id=None, sampling=None)   a waiting
                 ``Seq``; ValueError or ``BudgetError`` (nothing queued) for a request that
                 can never run: empty, longer than the model's context, or more blocks than
                 the whole budget. ``sampling``: an ``engine.serving.sampling.Sampling``
                 (None or greedy: the argmax)
  out = engine.step()            one step: ``schedule()`` then ``execute(works)``, which the
                                 caller may also call apart (to time the scheduler alone)
  engine.cancel(seq)             a client gone: its blocks back at once
  engine.drain()                 steps until nothing waits or runs

Every step is the scheduler's decision (``engine.serving.scheduler``), then one forward of the
model over every scheduled token (``engine.serving.batch``), then a token for each sequence
that reached its last token: the argmax, or its own ``Sampler``'s draw when it asked to
sample (``engine.serving.sampling``). A sequence ends at ``max_new_tokens`` or after
``eos_id``. Its computed rows then go to the prefix tree (``prefix_reuse``; else they are
freed), and its other blocks go back to the pool. ``StepOutput`` says what the step did: the
batch, its tokens, the tokens emitted, who finished, who was preempted, and the pool after it.

One ``PrefixCache`` (a radix tree over one ``BlockPool``) is both the prefix cache and the
block manager. A prompt that shares a prefix with a running or cached one shares its blocks,
so a shared prefix counts once against the budget. The engine measures nothing: the serving
experiments (``instruments/experiments/serving``) stamp times around ``step``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache.prefix import PrefixCache
from .batch import READS, default_reads, forward, kernel_for, step_decodes
from .sampling import Sampler, Sampling
from .scheduler import Scheduler, Seq, Work

# How a step in which every sequence decodes runs: "forward", the model's own forward over the
# tokens laid end to end; "fast", the family's one-token step, no module calls, over products
# chosen per role and row count on this machine (``engine.serving.products``). A step with
# prompt tokens always runs the forward.
STEPS = ("forward", "fast")


def default_step(device: Any, dtype: Any) -> str:
    """"fast" where mode 8's products and our C++ paged kernel run (a CPU in fp32 with the
    kernel built), else "forward"."""
    return "fast" if default_reads(device, dtype) == "in_place" and str(device) == "cpu" \
        else "forward"


@dataclass
class StepOutput:
    works: list[Work]
    emitted: list[tuple[Seq, int]] = field(default_factory=list)  # (sequence, its new token)
    finished: list[Seq] = field(default_factory=list)
    preempted: int = 0  # sequences preempted while this step was scheduled

    @property
    def batch(self) -> int:
        return len(self.works)

    @property
    def tokens(self) -> int:
        return sum(w.n for w in self.works)

    @property
    def decodes(self) -> int:
        return sum(1 for w in self.works if w.n == 1)


class ServingEngine:
    """Continuous batching over the prefix cache's block pool (the module docstring)."""

    def __init__(self, model: Any, budget_bytes: int, *, block_tokens: int = 16,
                 max_seqs: int = 64, step_tokens: int = 512, policy: str = "fcfs",
                 reads: str | None = None, prefix_reuse: bool = True,
                 keep_logits: bool = False, kernel: str | None = None,
                 step: str = "forward", kv_storage: str = "model") -> None:
        cfg = model.config
        if cfg.cache_rows(cfg.block_size) < cfg.block_size:  # a sliding window (Mistral's)
            raise ValueError(f"this model attends over its last {cfg.cache_rows(cfg.block_size)}"
                             " tokens only; the batched step attends over every row of a "
                             "sequence, so it would not be this model; allowed: a model whose "
                             "attention sees every earlier token")
        self.model = model
        self.cache = PrefixCache(model, budget_bytes, block_tokens=block_tokens, buffers=False,
                                 storage=kv_storage)
        if kv_storage == "int8" and reads is None:
            reads = "gather"  # no kernel of ours reads int8 blocks through a table yet
        self.scheduler = Scheduler(self.cache, max_seqs=max_seqs, step_tokens=step_tokens,
                                   policy=policy, keep_preempted=prefix_reuse)
        self.reads = default_reads(model.device, model.dtype) if reads is None else reads
        if self.reads not in READS:
            raise ValueError(f"unknown way to read the pool {self.reads!r}; allowed: "
                             f"{', '.join(READS)}")
        if kv_storage == "int8" and self.reads != "gather":
            raise ValueError("int8 K/V blocks are read gathered (dequantized); allowed: "
                             "reads='gather' with kv_storage='int8'")
        if self.reads == "in_place" and (kernel or kernel_for(model.device)) == "cpu":
            from ..kernels import cpu as kernels  # noqa: PLC0415

            built, why = kernels.available()
            if model.dtype != torch.float32 or not built:
                raise ValueError(f"in-place reads on a CPU need our C++ kernel over fp32 rows; "
                                 f"the model is {model.dtype}" + ("" if built else f", the "
                                 f"kernel {why}") + "; allowed: reads='gather'")
        self.kernel = kernel_for(model.device) if kernel is None else kernel
        if step not in STEPS:
            raise ValueError(f"unknown step {step!r}; allowed: {', '.join(STEPS)}")
        if step == "fast" and self.reads != "in_place":
            raise ValueError("the fast step reads the pool in place; allowed: step='forward' "
                             "with reads='gather'")
        self.step_kind = step
        self._fast: tuple[Any, Any] | None = None
        if step == "fast":  # products chosen per role and row count here (set-up, not a step)
            from ..decoders.fast import steps_of  # noqa: PLC0415
            from .products import batch_weights  # noqa: PLC0415

            weights = batch_weights(model).step
            self._fast = (steps_of(model, weights)[0], weights)
        self.prefix_reuse = prefix_reuse
        self.keep_logits = keep_logits
        self.logits: dict[int, list[torch.Tensor]] = {}  # seq id -> each generated token's
        self.samplers: dict[int, Sampler] = {}  # seq id -> its draws (sampled requests only)
        self.steps = 0

    # ----------------------------------------------------------------------------- requests
    def submit(self, prompt: list[int], max_new_tokens: int, eos_id: int | None = None,
               sampling: Sampling | None = None) -> Seq:
        seq = self.scheduler.add(prompt, max_new_tokens, eos_id)
        if sampling is not None and not sampling.greedy:
            self.samplers[seq.id] = Sampler(sampling)
        return seq

    def cancel(self, seq: Seq) -> None:
        self.scheduler.cancel(seq)
        self.samplers.pop(seq.id, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ----------------------------------------------------------------------------- stepping
    def schedule(self) -> list[Work]:
        return self.scheduler.schedule()

    def execute(self, works: list[Work], preempted: int = 0) -> StepOutput:
        """Run the scheduled works: one forward, a token for each that samples, the
        sequences advanced and those done finished."""
        out = StepOutput(works, preempted=preempted)
        if not works:
            return out
        if self._fast is not None and all(w.n == 1 for w in works):
            logits = step_decodes(*self._fast, self.cache.pool, works, self.kernel)
        else:
            logits = forward(self.model, self.cache.pool, works, self.reads, self.kernel)
        picks = logits.argmax(-1).tolist() if logits.size(0) else []
        r = 0
        for w in works:
            seq = w.seq
            seq.computed += w.n
            seq.req.length = seq.computed
            if not w.samples:
                continue
            sampler = self.samplers.get(seq.id)
            token = int(picks[r]) if sampler is None else sampler.pick(logits[r])
            if self.keep_logits:
                self.logits.setdefault(seq.id, []).append(logits[r].detach().cpu().clone())
            r += 1
            seq.tokens.append(token)
            out.emitted.append((seq, token))
            if token == seq.eos_id or seq.remaining <= 0:
                self.scheduler.finish(seq, "eos" if token == seq.eos_id else "length")
                self.samplers.pop(seq.id, None)
                if not self.prefix_reuse:  # nothing kept: the tree gives its blocks back now
                    self._drop_tree()
                out.finished.append(seq)
        self.steps += 1
        return out

    def step(self) -> StepOutput:
        before = self.scheduler.preemptions
        works = self.schedule()
        return self.execute(works, self.scheduler.preemptions - before)

    def drain(self, max_steps: int = 1_000_000) -> list[StepOutput]:
        """Steps until nothing waits or runs (at most ``max_steps``)."""
        outs = []
        while self.has_work() and len(outs) < max_steps:
            outs.append(self.step())
            if not outs[-1].works and self.has_work():
                raise RuntimeError("the scheduler can run nothing although requests wait; "
                                   "this is a bug: " + self.describe())
        return outs

    def _drop_tree(self) -> None:
        for leaf in self.cache.evictable():
            self.cache.evict_leaf(leaf)

    # ------------------------------------------------------------------------ what it holds
    def pool_state(self) -> dict[str, int]:
        """Blocks of the pool: held by running sequences (own), shared (more than one
        holder), held by the tree alone, free."""
        refs, running = self.cache.pool.refs, self.scheduler.running
        held = {b for s in running for b in s.req.table}
        shared = sum(1 for b in held if refs[b] > 1)
        return {"blocks": self.cache.pool.n_blocks, "free": len(self.cache.pool.free),
                "running": len(held), "shared": shared,
                "tree_only": self.cache.pool.used - len(held),
                "waiting_seqs": len(self.scheduler.waiting), "running_seqs": len(running)}

    def describe(self) -> str:
        s = self.pool_state()
        return (f"{s['running_seqs']} running, {s['waiting_seqs']} waiting; blocks: "
                f"{s['running']} held by running, {s['tree_only']} by the tree alone, "
                f"{s['free']} free of {s['blocks']}")
