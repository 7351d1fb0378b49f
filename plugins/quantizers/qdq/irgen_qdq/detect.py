"""Detection: the ``qdq`` scheme claims the quantized graphs of the dialects it realizes."""

from __future__ import annotations

#: the quantization dialects this scheme realizes: ONNX QDQ (ORT's kernels) and torch's
#: reference-quantized graphs (torch's rounding), as frontends declare them
DIALECTS = ("onnx-qdq", "torch-qdq")


def _is_quantized(qg) -> bool:
    """Whether ``qg`` quantizes or dequantizes anything."""
    return any(b.op in ("relax.quantize", "relax.dequantize") for b in qg.bindings)


def detect(qg) -> bool:
    """``qg`` is a quantized graph of one of :data:`DIALECTS`."""
    return getattr(qg, "dialect", None) in DIALECTS and _is_quantized(qg)
