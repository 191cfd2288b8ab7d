"""What a family's gate against ``transformers`` shares: a small random model of transformers'
own class saved to a folder, and every decode mode the family is offered held to it.

  save_tiny(hf_class, config_class, folder, **fields) -> the transformers model saved there
  hf_greedy(hf, prompt, n) -> (tokens (B, n), logits (B, n, vocab))   transformers' own loop
  offered(family) -> our modes offered for the family on a CPU, with how each is built here
  gate_every_mode(state, hf, prompt, n) -> {mode: share of the largest logit it strayed by}
      every offered mode fed transformers' greedy tokens: an exact mode's logits within
      ``EXACT`` (1e-4) of the largest logit and its own greedy tokens equal to transformers';
      a lossy one's logits within its registered tolerance. Modes that need a GPU run their
      step uncaptured on the CPU (mode 6), and the compiled modes their step uncompiled
      (variant "eager": the same step; compiling takes minutes on 2 cores); the Triton step is
      tests/test_triton_step.py's (its interpreter is too slow for a whole gate here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine import modes
from engine.decoders import make_decoder
from engine.loop import decode
from instruments import lineup

EXACT = 1e-4  # fp32: an exact mode strays by float32 rounding only


def save_tiny(hf_class: Any, config_class: Any, folder: Path, seed: int = 0,
              **fields: Any) -> Any:
    """A random-initialised ``hf_class`` of ``config_class(**fields)`` saved with
    ``save_pretrained`` to ``folder`` (safetensors), in eval mode."""
    torch.manual_seed(seed)
    hf = hf_class(config_class(**fields)).eval()
    hf.save_pretrained(folder)
    return hf


@torch.no_grad()
def hf_greedy(hf: Any, prompt: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' greedy tokens (B, n) after ``prompt`` and the logits before each."""
    seq, rows = prompt, []
    for _ in range(n):
        logits = hf(seq).logits[:, -1].float()
        rows.append(logits)
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompt.size(1):], torch.stack(rows, dim=1)


def offered(family: str) -> list[str]:
    """Our modes offered for ``family`` (on any device), but the Triton step."""
    names = [m for m in lineup.mode_names() if modes.spec(m).runs(family)[0]]
    return [m for m in names if m != "triton"]


def _decoder(state: Any, mode: str, batch: int, capacity: int) -> Any:
    spec = modes.spec(mode)
    if spec.needs == "cuda":
        from engine.decoders.captured import CudaGraphDecoder

        return CudaGraphDecoder(state, batch_size=batch, capacity=capacity, capture=False)
    if spec.needs == "compiler":
        from engine.decoders.compiled import CompiledDecoder

        return CompiledDecoder(state, batch_size=batch, capacity=capacity, variant="eager")
    return make_decoder(state, mode, batch_size=batch, capacity=capacity)


@torch.no_grad()
def run_mode(state: Any, mode: str, prompt: torch.Tensor, feed: torch.Tensor | None,
             n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``mode``'s greedy tokens (B, n) after ``prompt`` (or ``feed`` forced in) and its logits."""
    dec = _decoder(state, mode, prompt.size(0), prompt.size(1) + n)
    gen = decode(dec, prompt, n, feed=feed, keep_logits=True)
    return gen.tokens, torch.stack(gen.logits, dim=1).float()


def gate_every_mode(state: Any, hf: Any, prompt: torch.Tensor, n: int,
                    names: list[str] | None = None) -> dict[str, float]:
    """Every offered mode against transformers (module docstring); the strays, by mode."""
    ref_tokens, ref_logits = hf_greedy(hf, prompt, n)
    scale = float(ref_logits.abs().max())
    strays: dict[str, float] = {}
    for mode in names or offered(state.model.config.family):
        spec = modes.spec(mode)
        lossy = spec.tolerance > 0
        tokens, logits = run_mode(state, mode, prompt, ref_tokens[:, :-1], n)
        strays[mode] = float((logits - ref_logits).abs().max()) / scale
        assert strays[mode] <= (spec.tolerance if lossy else EXACT), (mode, strays[mode])
        if not lossy:
            own, _ = run_mode(state, mode, prompt, None, n)
            assert torch.equal(own, ref_tokens), mode
    return strays
