"""The HTTP benchmark: guidellm against our server and against llama.cpp's own server on the
same F32 GGUF and the same workload, beside our own harness at the same concurrencies and
rates (docs/serving-http.md).

  python scripts/bench_server.py --setup     the bench environment .venv-http-bench: guidellm
                                             and xllamacpp (requirements-http-bench.txt) over
                                             the main .venv (its torch and transformers)
  python scripts/bench_server.py --out docs/runs/serving-http      on a quiet machine
  python scripts/bench_server.py --smoke     llama-tiny, 2 requests a point: the pipeline end
                                             to end, nothing worth keeping

What it does, in order (one server at a time, nothing else running beside it):
  1. the model's weights as an F32 GGUF (``python -m instruments gguf``; SmolLM2: the shipped
     file re-written) and, for guidellm, a Hugging Face tokenizer folder of its tokenizer;
  2. our server (``python -m instruments server --model FILE``), then guidellm against it:
     closed loop at each --concurrency (C x --rounds requests) and Poisson at each --rates
     (--requests each), synthetic prompts of --prompt tokens asking for --output tokens,
     greedy (temperature 0), to length (ignore_eos), streamed, /v1/completions; its reports
     read into one run of kind "serving_http" (``instruments.server.report``);
  3. the same for llama-server (``scripts/llama_server.py``: xllamacpp, --parallel = the
     largest concurrency, K/V in f32), its version in the run;
  4. our own harness, the serving experiment (kind "serving": concurrency, then load with
     continuous batching), in this process on the same file, knobs and threads;
  5. a table: HTTP against the harness (throughput and TTFT, the 10% target; TPOT at the
     largest concurrency, the 2% target) and ours against llama-server (output tokens/s,
     ITL p99).
Runs are saved into --out (default results/). A timed step runs in the engine core's process
or in this one while no server runs, never beside a front end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BENCH_VENV = ROOT / ".venv-http-bench"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def setup() -> int:
    """.venv-http-bench over the main venv: its site-packages first, the main one after."""
    import site
    import sysconfig

    if not (BENCH_VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(BENCH_VENV)],
                       check=True)
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (BENCH_VENV / "lib" / ver / "site-packages" / "_kvlab_base.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n" + "\n".join(site.getsitepackages()) + "\n")
    return subprocess.run([str(BENCH_VENV / "bin" / "python"), "-m", "pip", "install", "-q",
                           "-r", str(ROOT / "requirements-http-bench.txt")]).returncode


def tool(name: str) -> Path:
    path = BENCH_VENV / "bin" / name
    if not path.exists():
        sys.exit(f"bench_server: {path} is missing: run `python scripts/bench_server.py "
                 "--setup` first (guidellm and xllamacpp, requirements-http-bench.txt)")
    return path


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"bench_server: the server at {url} exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    proc.terminate()
    sys.exit(f"bench_server: the server at {url} was not healthy within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def guidellm(url: str, model: str, tok_dir: Path, args: argparse.Namespace, profile: dict,
             requests: int, out: Path) -> dict:
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": model,
                    "request_format": "/v1/completions",
                    "extras": {"body": {"temperature": 0}}},
        "profile": profile, "tokenizer": {"kind": "hf_auto", "model": str(tok_dir)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": args.prompt,
                  "output_tokens": args.output}],
        "constraints": [{"kind": "max_requests", "count": requests}],
        "outputs": [{"kind": "json", "path": str(out)}]}}
    spec = out.with_suffix(".scenario.json")
    spec.write_text(json.dumps(scenario))
    done = subprocess.run([str(tool("guidellm")), "run", "--scenario", str(spec),
                           "--disable-progress"], cwd=out.parent, env={**os.environ,
                                                                       **OFFLINE},
                          capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        sys.exit(f"bench_server: guidellm failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def sweep(url: str, name: str, server: str, tok_dir: Path, work: Path,
          args: argparse.Namespace) -> dict:
    """guidellm at every concurrency and rate; one report with every benchmark."""
    merged: dict | None = None
    points = [({"kind": "concurrent", "streams": [c]}, max(c * args.rounds, 2), f"c{c}")
              for c in args.concurrency]
    points += [({"kind": "poisson", "rate": [r]}, args.requests, f"r{r:g}")
               for r in args.rates]
    for profile, n, tag in points:
        print(f"  guidellm -> {server}: {tag} ({n} requests)", flush=True)
        rep = guidellm(url, name, tok_dir, args, profile, n, work / f"{server}-{tag}.json")
        if merged is None:
            merged = rep
        else:
            merged["benchmarks"].extend(rep["benchmarks"])
    assert merged is not None
    return merged


def host_meta(args: argparse.Namespace, gguf: Path) -> dict:
    from instruments.measure.device import describe_device

    return {"model": args.model, "weights": f"{gguf.name} (F32 GGUF)", "device": "cpu",
            "device_name": describe_device("cpu")["name"], "dtype": "float32",
            "threads": args.threads, "concurrency": args.concurrency, "rates": args.rates,
            "prompt_tokens": args.prompt, "output_tokens": args.output,
            "rounds": args.rounds, "requests": args.requests}


def ours(gguf: Path, tok_dir: Path, work: Path, args: argparse.Namespace) -> dict:
    from instruments.server.report import to_run

    port, name = args.port, f"{args.model}-f32"
    cmd = [sys.executable, "-m", "instruments", "server", "--model", str(gguf),
           "--served-model-name", name, "--port", str(port), "--threads", str(args.threads),
           "--max-seqs", str(max(args.concurrency + [args.max_seqs])),
           "--step", args.step]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        report = sweep(url, name, "kvlab", tok_dir, work, args)
    finally:
        stop(proc)
    return to_run(report, server="kvlab", meta={**host_meta(args, gguf), "server_command":
                                                 " ".join(cmd[1:]), "step": args.step})


def llama(gguf: Path, tok_dir: Path, work: Path, args: argparse.Namespace) -> dict:
    from instruments.server.report import to_run

    port = args.port + 1
    cmd = [str(tool("python")), str(ROOT / "scripts" / "llama_server.py"), "--model",
           str(gguf), "--port", str(port), "--parallel", str(max(args.concurrency)),
           "--threads", str(args.threads),
           "--ctx-per-slot", str(args.prompt + args.output + 64)]
    log = (work / "llama-server.log").open("w")  # its per-request lines: kept, not printed
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout is not None
    facts = json.loads(proc.stdout.readline() or "{}")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        report = sweep(url, args.model, "llama-server", tok_dir, work, args)
    finally:
        stop(proc)
    return to_run(report, server="llama-server", meta={
        **host_meta(args, gguf), "llama_server": facts,
        "llama_cpp": f"xllamacpp {facts.get('xllamacpp')} (llama-server's C++ server; "
                     f"build info {facts.get('build_info')})"})


def harness(gguf: Path, args: argparse.Namespace) -> list[dict]:
    import torch

    from instruments.experiments.serving import ServingParams
    from instruments.experiments.serving import run as serving
    from instruments.spine import ModelSpec, load

    torch.set_num_threads(args.threads)
    loaded = load(ModelSpec(args.model, str(gguf), "cpu", "float32", 0))
    out = []
    for exp in ("concurrency", "load"):
        p = ServingParams(experiment=exp, concurrency=list(args.concurrency),
                          rounds=args.rounds, prompt_min=args.prompt, prompt_max=args.prompt,
                          output_min=args.output, output_max=args.output,
                          rates=list(args.rates), ways=["continuous"], requests=args.requests,
                          max_seqs=max(args.concurrency + [args.max_seqs]), peers=False,
                          step=args.step)
        print(f"  our harness: {exp}", flush=True)
        run = serving(loaded, p)
        run["meta"].update(model=args.model, weights=f"{gguf.name} (F32 GGUF)",
                           note=f"the harness beside guidellm's runs (scripts/"
                           f"bench_server.py); {run['meta'].get('note') or ''}".strip("; "))
        out.append(run)
    return out


def compare(http: dict, llama_run: dict | None, runs: list[dict]) -> list[str]:
    def by(rows: list[dict], key: str) -> dict:
        return {r[key]: r for r in rows if r.get(key) is not None}

    ours_c, ours_r = by(http["tables"]["points"], "concurrency"), by(
        http["tables"]["points"], "rate_per_s")
    lines = [f"{'point':>14s} | ours/harness tok/s | ours/harness TTFT p50 | "
             "ours/llama tok/s | ITL p99 ours/llama (ms)"]
    llama_pts = llama_run["tables"]["points"] if llama_run else []
    lc, lr = by(llama_pts, "concurrency"), by(llama_pts, "rate_per_s")
    harness_pts = [r for run in runs for r in run["tables"]["points"]]
    hc, hr = by(harness_pts, "concurrency"), by(harness_pts, "rate_per_s")

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:6.3f}" if a and b else "     —"

    for key, mine, h, ll in [(f"C={k}", v, hc.get(k), lc.get(k)) for k, v in ours_c.items()] \
            + [(f"{k:g}/s", v, hr.get(k), lr.get(k)) for k, v in ours_r.items()]:
        lines.append(f"{key:>14s} | {ratio(mine['output_tok_s'], h and h['output_tok_s']):>18s}"
                     f" | {ratio(mine['ttft_p50_ms'], h and h['ttft_p50_ms']):>21s} | "
                     f"{ratio(mine['output_tok_s'], ll and ll['output_tok_s']):>16s} | "
                     f"{mine['itl_p99_ms'] or 0:8.1f} / "
                     f"{(ll or {}).get('itl_p99_ms') or 0:8.1f}")
    top = max(ours_c, default=None)
    if top is not None and hc.get(top):
        lines.append(f"TPOT at C={top}: HTTP {ours_c[top]['tpot_mean_ms']:.2f} ms, engine driven "
                     f"directly {hc[top]['tpot_mean_ms']:.2f} ms "
                     f"({ours_c[top]['tpot_mean_ms'] / hc[top]['tpot_mean_ms'] - 1:+.1%})")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--setup", action="store_true", help="make .venv-http-bench and stop")
    ap.add_argument("--smoke", action="store_true", help="llama-tiny, tiny workload")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--rates", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=4, help="closed loop: requests per client")
    ap.add_argument("--requests", type=int, default=64, help="Poisson: requests per rate")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--output", type=int, default=128, help="output tokens")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--step", default="auto", choices=("auto", "forward", "fast"))
    ap.add_argument("--port", type=int, default=18400)
    ap.add_argument("--skip", default="", help="comma list of: ours, llama, harness")
    ap.add_argument("--out", default="results")
    args = ap.parse_args()
    if args.setup:
        return setup()
    if args.smoke:
        args.model, args.prompt, args.output, args.rounds, args.requests = ("llama-tiny", 16, 8,
                                                                             1, 2)
        args.concurrency, args.rates = "1,2", "50"
    args.concurrency = [int(x) for x in str(args.concurrency).split(",")]
    args.rates = [float(x) for x in str(args.rates).split(",")]
    skip = set(filter(None, args.skip.split(",")))
    from instruments.store import results

    work = Path(tempfile.mkdtemp(prefix="kvlab-http-bench-"))
    gguf = work / f"{args.model}-f32.gguf"
    subprocess.run([sys.executable, "-m", "instruments", "gguf", "--model", args.model,
                    "--type", "f32", str(gguf)], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    from instruments import lineup

    tok, tok_dir = lineup.tokenizer(lineup.config(args.model), args.model), work / "tokenizer"
    tok_dir.mkdir()
    tok.tokenizer.save(str(tok_dir / "tokenizer.json"))  # guidellm reads it with transformers
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
        "eos_token": tok.tokenizer.id_to_token(tok.eos_id), "model_max_length": 1 << 20}))
    saved, http, llama_run, harness_runs = [], None, None, []
    if "ours" not in skip:
        http = ours(gguf, tok_dir, work, args)
        saved.append(results.save_run(http, args.out))
    if "llama" not in skip:
        llama_run = llama(gguf, tok_dir, work, args)
        saved.append(results.save_run(llama_run, args.out))
    if "harness" not in skip:
        harness_runs = harness(gguf, args)
        saved += [results.save_run(r, args.out) for r in harness_runs]
    for path in saved:
        print(f"saved {path}")
    if http is not None:
        print("\n".join(compare(http, llama_run, harness_runs)))
    errors = sum(r["meta"]["errors"] for r in (http, llama_run) if r)
    print(f"guidellm errors: {errors} (reports and scenarios in {work})")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
