"""Getting weights into our GPT-2: OpenAI's through ``transformers``, a local folder, or random.

``read(preset, weights, device=..., dtype=..., mask=..., hub_id=None) -> (model, label)`` is the
GPT-2 family's reader of its own weights (``engine.families.load`` is the one entry point for
every family: ``families.load("gpt2", "pretrained", hub_id=...)``); what every family's loading
does -- test shapes, random weights, the fallback of "auto", the provenance -- is
``engine.models.loader.load_preset``'s; here is where GPT-2's own weights come from.
``weights`` is "random" (seeded, real shapes), "pretrained" (hub id = the preset name, or
``hub_id``), or "auto" (pretrained if it can be had quickly, else random); a local checkpoint
folder is read by ``engine.models.checkpoint`` (never unpickled), through
``checkpoint_names`` / ``from_checkpoint`` here. Failures raise ``WeightsError`` with a message
that says what to do. ``gguf_config`` / ``gguf_param`` / ``gguf_rows`` read a ``gpt2`` GGUF file
(llama.cpp's names); ``gguf_layout(model)`` is their inverse, what ``instruments.peers.gguf_out``
writes.

``to_transformers(model)`` is the reference the gate compares with: a ``GPT2LMHeadModel``
holding our weights (Conv1D weights transposed).
"""

from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from ..config import GPTConfig
from ..gguf import GGUFLayout, float_params
from ..loader import WeightsError
from .model import GPT
from .tokenizer import VOCAB, bpe_table

WEIGHT_CHOICES = ("auto", "pretrained", "random")
# transformers' GPT-2 uses Conv1D, whose weight is stored [in, out]: the transpose of nn.Linear.
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

def config_from_hf(hf_config: object, mask: str = "none") -> GPTConfig:
    return GPTConfig(
        n_layer=hf_config.n_layer,  # type: ignore[attr-defined]
        n_head=hf_config.n_head,  # type: ignore[attr-defined]
        n_embd=hf_config.n_embd,  # type: ignore[attr-defined]
        block_size=hf_config.n_positions,  # type: ignore[attr-defined]
        vocab_size=hf_config.vocab_size,  # type: ignore[attr-defined]
        mask=mask,
    )


def gpt_from_transformers(
    hf_model: nn.Module,
    *,
    mask: str = "none",
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> GPT:
    """Copy a ``GPT2LMHeadModel``'s weights into a new GPT (Conv1D weights transposed)."""
    cfg = config_from_hf(hf_model.config, mask)
    src = {k: v for k, v in hf_model.state_dict().items() if not k.endswith((".attn.bias",
                                                                              ".masked_bias"))}
    some = next(iter(src.values()))
    model = GPT.empty(cfg, device or some.device, dtype or some.dtype)
    dst = model.state_dict()
    missing = [k for k in dst if k not in src and k != "lm_head.weight"]
    if missing:
        raise WeightsError(
            f"checkpoint lacks {len(missing)} GPT-2 tensors (first: {missing[0]}); "
            "is it a GPT2LMHeadModel checkpoint?"
        )
    with torch.no_grad():
        for name, target in dst.items():
            if name == "lm_head.weight":
                continue  # tied to wte
            value = src[name]
            if name.endswith(_CONV1D):
                value = value.t()
            if value.shape != target.shape:
                raise WeightsError(
                    f"{name}: checkpoint shape {tuple(value.shape)} does not fit the model's "
                    f"{tuple(target.shape)}"
                )
            target.copy_(value)
    return model.eval()


def _hub_reachable(timeout_s: float = 2.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True"):
        return False
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def _cached(source: str) -> bool:
    """Whether the Hugging Face cache holds ``source``'s config, so that "auto" with no copy and
    no network falls back to random weights without importing transformers' GPT-2 (5 s of a
    measuring process's start on a 2-core CPU). The hub's folder for ``source`` is looked for
    first (where the hub's own settings put it): where it is missing, the hub's file functions
    are not imported (0.3 s more)."""
    if os.environ.get("TRANSFORMERS_CACHE"):  # a cache of transformers' own: let it look
        return True
    try:
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:  # pragma: no cover - a dependency of transformers
        return True  # cannot tell: let transformers look
    if not os.path.isdir(os.path.join(HF_HUB_CACHE, "models--" + source.replace("/", "--"))):
        return False
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(source, "config.json"), str)


def _from_pretrained(source: str, *, local_only: bool) -> nn.Module:
    try:
        from transformers import GPT2LMHeadModel
    except ImportError as exc:  # pragma: no cover - transformers is a requirement
        raise WeightsError("the transformers package is needed to load pretrained weights") from exc
    try:
        return GPT2LMHeadModel.from_pretrained(
            source, local_files_only=local_only, use_safetensors=True
        )
    except Exception as exc:  # transformers raises OSError, ValueError, HTTP errors...
        raise WeightsError(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)) \
            from exc


def read(preset: Any, weights: str, *, device: str | torch.device, dtype: torch.dtype,
         mask: str, hub_id: str | None = None) -> tuple[GPT, str, None]:
    """GPT-2's own weights for ``preset``: a checkpoint folder, or the hub's ``hub_id``
    (default: the preset's name) from the Hugging Face cache or the hub (WeightsError saying
    what to do when they cannot be had)."""
    source = hub_id or preset.name
    if weights not in WEIGHT_CHOICES:
        raise WeightsError(f"unknown weights {weights!r}; allowed: "
                           f"{', '.join(WEIGHT_CHOICES)}, or a checkpoint's path")
    try:
        if weights == "auto" and not _cached(source) and not _hub_reachable():
            raise WeightsError("no network and no cached copy")
        try:
            hf = _from_pretrained(source, local_only=True)  # the Hugging Face cache first
        except WeightsError:
            if weights == "auto" and not _hub_reachable():
                raise WeightsError("no network and no cached copy") from None
            hf = _from_pretrained(source, local_only=False)
    except WeightsError as exc:
        if weights == "pretrained":
            raise WeightsError(
                f"pretrained weights for {source!r} could not be loaded ({exc}). "
                "Connect to the internet once so transformers can download them into the "
                "Hugging Face cache, or download them elsewhere with "
                f"GPT2LMHeadModel.from_pretrained({source!r}).save_pretrained(FOLDER) and "
                "pass that folder as the weights; or choose random weights."
            ) from exc
        raise WeightsError(f"pretrained weights for {source!r} unavailable ({exc})") from exc
    model = gpt_from_transformers(hf, mask=mask, device=device, dtype=dtype)
    return model, f"pretrained ({source})", None


def checkpoint_names(name: str) -> tuple[str, ...]:
    """Where our parameter ``name`` is in a ``transformers`` GPT-2 checkpoint: the same name
    (``GPT2LMHeadModel``'s), or without ``transformer.`` (``GPT2Model``'s, the hub's gpt2)."""
    return (name, name.removeprefix("transformer."))


def from_checkpoint(name: str, value: torch.Tensor) -> torch.Tensor:
    """A checkpoint's tensor as our parameter ``name``: Conv1D weights ([in, out]) transposed."""
    return value.t() if name.endswith(_CONV1D) else value


# GGUF tensor names (llama.cpp's ``gpt2`` architecture) -> ours; per layer after "blk.N."
_GGUF_TOP = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
             "output_norm": "transformer.ln_f", "output": "lm_head"}
_GGUF_LAYER = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
               "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}


def gguf_param(gguf_name: str) -> str:
    """Our parameter for a ``gpt2`` GGUF tensor ("blk.3.attn_qkv.bias" ->
    "transformer.h.3.attn.c_attn.bias"); WeightsError for one GPT-2 does not have."""
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    if kind in ("weight", "bias") and stem in _GGUF_TOP:
        return f"{_GGUF_TOP[stem]}.{kind}"
    if kind in ("weight", "bias") and len(parts) == 3 and parts[0] == "blk" \
            and parts[1].isdigit() and parts[2] in _GGUF_LAYER:
        return f"transformer.h.{parts[1]}.{_GGUF_LAYER[parts[2]]}.{kind}"
    raise WeightsError(f"GGUF tensor {gguf_name!r} is not part of a GPT-2; allowed: "
                       f"{', '.join(_GGUF_TOP)} and blk.N.{{{', '.join(_GGUF_LAYER)}}}")


def gguf_rows(name: str, value: torch.Tensor, cfg: Any) -> torch.Tensor:
    """A GGUF tensor's rows as they are: llama.cpp stores GPT-2's matrices (out, in), ours."""
    return value


def gguf_config(f: Any, mask: str = "none") -> GPTConfig:
    """The config a ``gpt2`` GGUF file's metadata describes (WeightsError for another
    architecture, or what our GPT-2 lacks: an untied output, another epsilon)."""
    meta = f.metadata
    if meta.get("general.architecture") != "gpt2":
        raise WeightsError(f"{f.path} holds a {meta.get('general.architecture')!r} model; "
                           "allowed: gpt2")
    if "output.weight" in f.tensors:
        raise WeightsError(f"{f.path}: an output projection of its own; allowed: tied to "
                           "token_embd (GPT-2's)")
    try:
        eps = float(meta.get("gpt2.attention.layer_norm_epsilon", 1e-5))
        if abs(eps - 1e-5) > 1e-12:
            raise ValueError(f"layer_norm_epsilon {eps}; allowed: 1e-05")
        return GPTConfig(n_layer=int(meta["gpt2.block_count"]),
                         n_head=int(meta["gpt2.attention.head_count"]),
                         n_embd=int(meta["gpt2.embedding_length"]),
                         block_size=int(meta["gpt2.context_length"]),
                         vocab_size=int(f.tensors["token_embd.weight"].shape[0]), mask=mask)
    except (KeyError, ValueError) as exc:
        raise WeightsError(f"{f.path}: its metadata makes no GPT-2 ({type(exc).__name__}: "
                           f"{exc})") from exc


# Layout (llama.cpp's ``src/llama-arch.cpp`` names, ``src/models/gpt2.cpp`` shapes): token_embd,
# position_embd, output_norm (weight, bias), output only when the head is not tied, and per block
# attn_norm, attn_qkv (our fused c_attn: q | k | v rows), attn_output, ffn_norm, ffn_up, ffn_down,
# each with its bias. GGUF lists dims fastest first, so a torch (out, in) matrix is written as is.
def gguf_layout(model: GPT, vocabulary: bool = True) -> GGUFLayout:
    """``model`` as llama.cpp's ``gpt2`` architecture (the inverse of ``gguf_param``): with
    GPT-2's BPE (``tokenizer.bpe_table``) when it has its vocabulary and ``vocabulary``, else
    placeholder tokens. The position table stays F32: added by a row lookup, never multiplied,
    and small."""
    cfg, p = model.config, float_params(model)
    table = bpe_table() if vocabulary and cfg.vocab_size == VOCAB else None
    vocab: list[tuple[str, Any]] = [("vocab_size", cfg.vocab_size)]
    if table is None:
        vocab.append(("tokenizer_model", "none"))
    else:
        tokens, merges = table
        eot = len(tokens) - 1
        vocab += [("tokenizer_model", "gpt2"), ("tokenizer_pre", "gpt-2"), ("token_list", tokens),
                  # GGUF's token types: 1 normal, 3 control (the end-of-text token)
                  ("token_types", [1] * eot + [3]), ("token_merges", merges),
                  ("bos_token_id", eot), ("eos_token_id", eot)]
    tensors = {"token_embd.weight": p["transformer.wte.weight"],
               "position_embd.weight": p["transformer.wpe.weight"]}
    for i in range(cfg.n_layer):
        for theirs, ours in _GGUF_LAYER.items():
            for kind in ("weight", "bias"):
                tensors[f"blk.{i}.{theirs}.{kind}"] = p[f"transformer.h.{i}.{ours}.{kind}"]
    tensors["output_norm.weight"] = p["transformer.ln_f.weight"]
    tensors["output_norm.bias"] = p["transformer.ln_f.bias"]
    if not np.array_equal(p["lm_head.weight"], p["transformer.wte.weight"]):  # not tied
        tensors["output.weight"] = p["lm_head.weight"]
    return GGUFLayout("gpt2", [
        ("name", "kvlab gpt2"), ("block_count", cfg.n_layer), ("context_length", cfg.block_size),
        ("embedding_length", cfg.n_embd), ("feed_forward_length", 4 * cfg.n_embd),
        ("head_count", cfg.n_head), ("layer_norm_eps", 1e-5)],  # our LayerNorms' epsilon
        tensors, vocab, unquantized=("position_embd.weight",))


def to_transformers(model: GPT) -> nn.Module:
    """A ``transformers`` ``GPT2LMHeadModel`` holding our model's weights (the reference)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = model.config
    hf_cfg = GPT2Config(
        n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, n_positions=cfg.block_size,
        vocab_size=cfg.vocab_size, activation_function="gelu_new", layer_norm_epsilon=1e-5,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    hf = GPT2LMHeadModel(hf_cfg).to(model.dtype).eval()
    src = model.state_dict()
    with torch.no_grad():
        for name, target in hf.state_dict().items():
            if name not in src:
                continue  # attention bias buffers and the tied head
            value = src[name].t() if name.endswith(_CONV1D) else src[name]
            target.copy_(value.to("cpu"))
    return hf
