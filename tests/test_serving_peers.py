"""The serving experiment's peers (``instruments.peers.serving``): llama.cpp's batched decode and
transformers' continuous batching serve the requests our engine served, on the same weights,
and give its greedy tokens; a planted bug in the batched calls (every sequence given one id,
every sequence reading the first one's logits, positions off by one, a slot not freed before
its next request) turns ``tokens_equal`` False; an absent package, a probe that crashes and a
concurrency beyond llama.cpp's sequences are rows that say why, never a traceback.

Our engine's tokens come from the concurrency experiment's own body (``runs.concurrency``) at
C = 1 and 3 on the tiny shapes. The module is ``native`` (tests/isolate.py): llama.cpp runs in
this process, so a crash fails a test, not the suite. Tests needing llama-cpp-python skip,
saying how to get it.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from engine import families
from instruments.experiments.serving import ServingParams, runs
from instruments.lineup import peers as lineup_peers
from instruments.peers import llamacpp_batch, native, serving, serving_hf
from instruments.spine import Loaded, ModelSpec, Tracker
from tests import native_peer

pytestmark = [pytest.mark.timeout(300), pytest.mark.native]  # tests/isolate.py
PEAKS = {"matmul_tflops": 0.1, "read_gbps": 10.0}  # only the floors' columns read them


def usable() -> None:
    ok, why = lineup_peers.available("llamacpp_f32", "cpu")
    if not ok:
        pytest.skip(f"llama.cpp peers unavailable: {why}")


_SERVED: dict[str, tuple[Loaded, ServingParams, list[dict[str, Any]]]] = {}


def served(name: str) -> tuple[Loaded, ServingParams, list[dict[str, Any]]]:
    """(the model, the run's parameters, our engine's request rows) at C = 1 and 3, once."""
    if name not in _SERVED:
        state = families.load(name, "random")
        model = state.model
        params = replace(ServingParams.defaults("cpu", model.config), concurrency=[1, 3],
                         peer_concurrency=[])  # the peers at every concurrency
        tr = Tracker(None, None, 2)
        runs.concurrency(model, params, PEAKS, tr)
        loaded = Loaded(model, ModelSpec(name, "random", "cpu", "float32"), {}, state)
        _SERVED[name] = loaded, params, tr.tables["requests"]
    return _SERVED[name]


def tracker(requests: list[dict[str, Any]]) -> Tracker:
    tr = Tracker(None, None, 2)
    tr.tables["requests"] = list(requests)
    return tr


def llama_rows(name: str, **params: Any) -> list[dict[str, Any]]:
    loaded, p, requests = served(name)
    tr = tracker(requests)
    p = replace(p, **params)
    serving.llamacpp_rows(loaded.model, p, runs.concurrency_requests(loaded.model, p), tr)
    return tr.tables["peers"]


@pytest.mark.parametrize("name", ["llama-tiny", "tiny"])
def test_llamacpp_batched_gives_our_engines_tokens(name: str) -> None:
    """Both families, every request at C = 1 and 3 (GPT-2 too: its f16 GELU table moved no
    greedy token of these requests, measured)."""
    usable()
    rows = llama_rows(name)
    assert [r["concurrency"] for r in rows] == [1, 3]
    for r in rows:
        assert r["ok"] and r["tokens_equal"] and r["tokens_differing"] == 0, r
        assert r["requests"] == max(2, 2 * r["concurrency"]) and r["output_tokens"] > 0
        assert r["output_tok_s"] > 0 and r["duration_s"] > 0
        assert r["version"].startswith("llama-cpp-python ")
    batches = {int(b) for b in rows[1]["step_ms_by_batch"]}
    assert 3 in batches and all(v > 0 for v in rows[1]["step_ms_by_batch"].values())


def _same_seq(decode: Any) -> Any:
    return lambda self, entries: decode(self, [(0, *e[1:]) for e in entries])


def _next_position(decode: Any) -> Any:
    return lambda self, entries: decode(self, [(s, t, p + 1, k) for s, t, p, k in entries])


def _first_logits(step: Any) -> Any:
    def planted(self: Any, live: list[tuple[int, int, int]]) -> list[int]:
        step(self, live)
        return [self._argmax(0)] * len(live)

    return planted


PLANTS = {  # attribute of Batched -> the planted bug around the real one
    "one sequence id for all": ("_decode", _same_seq),
    "every sequence reads the first one's logits": ("step", _first_logits),
    "positions off by one (GPT-2's are absolute)": ("_decode", _next_position),
}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_bug_in_the_batched_calls_is_caught(plant: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """One id for all: llama.cpp refuses the batch (its positions go back), a row saying so.
    The others pass llama.cpp's checks and only the token gate sees them. (A shift of every
    position is invisible on Llama: RoPE attends by relative position.)"""
    usable()
    attr, wrap = PLANTS[plant]
    monkeypatch.setattr(llamacpp_batch.Batched, attr, wrap(getattr(llamacpp_batch.Batched, attr)))
    rows = llama_rows("tiny", concurrency=[3])
    assert len(rows) == 1 and rows[0]["tokens_equal"] is False, rows
    if plant.startswith("one sequence"):
        assert not rows[0]["ok"] and rows[0]["why"].startswith("RuntimeError: llama_decode "
                                                               "returned"), rows
    else:
        assert rows[0]["ok"] and rows[0]["tokens_differing"] > 0
        assert "requests differ from ours" in rows[0]["note"] and serving.GELU_NOTE in rows[0][
            "note"]


def test_a_slot_not_freed_before_its_next_request_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    usable()
    monkeypatch.setattr(llamacpp_batch.Batched, "clear", lambda self, seq: None)
    rows = llama_rows("llama-tiny", concurrency=[1])
    assert rows[0]["tokens_equal"] is False and not rows[0]["ok"], rows


def test_a_crash_in_the_batched_probe_is_a_row_saying_make_peers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The multi-sequence path's probe dies of SIGSEGV (planted): this process never decodes a
    batch, and run_peers goes on to the next peer."""
    usable()
    monkeypatch.setattr(native, "_SEEN", {})
    monkeypatch.setattr(serving_hf, "rows", lambda *a: None)
    import instruments.peers.llamacpp_batch as mod

    monkeypatch.setattr(mod, "probe_batched", native_peer.segfault)
    loaded, p, requests = served("llama-tiny")
    tr = tracker(requests)
    serving.run_peers(loaded, p, tr, runs.concurrency_requests(loaded.model, p))
    (row,) = tr.tables["peers"]
    assert not row["ok"] and row["peer"] == serving.PEER and row["concurrency"] is None
    assert "crashed (signal 11, SIGSEGV) in a probe of llama.cpp" in row["why"]
    assert "make peers" in row["why"]


def test_beyond_llama_cpps_sequences_a_row_says_so() -> None:
    usable()
    loaded, p, _ = served("llama-tiny")
    tr = tracker([])
    p = replace(p, concurrency=[llamacpp_batch.MAX_SEQS + 1], rounds=1)
    serving.llamacpp_rows(loaded.model, p, runs.concurrency_requests(loaded.model, p), tr)
    (row,) = tr.tables["peers"]
    assert not row["ok"] and row["concurrency"] == 257 and "at most 256 sequences" in row["why"]


def test_absent_packages_are_rows_saying_how_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails, find_spec finds none
    monkeypatch.setitem(sys.modules, "transformers", None)
    loaded, p, requests = served("llama-tiny")
    tr = tracker(requests)
    serving.run_peers(loaded, p, tr, runs.concurrency_requests(loaded.model, p))
    lcpp, hf = tr.tables["peers"]
    assert (lcpp["peer"], hf["peer"]) == (serving.PEER, serving_hf.PEER)
    assert not lcpp["ok"] and lcpp["why"] == lineup_peers.available("llamacpp_f32", "cpu")[1]
    assert lcpp["why"].startswith("llama_cpp not installed; install with: make peers")
    assert not hf["ok"] and hf["why"].startswith("ModuleNotFoundError: import of transformers")
    assert hf["why"].endswith("install or rebuild with: pip install transformers==5.23.0")


@pytest.mark.parametrize("name", ["llama-tiny", "tiny"])
def test_transformers_continuous_batching_gives_our_engines_tokens(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers.GenerationMixin, "generate_batch"):
        pytest.skip("this transformers has no generate_batch: pip install transformers==5.23.0")
    loaded, p, requests = served(name)
    tr = tracker(requests)
    serving_hf.rows(loaded.model, p, runs.concurrency_requests(loaded.model, p), tr)
    rows = tr.tables["peers"]
    assert [r["concurrency"] for r in rows] == [1, 3]
    for r in rows:
        assert r["ok"] and r["tokens_equal"] and r["tokens_differing"] == 0, r
        assert r["version"].startswith("transformers ") and "sdpa" in r["note"]
        assert r["output_tok_s"] > 0


class Fake:
    """Batched's calls over a toy model: the next token is (last token + position) % 97, so a
    wrong position, token or sequence shows in the tokens; it holds at most ``seqs`` at once."""

    def __init__(self, seqs: int) -> None:
        self.seqs, self.held, self.most = seqs, set(), 0

    def prefill(self, seq: int, ids: list[int]) -> int:
        assert seq not in self.held and 0 <= seq < self.seqs
        self.held.add(seq)
        self.most = max(self.most, len(self.held))
        return (ids[-1] + len(ids) - 1) % 97

    def step(self, live: list[tuple[int, int, int]]) -> list[int]:
        assert {s for s, _, _ in live} <= self.held
        return [(t + p) % 97 for _, t, p in live]

    def clear(self, seq: int) -> None:
        self.held.discard(seq)


def _alone(a: Any) -> list[int]:
    out, pos = [(a.prompt[-1] + len(a.prompt) - 1) % 97], len(a.prompt)
    while len(out) < a.new_tokens:
        out.append((out[-1] + pos) % 97)
        pos += 1
    return out


def test_the_closed_loop_serves_each_request_as_alone_within_its_slots() -> None:
    arrivals = [SimpleNamespace(prompt=[i + 1] * (3 + i % 4), new_tokens=1 + i % 5)
                for i in range(11)]
    fake = Fake(3)
    loop = serving.closed_loop(fake, arrivals, 3)
    assert loop.tokens == {i: _alone(a) for i, a in enumerate(arrivals)}
    assert fake.most == 3 and not fake.held and max(loop.step_ms) == 3
    assert serving.compare(loop.tokens, loop.tokens) == (0, 0)
    assert serving.compare({0: [1, 2, 3]}, {0: [1, 5], 1: [4]}) == (3, 2)


def test_peers_serve_only_the_concurrencies_asked_that_ours_served() -> None:
    p = replace(ServingParams(), concurrency=[1, 2, 4, 16, 64], peer_concurrency=[1, 16, 32])
    assert serving.peer_points(p) == [1, 16]
    assert serving.peer_points(replace(p, peer_concurrency=[])) == [1, 2, 4, 16, 64]
