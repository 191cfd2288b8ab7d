"""Peers on the same weights: each one's logits against mode 1, in the latency sweep and in
their own experiment; a missing package or a failed export is an unavailable row, never a
traceback. Small random models (placeholder vocabulary for CTranslate2: ids are what we feed).

Measured here (2 layers, width 64): the exact peers' logits within 1.2e-5 of mode 1 (the gate's
bound is 1e-4 of the largest logit); CTranslate2 int8 within 9% of the largest logit on
GPT-2-style initial weights at width 256 (std 0.02; measured 8.2%, bound 15%; 10.6% on gpt2's
shapes) and 35% on the lively std-0.2 weights at width 64 (refused).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import GPT, GPTConfig
from engine.loop import decode, random_prompt
from instruments import cli, lineup
from instruments.checks.gate import Gate
from instruments.experiments import peers as peers_exp
from instruments.lineup import peers
from instruments.store import peers_report
from tests.conftest import SMALL, loaded_model, small_model

CPU_PEERS = [n for n, p in peers.PEERS.items() if "cpu" in p.devices]
EXACT = [n for n in CPU_PEERS if not peers.PEERS[n].tolerance]
pytestmark = [pytest.mark.timeout(600), pytest.mark.native]  # tests/isolate.py


def usable(name: str) -> None:
    ok, why = peers.available(name, "cpu")
    if not ok:
        pytest.skip(why)


@pytest.fixture(scope="module")
def lively() -> GPT:
    return small_model(seed=3)


@pytest.mark.parametrize("name", EXACT)
def test_each_exact_peer_gives_mode_1s_logits(lively: GPT, name: str) -> None:
    usable(name)
    check = Gate(lively).check(name)
    assert check.passed, check.detail
    assert check.max_diff is not None and check.max_diff < 5e-5, check.detail  # measured ≤ 1.2e-5


def test_int8_peer_is_held_to_its_stated_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    usable("ct2_int8")
    calm = GPT.random(GPTConfig(**{**SMALL, "n_embd": 256}), seed=3, std=0.02)
    check = Gate(calm).check("ct2_int8")
    scale = check.tolerance / peers.PEERS["ct2_int8"].tolerance  # the largest mode 1 logit
    assert check.passed, check.detail
    share = check.max_diff / scale
    assert 1e-3 < share < 0.15  # lossy, within its bound (measured 8.2% on the EPYC)
    # A bound tighter than the error it makes refuses it. (On the tiny shape's std-0.2 weights
    # CTranslate2's int8 strayed by ~35% on the AVX2 EPYC and 3.3% on the AVX-512 Xeon: its
    # error depends on the CPU's int8 path, so the refusal is tested against a set bound.)
    strict = dataclasses.replace(peers.PEERS["ct2_int8"], tolerance=share / 2)
    monkeypatch.setitem(peers.PEERS, "ct2_int8", strict)
    refused = Gate(calm).check("ct2_int8")
    assert not refused.passed and refused.max_diff > refused.tolerance, refused.detail


def seek_back_then_step(model: torch.nn.Module, name: str) -> None:
    """The sweep's set-up: seek to t - 1 (cropping, or moving the write position back), then
    one step, at falling and rising contexts; CTranslate2's is a step of its own loop."""
    ids = random_prompt(model, 1, 120, seed=1)
    dec = lineup.make_decoder(model, name, batch_size=1, capacity=128)
    for t in (100, 40, 70, 70):
        dec.seek(ids, t - 1)
        got = dec.step(ids[:, t - 1:t])
        with torch.no_grad():
            want, _ = model(ids[:, :t], use_cache=False, logits="last")
        assert float((got - want[:, -1]).abs().max()) < 5e-5, (name, t)
    assert getattr(dec, "refills", 0) == 0  # no step had to start a generation afresh


@pytest.mark.parametrize("name", ["hf_static", "hf_dynamic", "ort_float32", "ov_float32",
                                  "ct2_float32"])
def test_seek_back_then_step_is_exact(lively: GPT, name: str) -> None:
    usable(name)
    seek_back_then_step(lively, name)


@pytest.mark.parametrize("name", ["hf_dynamic", "hf_static", "ct2_float32"])
def test_the_transformers_peers_convert_a_llama_too(name: str) -> None:
    """Built from the family's own transformers model (``lineup.reference``), not GPT-2's: the
    gate passes on llama-tiny (measured within 1.1e-5 of mode 1) and a seek back is exact."""
    usable(name)
    state = lineup.load_model("llama-tiny", "random")
    assert lineup.available(name, "cpu", "llama") == (True, "")
    check = Gate(state.model).check(name)
    assert check.passed and check.max_diff is not None and check.max_diff < 5e-5, check.detail
    seek_back_then_step(state.model, name)


def test_a_peer_refuses_the_architectures_its_converter_was_not_gated_for() -> None:
    """Matched against the family table's architectures: a sliding window (Mistral) is refused
    where the peer's logits or its seek strayed past the window, saying why."""
    assert peers.available("hf_dynamic", "cpu", "mistral") == peers.available("hf_dynamic", "cpu")
    for name, why in (("hf_static", "a sliding window's StaticCache is not rewound"),
                      ("ct2_float32", "its conversion attends over every row"),
                      ("ort_float32", "its ONNX export wraps transformers' GPT2LMHeadModel")):
        ok, said = peers.available(name, "cpu", "mistral")
        assert not ok and said.startswith(f"not for Mistral models: {why}"), said


def test_ct2_greedy_steps_stay_in_its_loop(lively: GPT) -> None:
    usable("ct2_float32")
    dec = lineup.make_decoder(lively, "ct2_float32", capacity=64)
    prompt = random_prompt(lively, 1, 8, seed=2)
    want = decode(lineup.make_decoder(lively, "uncached"), prompt, 12).tokens
    assert torch.equal(decode(dec, prompt, 12).tokens, want)
    assert dec.refills == 0


def test_peers_join_the_latency_sweep_through_modes(tmp_path: Path) -> None:
    names = [n for n in ("hf_dynamic", "ct2_float32", "ort_float32") if
             peers.available(n, "cpu")[0]]
    if not names:
        pytest.skip("no peer package installed")
    argv = ["latency", "--model", "tiny", "--contexts", "8,16", "--repeats", "1",
            "--modes", ",".join(["concat", *names]), "--new-tokens", "0", "--no-peaks",
            "--no-progress", "--results-dir", str(tmp_path)]
    assert cli.main(argv) == 0
    (path,) = tmp_path.glob("*.json")
    run = json.loads(path.read_text())
    timed = {(r["mode"], r["context_len"]) for r in run["tables"]["latency"]}
    assert {(n, t) for n in names for t in (8, 16)} <= timed
    checks = {c["mode"]: c for c in run["tables"]["checks"]}
    assert all(checks[n]["passed"] and checks[n]["max_diff"] < 1e-4 for n in names)
    labels = {r["mode"]: r["mode_label"] for r in run["tables"]["latency"]}
    assert labels[names[0]] == lineup.label(names[0])


def _run(model: GPT, **kw: object) -> dict:
    p = peers_exp.PeersParams([16], **{"modes": ["concat"], "rounds": 1, "steps": 2,
                                       "warmup": 0, **kw})  # type: ignore[arg-type]
    return peers_exp.run(loaded_model(model), p)


def test_a_missing_package_is_an_unavailable_row_with_its_install_command(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = peers._find
    monkeypatch.setattr(peers, "_find", lambda pkg: pkg != "ctranslate2" and real(pkg))
    assert peers.available("ct2_int8", "cpu") == (
        False, "ctranslate2 not installed; install with: pip install ctranslate2==4.8.5")
    run = _run(small_model(seed=4), peers=["ct2_float32"])
    rows = {r["engine"]: r for r in run["tables"]["peers"]}
    assert rows["ct2_float32"]["available"] is False
    assert "pip install ctranslate2==" in rows["ct2_float32"]["why"]
    assert rows["concat"]["latency_ms"] > 0 and rows["concat"]["x_fastest_exact"] == 1.0
    assert any("ct2_float32 not available" in n for n in run["meta"]["notes"])


def test_a_failed_export_is_an_unavailable_row_with_the_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    usable("ort_float32")
    from instruments.peers import ort

    def broken(*args: object) -> None:
        raise RuntimeError("exporter gave up")

    monkeypatch.setattr(ort, "_export", broken)
    run = _run(small_model(seed=5), peers=["ort_float32"])
    row = next(r for r in run["tables"]["peers"] if r["engine"] == "ort_float32")
    assert row["available"] is False
    assert row["why"].endswith("ONNX export failed: RuntimeError: exporter gave up")


def test_the_peers_run_times_every_engine_with_the_floor_and_the_gate(lively: GPT) -> None:
    names = [n for n in ("hf_dynamic", "ct2_float32") if peers.available(n, "cpu")[0]]
    run = _run(lively, peers=names, steps=5, rounds=2)
    rows = [r for r in run["tables"]["peers"] if r["latency_ms"] is not None]
    assert {r["engine"] for r in rows} == {"concat", *names}
    for r in rows:
        assert r["floor_ms"] > 0 and r["x_floor"] == pytest.approx(r["latency_ms"] / r["floor_ms"])
        assert len(r["samples_ms"]) == 10 and len(r["rounds_ms"]) == 2
        assert r["p90_ms"] is not None and r["p90_ms"] >= r["min_ms"]
        assert r["logits_max_abs_diff"] < 1e-4 and r["weight_bytes"] > 0 and r["version"]
    assert {c["mode"] for c in run["tables"]["checks"]} == {"concat", *names}
    assert {f["kernel"] for f in run["tables"]["floor"]} == {"sum", "matrix-vector"}
    assert peers_report.verdict(run["tables"]["peers"])[0].startswith("At 16 tokens, float32: ")
    few = _run(lively, peers=[], steps=3)  # fewer than 10 samples: no p90
    assert few["tables"]["peers"][0]["p90_ms"] is None


def test_the_verdict_can_say_a_peer_is_faster_than_us() -> None:
    rows = [{"engine": "fast", "kind": "mode", "precision": "float32", "context_len": 512,
             "latency_ms": 30.0, "x_floor": 2.0},
            {"engine": "ct2_float32", "kind": "peer", "precision": "float32", "context_len": 512,
             "latency_ms": 20.0, "x_floor": 1.5},
            {"engine": "ct2_int8", "kind": "peer", "precision": "int8", "context_len": 512,
             "latency_ms": 10.0, "x_floor": 0.7},
            {"engine": "ort_float32", "available": False, "why": "pip install x",
             "latency_ms": None, "context_len": None}]
    (line,) = peers_report.verdict(rows)
    assert line == ("At 512 tokens, float32: ct2_float32 is fastest (20.00 ms, 1.50× the read "
                    "floor); our fastest, fast, takes 1.50× its time; int8: ct2_int8 is fastest "
                    "(10.00 ms, 0.70× the read floor).")
    assert "| ort_float32 |  | — | unavailable: pip install x |" in peers_report.markdown(rows)


def test_llamacpps_goals_say_a_miss_and_pair_ours_with_its_format() -> None:
    """Each format against llama.cpp's on the same bytes (F32: our fastest exact fp32 mode),
    the goal (<= 1) and the target (<= 0.8) said apart, a miss in capitals, q4_1 over the fp32
    read; a run without llama.cpp gives no line."""
    def row(engine: str, kind: str, precision: str, ms: float, **more: float) -> dict:
        return {"engine": engine, "kind": kind, "precision": precision, "context_len": 128,
                "latency_ms": ms, **more}

    rows = [row("fast", "mode", "float32", 30.0), row("concat", "mode", "float32", 40.0),
            row("q4_1_weights", "mode", "q4_1", 14.0, x_floor=0.4),
            row("q8_0_weights", "mode", "q8_0", 18.0), row("llamacpp_q4_1", "peer", "q4_1", 20.0),
            row("llamacpp_q8_0", "peer", "q8_0", 20.0), row("llamacpp_f32", "peer", "float32",
                                                               25.0)]
    q4, q8, f32 = peers_report.llamacpp_goals(rows)
    assert q4 == ("At 128 tokens: q4_1_weights 14.00 ms ÷ llamacpp_q4_1 20.00 ms = 0.70 (target "
                  "met: goal ≤ 1, target ≤ 0.8); 0.40× the fp32 read floor (target ≤ 0.35).")
    assert "= 0.90 (goal met" in q8
    assert f32.startswith("At 128 tokens: fast 30.00 ms ÷ llamacpp_f32 25.00 ms = 1.20 (MISSED")
    assert peers_report.llamacpp_goals([r for r in rows if r["kind"] == "mode"]) == []


def test_bad_peer_input_is_one_line() -> None:
    cfg = GPTConfig(**SMALL)
    with pytest.raises(ValueError, match="unknown peer 'ct3'; allowed: hf_dynamic"):
        peers_exp.PeersParams([16], ["ct3"]).check(cfg, "cpu")
    with pytest.raises(ValueError, match="outside 2..256"):
        peers_exp.PeersParams([1], ["hf_dynamic"]).check(cfg, "cpu")
    with pytest.raises(ValueError, match="name peers under peers"):
        peers_exp.PeersParams([16], [], ["ort_float32"]).check(cfg, "cpu")
    assert lineup.available("ct2_float16", "cpu") == (False, "runs on cuda only")
    assert lineup.ordered(["ort_float32", "fast", "hf_dynamic", "uncached"]) == [
        "uncached", "fast", "hf_dynamic", "ort_float32"]
    colors = {lineup.color(n) for n in lineup.names()}
    assert len(colors) == len(lineup.names())  # every mode and peer its own colour


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(root), **env})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the dynamic linker's report")
def test_ctranslate2_runs_on_its_own_openmp_runtime_not_torchs(tmp_path: Path) -> None:
    """Bound to torch's libgomp, CTranslate2's worker adds a second team to torch's runtime and
    libgomp stops spinning for everyone (mode 8's step 19 -> 25 ms at 2 threads on the Xeon).
    The dynamic linker's own report says where its parallel regions go."""
    usable("ct2_float32")
    log = tmp_path / "ld"
    done = _python("import torch; from instruments.peers.ct2 import import_ctranslate2; "
                   "import_ctranslate2()", LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(log))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [ln for f in tmp_path.glob("ld*") for ln in f.read_text(errors="replace").splitlines()
             if "libctranslate2" in ln.split(" to ")[0] and "`GOMP_parallel'" in ln]
    assert lines, "CTranslate2's GOMP_parallel was not bound when it was loaded"
    assert all("ctranslate2.libs/libgomp" in ln.split(" to ")[1] for ln in lines), lines[0]


def test_a_paused_ctranslate2_generation_does_not_abort_the_exit() -> None:
    """A measuring process that ends with a CTranslate2 generation still paused (nobody called
    close) exits cleanly: the generations are ended before the interpreter shuts down, and only
    once the engine holds no batch (an exit just after the result landed aborted 4 processes of
    12). A race: four processes give this test a fair chance to see it come back (without the
    wait, 1 of 3 runs of the test failed), not a certainty."""
    usable("ct2_float32")
    code = ("from tests.conftest import small_model; from engine.loop import random_prompt; "
            "from instruments import lineup; m = small_model(seed=3); "
            "d = lineup.make_decoder(m, 'ct2_float32', capacity=64); "
            "ids = random_prompt(m, 1, 20, seed=1); d.seek(ids, 10); d.step(ids[:, 10:11]); "
            "print('stepped')")
    for _ in range(4):  # one after another: side by side they exit too slowly to race
        done = _python(code)
        assert done.returncode == 0 and "stepped" in done.stdout, done.stderr[-2000:]
        assert "Fatal Python error" not in done.stderr, done.stderr[-2000:]
