"""Speculative decoding, greedy and exact: draft by prompt lookup, verify in one multi-token append.

``speculative_decode(decoder, prompt, n, k)`` returns a ``Speculation`` whose ``tokens`` (1, n)
are plain greedy decoding's (``engine.loop.decode`` with the same mode) token for token, made
with fewer forwards when the drafts are right:

  1. prefill the prompt; its argmax is the first new token (as ``decode`` does)
  2. draft up to ``k`` tokens by prompt lookup (``propose``): the longest n-gram (``ngram``
     tokens down to 1) ending the text so far that occurred before, in the prompt or in what
     was generated, and the tokens that followed it there. No second model.
  3. verify: one ``decoder.append([last token] + draft)`` gives the greedy choice after every
     prefix of the draft at once; keep the longest prefix of the draft that agrees with those
     choices, plus the choice after it (so every forward yields at least one token), and
     ``decoder.rewind`` the cache to drop the rejected rows. No draft found: a plain step.
Steps 2 and 3 outside the forward are ``draft_feed`` and ``keep`` (the experiment times them
apart with the same calls). A draft never runs past ``n``: the output is exactly ``n`` tokens.
Batch 1 only (each sequence would accept a different number of tokens).

Exactness: the verified logits come from a forward over several new tokens; its matmuls may
round differently from a single step's (a few 1e-7 of the logits in fp32), so a choice
between two logits closer than that could differ from the plain loop's. The tests compare the
two token for token on a trained model and on random weights.

The decoder must take several tokens at once (``decoder.appends``: modes 1-5, 10-13).
``Speculation.forwards`` keeps each verify forward (context held before it, tokens drafted and
accepted) for the acceptance rate and the predicted speedup (``instruments.experiments.
speculate``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import Decoder


@dataclass(frozen=True)
class Forward:
    context_len: int  # tokens the decoder held before this forward
    drafted: int  # draft tokens verified (0: a plain step)
    accepted: int  # of them, how many agreed with the greedy choice


@dataclass
class Speculation:
    tokens: torch.Tensor  # (1, n): the greedy tokens, prompt excluded
    forwards: list[Forward] = field(default_factory=list)  # after the prefill, in order
    stopped_early: bool = False

    @property
    def drafted(self) -> int:
        return sum(f.drafted for f in self.forwards)

    @property
    def accepted(self) -> int:
        return sum(f.accepted for f in self.forwards)

    @property
    def acceptance(self) -> float | None:
        """Share of drafted tokens accepted (None when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_forward(self) -> float | None:
        """New tokens per forward after the prefill (1.0 = plain decoding)."""
        if not self.forwards:
            return None
        return (self.tokens.size(1) - 1) / len(self.forwards)


def propose(history: torch.Tensor, k: int, ngram: int = 3) -> list[int]:
    """Up to ``k`` draft tokens: what followed an earlier occurrence of the longest n-gram
    (``ngram`` tokens down to 1) that ends ``history`` (1-D ids). Of the occurrences, the most
    recent one followed by ``k`` tokens, else the one followed by the most; [] if none."""
    length = history.numel()
    if k < 1:
        return []
    for n in range(min(ngram, length - 1), 0, -1):
        suffix = history[length - n :]
        windows = history[: length - 1].unfold(0, n, 1)  # starts 0 .. length - 1 - n
        starts = (windows == suffix).all(dim=1).nonzero().flatten()
        if starts.numel() == 0:
            continue
        full = starts[starts + n + k <= length]
        j = int(full[-1]) if full.numel() else int(starts[0])
        return history[j + n : j + n + k].tolist()
    return []


def draft_feed(history: torch.Tensor, size: int, most: int, ngram: int,
               device: torch.device | str = "cpu") -> tuple[list[int], torch.Tensor]:
    """The draft after ``history[:size]`` (up to ``most`` tokens, ``propose``) and what one
    verify forward feeds: the last token and the draft, (1, 1 + d) on ``device``."""
    draft = propose(history[:size], most, ngram)
    return draft, torch.tensor([[int(history[size - 1]), *draft]], dtype=torch.long,
                               device=device)


def keep(draft: list[int], rows: torch.Tensor, history: torch.Tensor, size: int
         ) -> tuple[int, int]:
    """Of ``draft``, the longest prefix that agrees with the greedy choice of each of ``rows``
    (1 + d, vocab) logits, plus the choice after it, written into ``history`` at ``size``;
    (tokens of the draft accepted, tokens written)."""
    choices = rows.argmax(dim=-1).tolist()  # (1 + d,)
    agreed = 0
    while agreed < len(draft) and draft[agreed] == choices[agreed]:
        agreed += 1
    new = [*draft[:agreed], choices[agreed]]
    history[size : size + len(new)] = torch.tensor(new)  # host: ids searched
    return agreed, len(new)


@torch.no_grad()
def speculative_decode(
    decoder: Decoder,
    prompt: torch.Tensor,
    n: int,
    k: int,
    *,
    ngram: int = 3,
    should_stop: Callable[[], bool] | None = None,
) -> Speculation:
    """``n`` greedy tokens after ``prompt`` (1, T), drafts of up to ``k`` tokens verified in
    one append each (see the module docstring)."""
    if prompt.dim() != 2 or prompt.size(0) != 1:
        raise ValueError(f"speculative decoding takes one sequence, got a prompt of shape "
                         f"{tuple(prompt.shape)}; allowed: (1, T)")
    if not getattr(decoder, "appends", False):
        raise ValueError(f"{type(decoder).__name__} takes one token per step; speculative "
                         "decoding needs a mode that appends several at once")
    if k < 0 or n < 1:
        raise ValueError(f"need n >= 1 new tokens and a draft length k >= 0, got n={n}, k={k}")
    dev = prompt.device
    # The prompt and every token so far, on the CPU: drafting is a search over token ids.
    history = torch.empty(prompt.size(1) + n, dtype=torch.long)  # host: see above
    history[: prompt.size(1)] = prompt[0].cpu()
    size = prompt.size(1)
    first = int(decoder.prefill(prompt).argmax(dim=-1)[0])
    history[size] = first
    size += 1
    out = Speculation(tokens=prompt.new_empty(1, 0))
    while size - prompt.size(1) < n:
        if should_stop is not None and should_stop():
            out.stopped_early = True
            break
        room = n - (size - prompt.size(1))  # tokens still to make; a forward makes <= d + 1
        draft, feed = draft_feed(history, size, min(k, room - 1), ngram, dev)
        held = decoder.length
        rows = decoder.append(feed)[0] if draft else decoder.step(feed)  # (1 + d, vocab)
        agreed, made = keep(draft, rows, history, size)
        if agreed < len(draft):
            decoder.rewind(held + 1 + agreed)  # drop the rows of the rejected draft tokens
        size += made
        out.forwards.append(Forward(held, len(draft), agreed))
    out.tokens = history[prompt.size(1) : size].unsqueeze(0).to(dev)
    return out
