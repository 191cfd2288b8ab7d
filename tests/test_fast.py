"""Modes 6-9: the fast CPU path, the graph-friendly and read-only steps, and their set-up costs.

Every mode must give mode 1's greedy tokens in fp32. On a CPU the CUDA-graph step and the
read-only compiled step are checked eagerly (same code, no capture / no compile); compiling is
opt-in (``KV_LAB_COMPILE_TESTS=1``, marker ``slow``): it costs 1-2 minutes on 2 cores.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine import GPT, GPTConfig, decode, make_decoder, modes
from engine.decoders.captured import CudaGraphDecoder
from engine.decoders.compiled import CompiledDecoder
from engine.decoders.fast import FastDecoder, PackedLinear
from engine.models.state import ModelState
from engine.modes import MODES
from instruments.checks.gate import Gate
from instruments.measure.memory import step_memory_growth

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=128, vocab_size=256)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
COMPILE = pytest.mark.skipif(not os.environ.get("KV_LAB_COMPILE_TESTS"),
                             reason="compiles for minutes: set KV_LAB_COMPILE_TESTS=1")


def tiny(device: str = "cpu") -> GPT:
    return GPT.random(CFG, seed=1, std=0.2, device=device)


def prompt(batch: int = 2, n: int = 8, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, CFG.vocab_size, (batch, n), generator=gen).to(device)


def same_as_mode1(model: GPT, dec, p: torch.Tensor, n: int = 40) -> bool:
    want = decode(make_decoder(model, "uncached", batch_size=p.size(0)), p, n).tokens
    return torch.equal(want, decode(dec, p, n).tokens)


def test_all_modes_registered_with_labels() -> None:
    for name in ("cuda_graph", "compiled", "fast", "fast_compiled"):
        assert name in MODES and MODES[name].cached
    assert MODES["compiled"].slow_setup and MODES["fast_compiled"].slow_setup
    assert not MODES["fast"].slow_setup
    assert MODES["fast"].label.startswith("8 ·")


@pytest.mark.parametrize("batch,n", [(2, 8), (1, 1)])
def test_fast_equals_mode1(batch: int, n: int) -> None:
    model = tiny()
    assert same_as_mode1(model, make_decoder(model, "fast", batch_size=batch),
                         prompt(batch, n))


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_fast_logits_match_the_model(chunks: int) -> None:
    """Split or not, padded or not: the same logits as GPT.forward to float32 rounding."""
    model = tiny()
    fast = FastDecoder(model, batch_size=2, chunks=chunks)
    ref = make_decoder(model, "prealloc_fused", batch_size=2)
    p = prompt()
    a, b = fast.prefill(p), ref.prefill(p)
    worst = 0.0
    for _ in range(20):
        token = b.argmax(-1, keepdim=True)
        a, b = fast.step(token), ref.step(token)
        worst = max(worst, float((a - b).abs().max()))
    assert worst < 2e-5 * max(1.0, float(b.abs().max()) / 10)


def test_fast_logits_match_transformers() -> None:
    from engine.models.gpt2.weights import to_transformers

    model = tiny()
    hf = to_transformers(model)
    p = prompt(1, 17)
    with torch.no_grad():
        want = hf(input_ids=p, use_cache=False).logits[:, -1]
    dec = make_decoder(model, "fast")
    dec.prefill(p[:, :16])
    got = dec.step(p[:, 16:17])
    # 1.7e-6 measured (largest logit ~5; 4.8e-6 at gpt2's shapes): an exact path's rounding,
    # where a wrong transpose, bias or scale moves the logits by whole units
    assert float((got - want).abs().max()) < 5e-6


def test_fast_reports_its_extra_memory_and_reuses_the_packing() -> None:
    model = tiny()  # a fresh model: nothing packed yet
    a = make_decoder(model, "fast")
    b = make_decoder(model, "fast")
    assert a.weights is b.weights  # packed once per model
    d, v = CFG.n_embd, CFG.vocab_size
    role_bytes = {"c_attn": 3 * d * d, "attn.c_proj": d * d, "c_fc": 4 * d * d,
                  "mlp.c_proj": 4 * d * d}
    copies = ("packed", "interleaved")
    copied = 4 * (CFG.n_layer * sum(n for r, n in role_bytes.items()
                                    if a.weights.choice[r] in copies)
                  + (d * v if a.weights.choice["lm_head"] in copies else 0))
    # a packed or interleaved role holds a copy of its weights (+ padding and biases); a role
    # the kernel serves over the model's own weights none
    assert copied <= a.extra_bytes <= copied * 1.1 + 4 * CFG.n_layer * 9 * d
    with torch.no_grad():
        model.lm_head.weight.add_(0.0)  # an in-place write: the packing is stale
    assert make_decoder(model, "fast").weights is not a.weights


def test_packed_linear_handles_odd_widths_and_batches() -> None:
    gen = torch.Generator().manual_seed(0)
    w, b, x = (torch.randn(7, 5, generator=gen), torch.randn(7, generator=gen),
               torch.randn(3, 5, generator=gen))
    for chunks in (1, 2, 4):
        lin = PackedLinear.from_out_in(w, b, chunks)
        assert torch.allclose(lin(x), torch.nn.functional.linear(x, w, b), atol=1e-6)
        assert torch.allclose(lin(x[:1]), torch.nn.functional.linear(x[:1], w, b), atol=1e-6)


def test_cuda_graph_step_is_exact_run_eagerly() -> None:
    """The captured step's code (position tensor, index_copy_, masked full-capacity SDPA)."""
    model = tiny()
    for batch, n in ((2, 8), (1, 1)):
        dec = CudaGraphDecoder(model, batch_size=batch, capture=False)
        assert same_as_mode1(model, dec, prompt(batch, n))


def test_read_only_step_is_exact_run_eagerly() -> None:
    """The compiled modes' step, uncompiled: it reads the cache, the caller writes the row."""
    model = tiny()
    for batch, n in ((2, 8), (1, 1)):
        dec = CompiledDecoder(model, batch_size=batch, variant="eager")
        assert dec.compile_s == 0.0
        assert same_as_mode1(model, dec, prompt(batch, n))


def test_a_second_decoder_takes_the_static_cache_over() -> None:
    model = tiny()
    a = CompiledDecoder(model, variant="eager")
    logits = a.prefill(prompt(1))
    b = CompiledDecoder(model, variant="eager")
    b.prefill(prompt(1))
    with pytest.raises(RuntimeError, match="prefill again"):
        a.step(logits.argmax(-1, keepdim=True))


def test_cuda_graph_is_unavailable_on_a_cpu() -> None:
    model = tiny()
    assert modes.available("cuda_graph", "cpu") == (False, "needs a CUDA GPU")
    assert "cuda_graph" not in modes.defaults("cpu")
    assert "fast" in modes.defaults("cpu")
    with pytest.raises(ValueError, match="CUDA GPU"):
        make_decoder(model, "cuda_graph")


def test_rewind_re_times_the_same_step() -> None:
    model = tiny()
    for mode in ("concat", "prealloc_fused", "fast", "uncached_last"):
        dec = make_decoder(model, mode, batch_size=2)
        token = dec.prefill(prompt()).argmax(-1, keepdim=True)
        first = dec.step(token)
        dec.rewind(8)
        assert dec.length == 8
        assert torch.allclose(dec.step(token), first, atol=1e-6), mode


def test_preallocated_steps_keep_no_memory() -> None:
    model = tiny()
    row = 2 * CFG.n_layer * CFG.n_embd * 4  # one token's K and V, every layer, fp32
    for mode, want in (("concat", row), ("prealloc_fused", 0), ("fast", 0)):
        dec = make_decoder(model, mode, capacity=64)
        assert step_memory_growth(dec, prompt(1), 12)["net_bytes_per_step"] == want, mode


@pytest.mark.slow
@COMPILE
@pytest.mark.parametrize("name", ["compiled", "fast_compiled"])
def test_compiled_modes_equal_mode1(name: str) -> None:
    model = tiny()
    assert Gate(model).check(name).passed
    dec = make_decoder(model, name)
    assert dec.compile_s > 0  # measured once, reported apart from the steps
    assert same_as_mode1(model, dec, prompt(1, 1), n=24)  # one cached token: its own graph


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("name", ["cuda_graph", "fast", "prealloc_fused"])
def test_gpu_modes_equal_mode1(name: str) -> None:
    model = tiny("cuda")
    assert Gate(model, batch=2).check(name).passed


@pytest.mark.cuda
@CUDA
def test_cuda_graph_reports_capture_and_replays() -> None:
    model = tiny("cuda")
    dec = make_decoder(model, "cuda_graph", batch_size=1)
    assert dec.graph is not None and dec.compile_s > 0
    assert same_as_mode1(model, dec, prompt(1, 8, "cuda"))


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("name", ["compiled", "fast_compiled"])
def test_compiled_modes_on_gpu(name: str) -> None:
    model = tiny("cuda")
    assert Gate(model).check(name).passed


def test_attribution_counts_each_cuda_step_once() -> None:
    """The profiler lists a record_function span on the CPU and again as a GPU annotation."""
    from types import SimpleNamespace as NS

    from instruments.experiments.attribution import STEP_SPAN, _read_trace

    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def ev(name, device, start, end, children=()):
        return NS(name=name, device_type=device, time_range=NS(start=start, end=end),
                  cpu_children=list(children))

    events = []
    for step in range(2):  # two steps of 100 µs: 3 operators, 3 launches, 3 kernels of 10 µs
        t = step * 1000
        ops = [ev("aten::mm", cpu, t + 10 + 20 * i, t + 25 + 20 * i) for i in range(3)]
        events += [ev(STEP_SPAN, cpu, t, t + 100, ops), ev(STEP_SPAN, gpu, t, t + 100), *ops]
        events += [ev("cudaLaunchKernel", cpu, t + 12 + 20 * i, t + 14 + 20 * i) for i in range(3)]
        events += [ev("gemv_kernel", gpu, t + 30 + 20 * i, t + 40 + 20 * i) for i in range(3)]
    trace = _read_trace(NS(events=lambda: events), cuda=True)
    assert trace.ops_per_step == 3 and trace.launches_per_step == 3  # not halved by the duplicate
    assert trace.kernels_per_step == 3  # the GPU-side annotation is not a kernel
    assert trace.device_ms == pytest.approx(0.030)  # 3 x 10 µs, not + the 100 µs annotation
    assert trace.profiled_step_ms == pytest.approx(0.1)


def test_a_captured_graph_is_uploaded_before_any_timed_step() -> None:
    from contextlib import contextmanager

    from engine.decoders.captured import capture_and_upload

    calls: list[str] = []

    class StubGraph:
        def replay(self) -> None:
            calls.append("replay")

    @contextmanager
    def capture(graph, capture_error_mode="global"):
        calls.append(f"capture ({capture_error_mode})")
        yield

    out = capture_and_upload(StubGraph(), lambda: calls.append("step") or torch.ones(1), capture)
    assert calls == ["capture (thread_local)", "step", "replay"] and out.item() == 1.0


def test_fast_without_the_kernel_packs_every_role_and_with_it_gives_the_same_logits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each role of mode 8 goes through the packed copies or the C++ kernel, whichever measured
    faster; both must give GPT.forward's logits. Forced each way here."""
    from engine.decoders import fast
    from engine.kernels import cpu as kernels

    model = tiny()
    with torch.no_grad():  # biases start at zero: give them values a dropped bias would miss
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(2))
    idx = torch.randint(0, CFG.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(idx, use_cache=False)[0][:, -1]
    for forced in ("packed", "kernel", "linear"):
        if forced == "kernel" and not kernels.available()[0]:
            continue

        def choose(packed, own, device, dtype, forced=forced):  # noqa: ANN001, ANN202
            if forced == "packed":
                return list(packed), "packed", {}
            way = fast.KernelLinear if forced == "kernel" else fast.OwnLinear
            return [way(m.weight.detach(), None if m.bias is None else m.bias.detach())
                    for m in own], forced, {}

        monkeypatch.setattr(fast, "_choose", choose)
        ModelState.of(model).drop(("packed",))  # the decoder packs again, the forced way
        dec = fast.FastDecoder(model, capacity=16, chunks=2)
        w = dec.weights
        assert set(w.choice.values()) == {forced}
        assert (w.extra_bytes == 0) == (forced != "packed")
        dec.prefill(idx[:, :8])
        got = dec.step(idx[:, 8:9])
        assert float((got - want).abs().max()) < 5e-6, forced


def test_every_way_a_role_can_take_gives_f_linears_product() -> None:
    """Whichever way ``_choose`` picks for a role (timing decides, so a test cannot), its
    product is F.linear's: the packed copies, the kernel over the model's weights, the kernel
    over the interleaved copy -- for a decode step's rows and for a prefill's many."""
    from engine.decoders.fast import InterleavedLinear, KernelLinear, OwnLinear, _choose
    from engine.kernels import cpu as kernels

    if not kernels.available()[0]:
        pytest.skip(f"the C++ kernel is not built: {kernels.available()[1]}")
    gen = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(64, 40)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 64, generator=gen))
    ways = {"packed": PackedLinear.from_out_in(lin.weight, lin.bias, 2),
            "kernel": KernelLinear(lin.weight.detach(), lin.bias.detach()),
            "linear": OwnLinear(lin.weight.detach(), lin.bias.detach()),
            "interleaved": InterleavedLinear(lin.weight.detach(),
                                             kernels.interleave(lin.weight),
                                             lin.bias.detach())}
    for rows in (1, 5, 12):
        x = torch.randn(rows, 64, generator=gen)
        want = torch.nn.functional.linear(x, lin.weight, lin.bias).detach()
        for how, way in ways.items():
            assert (way(x) - want).abs().max() <= 1e-5, (how, rows)
    chosen, how, ms = _choose([ways["packed"]], [lin], torch.device("cpu"), torch.float32)
    assert set(ms) == {"packed", "linear", "kernel", "interleaved"} and how in ms
    assert len(chosen) == 1 and type(chosen[0]) is type(ways[how])


@pytest.mark.parametrize("times, want", [
    ({"packed": 10.0, "linear": 10.2, "kernel": 10.5, "interleaved": 9.0}, "interleaved"),
    ({"packed": 10.0, "linear": 10.2, "kernel": 10.5, "interleaved": 11.0}, "linear"),
    ({"packed": 10.0, "linear": 10.2, "kernel": 10.1, "interleaved": 11.0}, "kernel"),
    ({"packed": 10.0, "linear": 12.0, "kernel": 11.0, "interleaved": 11.0}, "packed"),
])
def test_a_way_that_holds_no_copy_wins_only_within_three_percent(
        monkeypatch: pytest.MonkeyPatch, times: dict[str, float], want: str) -> None:
    """The choice is the fastest way, except that the kernel over the model's weights, then
    F.linear over them, take a tie within 3% (they hold no copy)."""
    from engine.decoders import fast
    from engine.kernels import cpu as kernels

    if not kernels.available()[0]:
        pytest.skip(f"the C++ kernel is not built: {kernels.available()[1]}")
    lin = torch.nn.Linear(64, 32)
    kinds = {fast.PackedLinear: "packed", fast.OwnLinear: "linear", fast.KernelLinear: "kernel",
             fast.InterleavedLinear: "interleaved"}
    monkeypatch.setattr(fast, "_pass_ms", lambda fns, x: times[kinds[type(fns[0])]])
    packed = [PackedLinear.from_out_in(lin.weight, lin.bias, 1)]
    chosen, how, ms = fast._choose(packed, [lin], torch.device("cpu"), torch.float32)
    assert how == want and kinds[type(chosen[0])] == want and ms == times
