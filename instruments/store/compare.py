"""Two runs of one experiment, point by point: new ÷ old against the runs' own noise. Torch-free.

``compare(old, new, floor=0.02) -> Comparison`` matches the points of the tables each kind
keeps (``MEASURES``: a sweep's per-token latency and its end-to-end totals, a bench's tokens/s)
by what names a point (mode, context, batch...), and gives per point the ratio new ÷ old of its
number and a noise band from the two runs' own samples:

  band b = the larger of the two points' relative spreads ((max - min) / median of the samples
           kept: the Sampler's own test of agreement), and ``floor``. A point with a single
           sample has no spread of its own: its run's typical one (the median over the points
           that have several) stands in.
  regression   worse than old by more than the band: ratio > 1 + b where lower is better (a
               time), ratio < 1 / (1 + b) where higher is better (tokens/s)
  improvement  better by more than the band, the other way round
  within noise otherwise; "only in old" / "only in new" for points the other run lacks

llama.cpp's ``compare-llama-bench.py`` is the model (a ratio per test); the band is ours, so
that a CI guard (``python -m instruments compare OLD NEW``, exit code 1 on a regression) does not
cry wolf on a noisy machine: ``floor`` says how much drift between runs it accepts besides the
spread inside them. Runs of different kinds are refused; differing models, devices, dtypes or
batch sizes are said in ``notes`` (the ratios then compare set-ups, not code).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from instruments.store import stats
from instruments.store.frames import run_label

DEFAULT_FLOOR = 0.02  # 2%: the least drift between two runs that is called noise


@dataclass(frozen=True)
class Measure:
    """What is compared in one table: the fields naming a point, its number and its samples."""

    table: str
    keys: tuple[str, ...]
    value: str
    samples: str
    unit: str
    point: str  # format of a point's name from its row, e.g. "{mode} @ {context_len}"
    higher_is_better: bool = False


MEASURES: dict[str, tuple[Measure, ...]] = {
    "latency_sweep": (
        Measure("latency", ("mode", "context_len", "batch_size"), "latency_ms", "samples_ms",
                "ms", "{mode} @ {context_len}"),
        Measure("end_to_end", ("mode", "prompt_len", "new_tokens", "batch_size"), "total_s",
                "samples_s", "s", "{mode} end to end, {new_tokens} tokens"),
    ),
    "end_to_end": (
        Measure("end_to_end", ("mode", "prompt_len", "new_tokens", "batch_size"), "total_s",
                "samples_s", "s", "{mode} end to end, {new_tokens} tokens"),
    ),
    "bench": (
        Measure("bench", ("mode", "test", "depth", "batch_size"), "tokens_per_s",
                "samples_tokens_per_s", "tokens/s", "{mode} {label}", higher_is_better=True),
    ),
}
VERDICTS = ("regression", "improvement", "within noise", "only in old", "only in new")


@dataclass
class Comparison:
    kind: str
    old: str  # the runs' labels
    new: str
    floor: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["verdict"] == "regression"]

    @property
    def improvements(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["verdict"] == "improvement"]

    def headline(self) -> str:
        counts = {v: sum(r["verdict"] == v for r in self.rows) for v in VERDICTS}
        said = ", ".join(f"{n} {v}" + ("s" if n != 1 and v in VERDICTS[:2] else "")
                         for v, n in counts.items() if n)
        return f"{len(self.rows)} points: {said or 'none in common'}"


def comparable(run: dict[str, Any]) -> bool:
    """Whether ``compare`` knows this run's kind."""
    return str(run.get("kind")) in MEASURES


def _typical_spread(rows: Sequence[dict[str, Any]], samples: str) -> float | None:
    spreads = [s for r in rows if len(r.get(samples) or []) >= 2
               and (s := stats.relative_spread(r.get(samples))) is not None]
    return statistics.median(spreads) if spreads else None


def _spread(row: dict[str, Any], m: Measure, typical: float | None) -> float | None:
    got = row.get(m.samples) or []
    return stats.relative_spread(got) if len(got) >= 2 else typical


def _verdict(ratio: float, band: float, higher_is_better: bool) -> str:
    worse = ratio < 1 / (1 + band) if higher_is_better else ratio > 1 + band
    better = ratio > 1 + band if higher_is_better else ratio < 1 / (1 + band)
    return "regression" if worse else "improvement" if better else "within noise"


def _point_name(m: Measure, row: dict[str, Any]) -> str:
    try:
        return m.point.format(**row)
    except (KeyError, IndexError, ValueError):
        return " · ".join(str(row.get(k)) for k in m.keys)


def _setup_notes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    a, b = old.get("meta") or {}, new.get("meta") or {}
    notes = []
    for key, what in (("model", "models"), ("device_name", "devices"), ("dtype", "dtypes"),
                      ("batch_size", "batch sizes"), ("threads", "thread counts")):
        if a.get(key) != b.get(key):
            notes.append(f"different {what}: {a.get(key)} (old) and {b.get(key)} (new): the "
                         "ratios compare set-ups, not only code")
    for run, which in ((old, "old"), (new, "new")):
        if (run.get("meta") or {}).get("partial"):
            notes.append(f"the {which} run is partial: it stopped before the end")
    return notes


def compare(old: dict[str, Any], new: dict[str, Any], floor: float = DEFAULT_FLOOR
            ) -> Comparison:
    """Per point, new ÷ old with its noise band and verdict (see the module docstring)."""
    kind = str(old.get("kind"))
    if kind != str(new.get("kind")):
        raise ValueError(f"compare needs two runs of the same experiment; old is {kind}, new is "
                         f"{new.get('kind')}")
    if kind not in MEASURES:
        raise ValueError(f"compare knows {', '.join(MEASURES)} runs, not {kind}")
    if not 0 <= floor < 10:
        raise ValueError(f"the noise floor must be a share from 0 (0.05 = 5%), got {floor!r}")
    out = Comparison(kind, run_label(old), run_label(new), floor, notes=_setup_notes(old, new))
    for m in MEASURES[kind]:
        old_rows = (old.get("tables") or {}).get(m.table) or []
        new_rows = (new.get("tables") or {}).get(m.table) or []
        typical = (_typical_spread(old_rows, m.samples), _typical_spread(new_rows, m.samples))
        before = {tuple(r.get(k) for k in m.keys): r for r in old_rows}
        after = {tuple(r.get(k) for k in m.keys): r for r in new_rows}
        for key in [*before, *(k for k in after if k not in before)]:
            a, b = before.get(key), after.get(key)
            row = {"table": m.table, "point": _point_name(m, a or b or {}),
                   **dict(zip(m.keys, key, strict=True)), "unit": m.unit,
                   "higher_is_better": m.higher_is_better,
                   "old": a.get(m.value) if a else None, "new": b.get(m.value) if b else None,
                   "ratio": None, "noise": None}
            if a is None or b is None or not row["old"] or row["new"] is None:
                row["verdict"] = "only in new" if a is None else "only in old"
                out.rows.append(row)
                continue
            spreads = [s for s in (_spread(a, m, typical[0]), _spread(b, m, typical[1]))
                       if s is not None]
            row["noise"] = max([floor, *spreads])
            row["ratio"] = row["new"] / row["old"]
            row["verdict"] = _verdict(row["ratio"], row["noise"], m.higher_is_better)
            out.rows.append(row)
    return out


def markdown(c: Comparison) -> str:
    """The comparison as a Markdown table with a headline and its notes."""
    lines = [f"old: {c.old}", f"new: {c.new}", "",
             "| point | old | new | new ÷ old | noise band | verdict |",
             "| ----- | --: | --: | --------: | ---------: | ------- |"]
    for r in c.rows:
        def num(v: Any, unit: str = r["unit"]) -> str:
            return "–" if v is None else f"{v:.4g} {unit}"

        ratio = "–" if r["ratio"] is None else f"{r['ratio']:.3f}"
        band = "–" if r["noise"] is None else f"±{r['noise']:.1%}"
        flag = {"regression": "**regression**", "improvement": "improvement"}.get(r["verdict"],
                                                                                 r["verdict"])
        lines.append(f"| {r['point']} | {num(r['old'])} | {num(r['new'])} | {ratio} | {band} | "
                     f"{flag} |")
    lines += ["", c.headline() + f" (noise floor {c.floor:.0%})."]
    lines += [f"note: {n}" for n in c.notes]
    return "\n".join(lines)
