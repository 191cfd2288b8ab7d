"""Calibration: the parts a decode step is made of, each timed alone on this device.

``calibrate(model, modes, batch_size, max_context, repeats, tick)`` -> rows, each
``{"part", "variant", "scale", "x", "ms", "samples_ms"}``; ``instruments.costmodel.predict`` sums
them into a predicted step. Parts (every one over all the model's layers, as a step runs them),
the same for every model family: what differs is read off the model and its config.

  layers     variant = weight layout ("out_in": ``F.linear`` on the model's ``[out, in]``
             weights; "packed": mode 8's chosen products; "int8" / "bfloat16": the weight-only
             rungs' modules, ``engine.quant.weight_only``), x = rows: every block's Linear matmuls
             (``lineup.block_linears``: GPT-2's q|k|v, o, MLP up and down; the Llama family's
             q, k and v -- k and v only n_kv_head heads wide --, o, gate, up, down) on x rows (1
             per sequence for a cached step, T for a forward)
  head       the output projection (``lineup.head_linear``: 50,257 rows for GPT-2, 49,152 for
             SmolLM2) on x rows, same layouts
  attention  variant = cache kind + core ("concat_seed", "prealloc_fused", ...), x = context S:
             one new token per sequence written into the mode's own cache class (holding S - 1
             tokens of n_kv_head heads) and attended by n_head queries over S keys -- explicit
             scores with the write-up's mask ("seed"), ``scaled_dot_product_attention``
             ("fused"), or "prealloc_step": what the one-token steps' ``attend_filled`` runs
             (modes 8, 12, 13, GPT-2's ``engine.models.gpt2.step`` and the Llama family's
             ``engine.models.llama.step`` alike: the C++ kernel on a CPU, grouped-query where K/V
             heads are fewer)
  attention_full  variant "seed", x = T: an uncached forward's T queries over T keys
  small      x = rows: the family's operators that are no matmul and no attention, at their real
             widths (the family table's ``small_ops``) -- GPT-2: layer norms, GELU, residual
             adds, the heads' re-assembly, token and position embeddings; the Llama family:
             RMSNorms, RoPE's angles and its rotation of q and k, SiLU(gate) x up, residual
             adds, the heads' re-assembly, the embedding lookup
  hollow     variant = mode, x = context: the mode's own decoder running a whole step (cached
             modes) or forward (uncached) on a *hollow* model of the same family
             (``hollow_model``) -- the same number of layers and the same code, widths of 4 and
             a vocabulary of 8 -- so arithmetic is nil and what is left is operator dispatch,
             module calls and the Python of the step and its loop

Every part except "hollow" is timed twice: at the model's real widths (``scale`` "real") and on
the hollow model ("hollow"). With ``busy`` (the default on cuda, where the host only queues the
kernels) each real part also gets a "device" row, the time its kernels kept the device busy
(``instruments.measure.busy``), and each hollow step a "host" row: the host's time to issue it,
synchronised before and not after, with ``kernels`` (its launches) beside it. The predictor
charges ``hollow`` step time once and, for each part, only real - hollow: the work that grows
with the widths, without counting a part's dispatch twice (on cuda: see ``predict``). x values
are a geometric grid (``grid``); the predictor interpolates between them.
Samples: ``repeats`` timed calls after one warm-up (2 for a piece over half a second), more
while they disagree by more than 10%; on a CPU, a call that another process disturbed is
taken again. A piece this module cannot time (a weight storage it does not know, a family
without small operators here) is left out, and the predictor says "not calibrated: ...".
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from engine.decoders.fast import fast_weights
from engine.loop import random_prompt
from engine.models.attention import Attention, attend_filled, through_cache
from engine.models.base import CausalLM
from engine.models.config import ModelConfig
from engine.models.state import ModelState
from engine.quant.weight_only import STORAGES, weight_only
from instruments import lineup
from instruments.costmodel import predict
from instruments.lineup import make_cache, small_ops
from instruments.measure import busy as busy_time
from instruments.measure.sampler import Sampler

Tick = Callable[[str], bool]  # (what is being timed) -> True when asked to stop
HOLLOW_WIDTH, HOLLOW_VOCAB = 4, 8


class NotCalibrated(Exception):
    """A piece this module cannot time for this model (the predictor then says why not)."""


def grid(top: int, fine_below: int | None = None) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, ... (powers of two and 1.5x between) up to and including ``top``;
    with ``fine_below``, powers of two only from there on (a forward's matmuls at long contexts
    cost seconds, and grow as a power of T between the points)."""
    points = {1, top}
    p = 1
    while p < top:
        mid = 3 * p // 2 if fine_below is None or p < fine_below else p
        points.update(x for x in (p, mid) if 1 <= x <= top)
        p *= 2
    return sorted(points)


def hollow_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with widths of 4 and a vocabulary of 8, everything else (layers, positions,
    mask, RoPE's base, the tie) kept. Its heads stay legal and take the same code paths: one
    head of 4 for a model whose every head caches K/V (GPT-2); under grouped-query attention
    2 query heads over 1 K/V head of size 2 (even: RoPE turns pairs), so the hollow step still
    runs the grouped path; an MLP of width 4."""
    fields = {f.name for f in dataclasses.fields(cfg)}
    shapes: dict[str, Any] = {"n_embd": HOLLOW_WIDTH, "vocab_size": HOLLOW_VOCAB, "n_head": 1}
    if cfg.n_kv_head != cfg.n_head:
        shapes.update(n_head=2, n_kv_head=1)
    elif "n_kv_head" in fields:
        shapes["n_kv_head"] = 1
    if "n_hidden" in fields:
        shapes["n_hidden"] = HOLLOW_WIDTH
    return dataclasses.replace(cfg, **{k: v for k, v in shapes.items() if k in fields})


def hollow_model(model: CausalLM) -> CausalLM:
    """Same family, same layers, same code, widths 4, vocabulary 8 (``hollow_config``)."""
    return type(model).random(hollow_config(model.config), device=model.device,
                              dtype=model.dtype, seed=0)


def _flush_buffer() -> torch.Tensor:
    """A buffer 1.5x the last-level cache (sysfs; 64 MiB if unknown): one pass over it
    evicts whatever a timed part would otherwise find in cache."""
    size = 64 * 2**20
    text = _read("/sys/devices/system/cpu/cpu0/cache/index3/size")
    if text and text.rstrip("K").isdigit():
        size = int(text.rstrip("K")) * 1024
    return torch.zeros(int(size * 1.5) // 4)  # host: flushes the CPU cache


def _layer_weight_bytes(model: CausalLM) -> int:
    """The bytes of one block's matrices (``lineup.block_linears``)."""
    return sum(p.numel() * p.element_size() for m in lineup.block_linears(model)[0]
               for p in m.parameters())


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def _sample(fn: Callable[[], Any], device: torch.device, repeats: int,
            prepare: Callable[[], Any] | None = None) -> list[float]:
    """One warm-up, then ``repeats`` timed calls and more (up to twice as many) while they
    disagree by more than 10% of their median: the ``Sampler``'s rule. A call that returns a
    number (ms) is timed by itself (it leaves untimed work out). A piece over half a second (a
    forward's matmuls at long contexts: stable, and seconds each) takes 2 samples at most.
    ``prepare`` runs untimed before each call."""
    first_ms, _ = Sampler(device, watch=None).take(fn, prepare, self_timed=True)  # the warm-up
    if first_ms > 500:
        repeats = min(repeats, 2)
    sampler = Sampler(device, repeats=2 * repeats, min_repeats=repeats, spread=0.10,
                      retakes=repeats)
    point = sampler.point(fn, prepare, self_timed=True)
    assert point is not None  # no should_stop: it always finishes
    return point.samples_ms


def _packed(state: ModelState) -> tuple[list[list[Callable[..., Any]]], Callable[..., Any]]:
    """Mode 8's chosen products (``engine.decoders.fast``): per block in ``cfg.matrices()``'s
    order (the family step's roles are in that order, the head last), and the head."""
    w = fast_weights(state)
    roles = [r for r in w.linears if r != "lm_head"]
    return [list(b) for b in zip(*(w.linears[r] for r in roles), strict=True)], \
        w.linears["lm_head"][0]


class _Parts:
    """The timed pieces of one model (real or hollow) at batch B."""

    def __init__(self, model: CausalLM, batch: int, cold: bool) -> None:
        self.model, self.batch, self.cold = model, batch, cold
        self.state = ModelState.of(model)  # held while timing: its packing and masks are reused
        self.cfg, self.dev, self.dtype = model.config, model.device, model.dtype
        gen = torch.Generator().manual_seed(0)
        self.randn = lambda *shape: torch.randn(*shape, generator=gen).to(self.dev, self.dtype)

    # -- weights ---------------------------------------------------------------------------
    def _inputs(self, rows: int, packed: bool) -> list[torch.Tensor]:
        """One input per Linear of a block (``cfg.matrices()``), one tensor per width: (rows,
        in) for mode 8's products, which multiply (B, C) rows; (1, rows, in) otherwise, as the
        model's forward hands (B, T, C) to its Linears (measured on GPT-2: 5% slower than
        (B*T, C) at one row)."""
        widths = [n_in for _, _, n_in, _ in self.cfg.matrices()]
        by_width = {w: self.randn(rows, w) if packed else self.randn(1, rows, w)
                    for w in dict.fromkeys(widths)}
        return [by_width[w] for w in widths]

    def _stored(self, layout: str) -> Any:
        """The weight-only view a rung of storage ``layout`` multiplies by."""
        if layout not in STORAGES:
            raise NotCalibrated(f"weight layout {layout!r}: only out_in, packed and "
                                f"{', '.join(STORAGES)} are timed here")
        return weight_only(self.model, layout)

    def linears(self, layout: str, rows: int) -> Callable[[], Any]:
        xs = self._inputs(rows, layout == "packed")
        if layout == "packed":
            blocks, _ = _packed(self.state)
            calls = [(f, x) for block in blocks for f, x in zip(block, xs, strict=True)]
            return lambda: [f(a) for f, a in calls]
        if layout != "out_in":  # a weight-only rung: its own modules, as its forward calls them
            mods = lineup.block_linears(self._stored(layout))
            calls = [(m, x) for block in mods for m, x in zip(block, xs, strict=True)]
            return lambda: [m(a) for m, a in calls]
        mats = [(m.weight, m.bias, x) for block in lineup.block_linears(self.model)
                for m, x in zip(block, xs, strict=True)]
        return lambda: [F.linear(a, w, b) for w, b, a in mats]

    def head(self, layout: str, rows: int) -> Callable[[], Any]:
        d = self.cfg.n_embd
        if layout == "packed":
            _, packed = _packed(self.state)
            x = self.randn(rows, d)
            return lambda: packed(x)
        x = self.randn(1, rows, d)
        if layout != "out_in":
            stored = lineup.head_linear(self._stored(layout))
            return lambda: stored(x)
        w = lineup.head_linear(self.model).weight
        return lambda: F.linear(x, w)

    # -- attention -------------------------------------------------------------------------
    def _core(self, core: str) -> Attention:
        """The model's own attention: "fused" (no stored mask) or the write-up's "seed"."""
        return self.state.attention({"fused": "none", "seed": "seed"}[core])

    def attention(self, variant: str, context: int) -> Callable[[], float | None]:
        """One new token into a cache of ``context - 1`` tokens, attended over ``context``:
        n_head query heads over n_kv_head K/V heads (fewer under grouped-query attention).

        On a CPU each layer's part is timed with the caches emptied before it (an untimed pass
        over a buffer larger than the last-level cache): inside a step the layer's weights
        stream through the cache between one layer's attention and the next, so its keys and
        values come from memory (timed warm, the concatenating and paged caches' attention at
        659 tokens came out 20-40% below its cost inside the step). Only where one layer's
        matrices fill half that cache or more; the hollow model's keys are not flushed.
        """
        kind, core_name = variant.rsplit("_", 1)
        cfg, B = self.cfg, self.batch
        nh, nkv, hs = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        cache = make_cache(kind, self.model, B, capacity=max(context, 1))
        if context > 1:
            for layer in range(cfg.n_layer):
                cache.update(layer, self.randn(B, nkv, context - 1, hs),
                             self.randn(B, nkv, context - 1, hs))
            cache.advance(context - 1)
        flush = _flush_buffer() if self.dev.type == "cpu" and self.cold else None
        if flush is not None and 2 * _layer_weight_bytes(self.model) < flush.nbytes / 1.5:
            flush = None  # a layer's weights are under half the cache: K/V stay in it
        if core_name == "step":  # "prealloc_step": what the one-token steps' attend_filled
            q = self.randn(B, nh, hs)  # runs (modes 8, 12, 13 of either family: the kernel's
            k1, v1 = self.randn(B, nkv, hs), self.randn(B, nkv, hs)  # write + attention in
            with torch.no_grad():  # one call on a CPU, else SDPA)
                attend = attend_filled(cache.k_buf, cache.v_buf, context - 1)

            def layer_part(layer: int) -> None:
                attend(layer, q, k1, v1)
        else:
            core = self._core(core_name)
            q = self.randn(B, nh, 1, hs)
            k1, v1 = self.randn(B, nkv, 1, hs), self.randn(B, nkv, 1, hs)

            def layer_part(layer: int) -> None:  # as the model's forward meets the cache
                through_cache(core, cache, q, k1, v1, layer, context - 1)

        def step() -> float | None:
            total_s = 0.0
            with torch.no_grad():
                for layer in range(cfg.n_layer):
                    if flush is not None:
                        flush.sum()
                    start = time.perf_counter()
                    layer_part(layer)
                    total_s += time.perf_counter() - start
            cache.crop(context - 1)  # back to where it was (cheap; the hollow run pays it too)
            return total_s * 1e3 if self.dev.type == "cpu" else None

        return step

    def attention_full(self, t: int) -> Callable[[], Any]:
        B, cfg = self.batch, self.cfg
        q = self.randn(B, cfg.n_head, t, cfg.head_dim)
        k, v = (self.randn(B, cfg.n_kv_head, t, cfg.head_dim) for _ in range(2))
        core = self._core("seed")
        return lambda: [core(q, k, v, layer, 0) for layer in range(cfg.n_layer)]

    # -- the rest ----------------------------------------------------------------------------
    def small(self, rows: int) -> Callable[[], Any]:
        build = small_ops(self.model)
        if build is not None:
            return build(self.model, self.randn, rows)
        raise NotCalibrated(f"small operators of a {type(self.model).__name__} "
                            f"({self.cfg.family} family): none are listed here")

    def build(self, part: str, variant: str, x: int
              ) -> Callable[[], Any] | tuple[Callable[[], Any], Callable[[], Any]]:
        """The call that times ``part`` (a calibration row's part, variant and x), or
        (untimed set-up, timed call) for a whole step. ``NotCalibrated`` when it cannot."""
        if part == "attention_full":
            return self.attention_full(x)
        if part == "small":
            return self.small(x)
        build = {"layers": self.linears, "head": self.head, "attention": self.attention,
                 "hollow": self.step}[part]
        return build(variant, x)

    # -- the whole step on this model (only called on the hollow one) ------------------------
    def step(self, mode: str, context: int
             ) -> Callable[[], Any] | tuple[Callable[[], Any], Callable[[], Any]]:
        """A forward of ``context`` tokens, or (seek to context - 1, one step), as the latency
        sweep times it."""
        from engine.decoders import make_decoder
        dec = make_decoder(self.model, mode, batch_size=self.batch,
                           capacity=max(context, 2))
        idx = random_prompt(self.model, self.batch, context, seed=0)
        if not lineup.spec(mode).cached or context == 1:
            return lambda: dec.prefill(idx[:, :context])
        return (lambda: dec.seek(idx, context - 1)), (lambda: dec.step(idx[:, context - 1:]))


def plan(model_modes: list[str], batch: int, max_context: int) -> list[tuple[str, str, int]]:
    """(part, variant, x) to time for ``model_modes``: only what those modes need."""
    todo: list[tuple[str, str, int]] = []
    xs, coarse = grid(max_context), grid(max_context, fine_below=256)
    for mode in model_modes:
        recipe = predict.recipe(mode)
        if recipe is None:
            continue
        if recipe.cached:
            todo += [("layers", recipe.layout, batch), ("head", recipe.layout, batch),
                     ("small", "", batch)]
            todo += [("attention", recipe.attention, s) for s in xs]
        else:
            todo += [("layers", recipe.layout, batch * t) for t in coarse]
            todo += [("head", recipe.layout, batch * (t if recipe.head_all else 1))
                     for t in coarse]
            todo += [("small", "", batch * t) for t in coarse]
            todo += [("attention_full", "seed", t) for t in coarse]
        todo += [("hollow", mode, s) for s in xs]
    return list(dict.fromkeys(todo))


@torch.no_grad()
def calibrate(model: CausalLM, model_modes: list[str], batch: int, max_context: int,
              repeats: int = 3, tick: Tick | None = None,
              skip: set[tuple[str, str, int]] | None = None,
              missing: list[str] | None = None, busy: bool | None = None
              ) -> list[dict[str, Any]]:
    """Time every part ``model_modes`` need (see the module docstring); rows as described.

    ``skip``: (part, variant, x) pieces already calibrated. ``tick(message)`` is called before
    each piece; when it returns True calibration stops and the rows so far are returned. A
    piece that cannot be timed for this model (``NotCalibrated``) is left out, and why is
    added to ``missing`` (once) when given. ``busy``: also the "device" and "host" rows (default:
    on cuda).
    """
    if busy is None:
        busy = model.device.type == "cuda"
    hollow = hollow_model(model)
    scales = {"real": _Parts(model, batch, True), "hollow": _Parts(hollow, batch, False)}
    rows: list[dict[str, Any]] = []
    counted: set[str] = set()  # modes whose hollow step's launches were counted (once each)
    for part, variant, x in plan(model_modes, batch, max_context):
        if skip and (part, variant, x) in skip:
            continue
        for scale, parts in scales.items():
            if part == "hollow" and scale == "real":
                continue
            if tick is not None and tick(f"calibrating {part} {variant} at {x} ({scale})"):
                return rows
            try:
                fn = parts.build(part, variant, x)
            except NotCalibrated as exc:  # the predictor says "not calibrated: ..."
                if missing is not None and str(exc) not in missing:
                    missing.append(str(exc))
                break
            prepare, fn = fn if isinstance(fn, tuple) else (None, fn)
            samples = _sample(fn, model.device, repeats, prepare)
            rows.append({"part": part, "variant": variant, "scale": scale, "x": x,
                         "ms": statistics.median(samples), "samples_ms": samples})
            if busy and (scale == "real" or part == "hollow"):
                try:
                    rows.append(busy_time.split_row(part, variant, x, fn, prepare, model.device,
                                                    repeats, variant not in counted, _sample))
                except Exception as exc:  # noqa: BLE001 -- a profiler that fails costs the split only
                    busy, rows = False, [r for r in rows if r["scale"] in ("real", "hollow")]
                    if missing is not None:
                        missing.append(f"host and kernels apart: {type(exc).__name__}: {exc}")
                if part == "hollow":
                    counted.add(variant)
            del fn
    return rows

