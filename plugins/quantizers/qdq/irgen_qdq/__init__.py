"""The ``qdq`` quantization-fusion scheme: ONNX QuantizeLinear/DequantizeLinear.

``onnxruntime.quantization.quantize_static(..., quant_format=QuantFormat.QDQ)``
writes DequantizeLinear -> float op -> QuantizeLinear spans; ONNX Runtime's CPU
provider fuses them into integer kernels (QLinearConv, QGemm, QLinearAdd,
QLinearMul, QLinearSoftmax, lookup tables...). For int8 activations compare
with ORT created with ``session.qdqisint8allowed=1`` (see docs/quantization.md).

This scheme claims quantized ONNX graphs (and torch's reference-quantized
ones) and realizes each span in ORT's integer arithmetic with irgen's QDQ
engine, :func:`irgen.plugin.realize_qdq` (whose module docstring lists each
kernel's arithmetic; ``pow2`` builds on the same engine), and registers
verify's recompute of the kinds the engine records.

Modules: :mod:`irgen_qdq.detect` (which graphs the scheme claims),
:mod:`irgen_qdq.realize` (the realization, through the engine's realizers keyed
by op kind), :mod:`irgen_qdq.recompute` (verify's recompute of each kind,
registered on import); this module registers the scheme.
"""

from __future__ import annotations

from irgen.plugin import Quantizer, hookimpl

from .detect import DIALECTS, detect
from .realize import SCHEME, realize
from .recompute import RECOMPUTE

__version__ = "0.1.0"
__all__ = ["DIALECTS", "RECOMPUTE", "SCHEME", "detect", "realize"]


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
