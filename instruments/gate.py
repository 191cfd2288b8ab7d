"""The gate every timed mode passes first: its greedy tokens against mode 1's (the naive loop).

``check_mode(model, name, prompt, n)`` -> ``ModeCheck``; ``gate(model, name, batch, n_tokens,
seed)`` checks one mode on a short random prompt (mode 1 is the reference: nothing to check), a
mode that crashes is reported as failed, never raised. Experiments refuse to time a mode that
fails and say why in the run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from engine.decoders import make_decoder
from engine.loop import decode
from engine.model import GPT
from instruments.spine import random_prompt


@dataclass
class ModeCheck:
    mode: str
    passed: bool
    detail: str

    def to_row(self) -> dict[str, Any]:
        return asdict(self)


def greedy(model: GPT, name: str, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` greedy tokens (B, n) of mode ``name`` after ``prompt``."""
    dec = make_decoder(model, name, batch_size=prompt.size(0), capacity=prompt.size(1) + n)
    return decode(dec, prompt, n).tokens


def check_mode(model: GPT, name: str, prompt: torch.Tensor, n: int = 24) -> ModeCheck:
    """Greedy tokens of ``name`` must equal mode 1's (the naive loop) before it is timed."""
    want = greedy(model, "uncached", prompt, n)
    got = greedy(model, name, prompt, n)
    if torch.equal(want, got):
        return ModeCheck(name, True, f"{n} greedy tokens identical to mode 1")
    row, pos = (int(i) for i in (want != got).nonzero()[0])
    return ModeCheck(name, False, f"differs from mode 1 at new token {pos}: "
                                  f"{int(got[row, pos])} instead of {int(want[row, pos])}")


def gate(model: GPT, name: str, batch: int = 1, n_tokens: int = 16, seed: int = 0) -> ModeCheck:
    """``check_mode`` on a short random prompt of up to 2 sequences."""
    if name == "uncached":
        return ModeCheck(name, True, "mode 1 is the reference")
    prompt_len = max(1, min(8, model.config.block_size - n_tokens))
    prompt = random_prompt(model, min(batch, 2), prompt_len, seed)
    n = min(n_tokens, model.config.block_size - prompt_len)
    try:
        return check_mode(model, name, prompt, n=n)
    except torch.OutOfMemoryError:
        raise  # not the mode's fault: the caller reports the sizes that did not fit
    except Exception as exc:  # a mode that crashes is as untrustworthy as a wrong one
        return ModeCheck(name, False, f"raised {type(exc).__name__}: {exc}")
