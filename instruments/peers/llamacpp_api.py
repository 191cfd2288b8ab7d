"""llama.cpp's C API as the llamacpp_* peers call it, without torch (a probe's child imports it).

``import_llama_cpp()`` the ``llama_cpp.llama_cpp`` bindings, initialised once, llama.cpp's log
kept (not printed) for ``last_error()`` and ``log()``; ``load(api, path)`` a GGUF file on the CPU;
``new_context(api, handle, capacity, threads)`` a context as the adapter
(``instruments.peers.llamacpp``) holds one: ``n_ctx`` = capacity, batch size 1, the run's threads,
an fp32 KV cache and flash attention off (that module's docstring says why);
``probe_file(path, threads)`` what ``instruments.peers.native.probe`` runs in a child process
before the measuring process loads the file: a load, a decode of 8 tokens, then 2 one at a time
-- the calls a gate makes first, where the AMX build crashed (ggml-org/llama.cpp#20824). Failures
raise ``PeerUnavailable`` with llama.cpp's own last error.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import sys
from pathlib import Path
from typing import Any

from instruments.lineup import PeerUnavailable

_LOG: collections.deque[str] = collections.deque(maxlen=40)  # llama.cpp's last log lines
_CALLBACK: Any = None  # the log callback handed to llama.cpp (kept alive here)
PROBE_TOKENS = (8, 1, 1)  # a probe's decodes: a prompt, then single steps


def import_llama_cpp() -> Any:
    """The ``llama_cpp.llama_cpp`` bindings, initialised once, llama.cpp's log kept (not
    printed) for the reasons a load fails."""
    global _CALLBACK
    import llama_cpp
    import llama_cpp.llama_cpp as api

    if _CALLBACK is None:
        @api.llama_log_callback
        def keep(level: int, text: bytes, user_data: Any) -> None:
            _LOG.append(text.decode("utf-8", errors="replace"))

        _CALLBACK = keep
        api.llama_log_set(keep, ctypes.c_void_p(0))
        api.llama_backend_init()
    api.version = llama_cpp.__version__
    return api


def log() -> list[str]:
    """llama.cpp's last log lines, oldest first (its load says which buffer types it used)."""
    return [s.strip() for s in _LOG if s.strip()]


def last_error() -> str:
    lines = log()
    bad = [s for s in lines if "error" in s.lower() or "failed" in s.lower()]
    return (bad or lines or ["no reason given"])[-1]


def load(api: Any, path: Path) -> Any:
    """The model handle of GGUF file ``path``, on the CPU."""
    params = api.llama_model_default_params()
    params.n_gpu_layers = 0
    handle = api.llama_model_load_from_file(str(path).encode(), params)
    if not handle:
        raise PeerUnavailable(f"llama.cpp could not load {path.name}: {last_error()}")
    return handle


def new_context(api: Any, handle: Any, capacity: int, threads: int) -> tuple[Any, int]:
    """(a context of ``capacity`` tokens over ``handle``, its n_batch)."""
    params = api.llama_context_default_params()
    params.n_ctx = capacity
    params.n_batch = params.n_ubatch = min(capacity, 512)
    params.n_seq_max = 1
    params.n_threads = params.n_threads_batch = threads
    params.type_k = params.type_v = api.GGML_TYPE_F32  # see instruments.peers.llamacpp
    params.flash_attn_type = api.LLAMA_FLASH_ATTN_TYPE_DISABLED
    params.no_perf = True
    ctx = api.llama_init_from_model(handle, params)
    if not ctx:
        raise PeerUnavailable(f"llama.cpp could not make a context of {capacity} tokens: "
                              f"{last_error()}")
    return ctx, int(params.n_batch)


def decode(api: Any, ctx: Any, tokens: list[int]) -> None:
    """One ``llama_decode`` of ``tokens`` after those the context holds (at most n_batch)."""
    arr = (api.llama_token * len(tokens))(*tokens)
    rc = api.llama_decode(ctx, api.llama_batch_get_one(arr, len(tokens)))
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}: {last_error()}")


def probe_file(path: str, threads: str) -> None:
    """A probe's child: load ``path``, decode ``PROBE_TOKENS``, read the last logits."""
    api = import_llama_cpp()
    handle = load(api, Path(path))
    ctx, _ = new_context(api, handle, 2 * sum(PROBE_TOKENS), int(threads))
    start = 1  # token ids 1..10: within every vocabulary
    for n in PROBE_TOKENS:
        decode(api, ctx, list(range(start, start + n)))
        start += n
    if not api.llama_get_logits_ith(ctx, -1):
        raise RuntimeError(f"llama.cpp gave no logits: {last_error()}")
    api.llama_free(ctx)
    api.llama_model_free(handle)


class Context:
    """An owner of a llama.cpp context (``self.api``, ``self.ctx``): ``close`` frees it once, and
    one collected unclosed closes itself (never while the interpreter shuts down)."""

    api: Any
    ctx: Any

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.api.llama_free(self.ctx)
            self.ctx = None

    def __del__(self) -> None:
        if sys.is_finalizing():
            return
        with contextlib.suppress(Exception):
            self.close()
