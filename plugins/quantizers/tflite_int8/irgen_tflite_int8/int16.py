"""TFLite's 16x8 kernels (int16 activations, int8 weights) that differ from their int8 forms.

The converter's ``EXPERIMENTAL_TFLITE_BUILTINS_ACTIVATIONS_INT16_WEIGHTS_INT8`` mode gives every
activation an int16 tensor with zero point 0. CONV_2D, DEPTHWISE_CONV_2D, FULLY_CONNECTED,
BATCH_MATMUL, ADD, SUB, MEAN, AVERAGE_POOL_2D, MAX_POOL_2D, CONCATENATION, MUL, LEAKY_RELU,
MAXIMUM, MINIMUM, RESIZE_BILINEAR and int16 -> int16 QUANTIZE are the scheme's int8
realizations with their 16x8 parameters (int64 accumulation and bias, the 15-bit ADD headroom;
:data:`SUPPORTED` lists them all). The kernels here are TFLite's own int16 algorithms (TF 2.21, the same in its
reference and optimized resolvers; measured against the interpreter), each realization
beside its numpy recompute:

* ``softmax16`` -- SOFTMAX over the last axis (``reference_ops::SoftmaxInt16``): ``x - max``
  rescaled so that [-10, 0] spans the int16 range, looked up in a 513-entry exp table
  (parameter ``table``), summed, the reciprocal of the sum through a 513-entry ``1 / (1 + x)``
  table (parameter ``table1``) after normalizing the sum by its leading zeros, the product
  rounded back; both tables are TFLite's ``LUTPopulate<int16_t>`` (in double, with the
  midpoint correction), the lookups its ``LUTLookup`` (linear interpolation over 7 bits);
* ``logistic16`` / ``tanh16`` -- LOGISTIC and TANH (``reference_integer_ops::Logistic`` /
  ``Tanh``): the input rescaled by an integer multiplier and left shift (from the input scale,
  ``* 4096 * 3``), interpolated in TFLite's 256-entry ``sigmoid_table_uint16`` (parameter
  ``table``), rounded back to Q0.15;
* ``gelu16`` -- GELU, exact or ``approximate`` (the tanh form): each int16 value looked up
  (``LUTLookup``) in a 513-entry table of the float32 ``GeluTransform`` over the input's
  int16 range (``LUTPopulate<int16_t>``, every step in float; parameter ``table``): every
  one of the 65,536 input codes equal to the interpreter's at six scales, both forms.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from irgen.plugin import round_half_away
from irgen_tflite_int8 import kinds

SCHEME = "tflite-int8"
I16 = (-32768, 32767)

#: TFLite's ``sigmoid_table_uint16`` (internal/common.h): sigmoid(i / 24) in Q0.16, i = 0..255
SIGMOID_TABLE = np.array([
    32768, 33451, 34133, 34813, 35493, 36169, 36843, 37513, 38180, 38841, 39498, 40149, 40794, 41432, 42064, 42688,
    43304, 43912, 44511, 45102, 45683, 46255, 46817, 47369, 47911, 48443, 48964, 49475, 49975, 50464, 50942, 51409,
    51865, 52311, 52745, 53169, 53581, 53983, 54374, 54755, 55125, 55485, 55834, 56174, 56503, 56823, 57133, 57433,
    57724, 58007, 58280, 58544, 58800, 59048, 59288, 59519, 59743, 59959, 60168, 60370, 60565, 60753, 60935, 61110,
    61279, 61441, 61599, 61750, 61896, 62036, 62172, 62302, 62428, 62549, 62666, 62778, 62886, 62990, 63090, 63186,
    63279, 63368, 63454, 63536, 63615, 63691, 63765, 63835, 63903, 63968, 64030, 64090, 64148, 64204, 64257, 64308,
    64357, 64405, 64450, 64494, 64536, 64576, 64614, 64652, 64687, 64721, 64754, 64786, 64816, 64845, 64873, 64900,
    64926, 64950, 64974, 64997, 65019, 65039, 65060, 65079, 65097, 65115, 65132, 65149, 65164, 65179, 65194, 65208,
    65221, 65234, 65246, 65258, 65269, 65280, 65291, 65301, 65310, 65319, 65328, 65337, 65345, 65352, 65360, 65367,
    65374, 65381, 65387, 65393, 65399, 65404, 65410, 65415, 65420, 65425, 65429, 65433, 65438, 65442, 65445, 65449,
    65453, 65456, 65459, 65462, 65465, 65468, 65471, 65474, 65476, 65479, 65481, 65483, 65485, 65488, 65489, 65491,
    65493, 65495, 65497, 65498, 65500, 65501, 65503, 65504, 65505, 65507, 65508, 65509, 65510, 65511, 65512, 65513,
    65514, 65515, 65516, 65517, 65517, 65518, 65519, 65520, 65520, 65521, 65522, 65522, 65523, 65523, 65524, 65524,
    65525, 65525, 65526, 65526, 65526, 65527, 65527, 65528, 65528, 65528, 65529, 65529, 65529, 65529, 65530, 65530,
    65530, 65530, 65531, 65531, 65531, 65531, 65531, 65532, 65532, 65532, 65532, 65532, 65532, 65533, 65533, 65533,
    65533, 65533, 65533, 65533, 65533, 65534, 65534, 65534, 65534, 65534, 65534, 65534, 65534, 65534, 65534, 65535,
], dtype=np.uint16)


# ------------------------------------------------------------------ numpy kernels


def lut_populate16(fn: Callable[[np.ndarray], np.ndarray], s_in: float, zp_in: int, s_out: float, zp_out: int,
                   dtype: type = np.float64) -> np.ndarray:
    """TFLite's ``LUTPopulate<int16_t>`` (``LUTPopulateInt16<T>``): 513 int16 samples of ``fn``
    over the input's int16 range, each corrected by half the error of linear interpolation at
    its interval's midpoint. Every step in ``dtype`` (``T``: double for softmax's tables, float
    for GELU's); ``fn`` maps an array of ``dtype`` elementwise, as the C library's function of
    that type does (:func:`each` makes one of a scalar function)."""
    f = dtype
    in_min, in_max = f(s_in) * f(I16[0] - zp_in), f(s_in) * f(I16[1] - zp_in)
    out_min, out_max = f(s_out) * f(I16[0] - zp_out), f(s_out) * f(I16[1] - zp_out)
    step = (in_max - in_min) / f(512)
    half = step / f(2)
    inv = f(65536) / (out_max - out_min)
    i = np.arange(512, dtype=dtype)
    at = in_min + i * step
    val, mid, nxt = fn(at), fn(at + half), fn(in_min + (i + f(1)) * step)

    def rnd(v):  # std::round in dtype
        return round_half_away(np.asarray(v, dtype))

    sample = rnd(val * inv)
    interp = rnd((nxt * inv + rnd(val * inv)) / f(2))
    bias = rnd((interp - rnd(mid * inv)) / f(2))
    lut = np.empty(513, np.int16)
    lut[:512] = np.clip(sample - bias, *I16)
    lut[512] = np.clip(rnd(fn(np.array([in_max], dtype)) * inv)[0], *I16)
    return lut


def each(fn: Callable[[float], float]) -> Callable[[np.ndarray], np.ndarray]:
    """``fn`` of a Python float applied to every element of a float64 array (``math.exp`` is
    the C library's ``exp``, whose last bit numpy's own may not share)."""
    return lambda a: np.array([fn(float(v)) for v in a], np.float64)


def gelu_table16(s_in: float, zp_in: int, s_out: float, zp_out: int, approximate: bool) -> np.ndarray:
    """GeluPrepare's int16 table: :func:`lut_populate16` in float of ``GeluTransform`` (or
    ``GeluTransformApproximate``)."""
    return lut_populate16(kinds.gelu_tanh_f32 if approximate else kinds.gelu_f32, s_in, zp_in, s_out, zp_out,
                          np.float32)


def gelu16(x, table) -> np.ndarray:
    """TFLite's int16 GELU: :func:`lut_lookup16` of each value in its table."""
    return lut_lookup16(x, table).astype(np.int16)


def softmax_tables() -> tuple[np.ndarray, np.ndarray]:
    """SoftmaxPrepare's two tables: ``exp`` over [-10, 0] and ``1 / (1 + x)`` over [0, 1], both
    to [-1, 1) in int16."""
    r = 65535.0
    return (lut_populate16(each(math.exp), 10.0 / r, I16[1], 2.0 / r, 0),
            lut_populate16(lambda v: 1.0 / (1.0 + v), 1.0 / r, I16[0], 2.0 / r, 0))


def _wrap16(v) -> np.ndarray:
    return np.asarray(v, np.int64).astype(np.int16).astype(np.int64)


def lut_lookup16(v, lut) -> np.ndarray:
    """TFLite's ``LUTLookup`` of an int16 value: ``lut[256 + (v >> 7)]`` plus the slope to the
    next entry times ``v & 127``, rounded over 7 bits (int16 wrap-around as in C++)."""
    v = np.asarray(v, np.int64)
    lut = np.asarray(lut, np.int64)
    idx = 256 + (v >> 7)
    base = lut[idx]
    slope = _wrap16(lut[idx + 1] - base)
    return _wrap16(base + ((slope * (v & 0x7F) + 64) >> 7))


def softmax_multiplier(s_in: float) -> tuple[int, int]:
    """SoftmaxPrepare: QuantizeMultiplier(float32(s_in * beta) / (10 / 65535)), beta = 1."""
    from irgen.plugin import quantize_multiplier

    return quantize_multiplier(float(np.float32(s_in)) / (10.0 / 65535.0))


def _bit_length(v) -> np.ndarray:
    """Bits of each positive int64 value below 2**32 (32 - TFLite's CountLeadingZeros)."""
    v = np.asarray(v, np.int64)
    return (v[..., None] >= (np.int64(1) << np.arange(32, dtype=np.int64))).sum(axis=-1)


def softmax16(x, exp_table, rec_table, multiplier: int, shift: int) -> np.ndarray:
    """``reference_ops::SoftmaxInt16`` over the last axis."""
    from irgen.plugin import DOUBLE, multiply_by_quantized_multiplier

    x = np.asarray(x, np.int64)
    scaled = multiply_by_quantized_multiplier(x - x.max(axis=-1, keepdims=True), multiplier, shift, DOUBLE)
    e = lut_lookup16(np.clip(scaled + 32767, *I16), exp_table)
    total = e.sum(axis=-1, keepdims=True)
    hp1 = 32 - _bit_length(total)
    shifted = ((total << (hp1 - 1)) + (1 << 13)) >> 14
    r = lut_lookup16(np.clip(shifted - ((1 << 15) + (1 << 16)), *I16), rec_table)
    rs = 31 - hp1
    return np.clip((e * r + (np.int64(1) << (rs - 1))) >> rs, 0, I16[1]).astype(np.int16)


def tanh_logistic_params(s_in: float, tanh: bool) -> tuple[int, int]:
    """TanhPrepare / SigmoidPrepare for int16: (input multiplier, input left shift). A
    power-of-two input scale whose shift is 0 (tanh: 0 or 1) gives multiplier 0 (the kernel then
    multiplies by ``3 << shift``); otherwise ``s_in * 4096 * 3`` doubled until above 16383.5,
    truncated."""
    m, e = math.frexp(float(np.float32(s_in)))
    left = 12 + (e - 1)
    pot = m == 0.5 and (left in (0, 1) if tanh else left == 0)
    if pot:
        return 0, left
    mult, left = float(np.float32(s_in)) * 4096.0 * 3.0, 0
    while mult <= 32767.0 / 2.0 and left <= 30:
        left += 1
        mult *= 2.0
    return int(mult), left


def _effective(mult: int, left: int) -> tuple[int, int]:
    return (3 << left, 0) if mult == 0 else (mult, left)


def logistic16(x, table, mult: int, left: int, tanh: bool = False) -> np.ndarray:
    """``reference_integer_ops::Logistic`` (``tanh``: ``Tanh``) on int16."""
    m, ls = _effective(mult, left)
    v = (np.asarray(x, np.int64) * m + ((1 << (ls - 1)) if ls > 0 else 0)) >> ls
    bits = 8 if tanh else 9
    a = np.abs(v)
    uh = a >> bits
    t = np.asarray(table, np.int64)
    ua, ub = t[np.minimum(uh, 254)], t[np.minimum(uh, 254) + 1]
    r = np.where(uh >= 255, (0xFFFF << 8) if tanh else (0x7FFF << 10), (ua << bits) + (a & ((1 << bits) - 1)) * (ub - ua))
    if tanh:
        r = np.where(v >= 0, r - (1 << 23) + (1 << 7), -r + (1 << 23) + (1 << 7) - 1)
        return _wrap16(r >> 8).astype(np.int16)
    r = np.where(v >= 0, r + (1 << 9), (1 << 25) - r + (1 << 9) - 1)
    return _wrap16(r >> 10).astype(np.int16)


# ------------------------------------------------------------------ Relax realizations


def _rx():
    from tvm import relax
    from tvm.relax import op

    import irgen.plugin as q

    return relax, op, q


def _rx_wrap16(emit, v):
    _, op, _ = _rx()
    return emit(op.astype(emit(op.astype(v, "int16")), "int64"))


def _rx_lut_lookup(emit, v, lut):
    """:func:`lut_lookup16` on an int64 tensor of int16 values; ``lut`` a Relax int16 constant."""
    _, op, q = _rx()
    idx = emit(op.add(emit(op.right_shift(v, q.rx_const(7, "int64"))), q.rx_const(256, "int64")))
    base = emit(op.astype(emit(op.take(lut, idx, axis=0, mode="clip")), "int64"))
    nxt = emit(op.astype(emit(op.take(lut, emit(op.add(idx, q.rx_const(1, "int64"))), axis=0, mode="clip")), "int64"))
    slope = _rx_wrap16(emit, emit(op.subtract(nxt, base)))
    frac = emit(op.floor_mod(v, q.rx_const(128, "int64")))  # v & 0x7f
    delta = emit(op.right_shift(emit(op.add(emit(op.multiply(slope, frac)), q.rx_const(64, "int64"))),
                                q.rx_const(7, "int64")))
    return _rx_wrap16(emit, emit(op.add(base, delta)))


def _check_q015(qb, out, what: str) -> None:
    from irgen.plugin import IrgenError

    if float(out.scale[0]) != 1 / 32768 or int(out.zero_point[0]) != 0:
        raise IrgenError(f"{SCHEME}: the int16 {what} {qb.name!r} has output scale {float(out.scale[0])!r}; "
                         "TFLite's kernel writes 1/32768 (Q0.15)")


def _unary_input(qg, qb, comp, act, helpers, what: str):
    from irgen.plugin import IrgenError

    if act is not None:
        raise IrgenError(f"{SCHEME}: a float activation after the int16 {what} {qb.name!r}")
    return helpers.int8_input(qg, comp.value.args[0], f"input of the {what} {qb.name!r}")


def realize_softmax16(qg, qb, comp, out, act, helpers):
    from irgen.plugin import IrgenError

    relax, op, q = _rx()
    x, qx, dqx = _unary_input(qg, qb, comp, act, helpers, "softmax")
    ndim = len(x.ty.shape.values)
    if int(comp.value.attrs.axis) not in (-1, ndim - 1):
        raise IrgenError(f"{SCHEME}: softmax {qb.name!r} is not over the last axis; TFLite's int16 kernel is")
    _check_q015(qb, out, "softmax")
    mult, shift = softmax_multiplier(float(qx.scale[0]))
    exp_table, rec_table = (relax.const(t) for t in softmax_tables())
    e = qg.emit
    xi = e(op.astype(x, "int32"))
    diff = e(op.subtract(xi, e(op.max(xi, axis=[-1], keepdims=True))))
    scaled = q.rx_multiply_by_quantized_multiplier(e, diff, np.array([mult]), np.array([shift]), -1, ndim, q.DOUBLE)
    sym = e(op.astype(e(op.clip(e(op.add(scaled, q.rx_const(32767, "int32"))), *I16)), "int64"))
    ex = _rx_lut_lookup(e, sym, exp_table)
    total = e(op.sum(ex, axis=[-1], keepdims=True))
    powers = q.rx_const(np.int64(1) << np.arange(32, dtype=np.int64), "int64")
    bits = e(op.sum(e(op.astype(e(op.greater_equal(e(op.expand_dims(total, -1)), powers)), "int64")), axis=[-1]))
    hp1 = e(op.subtract(q.rx_const(32, "int64"), bits))
    shifted = e(op.right_shift(e(op.add(e(op.left_shift(total, e(op.subtract(hp1, q.rx_const(1, "int64"))))),
                                        q.rx_const(1 << 13, "int64"))), q.rx_const(14, "int64")))
    centred = e(op.clip(e(op.subtract(shifted, q.rx_const((1 << 15) + (1 << 16), "int64"))), *I16))
    r = _rx_lut_lookup(e, centred, rec_table)
    rs = e(op.subtract(q.rx_const(31, "int64"), hp1))
    half = e(op.left_shift(q.rx_const(1, "int64"), e(op.subtract(rs, q.rx_const(1, "int64")))))
    y = e(op.right_shift(e(op.add(e(op.multiply(ex, r)), half)), rs))
    rec = {"scheme": SCHEME, "kind": "softmax16", "op": "softmax", "axis": -1, "inputs": [qx.record()], "output": out.record(),
           "requant": {"multiplier": int(mult), "shift": int(shift), "rounding": q.DOUBLE,
                       "rounding_rule": "TFLite SoftmaxInt16: d = MultiplyByQuantizedMultiplier(x - max, M, shift) "
                                        "(double rounding); e = LUTLookup(clamp(d + 32767), table); s = sum(e); "
                                        "h = CountLeadingZeros32(s); r = LUTLookup(clamp((((s << (h - 1)) + 2**13) >> 14) "
                                        "- 98304), table1); y = (e * r + 2**(30 - h)) >> (31 - h), clamped to [0, 32767]"},
           "tables": {"table": "LUTPopulate<int16_t>(exp) over [-10, 0] (513 int16)",
                      "table1": "LUTPopulate<int16_t>(1 / (1 + x)) over [0, 1] (513 int16)"},
           "clamp": [0, I16[1]]}
    return [dqx, comp.name, qb.name], op.astype(e(op.clip(y, 0, I16[1])), "int16"), rec


def _realize_sigmoid_table(qg, qb, comp, out, act, helpers, tanh: bool):
    relax, op, q = _rx()
    what = "tanh" if tanh else "logistic"
    x, qx, dqx = _unary_input(qg, qb, comp, act, helpers, what)
    _check_q015(qb, out, what)
    mult, left = tanh_logistic_params(float(qx.scale[0]), tanh)
    m, ls = _effective(mult, left)
    bits = 8 if tanh else 9
    e = qg.emit

    def c(v):
        return q.rx_const(v, "int64")

    v = e(op.right_shift(e(op.add(e(op.multiply(e(op.astype(x, "int64")), c(m))), c((1 << (ls - 1)) if ls > 0 else 0))), c(ls)))
    a = e(op.abs(v))
    uh = e(op.right_shift(a, c(bits)))
    at = e(op.minimum(uh, c(254)))
    table = relax.const(SIGMOID_TABLE)
    ua = e(op.astype(e(op.take(table, at, axis=0, mode="clip")), "int64"))
    ub = e(op.astype(e(op.take(table, e(op.add(at, c(1))), axis=0, mode="clip")), "int64"))
    interp = e(op.add(e(op.left_shift(ua, c(bits))), e(op.multiply(e(op.floor_mod(a, c(1 << bits))), e(op.subtract(ub, ua))))))
    r = e(op.where(e(op.greater_equal(uh, c(255))), c((0xFFFF << 8) if tanh else (0x7FFF << 10)), interp))
    nonneg = e(op.greater_equal(v, c(0)))
    if tanh:
        r = e(op.where(nonneg, e(op.add(r, c(-(1 << 23) + (1 << 7)))), e(op.subtract(c((1 << 23) + (1 << 7) - 1), r))))
    else:
        r = e(op.where(nonneg, e(op.add(r, c(1 << 9))), e(op.subtract(c((1 << 25) + (1 << 9) - 1), r))))
    y = op.astype(e(op.right_shift(r, c(8 if tanh else 10))), "int16")
    kernel = "Tanh" if tanh else "Logistic"
    rec = {"scheme": SCHEME, "kind": f"{what}16", "op": "tanh" if tanh else "sigmoid", "inputs": [qx.record()],
           "output": out.record(),
           "requant": {"input_multiplier": int(mult), "input_left_shift": int(left),
                       "rounding_rule": f"TFLite reference_integer_ops::{kernel} (int16): v = (x * m + round) >> "
                                        f"shift (m = 3 << shift, shift 0, when the multiplier is 0); interpolate "
                                        f"|v| in table at (|v| >> {bits}) over its low {bits} bits; "
                                        + ("y = (r - 2**23 + 2**7) >> 8, or (2**23 + 2**7 - 1 - r) >> 8 for v < 0"
                                           if tanh else "y = (r + 2**9) >> 10, or (2**25 + 2**9 - 1 - r) >> 10 for v < 0")},
           "table": "parameter 'table': TFLite's sigmoid_table_uint16 (256 uint16, sigmoid(i / 24) in Q0.16)"}
    return [dqx, comp.name, qb.name], y, rec


def realize_logistic16(qg, qb, comp, out, act, helpers):
    return _realize_sigmoid_table(qg, qb, comp, out, act, helpers, tanh=False)


def realize_tanh16(qg, qb, comp, out, act, helpers):
    return _realize_sigmoid_table(qg, qb, comp, out, act, helpers, tanh=True)


def realize_gelu16(qg, qb, comp, out, act, helpers):
    """GELU on int16 (``nn.gelu``; ``nn.gelu_tanh`` for ``approximate``): the input's values
    looked up in the table of the float32 transform (:func:`gelu_table16`)."""
    relax, op, _ = _rx()
    approximate = comp.op == "relax.nn.gelu_tanh"
    x, qx, dqx = _unary_input(qg, qb, comp, act, helpers, "GELU")
    table = gelu_table16(float(qx.scale[0]), int(qx.zero_point[0]), float(out.scale[0]), int(out.zero_point[0]),
                         approximate)
    e = qg.emit
    y = _rx_lut_lookup(e, e(op.astype(x, "int64")), relax.const(table))
    form = "GeluTransformApproximate (0.5f * x * (1 + tanh(...)))" if approximate else \
        "GeluTransform (0.5f * x * erfc(-x / sqrt(2)))"
    rec = {"scheme": SCHEME, "kind": "gelu16", "op": "gelu", "inputs": [qx.record()], "output": out.record(),
           "params": {"approximate": approximate},
           "rounding_rule": "TFLite GELU (int16): y = LUTLookup(x, table): table[256 + (x >> 7)] plus "
                            "((table[i + 1] - table[i]) * (x & 127) + 64) >> 7",
           "table": f"parameter 'table': LUTPopulate<int16_t> of the float32 {form} over the input's int16 "
                    "range (513 int16, every step in float, midpoint-corrected)"}
    return [dqx, comp.name, qb.name], op.astype(y, "int16"), rec


def realize_mul16(qg, qb, comp, out, act, helpers):
    """MUL on int16: the int8 kernel's formula (``MulElementwise``) with the int16 clamp;
    SQUARED_DIFFERENCE (``d * d``) has no int16 kernel here."""
    from tvm import relax

    from irgen.plugin import IrgenError
    a, b = comp.value.args
    if isinstance(a, relax.Var) and isinstance(b, relax.Var) and a.name == b.name:
        raise IrgenError(f"{SCHEME}: cannot realize the square {qb.name!r} on int16 activations (16x8)")
    return kinds.realize_mul(qg, qb, comp, out, act, helpers)


# ------------------------------------------------------------------ recomputes


def recompute_softmax16(layer, inputs, params) -> np.ndarray:
    rq = layer["quant"]["requant"]
    return softmax16(inputs[0], params["table"], params["table1"], rq["multiplier"], rq["shift"])


def recompute_gelu16(layer, inputs, params) -> np.ndarray:
    return gelu16(inputs[0], params["table"])


def recompute_sigmoid_table(layer, inputs, params) -> np.ndarray:
    qr = layer["quant"]
    rq = qr["requant"]
    return logistic16(inputs[0], params["table"], rq["input_multiplier"], rq["input_left_shift"],
                      tanh=qr["kind"] == "tanh16")


#: the float Relax op between dequantize and quantize -> its int16 realization
SPANS: dict[str, Callable] = {
    "relax.nn.softmax": realize_softmax16,
    "relax.sigmoid": realize_logistic16,
    "relax.tanh": realize_tanh16,
    "relax.nn.gelu": realize_gelu16,
    "relax.nn.gelu_tanh": realize_gelu16,
    "relax.multiply": realize_mul16,
    "relax.dequantize": kinds.realize_requantize,  # int16 -> int16 QUANTIZE, int16 ReLUs
    "relax.image.resize2d": kinds.realize_resize_bilinear,  # ResizeBilinearInteger<int16_t>
    "relax.nn.leakyrelu": kinds.realize_leaky_relu,  # QuantizeLeakyRelu<int16_t>
    "relax.maximum": kinds.realize_min_max,
    "relax.minimum": kinds.realize_min_max,
}

#: quant kind -> numpy recompute (registered by the scheme)
RECOMPUTE: dict[str, Callable[..., Any]] = {
    "softmax16": recompute_softmax16,
    "logistic16": recompute_sigmoid_table,
    "tanh16": recompute_sigmoid_table,
    "gelu16": recompute_gelu16,
}

#: TFLite ops the scheme realizes on int16 activations (for the error that names the others)
SUPPORTED = ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "BATCH_MATMUL", "ADD", "SUB", "MUL", "MEAN",
             "AVERAGE_POOL_2D", "MAX_POOL_2D", "CONCATENATION", "PAD", "TRANSPOSE", "RESHAPE", "TILE", "RESIZE_BILINEAR", "LEAKY_RELU", "MAXIMUM", "MINIMUM",
             "SOFTMAX", "LOGISTIC", "TANH", "GELU", "QUANTIZE", "DEQUANTIZE")
