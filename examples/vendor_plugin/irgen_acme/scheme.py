"""The ``acme-qdq`` scheme: symmetric int8 ONNX QDQ models, fixed-point requantization.

The acme NPU's MAC array has no float unit: a convolution or dense accumulator
(int32) is requantized with a per-channel int32 multiplier and a right shift,
``y = (acc * M[c] + 2**(30 - shift[c])) >> (31 - shift[c])`` (one rounding, ties
up: ``irgen.plugin.SINGLE``), where ``M[c] * 2**(shift[c] - 31)`` approximates
``s_x * s_w[c] / s_y``. It has no zero-point adders either, so every tensor must
be int8 with zero point 0 (bias: int32, zero point 0): ``quantize_static(...,
extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})``.
Any other model is refused, naming the first tensor that breaks the rule.

Every other layer is realized as ONNX Runtime computes it, by the ``qdq`` scheme's
realization (``irgen_qdq.realize``, the public API of the ``irgen-qdq`` plugin this one
depends on); this scheme only replaces the requantization of convolutions and dense layers.
"""

from __future__ import annotations

import numpy as np

from irgen.plugin import SINGLE, ROUNDING_RULES, IrgenError, quantize_multiplier

SCHEME = "acme-qdq"
DIALECT = "onnx-qdq"
#: the layer kinds the acme NPU runs (``quant["kind"]`` of the layers the QDQ engine forms)
KINDS = frozenset({"conv2d", "depthwise_conv2d", "dense", "add", "global_avg_pool", "lut", "integer",
                   "concatenate", "quantize", "dequantize"})
RULE = ("y = clamp((acc * multiplier[c] + 2**(30 - shift[c])) >> (31 - shift[c]), clamp); "
        "multiplier[c] * 2**(shift[c] - 31) ~= s_x * s_w[c] / s_y (" + ROUNDING_RULES[SINGLE] + ")")


def _qdq_ops(qg) -> list:
    return [b for b in qg.bindings if b.op in ("relax.quantize", "relax.dequantize")]


def _zero_points(qg):
    """``(binding, zero points)`` of each quantize/dequantize; None when its scale or zero point is computed."""
    from irgen.plugin import Constant

    for b in _qdq_ops(qg):
        constant = all(isinstance(a, Constant) for a in b.value.args[1:3])
        yield b, b.value.args[2].value.numpy() if constant else None


def not_symmetric_int8(qg) -> list[str]:
    """Why ``qg`` is not a symmetric int8 QDQ model (one sentence per tensor), empty when it is."""
    from irgen.plugin import Constant

    if getattr(qg, "dialect", None) != DIALECT:
        return [f"the model's quantization dialect is {getattr(qg, 'dialect', None)!r}, not {DIALECT!r} "
                "(an ONNX QuantizeLinear/DequantizeLinear model)"]
    bad = []
    for b, z in _zero_points(qg):
        # int32 only for a dequantized constant (a bias), int8 everywhere else
        bias = b.op == "relax.dequantize" and isinstance(b.value.args[0], Constant)
        if z is None:
            bad.append(f"{b.name}: its scale or zero point is not a constant")
        elif str(z.dtype) not in (("int8", "int32") if bias else ("int8",)):
            bad.append(f"{b.name}: {z.dtype} (the acme NPU runs int8 tensors only)")
        elif np.any(z != 0):
            bad.append(f"{b.name}: zero point {z.reshape(-1)[np.flatnonzero(z.reshape(-1))[0]]} is not 0 "
                       "(the acme NPU is symmetric: quantize with ActivationSymmetric and WeightSymmetric)")
    return bad


def detect(qg) -> bool:
    return bool(_qdq_ops(qg)) and not not_symmetric_int8(qg)


def fixed_point_requant(qg, acc, scale, out, lo, hi, axis, ndim, tensor):
    """``conv_requant`` of :func:`irgen_qdq.realize`: the int32 accumulator ``acc``
    requantized by multiplier and shift (per channel on ``axis``), clamped to ``[lo, hi]``."""
    import irgen.plugin as q

    pairs = [quantize_multiplier(float(s)) for s in np.asarray(scale, np.float64).reshape(-1)]
    multiplier = np.array([m for m, _ in pairs], np.int64)
    shift = np.array([s for _, s in pairs], np.int64)
    if np.any(multiplier == 0) or np.any(31 - shift > 62):
        raise IrgenError(f"{SCHEME}: the requantization scale of {tensor!r} ({float(np.min(scale)):.3g}) is too small "
                         "for the acme NPU's 62-bit shifter")
    y = q.rx_multiply_by_quantized_multiplier(qg.emit, acc, multiplier, shift, axis, ndim, SINGLE)
    expr = q.rx_clamp_cast(qg.emit, y, lo, hi, out.dtype)
    return expr, {"multiplier": multiplier.tolist(), "shift": shift.tolist(), "axis": axis, "rounding": SINGLE,
                  "rounding_rule": RULE}


def realize(qg) -> None:
    """Realize a symmetric int8 QDQ model; refuse any other, and any layer the NPU cannot run."""
    import irgen_qdq

    bad = not_symmetric_int8(qg)
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise IrgenError(f"{SCHEME}: not a symmetric int8 QDQ model: {bad[0]}{more}")
    irgen_qdq.realize(qg, scheme=SCHEME, conv_requant=fixed_point_requant)
    other = sorted({f"{name} ({rec['kind']})" for name, rec in qg.quant.items() if rec["kind"] not in KINDS})
    if other:
        raise IrgenError(f"{SCHEME}: the acme NPU cannot run layer(s) {', '.join(other[:5])}; "
                         f"it runs {', '.join(sorted(KINDS))}")
