"""Peer ov_float32: OpenVINO running the same GPT-2 export as the ONNX Runtime peer.

OpenVINO reads the ONNX file ``instruments.peers.ort`` exports (transformers' GPT-2 with past
keys/values in and presents out) and compiles it for the CPU with ``INFERENCE_NUM_THREADS`` = the
run's threads and fp32 inference precision (its default on CPUs with bf16 units would be bf16).
Everything else -- the past fed back each step, cropping to seek, the logits -- is the ONNX
Runtime adapter's (``ORTDecoder``), with OpenVINO's infer request in place of the session.
"""

from __future__ import annotations

from typing import Any

from engine.models.base import CausalLM
from instruments.lineup import PeerUnavailable
from instruments.peers.built import Built, folder_bytes, temp_folder
from instruments.peers.ort import ORTDecoder, _export


def _build(model: CausalLM, dtype: str, threads: int) -> Built:
    import openvino as ov

    folder = temp_folder("ov")
    try:
        _export(model, dtype, folder / "model.onnx")
        core = ov.Core()
        compiled = core.compile_model(core.read_model(str(folder / "model.onnx")), "CPU", {
            "INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32"})
    except Exception as exc:
        raise PeerUnavailable(f"OpenVINO export/compile failed: {type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
                              ) from exc
    return Built(compiled.create_infer_request(), 0.0, folder_bytes(folder), ov.__version__,
                 folder)


class OVDecoder(ORTDecoder):
    cache_kind = "ov_past"
    engine = "ov"
    build = staticmethod(_build)

    def _infer(self, feed: Any) -> list[Any]:
        out = self.session.infer([feed, *self.past])  # inputs in order: ids, then each past
        return [out[i] for i in range(len(out))]
