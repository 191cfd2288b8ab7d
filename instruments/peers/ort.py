"""Peers ort_*: ONNX Runtime running transformers' GPT-2 exported with past keys/values.

Export: the loaded weights in transformers' ``GPT2LMHeadModel`` (``lineup.reference``; the peers'
table offers it for that architecture only), wrapped so the graph takes ``input_ids`` (B, T)
and, per layer, ``past_<i>_k`` / ``past_<i>_v`` (B, heads, P, head size) and returns the last
position's logits (B, vocab) and the presents (P + T rows). Exported by torch's TorchScript-based
ONNX exporter (``dynamo=False``): the package's own GPT-2 exporter
(``onnxruntime.transformers.models.gpt2``) passes past state as tuples, which transformers 5 no
longer takes, and torch's newer exporter needs ``onnxscript``; this one needs only the ``onnx``
package and keeps the past length dynamic. One export per model and precision, into a temporary
folder; ``extra_bytes`` is the size of what was written (the tied embedding is stored twice: as the
input embedding and as the output projection). The session runs every graph optimization, with
``intra_op_num_threads`` = the run's threads (its threads spin after a run, as ORT ships;
``KVLAB_ORT_SPIN=0`` stops that).

Steps feed the presents back as the next past: the graph concatenates the new key/value onto
what it is given (ONNX Runtime's usual GPT-2 past/present). ``seek`` crops the arrays on a CPU;
on CUDA (I/O binding, the past kept on the device as ORT values) it prefills again.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from engine.models.base import CausalLM
from instruments.lineup import PeerUnavailable
from instruments.peers.built import Built, engine_for, folder_bytes, hf_copy, temp_folder

OPSET = 17


class _Graph(torch.nn.Module):
    """GPT2LMHeadModel with its cache as plain tensors in and out (what the export traces)."""

    def __init__(self, hf: Any) -> None:
        super().__init__()
        self.hf, self.layers = hf, hf.config.n_layer

    def forward(self, input_ids: torch.Tensor, *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        cache = DynamicCache()
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.hf(input_ids=input_ids, past_key_values=cache, use_cache=True,
                      logits_to_keep=1)
        presents = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits[:, -1, :], *presents)


def names(layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_{i}_{kv}" for i in range(layers) for kv in "kv"]
    return past, [p.replace("past", "present") for p in past]


def _export(model: CausalLM, dtype: str, path: Any) -> None:
    import warnings

    cfg = model.config
    hf = hf_copy(model).to(getattr(torch, dtype))
    past, present = names(cfg.n_layer)
    ids = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    dummy = [torch.zeros(1, cfg.n_head, 2, cfg.head_dim, dtype=getattr(torch, dtype),
                         device=model.device) for _ in past]
    axes = {"input_ids": {0: "batch", 1: "tokens"}, "logits": {0: "batch"},
            **{n: {0: "batch", 2: "past"} for n in past},
            **{n: {0: "batch", 2: "total"} for n in present}}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporter's deprecation and tracer warnings
        torch.onnx.export(_Graph(hf), (ids, *dummy), str(path), dynamo=False,
                          input_names=["input_ids", *past], output_names=["logits", *present],
                          dynamic_axes=axes, opset_version=OPSET)


def _build(model: CausalLM, dtype: str, threads: int) -> Built:
    import onnxruntime as ort

    dev = model.device
    folder = temp_folder("ort")
    try:
        _export(model, dtype, folder / "model.onnx")
    except Exception as exc:
        raise PeerUnavailable(f"ONNX export failed: {type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                              ) from exc
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # ORT as it ships: its pool's threads spin for a while after each run (on the cores the
    # next engine of an interleaved round is timed on). KVLAB_ORT_SPIN=0 stops them; measured
    # at 1 thread it changed nobody's step beyond the rounds' noise.
    if os.environ.get("KVLAB_ORT_SPIN") == "0":
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if dev.type == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise PeerUnavailable("onnxruntime has no CUDA provider here; install with: "
                                  "pip install onnxruntime-gpu==1.32.0")
        providers: list[Any] = [("CUDAExecutionProvider", {"device_id": dev.index or 0})]
    else:
        providers = ["CPUExecutionProvider"]
    session = ort.InferenceSession(str(folder / "model.onnx"), so, providers=providers)
    return Built(session, 0.0, folder_bytes(folder), ort.__version__, folder)


class ORTDecoder:
    appends = False
    logits = "last"
    cache_kind = "ort_past"
    engine = "ort"  # the key its converted engine is kept under (per model)
    build = staticmethod(_build)

    def __init__(self, model: CausalLM, *, batch_size: int = 1, capacity: int | None = None,
                 threads: int | None = None, dtype: str = "float32") -> None:
        self.model, self.batch_size = model, batch_size
        self.capacity = capacity or model.config.block_size
        threads = threads or torch.get_num_threads()
        dev = model.device
        built = engine_for(model, (self.engine, dtype, threads, str(dev)),
                           lambda: self.build(model, dtype, threads))
        self.session = built.handle
        self.compile_s, self.extra_bytes, self.version = (built.compile_s, built.weight_bytes,
                                                          built.version)
        self.cuda = dev.type == "cuda"
        self.dtype = dtype
        self.past_names, self.present_names = names(model.config.n_layer)
        self.past: list[Any] = []
        self.seq: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.seq is None else self.seq.size(1)

    def attended_keys(self, length: int) -> int:
        return length

    def _empty(self) -> list[Any]:
        import numpy as np

        cfg = self.model.config
        shape = (self.batch_size, cfg.n_head, 0, cfg.head_dim)
        return [np.zeros(shape, dtype=self.dtype) for _ in self.past_names]

    def _run(self, ids: torch.Tensor) -> torch.Tensor:
        if self.length + ids.size(1) > self.model.config.block_size:
            raise ValueError(f"context of {self.length + ids.size(1)} tokens is beyond the "
                             f"model's limit of {self.model.config.block_size}")
        ids = ids.to("cpu", torch.long)
        feed = ids.numpy()
        if self.cuda:
            logits = self._run_bound(feed)
        else:
            out = self._infer(feed)
            logits, self.past = torch.from_numpy(out[0]), out[1:]  # host: peer logits
        self.seq = ids if self.seq is None else torch.cat([self.seq, ids], dim=1)
        return logits.float()

    def _infer(self, feed: Any) -> list[Any]:
        """[logits, presents...] as arrays, for ``input_ids`` and the held past."""
        return self.session.run(None, {"input_ids": feed,
                                       **dict(zip(self.past_names, self.past, strict=True))})

    def _run_bound(self, feed: Any) -> torch.Tensor:
        """CUDA: inputs and presents stay on the device (I/O binding); only logits come back."""
        import onnxruntime as ort

        index = self.model.device.index or 0
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", feed)
        for name, value in zip(self.past_names, self.past, strict=True):
            if not isinstance(value, ort.OrtValue):
                value = ort.OrtValue.ortvalue_from_numpy(value, "cuda", index)
            binding.bind_ortvalue_input(name, value)
        binding.bind_output("logits", "cpu")
        for name in self.present_names:
            binding.bind_output(name, "cuda", index)
        self.session.run_with_iobinding(binding)
        out = binding.get_outputs()
        self.past = list(out[1:])
        return torch.from_numpy(out[0].numpy())  # host: peer logits

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        self.past, self.seq = self._empty(), None
        return self._run(ids)

    @torch.no_grad()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        assert self.seq is not None, "prefill first"
        return self._run(token)

    @torch.no_grad()
    def seek(self, ids: torch.Tensor, length: int) -> None:
        """Hold ``ids[:, :length]``: crop the past (CPU), extend it, or prefill afresh."""
        import numpy as np

        if not 1 <= length <= ids.size(1):
            raise ValueError(f"seek length must be within 1..{ids.size(1)}, got {length}")
        held = self.length
        n = min(held, length)
        ids = ids.to("cpu")
        same = held > 0 and torch.equal(self.seq[:, :n].cpu(), ids[:, :n])  # type: ignore[index]
        if not same or (held > length and self.cuda):
            self.prefill(ids[:, :length])
        elif held > length:  # contiguous copies now, so the timed step does not make them
            self.past = [np.ascontiguousarray(p[:, :, :length]) for p in self.past]
            self.seq = self.seq[:, :length]  # type: ignore[index]
        elif held < length:
            self._run(ids[:, held:length])
