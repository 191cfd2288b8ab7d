"""The field's terms in real runs of the tiny model: llama-bench's pp/tg rows and table, TTFT /
TPOT / E2E in end-to-end rows, p50/p90/p99 and MBU/MFU in latency rows, and ``compare`` on two
sweeps of the same code (passes) and on a sweep whose mode was slowed on purpose (flagged).

``compare``'s verdicts are decided on timings the test sets, not on this host's: the sweeps run
the tiny model's real steps, but the Sampler reads a clock that each step moves by a set 1.0 to
1.1 ms (and the slowed mode's by 300 ms more), so a busy neighbour or a quick host flips none.
"""

from __future__ import annotations

import random

import pytest

from engine.models.config import GPTConfig
from engine.models.gpt2.model import GPT
from instruments import cli
from instruments.experiments import get, latency
from instruments.experiments.bench import BenchParams, markdown, parse_depths
from instruments.experiments.end_to_end import EndToEndParams
from instruments.experiments.latency import LatencyParams
from instruments.spine import Loaded
from instruments.store import compare

from .conftest import loaded_model

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=128, vocab_size=256)


@pytest.fixture(scope="module")
def tiny() -> Loaded:
    return loaded_model(GPT.random(TINY, seed=3, std=0.2))


def test_bench_rows_and_llama_bench_table(tiny: Loaded) -> None:
    p = BenchParams(["uncached", "concat"], prompt_tokens=16, gen_tokens=8, depths=[0, 16],
                    repeats=2, warmup=0)
    run = get("bench").run(tiny, p)
    rows = run["tables"]["bench"]
    assert [(r["mode"], r["label"]) for r in rows] == [
        (m, t) for m in ("uncached", "concat")
        for t in ("pp16", "tg8", "pp16 @ d16", "tg8 @ d16")]
    for r in rows:
        assert len(r["samples_ms"]) == 2 and r["samples_n"] == 2
        rates = [r["n_tokens"] / (ms / 1e3) for ms in r["samples_ms"]]
        assert r["tokens_per_s"] == pytest.approx(sum(rates) / 2)
        assert r["tokens_per_s_sd"] is not None and r["p99_ms"] is None
        assert r["joules_per_token"] is not None or r["energy_note"].startswith("not available")
    table = markdown(run).splitlines()
    assert table[0].startswith("| model | size | params | device | threads | mode | test | t/s |")
    assert any("| concat | tg8 @ d16 | " in line and " ± " in line for line in table)
    assert all(c["passed"] for c in run["tables"]["checks"])


@pytest.mark.parametrize("change, match", [
    (dict(prompt_tokens=0, gen_tokens=0), "nothing to run"),
    (dict(depths=[120], prompt_tokens=16), "must fit the model's 128 tokens"),
    (dict(repeats=0), "repeats"), (dict(modes=["nope"]), "cannot run"), (dict(depths=[]), "depth"),
])
def test_bench_params_say_what_is_allowed(change: dict, match: str) -> None:
    p = BenchParams(**{**dict(modes=["concat"], prompt_tokens=16, gen_tokens=8), **change})
    with pytest.raises(ValueError, match=match):
        p.check(TINY, "cpu")
    with pytest.raises(ValueError, match="allowed: whole numbers"):
        parse_depths("0, x")


def test_bench_cli_bad_flags_are_one_line(capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["bench", "--model", "tiny", "--depth", "0,abc", "--no-progress"]) == 2
    assert "cannot read depths" in capsys.readouterr().err


def test_end_to_end_rows_speak_ttft_and_tpot(tiny: Loaded) -> None:
    run = get("end_to_end").run(tiny, EndToEndParams(["concat"], prompt_len=4, new_tokens=12,
                                                     repeats=2))
    (row,) = run["tables"]["end_to_end"]
    assert row["ttft_ms"] > 0 and row["e2e_ms"] == pytest.approx(row["total_s"] * 1e3)
    assert row["tpot_samples_n"] == 22  # 11 later steps, both repeats pooled
    assert row["tpot_p50_ms"] is not None and row["tpot_p90_ms"] is not None
    assert row["tpot_p99_ms"] is None and "p99 needs at least 100" in \
        row["tpot_percentiles_note"]
    assert row["output_tokens_per_s"] == pytest.approx(12 / row["total_s"])
    assert row["decode_tokens_per_s"] == pytest.approx(1e3 / row["tpot_ms"])
    assert row["prefill_tokens_per_s"] == pytest.approx(4 / (row["ttft_ms"] / 1e3))


def sweep(tiny: Loaded, **change: object) -> dict:
    p = LatencyParams(**{**dict(contexts=[4, 16], modes=["uncached", "concat"], repeats=3,
                                warmup=0, measure_peaks=False), **change})
    return get("latency").run(tiny, p)


def test_latency_rows_carry_percentiles_and_shares(tiny: Loaded) -> None:
    run = sweep(tiny, contexts=[8], modes=["concat"], repeats=2)
    (row,) = run["tables"]["latency"]
    assert row["p50_ms"] == pytest.approx(row["latency_ms"]) and row["p90_ms"] is None
    assert row["samples_n"] == len(row["samples_ms"]) and "p90 needs" in row["percentiles_note"]
    assert row["read_bytes"] > 0 and row["mbu"] is None  # no peaks measured: no share
    assert "mbu_listed" in row and row["mbu_listed"] is None  # a CPU lists no datasheet


def test_compare_passes_the_same_code_and_flags_a_slowed_mode(
        tiny: Loaded, monkeypatch: pytest.MonkeyPatch) -> None:
    from instruments.measure import sampler

    now_s, jitter = [0.0], random.Random(7)
    slow_mode: list[str] = []  # the mode whose steps take 300 ms more, once it is set

    def clock() -> float:
        return now_s[0]

    real_init, calls = sampler.Sampler.__init__, latency._Mode.calls
    monkeypatch.setattr(sampler.Sampler, "__init__", lambda self, *a, **k: real_init(
        self, *a, **{**k, "clock": clock, "watch": None}))

    def timed(self: latency._Mode, idx: object, t: int) -> tuple:
        prepare, step, phase = calls(self, idx, t)

        def set_time() -> object:  # the real step runs; the time it took is the test's
            out = step()
            now_s[0] += (jitter.uniform(1.0, 1.1) + 300.0 * (self.name in slow_mode)) / 1e3
            return out

        return prepare, set_time, phase

    monkeypatch.setattr(latency._Mode, "calls", timed)
    old, same = sweep(tiny), sweep(tiny)
    assert all(1.0 <= s <= 1.1 for r in old["tables"]["latency"] for s in r["samples_ms"])
    # the steps differ by up to 10% from run to run: a 50% floor passes the unchanged pair
    assert not compare.compare(old, same, floor=0.5).regressions
    slow_mode.append("concat")
    new = sweep(tiny)
    got = compare.compare(old, new, floor=0.5)
    flagged = {(r["mode"], r["context_len"]) for r in got.regressions}
    assert flagged == {("concat", 4), ("concat", 16)}, compare.markdown(got)
