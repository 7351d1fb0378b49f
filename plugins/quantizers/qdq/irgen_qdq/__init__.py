"""The ``qdq`` quantization-fusion scheme: ONNX QuantizeLinear/DequantizeLinear.

``onnxruntime.quantization.quantize_static(..., quant_format=QuantFormat.QDQ)``
writes DequantizeLinear -> float op -> QuantizeLinear spans; ONNX Runtime's CPU
provider fuses them into integer kernels (QLinearConv, QGemm, QLinearAdd,
QLinearMul, QLinearSoftmax, lookup tables...). For int8 activations compare
with ORT created with ``session.qdqisint8allowed=1`` (see the README).

This scheme claims quantized ONNX graphs (and torch's reference-quantized
ones) and realizes each span in ORT's integer arithmetic with irgen's QDQ
engine, :func:`irgen.plugin.realize_qdq` (whose module docstring lists each
kernel's arithmetic; ``pow2`` builds on the same engine), and registers
verify's recompute of the kinds the engine records.
"""

from __future__ import annotations

from irgen.plugin import (QDQ_RECOMPUTE, Quantizer, hookimpl, realize_qdq, recompute_qdq, recompute_requantized,
                          register_recompute)

__version__ = "0.1.0"

SCHEME = "qdq"


#: the quantization dialects this scheme realizes: ONNX QDQ (ORT's kernels) and torch's
#: reference-quantized graphs (torch's rounding), as frontends declare them
DIALECTS = ("onnx-qdq", "torch-qdq")


def _is_quantized(qg) -> bool:
    return any(b.op in ("relax.quantize", "relax.dequantize") for b in qg.bindings)


def detect(qg) -> bool:
    return getattr(qg, "dialect", None) in DIALECTS and _is_quantized(qg)


def realize(qg) -> None:
    """Every DQ -> op -> Q span of ``qg`` in ONNX Runtime's integer arithmetic."""
    realize_qdq(qg, scheme=SCHEME)


# verify's recompute of the kinds the engine records beyond irgen's built-in qdq kinds
# (schemes built on qdq, such as pow2, find them under this scheme's name)
register_recompute(SCHEME, "*", recompute_qdq)  # ONNX Runtime's CPU kernels
register_recompute(SCHEME, "integer", recompute_requantized)  # plain int8 ops (max pool, reshape...)
for _kind, _fn in QDQ_RECOMPUTE.items():
    register_recompute(SCHEME, _kind, _fn)


@hookimpl
def irgen_register_quantizers(register):
    register(
        Quantizer(
            name=SCHEME,
            detect=detect,
            realize=realize,
            priority=10,
            description="ONNX QuantizeLinear/DequantizeLinear models, bit-exact with ONNX Runtime's CPU kernels",
        )
    )
