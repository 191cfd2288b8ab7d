"""What the serving peers share: the requests they serve, the concurrencies they serve them at,
and their rows, each gated on our engine's tokens (``instruments.peers.serving`` and
``serving_hf`` build on it; a row's fields are named in ``serving``'s docstring).

  peer_points(params)           the concurrencies the peers serve
  arrivals_at(every, c, rounds) the requests our engine served at concurrency c
  point_row(tr, peer, c, ...)   a served point's row, its tokens compared with ours
  unavailable(tr, peer, why)    a row saying why a peer (or a point) could not run
"""

from __future__ import annotations

from typing import Any


def peer_points(params: Any) -> list[int]:
    """The concurrencies the peers serve: those of ``params.peer_concurrency`` our engine served
    (every one where the list is empty)."""
    wanted = getattr(params, "peer_concurrency", None) or params.concurrency
    return [c for c in params.concurrency if c in wanted]


def arrivals_at(every: list[Any], c: int, rounds: int) -> list[Any]:
    """The requests our engine served at concurrency ``c`` (``runs.concurrency``'s slice)."""
    return every[: max(c * rounds, 2)]


def line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def unavailable(tr: Any, peer: str, why: str, concurrency: int | None = None,
                 **extra: Any) -> None:
    row = {"peer": peer, "concurrency": concurrency, "ok": False, "why": why,
           "tokens_equal": False, **extra}
    tr.row("peers", row, f"peer {peer}: unavailable: {why}", points=0)


def ours(tr: Any, c: int) -> dict[int, list[int]] | None:
    """Our engine's generated ids by request index at concurrency ``c`` (None: not kept)."""
    rows = [r for r in tr.tables.get("requests", []) if r.get("label") == f"C={c}"]
    return {r["request"]: list(r["generated_ids"]) for r in rows} if rows else None


def compare(want: dict[int, list[int]], got: dict[int, list[int]]) -> tuple[int, int]:
    """(token positions that differ, requests that differ) over every request of either; a
    token one side lacks counts as differing."""
    tokens = requests = 0
    for i in sorted(set(want) | set(got)):
        a, b = want.get(i, []), got.get(i, [])
        n = sum(x != y for x, y in zip(a, b, strict=False)) + abs(len(a) - len(b))
        tokens += n
        requests += n > 0
    return tokens, requests


def point_row(tr: Any, peer: str, c: int, arrivals: list[Any], tokens: dict[int, list[int]],
              duration_s: float, **extra: Any) -> dict[str, Any]:
    """A served point's row, gated on our engine's tokens at ``c``; ``extra`` joins it (a
    ``note`` is prefixed with what the gate found)."""
    want = ours(tr, c)
    out_tokens = sum(len(t) for t in tokens.values())
    note = extra.pop("note", "")
    if want is None:
        equal, differing, reqs = False, None, None
        note = f"not gated: our engine's tokens at C={c} were not kept. {note}"
    else:
        differing, reqs = compare(want, tokens)
        equal = differing == 0
        if not equal:
            note = (f"{reqs} of {len(arrivals)} requests differ from ours "
                    f"({differing} tokens). {note}")
    return {"peer": peer, "concurrency": c, "ok": True, "why": "", "requests": len(arrivals),
            "output_tokens": out_tokens, "output_tok_s": out_tokens / max(duration_s, 1e-12),
            "duration_s": duration_s, "tokens_equal": equal, "tokens_differing": differing,
            "requests_differing": reqs, **extra, "note": note.strip()}
