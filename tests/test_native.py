"""Native peers are tried in a throwaway process first (``instruments.peers.native``): a planted
peer whose engine segfaults is an unavailable row saying "crashed (signal 11, SIGSEGV) in a
probe of ...", while the other engines of the same peers run are measured and the run is
saved; the probe runs once per key, in a child process. Through the CLI and the experiment, as
every peer goes; without the probe this module's first test crashes (``native``: that is one
failed test, ``tests/isolate.py``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine import families
from instruments import cli, lineup
from instruments.lineup import PeerSpec, PeerUnavailable, peers
from instruments.peers import native
from tests import native_peer

pytestmark = [pytest.mark.timeout(600), pytest.mark.native]  # tests/isolate.py


def _spec(name: str, crash: bool) -> PeerSpec:
    return PeerSpec(name, 190 + crash, f"peer · planted, crash={crash}", "#123456", "planted",
                    (), "planted==1", "float32", ("cpu",), "tests.native_peer:PlantedDecoder",
                    dict(crash=crash), architectures=("gpt2", "llama"))  # GGUF names


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The two planted peers registered, no probe remembered; the engine's runs log."""
    for name, crash in (("planted_crash", True), ("planted_ok", False)):
        monkeypatch.setitem(peers.PEERS, name, _spec(name, crash))
    monkeypatch.setattr(native, "_SEEN", {})
    log = tmp_path / "runs.log"
    monkeypatch.setenv(native_peer.RUNS_LOG, str(log))
    return log


def test_a_crashing_peer_is_an_unavailable_row_and_the_run_is_saved(
        planted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["peers", "--model", "tiny", "--contexts", "16", "--rounds", "1", "--steps", "2",
            "--peers", "planted_crash,planted_ok", "--modes", "concat", "--no-progress",
            "--results-dir", str(tmp_path / "runs")]
    assert cli.main(argv) == 0
    (path,) = (tmp_path / "runs").glob("*_peers_*.json")
    rows = {r["engine"]: r for r in json.loads(path.read_text())["tables"]["peers"]}
    why = ("crashed (signal 11, SIGSEGV) in a probe of the planted engine on engine.bin; "
           "leave the planted peer out")
    assert rows["planted_crash"]["available"] is False and rows["planted_crash"]["why"] == why
    assert rows["planted_ok"]["latency_ms"] > 0 and rows["concat"]["latency_ms"] > 0
    assert rows["planted_ok"]["logits_max_abs_diff"] < 1e-4  # gated, then timed
    out = capsys.readouterr().out
    assert f"| planted_crash | float32 | — | unavailable: {why} |" in out


def test_the_probe_runs_once_per_key_in_a_child_process(planted: Path) -> None:
    for seed in (1, 2):  # two models of one shape: one key
        lineup.make_decoder(families.load("tiny", "random", seed=seed), "planted_ok")
    pids = planted.read_text().split()
    assert len(pids) == 3 and pids.count(str(os.getpid())) == 2  # the probe, then each build
    with pytest.raises(PeerUnavailable, match=r"^crashed \(signal 11, SIGSEGV\) in a probe"):
        lineup.make_decoder(families.load("tiny", "random"), "planted_crash")
    assert native._SEEN[("planted", "True", repr(families.config("tiny")))].startswith(
        "crashed (signal 11, SIGSEGV)")  # kept: the next build is refused without a child
    assert native.signal_name(6) == "signal 6, SIGABRT" and native.signal_name(99) == "signal 99"
