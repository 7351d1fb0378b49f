"""The ``tflite-int8`` quantization-fusion scheme.

TVM imports a full-integer TFLite model as dequantize -> float op ->
quantize. Run as is, that rounds differently from TFLite's integer kernels.
This scheme rewrites each such span into the integer arithmetic of TFLite's
reference kernels (``tflite::reference_integer_ops``), so the golden data is
what the TFLite interpreter computes, bit for bit:

* CONV_2D, DEPTHWISE_CONV_2D, FULLY_CONNECTED: int32 accumulation of
  ``(x - zp_x) * w`` plus the int32 bias, then ``MultiplyByQuantizedMultiplier``
  (per output channel; TF 2.21 rounds twice in conv and depthwise, once in
  fully connected), plus ``zp_y``, clamp to the fused activation's range;
* ADD: both inputs shifted left by 20 and scaled to twice the larger input
  scale, summed, rescaled to the output (TFLite's general int8 add); SUB is
  that kernel with the second input's multiplier negated, as TFLite runs it;
* MEAN: sum of ``x - zp_x`` times a multiplier that folds in the division by
  the element count (TFLite's MeanImpl);
* AVERAGE_POOL_2D: sum over the valid window divided by the valid count,
  rounding half away from zero;
* SOFTMAX (last axis): TFLite's table kernel, which its reference resolver
  runs for int8 too: ``e = table[x - max(x) + 255]`` with
  ``table[255 - v] = expf(-s_x * v)`` (a 256-entry float32 parameter),
  ``p = e * (1 / (sum(e) * s_y))`` in float32 (the sum in row order), rounded
  half away from zero, plus ``zp_y``;
* QUANTIZE of a float model input (the converter's default float interface):
  ``zero_point + TfLiteRound(x / scale)`` in float32, saturated; DEQUANTIZE of an
  int8 result to a float model output: ``float32(scale * (x - zero_point))``;
* MAX_POOL_2D, RESHAPE, CONCATENATION with shared parameters: exact in int8
  as imported (and PAD, STRIDED_SLICE, TRANSPOSE, RESIZE_NEAREST_NEIGHBOR, which
  the tflite frontend imports on int8 tensors itself);
* LOGISTIC, TANH, HARD_SWISH, GELU, RSQRT and float NEG (256-entry tables), MUL,
  SQUARED_DIFFERENCE, RESIZE_BILINEAR,
  BATCH_MATMUL, int8 RELU/QUANTIZE (requantize), and ADD/MUL with an int8
  constant operand: :mod:`irgen_tflite_int8.kinds`, each realization beside its
  numpy recompute.

The converter's 16x8 mode (int16 activations with zero point 0, int8 weights, int64 biases)
takes the same realizations with TFLite's 16x8 parameters: CONV_2D and DEPTHWISE_CONV_2D
accumulate in int64 and rescale with TFLite's int64 ``MultiplyByQuantizedMultiplier`` (its
multiplier rounded to 16 bits: rounding ``wide``), FULLY_CONNECTED accumulates in int64 and
rescales in double (``double(acc) * s_x * s_w / s_y``, rounded half away from zero: rounding
``float64``), ADD/SUB shift left by 15 instead of 20, BATCH_MATMUL sums in int64 with the
int64 multiplier; SOFTMAX, LOGISTIC and TANH have int16 algorithms of their own
(:mod:`irgen_tflite_int8.int16`, whose ``SUPPORTED`` lists every op realized on int16). Any
other op on int16 is refused, naming it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from irgen.plugin import IrgenError, Quantizer, hookimpl, quantize_half_away, quantize_multiplier
from irgen_tflite_int8 import int16, kinds
from irgen_tflite_int8.reference import recompute_requantized, tflite_softmax_table

__version__ = "0.1.0"

SCHEME = "tflite-int8"

#: verify's recompute of each kind (the quantizer's ``recompute``): TFLite's requantizing kernels
#: (conv, dense, add, mean, pools, concatenate, softmax, plain int8 ops), and the kinds of kinds.py
RECOMPUTE = {"*": recompute_requantized, **kinds.RECOMPUTE, **int16.RECOMPUTE}


def consistency(layer: dict[str, Any]) -> str | None:
    """A conv/dense layer's requant multiplier and shift per channel are TFLite's
    QuantizeMultiplier of ``s_x * s_w / s_y`` (verify catches a scale edited in ir.json)."""
    qr = layer["quant"]
    rq = qr.get("requant") or {}
    if "multiplier" not in rq and not ("scale" in rq and qr.get("weight")):
        return None
    s_x = float(np.asarray(qr["inputs"][0]["scale"]).reshape(-1)[0])
    s_w = np.asarray(qr["weight"]["scale"], np.float64).reshape(-1)
    s_y = float(np.asarray(qr["output"]["scale"]).reshape(-1)[0])
    if "multiplier" not in rq:  # a 16x8 FULLY_CONNECTED: the real scale itself
        want = np.broadcast_to(np.float64(s_x) * s_w / np.float64(s_y), np.shape(rq["scale"]))
        if not np.array_equal(want, np.asarray(rq["scale"], np.float64)):
            return "requant scale does not follow from the input, weight and output scales (s_x*s_w/s_y)"
        return None
    # per-tensor weights: one scale, and a multiplier per channel or one
    n = (max(s_w.size, np.asarray(rq["multiplier"]).size),)
    want = [quantize_multiplier(float(r)) for r in np.broadcast_to(s_x * s_w / s_y, n)]
    have = list(zip(np.broadcast_to(np.asarray(rq["multiplier"]).reshape(-1), n).tolist(),
                    np.broadcast_to(np.asarray(rq["shift"]).reshape(-1), n).tolist()))
    bad = [c for c, (w, h) in enumerate(zip(want, have)) if tuple(w) != tuple(h)]
    if bad:
        return (f"requant multiplier/shift of channel(s) {bad[:4]} do not follow from the input, weight and "
                f"output scales (s_x*s_w/s_y)")
    return None



def _ops():
    from tvm import relax
    from tvm.relax import op

    import irgen.plugin as q
    from irgen.plugin import Constant

    return relax, op, q, Constant


def _qparams(qg, call, what: str, tensor: str):
    """Scale and zero point of a quantize/dequantize call, checked."""
    relax, _, q, Constant = _ops()
    scale, zp = call.args[1], call.args[2]
    if not isinstance(scale, Constant) or not isinstance(zp, Constant):
        raise IrgenError(f"{SCHEME}: {what} of tensor {tensor!r} has a scale or zero point that is not a constant")
    dtype = str(call.attrs.out_dtype) if str(call.op.name) == "relax.quantize" else str(call.args[0].ty.dtype)
    return q.check_qparams(SCHEME, tensor, scale.value.numpy(), zp.value.numpy(), dtype, int(call.attrs.axis))


def _dequantized(qg, expr):
    """(int var, QTensor, dq binding name) when ``expr`` is dequantize(var)."""
    relax, _, _, _ = _ops()
    b = qg.producer(expr)
    if b is None or b.op != "relax.dequantize":
        return None
    src = b.value.args[0]
    if not isinstance(src, relax.Var):
        return None
    return src, _qparams(qg, b.value, "dequantize", src.name), b.name


def _int8_input(qg, expr, what: str):
    """(int var, QTensor, dq binding name) of an input that must be dequantize(int8 var)."""
    xin = _dequantized(qg, expr)
    if xin is None:
        raise IrgenError(f"{SCHEME}: {what} is not a dequantized int8 tensor")
    return xin


def _wide(qg, tensor: str, *qts) -> bool:
    """Whether a span computes on int16 activations (TFLite's 16x8 mode): then every activation
    is int16 with zero point 0, as TFLite requires; a mix with int8 is refused."""
    dtypes = {qt.dtype for qt in qts}
    if "int16" not in dtypes:
        return False
    if dtypes != {"int16"}:
        raise IrgenError(f"{SCHEME}: {tensor!r} mixes int16 and {sorted(dtypes - {'int16'})} activations")
    if any(np.any(qt.zero_point != 0) for qt in qts):
        raise IrgenError(f"{SCHEME}: int16 activation of {tensor!r} has a non-zero zero point (TFLite's 16x8 "
                         "activations are symmetric)")
    return True


def _const_weight(qg, expr, tensor: str):
    """Follow dequantize/reshape/permute_dims back to an int8 constant.

    Returns (int array in the layout the op consumes, QTensor with the
    per-channel axis mapped into that layout, binding names to drop).
    """
    _, _, q, _ = _ops()
    arr, qt, chain = q.follow_constant(qg, expr, lambda b, a: _qparams(qg, b.value, "dequantize", tensor),
                                       SCHEME, "weights", tensor)
    if arr.dtype != np.int8:
        raise IrgenError(f"{SCHEME}: weights of {tensor!r} are {arr.dtype}, not int8 "
                         "(a dynamic-range or float model is not full-integer)")
    if np.any(qt.zero_point != 0):
        raise IrgenError(f"{SCHEME}: weights of {tensor!r} have non-zero zero points (TFLite int8 weights are symmetric)")
    if qt.axis is not None and qt.scale.size > 1 and arr.shape[qt.axis] != qt.scale.size:
        raise IrgenError(f"{SCHEME}: weights of {tensor!r} have {qt.scale.size} scales for {arr.shape[qt.axis]} channels")
    return arr, qt, [b.name for b in chain if qg.n_users(b.name) == 1]


def _bias_constant(qg, expr, tensor: str):
    """(integer values, record, binding names) of a conv/dense bias: an int32 constant
    dequantized, or (a 16x8 model's int64 bias beyond int32, which TVM cannot dequantize) the
    frontend's ``float32(int64 constant) * scale``; None for anything else."""
    relax, _, q, Constant = _ops()
    b = qg.producer(expr)
    if b is None:
        return None
    if b.op == "relax.dequantize" and isinstance(b.value.args[0], Constant):
        return b.value.args[0].value.numpy(), _qparams(qg, b.value, "dequantize", tensor + " bias").record(), [b.name]
    if b.op != "relax.multiply" or not isinstance(b.value.args[1], Constant):
        return None
    cast = qg.producer(b.value.args[0])
    if cast is None or cast.op != "relax.astype" or not isinstance(cast.value.args[0], Constant) \
            or str(cast.value.args[0].ty.dtype) != "int64" or qg.n_users(cast.name) != 1:
        return None
    bias = cast.value.args[0].value.numpy()
    qt = q.check_qparams(SCHEME, tensor + " bias", b.value.args[1].value.numpy(), 0, "int64", 0)
    return bias, qt.record(), [cast.name, b.name]


def _multipliers(real: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from irgen.plugin import quantize_multiplier

    pairs = [quantize_multiplier(float(r)) for r in np.asarray(real, np.float64).reshape(-1)]
    return np.array([p[0] for p in pairs], np.int64), np.array([p[1] for p in pairs], np.int64)


def _clamp(qg, qname: str, dtype: str, act=None, out=None) -> tuple[int, int, str]:
    """Clamp range of a layer: a float activation before the quantize (relu,
    clip, computed as TFLite's CalculateActivationRangeQuantized does) and a
    clip on the quantized result after it. Returns (lo, hi, last binding name)."""
    info = np.iinfo(dtype)
    lo, hi, last = int(info.min), int(info.max), qname
    if act is not None:
        s, z = float(out.scale[0]), int(out.zero_point[0])

        def q(v: float) -> int:
            b = quantize_half_away(v, s, z)
            if b is None:  # kernel_util.cc Quantize: TFLite refuses the model
                raise IrgenError(
                    f"{SCHEME}: the fused activation of {qname!r} bounds it at {v:g}, which its output scale "
                    f"{s!r} puts beyond int32; TFLite's interpreter refuses such a model too "
                    "(no_integer_overflow_from_quantization): the tensor's calibrated range is all but zero")
            return b

        if act.op == "relax.nn.relu":
            lo = max(lo, q(0.0))
        else:
            lo = max(lo, q(float(act.value.args[1].value)))
            hi = min(hi, q(float(act.value.args[2].value)))
    users = qg.users.get(qname, [])
    if len(users) == 1 and qg.n_users(qname) == 1:
        c = qg.bindings[users[0]]
        if c.op == "relax.clip":
            lo = max(lo, int(round(float(c.value.args[1].value))))
            hi = min(hi, int(round(float(c.value.args[2].value))))
            last = c.name
    return lo, hi, last


def _tail(qb, act, last) -> list[str]:
    """Names a realized span ends with: the activation, the quantize, a clip after it."""
    return ([act.name] if act is not None else []) + [qb.name] + ([last] if last != qb.name else [])


def _finish(qg, acc, out, lo, hi):
    """acc (int32) + zero point, clamped, cast to the output dtype."""
    _, op, q, _ = _ops()
    y = qg.emit(op.add(acc, q.rx_const(int(out.zero_point[0]), "int32")))
    return q.rx_clamp_cast(qg.emit, y, lo, hi, out.dtype)


def _offset(qg, x, zp: int):
    _, op, q, _ = _ops()
    return qg.emit(op.subtract(qg.emit(op.astype(x, "int32")), q.rx_const(zp, "int32")))


def _realize_conv(qg, qb, comp, bias_b, out, act=None):
    relax, op, q, Constant = _ops()
    tensor = qb.name
    x, qx, dqx = _int8_input(qg, comp.value.args[0], f"input of {tensor!r}")
    w, qw, wdrop = _const_weight(qg, comp.value.args[1], tensor)
    # 16x8 (int16 activations): TFLite accumulates in int64 and adds an int64 bias; its
    # activations are symmetric (zero point 0)
    wide = _wide(qg, tensor, qx, out)
    acc_dtype = "int64" if wide else "int32"
    xs = x if wide else _offset(qg, x, int(qx.zero_point[0]))
    a = comp.value.attrs
    if comp.op == "relax.matmul":
        kind = "dense"
        acc = qg.emit(op.matmul(xs, relax.const(w), out_dtype=acc_dtype))
        ch_axis = -1
    else:
        kind = "depthwise_conv2d" if int(a.groups) > 1 else "conv2d"
        acc = qg.emit(op.nn.conv2d(
            xs, relax.const(w), strides=list(a.strides), padding=list(a.padding), dilation=list(a.dilation),
            groups=int(a.groups), data_layout=str(a.data_layout), kernel_layout=str(a.kernel_layout),
            out_layout=str(a.out_layout), out_dtype=acc_dtype,
        ))
        ch_axis = str(a.out_layout).index("C")
    ndim = len(comp.var.ty.shape.values)
    n_out = int(comp.var.ty.shape.values[ch_axis])
    drop = [dqx] + wdrop + [comp.name]
    bias_rec = None
    w_scale = np.broadcast_to(qw.scale, (n_out,)) if qw.scale.size == 1 else qw.scale
    if bias_b is not None:
        other = bias_b.value.args[1] if bias_b.value.args[0].same_as(comp.var) else bias_b.value.args[0]
        found = _bias_constant(qg, other, tensor)
        if found is None:
            raise IrgenError(f"{SCHEME}: bias of {tensor!r} is not a dequantized int32 (16x8: int64) constant")
        bias, bias_rec, bias_drop = found
        if bias.dtype != np.int32 and not (wide and bias.dtype == np.int64):
            raise IrgenError(f"{SCHEME}: bias of {tensor!r} is {bias.dtype}, not int32")
        acc = qg.emit(op.add(acc, relax.const(q.per_axis(bias, ch_axis, ndim).astype(acc_dtype), acc_dtype)))
        drop += bias_drop + [bias_b.name]
        bias_rec = {**bias_rec, "dtype": acc_dtype}  # 16x8: the model's int64 bias
    # TFLite: effective scale = double(s_x) * double(s_w) / double(s_y)
    real = (np.float64(qx.scale[0]) * w_scale.astype(np.float64)) / np.float64(out.scale[0])
    mult, shift = _multipliers(real)
    # TF 2.21's reference kernels: conv and depthwise round twice, fully connected once
    if wide and kind == "dense":  # 16x8 FULLY_CONNECTED: the int64 sum times the double scale
        rounding = q.FLOAT64
        y = q.rx_rescale_float64(qg.emit, acc, real, ch_axis, ndim)
    else:  # conv and depthwise: int64 with a 16-bit multiplier (16x8); int8: TF 2.21's mix
        rounding = q.SINGLE if kind == "dense" else q.WIDE if wide else q.DOUBLE
        y = q.rx_multiply_by_quantized_multiplier(qg.emit, acc, mult, shift, ch_axis, ndim, rounding)
    lo, hi, last = _clamp(qg, qb.name, out.dtype, act, out)
    expr = _finish(qg, y, out, lo, hi)
    rec = {
        "scheme": SCHEME,
        "kind": kind,
        "inputs": [qx.record()],
        "weight": qw.record(),
        "bias": bias_rec,
        "output": out.record(),
        "requant": {
            **({"scale": real.tolist()} if rounding == q.FLOAT64 else {"multiplier": mult.tolist(), "shift": shift.tolist()}),
            "axis": ch_axis % ndim,
            "rounding": rounding,
            "rounding_rule": q.ROUNDING_RULES[rounding],
        },
        "clamp": [lo, hi],
    }
    return drop + _tail(qb, act, last), expr, rec


def _realize_add(qg, qb, comp, out, act=None):
    """TFLite's general int8 ADD; also its SUB, which TFLite runs as the same kernel with the
    second input's multiplier negated (kernels/sub.cc): a ``subtract`` record is an ``add`` one
    whose second ``input_multiplier`` is negative (negating the result instead would round
    ties the other way)."""
    relax, op, q, _ = _ops()
    tensor = qb.name
    what = "add" if comp.op == "relax.add" else "subtraction"
    ins = [_operand(qg, a) for a in comp.value.args]  # an int8 constant operand too (a batch norm's shift)
    if any(i is None for i in ins):
        raise IrgenError(f"{SCHEME}: an input of the {what} {tensor!r} is not a dequantized int8 tensor")
    (x1, q1, d1), (x2, q2, d2) = ins
    # TFLite's general ADD: 20 bits of headroom for int8, 15 for int16 (16x8, whose ADD kernel
    # takes this path unless every scale is a power of two and the op asks for that kernel)
    left_shift = 15 if _wide(qg, tensor, q1, q2, out) else 20
    s1, s2 = np.float32(q1.scale[0]), np.float32(q2.scale[0])
    twice_max = np.float64(np.float32(2) * max(s1, s2))
    m1, sh1 = _multipliers([np.float64(s1) / twice_max])
    m2, sh2 = _multipliers([np.float64(s2) / twice_max])
    if comp.op == "relax.subtract":
        m2 = -m2
    mo, sho = _multipliers([twice_max / (np.float64(1 << left_shift) * np.float64(out.scale[0]))])
    ndim = len(comp.var.ty.shape.values)
    ls = q.rx_const(left_shift, "int32")
    e = qg.emit
    a1 = q.rx_multiply_by_quantized_multiplier(e, e(op.left_shift(_offset(qg, x1, int(q1.zero_point[0])), ls)), m1, sh1, -1, ndim)
    a2 = q.rx_multiply_by_quantized_multiplier(e, e(op.left_shift(_offset(qg, x2, int(q2.zero_point[0])), ls)), m2, sh2, -1, ndim)
    y = q.rx_multiply_by_quantized_multiplier(e, e(op.add(a1, a2)), mo, sho, -1, ndim)
    lo, hi, last = _clamp(qg, qb.name, out.dtype, act, out)
    rec = {
        "scheme": SCHEME,
        "kind": "add" if comp.op == "relax.add" else "subtract",
        "inputs": [q1.record(), q2.record()],
        "output": out.record(),
        "requant": {
            "left_shift": left_shift,
            "input_multiplier": [int(m1[0]), int(m2[0])],
            "input_shift": [int(sh1[0]), int(sh2[0])],
            "multiplier": int(mo[0]),
            "shift": int(sho[0]),
            "rounding": q.DOUBLE,
            "rounding_rule": q.ROUNDING_RULES[q.DOUBLE],
        },
        "clamp": [lo, hi],
    }
    kinds.add_operand_records(rec, x1, x2)
    return [d for d in (d1, d2) if d is not None] + [comp.name] + _tail(qb, act, last), _finish(qg, y, out, lo, hi), rec


def _realize_mean(qg, qb, comp, out, act=None):
    _, op, q, _ = _ops()
    tensor = qb.name
    x, qx, dqx = _int8_input(qg, comp.value.args[0], f"input of the mean {tensor!r}")
    axes = [int(a) for a in comp.value.attrs.axis]
    shape = [int(d) for d in x.ty.shape.values]
    count = int(np.prod([shape[a] for a in axes]))
    keep = bool(comp.value.attrs.keepdims)
    mult, shift = _multipliers([np.float64(qx.scale[0]) / np.float64(out.scale[0])])
    # TFLite's MeanImpl folds the division by the count into the multiplier
    reduction_shift = min(count.bit_length() - 1, 32, 31 + int(shift[0]))
    mult = np.array([(int(mult[0]) << reduction_shift) // count], np.int64)
    shift = shift - reduction_shift
    acc = qg.emit(op.sum(_offset(qg, x, int(qx.zero_point[0])), axis=axes, keepdims=keep))
    ndim = len(comp.var.ty.shape.values)
    acc = q.rx_multiply_by_quantized_multiplier(qg.emit, acc, mult, shift, -1, ndim)
    lo, hi, last = _clamp(qg, qb.name, out.dtype, act, out)
    rec = {
        "scheme": SCHEME,
        "kind": "mean",
        "inputs": [qx.record()],
        "output": out.record(),
        "axes": axes,
        "keepdims": keep,
        "requant": {"multiplier": int(mult[0]), "shift": int(shift[0]), "count": count,
                    "reduction_shift": reduction_shift, "rounding": q.DOUBLE,
                    "rounding_rule": q.ROUNDING_RULES[q.DOUBLE],
                    "note": "multiplier = (QuantizeMultiplier(s_in/s_out) << reduction_shift) // count"},
        "clamp": [lo, hi],
    }
    return [dqx, comp.name] + _tail(qb, act, last), _finish(qg, acc, out, lo, hi), rec


def _realize_concat(qg, qb, comp, out):
    relax, op, _, _ = _ops()
    fields = list(comp.value.args[0].fields)
    ins = [_dequantized(qg, f) for f in fields]
    if any(i is None for i in ins):
        raise IrgenError(f"{SCHEME}: an input of the concatenation {qb.name!r} is not a dequantized int8 tensor")
    for x, qx, _ in ins:
        if qx.scale[0] != out.scale[0] or qx.zero_point[0] != out.zero_point[0]:
            raise IrgenError(
                f"{SCHEME}: concatenation {qb.name!r} mixes quantization parameters "
                f"(input {x.name!r}: {qx.scale[0]}/{qx.zero_point[0]}, output {out.scale[0]}/{out.zero_point[0]}); "
                "not supported"
            )
    expr = op.concat([x for x, _, _ in ins], axis=int(comp.value.attrs.axis))
    rec = {"scheme": SCHEME, "kind": "concatenate", "axis": int(comp.value.attrs.axis),
           "inputs": [qx.record() for _, qx, _ in ins], "output": out.record()}
    return [d for _, _, d in ins] + [comp.name, qb.name], expr, rec


def _realize_softmax(qg, qb, comp, out):
    relax, op, q, _ = _ops()
    tensor = qb.name
    x, qx, dqx = _int8_input(qg, comp.value.args[0], f"input of the softmax {tensor!r}")
    ndim = len(x.ty.shape.values)
    if int(comp.value.attrs.axis) not in (-1, ndim - 1):
        raise IrgenError(f"{SCHEME}: softmax {tensor!r} is not over the last axis; TFLite's int8 kernel is")
    table = tflite_softmax_table(float(qx.scale[0]))
    lo, hi, last = _clamp(qg, qb.name, out.dtype)
    xi = qg.emit(op.astype(x, "int32"))
    idx = qg.emit(op.add(qg.emit(op.subtract(xi, qg.emit(op.max(xi, axis=[-1], keepdims=True)))),
                         q.rx_const(255, "int32")))
    e = qg.emit(op.take(relax.const(table), idx, axis=0, mode="clip"))  # idx is in 0..255
    total = qg.emit(op.sum(e, axis=[-1], keepdims=True))
    inv = qg.emit(op.divide(q.rx_const(1.0, "float32"),
                            qg.emit(op.multiply(total, q.rx_const(float(np.float32(out.scale[0])), "float32")))))
    p = qg.emit(op.multiply(e, inv))
    r = qg.emit(op.floor(p))
    half_up = qg.emit(op.astype(qg.emit(op.greater_equal(qg.emit(op.subtract(p, r)), q.rx_const(0.5, "float32"))),
                                "float32"))
    y = qg.emit(op.astype(qg.emit(op.add(r, half_up)), "int32"))
    rec = {
        "scheme": SCHEME,
        "kind": "softmax",
        "axis": -1,
        "inputs": [qx.record()],
        "output": out.record(),
        "table": "parameter 'table' (float32[256]): table[255 - v] = expf(float32(-input_scale) * v)",
        "requant": {"rounding": "half_away_from_zero",
                    "rounding_rule": "y = round(table[x - max + 255] * float32(1 / (float32(sum) * output_scale))) "
                                     "+ zero_point, sum in row order, float32 throughout"},
        "clamp": [lo, hi],
    }
    return [dqx, comp.name] + _tail(qb, None, last), _finish(qg, y, out, lo, hi), rec


def _realize_avg_pool(qg, cast_b, pool_b, widen_b, qin):
    """astype(int32) -> avg_pool2d -> astype(int8): TFLite's rounded average of valid elements."""
    relax, op, q, _ = _ops()
    a = pool_b.value.attrs
    layout = str(a.layout)
    if layout != "NHWC":
        raise IrgenError(f"{SCHEME}: average pool {cast_b.name!r} in layout {layout} (TFLite is NHWC)")
    x = widen_b.value.args[0]
    n, h, w, c = (int(d) for d in x.ty.shape.values)
    kh, kw = (int(v) for v in a.pool_size)
    sh, sw = (int(v) for v in a.strides)
    pt, pl, pb, pr = (int(v) for v in a.padding)
    dh, dw = (int(v) for v in a.dilation)
    if (dh, dw) != (1, 1) or bool(a.ceil_mode):
        raise IrgenError(f"{SCHEME}: average pool {cast_b.name!r} with dilation or ceil mode is not supported")
    oh = (h + pt + pb - kh) // sh + 1
    ow = (w + pl + pr - kw) // sw + 1
    rows = np.array([min(h, i * sh - pt + kh) - max(0, i * sh - pt) for i in range(oh)])
    cols = np.array([min(w, j * sw - pl + kw) - max(0, j * sw - pl) for j in range(ow)])
    count = (rows[:, None] * cols[None, :]).reshape(1, oh, ow, 1).astype(np.int32)
    ones = np.ones((kh, kw, c, 1), np.int8)
    s = qg.emit(op.nn.conv2d(qg.emit(op.astype(x, "int32")), relax.const(ones), strides=[sh, sw],
                             padding=[pt, pl, pb, pr], groups=c, data_layout="NHWC", kernel_layout="HWOI",
                             out_layout="NHWC", out_dtype="int32"))
    avg = q.rx_divide_round_half_away(qg.emit, s, relax.const(count))
    out_dtype = str(cast_b.var.ty.dtype)
    lo, hi, last = _clamp(qg, cast_b.name, out_dtype)
    rec = {
        "scheme": SCHEME,
        "kind": "avg_pool2d",
        "inputs": [qin.record()] if qin else [],
        "output": qin.record() if qin else None,
        "pool": {"size": [kh, kw], "strides": [sh, sw], "padding": [pt, pl, pb, pr], "layout": layout},
        "requant": {"divide": "sum of valid elements / their count, round half away from zero"},
        "clamp": [lo, hi],
    }
    return [widen_b.name, pool_b.name, cast_b.name] + ([last] if last != cast_b.name else []), q.rx_clamp_cast(qg.emit, avg, lo, hi, out_dtype), rec


def _operand(qg, expr):
    """(int var or int constant, QTensor, dq binding name or None) of an operand
    that is a dequantized integer tensor or constant, else None."""
    relax, _, _, Constant = _ops()
    b = qg.producer(expr)
    if b is None or b.op != "relax.dequantize" or not isinstance(b.value.args[0], (relax.Var, Constant)):
        return None
    src = b.value.args[0]
    label = src.name if isinstance(src, relax.Var) else f"{b.name} (a constant)"
    qt = _qparams(qg, b.value, "dequantize", label)
    if qt.scale.size != 1:
        return None
    return src, qt, b.name if qg.n_users(b.name) == 1 else None


def _from_constants(qg, expr, depth: int = 0) -> bool:
    """Whether ``expr`` is computed from constants alone (a weight behind a reshape or transpose)."""
    relax, _, _, Constant = _ops()
    if isinstance(expr, Constant):
        return True
    b = qg.producer(expr)
    if b is None or b.kind != "call" or depth > 8:
        return False
    return all(_from_constants(qg, a, depth + 1) for a in b.value.args if isinstance(a, (relax.Var, Constant)))


#: the ops this module realizes with TFLite's 16x8 variant too (conv, depthwise, fully connected
#: and BATCH_MATMUL, whose kinds.py realization sums int16 in int64, add, sub, mean,
#: concatenation); :mod:`.int16` has the others
_INT16_OPS = frozenset({"relax.nn.conv2d", "relax.matmul", "relax.add", "relax.subtract", "relax.mean", "relax.concat"})


class _Helpers:
    """The scheme's shared steps, handed to the realizations of :mod:`irgen_tflite_int8.kinds`."""

    int8_input = staticmethod(_int8_input)
    dequantized = staticmethod(_dequantized)
    operand = staticmethod(_operand)
    offset = staticmethod(_offset)
    clamp = staticmethod(_clamp)
    tail = staticmethod(_tail)
    finish = staticmethod(_finish)


def _take_identity_reshape(qg, names: list[str]) -> list[str]:
    """``names`` and the reshape to the same shape that reads the span's result, if
    one does: TVM's FULLY_CONNECTED with keep_num_dims (a Dense on [1, T, C]) ends
    in one, and so does irgen's FULLY_CONNECTED of a 4-D input without it (to
    TFLite's 2-D result); it holds the source tensor's name. The realized layer takes that
    binding, so the layer's record is the span's (requant and all), not a
    pass-through of an int8 reshape."""
    last = names[-1]
    users = qg.users.get(last, [])
    if len(users) != 1 or qg.n_users(last) != 1:
        return names
    r = qg.bindings[users[0]]
    if r.op != "relax.reshape" or not getattr(r.value.args[0], "name", None) == last:
        return names
    src = qg.by_name[last]
    shape_in = [int(d) for d in src.var.ty.shape.values]
    shape_out = [int(d) for d in r.var.ty.shape.values]
    # the same shape, or FULLY_CONNECTED's 2-D result of a [1, 1, 1, K] input (the frontend
    # reshapes TVM's [1, 1, 1, N] to TFLite's [1, N]): the recompute writes the output's shape
    flattened = (len(shape_out) == 2 and shape_in[-1:] == shape_out[-1:]
                 and int(np.prod(shape_in)) == int(np.prod(shape_out)))
    return names + [r.name] if shape_in == shape_out or flattened else names


def _is_quantized(qg) -> bool:
    return any(b.op in ("relax.quantize", "relax.dequantize") for b in qg.bindings)


#: the quantization dialect this scheme realizes: TFLite's int8 tensors (the ``tflite`` and
#: ``keras`` frontends declare it; keras converts to TFLite first)
DIALECT = "tflite"


def detect(qg) -> bool:
    return getattr(qg, "dialect", None) == DIALECT and _is_quantized(qg)


def realize(qg) -> None:
    """Rewrite every quantized span of a TFLite int8 (or 16x8) model into TFLite's integer
    arithmetic, as the module docstring says, then record the DEQUANTIZEs of int8 activations
    and the int8 ops kept as imported. A QUANTIZE or DEQUANTIZE left after folding is an error."""
    qparams: dict[str, Any] = {}  # int var name -> QTensor, for pass-through records
    i = 0
    while i < len(qg.bindings):
        b = qg.bindings[i]
        i += 1
        _note_qparams(qg, b, qparams)
        if _realize_avg_pool_at(qg, b, qparams) or _realize_quantize_at(qg, b, qparams):
            i = 0  # indices moved; realized spans no longer match
    _check_full_integer(qg)
    _record_dequantizes(qg)
    _record_integer_ops(qg, qparams)


def _note_qparams(qg, b, qparams: dict[str, Any]) -> None:
    """Record in ``qparams`` the parameters of the integer tensor a DEQUANTIZE ``b`` reads, and
    those of an int8 op kept as imported (max pool, reshape): its first quantized input's."""
    relax = _ops()[0]
    if b.op == "relax.dequantize" and isinstance(b.value.args[0], relax.Var):
        qparams.setdefault(b.value.args[0].name, _qparams(qg, b.value, "dequantize", b.value.args[0].name))
    if b.kind == "call" and b.op not in ("relax.quantize", "relax.dequantize", "relax.astype") \
            and b.name not in qparams and str(getattr(b.var.ty, "dtype", "")) in ("int8", "uint8", "int16"):
        srcs = [a.name for a in b.value.args if isinstance(a, relax.Var) and a.name in qparams]
        if srcs:  # int8 ops kept as imported (max pool, reshape) keep their input's parameters
            qparams[b.name] = qparams[srcs[0]]


def _realize_avg_pool_at(qg, b, qparams: dict[str, Any]) -> bool:
    """Realize the integer average pool whose narrowing ``astype`` is ``b`` (widen, pool, narrow
    as imported); whether it did."""
    relax = _ops()[0]
    if not (b.op == "relax.astype" and str(b.var.ty.dtype) in ("int8", "uint8", "int16")):
        return False
    pool = qg.producer(b.value.args[0])
    widen = qg.producer(pool.value.args[0]) if pool is not None and pool.op == "relax.nn.avg_pool2d" else None
    if widen is None or widen.op != "relax.astype":
        return False
    src = widen.value.args[0]
    names, expr, rec = _realize_avg_pool(qg, b, pool, widen, qparams.get(src.name) if isinstance(src, relax.Var) else None)
    qg.replace(names, expr, rec)
    return True


def _realize_quantize_at(qg, b, qparams: dict[str, Any]) -> bool:
    """Realize the span that QUANTIZE ``b`` ends (the QUANTIZE of a float model input alone) and
    record its output's parameters in ``qparams``; whether ``b`` is a QUANTIZE (always realized)."""
    if b.op != "relax.quantize":
        return False
    out = _qparams(qg, b.value, "quantize", b.name)
    if out.scale.size != 1:
        raise IrgenError(f"{SCHEME}: activation {b.name!r} is quantized per channel; TFLite int8 activations are per tensor")
    f = qg.producer(b.value.args[0])
    if f is None:  # the QUANTIZE of a float model input (the converter's default float interface)
        names, expr, rec = kinds.realize_quantize_float(qg, b, out)
        qparams[names[-1]] = out
        qg.replace(names, expr, rec)
        return True
    comp, bias_b, act = _span_ops(qg, b, f)
    names, expr, rec = _realize_span(qg, b, comp, bias_b, out, act)
    names, expr = _with_identity_reshape(qg, names, expr)
    qparams[names[-1]] = out
    qg.replace(names, expr, rec)
    return True


def _span_ops(qg, b, f) -> tuple[Any, Any, Any]:
    """The ops of the span QUANTIZE ``b`` ends, whose input ``f`` computes: (the op that computes,
    the bias add after a convolution or matmul or None, the fused activation computed in float
    or None)."""
    act = None
    if f.op in ("relax.nn.relu", "relax.clip") and qg.n_users(f.name) == 1:
        act, f = f, qg.producer(f.value.args[0])  # a fused activation computed in float
        if f is None:
            raise IrgenError(f"{SCHEME}: activation {act.name!r} reads a model input directly")
    comp, bias_b = f, None
    if f.op == "relax.add":
        p0, p1 = (qg.producer(a) for a in f.value.args)
        for cand, other in ((p0, p1), (p1, p0)):
            if cand is not None and cand.op in ("relax.nn.conv2d", "relax.matmul") and other is not None \
                    and _bias_constant(qg, other.var, b.name) is not None:
                comp, bias_b = cand, f
                break
    return comp, bias_b, act


def _realize_span(qg, b, comp, bias_b, out, act):
    """(names, expr, record) of the span ending in QUANTIZE ``b`` whose computing op is ``comp``,
    in the integer arithmetic of TFLite's kernel for it; an op irgen has no kernel for is an error."""
    if out.dtype == "int16" and comp.op in int16.SPANS:  # TFLite's 16x8 kernels of their own
        return int16.SPANS[comp.op](qg, b, comp, out, act, _Helpers)
    if out.dtype == "int16" and comp.op not in _INT16_OPS:
        raise IrgenError(f"{SCHEME}: cannot realize {comp.op or comp.kind} at tensor {b.name!r} on int16 "
                         "activations (16x8 quantization): irgen has TFLite's 16x8 kernels for "
                         f"{', '.join(int16.SUPPORTED)}")
    if comp.op == "relax.matmul" and all(_dequantized(qg, a) is not None and not _from_constants(qg, _dequantized(qg, a)[0])
                                         for a in comp.value.args):
        return kinds.realize_batch_matmul(qg, b, comp, out, act, _Helpers)
    if comp.op in ("relax.nn.conv2d", "relax.matmul"):
        return _realize_conv(qg, b, comp, bias_b, out, act)
    if comp.op in ("relax.add", "relax.subtract"):
        return _realize_add(qg, b, comp, out, act)
    if comp.op == "relax.mean":
        return _realize_mean(qg, b, comp, out, act)
    if comp.op == "relax.concat" and act is None:
        return _realize_concat(qg, b, comp, out)
    if comp.op == "relax.nn.softmax" and act is None:
        return _realize_softmax(qg, b, comp, out)
    if comp.op in kinds.SPANS:
        return kinds.SPANS[comp.op](qg, b, comp, out, act, _Helpers)
    raise IrgenError(f"{SCHEME}: cannot realize {comp.op or comp.kind} at tensor {b.name!r} in integer arithmetic")


def _with_identity_reshape(qg, names: list[str], expr):
    """``names`` and ``expr`` extended by the identity reshape that follows the span
    (:func:`_take_identity_reshape`), ``expr`` then in the reshape's shape (FULLY_CONNECTED's
    2-D result)."""
    relax = _ops()[0]
    taken = _take_identity_reshape(qg, names)
    if len(taken) > len(names):  # the result in the reshape's shape (FULLY_CONNECTED's 2-D result)
        shape = [int(d) for d in qg.by_name[taken[-1]].var.ty.shape.values]
        if [int(d) for d in qg.by_name[names[-1]].var.ty.shape.values] != shape:
            expr = relax.op.reshape(qg.emit(expr), shape)
    return taken, expr


def _check_full_integer(qg) -> None:
    """Refuse a QUANTIZE, or a DEQUANTIZE of a constant, left after folding: the model is not
    full-integer. A DEQUANTIZE of an int8 activation stays: TFLite's float result of an integer
    tensor (the converter's default float model output), exact as TVM computes it
    (float32(scale * (x - zp)))."""
    relax = _ops()[0]
    left = [b for b in qg.bindings if b.op == "relax.quantize"
            or (b.op == "relax.dequantize" and not isinstance(b.value.args[0], relax.Var))]
    if left:
        b = left[0]
        raise IrgenError(f"{SCHEME}: {b.op.removeprefix('relax.')} at tensor {b.name!r} is left after folding; the model is not full-integer")


def _record_dequantizes(qg) -> None:
    """The quantization record of each DEQUANTIZE of an int8 activation left in the graph:
    float32(scale * (x - zero_point))."""
    q = _ops()[2]
    for b in qg.bindings:
        if b.op == "relax.dequantize" and b.name not in qg.quant:
            qx = _qparams(qg, b.value, "dequantize", b.value.args[0].name)
            qg.quant[b.name] = {"scheme": SCHEME, "kind": "dequantize", "inputs": [qx.record()],
                                "output": q.float_record(),
                                "requant": {"rounding_rule": "y = float32(scale * (x - zero_point)) (TFLite's DEQUANTIZE)"}}


def _record_integer_ops(qg, qparams: dict[str, Any]) -> None:
    """The quantization record of each int8 op kept as imported (max pool, reshape...): exact
    in int8, its output with the same parameters as its input."""
    relax = _ops()[0]
    for b in qg.bindings:
        if b.name in qg.quant or b.kind != "call" or b.name not in qparams:
            continue
        srcs = [a.name for a in b.value.args if isinstance(a, relax.Var) and a.name in qparams]
        qg.quant[b.name] = {"scheme": SCHEME, "kind": "integer", "inputs": [qparams[s].record() for s in srcs],
                            "output": qparams[b.name].record()}


@hookimpl
def irgen_register_quantizers(register):
    register(
        Quantizer(
            name=SCHEME,
            detect=detect,
            realize=realize,
            priority=10,
            description="full-integer TFLite models, bit-exact with TFLite's reference kernels",
            recompute=RECOMPUTE,
            consistency=consistency,
            runtime_exact=True,  # its integer kernels are the runtime's, bit for bit
        )
    )
