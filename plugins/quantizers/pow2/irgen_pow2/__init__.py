"""The ``pow2`` quantization-fusion scheme: power-of-two scales, requantization by shift alone.

Many accelerators keep every scale a power of two and zero points at 0, so
requantizing an int32 accumulator is one rounding right shift. This scheme
takes ONNX QDQ models whose scales are all powers of two (chosen
automatically then, or forced with ``--quantizer pow2``), realizes them as
the ``qdq`` scheme does (irgen's QDQ engine, :func:`irgen.plugin.realize_qdq`), and requantizes convolutions and dense layers with
shifts only: ``y = round_half_even(acc / 2**shift[c])``, which is exactly
what ONNX Runtime computes for such scales. The quant record carries the
shift amounts.
"""

from __future__ import annotations

import numpy as np

from irgen.plugin import (QDQ_RECOMPUTE, IrgenError, Quantizer, hookimpl, recompute_pow2, recompute_qdq,
                          recompute_requantized, register_recompute)

__version__ = "0.1.0"

SCHEME = "pow2"
RULE = ("y = round_half_even(acc / 2**shift[c]) by shifts: s = shift + 1, a = acc << (1 + max(-shift, 0)); "
        "q = a >> s; r = a & (2**s - 1); q += (r > 2**(s-1)) + (r == 2**(s-1)) * (q & 1); then + zp, clamp")


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
        elif np.any(zp.value.numpy() != 0):
            bad.append(f"{b.name}: zero point is not 0 (pow2 is symmetric)")
    return bad


def detect(qg) -> bool:
    return getattr(qg, "dialect", None) == "onnx-qdq" and bool(_qdq_spans(qg)) and not _not_pow2(qg)


def _shift_requant(qg, acc, scale, out, lo, hi, axis, ndim, tensor):
    from tvm.relax import op

    import irgen.plugin as q

    shift = -np.log2(np.asarray(scale, np.float64))
    if np.any(shift != np.round(shift)):
        raise IrgenError(f"{SCHEME}: the requantization scale of {tensor!r} is not a power of two")
    shift = shift.astype(np.int64)
    e = qg.emit

    def c(v):
        return q.rx_const(q.per_axis(np.asarray(v, np.int64), axis, ndim), "int64")

    s = shift + 1
    a = e(op.left_shift(e(op.astype(acc, "int64")), c(1 + np.maximum(-shift, 0))))
    quo = e(op.right_shift(a, c(np.maximum(s, 1))))
    rem = e(op.bitwise_and(a, c((np.int64(1) << np.maximum(s, 1)) - 1)))
    half = c(np.int64(1) << (np.maximum(s, 1) - 1))
    up = e(op.add(e(op.astype(e(op.greater(rem, half)), "int64")),
                  e(op.multiply(e(op.astype(e(op.equal(rem, half)), "int64")),
                                e(op.bitwise_and(quo, q.rx_const(1, "int64")))))))
    y = e(op.astype(e(op.add(quo, up)), "int32"))
    y = e(op.add(y, q.rx_const(int(out.zero_point[0]), "int32")))
    expr = q.rx_clamp_cast(e, y, lo, hi, out.dtype)
    return expr, {"shift": shift.tolist(), "axis": axis, "rounding": "half_to_even", "rounding_rule": RULE}


def realize(qg) -> None:
    from irgen.plugin import realize_qdq

    bad = _not_pow2(qg)
    if bad:
        raise IrgenError(f"{SCHEME}: not a power-of-two model: {bad[0]}")
    realize_qdq(qg, scheme=SCHEME, conv_requant=_shift_requant)


# verify's recompute of the kinds irgen's QDQ engine records beyond the built-in ones, under this
# scheme's name (so pow2 outputs verify without the qdq plugin installed)
register_recompute(SCHEME, "*", recompute_qdq)  # the QDQ engine's kinds, ONNX Runtime's kernels
register_recompute(SCHEME, "integer", recompute_requantized)
for _kind in ("conv2d", "depthwise_conv2d", "dense"):  # requantized by a rounding shift
    register_recompute(SCHEME, _kind, recompute_pow2)
for _kind, _fn in QDQ_RECOMPUTE.items():
    register_recompute(SCHEME, _kind, _fn)


@hookimpl
def irgen_register_quantizers(register):
    register(
        Quantizer(
            name=SCHEME,
            detect=detect,
            realize=realize,
            priority=20,  # before qdq: a power-of-two QDQ model is requantized by shifts
            description="symmetric power-of-two scales, requantization by shift alone",
        )
    )
