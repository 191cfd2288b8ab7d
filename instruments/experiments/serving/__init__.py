"""The serving experiments: continuous batching measured against load.

Kind "serving"; CLI ``python -m instruments serving [--experiment NAME]``.

``run(loaded, ServingParams, progress, should_stop)`` runs one of ``EXPERIMENTS``
(``instruments.experiments.serving.runs``: concurrency, load, budget, schedule) through
``engine.serving.ServingEngine``, stepped on a virtual clock by ``driver.drive``, and saves:
  points       one row per point (a concurrency, a rate and way, a budget, a policy): output
               tokens/s, requests/s, goodput, TTFT / TPOT / ITL mean, p50, p99, the batch,
               preemptions, hit rate, the scheduler's share of the time
  batch_steps  (concurrency) the decode-only step at each batch: median ms and samples beside
               its floor (``metrics.step_floor_ms``: the measured matmul peak and read
               bandwidth) and its parts (weights' read, K/V read, compute)
  requests     every request: prompt ids, generated ids, arrival, first-token, finish and
               token times (s, on the run's clock), cached tokens, preemptions
  steps        every step: its time, the scheduler's, the batch and its tokens, the queues and
               the block pool after it
  peers        (concurrency, ``peers``) other engines' batched decoding on the same weights
               and requests at ``peer_concurrency``, gated on their tokens
               (``instruments.peers.serving``)
  recheck      (budget) the tightest budget's first ``recheck`` requests served again alone
               through the one decode loop: the requests and tokens that differ
Meta: ``serving_experiment`` (which of the four), the measured peaks, the weights' and a
token's K/V bytes, and the experiment's own facts (the batch where K/V reads overtake the
weights', the highest rate each way held the SLO...).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from engine.models.config import ModelConfig
from instruments.experiments.inputs import contexts_within, whole
from instruments.spine import Loaded, ProgressFn, StopFn, Tracker, no_grad, record

EXPERIMENTS = ("concurrency", "load", "budget", "schedule")
WAYS = ("single", "static", "continuous")
CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class ServingParams:
    """Which experiment, its workload (stated distributions, seeded) and the engine's knobs."""

    experiment: str = "concurrency"
    concurrency: list[int] = field(default_factory=lambda: list(CONCURRENCY))
    rounds: int = 2  # closed loop: each client sends this many requests
    prompt_min: int = 32  # prompt tokens, uniform over prompt_min..prompt_max
    prompt_max: int = 96
    output_min: int = 32  # output tokens, uniform over output_min..output_max
    output_max: int = 32
    rates: list[float] = field(default_factory=lambda: [1.0, 2.0, 4.0, 8.0])  # per s
    ways: list[str] = field(default_factory=lambda: list(WAYS))
    requests: int = 100  # open loop, budget and schedule: requests per point
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 250.0
    budgets_tokens: list[int] = field(default_factory=list)  # [] = spread from one to all
    policies: list[str] = field(default_factory=lambda: ["fcfs", "lpm"])
    systems: int = 2  # schedule: the prefix workload's shared parts
    system_tokens: int = 192
    documents: int = 6
    document_tokens: int = 384
    max_seqs: int = 64
    step_tokens: int = 512
    block_tokens: int = 16
    reads: str = "auto"  # "auto" (the device's), "in_place", "gather"
    step: str = "auto"  # how an all-decode step runs: "auto" (the device's), "forward", "fast"
    kv_storages: list[str] = field(default_factory=lambda: ["model", "int8"])  # budget
    peers: bool = True
    peer_concurrency: list[int] = field(default_factory=lambda: [1, 16])  # where peers run
    recheck: int = 32  # budget: the tightest point's requests served again alone, compared
    seed: int = 0

    @classmethod
    def defaults(cls, device: str, cfg: ModelConfig) -> ServingParams:
        """Within the model's context; a test shape's workload shrunk to a dry run."""
        p = cls()
        if cfg.n_layer * cfg.n_embd < 4096:  # a test shape: seconds, not minutes
            p.concurrency, p.rates, p.requests = [1, 2, 4], [50.0, 200.0], 12
            p.prompt_min, p.prompt_max, p.output_min, p.output_max = 4, 24, 4, 8
            p.system_tokens, p.document_tokens, p.max_seqs = 24, 40, 8
        room = cfg.block_size - p.output_max
        p.prompt_max = min(p.prompt_max, room)
        p.prompt_min = min(p.prompt_min, p.prompt_max)
        p.system_tokens = min(p.system_tokens, room // 3)
        p.document_tokens = min(p.document_tokens, room // 3)
        return p

    def check(self, cfg: ModelConfig, device: str) -> None:
        if self.experiment not in EXPERIMENTS:
            raise ValueError(f"unknown serving experiment {self.experiment!r}; allowed: "
                             f"{', '.join(EXPERIMENTS)}")
        contexts_within("concurrency", self.concurrency, 1, 1024)
        for name, value, lo, hi in (
                ("rounds", self.rounds, 1, 100), ("requests", self.requests, 1, 10_000),
                ("shortest prompt", self.prompt_min, 1, None),
                ("longest prompt", self.prompt_max, self.prompt_min, None),
                ("shortest output", self.output_min, 1, None),
                ("longest output", self.output_max, self.output_min, None),
                ("max sequences", self.max_seqs, 1, 1024),
                ("step tokens", self.step_tokens, 1, 65_536),
                ("block tokens", self.block_tokens, 1, 256)):
            whole(name, value, lo, hi)
        if self.prompt_max + self.output_max > cfg.block_size:
            raise ValueError(f"the longest request ({self.prompt_max} + {self.output_max} "
                             f"tokens) is beyond the model's context of {cfg.block_size}; "
                             f"allowed: at most {cfg.block_size} tokens in all")
        if not self.rates or any(not r > 0 for r in self.rates):
            raise ValueError(f"arrival rates must be above 0 requests/s, got {self.rates}")
        bad = [w for w in self.ways if w not in WAYS] or [
            x for x in self.policies if x not in ("fcfs", "lpm")]
        if bad or not self.ways or not self.policies:
            raise ValueError(f"unknown way or policy {bad[0] if bad else '(none)'!r}; "
                             f"allowed ways: {', '.join(WAYS)}; policies: fcfs, lpm")
        if self.reads not in ("auto", "in_place", "gather"):
            raise ValueError(f"unknown way to read the pool {self.reads!r}; allowed: auto, "
                             "in_place, gather")
        if self.step not in ("auto", "forward", "fast"):
            raise ValueError(f"unknown step {self.step!r}; allowed: auto, forward, fast")
        if not self.kv_storages or any(k not in ("model", "int8") for k in self.kv_storages):
            raise ValueError(f"unknown K/V storage in {self.kv_storages}; allowed: model (the "
                             "model's dtype), int8")
        if self.budgets_tokens:
            contexts_within("KV budget (tokens)", self.budgets_tokens, self.block_tokens,
                            10**9)
        if not self.slo_ttft_ms > 0 or not self.slo_tpot_ms > 0:
            raise ValueError("the SLO's TTFT and TPOT must be above 0 ms")


Params = ServingParams


def _list(text: str | None, cast: type, what: str) -> list[Any] | None:
    if text is None:
        return None
    try:
        return [cast(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be numbers separated by commas, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experiment", default="concurrency", choices=EXPERIMENTS,
                   help="concurrency (closed loop, the default), load (Poisson rates, three "
                   "ways), budget (KV budgets), schedule (FCFS against longest prefix match)")
    p.add_argument("--concurrency", default=None, help="clients, e.g. 1,4,16,64")
    p.add_argument("--rates", default=None, help="arrivals per second, e.g. 1,2,4")
    p.add_argument("--requests", type=int, default=None, help="requests per point")
    p.add_argument("--budgets-tokens", default=None, help="KV budgets in tokens")
    p.add_argument("--prompt", default=None, help="prompt tokens MIN-MAX (uniform)")
    p.add_argument("--output", default=None, help="output tokens MIN-MAX (uniform)")
    p.add_argument("--reads", default="auto", choices=("auto", "in_place", "gather"))
    p.add_argument("--step", default="auto", choices=("auto", "forward", "fast"),
                   help="how an all-decode step runs (auto: the device's default)")
    p.add_argument("--no-peers", action="store_true", help="leave the peers out")


def _range(text: str, what: str) -> tuple[int, int]:
    try:
        lo, _, hi = str(text).partition("-")
        return int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"{what} must be MIN-MAX tokens, got {text!r}") from None


def from_args(args: argparse.Namespace, cfg: ModelConfig) -> ServingParams:
    p = ServingParams.defaults(args.device, cfg)
    p.experiment, p.reads, p.peers, p.seed = (args.experiment, args.reads, not args.no_peers,
                                              args.seed)
    p.step = args.step
    p.concurrency = _list(args.concurrency, int, "--concurrency") or p.concurrency
    p.rates = _list(args.rates, float, "--rates") or p.rates
    p.budgets_tokens = _list(args.budgets_tokens, int, "--budgets-tokens") or []
    p.requests = args.requests or p.requests
    if args.prompt:
        p.prompt_min, p.prompt_max = _range(args.prompt, "--prompt")
    if args.output:
        p.output_min, p.output_max = _range(args.output, "--output")
    return p


def summary(run: dict[str, Any]) -> list[str]:
    def ms(v: float | None) -> str:
        return "—" if v is None else f"{v:,.0f}"

    lines = [f"{r['label']:>18s}: {r['output_tok_s']:8.1f} output tok/s, TTFT p50 "
             f"{ms(r['ttft_p50_ms'])} / p99 {ms(r['ttft_p99_ms'])} ms, TPOT p50 "
             f"{ms(r['tpot_p50_ms'])} ms, batch up to {r['batch_max']}, "
             f"{r['preemptions']} preemptions, hit rate {r['hit_rate']:.0%}"
             for r in run["tables"].get("points", [])]
    lines += [f"{'batch ' + str(r['batch']):>18s}: step {r['step_ms']:.1f} ms, floor "
              f"{r['floor_ms']:.1f} ms ({r['over_floor']:.2f}x)"
              for r in run["tables"].get("batch_steps", []) if r["label"] == "all"]
    lines += [f"{'peer ' + r['peer']:>18s}: " + (
              f"{r['output_tok_s']:.1f} output tok/s at concurrency {r['concurrency']}, "
              f"tokens {'equal' if r['tokens_equal'] else 'DIFFER'}" if r.get("ok")
              else f"unavailable: {r['why']}") for r in run["tables"].get("peers", [])]
    lines += [f"{'again alone':>18s}: {r['requests']} requests of {r['label']} "
              f"({r['preemptions']} preemptions): {r['tokens_differing']} of {r['tokens']} "
              "tokens differ" for r in run["tables"].get("recheck", [])]
    if run["meta"].get("kv_overtakes_batch"):
        lines.append("K/V reads overtake the weights' at batch "
                     f"{run['meta']['kv_overtakes_batch']}")
    return lines


@no_grad
def run(loaded: Loaded, params: ServingParams, progress: ProgressFn | None = None,
        should_stop: StopFn | None = None) -> dict[str, Any]:
    from instruments.costmodel import costs
    from instruments.experiments.prefix.parts import load_avg
    from instruments.experiments.serving import runs
    from instruments.measure import device

    model = loaded.checked(params)
    cfg, dtype = model.config, str(model.dtype).removeprefix("torch.")
    total = {"concurrency": len(params.concurrency),
             "load": len(params.rates) * len(params.ways),
             "budget": 5 * len(params.kv_storages),
             "schedule": len(params.policies)}[params.experiment]
    tr = Tracker(progress, should_stop, total, unit="points", total_work=total * 200)
    load_start = load_avg()
    tr.emit("measuring the device's matmul peak and read bandwidth")
    pk = device.peaks(str(model.device), dtype, quick=cfg.n_layer * cfg.n_embd < 4096)
    peaks = {"matmul_tflops": pk.matmul_tflops, "read_gbps": pk.read_gbps}
    runs.warm(model, params)
    extra = getattr(runs, params.experiment)(model, params, peaks, tr)
    partial = bool(extra.pop("partial", False))
    if params.experiment == "concurrency" and params.peers and not partial:
        from instruments.peers import serving as peers

        peers.run_peers(loaded, params, tr, runs.concurrency_requests(model, params))
    if partial:
        tr.note("stopped: what was measured is kept")
    return record(loaded, "serving", params, tr.tables, partial=partial, notes=tr.notes,
                  measured_peaks=pk.to_dict(), weights_bytes=costs.linear_weight_bytes(
                      cfg, dtype), kv_bytes_per_token=costs.kv_bytes_per_token(cfg, dtype),
                  load_avg_start=load_start, load_avg_end=load_avg(),
                  serving_experiment=params.experiment, **extra)
