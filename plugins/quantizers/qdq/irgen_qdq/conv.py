"""Conv, Gemm and MatMul with constant weights: int32 accumulation of ``(x - zp_x) * w`` plus the
int32 bias, then MLAS requantization ``float32(acc) * (s_x * s_w[c] / s_y)`` (float32), clamped to
``[lo - zp_y, hi - zp_y]``, rounded half to even, ``+ zp_y``; a Relu/Clip inside the span narrows
the clamp. A scheme built on qdq replaces the requantization (``conv_requant`` of
:func:`irgen_qdq.realize`); a torch reference graph's layer is the float op on the dequantized
values (plus its float bias), then torch's quantize."""

from __future__ import annotations

import numpy as np

from irgen.plugin import IrgenError

from .common import SCHEME, _clamp_of, _const_chain, _drop, _float_weights, _is_torch, _need_or_constant, _offset, _ops
from .torch_spans import _rx_torch_quantize


def _float_bias(qg, expr):
    """A float bias constant reached through reshape bindings (torch reference graphs keep float biases)."""
    _, _, _, Constant = _ops()
    e, chain = expr, []
    while not isinstance(e, Constant):
        b = qg.producer(e)
        if b is None or b.op != "relax.reshape":
            return None
        chain.append(b)
        e = b.value.args[0]
    arr = e.value.numpy()
    if arr.dtype != np.float32:
        return None
    return arr.reshape(-1), chain


def _weights_less_zero_point(w: np.ndarray, qw, tensor: str) -> tuple[np.ndarray, dict]:
    """int8 weights with zero point 0 as they are; uint8 weights (``weight_type=QUInt8``) or
    non-zero zero points as ``w - zp_w`` in int16 (exact: -255..255), the product ORT's
    QLinearConv/MatMulInteger accumulate. The record then says the parameter file holds
    ``w - zero_point`` (``zero_point_applied``), and keeps the zero points for the hardware
    that stores the raw weights."""
    if w.dtype not in (np.int8, np.uint8):
        raise IrgenError(f"{SCHEME}: weights of {tensor!r} are {w.dtype}, not int8 or uint8")
    zp = np.asarray(qw.zero_point).reshape(-1)
    if w.dtype == np.int8 and not np.any(zp != 0):
        return w, {}
    if zp.size > 1:
        shape = [1] * w.ndim
        shape[qw.axis % w.ndim] = zp.size
        zp = zp.reshape(shape)
    return (w.astype(np.int16) - zp.astype(np.int16)).astype(np.int16), \
        {"zero_point_applied": True, "parameter_dtype": "int16"}


def _check_conv_bias_scale(qx, qw, bq, n_out: int, tensor: str) -> None:
    """ONNX Runtime fuses DQ -> Conv -> Q into QLinearConv only when the bias's scale is close to
    ``s_x * s_w[c]`` (``|s_b - s_x*s_w| <= 1e-6 + 0.01 * s_x*s_w``, measured on ORT 1.32 at the
    boundary); else it runs the node unit in float: so does irgen (timm mobilevitv2's zero biases
    were quantized with another scale). A Gemm's bias is not checked: ORT's QGemm takes it as is."""
    want = np.float32(qx.scale[0]) * np.broadcast_to(qw.scale, (n_out,)).astype(np.float32)
    have = np.broadcast_to(np.asarray(bq.scale, np.float32), (n_out,))
    if np.any(np.abs(have.astype(np.float64) - want) > 1e-6 + 0.01 * np.abs(want.astype(np.float64))):
        raise IrgenError(f"{SCHEME}: bias of {tensor!r} has a scale other than s_x * s_w: no integer kernel "
                         "(ORT runs the node unit in float)")


def _realize_conv(qg, qb, comp, bias_b, acts, out, requant=None):
    """Conv/Gemm/MatMul with constant weights (``comp``), its bias add ``bias_b`` and activations
    ``acts`` before the quantize ``qb``: the int32 accumulator (plus the int32 bias), then ONNX
    Runtime's requantization, ``requant``'s (a scheme built on qdq), or a torch reference graph's
    float op and quantize."""
    relax, op, q, Constant = _ops()
    tensor = qb.name
    x, qx, dqx = _need_or_constant(qg, comp.value.args[0], "the input", tensor)
    if not _is_torch(qg) and _float_weights(qg, comp.value.args[1]):
        # 4-bit weights (the onnx frontend folds their DequantizeLinear: ORT runs the op in float)
        raise IrgenError(f"{SCHEME}: weights of {tensor!r} are float: no integer kernel")
    w, qw, wchain = _const_chain(qg, comp.value.args[1], tensor, "weights")
    w, w_offset = _weights_less_zero_point(w, qw, tensor)
    kind, ch_axis, acc = _accumulator(qg, comp, _offset(qg, x, int(qx.zero_point[0])), w)
    ndim = len(comp.var.ty.shape.values)
    n_out = int(comp.var.ty.shape.values[ch_axis])
    if qw.scale.size > 1:
        w_axis = 1 if kind == "dense" else 0
        if qw.axis != w_axis or qw.scale.size != n_out:
            raise IrgenError(f"{SCHEME}: weights of {tensor!r} have {qw.scale.size} scales on axis {qw.axis} "
                             f"for {n_out} output channels")
    drop = [dqx] + _drop(qg, wchain) + [comp.name]
    bias_rec = None
    fbias = None
    if bias_b is not None and _is_torch(qg):
        other = bias_b.value.args[1] if bias_b.value.args[0].same_as(comp.var) else bias_b.value.args[0]
        fb = _float_bias(qg, other)
        if fb is not None:
            fbias, fchain = fb
            drop += _drop(qg, fchain) + [bias_b.name]
            bias_b = None
    if bias_b is not None:
        bias, bq, bchain = _int32_bias(qg, comp, bias_b, kind, qx, qw, n_out, tensor)
        acc = qg.emit(op.add(acc, relax.const(q.per_axis(bias.reshape(-1), ch_axis, ndim).astype(np.int32))))
        drop += _drop(qg, bchain) + [bias_b.name]
        bias_rec = bq.record()
    w_scale = np.broadcast_to(qw.scale, (n_out,)).astype(np.float32)
    # ORT: output_scale[c] = (x_scale * w_scale[c]) / y_scale, in float32
    scale = (np.float32(qx.scale[0]) * w_scale) / np.float32(out.scale[0])
    lo, hi = _clamp_of(acts, out.dtype, out)
    if _is_torch(qg) and requant is None:
        ws = (np.float32(qx.scale[0]) * w_scale).astype(np.float32)
        expr, rq = _torch_requant(qg, acc, ws, fbias, out, lo, hi, ch_axis, ndim)
        bias_rec = None if fbias is None else {"dtype": "float32"}
    elif requant is None:
        expr = q.rx_requantize_float(qg.emit, acc, scale, int(out.zero_point[0]), lo, hi, out.dtype, ch_axis, ndim)
        rq = {"scale": [float(s) for s in scale], "axis": ch_axis % ndim, "rounding": "half_to_even",
              "rounding_rule": "y = clamp(round_half_even(float32(acc) * scale[c]) + zp_y, clamp); "
                               "scale[c] = float32(s_x * s_w[c]) / s_y (MLAS requantize)"}
    else:  # another scheme's requantization of the same accumulator
        expr, rq = requant(qg, acc, scale, out, lo, hi, ch_axis % ndim, ndim, tensor)
    rec = {
        "scheme": SCHEME, "kind": kind, "inputs": [qx.record()], "weight": {**qw.record(), **w_offset}, "bias": bias_rec,
        **({"reference": "torch"} if _is_torch(qg) and requant is None else {}),
        "output": out.record(), "requant": rq, "clamp": [lo, hi],
    }
    return drop + [b.name for b in acts] + [qb.name], expr, rec


def _accumulator(qg, comp, xs, w: np.ndarray):
    """``(kind, channel axis, int32 accumulator)`` of ``comp`` (a conv2d, a conv3d or a matmul) on
    the offset input ``xs`` and the integer weights ``w``: ``dense``, ``conv2d``, ``depthwise_conv2d``,
    ``conv3d`` or ``depthwise_conv3d``."""
    relax, op, _, _ = _ops()
    a = comp.value.attrs
    if comp.op == "relax.matmul":
        return "dense", -1, qg.emit(op.matmul(xs, relax.const(w), out_dtype="int32"))
    conv, kind = (op.nn.conv3d, "conv3d") if comp.op == "relax.nn.conv3d" else (op.nn.conv2d, "conv2d")
    if int(a.groups) > 1 and int(a.groups) == w.shape[0]:
        kind = f"depthwise_{kind}"
    acc = qg.emit(conv(
        xs, relax.const(w), strides=list(a.strides), padding=list(a.padding), dilation=list(a.dilation),
        groups=int(a.groups), data_layout=str(a.data_layout), kernel_layout=str(a.kernel_layout),
        out_layout=str(a.out_layout), out_dtype="int32"))
    return kind, str(a.out_layout).index("C"), acc


def _int32_bias(qg, comp, bias_b, kind: str, qx, qw, n_out: int, tensor: str):
    """``(int32 bias, its QTensor, the bindings it came through)`` of the bias add ``bias_b`` on
    ``comp``: a dequantized int32 constant, or a float one that ONNX Runtime quantizes itself;
    one ORT has no integer kernel for is refused (the span becomes a float span)."""
    other = bias_b.value.args[1] if bias_b.value.args[0].same_as(comp.var) else bias_b.value.args[0]
    fb = _float_bias(qg, other)
    if fb is not None:
        # a float bias (quantize_static's QuantizeBias=False): ORT quantizes it to int32 itself
        # (WeightBiasQuantization: QuantizeLinear(bias, float32(s_x * s_w[c]), 0, int32))
        bias, bq = _ort_bias_int32(fb[0], qx, qw, n_out)
        bchain = [qg.producer(other)] if qg.producer(other) is not None else []
    else:
        bias, bq, bchain = _const_chain(qg, other, tensor, "bias")
    if bias.dtype != np.int32:  # e.g. a bias initializer the exporter shared with a quantized Add
        raise IrgenError(f"{SCHEME}: bias of {tensor!r} is {bias.dtype}, not int32: no integer kernel "
                         "(ORT runs the node unit in float)")
    if np.any(bq.zero_point != 0):
        raise IrgenError(f"{SCHEME}: bias of {tensor!r} has a non-zero zero point")
    if kind != "dense" and not _is_torch(qg):
        _check_conv_bias_scale(qx, qw, bq, n_out, tensor)
    return bias, bq, bchain


def _torch_requant(qg, acc, ws: np.ndarray, fbias, out, lo: int, hi: int, ch_axis: int, ndim: int):
    """torch reference: the float op on dequantized values, ``float32(acc) * float32(s_x * s_w[c])``
    (+ the float bias), then quantize_per_tensor; ``(expr, requant record)``."""
    _, op, q, _ = _ops()
    e = qg.emit
    f = e(op.multiply(e(op.astype(e(op.astype(acc, "float32")), "float64")),
                      q.rx_const(q.per_axis(ws.astype(np.float64), ch_axis, ndim), "float64")))
    f = e(op.astype(f, "float32"))
    if fbias is not None:
        f = e(op.astype(e(op.add(e(op.astype(f, "float64")),
                                 q.rx_const(q.per_axis(fbias.astype(np.float64), ch_axis, ndim), "float64"))), "float32"))
    expr = _rx_torch_quantize(qg, f, out, lo, hi)
    inv = float(np.float32(1.0 / float(np.float32(out.scale[0]))))
    rq = {"scale": [float(v) for v in ws], "axis": ch_axis % ndim, "inverse_output_scale": inv,
          "float_bias": None if fbias is None else [float(v) for v in fbias], "rounding": "half_to_even",
          "rounding_rule": "y = clamp(round_half_even(float32(float32(float32(acc) * scale[c]) + float_bias[c]) "
                           "* inverse_output_scale) + zp_y, clamp); scale[c] = float32(s_x * s_w[c]) "
                           "(torch reference: float op on dequantized values, then quantize_per_tensor)"}
    return expr, rq


def _ort_bias_int32(bias: np.ndarray, qx, qw, n_out: int):
    """ONNX Runtime's int32 quantization of a float conv/Gemm bias (its WeightBiasQuantization
    transformer): scale ``float32(s_x * s_w[c])``, zero point 0, QuantizeLinear's
    ``saturate(round_half_even(bias / scale))``."""
    from irgen.plugin import QTensor

    scale = (np.float32(qx.scale[0]) * np.broadcast_to(qw.scale, (n_out,)).astype(np.float32)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.rint(bias.astype(np.float32) / scale)
    info = np.iinfo(np.int32)
    q = np.clip(np.nan_to_num(v, nan=0.0, posinf=info.max, neginf=info.min), info.min, info.max).astype(np.int32)
    axis = 0 if scale.size > 1 else None
    return q, QTensor(scale=scale if scale.size > 1 else scale[:1], zero_point=np.zeros(scale.size if axis == 0 else 1,
                                                                                          np.int32), dtype="int32", axis=axis)
