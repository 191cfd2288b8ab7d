"""/metrics: the server's counts and latencies in Prometheus' text format, under vLLM's names
where vLLM has one (``vllm/v1/metrics/loggers.py``), so a dashboard or scraper made for vLLM
reads ours unchanged. Every series carries ``model_name``.

  vllm:num_requests_running / vllm:num_requests_waiting   gauges, from the core's last state
  vllm:kv_cache_usage_perc        gauge 0..1: blocks held by running requests / the pool's
                                  blocks (a block the prefix tree alone holds is evictable,
                                  so free in vLLM's sense)
  vllm:prefix_cache_queries / vllm:prefix_cache_hits   counters in tokens: every finished
                                  request's prompt, and the part the prefix tree gave it
  vllm:num_preemptions            counter (the scheduler's, recompute)
  vllm:prompt_tokens / vllm:generation_tokens           counters in tokens
  vllm:request_success{finished_reason="stop|length|abort"}   counter
  vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
  vllm:e2e_request_latency_seconds                      histograms (vLLM's buckets)
Ours, with no vLLM name: kvlab:kv_blocks{state="running|shared|tree|free"} (the pool's blocks;
running counts every block a running request holds, shared those of them held more than
once), kvlab:kv_blocks_leaked (references no running request or tree node accounts for, read
while the core is idle: 0 unless blocks were lost), kvlab:engine_steps_total.

A request's TTFT runs from its arrival at the front end to the step that picked its first
token (stamped by the core); inter-token latencies are the gaps between its steps; end-to-end
runs to the step that picked its last. Prometheus counters gain ``_total`` in the text, as in
vLLM's own output.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    def __init__(self, model: str) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        lb = ["model_name"]
        self.model = model
        self.running = Gauge("vllm:num_requests_running", "Requests running in the engine",
                             lb, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be admitted",
                             lb, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)", lb,
                              registry=r)
        self.queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the "
                               "prefix cache", lb, registry=r)
        self.hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix "
                            "cache", lb, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions (by recompute)", lb,
                                   registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished "
                                     "requests", lb, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", lb,
                                         registry=r)
        self.success = Counter("vllm:request_success", "Requests ended, by reason",
                               [*lb, "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (s)",
                              lb, buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Gap between a request's "
                             "tokens (s)", lb, buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token (s)",
                             lb, buckets=E2E_BUCKETS_S, registry=r)
        self.blocks = Gauge("kvlab:kv_blocks", "The block pool's blocks by holder",
                            [*lb, "state"], registry=r)
        self.leaked = Gauge("kvlab:kv_blocks_leaked", "Block references nobody accounts for "
                            "(read while idle)", lb, registry=r)
        self.steps = Counter("kvlab:engine_steps", "Engine steps", lb, registry=r)
        self._preempted = self._steps = 0
        for metric in (self.running, self.waiting, self.kv_usage, self.queries, self.hits,
                       self.preemptions, self.prompt_tokens, self.generation_tokens, self.ttft,
                       self.itl, self.e2e, self.leaked, self.steps):
            metric.labels(model)  # every series shown from the start, at 0 (as vLLM's)
        for reason in ("stop", "length", "abort"):
            self.success.labels(model, reason)

    def state(self, s: dict[str, Any]) -> None:
        m = self.model
        self.running.labels(m).set(s["running"])
        self.waiting.labels(m).set(s["waiting"])
        self.kv_usage.labels(m).set(s["blocks_running"] / max(s["blocks"], 1))
        for key, name in (("blocks_running", "running"), ("blocks_shared", "shared"),
                          ("blocks_tree", "tree"), ("free", "free")):
            self.blocks.labels(m, name).set(s[key])
        if "leaked" in s:
            self.leaked.labels(m).set(s["leaked"])
        if s["preemptions"] > self._preempted:
            self.preemptions.labels(m).inc(s["preemptions"] - self._preempted)
            self._preempted = s["preemptions"]
        if s["steps"] > self._steps:
            self.steps.labels(m).inc(s["steps"] - self._steps)
            self._steps = s["steps"]

    def finished(self, reason: str, prompt: int, cached: int, times: list[float],
                 arrival: float) -> None:
        """One request ended (``reason`` stop, length or abort) with its token times."""
        m = self.model
        self.success.labels(m, reason).inc()
        self.prompt_tokens.labels(m).inc(prompt)
        if reason != "abort":
            self.queries.labels(m).inc(prompt)
            self.hits.labels(m).inc(cached)
        if times:
            self.e2e.labels(m).observe(times[-1] - arrival)

    def token(self, times: list[float], arrival: float) -> None:
        """A request's newest token, at ``times[-1]``."""
        m = self.model
        self.generation_tokens.labels(m).inc()
        if len(times) == 1:
            self.ttft.labels(m).observe(times[0] - arrival)
        else:
            self.itl.labels(m).observe(times[-1] - times[-2])

    def text(self) -> bytes:
        return generate_latest(self.registry)
