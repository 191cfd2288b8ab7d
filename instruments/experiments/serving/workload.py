"""The request streams the serving experiments serve, seeded and stated. Torch-free.

``random_requests(n, vocab, prompt, output, seed)``: vLLM's "random" dataset. Prompt lengths
are uniform over ``prompt = (lo, hi)`` and output lengths over ``output = (lo, hi)`` tokens.
The ids are uniform over the vocabulary, and every prompt starts with its own first token, so
no two share a prefix by chance. Generation always runs to its length (no end-of-sequence).

``poisson(requests, rate_per_s, seed)``: the same requests, their arrival times a Poisson
process of ``rate_per_s`` (exponential gaps from a seeded generator; rate inf: all at 0).

``prefix_requests(n, vocab, ..., seed)``: the prefix workload's mix
(``instruments.experiments.prefix.workload.mix``: shared system prompts and documents, a
question of its own each) with its own seeded arrivals, and each request's group (its system
prompt and document), for cache-aware scheduling.
"""

from __future__ import annotations

import random
from typing import Any

from instruments.experiments.serving.driver import Arrival


def random_requests(n: int, vocab: int, prompt: tuple[int, int], output: tuple[int, int],
                    seed: int = 0) -> list[Arrival]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(*prompt))]
        ids[0] = (i * 7919 + 1) % vocab  # its own first token: no shared prefix by chance
        out.append(Arrival(0.0, ids, rng.randint(*output)))
    return out


def poisson(requests: list[Arrival], rate_per_s: float, seed: int = 0) -> list[Arrival]:
    rng = random.Random(seed + 104729)
    clock = 0.0
    out = []
    for a in requests:
        if rate_per_s != float("inf"):
            clock += rng.expovariate(rate_per_s)
        out.append(Arrival(clock, a.prompt, a.new_tokens, a.group))
    return out


def prefix_requests(cfg: Any, n: int, rate_per_s: float, new_tokens: int, *, systems: int,
                    system_tokens: int, documents: int, document_tokens: int,
                    seed: int = 0) -> list[Arrival]:
    from instruments.experiments.prefix.workload import PrefixWorkloadParams, mix

    p = PrefixWorkloadParams([1.0], requests=n, systems=systems, system_tokens=system_tokens,
                             documents=documents, document_tokens=document_tokens,
                             new_tokens=new_tokens, rate_per_s=rate_per_s, seed=seed)
    return [Arrival(r["arrival_s"], r["ids"], new_tokens,
                    r["system"] * 1000 + (-1 if r["document"] is None else r["document"]))
            for r in mix(cfg, p)]
