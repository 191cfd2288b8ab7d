"""How a request's next token is picked from its logits: greedy, or sampled with a temperature,
nucleus (top-p), top-k and a seed of its own.

  s = Sampling(temperature=0.7, top_p=0.9, top_k=0, seed=1234)   checked at construction:
                 ValueError naming the allowed range of each field
  s.greedy       True when the pick is the argmax (temperature 0, or top_k 1)
  sampler = Sampler(s)                         one per request: its own ``torch.Generator``
  token = sampler.pick(logits)                 logits (vocab,) of one row -> a token id

Greedy requests never reach a ``Sampler``: ``engine.serving.engine`` keeps the batch's one
argmax for them, so a greedy request's tokens are the engine's argmax exactly, whoever else is
in the batch. A sampled request draws from softmax(logits / temperature), restricted to the
``top_k`` most likely tokens (0: all) and then to the smallest set whose probability reaches
``top_p`` (the most likely token is always kept), with a generator seeded by ``seed`` (None: a
fresh random seed). The draw runs on the CPU in fp32, so one seed gives one stream on any
device, given the same logits. Torch is imported on first use.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

MAX_TEMPERATURE = 100.0  # past this the distribution is uniform to fp32: an absurd request
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed's range


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.temperature) <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be within 0..{MAX_TEMPERATURE:g}, got "
                             f"{self.temperature}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be within (0, 1], got {self.top_p}")
        if int(self.top_k) < 0:
            raise ValueError(f"top_k must be 0 (no cut) or more, got {self.top_k}")
        if self.seed is not None and not 0 <= int(self.seed) <= MAX_SEED:
            raise ValueError(f"seed must be within 0..{MAX_SEED}, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class Sampler:
    """One request's draws (the module docstring)."""

    def __init__(self, sampling: Sampling) -> None:
        import torch

        self.sampling = sampling
        self.generator = torch.Generator(device="cpu")
        seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        self.generator.manual_seed(int(seed))

    def pick(self, logits: Any) -> int:
        import torch

        s = self.sampling
        if s.greedy:
            return int(logits.argmax(-1))
        x = logits.detach().float().cpu() / s.temperature
        if 0 < s.top_k < x.numel():
            kth = torch.topk(x, s.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, -1)
        if s.top_p < 1.0:
            p, order = probs.sort(descending=True)
            # drop a token once the ones before it already reach top_p (the first always stays)
            drop = (p.cumsum(-1) - p) >= s.top_p
            p = p.masked_fill(drop, 0.0)
            return int(order[torch.multinomial(p, 1, generator=self.generator)])
        return int(torch.multinomial(probs, 1, generator=self.generator))
