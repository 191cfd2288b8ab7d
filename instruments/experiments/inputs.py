"""What a user types, read and checked once for every experiment (pages, CLI, measuring process).

``parse_contexts("8, 16, 64-512:64", block_size)`` -> sorted, de-duplicated lengths within
1..block_size, or a one-line ValueError saying what is allowed; ``repeated_contexts`` names the
lengths a list gave twice (measured once) so a page can say so; ``spread_order`` orders lengths
so that every prefix spans them (a sweep stopped early). ``parse_modes`` reads a comma
list of mode names. ``whole``, ``contexts_within`` and ``modes_usable`` are the checks every
experiment's ``Params.check`` is made of: each raises a one-line ValueError saying what is
allowed. Torch-free.
"""

from __future__ import annotations

import re
from typing import Any

from instruments import lineup

MAX_BATCH = 256


def whole(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    """A whole number within lo..hi (or >= lo)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (
            hi is not None and value > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be a whole number {rng}, got {value!r}")


def contexts_within(name: str, values: list[int], lo: int, hi: int) -> None:
    """A non-empty list of whole numbers within lo..hi."""
    if not values:
        raise ValueError(f"no {name} given; allowed: {lo}..{hi}")
    bad = [t for t in values if isinstance(t, bool) or not isinstance(t, int)
           or not lo <= t <= hi]
    if bad:
        raise ValueError(f"{name.rstrip('s')} {bad[0]!r} is outside {lo}..{hi}")


def modes_usable(names: list[str], device: str, family: str | None = None) -> None:
    """Every name is a decode mode (or a peer) that can run on ``device`` and a model of
    ``family`` (when given)."""
    if not names:
        raise ValueError(f"no modes given; allowed: {', '.join(lineup.names())}")
    for name in names:
        ok, why = lineup.available(name, device, family)
        if not ok:
            raise ValueError(f"mode {name!r} cannot run: {why}")


def parse_modes(text: str) -> list[str]:
    """'uncached, concat' -> names, each a known decode mode (or peer)."""
    names = [m.strip() for m in str(text).split(",") if m.strip()]
    known = lineup.names()
    unknown = [m for m in names if m not in known]
    if not names or unknown:
        raise ValueError(f"unknown mode {unknown[0] if unknown else text!r}; "
                         f"allowed: {', '.join(known)}")
    return names


def _log_spaced(lo: int, hi: int, n: int) -> list[int]:
    return sorted({round(lo * (hi / lo) ** (i / (n - 1))) for i in range(n)})


# 12 log-spaced lengths plus the write-up's table points (10, 100, 500, 1000): 16 in all.
CONTEXT_PRESETS: dict[str, list[int]] = {
    "log-spaced (16)": sorted(set(_log_spaced(8, 1024, 12)) | {10, 100, 500, 1000}),
    "every length 8..1024": list(range(8, 1025)),
}


def preset_contexts(name: str, block_size: int) -> list[int]:
    """A preset clipped to a model's block_size (block_size itself added if points were cut)."""
    if name not in CONTEXT_PRESETS:
        raise ValueError(f"unknown context preset {name!r}; allowed: {', '.join(CONTEXT_PRESETS)}")
    points = CONTEXT_PRESETS[name]
    kept = [t for t in points if t <= block_size]
    if len(kept) < len(points):
        kept.append(block_size)
    return sorted(set(kept))


def spread_order(values: list[int]) -> list[int]:
    """The values (sorted, de-duplicated) reordered so that every prefix spans them: the
    smallest, the largest, then the middle of each gap left, widest gaps first -- what a sweep
    stopped after any point has still measured from short to long."""
    ordered = sorted(set(values))
    if len(ordered) < 3:
        return ordered
    out, gaps = [0, len(ordered) - 1], [(0, len(ordered) - 1)]
    while gaps:
        lo, hi = gaps.pop(0)
        if hi - lo < 2:
            continue
        mid = (lo + hi) // 2
        out.append(mid)
        gaps += [(lo, mid), (mid, hi)]
    return [ordered[i] for i in out]


def _expand_contexts(text: str, block_size: int, name: str = "context length") -> list[int]:
    """Every value a custom list names, in order, repeats included (ValueError if unreadable,
    naming the quantity: ``name``, e.g. "batch size")."""
    allowed = (f"allowed: whole numbers 1..{block_size} and ranges like 8-{block_size}:8, "
               "separated by commas")
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)\s*-\s*(\d+)(?:\s*:\s*(\d+))?|(\d+)", part)
        if m is None:
            raise ValueError(f"cannot read {part!r} as a {name}; {allowed}")
        if m.group(4) is not None:
            values = [int(m.group(4))]
        else:
            start, stop, step = int(m.group(1)), int(m.group(2)), int(m.group(3) or 1)
            if step < 1 or stop < start:
                raise ValueError(f"range {part!r} is empty (need start <= stop, step >= 1); "
                                 f"{allowed}")
            values = list(range(start, stop + 1, step))
        bad = [v for v in values if not 1 <= v <= block_size]
        if bad:
            raise ValueError(f"{name} {bad[0]} is outside 1..{block_size}; {allowed}")
        out.extend(values)
    if not out:
        raise ValueError(f"no {name} given; {allowed}")
    return out


def parse_contexts(text: str, block_size: int, name: str = "context length") -> list[int]:
    """'8, 16, 100', ranges 'start-stop:step' ('8-1024:8', step optional) or a preset name.
    ``name`` is the quantity the list holds, as errors say it ("batch size", "prompt length":
    the same grammar reads those lists, up to their own largest value)."""
    if text.strip() in CONTEXT_PRESETS:
        return preset_contexts(text.strip(), block_size)
    return sorted(set(_expand_contexts(text, block_size, name)))


def repeated_contexts(text: str, block_size: int) -> list[int]:
    """Lengths a custom list names more than once (each is measured once; say so)."""
    if text.strip() in CONTEXT_PRESETS:
        return []
    seen: set[int] = set()
    again: set[int] = set()
    for t in _expand_contexts(text, block_size):
        (again if t in seen else seen).add(t)
    return sorted(again)
