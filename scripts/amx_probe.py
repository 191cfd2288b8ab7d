"""Probe llama.cpp builds on an AMX CPU. For the GPU machine's Xeon host: which run, which crash.

On a Sapphire Rapids Xeon, llama.cpp as ``make peers`` built it (``-march=native``, AMX compiled
in) put Q8_0/Q4_1 weights in its AMX buffer type and segfaulted in the first decode
(``ggml_backend_amx_mul_mat``, ggml-org/llama.cpp#20824); ``make peers`` now adds
``-mno-amx-int8``. This checks builds made elsewhere on such a host, which needs no compiler:

    python3 scripts/amx_probe.py --out OUT [--threads 2] NAME=DIR [NAME=DIR ...]

Each DIR holds one llama-cpp-python build (its wheel unzipped, or ``pip install --no-deps
--target DIR WHEEL``); gguf and diskcache must be importable too (PYTHONPATH). For each model
shape -- ``tiny`` (GPT-2's layout: the test that crashed) and SmolLM2-135M's matrices in 2
blocks, random weights -- the parent writes F32, Q8_0 and Q4_1 GGUF files with our writer
(``instruments/peers/gguf_out.py``) and computes mode 1's logits after 8 tokens and after each of
2 more. Then, per build and file, a child process loads the file with the adapter's own calls
(``instruments/peers/llamacpp_api.py``) and decodes those 10 tokens: one line each, such as
    amx-off tiny q8_0: ok, max |diff| from mode 1 0.0123 (1.0% of its largest logit); AMX_INT8 0..
    amx-on tiny q8_0: crashed (signal 11, SIGSEGV)
a first line of what ``make peers``' flags give this CPU (where a compiler is at hand: ``cc
-dM -E``), and per build one line of the adapter as a run builds it (``lineup.make_decoder(tiny,
llamacpp_q8_0)`` and one step, in a child with torch): "ok", or "unavailable: crashed (signal
11, SIGSEGV) in a probe of ..." -- the containment (``instruments/peers/native.py``) at work. The
lines go to stdout and OUT/amx_probe.txt. Children are given 30 s each (their work takes
seconds).

The wheels, built on a 2-core AVX2 box for the Sapphire Rapids host (there they only compile:
it cannot run AVX-512); llama-cpp-python's wheel is tagged py3-none-linux_x86_64 (any CPython 3,
glibc >= 2.34, libstdc++ of GCC >= 11) and asks for libgomp.so.1 (torch's copy where torch was
imported first, else the system's, else the one carried in .whl-amx/lib):
    SKIP="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
          -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=OFF"
    F="-march=sapphirerapids -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"   # .whl-amx/amx-off
    F="-march=sapphirerapids"   # .whl-amx/amx-on: what -march=native gives there, AMX compiled in
    CMAKE_ARGS="$SKIP '-DCMAKE_C_FLAGS=$F' '-DCMAKE_CXX_FLAGS=$F'" CMAKE_BUILD_PARALLEL_LEVEL=2 \
        nice -n 10 python3.12 -m pip wheel --no-deps -w .whl-amx/amx-off llama-cpp-python==0.3.36
    pip download --no-deps -d .whl-amx gguf==0.19.0 diskcache==5.6.3
    mkdir .whl-amx/lib && cp /lib/x86_64-linux-gnu/libgomp.so.1 .whl-amx/lib/
On the host, from the repository root with .whl-amx/ there (wheels are zips: no pip needed):
    T=$(mktemp -d); for w in amx-off amx-on; do python3 -m zipfile -e .whl-amx/$w/*.whl $T/$w; done
    for w in .whl-amx/*.whl; do python3 -m zipfile -e $w $T/common; done
    LD_LIBRARY_PATH=$PWD/.whl-amx/lib PYTHONPATH=$T/common \
        python3 scripts/amx_probe.py --out OUT amx-off=$T/amx-off amx-on=$T/amx-on
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FORMATS = ("f32", "q8_0", "q4_1")
PROMPT, STEPS = 8, 2  # mode 1's logits after 8 tokens, then after each of 2 more
CHILD_S = 30


def child(path: str, ids: str, threads: str, out: str) -> None:
    """In a child: decode ``ids`` with the build on PYTHONPATH, save the logits rows."""
    import numpy as np

    from instruments.peers import llamacpp_api as c

    api = c.import_llama_cpp()
    info = api.llama_print_system_info().decode()
    handle = c.load(api, Path(path))
    amx_buffer = any("AMX" in line for line in c.log())  # "AMX model buffer size = ..."
    ctx, _ = c.new_context(api, handle, 2 * (PROMPT + STEPS), int(threads))
    n_vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(handle))
    tokens = [int(t) for t in ids.split(",")]
    rows = []
    for chunk in [tokens[:PROMPT], *([t] for t in tokens[PROMPT:])]:
        c.decode(api, ctx, chunk)
        rows.append(np.ctypeslib.as_array(api.llama_get_logits_ith(ctx, -1),
                                          shape=(n_vocab,)).copy())
    np.save(out, np.stack(rows))
    print(json.dumps({"amx_int8": "AMX_INT8 = 1" in info, "amx_buffer": amx_buffer}))


def adapter(threads: str) -> None:
    """In a child with torch: the llamacpp_q8_0 peer as a run builds it, and one step."""
    import torch

    from engine.loop import random_prompt
    from instruments import lineup
    from instruments.lineup import PeerUnavailable

    _offline()
    torch.set_num_threads(int(threads))
    state = lineup.load_model("tiny", "random")
    ids = random_prompt(state.model, 1, PROMPT + 1, seed=1)
    try:
        dec = lineup.make_decoder(state, "llamacpp_q8_0", capacity=32, threads=int(threads))
        dec.prefill(ids[:, :PROMPT])
        dec.step(ids[:, PROMPT:])
        print("ok: built, a prefill and a step ran in this process")
    except PeerUnavailable as exc:
        print(f"unavailable: {exc}")


def _models() -> dict:
    """name -> a random model (std 0.02): tiny, and SmolLM2-135M's matrices in 2 blocks."""
    from instruments import lineup

    shapes = {"tiny": lineup.config("tiny"), "smollm2-2blocks": dataclasses.replace(
        lineup.config("smollm2-135m"), n_layer=2)}
    return {name: lineup.model_class(cfg).random(cfg, seed=0) for name, cfg in shapes.items()}


def _offline() -> None:
    """Placeholder tokens in GPT-2's files: tiktoken would try to download its files."""
    from instruments.peers import gguf_out

    gguf_out.VOCABULARY = False


def _spawn(args: list[str], build: Path, timeout: float = CHILD_S
           ) -> tuple[int | None, str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(build), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    try:
        done = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True,
                              text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, "", ""
    return done.returncode, done.stdout, done.stderr


def _compiler() -> str:
    """What ``make peers``' flags give on this CPU, where a C compiler is at hand: the Makefile
    puts -mno-amx-int8 (CMAKE_C_FLAGS) before -march=native (ggml's own flag)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "no C compiler here: not checked"

    def defined(*flags: str) -> str:
        got = subprocess.run([cc, *flags, "-dM", "-E", "-x", "c", "-"], input="",
                             capture_output=True, text=True, check=False).stdout
        names = ("__AMX_INT8__", "__AVX512F__", "__AVX512VNNI__", "__AVX512BF16__")
        return " ".join(n.strip("_") for n in names if f"#define {n} " in got) or "none"

    return (f"{cc} -march=native defines {defined('-march=native')}; "
            f"-mno-amx-int8 -march=native defines {defined('-mno-amx-int8', '-march=native')}")


def _said(rc: int | None, err: str) -> str:
    from instruments.peers.native import signal_name

    if rc is None:
        return f"hung (no exit in {CHILD_S} s)"
    if rc < 0:
        return f"crashed ({signal_name(-rc)})"
    return f"failed (exit {rc}): {(err.strip().splitlines() or ['no output'])[-1]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="a folder: amx_probe.txt is written there")
    p.add_argument("--threads", default="2", help="llama.cpp's threads (the tests' 2)")
    p.add_argument("builds", nargs="+", help="NAME=DIR, DIR holding one llama-cpp-python build")
    args = p.parse_args(argv)
    builds = dict(b.split("=", 1) if "=" in b else (Path(b).name, b) for b in args.builds)
    import numpy as np
    import torch

    from engine.loop import random_prompt
    from instruments import lineup
    from instruments.peers import gguf_out

    _offline()
    lines = [f"compiler: {_compiler()}"]
    print(lines[0], flush=True)
    work = Path(tempfile.mkdtemp(prefix="amx_probe_"))
    for model, weights in _models().items():
        ids = random_prompt(weights, 1, PROMPT + STEPS, seed=1)
        dec = lineup.make_decoder(weights, "uncached", capacity=PROMPT + STEPS)
        with torch.no_grad():
            want = [dec.prefill(ids[:, :PROMPT])]
            want += [dec.step(ids[:, t:t + 1]) for t in range(PROMPT, PROMPT + STEPS)]
        want_np = torch.cat(want).numpy()
        text_ids = ",".join(str(int(t)) for t in ids[0])
        for fmt in FORMATS:
            path = gguf_out.write_gguf(weights, work / f"{model}.{fmt}.gguf", fmt)
            for name, build in builds.items():
                out = work / f"{name}.{model}.{fmt}.npy"
                rc, said, err = _spawn(["--child", str(path), text_ids, args.threads, str(out)],
                                       Path(build))
                if rc == 0:
                    flags = json.loads(said.strip().splitlines()[-1])
                    diff = float(np.abs(np.load(out) - want_np).max())
                    share = diff / float(np.abs(want_np).max())
                    line = (f"ok, max |diff| from mode 1 {diff:.3g} ({share:.1%} of its largest "
                            f"logit); AMX_INT8 {int(flags['amx_int8'])}, AMX buffer "
                            f"{'yes' if flags['amx_buffer'] else 'no'}")
                else:
                    line = _said(rc, err)
                lines.append(f"{name} {model} {fmt}: {line}")
                print(lines[-1], flush=True)
    for name, build in builds.items():
        rc, said, err = _spawn(["--adapter", args.threads], Path(build), timeout=4 * CHILD_S)
        line = said.strip().splitlines()[-1] if rc == 0 and said.strip() else \
            _said(rc, err) + " -- in the measuring process: the containment failed"
        lines.append(f"{name} adapter llamacpp_q8_0: {line}")
        print(lines[-1], flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "amx_probe.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(*sys.argv[2:])
    elif sys.argv[1:2] == ["--adapter"]:
        adapter(*sys.argv[2:])
    else:
        sys.exit(main())
