"""Our GPU kernels, in Triton: each module a kernel (or two), its launcher and its contract; each
tested on a CPU under ``TRITON_INTERPRET=1`` against torch (tests/test_triton_*.py), so none
waits for a GPU to be checked. Importing a module here needs ``triton`` (requirements-gpu.txt);
nothing on a CPU imports them outside those tests.

  decode_attention   one query per sequence over the filled rows of a KV cache, split over the
                     cache and merged (flash-decoding), grouped-query heads; contiguous or
                     paged (rows addressed through a block table)
  paged_prefill      several new queries per sequence over a paged cache, causally (a prefill,
                     an append)
  linear             a product with its norm, bias, activation, residual (or the attention's
                     merge) folded in; weights dense or GGUF Q8_0 / Q4_1 blocks as stored
  qkv                q|k|v with the norm, bias, RoPE and the cache write folded in
  embed              the token's row (and GPT-2's position) of a dense or block table

``triton_usable(device)`` says whether these kernels compile for ``device`` here (a CUDA device
and ``triton`` installed), without importing triton.
"""

from __future__ import annotations

import importlib.util

import torch


def triton_usable(device: torch.device | str) -> bool:
    """Whether the Triton kernels compile for ``device``: a CUDA GPU with ``triton`` installed."""
    return torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None
