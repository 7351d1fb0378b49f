"""The ``pow2`` requantization: a convolution's or dense layer's int32 accumulator divided by a
power of two per channel, rounded half to even, as Relax ops (:func:`shift_requant`, the
``conv_requant`` of ``irgen_qdq.realize``) and in numpy (:func:`recompute_shifted`, verify's
recompute of those layers), side by side so they cannot drift."""

from __future__ import annotations

from typing import Any

import numpy as np

from irgen.plugin import IrgenError, accumulate, per_axis

SCHEME = "pow2"
RULE = ("y = round_half_even(acc / 2**shift[c]) by shifts: s = shift + 1, a = acc << (1 + max(-shift, 0)); "
        "q = a >> s; r = a & (2**s - 1); q += (r > 2**(s-1)) + (r == 2**(s-1)) * (q & 1); then + zp, clamp")


def shift_requant(qg, acc, scale, out, lo, hi, axis, ndim, tensor):
    """``conv_requant`` of ``irgen_qdq.realize``: ``scale`` (``s_x * s_w[c] / s_y``) must be
    ``2**-shift[c]``; the accumulator shifted right by ``shift[c]``, rounded half to even."""
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


def round_shift_half_even(acc, shift) -> np.ndarray:
    """``round_half_even(acc / 2**shift)`` in integers (``shift`` may be negative)."""
    acc, shift = np.asarray(acc, np.int64), np.asarray(shift, np.int64)
    s = shift + 1
    a = acc << (1 + np.maximum(-shift, 0))
    s = np.maximum(s, 1)
    quo, rem, half = a >> s, a & ((np.int64(1) << s) - 1), np.int64(1) << (s - 1)
    return quo + (rem > half) + (rem == half) * (quo & 1)


def recompute_shifted(layer: dict[str, Any], inputs: list[np.ndarray], params: dict[str, np.ndarray]) -> np.ndarray:
    """A ``pow2`` convolution or dense layer: int32 accumulation, then a rounding shift per channel."""
    qr = layer["quant"]
    rq, out = qr["requant"], qr["output"]
    acc = accumulate(layer, inputs, params)
    y = round_shift_half_even(acc, per_axis(rq["shift"], rq["axis"], acc.ndim)) + int(out["zero_point"])
    lo, hi = qr["clamp"]
    return np.clip(y, lo, hi).astype(out["dtype"])
