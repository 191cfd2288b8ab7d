"""Peers ct2_*: CTranslate2 converted from the loaded weights, stepped through its own loop.

Conversion: the weights go into the family's transformers model (``lineup.reference``: a
``GPT2LMHeadModel``, a ``LlamaForCausalLM``, ...); its config is saved to a temporary folder and
CTranslate2's Transformers converter reads the model from memory, with a vocabulary of numbered
placeholders (ids are all we feed it, and a token's name is only how CTranslate2 maps it back to
its id): no tokenizer is read, nothing is downloaded. One folder per precision
(``quantization`` = the peer's compute type), so the bytes of ``model.bin`` are the bytes of
weights the engine holds. ``intra_threads`` = the run's threads. Batch size 1.

Steps: CTranslate2's Python API has no KV cache to hold between calls, so the adapter keeps one
of its generations paused: the generation's callback (run in CTranslate2's worker thread after
every token) waits until ``step`` lets it go on. The held tokens are given as a static prompt
(forwarded at once) plus the last one or two tokens as start tokens that the loop is constrained
to follow; the loop then feeds its own greedy pick. ``step(token)`` when ``token`` is what the
loop feeds next is one step of CTranslate2's decoding loop (the KV cache it keeps, the logits it
returns with ``return_logits_vocab``), timed like any step. Another token (teacher forcing, the
gate) starts a new generation from the held tokens: correct logits, at a prefill's cost.
``seek(ids, t)`` starts one whose next step feeds ``ids[:, t]``, so the sweep's timed step is
a true loop step at its context; the state after the static prompt is cached by CTranslate2
(``cache_static_prompt``) so re-seeking the same context is cheap. Closing a generation (and
every paused one at exit) waits until the engine holds no batch: its result lands first.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import glob
import importlib.util
import os
import sys
import threading
import time
import weakref
from typing import Any

import torch

from engine.models.base import CausalLM
from instruments.lineup import PeerUnavailable
from instruments.peers.built import Built, engine_for, folder_bytes, hf_copy, temp_folder

_HELD: list[ctypes.CDLL] = []  # the library loaded with its own bindings, kept loaded


def import_ctranslate2() -> Any:
    """``import ctranslate2``, its library bound to the OpenMP runtime its wheel bundles.

    Why: torch has put its own libgomp in the process's global scope, and the dynamic linker
    binds CTranslate2's OpenMP calls to that one, not to the copy CTranslate2 ships. Its worker
    thread then runs a second team in torch's runtime: four managed threads on a 2-core machine,
    more than the CPUs, so libgomp stops spinning between parallel regions for every team, ours
    included. Measured on the 2-core Xeon at 2 threads: after one CTranslate2 step, a 1.5 MB
    matrix-vector product of ours went from 0.013 to 0.081 ms and stayed there, and mode 8's
    step from 19 to 25 ms. Loaded first with ``RTLD_DEEPBIND``, the library looks in its own
    dependencies before the global scope, and neither engine slows the other."""
    if "ctranslate2" not in sys.modules and hasattr(os, "RTLD_DEEPBIND"):
        spec = importlib.util.find_spec("ctranslate2")
        if spec is not None and spec.origin:
            site = os.path.dirname(os.path.dirname(spec.origin))
            for lib in sorted(glob.glob(os.path.join(site, "ctranslate2.libs",
                                                     "libctranslate2*.so*"))):
                with contextlib.suppress(OSError):  # then the plain import binds as it can
                    _HELD.append(ctypes.CDLL(lib, mode=os.RTLD_NOW | os.RTLD_DEEPBIND))
    import ctranslate2

    return ctranslate2


CLOSE_S = 5.0  # the longest a closed generation's batch is waited for
IDLE_S = 60.0  # a paused generation nobody steps for this long is ended (frees the worker)
EOS = "<|endoftext|>"


@functools.lru_cache(maxsize=2)
def vocabulary(size: int) -> tuple[str, ...]:
    """Token names by id: '<id>', the last one the end-of-text token CTranslate2 is told of."""
    return (*(f"<{i}>" for i in range(size - 1)), EOS)


class _Vocab:
    """The little of a tokenizer CTranslate2's Transformers loaders read."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.bos_token = self.eos_token = self.unk_token = names[-1]

    def get_vocab(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}


def _build(model: CausalLM, compute_type: str, threads: int) -> Built:
    ctranslate2 = import_ctranslate2()
    from ctranslate2.converters.transformers import TransformersConverter

    hf = hf_copy(model).to("cpu").float()
    names = vocabulary(model.config.vocab_size)

    class FromMemory(TransformersConverter):
        def load_model(self, model_class: Any, path: str, **kwargs: Any) -> Any:
            return hf

        def load_tokenizer(self, tokenizer_class: Any, path: str, **kwargs: Any) -> Any:
            return _Vocab(names)

    folder = temp_folder("ct2")
    try:
        hf.config.save_pretrained(folder)
        out = FromMemory(str(folder)).convert(str(folder / "model"), quantization=compute_type,
                                              force=True)
        dev = model.device
        gen = ctranslate2.Generator(out, device=dev.type, device_index=dev.index or 0,
                                    compute_type=compute_type, intra_threads=threads)
    except Exception as exc:
        raise PeerUnavailable(f"CTranslate2 conversion failed: {type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                              ) from exc
    built = Built(gen, 0.0, folder_bytes(folder / "model"), ctranslate2.__version__, folder)
    built.state["names"] = names
    built.state["close"] = lambda: _stop(built)
    return built


def _stop(built: Built) -> None:
    stream = built.state.pop("stream", None)
    if stream is not None:
        stream.close()


def _logits(storage: Any) -> torch.Tensor:
    """A StorageView of logits as a (1, vocab) fp32 CPU tensor (copied: it dies after)."""
    if getattr(storage, "device", "cpu") == "cuda":
        return torch.as_tensor(storage, device="cuda").float().cpu().reshape(1, -1)
    import numpy as np

    return torch.from_numpy(np.array(storage, dtype=np.float32)).reshape(1, -1)  # host: peer logits


_OPEN: weakref.WeakSet[_Stream] = weakref.WeakSet()  # paused generations not yet ended


@atexit.register
def _end_open_streams() -> None:
    """End every paused generation before the interpreter shuts down: CTranslate2 joins its
    worker, which waits inside our Python callback, and a join during finalisation aborts the
    process ("Fatal Python error: PyThreadState_Get")."""
    for stream in list(_OPEN):
        stream.close()


class _Stream:
    """One CTranslate2 generation, paused after each token until ``advance`` (see above)."""

    def __init__(self, built: Built, held: list[int], ahead: int | None, max_length: int,
                 cache_prompt: bool) -> None:
        names = built.state["names"]
        self._go, self._got = threading.Event(), threading.Event()
        self.stopping = self.ended = False
        self.next_token: int | None = None
        self.logits: torch.Tensor | None = None
        self.held = list(held)
        self._engine = built.handle
        start = held[-1:] + ([ahead] if ahead is not None else [])
        static = [names[t] for t in held[:-1]] or None
        self.result = built.handle.generate_batch(
            [[names[t] for t in start]], static_prompt=static, cache_static_prompt=cache_prompt,
            include_prompt_in_result=True, max_length=max_length, end_token=[],
            return_logits_vocab=True, beam_size=1, sampling_topk=1, asynchronous=True,
            callback=self._on_token)[0]
        _OPEN.add(self)
        self._wait()  # the logits after the held tokens

    def _on_token(self, step: Any) -> bool:  # CTranslate2's worker thread
        self.logits = _logits(step.logits)
        self.next_token = int(step.token_id)  # what the loop feeds next
        self.ended = bool(step.is_last)
        self._got.set()
        if not self._go.wait(IDLE_S):
            self.ended = True
            return True
        self._go.clear()
        return self.stopping

    def _wait(self) -> None:
        while not self._got.wait(0.05):
            if self.result.done():
                self.ended = True
                self.result.result()  # raises what went wrong
                raise RuntimeError("CTranslate2's generation ended before its next token")
        self._got.clear()

    def advance(self) -> torch.Tensor:
        """One step of the loop: feeds ``next_token``; the logits after it."""
        assert self.next_token is not None
        self.held.append(self.next_token)
        self._go.set()
        self._wait()
        return self.logits  # type: ignore[return-value]

    def close(self) -> None:
        if not self.ended:
            self.stopping = True
            self._go.set()
        with contextlib.suppress(Exception):  # ending it is all we wanted
            self.result.result()
        # The result lands before the worker has let the batch go: an exit in between aborted
        # the process ("terminate called without an active exception", 4 exits in 12), so the
        # generation is ended once the engine says no batch is left (bounded: never a hang).
        end = time.monotonic() + CLOSE_S
        while (self._engine.num_active_batches or self._engine.num_queued_batches) \
                and time.monotonic() < end:
            time.sleep(0.001)
        self.ended = True


class CT2Decoder:
    appends = False
    logits = "last"
    cache_kind = "ct2"

    def __init__(self, model: CausalLM, *, batch_size: int = 1, capacity: int | None = None,
                 threads: int | None = None, compute_type: str = "float32") -> None:
        if batch_size != 1:
            raise ValueError("CTranslate2 peers run at batch size 1 here (one paused "
                             "generation per adapter)")
        self.model, self.batch_size = model, batch_size
        self.capacity = capacity or model.config.block_size
        threads = threads or torch.get_num_threads()
        self.built = engine_for(model, ("ct2", compute_type, threads),
                                lambda: _build(model, compute_type, threads))
        self.compile_s, self.extra_bytes, self.version = (self.built.compile_s,
                                                          self.built.weight_bytes,
                                                          self.built.version)
        self.refills = 0  # steps that had to start a new generation (a token not its own)
        self._stream: _Stream | None = None

    @property
    def length(self) -> int:
        return 0 if self._stream is None else len(self._stream.held)

    def attended_keys(self, length: int) -> int:
        return length

    def _start(self, held: list[int], ahead: int | None = None, cache: bool = False) -> _Stream:
        if len(held) + (ahead is not None) > self.model.config.block_size:
            raise ValueError(f"context of {len(held) + 1} tokens is beyond the model's limit "
                             f"of {self.model.config.block_size}")
        _stop(self.built)  # one live generation per engine: its worker serves one at a time
        room = self.model.config.block_size - len(held) + 2
        self._stream = _Stream(self.built, held, ahead, room, cache)
        self.built.state["stream"] = self._stream
        return self._stream

    def _live(self) -> _Stream | None:
        s = self._stream
        ok = s is not None and not s.ended and self.built.state.get("stream") is s
        return s if ok else None

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return self._start(ids[0].tolist()).logits  # type: ignore[return-value]

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        assert self._stream is not None, "prefill first"
        tok = int(token[0, 0])
        live = self._live()
        if live is not None and live.next_token == tok:
            return live.advance()
        self.refills += 1
        return self._start([*self._stream.held, tok]).logits  # type: ignore[return-value]

    @torch.no_grad()
    def seek(self, ids: torch.Tensor, length: int) -> None:
        """Hold ``ids[:, :length]`` with a paused generation whose next step feeds
        ``ids[:, length]`` (when given): a new generation each time, from the cached state
        after the static prompt."""
        if not 1 <= length <= ids.size(1):
            raise ValueError(f"seek length must be within 1..{ids.size(1)}, got {length}")
        row = ids[0].tolist()
        ahead = row[length] if length < len(row) else None
        self._start(row[:length], ahead, cache=True)

    def close(self) -> None:
        if self._live() is not None:
            _stop(self.built)

    def __del__(self) -> None:
        if sys.is_finalizing():  # CTranslate2's threads cannot be joined from here any more
            return
        with contextlib.suppress(Exception):
            self.close()
