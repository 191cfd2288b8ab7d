"""On a CUDA GPU (skipped elsewhere; the device check runs them first): every mode offered on
cuda passes the gate there, in fp32 and bf16, stepping through new lengths; the experiments and
peers that first light found mixing the CPU with cuda run there whole. CPU tests guard each
bug's mechanism (tests/test_device_discipline.py, test_state.py); these see the class on the
device itself.
"""

from __future__ import annotations

import pytest
import torch

from engine import GPT, GPTConfig, decode, make_decoder, modes
from instruments import lineup
from instruments.checks.gate import Gate
from instruments.experiments import EXPERIMENTS
from instruments.experiments.planner import PlannerParams

from .conftest import loaded_model

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
SHAPE = dict(n_layer=2, n_head=4, n_embd=64, block_size=256, vocab_size=512)  # the CPU tests


def tiny(dtype: torch.dtype = torch.float32) -> GPT:
    return GPT.random(GPTConfig(**SHAPE), seed=1, std=0.2).to("cuda", dtype)


@pytest.mark.parametrize("name", modes.defaults("cuda", "gpt2"))
def test_every_mode_offered_on_cuda_passes_the_gate_there(name: str) -> None:
    check = Gate(tiny(), batch=2).check(name)
    assert check.passed, check.detail


@pytest.mark.parametrize("name", ["prealloc_fused", "fast", "cuda_graph"])
def test_bf16_steps_through_new_lengths_give_mode_1s_tokens(name: str) -> None:
    model = tiny(torch.bfloat16)
    prompt = torch.randint(0, 512, (1, 8), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(0))
    want = decode(make_decoder(model, "uncached"), prompt, 24).tokens
    got = decode(make_decoder(model, name), prompt, 24).tokens
    assert (got == want).float().mean() > 0.9  # bf16 rounding may flip a near tie


def test_planner_runs_whole_on_cuda() -> None:
    params = PlannerParams("long-tailed", 4, 32, 16, contexts=[32, 128], max_alloc_mib=64,
                           error_tokens=8)
    run = EXPERIMENTS["planner"].run(loaded_model(tiny()), params)
    storages = {r["storage"]: r for r in run["tables"]["storages"]}
    assert storages["float32"]["rel_error"] < 1e-5 and "int8" in storages


@pytest.mark.parametrize("name", ["hf_dynamic", "hf_static"])
def test_transformers_peers_pass_the_gate_on_cuda(name: str) -> None:
    if not lineup.peer_choices("cuda", "gpt2")[0].count(name):
        pytest.skip(f"{name} is not offered on cuda here")
    check = Gate(tiny()).check(name)
    assert check.passed, check.detail
