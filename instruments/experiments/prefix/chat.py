"""A multi-turn chat in the model's chat template, each turn's time to first token with and
without reusing the conversation's KV (kind "prefix_chat").

``run(loaded, PrefixChatParams, progress, should_stop)`` -> run with tables
  turns   two rows per turn (``mode`` "reuse" | "no reuse"): the prompt (the whole conversation
          so far in the template, ending with the assistant's header) in tokens, the tokens
          taken from the prefix cache and those computed, ``ttft_ms`` (median of
          ``repeats`` samples: lookup, admission and the prefill to the first token's logits)
          with its ``samples_ms``, ``lookup_ms``, ``kv_bytes_held`` (the pool's blocks held
          when the first token is ready: the tree's and the request's), ``kv_bytes_computed``
          (the rows this turn computed), the assistant's answer (greedy, at most
          ``answer_tokens``, ending at the end-of-turn token), ``identical`` (the two modes'
          answers token for token) and the first logits' drift between the modes
  checks  the largest drift and whether every answer was identical
The user turns are ``USER_TURNS``: eight real, varied requests (a trip, a language, a laptop, a
poem, a summary). The assistant turns are the model's own greedy answers, as the "reuse" mode
wrote them (the same as "no reuse" wrote them when ``identical``). "no reuse" computes every
turn's whole prompt and keeps nothing; "reuse" serves each turn from the tree the earlier turns
left (prompt and answer), so only the new user turn and the template around it are computed.
Needs a model whose tokenizer has a chat template (SmolLM2's, or a checkpoint's own).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from engine.models.config import ModelConfig
from instruments.experiments.inputs import whole
from instruments.experiments.prefix.parts import budget_for, drift, load_avg, serve
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, no_grad, record

USER_TURNS = [
    "I'm planning a week in Portugal in October. Which two cities would you suggest for "
    "someone who loves old streets, history and good food, and why?",
    "Lisbon sounds lovely. Name three neighbourhoods there that are worth an afternoon's walk.",
    "How do I get from Lisbon to Porto without a car, and roughly how long does it take?",
    "Suggest one vegetarian dish I should try in Porto, and describe it in two sentences.",
    "What is a polite way to ask for the bill in a café, in Portuguese?",
    "Different question: my laptop's fan roars whenever I edit photos. What are the most "
    "likely causes, and what can I check first?",
    "Write a four-line poem about the sea at dusk.",
    "Summarise everything we talked about in three short bullet points.",
]


@dataclass
class PrefixChatParams:
    """``turns`` user turns of ``USER_TURNS``, answers of at most ``answer_tokens``."""

    turns: int = len(USER_TURNS)
    answer_tokens: int = 48
    repeats: int = 3
    block_tokens: int = 16

    @classmethod
    def defaults(cls, device: str, cfg: ModelConfig) -> PrefixChatParams:
        return cls()

    def check(self, cfg: ModelConfig, device: str) -> None:
        whole("turns", self.turns, 1, len(USER_TURNS))
        whole("answer tokens", self.answer_tokens, 1, 512)
        whole("repeats", self.repeats, 1, 50)
        whole("block tokens", self.block_tokens, 1, 256)


Params = PrefixChatParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--turns", type=int, default=len(USER_TURNS),
                   help=f"user turns, 1..{len(USER_TURNS)}")
    p.add_argument("--answer-tokens", type=int, default=48,
                   help="the most tokens of each assistant answer")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block-tokens", type=int, default=16)


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> PrefixChatParams:
    return PrefixChatParams(args.turns, args.answer_tokens, args.repeats, args.block_tokens)


def summary(run: dict[str, Any]) -> list[str]:
    rows = run["tables"].get("turns", [])
    lines = [f"turn {r['turn']} {r['mode']:8s}: {r['prompt_tokens']:5d} tokens, "
             f"{r['cached_tokens']:5d} cached, TTFT {r['ttft_ms']:8.1f} ms, KV computed "
             f"{r['kv_bytes_computed'] / 2**20:6.2f} MiB" + ("" if r["identical"]
                                                              else "  ANSWERS DIFFER")
             for r in rows]
    for mode in ("no reuse", "reuse"):
        mine = [r for r in rows if r["mode"] == mode]
        if len(mine) > 1:
            lines.append(f"{mode}: turn {mine[-1]['turn']}'s TTFT = "
                         f"{mine[-1]['ttft_ms'] / mine[0]['ttft_ms']:.2f}x turn 1's")
    return lines


def _turn(model: Any, cache: Any, ids: list[int], reuse: bool, p: PrefixChatParams,
          sampler: Any, eos: int | None) -> tuple[dict[str, Any], Any, list[int]] | None:
    """One mode's turn: timed samples, then the last sample's request answers; None if
    stopped."""
    served: list[Any] = []

    def drop() -> None:
        while served:
            cache.cancel(served.pop().request)

    got = sampler.point(lambda: served.append(serve(model, cache, ids, p.answer_tokens, reuse)),
                        drop)
    if got is None:
        drop()
        return None
    last = served.pop()
    drop()
    held = cache.used_bytes()
    answer = last.request.greedy(model, last.logits, p.answer_tokens, eos)
    (cache.finish if reuse else cache.cancel)(last.request)
    bpt = cache.pool.block_bytes // cache.block_tokens
    row = {"mode": "reuse" if reuse else "no reuse", "prompt_tokens": len(ids),
           "cached_tokens": last.cached, "new_tokens": len(ids) - last.cached,
           "ttft_ms": got.median_ms, "samples_ms": got.samples_ms, "lookup_ms": last.lookup_ms,
           "kv_bytes_held": held, "kv_bytes_computed": (len(ids) - last.cached) * bpt,
           "tree_tokens": cache.tokens_held(), "answer_len": len(answer), **got.quiet()}
    return row, last.logits, answer


def chat_tokenizer(model: Any) -> Any:
    """The model's tokenizer (a checkpoint's own, else its family's) when it holds a chat
    template; ValueError saying what is allowed otherwise."""
    from instruments import lineup

    allowed = ("allowed: an instruct model's (smollm2-135m; llama-tiny for a quick run), or a "
               "checkpoint whose tokenizer holds one")
    try:
        tok = lineup.tokenizer(model)
    except (ValueError, lineup.TokenizerError) as exc:
        raise ValueError(f"the chat needs a model with a chat template ({exc}); {allowed}") \
            from exc
    if not tok.chat_template:
        raise ValueError(f"the chat needs a model with a chat template ({tok.name} has none); "
                         f"{allowed}")
    return tok


@no_grad
def run(loaded: Loaded, params: PrefixChatParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    """The chat, turn by turn, with and without reuse (see the module docstring)."""
    from engine.cache import PrefixCache
    from instruments.measure.sampler import Sampler

    model = loaded.checked(params)
    cfg = model.config
    tok = chat_tokenizer(model)
    load_start = load_avg()
    budget = budget_for(cfg, model.dtype, cfg.block_size + 4 * params.block_tokens)
    caches = {False: PrefixCache(model, budget, block_tokens=params.block_tokens),
              True: PrefixCache(model, budget, block_tokens=params.block_tokens)}
    tr = Tracker(progress, should_stop, params.turns, unit="turns")
    sampler = Sampler(model.device, repeats=params.repeats, warmup=1, should_stop=tr.stop)
    messages: list[dict[str, str]] = []
    stopped = False
    for turn, text in enumerate(USER_TURNS[: params.turns], 1):
        messages.append({"role": "user", "content": text})
        ids = tok.encode(tok.chat_messages(messages))
        if len(ids) + params.answer_tokens > cfg.block_size:
            tr.note(f"turn {turn} ({len(ids)} tokens + {params.answer_tokens}) is beyond the "
                    f"model's context of {cfg.block_size}: the chat ends at turn {turn - 1}")
            break
        done = [_turn(model, caches[reuse], ids, reuse, params, sampler, tok.eos_id)
                for reuse in (False, True)]
        if any(d is None for d in done):
            stopped = True
            break
        (plain, plain_logits, plain_answer), (mine, logits, answer) = done  # type: ignore
        same = {"turn": turn, "identical": answer == plain_answer,
                **{f"between_modes_{k}": v for k, v in drift(logits, plain_logits).items()}}
        text_out = tok.decode(answer).replace("<|im_end|>", "").strip()
        tr.row("turns", {"turn": turn, **plain, **same, "answer": tok.decode(plain_answer)
                         .replace("<|im_end|>", "").strip()}, points=0)
        tr.row("turns", {"turn": turn, **mine, **same, "answer": text_out},
               f"turn {turn}: {mine['ttft_ms']:.0f} ms with reuse, {plain['ttft_ms']:.0f} "
               "without")
        tr.work += 1
        messages.append({"role": "assistant", "content": text_out})
    rows = tr.tables.get("turns", [])
    if rows:
        tr.tables["checks"] = [{
            "turns": len(rows) // 2, "all_identical": all(r["identical"] for r in rows),
            "max_abs_logit_diff": max(r["between_modes_max_abs_logit_diff"] for r in rows),
            "all_within_tolerance": all(r["between_modes_exact"] for r in rows)}]
    if stopped:
        tr.note("stopped: what was measured is kept")
    return record(loaded, "prefix_chat", params, tr.tables, partial=stopped, notes=tr.notes,
                  user_turns=USER_TURNS[: params.turns], budget_bytes=budget,
                  kv_bytes_per_token=budget_for(cfg, model.dtype, 1),
                  load_avg_start=load_start, load_avg_end=load_avg(),
                  ttft_turn_ratio={m: _ratio(rows, m) for m in ("reuse", "no reuse")})


def _ratio(rows: list[dict[str, Any]], mode: str) -> float | None:
    mine = [r["ttft_ms"] for r in rows if r["mode"] == mode]
    return mine[-1] / mine[0] if len(mine) > 1 else None

