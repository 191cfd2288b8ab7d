"""Peers of the serving engine: other engines serving the concurrency experiment's requests on the
loaded model's weights, each gated on its tokens and timed beside ours.

``run_peers(loaded, params, tr, every)`` runs after our engine served every concurrency (the
experiment's ``peers``: ``instruments.experiments.serving``), in the same process and never
beside other work, and adds one row per peer and concurrency to table "peers" (``tr.row``).
``every`` is the requests our engine served (``runs.concurrency_requests``): the first
max(C x rounds, 2) at concurrency C, a closed loop of C clients, greedy, no end-of-sequence. It
never raises: a peer that cannot run here is a row saying why and how to install it.

The peers:
  "llama.cpp batched (F32)"    llama.cpp's batched decode through llama-cpp-python's low-level
                               calls (``llamacpp_batch.Batched``) on the F32 GGUF file of the
                               loaded weights -- the very file and model handle the llamacpp_f32
                               peer builds (``llamacpp._build``: written, probed in a child,
                               loaded once per model). Per C: one context of n_seq_max = C (llama-
                               server's ``--parallel C``), C slots; each new request prefilled in
                               its own ``llama_decode``, then one ``llama_decode`` a step of one
                               token per live sequence (``closed_loop``). The multi-sequence path
                               is probed in a child process first (``probe_batched``). Capped at
                               llama.cpp's 256 sequences a context (a row says so above it).
  "transformers generate_batch"  transformers' continuous batching on its paged cache
                               (``serving_hf``), on SmolLM2 or GPT-2 holding the same weights.
Row fields: peer, concurrency, ok, why (when not ok), requests, output_tokens, output_tok_s,
duration_s (first request in to last token out, wall clock), tokens_equal (every request's
greedy tokens equal our engine's for the same request: ``tr.tables["requests"]``, label
"C={c}"), tokens_differing (token positions that differ, a missing one counted),
requests_differing, step_ms_by_batch (llama.cpp: the median decode step, ms, by its batch; keys
are the batch as text, as JSON keeps them), threads, version, note.

Where llama.cpp's tokens legitimately differ: its CPU GELU reads an f16 table
(``instruments.peers.llamacpp``), so F32 GPT-2's logits stray by ~5e-4 of the largest; a near tie
flips a greedy token and the rest of that request. Llama's SiLU is fp32 (within ~7e-6 of mode
1): a difference there is one to look at. A row whose tokens differ says both (``GELU_NOTE``).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from instruments.peers.serving_rows import (  # noqa: F401 (the peers' shared names, here too)
    arrivals_at,
    compare,
    line,
    ours,
    peer_points,
    point_row,
    unavailable,
)

PEER = "llama.cpp batched (F32)"
INSTALL = "make peers"  # compiles llama-cpp-python for this CPU (the Makefile says why)
# One note for every model (the row names the model; no family is tested here): which of the two
# facts applies is the model's activation
GELU_NOTE = ("llama.cpp's CPU GELU (GPT-2's) reads an f16 table (~5e-4 of the largest logit in "
             "every MLP, instruments.peers.llamacpp), so a near tie flips a greedy token and the "
             "rest of that request; its SiLU (the Llama family's) is fp32, within ~7e-6 of mode "
             "1's logits: a difference there is a near tie or a bug to look at")


@dataclass
class Loop:
    """What one closed loop served: each request's tokens, the decode steps' ms by batch."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    step_ms: dict[int, list[float]] = field(default_factory=dict)
    duration_s: float = 0.0


def run_peers(loaded: Any, params: Any, tr: Any, every: list[Any]) -> None:
    """Every peer's rows in table "peers" (the module docstring); never raises."""
    from instruments.lineup import PeerUnavailable
    from instruments.peers import serving_hf

    for name, rows in ((PEER, llamacpp_rows), (serving_hf.PEER, serving_hf.rows)):
        if tr.stop():
            tr.note("stopped: the serving peers were left out")
            return
        try:
            rows(loaded.model, params, every, tr)
        except PeerUnavailable as exc:  # a missing package, a crash in a probe: says what to do
            unavailable(tr, name, str(exc))
        except Exception as exc:  # an import that fails, an export, a refused call
            fix = INSTALL if name == PEER else serving_hf.INSTALL
            unavailable(tr, name, f"{line(exc)}; install or rebuild with: {fix}")


def closed_loop(dec: Any, arrivals: list[Any], clients: int) -> Loop:
    """``arrivals`` served by ``dec`` (``llamacpp_batch.Batched``'s calls) in a closed loop of
    ``clients`` slots: a slot's request prefilled, then stepped with every live one, its cells
    freed when it has its tokens and the slot given the next request. Each step is timed alone;
    ``duration_s`` spans the whole loop, prefills included."""
    clock = time.perf_counter
    out = Loop()
    pending = deque(range(len(arrivals)))
    slots: dict[int, list[int]] = {}  # seq id -> [request, next position, last token]

    def fill(seq: int) -> None:
        while pending:  # a request done by its prefill alone frees the slot at once
            i = pending.popleft()
            a = arrivals[i]
            out.tokens[i] = [dec.prefill(seq, list(a.prompt))]
            if a.new_tokens > 1:
                slots[seq] = [i, len(a.prompt), out.tokens[i][0]]
                return
            dec.clear(seq)

    t0 = clock()
    for seq in range(min(clients, len(arrivals))):
        fill(seq)
    while slots:
        live = sorted(slots)
        s0 = clock()
        got = dec.step([(s, slots[s][2], slots[s][1]) for s in live])
        out.step_ms.setdefault(len(live), []).append((clock() - s0) * 1e3)
        for seq, token in zip(live, got, strict=True):
            slot = slots[seq]
            out.tokens[slot[0]].append(token)
            slot[1], slot[2] = slot[1] + 1, token
            if len(out.tokens[slot[0]]) >= arrivals[slot[0]].new_tokens:
                del slots[seq]
                dec.clear(seq)
                fill(seq)
    out.duration_s = clock() - t0
    return out


def llamacpp_model(model: Any) -> tuple[Any, int]:
    """The llamacpp_f32 peer's F32 file of ``model``'s weights, loaded and probed (a single
    sequence, then several in one batch, each in a child process first): (built, threads).
    Raises ``PeerUnavailable`` where it cannot run."""
    import torch

    from instruments.lineup import PeerUnavailable
    from instruments.lineup import peers as lineup_peers
    from instruments.peers import llamacpp, native
    from instruments.peers.built import engine_for
    from instruments.peers.llamacpp_batch import probe_batched

    ok, why = lineup_peers.available("llamacpp_f32", str(model.device), model.config.family)
    if not ok:
        raise PeerUnavailable(why)
    threads = torch.get_num_threads()  # ours ran on these
    built = engine_for(model, ("llamacpp", "f32"),
                       lambda: llamacpp._build(model, "f32", threads))
    path = built.state["path"]
    native.probe(("llama.cpp batched", built.version, "f32", repr(model.config)),
                 probe_batched, path, threads, what=f"llama.cpp ({built.version}) decoding 4 "
                 f"sequences in one batch from {path.name}",
                 fix=llamacpp.FIX.format(qtype="f32"))
    return built, threads


class Stepper:
    """``batch`` sequences of ``context`` random tokens prefilled in one llama.cpp context
    (untimed), then ``time_steps(k)``: k decode steps of one token per sequence, each one
    ``llama_decode`` timed alone (ms): the batched step ``scripts/bench_serving.py`` sets beside
    ours at the same batch and context."""

    def __init__(self, model: Any, batch: int, context: int, steps: int, seed: int = 0) -> None:
        import random

        from instruments.peers.llamacpp_batch import Batched

        built, threads = llamacpp_model(model)
        self.dec = Batched(built.state["api"], built.handle, seqs=batch,
                           seq_tokens=context + steps + 2, threads=threads)
        built.state["contexts"].add(self.dec)
        rng = random.Random(seed)
        self.live = []
        for seq in range(batch):
            ids = [rng.randrange(model.config.vocab_size) for _ in range(context)]
            ids[0] = seq + 1
            self.live.append((seq, self.dec.prefill(seq, ids), context))
        self.version = built.version

    def time_steps(self, k: int) -> list[float]:
        out = []
        for _ in range(k):
            t0 = time.perf_counter()
            tokens = self.dec.step(self.live)
            out.append((time.perf_counter() - t0) * 1e3)
            self.live = [(s, t, p + 1) for (s, _, p), t in zip(self.live, tokens, strict=True)]
        return out

    def close(self) -> None:
        self.dec.close()


def llamacpp_rows(model: Any, params: Any, every: list[Any], tr: Any) -> None:
    """The llama.cpp peer's rows (the module docstring). Raises where it cannot start at all
    (the caller's unavailable row); a concurrency that fails is a row of its own."""
    from instruments.peers.llamacpp_batch import MAX_SEQS, Batched

    tr.emit(f"peer {PEER}: the F32 GGUF file, its load and probes")
    built, threads = llamacpp_model(model)
    api = built.state["api"]
    seq_tokens = params.prompt_max + params.output_max
    base_note = (f"one context of n_seq_max = C, {seq_tokens} cells a sequence (kv_unified "
                 f"off), fp32 KV, flash attention off, {threads} threads; a new request "
                 "prefilled in its own llama_decode, then one llama_decode a step over every "
                 "live sequence; step_ms_by_batch times the decode steps alone, the duration "
                 "includes the prefills")
    for c in peer_points(params):
        if tr.stop():
            return
        arrivals = arrivals_at(every, c, params.rounds)
        if c > MAX_SEQS:
            unavailable(tr, PEER, f"llama.cpp holds at most {MAX_SEQS} sequences in a "
                         "context (LLAMA_MAX_SEQ)", c, version=built.version)
            continue
        tr.emit(f"peer {PEER}: concurrency {c}")
        dec = None
        try:
            dec = Batched(api, built.handle, seqs=c, seq_tokens=seq_tokens, threads=threads)
            built.state["contexts"].add(dec)  # freed before the model, were it released first
            first = dec.prefill(0, list(arrivals[0].prompt[:4]))  # untimed: its first graphs
            dec.step([(0, first, min(4, len(arrivals[0].prompt)))])
            dec.clear(0)
            loop = closed_loop(dec, arrivals, c)
        except Exception as exc:  # this point failed (a refused batch): the next may not
            unavailable(tr, PEER, line(exc), c, version=built.version, threads=threads)
            continue
        finally:
            if dec is not None:
                dec.close()
        row = point_row(tr, PEER, c, arrivals, loop.tokens, loop.duration_s,
                        step_ms_by_batch={str(b): statistics.median(ms)
                                          for b, ms in sorted(loop.step_ms.items())},
                        threads=threads, version=built.version, note=base_note)
        if not row["tokens_equal"]:
            row["note"] = f"{row['note']}. {GELU_NOTE}"
        tr.row("peers", row, f"peer {PEER}: concurrency {c}: {row['output_tok_s']:.1f} "
               f"output tok/s, tokens {'equal' if row['tokens_equal'] else 'DIFFER'}",
               points=0)
