"""Every verdict on screen can come out the other way and says no more than was measured.

Sentences that state a regime are computed from the run's own measurements (or absent); a run
without measured peaks is drawn without shares of a measured peak; the correctness lab's caption
says what its matrix shows; the precision and scope experiments gate their modes.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from instruments.store.results import collect_meta, new_run, save_run
from ui.apptest import open_page, wait_job
from ui.figures_perf import Ceiling, floor_sentence, share_sentence

from .test_app import results

__all__ = ["results"]
pytestmark = pytest.mark.timeout(300)


def _rows(latency_ms: float) -> pd.DataFrame:
    return pd.DataFrame([{"mode": "concat", "phase": "decode", "context_len": t,
                          "latency_ms": latency_ms * (1 + t / 1000), "bytes": 10**9,
                          "tflops": 0.01} for t in (10, 100)])


def test_the_floor_sentence_is_computed_from_the_run() -> None:
    # 1 GB per step at 10 GB/s: a 100 ms floor. 150 ms and 165 ms steps: 1.5x and 1.65x.
    text = floor_sentence(_rows(150.0), {"read_gbps": 10.0})
    assert "1.5–1.6×" in text and "10 GB/s" in text
    slow = floor_sentence(_rows(900.0), {"read_gbps": 10.0})
    assert "9.1–9.9×" in slow  # the same sentence comes out the other way on other numbers
    assert floor_sentence(_rows(150.0), None) is None  # no peaks measured: no claim at all
    assert "cached steps 0.1–0.1%" in share_sentence(_rows(1.0), Ceiling("measured", 10.0))


def test_a_run_without_peaks_is_drawn_without_measured_shares(results: Path) -> None:
    rows = [{"mode": m, "context_len": t, "latency_ms": 1.0 + t / 100}
            for m in ("uncached", "concat") for t in (8, 64)]
    meta = collect_meta(model="gpt2", device="cpu", device_name="Another CPU", dtype="float32",
                        batch_size=1, peaks={"listed": None, "measured": None})
    save_run(new_run("latency_sweep", meta, {"latency": rows}), results)
    at = open_page("flops")
    at.selectbox(key="flops_source").set_value(next(
        o for o in at.selectbox(key="flops_source").options if "Another CPU" in o)).run()
    captions = " ".join(c.value for c in at.caption)
    assert "No peak recorded for that machine" in captions
    assert not any("measured here" in str(e.value) for e in at.get("markdown"))
    assert "The roofline needs a device peak." in [i.value for i in at.info]


def test_the_correctness_caption_says_what_the_matrix_shows(results: Path) -> None:
    at = open_page("correctness")
    at.number_input(key="correct_new").set_value(12)
    at.button[0].click().run()
    job = wait_job(at, "correct_job")
    checks = pd.DataFrame(job.tables["checks"])
    caught = checks[(checks["bug"] == "cache_order") & (checks["passed"] == False)]  # noqa: E712
    caption = next(c.value for c in at.caption if "caught by" in c.value)
    assert f"cache_order was caught by {caught['check'].iloc[0].split(' (')[0]}." in caption
    assert "only the multi-token append sees every bug" not in caption.lower()
