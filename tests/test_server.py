"""The HTTP server (``python -m instruments server``) as a client meets it: started on a free
loopback port with llama-tiny (its engine core in a process of its own, an API key set, at most
4 requests running so that more wait), then driven over HTTP.

  endpoints     /health, /v1/models, /metrics (vLLM's names), a route or method that is not
                there
  exactness     greedy completions through the endpoint, streamed and whole, ids and chat, 8 at
                once (so half of them queue): each request's tokens are the engine's serving
                that request alone, and a stream's text is the tokenizer's text of them
  bad input     each answered with OpenAI's error body and its 4xx, the server still serving
  disconnect    a client that leaves mid-stream: its request aborted and its blocks back at
                once (/metrics: no block held, none leaked), well before its max_tokens
  API key       /v1 refuses a missing or wrong key (401), /health and /metrics stay open, and
                the CLI refuses a non-loopback address without a key before loading anything
  load (slow)   64 concurrent streams, then 1,000 short requests: 0 errors, 0 leaked blocks
Each was seen to fail on its planted bug (a stream that drops its last token, a disconnect
that leaks blocks or is never cancelled, a key check that passes without a key, a context
check left out).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

requests = pytest.importorskip("requests")
for _m in ("starlette", "uvicorn", "prometheus_client"):
    pytest.importorskip(_m, reason=f"the server needs {_m}: pip install -r "
                        "requirements-serving.txt")

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key-3f9c"
MODEL = "llama-tiny"
CONTEXT = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(model: str, *args: str) -> Iterator[str]:
    """``python -m instruments server --model MODEL ARGS`` on a free loopback port, its engine
    core started: its URL; stopped after."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "instruments", "server", "--model", model,
                             "--port", str(port), "--threads", "1", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while True:
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("the server did not start:\n" + (proc.stdout.read() if proc.stdout
                                                              else ""))
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serving(MODEL, "--api-key", KEY, "--max-seqs", "4") as url:
        yield url


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def post(url: str, path: str, body: dict, **kw) -> requests.Response:
    return requests.post(url + path, json=body, headers=auth(), timeout=120, **kw)


def metrics(url: str) -> dict[str, float]:
    """The /metrics samples by name and labels, e.g. 'kvlab:kv_blocks{state="running"}'."""
    out = {}
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r',?model_name="[^"]*"', "", name).replace("{,", "{").replace(
                "{}", "")
            out[name] = float(value)
    return out


def stream_events(r: requests.Response) -> list[dict | str]:
    events: list[dict | str] = []
    for line in r.iter_lines():
        if line.startswith(b"data: "):
            data = line[6:].decode()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---------------------------------------------------------------------------- endpoints
def test_endpoints(server: str) -> None:
    assert requests.get(server + "/health", timeout=30).json() == {"status": "ok"}
    models = requests.get(server + "/v1/models", headers=auth(), timeout=30).json()
    assert models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == CONTEXT
    m = metrics(server)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", 'kvlab:kv_blocks{state="free"}'):
        assert name in m, name
    r = requests.get(server + "/v1/nothing", headers=auth(), timeout=30)
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    r = requests.get(server + "/v1/completions", headers=auth(), timeout=30)
    assert r.status_code == 405 and r.json()["error"]["message"]


# ---------------------------------------------------------------------------- exactness
@pytest.fixture(scope="module")
def alone():
    """Each request served alone by a ServingEngine of the same model in this process."""
    import torch

    from engine.serving.engine import ServingEngine
    from instruments.spine import ModelSpec, load

    model = load(ModelSpec(MODEL, "random", "cpu", "float32", 0)).model

    def serve(prompt: list[int], max_tokens: int, eos_id: int | None = None) -> list[int]:
        bpt = model.config.kv_bytes_per_token(4)
        eng = ServingEngine(model, 4 * CONTEXT * bpt, block_tokens=16)
        with torch.no_grad():
            seq = eng.submit(prompt, max_tokens, eos_id)
            eng.drain()
        return seq.generated

    return serve


def test_greedy_through_http_is_the_engine_alone_under_load(server: str, alone) -> None:
    from engine import families
    from instruments import lineup

    tok = families.tokenizer(lineup.config(MODEL))
    prompts = [[(i * 7919 + j * 104729) % 49152 for j in range(3 + 3 * i)] for i in range(6)]
    chat = [{"role": "user", "content": "Name three colours."}]
    jobs = [("/v1/completions", {"prompt": p, "max_tokens": 8 + 3 * i, "ignore_eos": True},
             i % 2 == 0) for i, p in enumerate(prompts)]
    jobs += [("/v1/chat/completions", {"messages": chat, "max_tokens": 12}, True),
             ("/v1/chat/completions", {"messages": chat, "max_tokens": 12}, False)]

    def one(job: tuple) -> tuple[list[int], str, str]:
        path, body, streamed = job
        body = {**body, "model": MODEL, "temperature": 0, "return_token_ids": True,
                "stream": streamed}
        r = post(server, path, body, stream=streamed)
        assert r.status_code == 200, r.text
        if not streamed:
            choice = r.json()["choices"][0]
            text = choice.get("text", (choice.get("message") or {}).get("content"))
            return choice["token_ids"], text, choice["finish_reason"]
        events = stream_events(r)
        assert events[-1] == "[DONE]"
        chunks = [e for e in events[:-1] if isinstance(e, dict) and e["choices"]]
        ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        text = "".join(c["choices"][0].get("text", c["choices"][0].get("delta", {}).get(
            "content", "")) for c in chunks)
        return ids, text, chunks[-1]["choices"][0]["finish_reason"]

    with ThreadPoolExecutor(len(jobs)) as pool:  # 8 at once, 4 running: the rest queue
        got = list(pool.map(one, jobs))
    for (path, body, streamed), (ids, text, finish) in zip(jobs, got, strict=True):
        if "prompt" in body:
            want = alone(body["prompt"], body["max_tokens"])
        else:
            want = alone(tok.encode(tok.chat_messages(body["messages"])), body["max_tokens"],
                         tok.eos_id)
        assert ids == want, (path, streamed)
        ended = want[-1] == tok.eos_id and len(want) < body["max_tokens"]
        assert finish == ("stop" if ended else "length")
        assert text == tok.decode(want[:-1] if ended else want), (path, streamed)


def test_stop_strings_and_seeded_sampling(server: str) -> None:
    base = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 20, "ignore_eos": True,
            "temperature": 0}
    whole = post(server, "/v1/completions", base).json()["choices"][0]["text"]
    stop = whole[len(whole) // 2:][:3]
    got = post(server, "/v1/completions", {**base, "stop": [stop]}).json()["choices"][0]
    assert got["finish_reason"] == "stop" and got["text"] == whole[:whole.find(stop)]
    seeded = {**base, "temperature": 0.9, "top_p": 0.8, "seed": 11, "return_token_ids": True}
    a, b = (post(server, "/v1/completions", seeded).json()["choices"][0]["token_ids"]
            for _ in range(2))
    assert a == b and len(a) == 20


# ---------------------------------------------------------------------------- bad input
BAD = [  # (what, how to send it, status, error code or param it names)
    ("malformed JSON", {"data": b'{"prompt": "x",'}, 400, "invalid_json"),
    ("wrong content type", {"data": b'{"prompt": "x"}', "ctype": "text/plain"}, 415,
     "unsupported_media_type"),
    ("unknown model", {"json": {"model": "gpt-4", "prompt": "x"}}, 404, "model_not_found"),
    ("max_tokens past the context", {"json": {"prompt": [1, 2, 3], "max_tokens": 254}}, 400,
     "context_length_exceeded"),
    ("a prompt longer than the model", {"json": {"prompt": [1] * 300}}, 400,
     "context_length_exceeded"),
    ("negative max_tokens", {"json": {"prompt": "x", "max_tokens": -5}}, 400, "max_tokens"),
    ("absurd max_tokens", {"json": {"prompt": "x", "max_tokens": 10**12}}, 400, "max_tokens"),
    ("max_tokens not a number", {"json": {"prompt": "x", "max_tokens": "ten"}}, 400,
     "max_tokens"),
    ("negative temperature", {"json": {"prompt": "x", "temperature": -1}}, 400, "temperature"),
    ("absurd top_p", {"json": {"prompt": "x", "top_p": 7}}, 400, "top_p"),
    ("n above 1", {"json": {"prompt": "x", "n": 3}}, 400, "unsupported_parameter"),
    ("a token outside the vocabulary", {"json": {"prompt": [1, 99999]}}, 400, "prompt"),
    ("an empty prompt", {"json": {"prompt": ""}}, 400, "prompt"),
    ("no messages", {"json": {"messages": []}, "path": "/v1/chat/completions"}, 400,
     "messages"),
    ("not an object", {"json": [1, 2]}, 400, None),
]


@pytest.mark.parametrize("what,send,status,names", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error(server: str, what: str, send: dict, status: int,
                                        names: str | None) -> None:
    path = send.get("path", "/v1/completions")
    headers = {**auth(), "Content-Type": send.get("ctype", "application/json")}
    data = send["data"] if "data" in send else json.dumps(send["json"]).encode()
    r = requests.post(server + path, data=data, headers=headers, timeout=60)
    assert r.status_code == status, (what, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if names is not None:
        assert names in (err["code"], err["param"]), (what, err)
    # never a crash or a stuck server: the next request is served
    ok = post(server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200


# ---------------------------------------------------------------------------- disconnect
def test_a_client_that_leaves_mid_stream_frees_its_blocks(server: str) -> None:
    before = metrics(server)
    host, port = server.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"prompt": [3, 1, 4, 1], "max_tokens": 250, "ignore_eos": True,
                       "temperature": 0, "stream": True})
    conn.request("POST", "/v1/completions", body, {**auth(),
                                                   "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = 0
    while seen < 3:  # three tokens in: the request is running and holds its blocks
        seen += resp.fp.readline().startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    abort = 'vllm:request_success_total{finished_reason="abort"}'
    deadline = time.monotonic() + 30
    while True:
        m = metrics(server)
        if (m["vllm:num_requests_running"] == 0 and m['kvlab:kv_blocks{state="running"}'] == 0
                and m["kvlab:kv_blocks_leaked"] == 0 and m[abort] > before[abort]) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert m[abort] == before[abort] + 1
    assert m['kvlab:kv_blocks{state="running"}'] == 0
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    assert m["kvlab:kv_blocks_leaked"] == 0
    made = m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert made < 250, "the request ran on after its client left"


# ---------------------------------------------------------------------------- API key
def test_the_api_key_is_required_on_v1(server: str) -> None:
    body = {"prompt": [1, 2], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = requests.post(server + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, headers
        assert r.json()["error"]["type"] == "authentication_error"
    assert requests.get(server + "/v1/models", timeout=30).status_code == 401
    assert requests.get(server + "/health", timeout=30).status_code == 200
    assert requests.get(server + "/metrics", timeout=30).status_code == 200
    assert post(server, "/v1/completions", body).status_code == 200


def test_a_public_address_needs_a_key() -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVLAB_API_KEY"}
    out = subprocess.run([sys.executable, "-m", "instruments", "server", "--model", MODEL,
                          "--host", "0.0.0.0", "--port", str(free_port())], cwd=ROOT,
                         env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "needs --api-key" in out.stderr
    assert "Traceback" not in out.stderr


# ---------------------------------------------------------------------------- load
@pytest.mark.slow
def test_bounded_load_ends_with_no_error_and_no_leaked_block(server: str) -> None:
    def streamed(i: int) -> int:
        r = post(server, "/v1/completions", {"prompt": [i % 500 + 1, 7, 8], "max_tokens": 16,
                                             "ignore_eos": True, "temperature": 0,
                                             "stream": True}, stream=True)
        events = stream_events(r) if r.status_code == 200 else []
        return 0 if events and events[-1] == "[DONE]" and "error" not in events[-2] else 1

    def short(i: int) -> int:
        r = post(server, "/v1/completions", {"prompt": [i % 900 + 1, 2], "max_tokens": 3,
                                             "temperature": 0})
        return 0 if r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3 else 1

    with ThreadPoolExecutor(64) as pool:
        errors = sum(pool.map(streamed, range(64)))
    with ThreadPoolExecutor(16) as pool:
        errors += sum(pool.map(short, range(1000)))
    assert errors == 0
    m = metrics(server)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m['kvlab:kv_blocks{state="running"}'] == 0 and m["kvlab:kv_blocks_leaked"] == 0


# ---------------------------------------------------------------------------- report
def test_a_guidellm_report_becomes_a_run_of_ours() -> None:
    from instruments.server.report import to_run
    from instruments.store import results

    report = json.loads((ROOT / "tests" / "fixtures" / "guidellm_report.json").read_text())
    m = report["benchmarks"][0]["metrics"]
    run = to_run(report, server="kvlab", meta={"device_name": "a CPU", "model": MODEL})
    assert run["kind"] == "serving_http" and not results.validate_run(run)
    (row,) = run["tables"]["points"]
    assert row["label"] == "C=2" and row["concurrency"] == 2 and row["requests"] == 2
    tokens = m["output_token_count"]["successful"]["total_sum"]
    assert row["output_tok_s"] == pytest.approx(tokens / report["benchmarks"][0]["duration"])
    assert row["ttft_p99_ms"] == m["time_to_first_token_ms"]["successful"]["percentiles"]["p99"]
    assert row["itl_p50_ms"] == m["inter_token_latency_ms"]["successful"]["percentiles"]["p50"]
    assert row["e2e_mean_ms"] == pytest.approx(m["request_latency"]["successful"]["mean"] * 1e3)
    assert run["meta"]["errors"] == 0 and run["meta"]["device_name"] == "a CPU"
    with pytest.raises(ValueError, match="not a guidellm report"):
        to_run({"benchmarks": []}, server="kvlab", meta={})


# ---------------------------------------------------------------------------- sampling
def test_sampling_keeps_the_argmax_where_it_must_and_checks_its_fields() -> None:
    import torch

    from engine.serving.sampling import Sampler, Sampling

    logits = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 3
    top = int(logits.argmax())
    for s in (Sampling(0.0), Sampling(1.0, top_k=1), Sampling(2.0, top_p=1e-6, seed=5)):
        assert all(Sampler(s).pick(logits) == top for _ in range(20)), s
    a, b = (Sampler(Sampling(1.5, top_p=0.9, top_k=20, seed=7)) for _ in range(2))
    draws = [a.pick(logits) for _ in range(50)]
    assert draws == [b.pick(logits) for _ in range(50)] and len(set(draws)) > 1
    assert set(draws) <= set(torch.topk(logits, 20).indices.tolist())
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(seed=-1)):
        with pytest.raises(ValueError):
            Sampling(**bad)
