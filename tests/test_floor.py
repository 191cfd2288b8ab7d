"""The Floor lab: attribution adds up, the staircase and scope run on tiny shapes, the CPU bench
smoke-runs, the figures build without Streamlit and the page runs a profile end to end."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import pytest
import torch

from engine import GPT, GPTConfig, make_decoder
from instruments.costmodel import costs
from instruments.experiments import get
from instruments.experiments.attribution import AttributionParams, attribute_step, with_floors
from instruments.experiments.precision import PrecisionParams
from instruments.experiments.scope import ScopeParams
from instruments.experiments.staircase import SHAPES, StaircaseParams, default_ts
from instruments.measure.device import Peaks
from instruments.spine import Loaded

from .conftest import loaded_model

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=128, vocab_size=256)
# Fixed rates: no re-measuring in every test (the routine itself is tested in test_hardware).
PEAKS = Peaks("cpu", "float32", matmul_tflops=0.05, matmul_n=1, read_gbps=5.0,
              read_kernel="sum", copy_gbps=5.0, bandwidth_bytes=1)
ROOT = Path(__file__).resolve().parents[1]


def tiny() -> GPT:
    return GPT.random(CFG, seed=1, std=0.2)


@pytest.fixture(autouse=True)
def fixed_peaks(monkeypatch: pytest.MonkeyPatch) -> None:
    from instruments.measure import device

    monkeypatch.setattr(device, "peaks", lambda *a, **k: PEAKS)


def run(name: str, params: object, model: GPT | None = None, **kw: object) -> dict:
    loaded: Loaded = loaded_model(model or tiny())
    return get(name).run(loaded, params, **kw)


@pytest.mark.parametrize("mode", ["prealloc_fused", "fast", "uncached_last"])
def test_attribution_rows_count_the_step_that_ran(mode: str) -> None:
    """A real profile of each kind of step: what it counts and charges, none of it a timing.
    (Whether the profiled step agrees with the plain one is the host's: ``profile_tolerance_ms``
    says how far apart they may be on it; the split is checked on a made-up trace below.)"""
    row = attribute_step(tiny(), mode, 48, steps=12, peaks=PEAKS)
    # The profiled step's parts add up to it: time inside operators and the host's between them.
    assert row["ops_ms"] + row["python_ms"] == pytest.approx(row["profiled_step_ms"])
    assert row["profile_tolerance_ms"] >= row["profiler_cost_ms"] >= 0
    assert row["ops_per_step"] > 10  # the step's operator calls were found, nested ones too
    from engine.kernels import cpu as kernels
    if mode == "fast" and kernels.available()[0]:  # the step is one C++ call: its ATen calls
        assert 1 <= row["top_ops_per_step"] < row["ops_per_step"] / 2  # run nested inside it
    else:
        assert row["ops_per_step"] >= row["top_ops_per_step"] > 10
    assert row["kernels_per_step"] is None and row["device_ms"] is None  # a CPU run
    # The floors are charged for the step that ran: 48 tokens in view, the mode's own logits.
    cached = mode != "uncached_last"
    assert row["flops"] == costs.step_flops(CFG, 48, cached=cached, last_only=True)
    assert row["bytes"] == costs.step_bytes(CFG, "float32", 48, cached=cached, last_only=True)
    # The step's own spread is the interquartile range of its samples, not the tolerance.
    assert len(row["samples_ms"]) == 12
    q = statistics.quantiles(row["samples_ms"], n=4)
    assert row["spread_ms"] == pytest.approx(q[2] - q[0])
    assert 0 < row["explained_share"] <= 1


def test_a_profiled_step_is_split_from_the_median_step() -> None:
    """Five steps of a made-up CPU trace (µs): the parts come from the median step by wall time
    and add up to it; the slow step (another process took the core) drags none of them."""
    from types import SimpleNamespace as NS

    from instruments.experiments.attribution import STEP_SPAN, _read_trace

    cpu = torch.autograd.DeviceType.CPU

    def ev(name: str, start: float, end: float, children: tuple = ()) -> NS:
        return NS(name=name, device_type=cpu, time_range=NS(start=start, end=end),
                  cpu_children=list(children))

    events = []
    for i, (wall, op) in enumerate([(100, 30), (104, 31), (900, 800), (102, 40), (98, 20)]):
        t = i * 10_000
        ops = [ev("aten::mm", t + 5, t + 5 + op / 2), ev("aten::add", t + 60, t + 60 + op / 2),
               ev("aten::view", t + 61, t + 62)]  # nested inside the add: not a top-level part
        events += [ev(STEP_SPAN, t, t + wall, ops[:2]), *ops]
    events.append(ev("aten::mm", 99_000, 99_050))  # outside every step: not counted
    trace = _read_trace(NS(events=lambda: events), cuda=False)
    assert trace.profiled_step_ms == pytest.approx(0.102)  # the median of 98..900 µs
    assert trace.ops_ms == pytest.approx(0.040) and trace.python_ms == pytest.approx(0.062)
    assert trace.ops_ms + trace.python_ms == pytest.approx(trace.profiled_step_ms)
    assert trace.ops_per_step == 3 and trace.top_ops_per_step == 2
    assert trace.spread_ms == pytest.approx(0.004)  # walls 98 100 102 104 900: 104 - 100
    assert trace.device_ms is None and trace.kernels_per_step is None


def test_floors_and_parts_from_known_rates() -> None:
    """Round numbers at PEAKS' rates: 2e9 FLOPs at 0.05 TFLOP/s take 40 ms, 5e8 B at 5 GB/s
    100 ms. A 150 ms step busy for 120 ms: 100 ms of floor, 20 ms above it, 30 ms idle."""
    row = {"step_ms": 150.0, "busy_ms": 120.0, "flops": 2e9, "bytes": 5e8}
    r = with_floors(row, PEAKS)
    assert (r["flop_floor_ms"], r["byte_floor_ms"]) == (pytest.approx(40), pytest.approx(100))
    assert r["floor_ms"] == pytest.approx(100) and r["bound"] == "memory"
    assert r["floor_part_ms"] == pytest.approx(100) and r["excess_ms"] == pytest.approx(20)
    assert r["above_floor_ms"] == pytest.approx(50) and not r["floor_above_step"]
    assert r["explained_share"] == pytest.approx(130 / 150)
    # Busy for less than the floor: the floor's part is what the device was busy, nothing above.
    short = with_floors({**row, "busy_ms": 60.0}, PEAKS)
    assert short["floor_part_ms"] == pytest.approx(60) and short["excess_ms"] == 0
    assert short["explained_share"] == pytest.approx(1.0)
    # 1e10 FLOPs: a 200 ms compute floor, above the 150 ms step -- flagged, not hidden.
    big = with_floors({**row, "flops": 1e10}, PEAKS)
    assert big["bound"] == "compute" and big["floor_ms"] == pytest.approx(200)
    assert big["floor_above_step"] and big["above_floor_ms"] == pytest.approx(-50)


def test_attribution_rows_progress_and_stop() -> None:
    seen = []
    res = run("attribution", AttributionParams(["fast"], [2, 32, 128], steps=3),
              progress=seen.append)
    rows = res["tables"]["attribution"]
    assert [r["context_len"] for r in rows] == [5, 32, 126]  # clipped to what fits
    assert "clipped" in res["meta"]["note"] and seen[-1].done == seen[-1].total == 3
    assert res["meta"]["peaks"]["measured"]["read_gbps"] == 5.0  # the run carries its peaks
    stopped = run("attribution", AttributionParams(["fast"], [16, 32], steps=3),
                  should_stop=lambda: True)
    assert stopped["meta"]["partial"] and not stopped["tables"]["attribution"]


def test_staircase_on_a_tiny_shape() -> None:
    ts = [1, 7, 64, 128]
    seen = []
    res = run("staircase", StaircaseParams(ts, repeats=2, include_forward=True),
              progress=seen.append)
    shapes, totals = res["tables"]["staircase"], res["tables"]["totals"]
    streamed = [e.row for e in seen if e.table == "totals"]
    assert len(shapes) == len(ts) * len(SHAPES) and len(totals) == len(ts) == len(streamed)
    for total in totals:
        per = {r["shape"]: r["latency_ms"] for r in shapes if r["T"] == total["T"]}
        layer = sum(per[s] for s in SHAPES[:4])
        assert total["total_ms"] == pytest.approx(CFG.n_layer * layer + per["head"])
        assert total["forward_ms"] > 0
    head = next(r for r in shapes if r["shape"] == "head" and r["T"] == 64)
    assert (head["m"], head["k"], head["n"]) == (64, 64, 256)
    assert default_ts(1024, "cpu")[:3] == [1, 32, 64] and len(default_ts(1024, "cuda")) == 1024
    with pytest.raises(ValueError, match="outside 1..128"):
        run("staircase", StaircaseParams([0, 5]))


def test_scope_batch_and_model_sweeps_bounded() -> None:
    res = run("scope", ScopeParams("batch", [1, 2, 4], 32, steps=2, repeats=1))
    rows = res["tables"]["scope"]
    assert [r["batch_size"] for r in rows] == [1, 2, 4]
    assert all(r["speedup"] > 0 and r["flop_ratio"] > 1 for r in rows)
    capped = run("scope", ScopeParams("batch", [1, 256], 32, steps=2, repeats=1,
                                      max_seconds=1e-6))["tables"]["scope"]
    assert capped[1]["skipped"] and capped[1]["speedup"] is None
    sizes = run("scope", ScopeParams("model", ["gpt2"], 16, steps=2, repeats=1,
                                     max_seconds=1e-6))["tables"]["scope"]
    assert [r["model"] for r in sizes] == ["gpt2"] and sizes[0]["params"] == 124_439_808


def test_precision_compare_against_fp32() -> None:
    res = run("precision", PrecisionParams(["fp32", "bf16"], prompt_len=8, new_tokens=8,
                                           steps=2))
    fp32, bf16 = res["tables"]["precision"]
    assert fp32["top1_agreement"] == 1.0 and fp32["max_logit_diff"] == 0.0
    assert fp32["identical_prefix_tokens"] == 8
    assert bf16["weight_bytes"] * 2 == fp32["weight_bytes"]
    assert 0 < bf16["max_logit_diff"] < 5 and 0 <= bf16["top1_agreement"] <= 1
    with pytest.raises(ValueError, match="not offered"):
        run("precision", PrecisionParams(["tf32"]))


# ----------------------------------------------------------------------------------- figures
def _attr_rows() -> pd.DataFrame:
    res = run("attribution", AttributionParams(["fast"], [16, 64], steps=2))
    return pd.DataFrame(res["tables"]["attribution"])


def test_figures_build_with_titled_axes() -> None:
    from ui.floor_figures import (
        attribution_figure,
        attribution_table,
        counts_figure,
        precision_figure,
        precision_table,
        scope_figure,
        scope_table,
        shapes_figure,
        staircase_figure,
    )

    df = _attr_rows()
    fig = attribution_figure(df)
    assert isinstance(fig, go.Figure) and len(fig.data) == 7  # parts, step, shares, floors
    assert "(ms)" in fig.layout.yaxis.title.text and "tokens" in fig.layout.xaxis.title.text
    assert fig.layout.barmode == "stack"
    assert len(counts_figure(df).data) == 1 and not attribution_table(df).empty
    stair = run("staircase", StaircaseParams([1, 64], repeats=1))["tables"]
    assert len(staircase_figure(pd.DataFrame(stair["totals"])).data) == 2
    assert len(shapes_figure(pd.DataFrame(stair["staircase"])).data) == len(SHAPES)
    scope = pd.DataFrame(run("scope", ScopeParams("batch", [1, 2], 16, steps=2,
                                                  repeats=1))["tables"]["scope"])
    sfig = scope_figure(scope)
    assert len(sfig.data) == 2 and "×" in sfig.layout.yaxis.title.text
    assert list(scope_table(scope)["batch_size"]) == [1, 2]
    prec = pd.DataFrame(run("precision", PrecisionParams(["fp32"], prompt_len=8, new_tokens=4,
                                                         steps=2))["tables"]["precision"])
    assert "MiB" in precision_table(prec).columns[2]
    assert precision_figure(prec).layout.yaxis.title.text == "time per decode step (ms)"
    for empty in (attribution_figure(pd.DataFrame()), staircase_figure(pd.DataFrame()),
                  scope_figure(pd.DataFrame()), precision_figure(pd.DataFrame())):
        assert isinstance(empty, go.Figure) and empty.layout.xaxis.title.text


def _script(name: str, monkeypatch: pytest.MonkeyPatch):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_gpu_check_dry_run_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The script's logic end to end on a CPU with no time budget: every stage saves a file."""
    from instruments.store.results import load_runs

    gpu_check = _script("gpu_check", monkeypatch)
    # --total-s 0 puts every stage past its budget at once: the watchdog's 30 s of grace would
    # judge how fast this host runs a stage's first point (tests/test_gpu_check.py tests it)
    monkeypatch.setattr(sys.modules["device_check.runner"], "GRACE_S", 3600.0)
    if not torch.cuda.is_available():
        assert gpu_check.main(["--device", "cuda"]) == 2  # a clear refusal, no traceback
    measuring = [s.name for s in gpu_check.STAGES if s.name not in ("tests", "pages")]
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path),
                           "--total-s", "0", "--stages", ",".join(measuring)]) == 0
    kinds = sorted(r["kind"] for r in load_runs(tmp_path).runs)
    assert kinds == ["attribution", "batch_curve", "bench", "device_check", "floor_summary",
                     "hardware", "kv_planner", "latency_sweep", "latency_sweep", "latency_sweep",
                     "memory", "peers", "prefix_ttft", "serving", "speculate", "staircase",
                     "step_prediction"]
    # every stage saves its run (sdpa-backends and triton-tiles are the GPU's: skipped here;
    # the prefix stage's chat needs SmolLM2's template: not in the dry run's llama-tiny)
    # three sweeps: GPT-2 in fp32 and bf16, then the Llama family
    families = sorted(r["meta"].get("family", "") for r in load_runs(tmp_path).runs
                      if r["kind"] == "latency_sweep")
    assert families.count("llama") == 1, families
    out = capsys.readouterr().out
    assert "bandwidth floor" in out
    stages = sys.modules["device_check.stages"]  # the stages' helpers, beside the script
    ok = {"fits": True, "tensor_bytes": 2048, "formula_bytes": 2048, "tensors": 2,
          "allocated_delta_bytes": 2048 + 1024, "reserved_delta_bytes": 2**21}
    assert "within rounding" in stages.planner_verdict(ok)
    assert "OUTSIDE rounding" in stages.planner_verdict({**ok, "allocated_delta_bytes": 2**20})
    assert "MISMATCH" in stages.planner_verdict({**ok, "formula_bytes": 4096})
    rows = [{"mode": "cuda_graph", "cached": True, "phase": "decode", "context_len": 100,
             "latency_ms": 2.0}]
    line = stages.floor_lines(rows, CFG, 5.0, "float32")[0]
    from instruments.costmodel.costs import activation_bytes

    assert line["floor_ms"] == pytest.approx(
        (4 * (CFG.n_layer * 12 * 64 * 64 + 64 * 256) + 100 * 2 * 2 * 64 * 4
         + activation_bytes(CFG, "float32", 100, True)) / 5e9 * 1e3)
    assert "goal ≤ 2×" in line["text"]


def test_scope_and_precision_gate_their_modes_first() -> None:
    from instruments.checks.bugs import inject_bug

    model = tiny()
    with inject_bug(model, "positions"):
        res = run("scope", ScopeParams("batch", [1, 2], 16, steps=2, repeats=1), model)
    assert res["tables"]["scope"] == [] and "prealloc_fused not timed" in res["meta"]["note"]
    assert [c["passed"] for c in res["tables"]["checks"]] == [True, False]
    prec = run("precision", PrecisionParams(["fp32", "bf16"], prompt_len=8, new_tokens=4,
                                            steps=2))
    # bf16 is checked against mode 1 in bf16, with bf16's tolerance: never refused for rounding
    assert [c["passed"] for c in prec["tables"]["checks"]] == [True, True]
    assert len(prec["tables"]["precision"]) == 2


def test_a_floor_above_the_step_remeasures_the_peaks_and_flags_what_stays(monkeypatch) -> None:
    """Peaks set relative to any step a host can take, not to this host's speed: the first are
    absurdly low (a floor of minutes), the fresh ones absurdly high (a floor of picoseconds)."""
    from instruments.measure import device

    slow = Peaks("cpu", "float32", matmul_tflops=1e-9, matmul_n=1, read_gbps=1e-9,
                 read_kernel="sum", copy_gbps=1.0, bandwidth_bytes=1)
    quick = Peaks("cpu", "float32", matmul_tflops=1e9, matmul_n=1, read_gbps=1e9,
                  read_kernel="sum", copy_gbps=1e9, bandwidth_bytes=1)
    calls: list[bool] = []

    def peaks(*a, fresh: bool = False, **k) -> Peaks:
        calls.append(fresh)
        return quick if fresh else slow

    monkeypatch.setattr(device, "peaks", peaks)
    res = run("attribution", AttributionParams(["fast"], [16], steps=2))
    (row,) = res["tables"]["attribution"]
    assert row["floor_ms"] < 1e-6 * row["step_ms"]  # so far below that no host flips the verdict
    assert calls == [False, True]  # measured once more because a floor beat the step
    assert row["bandwidth_gbps"] == 1e9 and not row["floor_above_step"]
    assert "measured again" in res["meta"]["note"]
    assert "still sit below" not in res["meta"]["note"]
    monkeypatch.setattr(device, "peaks", lambda *a, **k: slow)  # still too low: flagged
    res = run("attribution", AttributionParams(["fast"], [16], steps=2))
    (row,) = res["tables"]["attribution"]
    assert row["floor_ms"] > 1e6 * row["step_ms"] and row["floor_above_step"]
    assert "still sit below their floor" in res["meta"]["note"]


def test_static_shape_modes_are_charged_for_the_whole_cache() -> None:
    from engine.decoders.captured import CudaGraphDecoder

    dec = CudaGraphDecoder(tiny(), capacity=128, capture=False)
    assert dec.attended_keys(10) == 128 and make_decoder(tiny(), "concat").attended_keys(10) == 10
    assert costs.step_flops(CFG, 10, True, keys=128) - costs.step_flops(CFG, 10, True) == (
        4 * CFG.n_layer * CFG.n_embd * 118)
    assert costs.step_bytes(CFG, "float32", 10, True, keys=128) > costs.step_bytes(
        CFG, "float32", 10, True) + 118 * costs.kv_bytes_per_token(CFG, "float32")


def test_a_step_without_excess_is_explained_exactly_once() -> None:
    """Operators faster than the floor (the fused step on a tiny model): no excess, and the
    share explained is 1, not a rounding above it (2.435 and 1.425 ms gave 1.0000000000000002
    as (floor part + idle) / step)."""
    from instruments.experiments.attribution import with_floors

    row = with_floors({"step_ms": 2.435, "busy_ms": 1.425, "flops": 1, "bytes": 10**9}, PEAKS)
    assert row["floor_ms"] > row["busy_ms"] and row["excess_ms"] == 0
    assert row["explained_share"] == 1.0
