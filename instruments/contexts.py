"""Which context lengths to measure: the presets and the parser for custom lists.

``parse_contexts("8, 16, 64-512:64", block_size)`` -> sorted, de-duplicated lengths within
1..block_size, or a one-line ValueError saying what is allowed; ``repeated_contexts`` names the
lengths a list gave twice (measured once) so a page can say so.
"""

from __future__ import annotations

import re


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


def _expand_contexts(text: str, block_size: int) -> list[int]:
    """Every length a custom list names, in order, repeats included (ValueError if unreadable)."""
    allowed = (f"allowed: whole numbers 1..{block_size} and ranges like 8-{block_size}:8, "
               "separated by commas")
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)\s*-\s*(\d+)(?:\s*:\s*(\d+))?|(\d+)", part)
        if m is None:
            raise ValueError(f"cannot read {part!r} as a context length; {allowed}")
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
            raise ValueError(f"context length {bad[0]} is outside 1..{block_size}; {allowed}")
        out.extend(values)
    if not out:
        raise ValueError(f"no context lengths given; {allowed}")
    return out


def parse_contexts(text: str, block_size: int) -> list[int]:
    """'8, 16, 100', ranges 'start-stop:step' ('8-1024:8', step optional) or a preset name."""
    if text.strip() in CONTEXT_PRESETS:
        return preset_contexts(text.strip(), block_size)
    return sorted(set(_expand_contexts(text, block_size)))


def repeated_contexts(text: str, block_size: int) -> list[int]:
    """Lengths a custom list names more than once (each is measured once; say so)."""
    if text.strip() in CONTEXT_PRESETS:
        return []
    seen: set[int] = set()
    again: set[int] = set()
    for t in _expand_contexts(text, block_size):
        (again if t in seen else seen).add(t)
    return sorted(again)
