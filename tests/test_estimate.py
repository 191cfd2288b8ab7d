"""The time a sweep will take, fitted from the steps a previous one measured."""

from __future__ import annotations

import pytest

from engine import families
from instruments.costmodel import estimate
from instruments.experiments.latency import LatencyParams

CFG = families.config("gpt2")


def rows(a_ms: float, per_gflop_ms: float, flat_ms: float) -> list[dict]:
    out = []
    for t in (8, 64, 256, 1024):
        gflops = estimate.cost_of(CFG, "float32", "uncached", t) / 1e9
        out.append({"mode": "uncached", "context_len": t, "latency_ms": a_ms + per_gflop_ms
                    * gflops, "phase": "forward"})
        out.append({"mode": "concat", "context_len": t, "latency_ms": flat_ms,
                    "phase": "decode"})
    return out


def test_fits_recover_the_step_costs() -> None:
    fits = estimate.fit(rows(40.0, 2.0, 45.0), CFG, "float32")
    t = 500
    gflops = estimate.cost_of(CFG, "float32", "uncached", t) / 1e9
    assert estimate.point_ms(fits, CFG, "float32", "uncached", t) == pytest.approx(40 + 2 * gflops)
    assert estimate.point_ms(fits, CFG, "float32", "concat", t) == pytest.approx(45.0)


def test_a_sweep_estimate_adds_up_its_work() -> None:
    fits = estimate.fit(rows(40.0, 2.0, 45.0), CFG, "float32")
    p = LatencyParams([8, 64], ["uncached", "concat"], warmup=1, repeats=3)
    point = {m: [estimate.point_ms(fits, CFG, "float32", m, t) for t in (8, 64)]
             for m in p.modes}
    fill = estimate.point_ms(fits, CFG, "float32", "uncached", 64)  # the cache, filled once
    want_ms = sum(2 * sum(v) + v[0] for v in point.values()) + fill
    p.point_ms = 0.0  # two samples a point
    assert estimate.sweep_seconds(p, CFG, "float32", fits, 7.0) == pytest.approx(
        want_ms / 1e3 + 7.0, rel=0.02)
    p.point_ms = 250.0  # cheap points: as many ~40-60 ms samples as add up to 250 ms, at most 5
    n = {ms: max(2, min(5, -(-250.0 // ms))) for v in point.values() for ms in v}
    assert 5 in n.values() and len(set(n.values())) > 1  # both rules are exercised
    want_ms = sum(sum(ms * n[ms] for ms in v) + v[0] for v in point.values()) + fill
    assert estimate.sweep_seconds(p, CFG, "float32", fits, 7.0) == pytest.approx(
        want_ms / 1e3 + 7.0, rel=0.02)
    assert estimate.sweep_seconds(LatencyParams([8], ["fast"]), CFG, "float32", fits) is None


def test_the_end_to_end_length_that_fits_a_budget() -> None:
    fits = estimate.fit(rows(40.0, 2.0, 45.0), CFG, "float32")
    p = LatencyParams([8], ["uncached", "concat"], e2e_prompt_len=8)
    n = estimate.tokens_that_fit(p, CFG, "float32", fits, 20.0)
    at = LatencyParams([8], ["uncached", "concat"], e2e_prompt_len=8, e2e_new_tokens=n)
    over = LatencyParams([8], ["uncached", "concat"], e2e_prompt_len=8, e2e_new_tokens=n + 1)
    assert estimate.end_to_end_seconds(at, CFG, "float32", fits) <= 20.0
    assert estimate.end_to_end_seconds(over, CFG, "float32", fits) > 20.0


def test_an_estimate_from_a_saved_run() -> None:
    run = {"meta": {"config": CFG.to_dict(), "dtype": "float32",
                    "timings": {"gate_s": 12.5, "peaks_s": 3.0}},
           "tables": {"latency": rows(40.0, 2.0, 45.0)}}
    fits, fixed = estimate.from_run(run)
    assert fixed == 15.5 and set(fits) == {"uncached", "concat"}
    assert estimate.from_run({"meta": {}, "tables": {}}) is None


# A forward whose time per token grows with the context, as on these CPUs (gpt2 measured here:
# 137 ms at 8 tokens, 330 at 73, 6 s at 1,000), and a cached step that barely grows.
SHAPES = {
    "convex, as measured": (lambda t: 120 + 3.0 * t + 0.003 * t * t, lambda t: 55 + 0.01 * t),
    "linear in FLOPs": (lambda t: 40 + 2 * estimate.cost_of(CFG, "float32", "uncached", t) / 1e9,
                        lambda t: 45.0),
}


def true_end_to_end_s(uncached, cached, prompt: int, new: int) -> float:
    """What the end-to-end part runs, per mode: call 0 the prompt's forward, call k a step at
    prompt + k (a forward of it, uncached); then the first 8 calls again as the warm-up."""
    calls = {"uncached": [uncached(prompt + k) for k in range(new)],
             "concat": [uncached(prompt)] + [cached(prompt + k) for k in range(1, new)]}
    return sum(sum(c) + sum(c[:8]) for c in calls.values()) / 1e3


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("budget_s", [10.0, 25.0, 60.0])
def test_the_chosen_end_to_end_length_lands_within_20_percent(shape: str, budget_s: float
                                                              ) -> None:
    uncached, cached = SHAPES[shape]
    contexts = LatencyParams.defaults("cpu", CFG).contexts  # the default sweep's
    rows = [{"mode": "uncached", "context_len": t, "latency_ms": uncached(t), "phase": "forward"}
            for t in contexts] + [{"mode": "concat", "context_len": t,
                                   "latency_ms": cached(t), "phase": "decode"} for t in contexts]
    fits = estimate.fit(rows, CFG, "float32")
    p = LatencyParams(contexts, ["uncached", "concat"], e2e_prompt_len=8)
    n = estimate.tokens_that_fit(p, CFG, "float32", fits, budget_s)
    took_s = true_end_to_end_s(uncached, cached, 8, n)
    assert abs(took_s - budget_s) <= 0.2 * budget_s, (n, took_s)
