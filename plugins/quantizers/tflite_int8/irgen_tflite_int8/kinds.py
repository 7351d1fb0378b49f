"""Layer kinds of the ``tflite-int8`` scheme beyond the core ones: each kind is
one realization (Relax integer ops, from the dequantize -> float op -> quantize
span TVM imports) and one numpy recompute (from the quant record and the
parameter files alone), side by side.

* ``lut`` -- an elementwise int8 -> int8 function as TFLite's kernel computes it,
  realized as a 256-entry table (parameter ``table``) indexed by ``x + 128``:

  - LOGISTIC: TFLite's ``LUTPopulate``: ``round(sigmoid(s_x * (v - zp_x)) / s_y) + zp_y``
    in float32 with ``expf``, rounding half away from zero; TANH the same with ``tanhf``;
  - HARD_SWISH: ``reference_ops::HardSwish``'s 16-bit fixed point (its
    multipliers are in the record), evaluated for each of the 256 inputs.
  - GELU: ``LUTPopulate`` of ``GeluTransform`` (erfc form) or, with
    ``params.approximate``, ``GeluTransformApproximate`` (tanh form), in float32.
  - RSQRT: ``RsqrtEvalQuantizedInt8``'s fixed point (``GetInvSqrtQuantizedMultiplierExp``,
    then two ``MultiplyByQuantizedMultiplier``; the output multiplier is in the record);
  - NEG, which TFLite runs in float between a DEQUANTIZE and a QUANTIZE: those three
    steps as its reference kernels compute them.

* ``batch_matmul`` -- BATCH_MATMUL of two int8 activations: int32 sums of
  ``(a - zp_a) * (b - zp_b)``, then ``MultiplyByQuantizedMultiplier`` (``operands``: the
  layer input of each operand; ``transpose``: the adjoint flags, axes applied to it);
* ``resize_bilinear`` -- RESIZE_BILINEAR: ``reference_ops::ResizeBilinearInteger``
  (sizes and coordinate mode in the record);
* ``requantize`` -- int8 RELU/RELU6/RELU_N1_TO_1 and int8 -> int8 QUANTIZE:
  ``clamp(MultiplyByQuantizedMultiplier(x - zp_x) + zp_y)``;
* ``squared_difference`` -- SQUARED_DIFFERENCE (keras' LayerNormalization): both inputs
  shifted left by 7 and scaled to twice the larger scale, the difference squared, then
  ``MultiplyByQuantizedMultiplier`` by ``(2 s_max)^2 / (2^14 s_y)``;
* ``mul`` -- MUL: ``MultiplyByQuantizedMultiplier((x1 - zp1) * (x2 - zp2), M, shift) + zp_y``
  with ``M, shift = QuantizeMultiplier(s1 * s2 / s_y)`` (the quotient in float32, as mul.cc has it); an
  int8 constant operand is in the record (``constants``: operand index -> values, shape).

:data:`SPANS` maps the float Relax op between dequantize and quantize to its
realization; :data:`RECOMPUTE` maps each kind to its recompute (the scheme's
``Quantizer.recompute`` holds them).
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Callable

import numpy as np

from irgen.plugin import round_half_away

SCHEME = "tflite-int8"


# ------------------------------------------------------------------ numpy kernels


def lut_populate(fn: Callable[[np.ndarray], np.ndarray], s_in: float, zp_in: int, s_out: float, zp_out: int,
                 dtype: str = "int8") -> np.ndarray:
    """TFLite's ``LUTPopulate`` for an 8-bit type: the output for every input value
    ``v`` (index ``v - min``), float32 arithmetic throughout: ``int32(round(f(x) / s) + zp)``
    clamped, the float-to-int32 conversion as x86 makes it (``cvttss2si``: a value beyond
    int32, an infinity or a NaN becomes INT32_MIN, so ``log(0)`` and an ``exp`` past int32
    give the type's minimum)."""
    info = np.iinfo(dtype)
    v = np.arange(int(info.min), int(info.max) + 1, dtype=np.int64)
    deq = np.float32(s_in) * (v - zp_in).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        transformed = fn(deq).astype(np.float32)
        q = round_half_away(transformed * (np.float32(1.0) / np.float32(s_out))) + np.float32(zp_out)
        inside = np.isfinite(q) & (q >= np.float32(-2.0 ** 31)) & (q < np.float32(2.0 ** 31))
        q32 = np.where(inside, np.where(inside, q, 0).astype(np.int64), -(2 ** 31))
    return np.clip(q32, info.min, info.max).astype(dtype)


def sigmoid_f32(x: np.ndarray) -> np.ndarray:
    """``1.0f / (1.0f + expf(-x))``; expf correctly rounded (glibc's)."""
    e = np.array([math.exp(-float(a)) if -float(a) < 88.8 else math.inf for a in np.asarray(x, np.float32).reshape(-1)])
    e = e.astype(np.float32).reshape(np.shape(x))
    with np.errstate(over="ignore"):
        return (np.float32(1.0) / (np.float32(1.0) + e)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def libm_float(name: str) -> Callable[[float], float] | None:
    """C's float function ``name`` (``tanhf``, ``erfcf``) from the C library of this process,
    the one TFLite's kernels call through ``std::tanh(float)``; None where it cannot be loaded.
    glibc's are not all correctly rounded (2.36's ``tanhf`` is not in 18% of [-3, 3]), and a
    table entry rounds differently where they differ."""
    import ctypes
    import ctypes.util

    try:
        f = getattr(ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6"), name)
    except (OSError, AttributeError):
        return None
    f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    return f


def _exp(v: float) -> float:
    return math.exp(v) if v < 709.0 else math.inf


def _log(v: float) -> float:
    return math.log(v) if v > 0 else (-math.inf if v == 0 else math.nan)


def _f32_map(fn: Callable[[float], float], x: np.ndarray, cname: str) -> np.ndarray:
    """The float overload C++ calls (``cname``: ``erfcf``, ``tanhf``, from :func:`libm_float`)
    on each float32 value; where the C library cannot be loaded, ``fn`` (the double function)
    rounded to float32."""
    x = np.asarray(x, np.float32)
    c = libm_float(cname)
    if c is not None:
        return np.array([c(float(a)) for a in x.reshape(-1)], np.float32).reshape(x.shape)
    return np.array([fn(float(a)) for a in x.reshape(-1)], np.float64).astype(np.float32).reshape(x.shape)


def gelu_f32(x: np.ndarray) -> np.ndarray:
    """TFLite's ``GeluTransform``: ``0.5f * x * erfc(x * float(-M_SQRT1_2))`` in float32."""
    x = np.asarray(x, np.float32)
    return (np.float32(0.5) * x) * _f32_map(math.erfc, x * np.float32(-0.7071067811865476), "erfcf")


#: TFLite's ``kSqrt2dPi``: ``M_2_SQRTPI * M_SQRT1_2`` as a float constant
_SQRT_2_OVER_PI = np.float32(1.1283791670955126 * 0.7071067811865476)


def gelu_tanh_f32(x: np.ndarray) -> np.ndarray:
    """TFLite's ``GeluTransformApproximate``:
    ``0.5f * x * (1.f + tanh(kSqrt2dPi * (x + 0.044715f * x * x * x)))`` in float32."""
    x = np.asarray(x, np.float32)
    inner = _SQRT_2_OVER_PI * (x + np.float32(0.044715) * x * x * x)
    return (np.float32(0.5) * x) * (np.float32(1.0) + _f32_map(math.tanh, inner, "tanhf"))


#: lut function -> its float32 transform (TFLite's ``LUTPopulate`` then tabulates it); GELU
#: with ``params.approximate`` is ``gelu_tanh``
FUNCTIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"logistic": sigmoid_f32, "gelu": gelu_f32,
                                                            "gelu_tanh": gelu_tanh_f32,
                                                            "tanh": lambda x: _f32_map(math.tanh, x, "tanhf"),
                                                            "exp": lambda x: _f32_map(_exp, x, "expf"),
                                                            "log": lambda x: _f32_map(_log, x, "logf")}


def _srdhm16(a, b):
    """gemmlowp's SaturatingRoundingDoublingHighMul on int16."""
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    ab = a * b
    nudge = np.where(ab >= 0, 1 << 14, 1 - (1 << 14))
    s = ab + nudge
    r = np.where(s < 0, -((-s) >> 15), s >> 15)  # C division truncates
    return np.where((a == b) & (a == -32768), 32767, r)


def _sdhm16(a, b):
    """TFLite's SaturatingDoublingHighMul on int16 (truncating, no rounding)."""
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    ab = a * b
    r = np.where(ab < 0, -((-ab) >> 15), ab >> 15)
    return np.where((a == b) & (a == -32768), 32767, r)


def _sat_left_shift16(v, amount: int):
    return np.clip(np.asarray(v, np.int64) * (1 << amount), -32768, 32767)


def _rounding_divide_by_pot(x, exponent: int):
    x = np.asarray(x, np.int64)
    mask = (1 << exponent) - 1
    remainder = x & mask
    threshold = (mask >> 1) + (x < 0)
    return (x >> exponent) + (remainder > threshold)


def _downscale_to_int16(m32: int) -> int:
    """TFLite's DownScaleInt32ToInt16Multiplier."""
    if m32 >= 2**31 - 1 - (1 << 15):
        return 32767
    return (m32 + (1 << 15)) >> 16


def hard_swish_params(s_in: float, s_out: float) -> dict[str, int]:
    """HardSwishPrepare's fixed-point parameters (float32 scales, as TFLite)."""
    from irgen.plugin import quantize_multiplier

    hires = np.float32(1.0 / 128.0) * np.float32(s_in)
    out_m, out_e = quantize_multiplier(float(np.float32(hires / np.float32(s_out))))
    relu_m, relu_e = quantize_multiplier(float(np.float32(hires / np.float32(3.0 / 32768.0))))
    return {"output_multiplier_int16": _downscale_to_int16(out_m), "output_exponent": int(out_e),
            "reluish_multiplier_int16": _downscale_to_int16(relu_m), "reluish_exponent": int(relu_e)}


def hard_swish(x, zp_in: int, zp_out: int, p: dict[str, int], dtype: str = "int8") -> np.ndarray:
    """``reference_ops::HardSwish`` on 8-bit values."""
    info = np.iinfo(dtype)
    v = np.asarray(x, np.int64) - zp_in
    hires = v * (1 << 7)
    pre_out = _srdhm16(hires, p["output_multiplier_int16"])
    reluish = hires
    e = p["reluish_exponent"]
    if e > 0:
        reluish = _sat_left_shift16(reluish, e - 1)
    reluish = _srdhm16(reluish, p["reluish_multiplier_int16"])
    if e > 0:
        reluish = _sat_left_shift16(reluish, 1)
    if e < 0:
        reluish = _rounding_divide_by_pot(reluish, -e)
    reluish = (reluish + (1 << 15)) >> 1
    y = _sdhm16(reluish, pre_out)
    y = _rounding_divide_by_pot(y, -p["output_exponent"]) + zp_out
    return np.clip(y, info.min, info.max).astype(dtype)


_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


def _srdhm32(a: int, b: int) -> int:
    """gemmlowp's SaturatingRoundingDoublingHighMul on int32 (Python ints)."""
    if a == b == _I32_MIN:
        return _I32_MAX
    ab = a * b
    s = ab + ((1 << 30) if ab >= 0 else 1 - (1 << 30))
    return -((-s) >> 31) if s < 0 else s >> 31  # C++ division truncates


def _sat_mul_pot32(x: int, exponent: int) -> int:
    """gemmlowp's SaturatingRoundingMultiplyByPOT<exponent> on int32."""
    if exponent < 0:
        return int(_rounding_divide_by_pot(x, -exponent))
    threshold = (1 << (31 - exponent)) - 1
    return _I32_MAX if x > threshold else _I32_MIN if x < -threshold else x << exponent


def inv_sqrt_multiplier(value: int) -> tuple[int, int]:
    """TFLite's ``GetInvSqrtQuantizedMultiplierExp(value, kReverseShift)``: 1/sqrt(value) as
    a multiplier and (left) shift, by 5 Newton-Raphson steps in gemmlowp fixed point
    (``F3``: 3 integer bits)."""
    if value <= 1:
        return _I32_MAX, 0
    shift = 11
    while value >= (1 << 29):
        value //= 4
        shift += 1
    pairs = ((32 - value.bit_length()) - 1) // 2 - 1  # CountLeadingZeros - 1, in bit pairs, less one
    shift -= pairs
    value <<= 2 * pairs
    half_input = _sat_mul_pot32(value >> 1, -1)
    half_three = (1 << 28) + (1 << 27)
    x = 1 << 28  # F3::One()
    for _ in range(5):
        x3 = _sat_mul_pot32(_srdhm32(_srdhm32(x, x), x), 6)  # Rescale<3> of an F9
        x = _sat_mul_pot32(_srdhm32(half_three, x) - _srdhm32(half_input, x3), 3)  # Rescale<3> of an F6
    x = _srdhm32(x, 1518500250)  # * sqrt(2)/2 in F0
    if shift < 0:
        x <<= -shift
        shift = 0
    return x, -shift


def rsqrt_params(s_in: float, s_out: float) -> dict[str, int]:
    """TFLite's SetRsqrtOutputMultiplier: ``QuantizeMultiplier(1. / (sqrtf(s_in) * s_out))``."""
    from irgen.plugin import quantize_multiplier

    m, shift = quantize_multiplier(1.0 / float(np.sqrt(np.float32(s_in)) * np.float32(s_out)))
    return {"multiplier": int(m), "shift": int(shift)}


def rsqrt_int8(v, zp_in: int, zp_out: int, p: dict[str, int], dtype: str = "int8") -> np.ndarray:
    """TFLite's int8 RSQRT (``RsqrtEvalQuantizedInt8``) of each value: ``1/sqrt(v - zp_in)`` as
    an inverse-sqrt multiplier applied to 1 with 20 bits of headroom, then requantized. An
    input below the zero point, which TFLite refuses, is taken as the zero point (the maximum)."""
    from irgen.plugin import DOUBLE, multiply_by_quantized_multiplier as mbqm

    info = np.iinfo(dtype)
    out = []
    for value in (int(a) - zp_in for a in np.asarray(v).reshape(-1)):
        if value <= 0:
            out.append(int(info.max))
            continue
        m, shift = inv_sqrt_multiplier(value)
        data = int(mbqm(1, m, shift + 20, DOUBLE))
        y = int(mbqm(data, p["multiplier"], p["shift"] - 20, DOUBLE)) + zp_out
        out.append(min(max(y, int(info.min)), int(info.max)))
    return np.array(out, dtype).reshape(np.shape(v))


#: float ops TFLite leaves between a DEQUANTIZE and a QUANTIZE of int8 tensors (NEG has no int8
#: kernel; keras' LayerNormalization negates its mean in float): the exact float32 function
ISLANDS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"negative": np.negative}


def island_table(fn: Callable[[np.ndarray], np.ndarray], s_in: float, zp_in: int, s_out: float, zp_out: int,
                 dtype: str = "int8") -> np.ndarray:
    """DEQUANTIZE -> ``fn`` -> QUANTIZE as TFLite's reference kernels compute it, for every input
    value: ``float(double(s_in) * (v - zp_in))``, ``fn`` in float32, then ``round(double(y) /
    double(s_out)) + zp_out`` (half away from zero), clamped."""
    info = np.iinfo(dtype)
    v = np.arange(int(info.min), int(info.max) + 1, dtype=np.int64)
    deq = (np.float64(np.float32(s_in)) * (v - zp_in)).astype(np.float32)
    y = np.asarray(fn(deq), np.float32).astype(np.float64) / np.float64(np.float32(s_out))
    return np.clip(round_half_away(y).astype(np.int64) + zp_out, info.min, info.max).astype(dtype)


def lut_table(qr: dict[str, Any]) -> np.ndarray:
    """The table of a ``lut`` record, from its function and parameters."""
    qi, qo = qr["inputs"][0], qr["output"]
    zp_in, zp_out = int(qi["zero_point"]), int(qo["zero_point"])
    if qr["function"] in ("hard_swish", "rsqrt"):
        info = np.iinfo(qo["dtype"])
        kernel = hard_swish if qr["function"] == "hard_swish" else rsqrt_int8
        return kernel(np.arange(int(info.min), int(info.max) + 1), zp_in, zp_out, qr["params"], qo["dtype"])
    fn = qr["function"]
    if fn in ISLANDS:
        return island_table(ISLANDS[fn], qi["scale"], zp_in, qo["scale"], zp_out, qo["dtype"])
    if fn == "gelu" and (qr.get("params") or {}).get("approximate"):
        fn = "gelu_tanh"
    return lut_populate(FUNCTIONS[fn], qi["scale"], zp_in, qo["scale"], zp_out, qo["dtype"])


def recompute_lut(layer, inputs, params) -> np.ndarray:
    qr = layer["quant"]
    lo = np.iinfo(qr["inputs"][0]["dtype"]).min
    return lut_table(qr)[inputs[0].astype(np.int64) - lo]


def operands(qr: dict[str, Any], inputs: list[np.ndarray]) -> list[np.ndarray]:
    """The operands of a layer: its inputs, with the integer constants the record
    holds (``constants``: operand index -> values and shape) in their places."""
    consts = qr.get("constants") or {}
    picks = qr.get("operands")  # operand k is layer input picks[k] (one tensor read twice: x + x)
    it = iter(inputs)
    out = []
    for k, q in enumerate(qr["inputs"]):
        c = consts.get(str(k))
        if c is not None:
            out.append(np.asarray(c["values"], q["dtype"]).reshape(c["shape"]))
        else:
            out.append(inputs[picks[k]] if picks else next(it))
    return out


def operands_record(*operands) -> list[int | None] | None:
    """``operands`` of a record when one tensor is read by several operands (``x + x``,
    ``x * x``; the layer has it as one input): operand k -> layer input index (None
    for a constant); None when every tensor operand is a layer input of its own."""
    from tvm import relax

    names: list[str] = []
    picks: list[int | None] = []
    for x in operands:
        if not isinstance(x, relax.Var):
            picks.append(None)
            continue
        if x.name not in names:
            names.append(x.name)
        picks.append(names.index(x.name))
    return picks if len(names) < sum(p is not None for p in picks) else None


def _constant_record(value) -> dict[str, Any]:
    arr = np.asarray(value.value.numpy())
    return {"values": arr.reshape(-1).tolist(), "shape": list(arr.shape)}


def add_operand_records(rec: dict[str, Any], *operands) -> dict[str, Any]:
    """``rec`` with its ``constants`` (:func:`constants_record`) and ``operands``
    (:func:`operands_record`) entries, each only when there is something to say."""
    consts, picks = constants_record(*operands), operands_record(*operands)
    if consts:
        rec["constants"] = consts
    if picks:
        rec["operands"] = picks
    return rec


def constants_record(*operands) -> dict[str, Any]:
    """``constants`` of a record: operand index -> values and shape of each constant operand."""
    from tvm import relax

    return {str(k): _constant_record(x) for k, x in enumerate(operands) if not isinstance(x, relax.Var)}


def recompute_add(layer, inputs, params) -> np.ndarray:
    """TFLite's general int8 ADD (the core record: ``left_shift``, input and output
    multipliers), with the record's constant operands in place; also SUB, whose record
    holds the second input's multiplier negated."""
    from irgen.plugin import multiply_by_quantized_multiplier as mbqm

    qr = layer["quant"]
    rq, out = qr["requant"], qr["output"]
    scaled = [mbqm((x.astype(np.int64) - int(q["zero_point"])) << rq["left_shift"], m, s, rq["rounding"])
              for x, q, m, s in zip(operands(qr, inputs), qr["inputs"], rq["input_multiplier"], rq["input_shift"])]
    y = mbqm(scaled[0] + scaled[1], rq["multiplier"], rq["shift"], rq["rounding"])
    lo, hi = qr["clamp"]
    return np.clip(y + int(out["zero_point"]), lo, hi).astype(out["dtype"])


def recompute_mul(layer, inputs, params) -> np.ndarray:
    from irgen.plugin import multiply_by_quantized_multiplier

    qr = layer["quant"]
    rq, out = qr["requant"], qr["output"]
    a, b = (x.astype(np.int64) - int(q["zero_point"]) for x, q in zip(operands(qr, inputs), qr["inputs"]))
    y = multiply_by_quantized_multiplier(a * b, rq["multiplier"], rq["shift"], rq["rounding"])
    lo, hi = qr["clamp"]
    return np.clip(y + int(out["zero_point"]), lo, hi).astype(out["dtype"])


def _interpolation_integer(size_in: int, size_out: int, align_corners: bool, half_pixel: bool):
    """TFLite's ComputeInterpolationValuesInteger for every output index: the
    scaled source position (10 fractional bits) and its lower and upper rows."""
    scale = ((1 << 10) * size_in + size_out // 2) // size_out
    if align_corners and size_out > 1:
        scale = ((1 << 10) * (size_in - 1) + (size_out - 1) // 2) // (size_out - 1)
    v = np.arange(size_out, dtype=np.int64)
    pos = v * scale + (scale // 2 - (1 << 9) if half_pixel else 0)
    lower = np.maximum(np.where(pos < 0, -((-pos) >> 10), pos >> 10), 0)  # C division truncates
    up = pos + (1 << 10) - 1
    upper = np.minimum(np.where(up < 0, -((-up) >> 10), up >> 10), size_in - 1)
    return pos, lower, upper


def resize_bilinear_tables(qr: dict[str, Any]):
    """Per axis (H, W): lower index, upper index, weight of the upper (10 bits)."""
    out = []
    for n_in, n_out in zip(qr["resize"]["input_size"], qr["resize"]["output_size"]):
        pos, lo, hi = _interpolation_integer(n_in, n_out, qr["resize"]["align_corners"], qr["resize"]["half_pixel_centers"])
        out.append((lo, hi, pos - (lo << 10)))
    return out


def recompute_resize_bilinear(layer, inputs, params) -> np.ndarray:
    """``reference_ops::ResizeBilinearInteger`` (NHWC): the four neighbours weighted
    in 20 fractional bits, ``(sum + sign * 2**19) / 2**20`` truncated."""
    qr = layer["quant"]
    x = inputs[0].astype(np.int64)
    (y0, y1, dy), (x0, x1, dx) = resize_bilinear_tables(qr)
    one = 1 << 10
    wy0, wy1 = (one - dy)[:, None, None], dy[:, None, None]
    wx0, wx1 = (one - dx)[None, :, None], dx[None, :, None]
    rows0, rows1 = x[:, y0], x[:, y1]
    acc = (rows0[:, :, x0] * wy0 * wx0 + rows1[:, :, x0] * wy1 * wx0
           + rows0[:, :, x1] * wy0 * wx1 + rows1[:, :, x1] * wy1 * wx1)
    acc = acc + np.where(acc > 0, 1 << 19, -(1 << 19))
    y = np.where(acc < 0, -((-acc) >> 20), acc >> 20)
    return y.astype(qr["output"]["dtype"])


def recompute_batch_matmul(layer, inputs, params) -> np.ndarray:
    """``reference_ops::BatchMatMul`` on int8: int32 sums of ``(a - zp_a) * (b - zp_b)``, requantized."""
    from irgen.plugin import multiply_by_quantized_multiplier

    qr = layer["quant"]
    rq, out = qr["requant"], qr["output"]
    picked = [inputs[k] for k in qr.get("operands") or (0, 1)]  # operand k is layer input operands[k]
    a, b = (x.astype(np.int64) - int(q["zero_point"]) for x, q in zip(picked, qr["inputs"]))
    ta, tb = qr.get("transpose") or (None, None)  # operand k = layer input k permuted by these axes
    a, b = (x if t is None else np.transpose(x, t) for x, t in ((a, ta), (b, tb)))
    y = multiply_by_quantized_multiplier(np.matmul(a, b), rq["multiplier"], rq["shift"], rq["rounding"])
    lo, hi = qr["clamp"]
    return np.clip(y + int(out["zero_point"]), lo, hi).astype(out["dtype"])


def recompute_squared_difference(layer, inputs, params) -> np.ndarray:
    """TFLite's int8 SQUARED_DIFFERENCE from its record."""
    from irgen.plugin import multiply_by_quantized_multiplier as mbqm

    qr = layer["quant"]
    rq, out = qr["requant"], qr["output"]
    a, b = (mbqm((x.astype(np.int64) - int(q["zero_point"])) << rq["left_shift"], m, s, rq["rounding"])
            for x, q, m, s in zip(operands(qr, inputs), qr["inputs"], rq["input_multiplier"], rq["input_shift"]))
    y = mbqm((a - b) * (a - b), rq["multiplier"], rq["shift"], rq["rounding"])
    lo, hi = qr["clamp"]
    return np.clip(y + int(out["zero_point"]), lo, hi).astype(out["dtype"])


RECOMPUTE: dict[str, Callable] = {"lut": recompute_lut, "mul": recompute_mul, "add": recompute_add,
                                  "subtract": recompute_add, "batch_matmul": recompute_batch_matmul,
                                  "squared_difference": recompute_squared_difference,
                                  "resize_bilinear": recompute_resize_bilinear}


# ------------------------------------------------------------------ Relax realizations


def _lut_layer(qg, qb, x, qx, out, function: str, drop: list[str], params: dict | None = None):
    """(names, expr, record) of a table lookup ``table[x - min]``."""
    from tvm import relax
    from tvm.relax import op

    import irgen.plugin as q
    from irgen.plugin import IrgenError

    if qx.dtype != out.dtype or qx.dtype not in ("int8", "uint8"):
        raise IrgenError(f"{SCHEME}: {function} {qb.name!r} maps {qx.dtype} to {out.dtype}; only 8-bit tables are realized")
    rec = {"scheme": SCHEME, "kind": "lut", "function": function, "inputs": [qx.record()], "output": out.record()}
    if params is not None:
        rec["params"] = params
    table = lut_table(rec)
    lo = int(np.iinfo(qx.dtype).min)
    idx = qg.emit(op.subtract(qg.emit(op.astype(x, "int32")), q.rx_const(lo, "int32")))
    expr = op.take(relax.const(table), idx, axis=0, mode="clip")
    rec["table"] = "parameter 'table' (256 entries): output for input value v at index v - min"
    return drop + [qb.name], expr, rec


def _unary_table(qg, qb, comp, out, act, helpers, function: str, what: str, params=None):
    """A unary op on one dequantized int8 tensor realized as the table of ``function``: the op's
    (names, expr, record); ``params(qx)`` gives the record's parameters from the input's."""
    from irgen.plugin import IrgenError

    if act is not None:
        raise IrgenError(f"{SCHEME}: a float activation after the {what} {qb.name!r}")
    x, qx, dqx = helpers.int8_input(qg, comp.value.args[0], f"input of the {what} {qb.name!r}")
    return _lut_layer(qg, qb, x, qx, out, function, [dqx, comp.name], None if params is None else params(qx))


def realize_logistic(qg, qb, comp, out, act, helpers):
    return _unary_table(qg, qb, comp, out, act, helpers, "logistic", "logistic")


def realize_tanh(qg, qb, comp, out, act, helpers):
    """TANH of an int8 tensor: TFLite's ``LUTPopulate`` of ``std::tanh`` in float32."""
    return _unary_table(qg, qb, comp, out, act, helpers, "tanh", "tanh")


def realize_gelu(qg, qb, comp, out, act, helpers):
    """GELU (``nn.gelu``, or ``nn.gelu_tanh`` for ``approximate``) on a dequantized int8
    tensor: TFLite's int8 kernel is a table of its float32 transform."""
    approximate = comp.op == "relax.nn.gelu_tanh"
    return _unary_table(qg, qb, comp, out, act, helpers, "gelu", "GELU", lambda qx: {"approximate": approximate})


def realize_exp_log(qg, qb, comp, out, act, helpers):
    """EXP or LOG of an int8 tensor: TFLite's int8 kernels are tables of ``std::exp(float)`` /
    ``std::log(float)`` (``LUTPopulate``), as LOGISTIC's and TANH's."""
    fn = comp.op.removeprefix("relax.")
    return _unary_table(qg, qb, comp, out, act, helpers, fn, fn)


def realize_rsqrt(qg, qb, comp, out, act, helpers):
    """RSQRT of an int8 tensor: TFLite's fixed-point kernel, tabulated for each input value."""
    return _unary_table(qg, qb, comp, out, act, helpers, "rsqrt", "rsqrt",
                        lambda qx: rsqrt_params(float(qx.scale[0]), float(out.scale[0])))


def realize_island(qg, qb, comp, out, act, helpers):
    """A float op between a DEQUANTIZE and a QUANTIZE of int8 tensors (:data:`ISLANDS`): a
    function of the 256 input values, tabulated as TFLite computes each step."""
    fn = comp.op.removeprefix("relax.")
    return _unary_table(qg, qb, comp, out, act, helpers, fn, fn)


def _const_float(expr) -> float | None:
    """The value of a scalar constant or PrimValue argument, else None."""
    v = getattr(expr, "value", None)
    if v is None:
        return None
    if hasattr(v, "numpy"):
        v = np.asarray(v.numpy())
        return float(v.reshape(-1)[0]) if v.size == 1 else None
    if hasattr(v, "value"):  # an IntImm / FloatImm
        v = v.value
    return float(v) if isinstance(v, (int, float)) else None


def realize_hard_swish(qg, qb, comp, out, act, helpers):
    """TVM's HARD_SWISH import: ``x * clip(x + 3, 0, 6) / 6`` on ``x = dequantize(int8)``."""
    from tvm import relax

    from irgen.plugin import IrgenError

    def fail():
        return IrgenError(f"{SCHEME}: cannot realize relax.divide at tensor {qb.name!r} in integer arithmetic "
                          "(only TFLite's HARD_SWISH pattern x * relu6(x + 3) / 6 is)")

    if act is not None or _const_float(comp.value.args[1]) != 6.0:
        raise fail()
    mul = qg.producer(comp.value.args[0])
    if mul is None or mul.op != "relax.multiply":
        raise fail()
    drop = [comp.name, mul.name]
    x_arg, clip = None, None
    for a, b in ((mul.value.args[0], mul.value.args[1]), (mul.value.args[1], mul.value.args[0])):
        c = qg.producer(b)
        if c is not None and c.op == "relax.clip":
            x_arg, clip = a, c
            break
    if clip is None or _const_float(clip.value.args[1]) != 0.0 or _const_float(clip.value.args[2]) != 6.0:
        raise fail()
    add = qg.producer(clip.value.args[0])
    if add is None or add.op != "relax.add" or _const_float(add.value.args[1]) != 3.0:
        raise fail()
    x, qx, dqx = helpers.int8_input(qg, x_arg, f"input of the hard swish {qb.name!r}")
    x2 = helpers.dequantized(qg, add.value.args[0])
    if x2 is None or not isinstance(x2[0], relax.Var) or x2[0].name != x.name:
        raise fail()
    if any(qg.n_users(n) != 1 for n in (mul.name, clip.name, add.name)):
        raise fail()
    drop += [clip.name, add.name]
    drop += sorted({dqx, x2[2]})
    params = hard_swish_params(float(qx.scale[0]), float(out.scale[0]))
    return _lut_layer(qg, qb, x, qx, out, "hard_swish", drop, params)


def _product_multiplier(q1, q2, out) -> tuple[int, int]:
    """TFLite's requantization of a product of two int8 operands: s1 * s2 / s_out as multiplier, shift."""
    import irgen.plugin as q

    real = np.float64(np.float32(q1.scale[0])) * np.float64(np.float32(q2.scale[0])) / np.float64(np.float32(out.scale[0]))
    return q.quantize_multiplier(float(real))


def _mul_multiplier(q1, q2, out) -> tuple[int, int]:
    """MUL's requantization (mul.cc, Prepare): ``s1 * s2 / s_out`` computed in float32 (the
    scales are floats), then QuantizeMultiplier of it as a double. The float32 product moves
    the 31-bit multiplier by a few hundred units from the double one: rarely visible with
    int8 operands, often with int16 ones (16x8)."""
    import irgen.plugin as q

    s1, s2, so = (np.float32(t.scale[0]) for t in (q1, q2, out))
    return q.quantize_multiplier(float(np.float32(np.float32(s1 * s2) / so)))


def realize_squared_difference(qg, qb, comp, diff, out, act, helpers):
    """SQUARED_DIFFERENCE of two int8 tensors (TVM imports it as ``d * d``, ``d = a - b`` of the
    dequantized inputs): each input shifted left by 7 and scaled to twice the larger input
    scale, the difference squared, then rescaled by ``(2 s_max)^2 / (2^14 s_y)``."""
    from tvm.relax import op

    import irgen.plugin as q
    from irgen.plugin import IrgenError

    ins = [helpers.operand(qg, a) for a in diff.value.args]
    if act is not None or any(i is None for i in ins):
        raise IrgenError(f"{SCHEME}: the squared difference {qb.name!r} is not of two dequantized int8 tensors")
    (x1, q1, d1), (x2, q2, d2) = ins
    left_shift = 7
    s1, s2 = np.float32(q1.scale[0]), np.float32(q2.scale[0])
    twice_max = np.float64(np.float32(2) * max(s1, s2))
    (m1, sh1), (m2, sh2) = (q.quantize_multiplier(float(np.float64(s) / twice_max)) for s in (s1, s2))
    mo, sho = q.quantize_multiplier(float(twice_max * twice_max / np.float64(np.float32(1 << 14) * np.float32(out.scale[0]))))
    ndim = len(comp.var.ty.shape.values)
    e, ls = qg.emit, q.rx_const(left_shift, "int32")
    a1 = q.rx_multiply_by_quantized_multiplier(e, e(op.left_shift(helpers.offset(qg, x1, int(q1.zero_point[0])), ls)),
                                               np.array([m1]), np.array([sh1]), -1, ndim)
    a2 = q.rx_multiply_by_quantized_multiplier(e, e(op.left_shift(helpers.offset(qg, x2, int(q2.zero_point[0])), ls)),
                                               np.array([m2]), np.array([sh2]), -1, ndim)
    d = e(op.subtract(a1, a2))
    y = q.rx_multiply_by_quantized_multiplier(e, e(op.multiply(d, d)), np.array([mo]), np.array([sho]), -1, ndim)
    lo, hi, last = helpers.clamp(qg, qb.name, out.dtype, act, out)
    rec = {"scheme": SCHEME, "kind": "squared_difference", "inputs": [q1.record(), q2.record()], "output": out.record(),
           "requant": {"left_shift": left_shift, "input_multiplier": [int(m1), int(m2)],
                       "input_shift": [int(sh1), int(sh2)], "multiplier": int(mo), "shift": int(sho),
                       "rounding": q.DOUBLE, "rounding_rule": q.ROUNDING_RULES[q.DOUBLE]},
           "clamp": [lo, hi]}
    add_operand_records(rec, x1, x2)
    drop = [d_ for d_ in (d1, d2) if d_ is not None] + [diff.name, comp.name]
    return drop + helpers.tail(qb, act, last), helpers.finish(qg, y, out, lo, hi), rec


def realize_mul(qg, qb, comp, out, act, helpers):
    from tvm import relax
    from tvm.relax import op

    import irgen.plugin as q
    from irgen.plugin import IrgenError

    a, b = comp.value.args
    diff = qg.producer(a) if isinstance(a, relax.Var) and isinstance(b, relax.Var) and a.name == b.name else None
    if diff is not None and diff.op == "relax.subtract" and qg.n_users(diff.name) == 2:
        return realize_squared_difference(qg, qb, comp, diff, out, act, helpers)
    ins = [helpers.operand(qg, a) for a in comp.value.args]
    if any(i is None for i in ins):
        raise IrgenError(f"{SCHEME}: an input of the multiply {qb.name!r} is not a dequantized int8 tensor")
    (x1, q1, d1), (x2, q2, d2) = ins
    mult, shift = _mul_multiplier(q1, q2, out)
    ndim = len(comp.var.ty.shape.values)
    prod = qg.emit(op.multiply(helpers.offset(qg, x1, int(q1.zero_point[0])), helpers.offset(qg, x2, int(q2.zero_point[0]))))
    y = q.rx_multiply_by_quantized_multiplier(qg.emit, prod, np.array([mult]), np.array([shift]), -1, ndim)
    lo, hi, last = helpers.clamp(qg, qb.name, out.dtype, act, out)
    rec = {
        "scheme": SCHEME,
        "kind": "mul",
        "inputs": [q1.record(), q2.record()],
        "output": out.record(),
        "requant": {"multiplier": int(mult), "shift": int(shift), "rounding": q.DOUBLE,
                    "rounding_rule": q.ROUNDING_RULES[q.DOUBLE],
                    "note": "y = MultiplyByQuantizedMultiplier((x1 - zp1) * (x2 - zp2)) + zp_y; "
                            "M, shift = QuantizeMultiplier(double(float32(s1 * s2) / s_y)), float32 arithmetic"},
        "clamp": [lo, hi],
    }
    add_operand_records(rec, x1, x2)
    drop = [d for d in (d1, d2) if d is not None] + [comp.name]
    return drop + helpers.tail(qb, act, last), helpers.finish(qg, y, out, lo, hi), rec


def realize_resize_bilinear(qg, qb, comp, out, act, helpers):
    """TVM's RESIZE_BILINEAR import (dequantize -> image.resize2d linear -> quantize)
    as TFLite's integer kernel: gathers of the neighbour rows and columns, int64
    weights, rounding division by 2**20."""
    from tvm import relax
    from tvm.relax import op

    import irgen.plugin as q
    from irgen.plugin import IrgenError

    a = comp.value.attrs
    x, qx, dqx = helpers.int8_input(qg, comp.value.args[0], f"input of the resize {qb.name!r}")
    mode = str(a.coordinate_transformation_mode)
    if act is not None or str(a.method) != "linear" or str(a.layout) != "NHWC" \
            or mode not in ("half_pixel", "align_corners", "asymmetric"):
        raise IrgenError(f"{SCHEME}: resize {qb.name!r} ({a.method}, {mode}, {a.layout}) is not TFLite's RESIZE_BILINEAR")
    if qx.scale[0] != out.scale[0] or qx.zero_point[0] != out.zero_point[0] or qx.dtype != out.dtype:
        raise IrgenError(f"{SCHEME}: resize {qb.name!r} changes quantization parameters; TFLite's int8 kernel keeps them")
    n, h, w, c = (int(d) for d in x.ty.shape.values)
    oh, ow = (int(d) for d in comp.var.ty.shape.values[1:3])
    rec = {"scheme": SCHEME, "kind": "resize_bilinear", "inputs": [qx.record()], "output": out.record(),
           "resize": {"input_size": [h, w], "output_size": [oh, ow], "align_corners": mode == "align_corners",
                      "half_pixel_centers": mode == "half_pixel", "layout": "NHWC",
                      "rule": "TFLite ResizeBilinearInteger: 10-bit source positions, four neighbours weighted "
                              "in 20 bits, (sum + sign * 2**19) / 2**20 truncated"}}
    (y0, y1, dy), (x0, x1, dx) = resize_bilinear_tables(rec)
    one = 1 << 10
    e = qg.emit
    xi = e(op.astype(x, "int64"))

    def gather(rows, cols):
        t = e(op.take(xi, relax.const(rows.astype(np.int32)), axis=1, mode="clip"))  # in range: clip is a no-op
        return e(op.take(t, relax.const(cols.astype(np.int32)), axis=2, mode="clip"))

    def weight(wy, wx):
        return q.rx_const((wy[:, None, None] * wx[None, :, None]).reshape(1, oh, ow, 1), "int64")

    terms = [e(op.multiply(gather(ry, cx), weight(wy, wx)))
             for ry, wy in ((y0, one - dy), (y1, dy)) for cx, wx in ((x0, one - dx), (x1, dx))]
    acc = e(op.add(e(op.add(terms[0], terms[1])), e(op.add(terms[2], terms[3]))))
    half = e(op.where(e(op.greater(acc, q.rx_const(0, "int64"))), q.rx_const(1 << 19, "int64"), q.rx_const(-(1 << 19), "int64")))
    y = e(op.divide(e(op.add(acc, half)), q.rx_const(1 << 20, "int64")))  # integer divide truncates
    expr = op.astype(y, out.dtype)
    return [dqx, comp.name, qb.name], expr, rec


def realize_batch_matmul(qg, qb, comp, out, act, helpers):
    """A matmul of two dequantized int8 activations (TFLite BATCH_MATMUL)."""
    from tvm.relax import op

    import irgen.plugin as q
    from irgen.plugin import IrgenError

    ins = [helpers.dequantized(qg, a) for a in comp.value.args]
    if any(i is None for i in ins):
        raise IrgenError(f"{SCHEME}: an input of the batch matmul {qb.name!r} is not a dequantized int8 tensor")
    (x1, q1, d1), (x2, q2, d2) = ins
    mult, shift = _product_multiplier(q1, q2, out)
    ndim = len(comp.var.ty.shape.values)
    # an adjoint flag: the importer's unnamed transpose of an int8 operand joins this layer
    # (operand a is emitted first, so that the layer's inputs are a, then b)
    operands, axes, absorbed, sources = [], [], [], []
    for x, qx in ((x1, q1), (x2, q2)):
        p = qg.producer(x)
        if p is not None and p.op == "relax.permute_dims" and re.fullmatch(r"lv\d*", p.name) and qg.n_users(p.name) == 1:
            perm = [int(a) for a in p.value.attrs.axes]
            src = p.value.args[0]
            x = qg.emit(op.permute_dims(src, perm))
            axes.append(perm)
            absorbed.append(p.name)
        else:
            src = x
            axes.append(None)
        sources.append(getattr(src, "name", None))
        operands.append(helpers.offset(qg, x, int(qx.zero_point[0])))
    # int16 operands (16x8): TFLite's BatchMatMul<int16_t, int64_t> sums in int64 and rescales with
    # the int64 MultiplyByQuantizedMultiplier
    wide = out.dtype == "int16"
    rounding = q.WIDE if wide else BATCH_MATMUL_ROUNDING
    acc = qg.emit(op.matmul(operands[0], operands[1], out_dtype="int64" if wide else "int32"))
    y = q.rx_multiply_by_quantized_multiplier(qg.emit, acc, np.array([mult]), np.array([shift]), -1, ndim, rounding)
    lo, hi, last = helpers.clamp(qg, qb.name, out.dtype, act, out)
    rec = {
        "scheme": SCHEME,
        "kind": "batch_matmul",
        "inputs": [q1.record(), q2.record()],
        "transpose": axes,
        "operands": [0, 0] if sources[0] == sources[1] else [0, 1],
        "output": out.record(),
        "requant": {"multiplier": int(mult), "shift": int(shift), "rounding": rounding,
                    "rounding_rule": q.ROUNDING_RULES[rounding]},
        "clamp": [lo, hi],
    }
    drop = absorbed + [d for d in (d1, d2) if qg.n_users(d) == 1] + [comp.name]
    return drop + helpers.tail(qb, act, last), helpers.finish(qg, y, out, lo, hi), rec


BATCH_MATMUL_ROUNDING = "double"


def recompute_requantize(layer, inputs, params) -> np.ndarray:
    from irgen.plugin import multiply_by_quantized_multiplier

    qr = layer["quant"]
    rq, out = qr["requant"], qr["output"]
    x = inputs[0].astype(np.int64) - int(qr["inputs"][0]["zero_point"])
    y = multiply_by_quantized_multiplier(x, rq["multiplier"], rq["shift"], rq["rounding"])
    lo, hi = qr["clamp"]
    return np.clip(y + int(out["zero_point"]), lo, hi).astype(out["dtype"])


RECOMPUTE["requantize"] = recompute_requantize


def by_sign_multipliers(s_in: float, alpha_scale: float, s_out: float) -> tuple[tuple[int, int], tuple[int, int]]:
    """LeakyReluPrepare and PreluPrepare: QuantizeMultiplier of ``s_in / s_out`` (identity) and of
    ``s_in * alpha_scale / s_out`` (LEAKY_RELU: its alpha; PRELU: the alpha tensor's scale), each
    quotient in float32 (the scales and alpha are floats)."""
    from irgen.plugin import quantize_multiplier

    s_in, alpha_scale, s_out = np.float32(s_in), np.float32(alpha_scale), np.float32(s_out)
    return (quantize_multiplier(float(np.float32(s_in / s_out))),
            quantize_multiplier(float(np.float32(np.float32(s_in * alpha_scale) / s_out))))


def _by_sign(qg, qb, x, qx, out, kind: str, scale_of_alpha: float, alpha=None, helpers=None):
    """The realization LEAKY_RELU and PRELU share: ``x - zp_x`` rescaled by the identity
    multiplier where it is not negative, else (times ``alpha - zp_a`` for PRELU's integer alpha
    tensor) by the alpha multiplier, plus ``zp_y``, saturated. (expr, record, last name)."""
    from tvm.relax import op

    import irgen.plugin as q

    (mi, si), (ma, sa) = by_sign_multipliers(float(qx.scale[0]), scale_of_alpha, float(out.scale[0]))
    ndim = len(qb.var.ty.shape.values)
    e = qg.emit
    xs = helpers.offset(qg, x, int(qx.zero_point[0]))
    neg_in = xs if alpha is None else e(op.multiply(xs, helpers.offset(qg, alpha[0], int(alpha[1].zero_point[0]))))
    pos = q.rx_multiply_by_quantized_multiplier(e, xs, np.array([mi]), np.array([si]), -1, ndim)
    neg = q.rx_multiply_by_quantized_multiplier(e, neg_in, np.array([ma]), np.array([sa]), -1, ndim)
    y = e(op.where(e(op.greater_equal(xs, q.rx_const(0, "int32"))), pos, neg))
    lo, hi, last = helpers.clamp(qg, qb.name, out.dtype)
    negative = "(x - zp_x) * (alpha - zp_a)" if alpha is not None else "x - zp_x"
    rec = {"scheme": SCHEME, "kind": kind, "inputs": [qx.record()] + ([alpha[1].record()] if alpha else []),
           "output": out.record(),
           "requant": {"identity": {"multiplier": int(mi), "shift": int(si)},
                       "alpha": {"multiplier": int(ma), "shift": int(sa)}, "rounding": q.DOUBLE,
                       "rounding_rule": f"y = zp_y + MultiplyByQuantizedMultiplier(x - zp_x, identity) if x >= zp_x, "
                                        f"else zp_y + MultiplyByQuantizedMultiplier({negative}, alpha); identity = "
                                        "QuantizeMultiplier(s_x / s_y), alpha = QuantizeMultiplier(s_x * "
                                        f"{'s_a' if alpha is not None else 'alpha'} / s_y), float32 quotients"},
           "clamp": [lo, hi]}
    return helpers.finish(qg, y, out, lo, hi), rec, last


def recompute_by_sign(layer, inputs, params) -> np.ndarray:
    """LEAKY_RELU and PRELU (whose second operand, the alpha tensor, multiplies the negatives)."""
    from irgen.plugin import multiply_by_quantized_multiplier as mbqm

    qr = layer["quant"]
    rq, out = qr["requant"], qr["output"]
    ops = [v.astype(np.int64) - int(t["zero_point"]) for v, t in zip(operands(qr, inputs), qr["inputs"])]
    x = ops[0]
    pos = mbqm(x, rq["identity"]["multiplier"], rq["identity"]["shift"], rq["rounding"])
    neg = mbqm(x * ops[1] if len(ops) > 1 else x, rq["alpha"]["multiplier"], rq["alpha"]["shift"], rq["rounding"])
    lo, hi = qr["clamp"]
    return np.clip(np.where(x >= 0, pos, neg) + int(out["zero_point"]), lo, hi).astype(out["dtype"])


def realize_leaky_relu(qg, qb, comp, out, act, helpers):
    """LEAKY_RELU on int8 or int16 (``reference_ops::QuantizeLeakyRelu``): :func:`_by_sign`."""
    from irgen.plugin import IrgenError

    if act is not None:
        raise IrgenError(f"{SCHEME}: a float activation after the leaky relu {qb.name!r}")
    alpha = float(comp.value.attrs.alpha)
    if not alpha >= 0:
        raise IrgenError(f"{SCHEME}: leaky relu {qb.name!r} has a negative alpha ({alpha}); not supported")
    x, qx, dqx = helpers.int8_input(qg, comp.value.args[0], f"input of the leaky relu {qb.name!r}")
    expr, rec, last = _by_sign(qg, qb, x, qx, out, "leaky_relu", alpha, helpers=helpers)
    rec["alpha"] = alpha
    return [dqx, comp.name] + helpers.tail(qb, None, last), expr, rec


def realize_prelu(qg, qb, comp, out, act, helpers):
    """PRELU (the frontend's ``where(x >= 0, x, x * alpha)`` of the dequantized input and alpha):
    TFLite's BroadcastPrelu4DSlow, :func:`_by_sign` with the integer alpha tensor multiplying the
    negatives; the alpha constant is in the record (``constants``)."""
    from tvm import relax

    from irgen.plugin import IrgenError

    cond_b, mul_b = qg.producer(comp.value.args[0]), qg.producer(comp.value.args[2])
    xv = comp.value.args[1]
    if act is not None or cond_b is None or cond_b.op != "relax.greater_equal" or mul_b is None \
            or mul_b.op != "relax.multiply" or not isinstance(xv, relax.Var) \
            or not all(getattr(a, "name", None) == xv.name for a in (cond_b.value.args[0], mul_b.value.args[0])):
        raise IrgenError(f"{SCHEME}: cannot realize the select at {qb.name!r} (only PRELU's where(x >= 0, x, x * alpha))")
    x, qx, dqx = helpers.int8_input(qg, xv, f"input of the prelu {qb.name!r}")
    alpha = helpers.operand(qg, mul_b.value.args[1])
    if alpha is None:
        raise IrgenError(f"{SCHEME}: the alpha of the prelu {qb.name!r} is not a dequantized integer tensor")
    a, qa, dqa = alpha
    expr, rec, last = _by_sign(qg, qb, x, qx, out, "prelu", float(qa.scale[0]), (a, qa), helpers)
    add_operand_records(rec, x, a)
    drop = [n for n in (dqa, cond_b.name, mul_b.name) if n is not None]
    drop += [dqx] if qg.n_users(dqx) == 3 else []
    return drop + [comp.name] + helpers.tail(qb, None, last), expr, rec


RECOMPUTE["leaky_relu"] = RECOMPUTE["prelu"] = recompute_by_sign


def realize_min_max(qg, qb, comp, out, act, helpers):
    """MAXIMUM / MINIMUM of two int8 (int16) tensors: TFLite compares the integers, with the
    output's parameters those of the inputs (the converter gives them one); an integer layer."""
    from tvm.relax import op

    from irgen.plugin import IrgenError

    what = comp.op.removeprefix("relax.")
    ins = [helpers.operand(qg, a) for a in comp.value.args]
    if act is not None or any(i is None for i in ins):
        raise IrgenError(f"{SCHEME}: the {what} {qb.name!r} is not of two dequantized integer tensors")
    for _, qt, _ in ins:
        if qt.scale[0] != out.scale[0] or qt.zero_point[0] != out.zero_point[0]:
            raise IrgenError(f"{SCHEME}: the {what} {qb.name!r} has inputs with other quantization parameters "
                             "than its output; TFLite's kernel compares the integers")
    (x1, q1, d1), (x2, q2, d2) = ins
    expr = (op.maximum if what == "maximum" else op.minimum)(x1, x2)
    rec = {"scheme": SCHEME, "kind": "integer", "inputs": [q1.record(), q2.record()], "output": out.record()}
    add_operand_records(rec, x1, x2)
    return [d for d in (d1, d2) if d is not None] + [comp.name, qb.name], expr, rec


def realize_requantize(qg, qb, comp, out, act, helpers):
    """An int8 tensor dequantized and quantized again, maybe through a float relu or
    clip (TFLite's int8 RELU/RELU6/RELU_N1_TO_1 and int8 -> int8 QUANTIZE):
    ``clamp(MultiplyByQuantizedMultiplier(x - zp_x, M, shift) + zp_y)``, the clamp
    from the activation's range (TFLite's quantized ReluX)."""
    import irgen.plugin as q

    x, qx, dqx = helpers.int8_input(qg, comp.var, f"input of {qb.name!r}")
    if act is not None:  # ReluPrepare: float input scale / float output scale
        real = float(np.float32(qx.scale[0]) / np.float32(out.scale[0]))
    else:  # QUANTIZE (requantize): double / double
        real = float(np.float64(np.float32(qx.scale[0])) / np.float64(np.float32(out.scale[0])))
    mult, shift = q.quantize_multiplier(real)
    ndim = len(comp.var.ty.shape.values)
    y = q.rx_multiply_by_quantized_multiplier(qg.emit, helpers.offset(qg, x, int(qx.zero_point[0])),
                                              np.array([mult]), np.array([shift]), -1, ndim)
    lo, hi, last = helpers.clamp(qg, qb.name, out.dtype, act, out)
    rec = {"scheme": SCHEME, "kind": "requantize", "inputs": [qx.record()], "output": out.record(),
           "activation": None if act is None else act.op.removeprefix("relax."),
           "requant": {"multiplier": int(mult), "shift": int(shift), "rounding": q.DOUBLE,
                       "rounding_rule": q.ROUNDING_RULES[q.DOUBLE]},
           "clamp": [lo, hi]}
    return [dqx] + helpers.tail(qb, act, last), helpers.finish(qg, y, out, lo, hi), rec


def affine_quantize(x, scale: float, zero_point: int, dtype: str) -> np.ndarray:
    """TFLite's QUANTIZE of a float tensor (``reference_ops::AffineQuantize``):
    ``zero_point + TfLiteRound(x / float32(scale))`` with a float32 division, rounded
    half away from zero, saturated; NaN becomes the type's minimum (the int32 cast of
    NaN is INT32_MIN on x86, then clamped)."""
    info = np.iinfo(dtype)
    f = np.asarray(x, np.float32) / np.float32(scale)
    f = np.where(np.isnan(f), np.float32(info.min - zero_point), f)
    f = np.clip(f, np.float32(info.min - zero_point), np.float32(info.max - zero_point))
    return (round_half_away(f).astype(np.int64) + zero_point).astype(dtype)


def recompute_quantize(layer, inputs, params) -> np.ndarray:
    qr = layer["quant"]
    out = qr["output"]
    return affine_quantize(inputs[0], float(np.asarray(out["scale"]).reshape(-1)[0]),
                           int(np.asarray(out["zero_point"]).reshape(-1)[0]), out["dtype"])


RECOMPUTE["quantize"] = recompute_quantize


def recompute_dequantize(layer, inputs, params) -> np.ndarray:
    """TFLite's DEQUANTIZE: ``float32(scale * (x - zp))``; the product of a float32 scale and an
    8-bit difference is exact in double, so this is float32 arithmetic's single rounding too."""
    q = layer["quant"]["inputs"][0]
    x = inputs[0].astype(np.int64) - int(np.asarray(q["zero_point"]).reshape(-1)[0])
    return (np.float64(np.float32(np.asarray(q["scale"]).reshape(-1)[0])) * x).astype(np.float32)


RECOMPUTE["dequantize"] = recompute_dequantize


def realize_quantize_float(qg, qb, out):
    """QUANTIZE of a float tensor (a model's float input, or the result of an op TFLite runs
    in float): :func:`affine_quantize` in Relax, every step exact in float32 (the fraction
    ``|f| - floor(|f|)`` is exact, so the half-away rounding needs no wider type)."""
    import irgen.plugin as q
    from tvm.relax import op

    info = np.iinfo(out.dtype)
    zp = int(out.zero_point[0])
    lo, hi = float(info.min - zp), float(info.max - zp)
    emit = qg.emit
    f = emit(op.divide(qb.value.args[0], q.rx_const(float(np.float32(out.scale[0])), "float32")))
    f = emit(op.where(emit(op.isnan(f)), q.rx_const(lo, "float32"), f))
    y = emit(op.astype(q.rx_round_half_away(emit, emit(op.clip(f, lo, hi))), "int32"))
    expr = op.astype(emit(op.add(y, q.rx_const(zp, "int32"))), out.dtype)
    rec = {"scheme": SCHEME, "kind": "quantize", "inputs": [], "output": out.record(),
           "clamp": [int(info.min), int(info.max)],
           "requant": {"rounding": "half_away_from_zero",
                       "rounding_rule": "y = saturate(zero_point + round(x / float32(scale))), float32 division; "
                                        "NaN -> the type's minimum (TFLite's AffineQuantize)"}}
    return [qb.name], expr, rec


#: the float Relax op between dequantize and quantize -> realization
SPANS: dict[str, Callable] = {
    "relax.sigmoid": realize_logistic,
    "relax.tanh": realize_tanh,
    "relax.nn.gelu": realize_gelu,
    "relax.nn.gelu_tanh": realize_gelu,
    "relax.rsqrt": realize_rsqrt,
    "relax.negative": realize_island,
    "relax.exp": realize_exp_log,
    "relax.log": realize_exp_log,
    "relax.divide": realize_hard_swish,
    "relax.multiply": realize_mul,
    "relax.image.resize2d": realize_resize_bilinear,
    "relax.dequantize": realize_requantize,
    "relax.nn.leakyrelu": realize_leaky_relu,
    "relax.where": realize_prelu,
    "relax.maximum": realize_min_max,
    "relax.minimum": realize_min_max,
}
