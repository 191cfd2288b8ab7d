"""Predict a decode step's time from its calibrated parts, and say where the prediction misses.

Torch-free: it reads calibration rows (``instruments.measure.calibration``) and measured latency
rows (``instruments.experiments.latency``), so the dashboard can overlay a prediction on any saved
sweep of the same machine. For a mode at context t, batch B:

  predicted_ms = dispatch_host_ms + weights_ms + attention_ms + small_ops_ms
  dispatch_host_ms  the mode's own step (or forward of t tokens) on the hollow model: operator
                    dispatch, module calls, the Python of the step and of its loop (a long
                    forward's hollow step also holds its one-head t x t mask and softmax: 57 ms
                    of gpt2's 4 s forward at 1,000 tokens here)
  weights_ms        every Linear matmul of the model's blocks (GPT-2's four, the Llama
                    family's seven: q, narrow k and v, o, gate, up, down): rows = B for a cached
                    step, B x t for a forward; the output projection on B x t rows for mode 1, B
                    rows otherwise; in the mode's weight layout (the weight-only rungs: their
                    int8 / bf16 kernels)
  attention_ms      the cached step's KV write/concat/gather/dequantize and attention over t
                    keys (n_head queries over the cache's n_kv_head heads), or an uncached
                    forward's t x t attention with the mask
  small_ops_ms      the family's other operators: GPT-2's layer norms, GELU, residual adds, the
                    heads' re-assembly, the embeddings; the Llama family's RMSNorms, RoPE on q
                    and k, SiLU x up, residual adds, the heads' re-assembly, the embedding
Each size part is (real - hollow) of its calibration at that size, interpolated log-log
between the calibrated grid points; the hollow model is of the model's own family.

On a GPU the host only queues kernels, and the two run side by side: where the calibration has
the device's busy time of each real part and the host's time to issue the hollow step (its
"device" and "host" rows: on cuda), the three size parts are those kernel times and

  predicted_ms = max(dispatch_host_ms, weights_ms + attention_ms + small_ops_ms)

``bound`` says which side sets it ("host": the kernels wait for their launches).

Nothing here depends on the family: the calibration (``instruments.measure.calibration``)
times each part on the model it is given. ``GOALS``: the prediction is judged within 15% of
the measured median for cached modes and 25% for uncached ones.

Which modes are predicted, and how, is read off each mode's ``ModeSpec`` (``recipe(mode)``: its
cache kind and attention, weight layout or storage, whether it projects every position); a mode
whose spec says it is not (modes 6, 7 and 9: compiled or graph-captured steps fuse and reorder
the operators this sum is made of) gets its stated reason (``why_not``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from instruments import lineup

GOALS = {True: 0.15, False: 0.25}  # cached -> allowed |residual| / measured
PARTS = ("weights_ms", "attention_ms", "small_ops_ms", "dispatch_host_ms")
PART_LABELS = {"weights_ms": "weights streamed (Linear matmuls)",
               "attention_ms": "attention and KV cache",
               "small_ops_ms": "small operators (norms, activations, RoPE, adds)",
               "dispatch_host_ms": "dispatch and host loop"}


@dataclass(frozen=True)
class Recipe:
    """What the predictor sums for a mode, read off its ``ModeSpec``."""

    cached: bool
    layout: str  # "out_in" | "packed" | "int8" | "bfloat16" (weight-only rungs' storage)
    attention: str  # a calibration "attention" variant (cached) or "seed" (uncached)
    head_all: bool = False  # the output projection on every position (mode 1)


def recipe(mode: str) -> Recipe | None:
    """The mode's recipe, or None when it is not predicted (``why_not`` says why): compiled
    or graph-captured modes, peers, unknown names."""
    spec = lineup.mode_spec(mode)
    if spec is None or spec.predicted:
        return None
    return Recipe(spec.cached, spec.weight_storage or spec.weight_layout, spec.attention_part,
                  spec.logits_all)


def why_not(mode: str) -> str:
    """Why ``mode`` is not predicted ("" when it is)."""
    spec = lineup.mode_spec(mode)
    if spec is None:
        return "not one of our modes: another engine's step is not made of our parts"
    return spec.predicted


def predictable(names: Iterable[str]) -> list[str]:
    """The names the predictor models, in the given order."""
    return [m for m in names if recipe(m) is not None]


def interpolate(points: Iterable[tuple[float, float]], x: float) -> float:
    """y at x from (x, y) points, linear in log x and log y between neighbours (power laws are
    exact); outside the points, the nearest segment's power law; one point: its y."""
    pts = sorted((float(a), float(b)) for a, b in points)
    if not pts:
        raise ValueError("no calibration points to interpolate")
    if len(pts) == 1 or x == pts[0][0]:
        return pts[0][1]
    i = next((j for j in range(1, len(pts)) if pts[j][0] >= x), len(pts) - 1)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    if min(x0, x1, x, y0, y1) <= 0 or x0 == x1:
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y1
    f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))


class Calibration:
    """Lookup over calibration rows: ``at(part, variant, scale, x)`` in ms. Rows of the same
    part and size timed more than once (re-timed beside each measuring pass) count by their
    median, as the passes' samples do."""

    def __init__(self, rows: Iterable[dict[str, Any]]) -> None:
        timed: dict[tuple[str, str, str], dict[float, list[float]]] = {}
        for r in rows:
            key = (str(r["part"]), str(r.get("variant", "")), str(r.get("scale", "real")))
            timed.setdefault(key, {}).setdefault(float(r["x"]), []).append(float(r["ms"]))
        self.series: dict[tuple[str, str, str], list[tuple[float, float]]] = {
            key: [(x, statistics.median(ms)) for x, ms in by_x.items()]
            for key, by_x in timed.items()}

    def has(self, part: str, variant: str, scale: str) -> bool:
        return (part, variant, scale) in self.series

    def at(self, part: str, variant: str, scale: str, x: float) -> float:
        key = (part, variant, scale)
        if key not in self.series:
            raise KeyError(f"no calibration of {part} {variant!r} ({scale})")
        return interpolate(self.series[key], x)

    def size_part(self, part: str, variant: str, x: float) -> float:
        """The work that grows with the widths: real - hollow at x (never below 0)."""
        return max(0.0, self.at(part, variant, "real", x) - self.at(part, variant, "hollow", x))


def predict_point(cal: Calibration, mode: str, context: int, batch: int = 1) -> dict[str, Any]:
    """The predicted step of ``mode`` at ``context``: parts and their sum (ms), or a reason.

    Returns ``{"predicted_ms": None, "why": ...}`` when the mode is not predicted or its
    calibration is missing.
    """
    r = recipe(mode)
    if r is None:
        return {"predicted_ms": None, "why": why_not(mode)}
    split = cal.has("hollow", mode, "host")  # a GPU's calibration: host and device apart

    def size(part: str, variant: str, x: float) -> float:
        return cal.at(part, variant, "device", x) if split else cal.size_part(part, variant, x)

    try:
        if r.cached:
            rows = head_rows = batch
            attention = size("attention", r.attention, context)
        else:
            rows = batch * context
            head_rows = rows if r.head_all else batch
            attention = size("attention_full", "seed", context)
        parts = {
            "weights_ms": size("layers", r.layout, rows) + size("head", r.layout, head_rows),
            "attention_ms": attention,
            "small_ops_ms": size("small", "", rows),
            "dispatch_host_ms": cal.at("hollow", mode, "host" if split else "hollow", context),
        }
    except KeyError as exc:
        return {"predicted_ms": None, "why": f"not calibrated: {exc.args[0]}"}
    if not split:
        return {**parts, "predicted_ms": sum(parts.values()), "bound": None, "why": ""}
    device_ms = parts["weights_ms"] + parts["attention_ms"] + parts["small_ops_ms"]
    host_ms = parts["dispatch_host_ms"]
    return {**parts, "predicted_ms": max(host_ms, device_ms),
            "bound": "host" if host_ms >= device_ms else "device", "why": ""}


def predict_generation(cal: Calibration, mode: str, prompt_len: int, new_tokens: int,
                       batch: int = 1) -> float | None:
    """Predicted ms of a whole generation: the prompt's forward, then one step per new token
    (cached modes), or one forward per new token over the growing sequence (uncached)."""
    r = recipe(mode)
    if r is None:
        return None
    prompt_mode = lineup.with_role("reference_uncached")[0]
    first = predict_point(cal, prompt_mode if r.cached else mode, prompt_len, batch)
    if first["predicted_ms"] is None:
        return None
    total = float(first["predicted_ms"])
    for t in range(prompt_len + 1, prompt_len + new_tokens):
        p = predict_point(cal, mode, t, batch)
        if p["predicted_ms"] is None:
            return None
        total += float(p["predicted_ms"])
    return total


def compare(cal: Calibration, latency_rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per measured point: measured, predicted, its parts, the residual and its share."""
    out = []
    for r in latency_rows:
        mode, t = str(r["mode"]), int(r["context_len"])
        batch = int(r.get("batch_size") or 1)
        p = predict_point(cal, mode, t, batch)
        measured = float(r["latency_ms"])
        pred = p["predicted_ms"]
        residual = None if pred is None else measured - pred
        out.append({
            "mode": mode, "mode_label": r.get("mode_label", mode),
            "cached": bool(r.get("cached", (rc := recipe(mode)) is not None and rc.cached)),
            "context_len": t, "batch_size": batch, "measured_ms": measured,
            "predicted_ms": pred, "residual_ms": residual,
            "residual_share": None if residual is None or measured <= 0 else residual / measured,
            **{k: p.get(k) for k in PARTS}, "bound": p.get("bound"), "why": p["why"],
        })
    return out


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys on xs; slope 0 when xs do not vary."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= 1e-12:
        return my, 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


def verdicts(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode: the worst |residual| share, the goal, whether it holds, and a sentence.

    Where a mode misses, which part is off: a residual that moves with the context is fitted
    against the part that varies most across the mode's contexts (attention for a cached step,
    weights for a forward) and that part is named, mis-scaled by the fitted slope -- unless no
    part varies by a tenth of the step, then the sum misses something context-dependent; a
    residual that stays put means a context-independent part is off by about its median.
    """
    out = []
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for p in points:
        by_mode.setdefault(p["mode"], []).append(p)
    for mode, pts in by_mode.items():
        cached = bool(pts[0]["cached"])
        goal = GOALS[cached]
        usable = [p for p in pts if p["predicted_ms"] is not None]
        if not usable:
            why = pts[0]["why"] or "no prediction"
            out.append({"mode": mode, "cached": cached, "goal_share": goal, "points": 0,
                        "worst_share": None, "worst_context": None, "within": None,
                        "off_part": None, "sentence": f"{mode}: not predicted ({why})."})
            continue
        worst = max(usable, key=lambda p: abs(p["residual_share"]))
        share = abs(float(worst["residual_share"]))
        within = share <= goal
        off, detail = None, ""
        if not within:
            off, detail = _which_part(usable)
        sentence = (f"{mode}: worst miss {share:.0%} at {worst['context_len']} tokens "
                    f"(predicted {worst['predicted_ms']:.2f} ms, measured "
                    f"{worst['measured_ms']:.2f} ms; goal {goal:.0%}): "
                    + ("within the goal." if within else f"outside the goal. {detail}"))
        out.append({"mode": mode, "cached": cached, "goal_share": goal, "points": len(usable),
                    "worst_share": share, "worst_context": worst["context_len"],
                    "within": within, "off_part": off, "sentence": sentence})
    return out


def _which_part(pts: list[dict[str, Any]]) -> tuple[str, str]:
    """(part, sentence) naming the part of the model the residuals point at."""
    ys = [float(p["residual_ms"]) for p in pts]
    ts = [float(p["context_len"]) for p in pts]
    mean_measured = sum(p["measured_ms"] for p in pts) / len(pts)
    t_intercept, t_slope = _fit(ts, ys)
    trend = t_slope * (max(ts) - min(ts))  # how much the residual moves across the contexts
    if len(pts) >= 3 and abs(trend) > abs(t_intercept):
        growing = max(("attention_ms", "weights_ms", "small_ops_ms"),
                      key=lambda k: max(p[k] for p in pts) - min(p[k] for p in pts))
        xs = [float(p[growing]) for p in pts]
        if max(xs) - min(xs) >= 0.1 * mean_measured:
            _, slope = _fit(xs, ys)
            return growing, (f"The residual follows {PART_LABELS[growing]}: that part runs "
                             f"{1 + slope:.2f}x its calibrated time inside the step.")
        # No part grows enough to carry it (a few µs of attention on a tiny model): a slope
        # fitted on that part would only fit noise.
        return "context", (f"The residual moves {trend:+.2f} ms across these contexts and no "
                           "part of the prediction grows that much: something that scales with "
                           "the context is missing from the sum.")
    typical = statistics.median(ys)
    constant = "dispatch_host_ms" if pts[0]["cached"] else "small_ops_ms"
    return "constant", (f"The residual stays about {typical:+.2f} ms "
                        f"({typical / mean_measured:+.0%} of the step) whatever the context: "
                        f"a part that does not grow with it ({PART_LABELS['weights_ms']} at one "
                        f"row, or {PART_LABELS[constant]}) is off by that much.")
