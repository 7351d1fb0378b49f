"""The ``pow2`` quantization-fusion scheme: power-of-two scales, requantization by shift alone.

Many accelerators keep every scale a power of two, so requantizing an int32
accumulator is one rounding right shift (then the output's zero point added:
symmetric models have 0, AMD Quark's XINT8 and Vitis AI's uint8 activations
128). This scheme takes ONNX QDQ models whose scales are all powers of two,
whatever their zero points (chosen automatically then, or forced with
``--quantizer pow2``), realizes them as
the ``qdq`` scheme does (it builds on the ``irgen-qdq`` plugin, a declared dependency,
through its public API: :func:`irgen_qdq.realize`, :data:`irgen_qdq.RECOMPUTE`), and
requantizes convolutions and dense layers with shifts only:
``y = round_half_even(acc / 2**shift[c])``, which is exactly what ONNX Runtime computes
for such scales (:mod:`irgen_pow2.shift`). The quant record carries the shift amounts.
"""

from __future__ import annotations

import numpy as np

import irgen_qdq
from irgen.plugin import IrgenError, Quantizer, hookimpl

from .shift import SCHEME, recompute_shifted, shift_requant

__version__ = "0.1.0"

#: verify's recompute: the qdq realization's kinds as ONNX Runtime computes them (so pow2 outputs
#: verify without the qdq scheme registered), the shifted convolutions and dense layers
RECOMPUTE = {**irgen_qdq.RECOMPUTE, **{kind: recompute_shifted for kind in ("conv2d", "depthwise_conv2d", "conv3d",
                                                                          "depthwise_conv3d", "dense")}}


def _qdq_spans(qg):
    return [b for b in qg.bindings if b.op in ("relax.quantize", "relax.dequantize")]


def _not_pow2(qg) -> list[str]:
    """Why the model is not a power-of-two model (tensor and reason), empty when it is."""
    from irgen.plugin import Constant

    bad = []
    for b in _qdq_spans(qg):
        scale, zp = b.value.args[1], b.value.args[2]
        if not isinstance(scale, Constant) or not isinstance(zp, Constant):
            bad.append(f"{b.name}: scale or zero point is not a constant")
            continue
        s = scale.value.numpy().astype(np.float64).reshape(-1)
        mant, _ = np.frexp(s)
        if not np.all(np.isfinite(s)) or np.any(s <= 0) or np.any(mant != 0.5):
            bad.append(f"{b.name}: scale {s[(mant != 0.5) | ~np.isfinite(s)][:1].tolist()} is not a power of two")
    return bad


def detect(qg) -> bool:
    return getattr(qg, "dialect", None) == "onnx-qdq" and bool(_qdq_spans(qg)) and not _not_pow2(qg)


def realize(qg) -> None:
    bad = _not_pow2(qg)
    if bad:
        raise IrgenError(f"{SCHEME}: not a power-of-two model: {bad[0]}")
    irgen_qdq.realize(qg, scheme=SCHEME, conv_requant=shift_requant)


@hookimpl
def irgen_register_quantizers(register):
    register(
        Quantizer(
            name=SCHEME,
            detect=detect,
            realize=realize,
            priority=20,  # before qdq: a power-of-two QDQ model is requantized by shifts
            description="power-of-two scales, requantization by shift alone (then + the zero point)",
            recompute=RECOMPUTE,
        )
    )
