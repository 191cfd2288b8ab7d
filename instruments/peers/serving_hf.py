"""The serving peer "transformers generate_batch": transformers' own continuous batching (its
paged cache and scheduler) serving the concurrency experiment's requests on the same weights.

``rows(model, params, every, tr)`` adds its rows to table "peers" (``instruments.peers.serving``
gives the fields, makes the requests and gates the tokens). The model is
``engine.lineup.reference(model)``: the family's transformers model (``LlamaForCausalLM`` for
SmolLM2, ``GPT2LMHeadModel``) holding a copy of the loaded weights, on the model's device, its
attention "sdpa" -- transformers' continuous batching takes sdpa, its paged eager or flash, and
switches to flash itself where flash is installed (a GPU); on a CPU it stays sdpa.

How a point runs: ``generate_batch`` is a context manager around a ``ContinuousBatchingManager``
(``continuous_batching_context_manager``: the cache allocated, a generation thread started),
``add_requests``, and a wait on each result. Each point makes that manager itself and adds each
request with its own ``max_new_tokens`` (the workload's output lengths may differ, and
``generate_batch`` takes one for all), ``eos_token_id`` -1 (no end-of-sequence, as ours),
greedy. It is timed from the first request in to the last result out: the manager's set-up is
left out, as our engine's is. Its knobs, set for C clients:
  max_requests_per_batch  C. Its FIFO scheduler serves decoding requests first, so C running
                          requests hold the batch and a waiting one starts when one finishes:
                          a closed loop of C clients with every request queued at once
  num_blocks              twice the pages the first C requests need at their full length (our
                          engine's pool is sized the same way); page_size its default (256)
  max_batch_tokens        the run's step_tokens (our engine's step budget)
  allow_block_sharing     off: the requests share no prefix, and with it on transformers sorts
                          the requests it is given
One short ``generate_batch`` call, untimed, comes first: it warms torch's kernels and is the
check that continuous batching runs here at all (its exception, one line, is the row's why).
The peer's thread runs the model while this one waits on its queue: nothing else runs.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from instruments.peers.serving_rows import arrivals_at, line, peer_points, point_row, unavailable

PEER = "transformers generate_batch"
INSTALL = "pip install transformers==5.23.0"
WAIT_S = 600.0  # no result for this long: the manager is stuck (a point takes seconds)


@contextlib.contextmanager
def _quiet() -> Any:
    """transformers' warnings kept out of the run's output (its log says which paths it took)."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _config(c: int, arrivals: list[Any], params: Any) -> Any:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = ContinuousBatchingConfig().page_size
    pages = sum(-(-(len(a.prompt) + a.new_tokens) // page) for a in arrivals[:c])
    return ContinuousBatchingConfig(max_requests_per_batch=c, num_blocks=2 * pages,
                                    max_batch_tokens=params.step_tokens,
                                    allow_block_sharing=False)


def _generation() -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                            max_new_tokens=1)


def serve(hf: Any, arrivals: list[Any], cb: Any) -> tuple[dict[int, list[int]], float, str]:
    """(each request's tokens, seconds from the first request in to the last result out, the
    attention the manager ran) for ``arrivals`` through one manager of config ``cb``."""
    got: dict[int, list[int]] = {}
    with hf.continuous_batching_context_manager(
            generation_config=_generation(), continuous_batching_config=cb, block=True,
            timeout=5) as manager:
        attention = str(manager.model.config._attn_implementation)
        t0 = time.perf_counter()
        for i, a in enumerate(arrivals):
            manager.add_request(list(a.prompt), request_id=f"r{i}", max_new_tokens=a.new_tokens,
                                eos_token_id=-1)
        waited = time.perf_counter()
        while len(got) < len(arrivals):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' generation thread ended with "
                                       f"{len(arrivals) - len(got)} requests unfinished")
                if time.perf_counter() - waited > WAIT_S:
                    raise TimeoutError(f"no result from transformers in {WAIT_S:.0f} s")
                continue
            waited = time.perf_counter()
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                got[int(result.request_id[1:])] = list(result.generated_tokens)
        duration_s = time.perf_counter() - t0
    return got, duration_s, attention


def rows(model: Any, params: Any, every: list[Any], tr: Any) -> None:
    """The peer's rows; raises where it cannot start (the caller's unavailable row)."""
    import torch
    import transformers

    from instruments import lineup

    version = f"transformers {transformers.__version__}"
    tr.emit(f"peer {PEER}: the transformers model holding the weights")
    hf = lineup.reference(model).to(model.device).eval()
    if not hasattr(hf, "generate_batch"):
        raise RuntimeError(f"{version} has no generate_batch (continuous batching)")
    hf.set_attn_implementation("sdpa")
    threads = torch.get_num_threads()
    with _quiet(), torch.no_grad():
        warm = hf.generate_batch(inputs=[list(every[0].prompt[:4])],
                                 generation_config=_generation(), max_new_tokens=2)
        if len(warm) != 1 or next(iter(warm.values())).error is not None:
            raise RuntimeError("generate_batch returned no tokens for a 4-token prompt")
        for c in peer_points(params):
            if tr.stop():
                return
            arrivals = arrivals_at(every, c, params.rounds)
            tr.emit(f"peer {PEER}: concurrency {c}")
            cb = _config(c, arrivals, params)
            try:
                tokens, duration_s, attention = serve(hf, arrivals, cb)
            except Exception as exc:  # this point failed: the next may not
                unavailable(tr, PEER, line(exc), c, version=version, threads=threads)
                continue
            note = (f"continuous batching, {attention} attention on its paged cache "
                    f"(page_size {cb.page_size}, {cb.num_blocks} blocks), "
                    f"max_requests_per_batch = {c}, max_batch_tokens {cb.max_batch_tokens}, "
                    f"{threads} threads; timed from the first request in to the last result "
                    "out, the manager's set-up left out")
            row = point_row(tr, PEER, c, arrivals, tokens, duration_s, threads=threads,
                            version=version, note=note)
            tr.row("peers", row, f"peer {PEER}: concurrency {c}: {row['output_tok_s']:.1f} "
                   f"output tok/s, tokens {'equal' if row['tokens_equal'] else 'DIFFER'}",
                   points=0)
