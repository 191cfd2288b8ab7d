#!/usr/bin/env python
"""Train the small model whose greedy stream is not degenerate: the speculative-decoding fixture.

    python scripts/train_fixture.py --out /tmp/stage1        # 500 steps from scratch, then
    python scripts/train_fixture.py --init /tmp/stage1 --steps 700 --lr 2e-3 --seed 1 --threads 1
                                               # 700 more, into tests/fixtures/bytes_stdlib/

gpt2 with random weights repeats one token greedily, so prompt lookup's drafts are trivially
right. This trains a GPT-2-shaped model (our ``engine.models.gpt2.model.GPT``: 4 layers, 4 heads,
width 128, 256 positions, 0.86 M parameters) on UTF-8 bytes (a vocabulary of 256: no tokenizer
files, a cheap softmax) of the Python standard library's own sources -- text at hand on every
machine -- for a fixed number of AdamW steps, and saves it as a ``transformers`` GPT-2 checkpoint
folder (config.json + model.safetensors, 3.4 MB in fp32), so
``engine.families.load(name, FOLDER)`` and the CLI's ``--weights FOLDER`` load it like
any checkpoint. ``training.json`` beside it says what it was trained on and how far it got
(``history``: the runs it continued). The shipped fixture is the two commands above; on the shared
2-core machine they took 66 and 18 minutes (one thread is faster there than two: the cores were
contended), held-out loss 1.85 then 1.49 nats/byte. Seeded; the stdlib's version decides the text.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.models.config import GPTConfig  # noqa: E402
from engine.models.gpt2.model import GPT  # noqa: E402
from engine.models.gpt2.tokenizer import BYTE_VOCAB  # noqa: E402
from engine.models.gpt2.weights import to_transformers  # noqa: E402

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "bytes_stdlib"
SHAPE = dict(n_layer=4, n_head=4, n_embd=128, block_size=256, vocab_size=BYTE_VOCAB)


def corpus(max_bytes: int) -> tuple[torch.Tensor, list[str]]:
    """The standard library's top-level modules, in name order, up to ``max_bytes``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data, names = bytearray(), []
    for path in sorted(stdlib.glob("*.py")):
        if len(data) >= max_bytes:
            break
        data += path.read_bytes() + b"\n"
        names.append(path.name)
    return torch.tensor(list(data[:max_bytes]), dtype=torch.long), names


def batches(data: torch.Tensor, batch: int, length: int, gen: torch.Generator
            ) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, data.numel() - length - 1, (batch,), generator=gen)
    x = torch.stack([data[s : s + length] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + length + 1] for s in starts.tolist()])
    return x, y


def loss_of(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits, _ = model(x, use_cache=False, logits="all")
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=128, help="tokens (bytes) per sequence")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-bytes", type=int, default=4_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(FIXTURE))
    ap.add_argument("--init", default=None,
                    help="a checkpoint folder to continue from (its training.json is kept as "
                    "the history of the new one)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data, names = corpus(args.max_bytes)
    split = int(data.numel() * 0.95)  # the last 5% held out
    train, held = data[:split], data[split:]
    history: list[dict] = []
    if args.init:
        from instruments import lineup

        model = lineup.load_model("gpt2", args.init).model.requires_grad_(True).train()
        before = Path(args.init) / "training.json"
        if before.exists():
            old = json.loads(before.read_text(encoding="utf-8"))
            history = [*old.pop("history", []), old]
    else:
        model = GPT.random(GPTConfig(**SHAPE), seed=args.seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    warm = max(1, args.steps // 20)
    start = time.perf_counter()
    for step in range(args.steps):
        # linear warm-up, then cosine down to a tenth
        f = (step + 1) / warm if step < warm else 0.55 + 0.45 * math.cos(
            math.pi * (step - warm) / max(1, args.steps - warm))
        for group in opt.param_groups:
            group["lr"] = args.lr * f
        x, y = batches(train, args.batch, args.length, gen)
        loss = loss_of(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f} nats/byte  "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    train_s = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        hx, hy = batches(held, 64, args.length, torch.Generator().manual_seed(1))
        held_loss = float(loss_of(model, hx, hy))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hf = to_transformers(model)
    # GPT-2's end-of-text id (50256) is outside a byte vocabulary: no special tokens at all
    hf.config.bos_token_id = hf.config.eos_token_id = None
    hf.generation_config.bos_token_id = hf.generation_config.eos_token_id = None
    hf.save_pretrained(out, safe_serialization=True)
    facts = {
        "shape": SHAPE, "params": model.num_params(), "vocabulary": "UTF-8 bytes (256)",
        "text": f"Python {sys.version.split()[0]} standard library, {len(names)} top-level "
                f"modules in name order ({names[0]} .. {names[-1]}), {data.numel():,} bytes; "
                "the last 5% held out",
        "steps": args.steps, "batch": args.batch, "length": args.length, "lr": args.lr,
        "optimizer": "AdamW (0.9, 0.95), weight decay 0.1, warm-up then cosine to 0.1x, "
                     "gradients clipped at 1.0",
        "seed": args.seed, "threads": torch.get_num_threads(), "train_s": round(train_s, 1),
        "final_train_loss": round(loss.item(), 3), "held_out_loss": round(held_loss, 3),
        "torch": torch.__version__, "continued_from": args.init,
        "history": history,  # the runs this one continued, first first
    }
    (out / "training.json").write_text(json.dumps(facts, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(facts, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
