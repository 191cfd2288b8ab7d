"""Model shapes: `GPTConfig` and the four GPT-2 presets.

A config describes shapes only (plus the causal-mask variant a decoder uses when its mode names
none); it holds no weights and no device. `GPTConfig.from_name("gpt2")` returns the 124M shape;
"tiny" (2 layers, width 64, 128 tokens, GPT-2's vocabulary) is the test shape that tests and
smoke runs use.
Torch-free: the dashboard's server process reads shapes without importing torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# How causality is enforced in attention (``engine.attention``). The memory page shows what
# each one costs:
#   "seed"        one fp32 block_size x block_size buffer for every layer (the write-up's)
#   "shared_bool" a single bool buffer shared by all layers
#   "none"        no stored mask: scaled_dot_product_attention applies causality itself
MASK_KINDS = ("none", "shared_bool", "seed")

PRESETS: dict[str, dict[str, int]] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}
# Not a GPT-2: a shape small enough for tests and dry runs, with GPT-2's vocabulary so the
# tokenizer works. Its random weights are drawn with a large std so greedy streams are lively.
TEST_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=128, vocab_size=50257),
}


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    vocab_size: int = 50257
    mask: str = "none"

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if self.mask not in MASK_KINDS:
            raise ValueError(f"unknown mask kind {self.mask!r}; allowed: {', '.join(MASK_KINDS)}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_name(cls, name: str, **overrides: object) -> GPTConfig:
        shapes = {**PRESETS, **TEST_PRESETS}
        if name not in shapes:
            raise ValueError(f"unknown model preset {name!r}; allowed: {', '.join(shapes)}")
        return cls(**{**shapes[name], **overrides})  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
