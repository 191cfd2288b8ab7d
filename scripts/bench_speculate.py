#!/usr/bin/env python
"""Speculative decoding, measured against what the verify curve predicts, over three prompts.

    python scripts/bench_speculate.py                      # the trained fixture, then gpt2
    python scripts/bench_speculate.py --models fixture --threads 1 --new-tokens 128
    python scripts/bench_speculate.py --models smollm2-135m   # real weights: code, prose, chat

For each model and prompt, one ``speculate`` run (``instruments.experiments.speculate``: its own
verify curve at the prompt's contexts, then plain greedy decoding and prompt-lookup speculation
with drafts of each k, all timed by the Sampler), saved to --results-dir. Then a table: per
model, prompt and k, the acceptance, tokens per forward, the measured speedup over plain
decoding with the same mode (mode 5 by default) and both predictions -- the formula at the
measured acceptance, and the forwards that actually ran -- with the miss; the goal is the
prediction within 15% of the measured speedup. Run it on a quiet machine: numbers taken beside
other work are not worth publishing.

Models: "fixture" is ``tests/fixtures/bytes_stdlib`` (a small model trained on the Python
standard library, real and varied acceptance, but host-bound: its forwards are mostly
dispatch); "gpt2" is the 124M shape, random weights unless --gpt2-weights names a checkpoint
folder or "pretrained" (random weights repeat one token: acceptance is trivially high);
"smollm2-135m" runs on its package's real weights, and adds a chat answer: the prose prompt's
question in the model's chat template.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from instruments import lineup  # noqa: E402
from instruments.experiments import speculate  # noqa: E402
from instruments.spine import ModelSpec, load  # noqa: E402
from instruments.store import results  # noqa: E402

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "bytes_stdlib"
CHAT = "What does a transformer's key-value cache store, and why does it make decoding faster?"
PROMPTS = {
    "code": speculate.DEFAULT_PROMPT,
    "class": ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n"
              "        self.y = y\n\n    def __repr__(self):\n        return "),
    "prose": ("The cache keeps the keys and values of every token seen so far, so that each "
              "new token attends to them without recomputing them. The cache grows with the "
              "context, and so does the memory it needs: the"),
}
GOAL = 0.15


def fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def spec_for(name: str, args: argparse.Namespace) -> ModelSpec:
    if name == "fixture":
        return ModelSpec("gpt2", str(FIXTURE), args.device, "float32")
    if name == "gpt2":
        return ModelSpec("gpt2", args.gpt2_weights, args.device, "float32")
    return ModelSpec(name, lineup.preset(name).weights[0], args.device, "float32")


def prompts(name: str) -> dict[str, tuple[str, bool]]:
    """label -> (text, in the chat template): the chat answer where the model has a template."""
    out = {label: (text, False) for label, text in PROMPTS.items()}
    if name not in ("fixture", "gpt2") and lineup.preset(name).chat:
        out["chat"] = (CHAT, True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="fixture,gpt2")
    ap.add_argument("--gpt2-weights", default="random", help="random | pretrained | FOLDER")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mode", default="prealloc_fused")
    ap.add_argument("--k", default="1,2,4,8,16")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--results-dir", default="results")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.k.split(",")]
    lines = []
    for name in args.models.split(","):
        loaded = load(spec_for(name, args))
        block = loaded.model.config.block_size
        for label, (text, chat) in prompts(name).items():
            ids, _ = speculate.prompt_ids(loaded.model, text, args.new_tokens, chat)
            t0 = ids.size(1)
            contexts = sorted({t0, min(t0 + args.new_tokens, block - max(ks) - 1)})
            params = speculate.SpeculateParams(contexts, ks, args.mode, text, args.new_tokens,
                                               args.repeats, chat=chat)
            run = speculate.run(loaded, params)
            run["meta"].update(command="scripts/bench_speculate.py", bench_prompt=label)
            print(f"saved {results.save_run(run, args.results_dir)}", flush=True)
            for r in run["tables"]["speculative"]:
                pred = r["speedup_predicted_drafts"]
                miss = None if pred is None else pred / r["speedup_measured"] - 1
                verdict = "" if miss is None or abs(miss) <= GOAL else " (missed)"
                cells = [name, label, r["k"], fmt(r["acceptance"], ".0%"),
                         fmt(r["tokens_per_forward"], ".2f"), fmt(r["speedup_measured"], ".2f"),
                         fmt(r["speedup_predicted"], ".2f"), fmt(pred, ".2f"),
                         fmt(miss, "+.0%") + verdict, "yes" if r["identical"] else "NO"]
                lines.append("| " + " | ".join(map(str, cells)) + " |")
    print("\n| model | prompt | k | acceptance | tokens/forward | measured × | predicted × "
          "(formula) | predicted × (forwards) | miss | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except ValueError as exc:  # bad input, no tokenizer files offline: one line, not a traceback
        print(f"bench_speculate: {str(exc).splitlines()[0]}", file=sys.stderr)
        raise SystemExit(2) from None
