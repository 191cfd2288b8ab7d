"""Model shapes: `GPTConfig` (GPT-2) and `LlamaConfig` (the Llama family).

A config describes shapes only (plus the causal-mask variant a decoder uses when its mode names
none); it holds no weights and no device. Which presets exist (gpt2 to gpt2-xl, smollm2-135m,
the test shapes), of which family and with which shapes, is ``engine.families``' table:
``families.config("gpt2")``.

Both configs answer the same questions, so caches, costs and the planner need not know the
family: ``n_layer``, ``n_head`` (query heads), ``n_kv_head`` (heads the KV cache holds: GPT-2's
every head, GQA's fewer), ``head_dim``, ``n_embd``, ``block_size``, ``vocab_size``, ``mask``,
``family``, ``kv_bytes_per_token(element_bytes)``, ``matrices()`` (every Linear of one block as
(role, out, in, bias), then the output projection), ``cache_rows(tokens)`` (the rows per layer
a cache holds after ``tokens`` tokens: all of them, or a sliding window's), ``head`` (the
output projection's
(out, in)), ``other_params()`` (the parameters that are no matrix: embeddings, norms, biases)
and ``activations_per_token()`` (the values one token's pass through a block writes).
Torch-free: the dashboard's server process reads shapes without importing torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# How causality is enforced in attention (``engine.models.attention``). The memory page shows what
# each one costs:
#   "seed"        one fp32 block_size x block_size buffer for every layer (the write-up's)
#   "shared_bool" a single bool buffer shared by all layers
#   "none"        no stored mask: scaled_dot_product_attention applies causality itself
MASK_KINDS = ("none", "shared_bool", "seed")

class Shapes:
    """What both configs compute the same way from their fields."""

    n_layer: int
    n_head: int
    n_embd: int
    n_kv_head: int  # (GPT-2: a property, every head)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """K and V of one token across every layer: 2 x n_layer x n_kv_head x head_dim x el."""
        return 2 * self.n_layer * self.n_kv_head * self.head_dim * element_bytes

    def cache_rows(self, tokens: int) -> int:
        """Rows per layer a KV cache holds after ``tokens`` tokens: every one (a family with a
        sliding window holds its window's at most)."""
        return tokens


@dataclass(frozen=True)
class GPTConfig(Shapes):
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

    family = "gpt2"

    @property
    def n_kv_head(self) -> int:
        return self.n_head  # every head caches its own K and V

    def matrices(self) -> list[tuple[str, int, int, bool]]:
        """One block's Linears, (role -- its module's path in the block --, out, in, has
        bias): the fused q|k|v product, the attention's output projection, the MLP's 4x up and
        down projections."""
        d = self.n_embd
        return [("attn.c_attn", 3 * d, d, True), ("attn.c_proj", d, d, True),
                ("mlp.c_fc", 4 * d, d, True), ("mlp.c_proj", d, 4 * d, True)]

    @property
    def head(self) -> tuple[int, int]:
        return (self.vocab_size, self.n_embd)  # tied to the token embedding

    def other_params(self) -> int:
        """Parameters that are no matrix product: the token embedding (tied: the head's, so
        counted here once), the position table, two LayerNorms per block and the final one,
        the Linears' biases."""
        d = self.n_embd
        biases = sum(out for _, out, _, bias in self.matrices() if bias)
        return self.vocab_size * d + self.block_size * d + self.n_layer * (4 * d + biases) + 2 * d

    def activations_per_token(self) -> int:
        """Values one token's pass through a block writes: q, k, v (3d), the attention output
        (d) and the MLP's hidden layer (4d)."""
        return 8 * self.n_embd

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_hf(cls, fields: dict[str, Any], mask: str = "none") -> GPTConfig:
        """The config a ``transformers`` GPT-2 ``config.json`` describes (its defaults where a
        field is absent); ValueError for what our GPT-2 lacks."""
        act = fields.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"activation {act!r}; allowed: gelu_new (GELU, tanh form)")
        eps = float(fields.get("layer_norm_epsilon", 1e-5))
        if eps != 1e-5:
            raise ValueError(f"layer_norm_epsilon {eps}; allowed: 1e-05")
        return cls(n_layer=int(fields.get("n_layer", 12)), n_head=int(fields.get("n_head", 12)),
                   n_embd=int(fields.get("n_embd", 768)),
                   block_size=int(fields.get("n_positions", 1024)),
                   vocab_size=int(fields.get("vocab_size", 50257)), mask=mask)


@dataclass(frozen=True)
class LlamaConfig(Shapes):
    """The Llama family's shapes: RMSNorm, rotary positions (RoPE), a SwiGLU MLP of width
    ``n_hidden``, grouped-query attention (``n_head`` query heads share ``n_kv_head`` K/V
    heads, ``n_head / n_kv_head`` each), the output projection tied to the embedding when
    ``tied``. SmolLM2-135M: 30 layers, width 576, 9 / 3 heads, MLP 1,536, 49,152 tokens, 8,192
    positions, RoPE base 100,000 (read from its GGUF file's metadata)."""

    n_layer: int = 30
    n_head: int = 9
    n_kv_head: int = 3
    n_embd: int = 576
    n_hidden: int = 1536
    block_size: int = 8192
    vocab_size: int = 49152
    rope_theta: float = 100000.0
    norm_eps: float = 1e-5
    tied: bool = True
    mask: str = "none"
    # Llama 3's RoPE scaling (factor, low_freq_factor, high_freq_factor, original context), or
    # None: every pair at its base frequency (``engine.models.rope.llama3_frequencies``)
    rope_scaling: tuple[float, float, float, float] | None = None

    family = "llama"

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "n_hidden", "block_size",
                     "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head "
                             f"({self.n_kv_head}): each K/V head serves a whole group")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError("the head size must be even: RoPE rotates pairs of channels")
        if self.rope_scaling is not None:  # a run's JSON gives a list back: kept as a tuple
            scaling = tuple(float(v) for v in self.rope_scaling)
            if len(scaling) != 4 or min(scaling) <= 0 or scaling[2] <= scaling[1]:
                raise ValueError(f"rope_scaling {self.rope_scaling!r}; allowed: (factor, "
                                 "low_freq_factor, high_freq_factor, original context), all "
                                 "positive, high_freq_factor > low_freq_factor")
            object.__setattr__(self, "rope_scaling", scaling)
        if self.mask not in MASK_KINDS:
            raise ValueError(f"unknown mask kind {self.mask!r}; allowed: {', '.join(MASK_KINDS)}")

    @property
    def groups(self) -> int:
        """Query heads per K/V head: query head h reads K/V head h // groups."""
        return self.n_head // self.n_kv_head

    def matrices(self) -> list[tuple[str, int, int, bool]]:
        """One block's Linears, (role -- its module's path in the block --, out, in, has bias):
        q, k and v apart (k and v only
        n_kv_head heads wide: GQA's saving), the attention's output projection, SwiGLU's gate,
        up and down projections. No biases."""
        d, kv, h = self.n_embd, self.n_kv_head * self.head_dim, self.n_hidden
        return [("self_attn.q_proj", d, d, False), ("self_attn.k_proj", kv, d, False),
                ("self_attn.v_proj", kv, d, False), ("self_attn.o_proj", d, d, False),
                ("mlp.gate_proj", h, d, False), ("mlp.up_proj", h, d, False),
                ("mlp.down_proj", d, h, False)]

    @property
    def head(self) -> tuple[int, int]:
        return (self.vocab_size, self.n_embd)  # tied (SmolLM2) or not: the same shape

    def other_params(self) -> int:
        """Parameters that are no matrix product: the token embedding (counted here once when
        tied to the head, twice otherwise), two RMSNorm weights per block and the final one.
        RoPE has no parameters."""
        d = self.n_embd
        embed = self.vocab_size * d * (1 if self.tied else 2)
        return embed + self.n_layer * 2 * d + d

    def activations_per_token(self) -> int:
        """Values one token's pass through a block writes: q (d), k and v (n_kv_head heads
        each), the attention output (d), and SwiGLU's gate, up and their product (3 x n_hidden)."""
        return 2 * self.n_embd + 2 * self.n_kv_head * self.head_dim + 3 * self.n_hidden

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    # transformers' defaults for a field config.json leaves out (LlamaConfig's)
    HF_DEFAULTS = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                   "tie_word_embeddings": False}

    @classmethod
    def hf_fields(cls, fields: dict[str, Any], mask: str) -> dict[str, Any]:
        """This config's fields from a ``transformers`` ``config.json`` (``HF_DEFAULTS`` where
        one is absent; RoPE's base and Llama 3's scaling under ``rope_parameters``
        (transformers 5) or at the top / ``rope_scaling`` (4)); ValueError for what the Llama
        blocks lack (another RoPE scaling or activation, biases, a head size other than width /
        heads)."""
        get = {**cls.HF_DEFAULTS, **fields}.get
        rope = get("rope_parameters") or get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise ValueError(f"RoPE scaling {kind!r}; allowed: none (rope_type 'default') or "
                             "Llama 3's ('llama3')")
        scaling = None if kind == "default" else tuple(float(rope[k]) for k in (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"))
        if get("hidden_act", "silu") != "silu":
            raise ValueError(f"activation {get('hidden_act')!r}; allowed: silu (SwiGLU)")
        if get("mlp_bias", False):
            raise ValueError("biases in the MLP; allowed: none")
        n_embd, n_head = int(get("hidden_size")), int(get("num_attention_heads"))
        if get("head_dim") not in (None, n_embd // n_head):
            raise ValueError(f"head_dim {get('head_dim')}; allowed: hidden_size / "
                             f"num_attention_heads = {n_embd // n_head}")
        return dict(n_layer=int(get("num_hidden_layers")), n_head=n_head,
                    n_kv_head=int(get("num_key_value_heads") or n_head), n_embd=n_embd,
                    n_hidden=int(get("intermediate_size")),
                    block_size=int(get("max_position_embeddings")),
                    vocab_size=int(get("vocab_size")),
                    rope_theta=float(rope.get("rope_theta", get("rope_theta"))),
                    norm_eps=float(get("rms_norm_eps")), tied=bool(get("tie_word_embeddings")),
                    mask=mask, rope_scaling=scaling)

    @classmethod
    def from_hf(cls, fields: dict[str, Any], mask: str = "none") -> LlamaConfig:
        """The config a ``transformers`` ``config.json`` describes (``hf_fields``)."""
        if fields.get("attention_bias", False):
            raise ValueError("biases on q/k/v; allowed: none in a Llama (Qwen2 has them)")
        return cls(**cls.hf_fields(fields, mask))


ModelConfig = GPTConfig | LlamaConfig  # what every model of engine.families is described by
