"""Percentiles and spread of a point's kept samples, in the field's terms. Torch-free.

``percentile(samples, q)`` is the q-th percentile by linear interpolation between the closest
ranks (numpy's default, what llmperf and vLLM's benchmarks report), or None when the samples are
too few for it to mean anything: a percentile q needs at least ``MIN_SAMPLES[q]`` samples, the
count at which the tail above it holds one sample of its own (p90: 10, p99: 100). A "p99" of
three samples would only be the largest of three. ``percentile_fields(samples, "ms")`` gives the
row fields ``p50_ms``, ``p90_ms``, ``p99_ms`` (None where too few) with ``samples_n`` and a
``percentiles_note`` saying which are missing and why; ``mean_sd`` is the mean and the sample
standard deviation (llama-bench's "± sd"); ``relative_spread`` is (max - min) / median, the
Sampler's own measure of how much a point's samples disagree. Used by the experiments when they
build rows and by ``ui`` for tables and tooltips, so each number is computed one way.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

PERCENTILES = (50, 90, 99)
# The fewest samples each percentile is reported from: 1 / (1 - q), so that at least one sample
# lies above it. p50 is the median, given from one sample on (as the rows' latency_ms is).
MIN_SAMPLES = {50: 1, 90: 10, 99: 100}


def _clean(samples: Sequence[Any] | None) -> list[float]:
    """The finite numbers of ``samples`` (None, NaN and non-numbers left out)."""
    out = []
    for x in samples or []:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            continue
        if math.isfinite(x):
            out.append(float(x))
    return out


def min_samples(q: int) -> int:
    """The fewest samples percentile ``q`` is reported from (1 / (1 - q) rounded up, >= 1)."""
    if q in MIN_SAMPLES:
        return MIN_SAMPLES[q]
    if not 0 <= q < 100:
        raise ValueError(f"percentile must be within 0..99, got {q!r}")
    return max(1, math.ceil(100 / (100 - q) - 1e-9))


def percentile(samples: Sequence[Any] | None, q: int) -> float | None:
    """The ``q``-th percentile (linear between closest ranks), None with too few samples."""
    xs = sorted(_clean(samples))
    if len(xs) < min_samples(q) or not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def why_missing(n: int, q: int) -> str | None:
    """Why percentile ``q`` of ``n`` samples is not reported (None when it is)."""
    need = min_samples(q)
    if n >= need and n > 0:
        return None
    return f"p{q} needs at least {need} samples, {n} kept"


def percentile_fields(samples: Sequence[Any] | None, unit: str = "ms", prefix: str = ""
                      ) -> dict[str, Any]:
    """``{prefix}p50_{unit}``, ``p90``, ``p99`` (None where too few), ``{prefix}samples_n`` and
    ``{prefix}percentiles_note`` (None when all three are given)."""
    xs = _clean(samples)
    out: dict[str, Any] = {f"{prefix}p{q}_{unit}": percentile(xs, q) for q in PERCENTILES}
    out[f"{prefix}samples_n"] = len(xs)
    missing = [why for q in PERCENTILES if (why := why_missing(len(xs), q))]
    out[f"{prefix}percentiles_note"] = "; ".join(missing) if missing else None
    return out


def mean_sd(samples: Sequence[Any] | None) -> tuple[float | None, float | None]:
    """(mean, sample standard deviation); sd None under two samples, both None with none."""
    xs = _clean(samples)
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) >= 2 else None)


def relative_spread(samples: Sequence[Any] | None) -> float | None:
    """(max - min) / median of the samples; 0 for one sample, None for none or a zero median."""
    xs = _clean(samples)
    if not xs:
        return None
    mid = statistics.median(xs)
    return (max(xs) - min(xs)) / abs(mid) if mid else None


def describe(samples: Sequence[Any] | None, unit: str = "ms", sep: str = " · ") -> str:
    """A tooltip's words: n, median, spread and the percentiles there are enough samples for,
    e.g. "3 samples · median 2.1 ms · spread 0.31 ms · p50 2.1 ms · p90, p99: too few samples
    (p90 needs 10)"; ``sep`` between the parts ("<br>" on a chart)."""
    xs = _clean(samples)
    if not xs:
        return "no samples"
    parts = [f"{len(xs)} sample{'s' if len(xs) != 1 else ''}",
             f"median {statistics.median(xs):.4g} {unit}",
             f"spread {max(xs) - min(xs):.3g} {unit}"]
    given = [f"p{q} {v:.4g} {unit}" for q in PERCENTILES if (v := percentile(xs, q)) is not None]
    absent = [f"p{q}" for q in PERCENTILES if percentile(xs, q) is None]
    parts += given
    if absent:
        need = min_samples(int(absent[0][1:]))
        parts.append(f"{', '.join(absent)}: too few samples (p{absent[0][1:]} needs {need})")
    return sep.join(parts)
