"""``python -m instruments server``: the serving engine behind an OpenAI-compatible endpoint.

  python -m instruments server --model smollm2-135m [--port 8000] [--host 127.0.0.1]
         [--api-key KEY] [--max-seqs 64] [--kv-budget-mb 1024] [--step auto|forward|fast] ...
  --model is a preset (``python -m instruments server --help`` lists them) or a checkpoint's
  path (a folder, a GGUF file), read with its own tokenizer; a model with none here serves
  token-id prompts only (``IdsOnly``: a text prompt is a 400 saying why).

What runs: the engine core in a process of its own (``instruments.server.core``), started and
ready before the port opens; the front end (``instruments.server.app``) under uvicorn in this
process. Bad input is one line and exit code 2 (``ValueError`` here, turned into the CLI's
error by ``instruments.cli``) before anything loads: a port in use, a non-loopback address
without --api-key, a missing package. Ctrl-C (or SIGTERM) stops uvicorn, then the core.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import Any

NEEDS = ("starlette", "uvicorn", "prometheus_client")
INSTALL = "pip install -r requirements-serving.txt"


def add_parser(sub: Any, models: list[str]) -> None:
    p = sub.add_parser("server", help="the serving engine behind an OpenAI-compatible HTTP "
                       "endpoint (/v1/completions, /v1/chat/completions, /v1/models, /health, "
                       "/metrics)")
    p.add_argument("--model", default="smollm2-135m",
                   help=f"a preset ({', '.join(models)}) or a path: a GGUF file or a GPT-2 "
                   "checkpoint folder")
    p.add_argument("--weights", default=None, help="as for the experiments (default: the "
                   "preset's real weights; random for GPT-2)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as 'model' (default: --model as given)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--seed", type=int, default=0, help="random weights' seed")
    p.add_argument("--threads", type=int, default=None, help="the core's torch threads")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (any but loopback needs --api-key)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("KVLAB_API_KEY"),
                   help="required as 'Authorization: Bearer KEY' on /v1 (default: "
                   "$KVLAB_API_KEY; none on loopback)")
    p.add_argument("--max-seqs", type=int, default=64, help="requests running at once; the "
                   "rest wait in the queue")
    p.add_argument("--step-tokens", type=int, default=512, help="tokens one step may run")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--kv-budget-mb", type=float, default=1024.0,
                   help="the K/V block pool's bytes (MiB), at most what max-seqs full "
                   "contexts need")
    p.add_argument("--policy", default="fcfs", choices=("fcfs", "lpm"))
    p.add_argument("--reads", default="auto", choices=("auto", "in_place", "gather"))
    p.add_argument("--step", default="auto", choices=("auto", "forward", "fast"),
                   help="how an all-decode step runs (engine.serving.engine.STEPS; auto: "
                   "fast on a CPU in fp32 with the kernel built, else forward)")
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check(args: argparse.Namespace) -> None:
    """ValueError for what can be refused before anything loads (module docstring)."""
    import importlib.util

    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"the server needs {', '.join(missing)}: {INSTALL}")
    if not is_loopback(args.host) and not args.api_key:
        raise ValueError(f"listening on {args.host} (not loopback) needs --api-key: anyone who "
                         "reaches the port could use the engine otherwise")
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be within 1..65535, got {args.port}")
    for name, v, lo, hi in (("--max-seqs", args.max_seqs, 1, 1024),
                            ("--step-tokens", args.step_tokens, 1, 65536),
                            ("--block-tokens", args.block_tokens, 1, 256)):
        if not lo <= v <= hi:
            raise ValueError(f"{name} must be within {lo}..{hi}, got {v}")
    if not args.kv_budget_mb > 0:
        raise ValueError(f"--kv-budget-mb must be above 0, got {args.kv_budget_mb}")
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((args.host, args.port))
        except OSError as exc:
            raise ValueError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}; "
                             "allowed: a free port (--port)") from None


def model_spec(args: argparse.Namespace, presets: list[str]) -> dict[str, Any]:
    """The ``ModelSpec`` fields --model names: a preset, or a checkpoint's path (a GGUF file, a
    folder with config.json), read as the family its file says (``lineup.preset``)."""
    from instruments import lineup

    name, weights = args.model, args.weights
    if name not in presets:
        path = Path(name).expanduser()
        if not path.exists():
            raise ValueError(f"unknown model {args.model!r}; allowed: {', '.join(presets)}, "
                             "or the path of a checkpoint (a .gguf file, or a folder with "
                             "config.json and *.safetensors)")
        name = str(path if lineup.is_path(str(path)) else path.absolute())
        lineup.preset(name)  # a file no family reads: its message, before the core starts
    return {"name": name, "weights": weights, "device": args.device, "dtype": args.dtype,
            "seed": args.seed}


class IdsOnly:
    """A model with no tokenizer here: prompts are token ids, and text comes back as its ids."""

    name, chat_template, eos_id = "token ids", False, None

    def __init__(self, why: str) -> None:
        self.why = why

    def encode(self, text: str) -> list[int]:
        from instruments.server.api import ApiError

        raise ApiError(400, f"{self.why}; allowed: a prompt of token ids", "prompt")

    def decode(self, ids: list[int]) -> str:
        return "".join(f" {i}" for i in ids)  # a prefix of ids decodes to a prefix of text


def tokenizer_for(facts: dict[str, Any]) -> Any:
    """The loaded model's tokenizer (the checkpoint's own, else its family's:
    ``lineup.tokenizer``), from the facts the core reports; ``IdsOnly`` where it has none."""
    from instruments import lineup

    try:
        return lineup.tokenizer(lineup.config_from_dict(facts["config"], facts["family"]),
                                facts.get("checkpoint"))
    except (ValueError, lineup.TokenizerError) as exc:
        return IdsOnly(str(exc))


def run(args: argparse.Namespace) -> int:
    from instruments import lineup

    presets = lineup.models(tests=True)
    check(args)
    spec = model_spec(args, presets)
    if spec["weights"] is None:
        spec["weights"] = lineup.offline_weights(spec["name"])  # never the network
    served = args.served_model_name or args.model
    options = {"budget_bytes": int(args.kv_budget_mb * 2**20),
               "block_tokens": args.block_tokens, "max_seqs": args.max_seqs,
               "step_tokens": args.step_tokens, "policy": args.policy,
               "reads": None if args.reads == "auto" else args.reads, "step": args.step}
    import uvicorn

    from instruments.server.app import build_app
    from instruments.server.core import Core, CoreError

    print(f"starting the engine core ({spec['name']}, {spec['weights']}, {args.device}, "
          f"{args.dtype})...", file=sys.stderr, flush=True)
    try:
        core = Core.start(spec, options, args.threads)
    except CoreError as exc:
        raise ValueError(f"the engine core could not start: {exc}") from None
    try:
        tok = tokenizer_for(core.facts)
        if isinstance(tok, IdsOnly):
            print(f"no tokenizer: prompts must be token ids ({tok.why})", file=sys.stderr)
        app = build_app(core, tok, served, args.api_key)
        f = core.facts
        print(f"serving {served!r} at http://{args.host}:{args.port}/v1 (OpenAI-compatible; "
              f"context {f['context']}, up to {f['max_seqs']} running, {f['blocks']} K/V "
              f"blocks of {f['block_tokens']} tokens, {f['reads']} reads, {f['step']} step"
              f"{', API key required' if args.api_key else ''})", file=sys.stderr, flush=True)
        uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                      log_level=args.log_level, access_log=False,
                                      lifespan="on")).run()
    finally:
        core.close()
    return 0
