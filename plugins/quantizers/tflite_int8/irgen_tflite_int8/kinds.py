"""Layer kinds of the ``tflite-int8`` scheme beyond the core ones: each kind is
one realization (Relax integer ops, from the dequantize -> float op -> quantize
span TVM imports) and one numpy recompute (from the quant record and the
parameter files alone), side by side.

* ``lut`` -- an elementwise int8 -> int8 function as TFLite's kernel computes it,
  realized as a 256-entry table (parameter ``table``) indexed by ``x + 128``:

  - LOGISTIC: TFLite's ``LUTPopulate``: ``round(sigmoid(s_x * (v - zp_x)) / s_y) + zp_y``
    in float32 with ``expf``, rounding half away from zero;
  - HARD_SWISH: ``reference_ops::HardSwish``'s 16-bit fixed point (its
    multipliers are in the record), evaluated for each of the 256 inputs.

* ``mul`` -- MUL: ``MultiplyByQuantizedMultiplier((x1 - zp1) * (x2 - zp2), M, shift) + zp_y``
  with ``M, shift = QuantizeMultiplier(double(s1) * double(s2) / double(s_y))``.

:data:`SPANS` maps the float Relax op between dequantize and quantize to its
realization; :data:`RECOMPUTE` maps each kind to its recompute (registered with
:func:`irgen.quant.register_recompute`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

SCHEME = "tflite-int8"


# ------------------------------------------------------------------ numpy kernels


def _round_away(v):
    v = np.asarray(v, np.float64)
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def lut_populate(fn: Callable[[np.ndarray], np.ndarray], s_in: float, zp_in: int, s_out: float, zp_out: int,
                 dtype: str = "int8") -> np.ndarray:
    """TFLite's ``LUTPopulate`` for an 8-bit type: the output for every input value
    ``v`` (index ``v - min``), float32 arithmetic throughout."""
    info = np.iinfo(dtype)
    v = np.arange(int(info.min), int(info.max) + 1, dtype=np.int64)
    deq = np.float32(s_in) * (v - zp_in).astype(np.float32)
    transformed = fn(deq).astype(np.float32)
    rescaled = _round_away(transformed * (np.float32(1.0) / np.float32(s_out)))
    return np.clip(rescaled.astype(np.int64) + zp_out, info.min, info.max).astype(dtype)


def sigmoid_f32(x: np.ndarray) -> np.ndarray:
    """``1.0f / (1.0f + expf(-x))``; expf correctly rounded (glibc's)."""
    e = np.array([math.exp(-float(a)) if -float(a) < 88.8 else math.inf for a in np.asarray(x, np.float32).reshape(-1)])
    e = e.astype(np.float32).reshape(np.shape(x))
    with np.errstate(over="ignore"):
        return (np.float32(1.0) / (np.float32(1.0) + e)).astype(np.float32)


FUNCTIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"logistic": sigmoid_f32}


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
    from irgen.quant import quantize_multiplier

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


def lut_table(qr: dict[str, Any]) -> np.ndarray:
    """The table of a ``lut`` record, from its function and parameters."""
    qi, qo = qr["inputs"][0], qr["output"]
    zp_in, zp_out = int(qi["zero_point"]), int(qo["zero_point"])
    if qr["function"] == "hard_swish":
        info = np.iinfo(qo["dtype"])
        return hard_swish(np.arange(int(info.min), int(info.max) + 1), zp_in, zp_out, qr["params"], qo["dtype"])
    return lut_populate(FUNCTIONS[qr["function"]], qi["scale"], zp_in, qo["scale"], zp_out, qo["dtype"])


def recompute_lut(layer, inputs, params) -> np.ndarray:
    qr = layer["quant"]
    lo = np.iinfo(qr["inputs"][0]["dtype"]).min
    return lut_table(qr)[inputs[0].astype(np.int64) - lo]


def recompute_mul(layer, inputs, params) -> np.ndarray:
    from irgen.quant import multiply_by_quantized_multiplier

    qr = layer["quant"]
    rq, out = qr["requant"], qr["output"]
    a, b = (inputs[k].astype(np.int64) - int(q["zero_point"]) for k, q in enumerate(qr["inputs"]))
    y = multiply_by_quantized_multiplier(a * b, rq["multiplier"], rq["shift"], rq["rounding"])
    lo, hi = qr["clamp"]
    return np.clip(y + int(out["zero_point"]), lo, hi).astype(out["dtype"])


RECOMPUTE: dict[str, Callable] = {"lut": recompute_lut, "mul": recompute_mul}


# ------------------------------------------------------------------ Relax realizations


def _lut_layer(qg, qb, x, qx, out, function: str, drop: list[str], params: dict | None = None):
    """(names, expr, record) of a table lookup ``table[x - min]``."""
    from tvm import relax
    from tvm.relax import op

    from irgen import quant as q
    from irgen.api import IrgenError

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


def realize_logistic(qg, qb, comp, out, act, helpers):
    from irgen.api import IrgenError

    if act is not None:
        raise IrgenError(f"{SCHEME}: a float activation after the logistic {qb.name!r}")
    x, qx, dqx = helpers.int8_input(qg, comp.value.args[0], f"input of the logistic {qb.name!r}")
    return _lut_layer(qg, qb, x, qx, out, "logistic", [dqx, comp.name])


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

    from irgen.api import IrgenError

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


def realize_mul(qg, qb, comp, out, act, helpers):
    from tvm.relax import op

    from irgen import quant as q
    from irgen.api import IrgenError

    ins = [helpers.operand(qg, a) for a in comp.value.args]
    if any(i is None for i in ins):
        raise IrgenError(f"{SCHEME}: an input of the multiply {qb.name!r} is not a dequantized int8 tensor")
    (x1, q1, d1), (x2, q2, d2) = ins
    real = np.float64(np.float32(q1.scale[0])) * np.float64(np.float32(q2.scale[0])) / np.float64(np.float32(out.scale[0]))
    mult, shift = q.quantize_multiplier(float(real))
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
                            "M, shift = QuantizeMultiplier(s1 * s2 / s_y)"},
        "clamp": [lo, hi],
    }
    drop = [d for d in (d1, d2) if d is not None] + [comp.name]
    return drop + helpers.tail(qb, act, last), helpers.finish(qg, y, out, lo, hi), rec


#: the float Relax op between dequantize and quantize -> realization
SPANS: dict[str, Callable] = {
    "relax.sigmoid": realize_logistic,
    "relax.divide": realize_hard_swish,
    "relax.multiply": realize_mul,
}
