"""What a GPU needs of the engine, checked on a CPU. Every tensor follows the model's device, by
construction: a check of the class of bug that first light on a GPU found twice (a tensor made
on the CPU beside the model's on cuda: the planner's logits, transformers' token ids), run on a
CPU where the two devices are one.

In ``engine/`` and ``instruments/`` each call of a torch factory (``torch.zeros``, ``arange``,
``tensor``, ``from_numpy``, ...) says where its tensor lives: a ``device=`` argument, a
``.to(...)`` on the result, or a ``# host:`` comment on its lines or the line above saying why
it belongs on the CPU (a token history searched in Python, a cache-flush buffer, logits a peer
hands back on the CPU by contract). The decode loop keeps and feeds tokens on the prompt's
device whatever device a decoder's logits come back on. Every attention of the engine calls one
``sdpa``, which keeps a GPU off cuDNN's per-length plans.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from engine.loop import decode

ROOT = Path(__file__).resolve().parents[1]
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "tensor", "randint", "randn", "rand",
             "as_tensor", "eye", "linspace", "randperm", "from_numpy", "frombuffer"}


def unplaced_factories(path: Path) -> list[str]:
    """``file:line`` of each torch factory call in ``path`` that does not say its device."""
    src = path.read_text(encoding="utf-8")
    lines = src.splitlines()
    tree = ast.parse(src)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and node.func.attr in FACTORIES):
            continue
        if any(k.arg == "device" for k in node.keywords):
            continue
        up, chained_to = parents.get(node), False  # torch.x(...).reshape(...).to(dev)
        while isinstance(up, (ast.Attribute, ast.Call)) and not chained_to:
            chained_to = isinstance(up, ast.Attribute) and up.attr == "to"
            up = parents.get(up)
        if chained_to:
            continue
        span = lines[node.lineno - 1 : (node.end_lineno or node.lineno)]
        if any("# host:" in line for line in [lines[node.lineno - 2], *span]):
            continue
        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {span[0].strip()}")
    return found


def test_every_tensor_factory_says_its_device() -> None:
    bad = [hit for folder in ("engine", "instruments")
           for path in sorted((ROOT / folder).rglob("*.py")) for hit in unplaced_factories(path)]
    assert not bad, ("torch factories without device= (or .to(...), or a '# host: why' "
                     "comment):\n" + "\n".join(bad))


def test_the_check_finds_an_unplaced_factory(tmp_path: Path) -> None:
    planted = ROOT / "engine" / "_planted_for_test.py"
    planted.write_text("import torch\n\nx = torch.arange(4)\ny = torch.zeros(2, device='cpu')\n"
                       "z = torch.ones(2).to('cpu')\nw = torch.empty(3)  # host: a test\n")
    try:
        assert [h.split(":")[1] for h in unplaced_factories(planted)] == ["3"]
    finally:
        planted.unlink()


class _HostLogits:
    """A peer-like decoder: its logits come back on the CPU; it records the ids it is fed."""

    cache_kind = "peer"

    def __init__(self) -> None:
        self.fed: list[torch.Tensor] = []

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(ids[:, -1] % 7, 7).float().cpu()

    def step(self, token: torch.Tensor) -> torch.Tensor:
        self.fed.append(token)
        return self.prefill(token)


def test_the_loop_feeds_back_its_own_tokens_not_the_host_pick() -> None:
    """First light: transformers on cuda was fed the token picked from CPU logits ("index is
    on cpu"). The loop feeds the token from its own buffer, on the prompt's device."""
    dec = _HostLogits()
    prompt = torch.tensor([[3, 5]], device="cpu")
    out = decode(dec, prompt, 4)  # type: ignore[arg-type]
    buf = out.tokens.untyped_storage().data_ptr()
    assert dec.fed and all(t.untyped_storage().data_ptr() == buf for t in dec.fed)
    assert all(t.device == prompt.device for t in dec.fed)


def test_every_attention_of_the_engine_goes_through_one_sdpa_kept_off_cudnn() -> None:
    """First light: mode 8 in bf16 took 74-76 ms a step on an H200 (8 ms with SDPA's math
    backend): cuDNN's attention plans anew for every sequence length, and a decode step is a
    new length each time. One ``engine.models.attention.sdpa`` keeps every call of ours off it."""
    from torch.nn.attention import SDPBackend

    from engine.models.attention import GPU_BACKENDS

    direct = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Attribute) and node.attr == "scaled_dot_product_attention"
                    and path.name != "attention.py"):
                direct.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not direct, f"call engine.models.attention.sdpa instead: {direct}"
    assert SDPBackend.CUDNN_ATTENTION not in GPU_BACKENDS
    assert SDPBackend.FLASH_ATTENTION in GPU_BACKENDS and SDPBackend.MATH in GPU_BACKENDS
