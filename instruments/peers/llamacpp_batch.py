"""llama.cpp's batched decode as the serving peer calls it, without torch (a probe's child
imports it).

``Batched(api, handle, seqs=C, seq_tokens=T, threads=n)`` is one context over a loaded model
(``llamacpp_api.load``) that holds ``C`` sequences of up to ``T`` tokens each, as llama-server's
``--parallel C`` does:
  n_seq_max   C, each sequence its own id 0..C-1 (a slot)
  n_ctx       C x T, kv_unified off: each sequence gets its own T cells. The sequences of a
              serving workload share no prefix, and llama.cpp's own note on kv_unified says a
              unified buffer then costs time: every token's attention would be masked over
              every sequence's cells
  n_batch     max(C, T) = n_ubatch: a step's C tokens, or a whole prompt, in one ubatch, so a
              step is one graph and is timed as one
  KV cache    fp32, flash attention off (``instruments.peers.llamacpp`` says why)
Its calls, all greedy (argmax of the full vocabulary's logits, read with
``llama_get_logits_ith``):
  ``prefill(seq, ids)`` -> the first token: one ``llama_decode`` of a ``llama_batch`` holding the
                           prompt's tokens at positions 0.., all of sequence ``seq``, logits
                           kept for the last one only
  ``step([(seq, token, pos), ...])`` -> the next token of each: one ``llama_decode`` of a batch
                           of one token per live sequence, each with its own id and position,
                           logits kept for every one
  ``clear(seq)``           the sequence's cells freed (``llama_memory_seq_rm``) for its next
                           request
``probe_batched(path, threads)``: what ``native.probe`` runs in a child process before the
measuring process decodes batches (llama.cpp's multi-sequence path is other code than one
sequence's): a context of 4 sequences, 4 prompts, two steps of 4 tokens. Failures raise
``PeerUnavailable`` (a context llama.cpp refuses) or ``RuntimeError`` (a decode's nonzero
return), each with llama.cpp's own last error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from instruments.lineup import PeerUnavailable
from instruments.peers.llamacpp_api import Context, import_llama_cpp, last_error, load

MAX_SEQS = 256  # llama.cpp's LLAMA_MAX_SEQ (src/llama-cparams.h): n_seq_max above it is refused


class Batched(Context):
    def __init__(self, api: Any, handle: Any, *, seqs: int, seq_tokens: int,
                 threads: int) -> None:
        if not 1 <= seqs <= MAX_SEQS:
            raise ValueError(f"llama.cpp holds 1..{MAX_SEQS} sequences in a context, "
                             f"asked for {seqs}")
        self.api, self.seqs, self.seq_tokens = api, seqs, seq_tokens
        params = api.llama_context_default_params()
        params.n_ctx = seqs * seq_tokens
        params.n_batch = params.n_ubatch = max(seqs, seq_tokens)
        params.n_seq_max = seqs
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = threads
        params.type_k = params.type_v = api.GGML_TYPE_F32
        params.flash_attn_type = api.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        self.ctx = api.llama_init_from_model(handle, params)
        if not self.ctx:
            raise PeerUnavailable(f"llama.cpp could not make a context of {seqs} sequences x "
                                  f"{seq_tokens} tokens: {last_error()}")
        per_seq = int(api.llama_n_ctx_seq(self.ctx))
        if per_seq < seq_tokens:  # llama.cpp rounds n_ctx; a sequence must still fit
            self.close()
            raise PeerUnavailable(f"llama.cpp gave each of {seqs} sequences {per_seq} cells, "
                                  f"fewer than the {seq_tokens} a request needs")
        self.n_batch = max(seqs, seq_tokens)
        self.batch = api.llama_batch_init(self.n_batch, 0, 1)
        self.memory = api.llama_get_memory(self.ctx)
        self.n_vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(handle))

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of ``entries``: (seq, token, position, keep its logits)."""
        if not 1 <= len(entries) <= self.n_batch:
            raise ValueError(f"a batch holds 1..{self.n_batch} tokens, got {len(entries)}")
        b = self.batch
        b.n_tokens = len(entries)
        for i, (seq, token, pos, keep) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, int(keep)
        rc = self.api.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}: {last_error()}")

    def _argmax(self, i: int) -> int:
        ptr = self.api.llama_get_logits_ith(self.ctx, i)
        if not ptr:
            raise RuntimeError(f"llama.cpp gave no logits for batch row {i}: {last_error()}")
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def prefill(self, seq: int, ids: list[int]) -> int:
        if len(ids) > self.seq_tokens:
            raise ValueError(f"a prompt of {len(ids)} tokens is beyond a sequence's "
                             f"{self.seq_tokens}")
        last = len(ids) - 1
        self._decode([(seq, t, p, p == last) for p, t in enumerate(ids)])
        return self._argmax(last)

    def step(self, live: list[tuple[int, int, int]]) -> list[int]:
        self._decode([(seq, token, pos, True) for seq, token, pos in live])
        return [self._argmax(i) for i in range(len(live))]

    def clear(self, seq: int) -> None:
        if not self.api.llama_memory_seq_rm(self.memory, seq, -1, -1):
            raise RuntimeError(f"llama.cpp could not free sequence {seq}'s cells")

    def close(self) -> None:
        if getattr(self, "batch", None) is not None:
            self.api.llama_batch_free(self.batch)
            self.batch = None
        super().close()


def probe_batched(path: str, threads: str) -> None:
    """A probe's child: load ``path``, then 4 sequences prefilled and stepped twice together."""
    api = import_llama_cpp()
    handle = load(api, Path(path))
    dec = Batched(api, handle, seqs=4, seq_tokens=16, threads=int(threads))
    # prompts of ids 1..11 (within every vocabulary); each step feeds the argmaxes back
    live = [(s, dec.prefill(s, list(range(1 + s, 9 + s))), 8) for s in range(4)]
    for _ in range(2):
        live = [(s, t, p + 1) for (s, _, p), t in zip(live, dec.step(live), strict=True)]
    dec.clear(0)
    dec.close()
    api.llama_model_free(handle)
