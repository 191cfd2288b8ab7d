"""Peers hf_dynamic, hf_static and hf_compiled: the family's transformers model (the gate's
reference: ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ...) holding the loaded weights.

``HFDecoder(model, batch_size=1, capacity=None, threads=None, cache="dynamic" | "static")`` is
an adapter of ``instruments.peers`` (prefill / step / seek, logits (B, vocab) fp32 on the CPU).
The transformers model is a copy of the weights (``lineup.reference``), built once per model;
``extra_bytes`` is that copy. "dynamic" is transformers' default ``DynamicCache`` (grown every
step, cropped to seek); "static" a ``StaticCache`` of ``capacity`` rows: a step attends over
all of them under a mask (``attended_keys`` says so), and seeking back only moves its write
position (the rows after it are masked, then overwritten). "compiled" is
transformers' own fast path as its docs recommend it: the static cache and ``torch.compile(forward,
mode="reduce-overhead", fullgraph=True)`` for the one-token step (a CUDA graph on a GPU); a prefill
runs the plain forward into the same cache (each new prompt length would otherwise compile
again). Its compile is set-up (``compile_s``), done once per model when it is built. Threads:
the process's torch threads.
"""

from __future__ import annotations

import torch

from engine.models.base import CausalLM
from instruments.peers.built import Built, engine_for, hf_copy, tensor_bytes


def _build(model: CausalLM) -> Built:
    import transformers

    hf = hf_copy(model)
    return Built(hf, 0.0, tensor_bytes(hf), transformers.__version__)


def _build_compiled(model: CausalLM, capacity: int) -> Built:
    """The copy with its step compiled, warmed through a static cache until no call compiles
    (reduce-overhead records its CUDA graph on a later call), so no timed step ever does."""
    from transformers import StaticCache

    built = _build(model)
    hf = built.handle
    step = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    cache = StaticCache(config=hf.config, max_cache_len=capacity)
    dev = next(hf.parameters()).device
    ids = torch.zeros(1, 2, dtype=torch.long, device=dev)
    with torch.no_grad():
        hf(input_ids=ids, past_key_values=cache, use_cache=True,
           cache_position=torch.arange(2, device=dev), logits_to_keep=1)
        for i in range(2, 6):
            step(input_ids=ids[:, :1], past_key_values=cache, use_cache=True,
                 cache_position=torch.tensor([i], device=dev), logits_to_keep=1)
    built.state["step"] = step
    return built


class HFDecoder:
    appends = False  # one token per step through this adapter
    logits = "last"

    def __init__(self, model: CausalLM, *, batch_size: int = 1, capacity: int | None = None,
                 threads: int | None = None, cache: str = "dynamic") -> None:
        if cache not in ("dynamic", "static", "compiled"):
            raise ValueError(f"cache must be 'dynamic', 'static' or 'compiled', got {cache!r}")
        self.model, self.batch_size = model, batch_size
        self.capacity = capacity or model.config.block_size
        self.kind = "static" if cache == "compiled" else cache
        self.cache_kind = f"hf_{cache}"
        if cache == "compiled":  # one compiled step per model and capacity (its cache's shape)
            built = engine_for(model, ("hf", "compiled", self.capacity),
                               lambda: _build_compiled(model, self.capacity))
        else:
            built = engine_for(model, ("hf",), lambda: _build(model))
        self.hf = built.handle
        self.compiled = built.state.get("step")
        self.compile_s, self.extra_bytes, self.version = (built.compile_s, built.weight_bytes,
                                                          built.version)
        self.cache = None
        self.seq: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.seq is None else self.seq.size(1)

    def attended_keys(self, length: int) -> int:
        return self.capacity if self.kind == "static" else length

    def _new_cache(self) -> object:
        from transformers import DynamicCache, StaticCache

        if self.kind == "static":
            return StaticCache(config=self.hf.config, max_cache_len=self.capacity)
        return DynamicCache()

    def _run(self, ids: torch.Tensor) -> torch.Tensor:
        start = self.length
        if start + ids.size(1) > self.capacity and self.kind == "static":
            raise ValueError(f"the static cache holds {self.capacity} tokens; this call needs "
                             f"{start + ids.size(1)}")
        ids = ids.to(self.hf.device)  # the loop may hand back a token picked on the CPU
        pos = torch.arange(start, start + ids.size(1), device=ids.device)
        fn = self.compiled if self.compiled is not None and ids.size(1) == 1 else self.hf
        out = fn(input_ids=ids, past_key_values=self.cache, use_cache=True,
                 cache_position=pos, logits_to_keep=1)
        self.seq = ids if self.seq is None else torch.cat([self.seq, ids], dim=1)
        return out.logits[:, -1, :].float().cpu()

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        self.cache, self.seq = self._new_cache(), None
        return self._run(ids)

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        assert self.cache is not None, "prefill first"
        return self._run(token)

    @torch.no_grad()
    def seek(self, ids: torch.Tensor, length: int) -> None:
        """Hold exactly ``ids[:, :length]``: crop (dynamic) or move the write position back
        (static) when the held tokens start the same way, extend when fewer, else prefill."""
        if not 1 <= length <= ids.size(1):
            raise ValueError(f"seek length must be within 1..{ids.size(1)}, got {length}")
        held = self.length
        n = min(held, length)
        if held == 0 or not torch.equal(self.seq[:, :n], ids[:, :n]):  # type: ignore[index]
            self.prefill(ids[:, :length])
        elif held > length:
            if self.kind == "static":
                for layer in self.cache.layers:  # type: ignore[attr-defined]
                    layer.cumulative_length.fill_(length)  # where the next row is written
            else:
                self.cache.crop(length - held)  # type: ignore[attr-defined]
            self.seq = self.seq[:, :length]  # type: ignore[index]
        elif held < length:
            self._run(ids[:, held:length])
