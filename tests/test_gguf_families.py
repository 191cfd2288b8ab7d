"""A user's GGUF file as the model, for each architecture llama.cpp writes for our families
(gpt2, llama, qwen2): the weights of a random transformers model, written with ``gguf`` as F32,
Q8_0 and Q4_1 (``instruments.peers.gguf_out``) and quantized by llama.cpp's own quantizer to
Q4_K_M (llama-cpp-python's ``llama_model_quantize``), loaded back by our code.

  F32         the logits of transformers' model (1e-4 of the largest) and its greedy tokens, at
              every mode the family is offered
  Q8_0, Q4_1  the model's weights are the file's, and the rungs that multiply by those blocks
              take them from the file byte for byte
  Q4_K_M      its Q4_K and Q6_K tensors dequantized at load, equal to gguf-py's dequantizer,
              the provenance saying so; a Q5_K_M file is refused, naming the type
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from engine import families
from engine.models.gguf import GGUFFile, dequantize_blocks
from engine.models.loader import WeightsError
from engine.quant import blocks as quant_blocks
from instruments import lineup
from instruments.peers import gguf_out

from .family_gate import gate_every_mode, hf_greedy

pytestmark = pytest.mark.timeout(900)
LLAMA_LIKE = dict(vocab_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
                  rms_norm_eps=1e-5, initializer_range=0.08)
# hidden widths of 64 for the 32-weight blocks; of 256 for the K-quants' super-blocks
ARCHS: dict[str, tuple[Any, Any, dict[str, Any], dict[str, Any]]] = {
    "gpt2": (GPT2Config, GPT2LMHeadModel,
             dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                  initializer_range=0.12), dict(n_embd=256)),
    "llama": (LlamaConfig, LlamaForCausalLM,
              dict(LLAMA_LIKE, hidden_size=64, intermediate_size=128),
              dict(hidden_size=256, intermediate_size=512)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM,
              dict(LLAMA_LIKE, hidden_size=64, intermediate_size=128),
              dict(hidden_size=256, intermediate_size=512)),
}
needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed: its quantizer makes the K-quant files")


def _folder(tmp: Path, arch: str, wide: bool = False) -> tuple[Path, Any]:
    config_class, model_class, fields, widths = ARCHS[arch]
    torch.manual_seed(0)
    hf = model_class(config_class(**{**fields, **(widths if wide else {})})).eval()
    if arch == "qwen2":  # transformers draws its biases at zero: visible ones
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.5)
    folder = tmp / f"{arch}{'-wide' * wide}"
    hf.save_pretrained(folder)
    return folder, hf


def _gguf(tmp: Path, folder: Path, qtype: str) -> Path:
    path = tmp / f"{folder.name}-{qtype}.gguf"
    gguf_out.write_gguf(families.load(str(folder)).model, path, qtype)
    return path


def _quantize(src: Path, ftype: int) -> Path:
    import llama_cpp

    dst = src.with_name(f"{src.stem}-ftype{ftype}.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(),
                                          ctypes.byref(params)) == 0
    return dst


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[str, Path, Any, Path]:
    tmp = tmp_path_factory.mktemp(request.param)
    folder, hf = _folder(tmp, request.param)
    return request.param, folder, hf, tmp


def test_an_f32_file_matches_transformers_at_every_mode(arch) -> None:
    name, folder, hf, tmp = arch
    path = _gguf(tmp, folder, "f32")
    p = lineup.preset(str(path))
    assert p.family == name and p.weights == ("checkpoint", "random")
    assert lineup.config(str(path)) == lineup.config(str(folder))  # the metadata's config
    state = families.load(str(path))
    assert state.provenance.file == str(path)
    assert state.provenance.label.startswith(f"{path.stem.split('.')[0]} F32, from a local "
                                             "GGUF file (dequantized to float32)")
    prompt = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    gate_every_mode(state, hf, prompt, 10)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_1"])
def test_block_files_are_read_as_stored(arch, qtype: str) -> None:
    name, folder, _, tmp = arch
    path = _gguf(tmp, folder, qtype)
    state = families.load(str(path))
    model = state.model
    with GGUFFile(path) as f:
        types = {t.ggml_type for t in f.tensors.values()}
        assert qtype.upper() in types
        raw = families.raw_weights(model, str(path))
    params = dict(model.named_parameters())
    for ours, tensor in raw.items():  # every weight the file's, dequantized
        assert torch.equal(tensor.dequantize(), params[ours]), ours
    view = quant_blocks.block_view(state, f"{qtype}")
    matrices = model.config.n_layer * len(model.config.matrices())
    assert view.sources.get("file", 0) >= matrices, view.sources  # the file's own blocks
    ref = lineup.reference(model)  # transformers holding the file's (dequantized) weights
    prompt = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(2))
    gate_every_mode(state, ref, prompt, 8, names=["prealloc_fused", f"{qtype}_weights"])


@needs_llama_cpp
def test_a_k_quant_file_is_dequantized_at_load(arch) -> None:
    """llama.cpp's Q4_K_M of the same architecture (rows of 256): its Q4_K and Q6_K tensors
    dequantized at load as gguf-py dequantizes them, the provenance saying so; the exact modes
    hold to transformers over those weights."""
    import gguf

    name, _, _, tmp = arch
    folder, _ = _folder(tmp, name, wide=True)
    path = _quantize(_gguf(tmp, folder, "f32"), 15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    state = families.load(str(path))
    assert "Q4_K, Q6_K read and dequantized at load: no rung keeps them" in \
        state.provenance.label
    params = dict(state.model.named_parameters())
    with GGUFFile(path) as f:
        assert {"Q4_K", "Q6_K"} <= {t.ggml_type for t in f.tensors.values()}
        for gname, info in f.tensors.items():
            if info.ggml_type not in ("Q4_K", "Q6_K"):
                continue
            blocks = f.raw(gname).blocks.numpy()
            theirs = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[info.ggml_type])
            ours = dequantize_blocks(torch.from_numpy(blocks.reshape(-1, info.block[1])),
                                     info.ggml_type).numpy().reshape(theirs.shape)
            assert np.array_equal(ours, theirs), gname
    raw = families.raw_weights(state.model, str(path))
    for ours_name, tensor in raw.items():
        assert torch.equal(tensor.dequantize(), params[ours_name]), ours_name
    prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(3))
    gate_every_mode(state, lineup.reference(state.model), prompt, 6,
                    names=["uncached", "prealloc_fused"])


@needs_llama_cpp
def test_a_file_of_a_type_we_do_not_read_is_refused_naming_it(tmp_path: Path) -> None:
    folder, _ = _folder(tmp_path, "llama", wide=True)
    path = _quantize(_gguf(tmp_path, folder, "f32"), 17)  # LLAMA_FTYPE_MOSTLY_Q5_K_M
    with pytest.raises(WeightsError, match=r"is Q5_K; allowed: F32, F16, Q8_0, Q4_1, Q4_K, "
                       "Q6_K"):
        families.load(str(path))


def test_synthetic_k_quant_blocks_match_gguf_py() -> None:
    """Every bit pattern of the K-quants' packed scales: random super-blocks (finite fp16
    scales) dequantized as gguf-py does, bit for bit."""
    import gguf

    rng = np.random.default_rng(0)
    for kind, size, halves in (("Q4_K", 144, (0, 2)), ("Q6_K", 210, (208,))):
        blocks = rng.integers(0, 256, (256, size), dtype=np.uint8)
        for at in halves:
            scale = rng.uniform(-2, 2, 256).astype(np.float16)
            blocks[:, at : at + 2] = scale.view(np.uint8).reshape(256, 2)
        theirs = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind])
        ours = dequantize_blocks(torch.from_numpy(blocks), kind).numpy()
        assert np.array_equal(ours.reshape(theirs.shape), theirs), kind


def test_a_gguf_of_an_architecture_we_do_not_have_is_refused(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture falcon; allowed: .*gpt2.*llama.*qwen2"):
        lineup.preset(str(path))
    assert hf_greedy  # (the gate's helpers are shared with the folder tests)
