"""The generated blocks over SmolLM2's and llama.cpp's runs (``instruments.store.readme_llama``):
each says what its runs say, and can say that llama.cpp was faster."""

from __future__ import annotations

from pathlib import Path

from instruments.store import readme
from tests.test_readme import _save, copy

__all__ = ["copy"]  # the fixture, re-exported for pytest


def _peers(ours_q4_ms: float, theirs_q4_ms: float) -> list[dict]:
    def row(engine: str, ms: float, **extra: object) -> dict:
        return {"engine": engine, "context_len": 128, "latency_ms": ms, "floor_ms": 40.0,
                "x_floor": ms / 40.0, **extra}
    return [row("fast", 30.0, kind="mode", precision="float32"),
            row("llamacpp_f32", 40.0, kind="peer", precision="float32"),
            row("q4_1_weights", ours_q4_ms, kind="mode", precision="q4_1"),
            row("llamacpp_q4_1", theirs_q4_ms, kind="peer", precision="q4_1"),
            {"engine": "llamacpp_q8_0", "available": False, "latency_ms": None,
             "why": "make peers"}]


def _summary(root: Path) -> str:
    body = (root / "README.md").read_text()
    return body.split("<!-- generated: llamacpp-summary -->")[1].split("<!-- end:")[0]


def test_the_llamacpp_lines_say_ours_over_theirs_whichever_is_faster(copy: Path) -> None:
    for name in ("peers-llamacpp", "peers"):
        for p in (copy / "docs" / "runs" / name).glob("*.json"):
            p.unlink()
    folder = copy / "docs" / "runs" / "peers-llamacpp"
    _save(folder, "peers", {"peers": _peers(10.0, 12.5)}, "2026-12-01T10:00:00+00:00",
          model="smollm2-135m", kernel_isa="avx2")
    # GPT-2's peers run without llama.cpp (older, or not installed): left out of both blocks
    _save(copy / "docs" / "runs" / "peers", "peers",
          {"peers": [r for r in _peers(10.0, 12.5) if r["engine"] == "fast"]},
          "2026-12-01T09:00:00+00:00")
    readme.write(copy)
    summary = _summary(copy)
    assert "**smollm2-135m** (1 run; 1 thread(s), 128 tokens): ours ÷ llama.cpp's step " \
        "Q4_1 0.80×, Q8_0 not compared (llama.cpp's make peers), F32 0.75×; our q4_1 step " \
        "0.25× a read of the fp32 weights." in summary
    assert "llama.cpp's is the host's): avx2 on Test CPU (" in summary
    assert "; never run on avx512-vnni, avx512, avx-vnni, scalar:" in summary
    assert "gpt2" not in summary
    table = (copy / "docs" / "llama.md").read_text()
    assert "| smollm2-135m | avx2 | 1 | 128 | 10.0 / 12.5 = 0.80 | – | 30.0 / 40.0 = 0.75 " \
        "| 0.25 |" in table

    # a newer run where llama.cpp wins: the span over both runs keeps the miss in view
    _save(folder, "peers", {"peers": _peers(15.0, 12.0)}, "2026-12-01T11:00:00+00:00",
          model="smollm2-135m", kernel_isa="avx512-vnni")
    readme.write(copy)
    summary = _summary(copy)
    assert "(2 runs; 1 thread(s), 128 tokens)" in summary and "Q4_1 0.80–1.25×" in summary
    assert "host's): avx512-vnni on Test CPU (" in summary and "; avx2 on Test CPU (" in summary
    assert "; never run on avx512, avx-vnni, scalar:" in summary  # widest first, the rest said
