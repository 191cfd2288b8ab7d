"""Generate side by side: one prompt, greedily, through two modes, token by token (kind
"generation").

``run(loaded, GenerationParams, progress, should_stop)`` -> run with tables ``tokens`` (one row
per generated token and side: side, mode, step, token_id, piece -- its text --, context_len,
step_ms -- streamed as they come, so the page writes the text live) and ``verdict`` (identical,
or the first new token where the two part, both tokens and their logit gap in each run); meta
``prompt_text`` (what the model read, the chat template applied when asked) and ``texts`` (each
side's whole text). The prompt is text, tokenized here by the model's own tokenizer (its
family's: GPT-2's BPE, SmolLM2's from its GGUF file), so the dashboard's server never loads a
tokenizer; or ids (``prompt_ids``) for callers that have them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.models.config import GPTConfig, ModelConfig
from instruments.experiments.inputs import (
    modes_usable,
    parse_modes,
    whole,
)
from instruments.measure.timing import StepClock
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, no_grad, record

if TYPE_CHECKING:

    from engine.loop import Step


@dataclass
class GenerationParams:
    """One prompt generated greedily through two modes, token by token, and the verdict."""
    prompt_text: str = ""
    new_tokens: int = 40
    modes: list[str] = field(default_factory=lambda: ["prealloc_fused", "uncached"])
    chat: bool = False  # wrap the text in the model's chat template (an instruct model's)
    prompt_ids: list[int] = field(default_factory=list)  # instead of text

    def check(self, cfg: GPTConfig, device: str) -> None:
        if not self.prompt_ids and not self.prompt_text.strip():
            raise ValueError("The prompt is empty: type at least one character.")
        whole("new tokens", self.new_tokens, 1)
        if len(self.modes) != 2 or self.modes[0] == self.modes[1]:
            raise ValueError("Pick two different modes to compare (left and right are the "
                             "same).")
        modes_usable(self.modes, device, cfg.family)
        fits(len(self.prompt_ids), self.new_tokens, cfg.block_size)

    def ids(self, model: Any) -> tuple[list[int], str]:
        """(the prompt's ids, the text the model reads): the text through the model's
        tokenizer, in its chat template when asked (ValueError where the model has none)."""
        if self.prompt_ids:
            return list(self.prompt_ids), ""
        from instruments.lineup import tokenizer

        cfg, tok = model.config, tokenizer(model)
        text = tok.chat(self.prompt_text) if self.chat else self.prompt_text
        ids = tok.encode(text)
        if not ids:
            raise ValueError("The prompt is empty: type at least one character.")
        fits(len(ids), self.new_tokens, cfg.block_size)
        return ids, text


def fits(n: int, new_tokens: int, limit: int) -> None:
    if n + new_tokens > limit:
        raise ValueError(
            f"Prompt ({n} tokens) + {new_tokens} new tokens is beyond the model's limit"
            f" of {limit} tokens; allowed: at most {max(limit - n, 0)} new tokens.")


Params = GenerationParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default="The KV cache stores",
                   help="the prompt, read by the model's own tokenizer")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template (an instruct model's)")
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--modes", default="prealloc_fused,uncached", help="two modes: left,right")


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> GenerationParams:
    return GenerationParams(args.prompt, args.new_tokens, parse_modes(args.modes), args.chat)


def summary(run: dict[str, Any]) -> list[str]:
    return [f"{v['left']} vs {v['right']}: " + ("identical" if v.get("identical") else
            f"part at new token {v.get('first_difference')}")
            for v in run["tables"].get("verdict", [])]



@no_grad
def run(loaded: Loaded, params: GenerationParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    from engine.loop import checked_request, decode
    from instruments.checks.correctness import compare_streams
    from instruments.lineup import make_decoder, tokenizer

    model = loaded.checked(params)
    ids, prompt_text = params.ids(model)
    tok = tokenizer(model)
    idx = checked_request(model, [ids], params.new_tokens)
    n = params.new_tokens
    tr = Tracker(progress, should_stop, 2 * n, unit="tokens")
    gens = []
    for side, mode in zip(("left", "right"), params.modes, strict=True):
        dec = make_decoder(model, mode, batch_size=1, capacity=idx.size(1) + n)

        def on_step(s: Step, side: str = side, mode: str = mode) -> None:
            tr.work += 1
            tr.row("tokens", {"side": side, "mode": mode, "step": s.index,
                              "token_id": s.token_ids[0],
                              "piece": tok.decode_each([s.token_ids[0]])[0],
                              "context_len": s.context_len, "step_ms": s.step_ms},
                   f"{mode}: token {s.index + 1}/{n}")

        gens.append(decode(dec, idx, n, keep_logits=True, timer=StepClock(model.device),
                           on_step=on_step, should_stop=tr.stop))
        del dec
    a, b = gens
    stopped = a.stopped_early or b.stopped_early
    verdict = compare_streams(a.tokens[0].tolist(), b.tokens[0].tolist(), a.logits, b.logits)
    tables = {"tokens": tr.tables.get("tokens", []),
              "verdict": [] if stopped else [{"left": params.modes[0],
                                              "right": params.modes[1],
                                              "new_tokens": int(a.tokens.size(1)),
                                              **vars(verdict)}]}
    if stopped:
        tr.note("stopped before both sides finished: no verdict")
    texts = {side: tok.decode(g.tokens[0].tolist()) for side, g in zip(("left", "right"), gens,
                                                                         strict=True)}
    return record(loaded, "generation", params, tables, partial=stopped, notes=tr.notes,
                  prompt_text=prompt_text or tok.decode(ids), prompt_tokens=len(ids),
                  texts=texts, tokenizer=tok.name)
