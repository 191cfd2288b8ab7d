"""llama.cpp's own server on a GGUF file, until it is killed: llama-server's C++ HTTP server
and its continuous batching over ``--parallel`` slots, from the registry's prebuilt xllamacpp
wheel (requirements-http-bench.txt). scripts/bench_server.py starts it with the bench
environment's Python (.venv-http-bench); it prints one line of JSON, the address and the
versions, once it listens:

  .venv-http-bench/bin/python scripts/llama_server.py --model F32.gguf --port 8080 \
      --parallel 16 --threads 2 [--ctx-per-slot 512] [--kv-type f32|f16]

Its K/V cache is held in f32 by default, as ours is, so both servers read and write the same
bytes per token (llama.cpp's own default is f16: ``--kv-type f16``). Flash attention is left
to llama.cpp (auto). The prebuilt CPU wheel is built without -march=native (AVX2, no AVX-512
or AMX: its ``get_system_info()`` line is printed), so no AMX-off flag is needed; a source build
tuned for the host may be faster, and the doc says which one ran.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--parallel", type=int, default=16, help="slots (requests at once)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ctx-per-slot", type=int, default=512, help="tokens each slot holds")
    ap.add_argument("--kv-type", default="f32", choices=("f32", "f16"))
    args = ap.parse_args()
    try:
        import xllamacpp as xlc
    except ImportError:
        print("llama_server: xllamacpp is not installed: make the bench environment "
              "(scripts/bench_server.py --setup)", file=sys.stderr)
        return 2
    # the signals that end it, held for sigwait (the server's threads inherit the mask)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    p = xlc.CommonParams()
    p.model.path = args.model
    p.n_parallel = args.parallel
    p.n_ctx = args.parallel * args.ctx_per_slot  # llama-server splits n_ctx among its slots
    p.cont_batching = True
    if args.threads:
        p.cpuparams.n_threads = args.threads
        p.cpuparams_batch.n_threads = args.threads
    kv = xlc.ggml_type.GGML_TYPE_F32 if args.kv_type == "f32" else xlc.ggml_type.GGML_TYPE_F16
    p.cache_type_k, p.cache_type_v = kv, kv
    p.hostnames = ["127.0.0.1"]
    p.port = args.port
    p.endpoint_metrics = True
    p.ui = False
    p.warmup = True
    server = xlc.Server(p)
    print(json.dumps({"address": server.listening_address, "xllamacpp": xlc.__version__,
                      "build_info": xlc.BUILD_INFO, "system_info": xlc.get_system_info(),
                      "parallel": args.parallel, "ctx_per_slot": args.ctx_per_slot,
                      "kv_type": args.kv_type, "threads": args.threads}), flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    return 0


if __name__ == "__main__":
    sys.exit(main())
