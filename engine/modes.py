"""The ladder of decode modes: each described once, in one ``ModeSpec``, and nowhere else.

``MODES[name]`` is a ``ModeSpec``: rung, label, colour, what it does, the decoder that runs it,
how it stores and reads the KV cache and the weights, how it attends, whether the step
predictor can model it (or why not), its roles (the exact default of a device, the baseline
beside the peers, ...), the model families it runs and why not the others. Everything else --
the sidebar, the CLI's ``--modes``, the gate, the cost model, the planner, the pages' default
picks -- asks these fields (through ``instruments.lineup`` outside ``engine/``), never a list of
names kept by hand. ``register(spec)`` adds a mode (a test registers a toy one).

``ordered(names)`` sorts names by rung; ``available(name, device, family)`` says whether a mode
can run on a device type ("cpu" | "cuda") and a model family, and why not. This module is
torch-free (the dashboard's server reads it to draw choices and colours); the decoders are built
in the measuring process by ``engine.decoders.make_decoder``, which imports each factory named
here on first use (modes 6-9 pull in ``torch._dynamo``, slow to import).

Every decoder has the same two calls (``engine.decoders.Decoder``):
  decoder.prefill(idx)  -> logits (B, vocab) for the token after ``idx`` (B, T)
  decoder.step(token)   -> logits (B, vocab) after appending ``token`` (B, 1)
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field

# How a cached step attends (``ModeSpec.attention``); with the cache kind it names the
# attention part the step predictor calibrates ("concat_seed", "prealloc_step", ...):
#   "seed"       explicit scores, masked by the write-up's fp32 triangle buffers
#   "fused"      scaled_dot_product_attention over the cache, no stored mask
#   "step"       one new token over a filled preallocated cache, no mask (the C++ kernel on a CPU)
#   "static"     the whole capacity under a mask computed from the position (fixed shapes)
#   "read_only"  a compiled step that only reads the cache; the caller writes the new rows
ATTENTIONS = ("seed", "fused", "step", "static", "read_only")
# Roles a mode can hold (``ModeSpec.roles``); pages and experiments pick their defaults by role:
ROLES = {
    "peer_baseline": "our exact cached modes timed beside the peers (Peers page, bench_peers)",
    "peer_rung": "our lossy rungs timed beside the peers' own quantized engines",
    "attribution": "profiled by default on the Floor lab (one per way of stepping)",
    "planner_step": "timed on the KV planner page: the cache layouts it plans for",
    "reference_cached": "the plain exact cached mode others are compared with (precision)",
    "reference_uncached": "the plain uncached forward a prompt's prefill is costed as",
    "seed_pair": "the write-up's own pair: no cache against its concatenating cache",
    "bench": "llama-bench's pp / tg throughput by default: the write-up's cache, mode 5, mode 6",
}
NOT_COMPILED = "compiled or graph-captured: its step fuses the operators the predictor sums"


@dataclass(frozen=True)
class ModeSpec:
    name: str
    rung: int  # position on the ladder: the order everywhere, and the number in the label
    label: str  # shown in the UI and in saved rows
    color: str  # one colour per mode in every chart
    description: str
    factory: str  # "module:callable" building the decoder: factory(model, **options, **kw)
    options: dict[str, object] = field(default_factory=dict)
    cache: str | None = "prealloc"  # the KV cache kind (engine.cache); None: no cache
    attention: str = "fused"  # ATTENTIONS: how a step attends
    weight_layout: str = "out_in"  # "out_in": nn.Linear's own; "packed": mode 8's chosen copies
    # How the Linear weights are stored ("" = the model dtype; "int8" = int8 with one fp32
    # scale per output channel; "bfloat16"; "q8_0" / "q4_1" = GGUF's blocks of 32): the bytes
    # a step streams, so the mode's own floor (instruments.costmodel.costs counts them).
    weight_storage: str = ""
    kv_storage: str = ""  # "" = the model dtype; "int8" = int8 with a scale per token and head
    logits_all: bool = False  # projects every position onto the vocabulary (mode 1)
    appends: bool = True  # takes several tokens at once (decoder.append: speculative decoding)
    predicted: str = ""  # "" when the step predictor models it; else why it does not
    needs: str = ""  # "" | "cuda" | "compiler": what the device must offer
    slow_setup: bool = False  # first use compiles for minutes on a CPU: opt-in, never a default
    # Not exact by design (a lossy cache or weights): the share of mode 1's largest |logit| its
    # logits may stray by, used by the gate when larger than the dtype's own tolerance. 0: exact.
    tolerance: float = 0.0
    default_on: tuple[str, ...] = ()  # device kinds where it is "the KV cache" (fastest exact)
    roles: frozenset[str] = frozenset()  # ROLES it holds
    families: tuple[str, ...] | None = None  # model families it runs (None: every one)
    why_not: str = ""  # why it does not run the other families
    # How it runs on a GPU: "torch" (its torch code, as on a CPU) or "triton" (our Triton
    # kernels, engine.kernels.gpu: not offered on a GPU without triton installed)
    gpu_path: str = "torch"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"{self.name}: unknown attention {self.attention!r}; allowed: "
                             f"{', '.join(ATTENTIONS)}")
        unknown = set(self.roles) - set(ROLES)
        if unknown:
            raise ValueError(f"{self.name}: unknown role {sorted(unknown)[0]!r}; allowed: "
                             f"{', '.join(ROLES)}")
        if self.families is not None and not self.why_not:
            raise ValueError(f"{self.name}: runs only {', '.join(self.families)}; say why not "
                             "the other families (why_not)")
        if self.gpu_path not in ("torch", "triton"):
            raise ValueError(f"{self.name}: unknown gpu_path {self.gpu_path!r}; allowed: torch, "
                             "triton")

    @property
    def cached(self) -> bool:
        return self.cache is not None

    @property
    def attention_part(self) -> str:
        """The attention the step predictor calibrates for it: cache kind + how it attends
        ("prealloc_step", ...), or the uncached forward's "seed"."""
        return f"{self.cache}_{self.attention}" if self.cached else self.attention

    @property
    def steps(self) -> bool:
        """Does it step with the family's one-token step (``engine.models.steps``) rather than
        the model's ``forward``? A family without one is not offered it."""
        return self.attention in ("step", "static", "read_only")

    def runs(self, family: str) -> tuple[bool, str]:
        """(does it run models of ``family``, why not)."""
        if self.families is not None and family not in self.families:
            return False, self.why_not
        from .families import FAMILIES  # the family table: its step, its cache kinds

        fam = FAMILIES.get(family)
        if fam is not None and self.steps and fam.step is None:
            return False, fam.step_why
        if fam is not None and self.cache is not None and fam.caches is not None \
                and self.cache not in fam.caches:
            return False, fam.caches_why
        return True, ""


_EAGER = "engine.decoders.eager:Decoder"
_WEIGHT_ONLY = "engine.decoders.weight_only:WeightOnlyDecoder"
_BLOCKS = "engine.decoders.blocks:block_decoder"  # on a GPU: the Triton step over the blocks
_BLOCKS_WHY = ("the step predictor has no calibration for GGUF block products yet (its weight "
               "pieces time int8 and bf16 rows only)")
_TRITON = "engine.decoders.triton_step:TritonDecoder"
MODES: dict[str, ModeSpec] = {}


def register(spec: ModeSpec) -> ModeSpec:
    """Add ``spec`` to the ladder (replacing a mode of the same name); returns it."""
    MODES[spec.name] = spec
    return spec


for _spec in (
    ModeSpec("uncached", 1, "1 · no cache, logits at every position", "#d62728",
             "The naive loop: the whole sequence re-run every step, output projection on every "
             "position.", _EAGER, dict(mask="seed", logits="all"), cache=None,
             attention="seed", logits_all=True, roles=frozenset({"seed_pair"})),
    ModeSpec("uncached_last", 2, "2 · no cache, last-position logits", "#ff7f0e",
             "Still re-runs the sequence, but projects only the last position onto the "
             "vocabulary.", _EAGER, dict(mask="seed", logits="last"), cache=None,
             attention="seed", roles=frozenset({"reference_uncached"})),
    ModeSpec("concat", 3, "3 · concatenating KV cache (the write-up's)", "#1f77b4",
             "torch.cat grows the cache every step; explicit attention with the fp32 mask "
             "buffers.", _EAGER, dict(mask="seed"), cache="concat", attention="seed",
             roles=frozenset({"seed_pair", "peer_baseline", "attribution", "bench"})),
    ModeSpec("prealloc", 4, "4 · preallocated cache, written in place", "#2ca02c",
             "Cache buffers sized once, new keys/values written at their position; same "
             "attention.", _EAGER, dict(mask="seed"), attention="seed"),
    ModeSpec("prealloc_fused", 5, "5 · preallocated cache + fused attention, no stored mask",
             "#17becf", "scaled_dot_product_attention applies causality itself: no mask "
             "buffers at all.", _EAGER, dict(mask="none"), default_on=("cuda",),
             roles=frozenset({"peer_baseline", "attribution", "planner_step",
                              "reference_cached", "bench"})),
    ModeSpec("cuda_graph", 6, "6 · CUDA graph of the whole decode step", "#9467bd",
             "The family's one-token step (GPT-2's or the Llama family's) is captured once "
             "over the preallocated cache and replayed with one launch; positions live in a "
             "tensor, and attention reads only the filled rows (our Triton decode kernel, split "
             "over the cache, grouped-query heads reading their K/V once; without Triton, SDPA "
             "over the whole capacity under a mask).",
             "engine.decoders.captured:CudaGraphDecoder", attention="static",
             appends=False, predicted=NOT_COMPILED, needs="cuda",
             roles=frozenset({"attribution", "bench"})),
    ModeSpec("compiled", 7, "7 · torch.compile of the decode step", "#8c564b",
             "torch.compile (reduce-overhead on a GPU, inductor on a CPU) of the family's "
             "one-token step, reading the cache only; the caller writes the new key/value row. "
             "Compile time is reported apart.", "engine.decoders.compiled:CompiledDecoder",
             dict(variant="compiled"), attention="read_only", appends=False,
             predicted=NOT_COMPILED, needs="compiler", slow_setup=True,
             roles=frozenset({"attribution"})),
    ModeSpec("fast", 8, "8 · fast CPU path (transposed weights, split matmuls)", "#e377c2",
             "Per role of matrix (GPT-2: q|k|v, o, MLP up, down, head; Llama: q, k, v, o, gate, "
             "up, down, head), the fastest of four ways measured when the weights load ([in, "
             "out] copies split across the cores, F.linear, our C++ kernel over the weights or "
             "an interleaved copy); preallocated cache, one-call attention (grouped-query for "
             "the Llama family), and on a CPU the whole step in one C++ call: streams the "
             "weights faster. Exact (fp32 rounding).",
             "engine.decoders.fast:FastDecoder", attention="step", weight_layout="packed",
             appends=False, default_on=("cpu",),
             roles=frozenset({"peer_baseline", "attribution"})),
    ModeSpec("fast_compiled", 9, "9 · step compiled with freezing + max-autotune", "#bcbd22",
             "torch.compile with freezing and max_autotune of mode 7's read-only step over the "
             "model's own [out, in] weights (not mode 8's packed copies): inductor packs them "
             "itself and generates matrix-vector kernels. Minutes to compile on a CPU; holds "
             "packed weight copies.", "engine.decoders.compiled:CompiledDecoder",
             dict(variant="fast_compiled"), attention="read_only", appends=False,
             predicted=NOT_COMPILED, needs="compiler", slow_setup=True),
    ModeSpec("paged", 10, "10 · paged KV cache (blocks of 16 tokens, a table per sequence)",
             "#393b79", "Keys/values in 16-token blocks of a shared pool, handed out as "
             "positions need them (a block table per sequence, as vLLM does). On a CPU every "
             "step gathers the blocks back in order for fused attention -- the copy a "
             "paged-attention kernel avoids, and what the step shows; on a GPU with Triton our "
             "kernels read them in place through the table, steps and prefills alike (vLLM's "
             "way). Exact.", _EAGER, dict(mask="none"), cache="paged",
             roles=frozenset({"planner_step"})),
    ModeSpec("int8_kv", 11, "11 · int8 KV cache (a scale per token and head)", "#637939",
             "Keys/values stored as int8 with one absmax scale per token and head (a quarter of "
             "fp32's bytes). On a CPU dequantized every step for fused attention; on a GPU with "
             "Triton a step's attention reads the int8 rows and scales as stored (a prefill "
             "still dequantizes). Not exact: its logits error is measured and must stay within "
             "5% of the largest logit.", _EAGER,
             dict(mask="none"), cache="kv_int8", kv_storage="int8", tolerance=0.05,
             roles=frozenset({"planner_step"})),
    ModeSpec("int8_weights", 12, "12 · int8 weights (a scale per output channel)", "#8c6d31",
             "Every Linear weight, the tied embedding/output projection included, stored "
             "as int8 with one fp32 scale per output channel: a quarter of fp32's bytes to "
             "stream. Activations and the KV cache stay in the model dtype (mode 5's cache and "
             "attention). Not exact: its logits must stay within 10% of the largest logit "
             "(measured: 2.5% gpt2 random, 3.6-4.1% the GPT-2 test shapes, 5.0% SmolLM2, "
             "5.0-6.4% llama-tiny's large random weights; a broken step strays by 58-123% on "
             "the test shapes).",
             _WEIGHT_ONLY, dict(storage="int8"), attention="step",
             weight_storage="int8", tolerance=0.10, roles=frozenset({"peer_rung"})),
    ModeSpec("bf16_weights", 13, "13 · bf16 weights (bf16 matmuls)", "#843c39",
             "Every Linear weight (and the tied embedding/output projection) stored in bfloat16, "
             "half of fp32's bytes; each matmul runs in bf16 and returns the model dtype. "
             "Activations and the KV cache stay in the model dtype (mode 5's cache and "
             "attention). Not exact: its logits must stay within 4% of the largest logit "
             "(measured: 0.6% gpt2 random, 0.9% SmolLM2, 1.2-1.6% the GPT-2 test shapes, "
             "1.8-2.7% llama-tiny).", _WEIGHT_ONLY, dict(storage="bfloat16"), attention="step",
             weight_storage="bfloat16", tolerance=0.04, roles=frozenset({"peer_rung"})),
    ModeSpec("q8_0_weights", 14, "14 · GGUF Q8_0 weights (blocks of 32, read as stored)",
             "#5254a3",
             "Every Linear weight, the tied embedding/head included, kept in GGUF's Q8_0 "
             "blocks tensor by tensor (32 int8 weights + an fp16 scale: 34 bytes per 32, 8.5 "
             "bits a weight) and multiplied by kvlab.q8_0_linear over the blocks as stored, "
             "never expanded to fp32; on a CPU the whole step is one C++ call. llama.cpp's way "
             "(x rounded to int8 per 32, integer dot products): measured faster than widening "
             "the blocks to fp32. SmolLM2 from its package: the file's Q8_0 head as stored, "
             "the other 210 tensors re-quantized to Q8_0 from the file's dequantized Q4_1 "
             "weights; GPT-2 and random weights: blocks from our fp32 weights by "
             "gguf.quants.quantize. Activations and the KV cache stay fp32. Not exact: its "
             "logits must stay within 15% of the largest logit (measured: 2.3% gpt2 random, "
             "4.8% SmolLM2, 2.5-5.4% the GPT-2 test shapes, 4.5-9.8% llama-tiny's large random "
             "weights -- llama.cpp's own Q8_0 strays alike; a broken step strays by 58-123% on "
             "the test shapes).",
             _BLOCKS, dict(storage="q8_0"), attention="step", weight_storage="q8_0",
             tolerance=0.15, predicted=_BLOCKS_WHY, roles=frozenset({"peer_rung"}),
             gpu_path="triton"),
    ModeSpec("q4_1_weights", 15, "15 · GGUF Q4_1 weights (llama.cpp's file, read as stored)",
             "#b5cf6b",
             "Every block matrix kept in GGUF's Q4_1 blocks tensor by tensor (32 4-bit weights "
             "+ an fp16 scale and an fp16 minimum: 20 bytes per 32, 5 bits a weight), the tied "
             "embedding/head in Q8_0 (as llama.cpp's Q4_1 files store it), multiplied by "
             "kvlab.q4_1_linear / q8_0_linear over the blocks as stored, never expanded to "
             "fp32; on a CPU the whole step is one C++ call. llama.cpp's way (x rounded to int8 "
             "per 32, integer dot products): measured faster than widening the blocks to fp32. "
             "SmolLM2 from its package: the shipped file's 210 Q4_1 tensors and its Q8_0 "
             "embedding/head byte for byte (what llama.cpp multiplies by); GPT-2 and random "
             "weights: blocks from our fp32 weights by gguf.quants.quantize. Activations and "
             "the KV cache stay fp32. Not exact: its logits must stay within 40% of the largest "
             "logit: on SmolLM2's own blocks only the 8-bit activations stray (3.7%), but Q4_1 "
             "of random Gaussian weights strays by 22% (gpt2) to 24-35% (the GPT-2 test "
             "shapes), and by 57-61% on llama-tiny's large random weights, which the gate "
             "refuses (as it refuses llama.cpp's own Q4_1 there); a broken step strays by "
             "58-123% on the test shapes.", _BLOCKS, dict(storage="q4_1"), attention="step",
             weight_storage="q4_1", tolerance=0.40, predicted=_BLOCKS_WHY,
             roles=frozenset({"peer_rung"}), gpu_path="triton"),
    ModeSpec("triton", 16, "16 · Triton step: five kernels a block, one CUDA graph", "#e7969c",
             "Our Triton kernels, the whole step captured in one CUDA graph: per block q|k|v "
             "with the norm, bias, RoPE and the cache write folded in; attention over the "
             "filled rows, split over the cache; the output projection merging the splits, with "
             "the residual; the MLP's up (GELU, or SwiGLU's gate and up) with its norm; its down "
             "with the residual. Weights as the model stores them (fp32, bf16); rungs 14-15 run "
             "the same step over their GGUF blocks on a GPU. Exact (fp32 rounding).",
             _TRITON, attention="step", predicted=NOT_COMPILED, needs="cuda",
             gpu_path="triton", roles=frozenset({"attribution", "bench"})),
):
    register(_spec)

ALIASES = {"cached": "concat"}  # the write-up's published rows call mode 3 "cached"
OTHER_COLOR = "#7f7f7f"


def uncached() -> tuple[str, ...]:
    """The modes without a KV cache (they re-run the whole sequence every step)."""
    return tuple(name for name, spec in MODES.items() if not spec.cached)


def with_role(role: str) -> list[str]:
    """The modes holding ``role`` (``ROLES``), in ladder order."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; allowed: {', '.join(ROLES)}")
    return ordered(n for n, s in MODES.items() if role in s.roles)


def seed_pair() -> tuple[str, str]:
    """What the write-up compared as "no cache" against "KV cache": (uncached, cached)."""
    pair = with_role("seed_pair")
    return (next(m for m in pair if not MODES[m].cached), next(m for m in pair
                                                                if MODES[m].cached))


def spec(name: str) -> ModeSpec:
    name = ALIASES.get(name, name)
    if name not in MODES:
        raise ValueError(f"unknown mode {name!r}; allowed: {', '.join(MODES)}")
    return MODES[name]


def color(name: str) -> str:
    name = ALIASES.get(name, name)
    return MODES[name].color if name in MODES else OTHER_COLOR


def label(name: str) -> str:
    return MODES[name].label if name in MODES else name


def ordered(names: Iterable[str]) -> list[str]:
    """Names in ladder order (known ones by rung), unknown ones after in their order, unique."""
    seen = list(dict.fromkeys(str(m) for m in names))

    def rank(m: str) -> tuple[int, int]:
        known = MODES.get(ALIASES.get(m, m))
        return (known.rung if known else len(MODES) + 1, seen.index(m))

    return sorted(seen, key=rank)


def available(name: str, device: str, family: str | None = None) -> tuple[bool, str]:
    """(can it run on ``device`` ("cpu", "cuda", "cuda:1") and, when given, a model of
    ``family``; why not). Torch-free."""
    if name not in MODES:
        return False, f"unknown mode {name!r}; allowed: {', '.join(MODES)}"
    spec = MODES[name]
    if family is not None:
        ok, why = spec.runs(family)
        if not ok:
            return False, f"not for {family} models: {why}"
    kind = str(device).split(":")[0]
    if spec.needs == "cuda" and kind != "cuda":
        return False, "needs a CUDA GPU"
    if kind == "cuda" and spec.gpu_path == "triton" and importlib.util.find_spec("triton") is None:
        return False, ("its GPU step is our Triton kernels, and triton is not installed "
                       "(pip install -r requirements-gpu.txt)")
    if spec.needs == "compiler":
        if kind == "cuda" and importlib.util.find_spec("triton") is None:
            return False, "torch.compile on a GPU needs triton, which is not installed"
        if kind == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
            return False, "torch.compile on a CPU needs a C++ compiler (g++ or clang++)"
    if kind not in ("cpu", "cuda"):
        return False, f"device {device!r} is not supported; use cpu or cuda"
    return True, ""


def choices(device: str, family: str | None = None) -> tuple[list[str], dict[str, str]]:
    """Modes that can run on ``device`` (and ``family``), ladder order, and why each other one
    cannot."""
    usable, missing = [], {}
    for name in ordered(MODES):
        ok, why = available(name, device, family)
        if ok:
            usable.append(name)
        else:
            missing[name] = why
    return usable, missing


def fastest_exact(device: str, family: str | None = None) -> str:
    """The default cached mode where one mode is offered as "the KV cache": the mode whose
    ``default_on`` names the device kind (mode 8 on a CPU -- our fastest exact step there:
    docs/peers.md -- mode 5 elsewhere), or the first exact cached mode that runs here."""
    kind = str(device).split(":")[0]
    usable = choices(device, family)[0]
    found = [n for n in usable if kind in MODES[n].default_on]
    return found[0] if found else next(n for n in usable
                                       if MODES[n].cached and not MODES[n].tolerance)


def defaults(device: str, family: str | None = None) -> list[str]:
    """Modes available on ``device`` (and ``family``) that are cheap to set up (no minutes of
    compile)."""
    return [n for n in choices(device, family)[0] if not MODES[n].slow_setup]
