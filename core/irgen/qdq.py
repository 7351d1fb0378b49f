"""The QDQ realization engine: ONNX QuantizeLinear/DequantizeLinear (and torch's
reference-quantized) graphs in ONNX Runtime's integer arithmetic.

Schemes reach it through :func:`irgen.plugin.realize_qdq` (this module is
private): the ``qdq`` plugin realizes with it as is, ``pow2`` with its own
requantization of convolution and dense accumulators.

``onnxruntime.quantization.quantize_static(..., quant_format=QuantFormat.QDQ)``
writes DequantizeLinear -> float op -> QuantizeLinear spans; ONNX Runtime's CPU
provider fuses them into integer kernels (QLinearConv, QGemm, QLinearAdd,
QLinearAveragePool, QLinearGlobalAveragePool, QLinearConcat, QLinearMul,
QLinearSoftmax, lookup tables). For int8 activations compare with ORT created
with ``session.qdqisint8allowed=1`` (see docs/quantization.md).
The engine rewrites each span into the same integer arithmetic:

* Conv, Gemm, MatMul: int32 accumulation of ``(x - zp_x) * w`` plus the int32
  bias; MLAS requantization: ``float32(acc) * (s_x * s_w[c] / s_y)`` (float32),
  clamped to ``[lo - zp_y, hi - zp_y]``, rounded half to even, ``+ zp_y``;
  a Relu/Clip inside the span narrows the clamp;
* Add: ``fma(x_a, r_a, fma(x_b, r_b, zp_y - fma(r_a, zp_a, r_b*zp_b)))`` in
  float32 with ``r = s/s_y``, rounded half to even, saturated (MLAS QLinearAdd,
  AVX2 kernel);
* Mul: ``float32(float32((x_a - zp_a) * (x_b - zp_b)) * float32(s_a*s_b/s_y)) + zp_y``
  rounded half to even, saturated (MLAS QLinearMul);
* Softmax (last axis): QLinearSoftmax's float ``exp`` table, float32 row sum,
  ``rint(e * floor(1/s_y) / sum) + zp_y``;
* GlobalAveragePool: int32 sum minus ``zp_x * N`` requantized by ``s_x / (s_y * N)``;
* AveragePool: dequantized float average, quantized;
* elementwise unary ops (Sigmoid, Relu, ...), and any chain of elementwise ops
  on one dequantized tensor and constants (HardSigmoid as multiply, add, clip):
  a 256-entry lookup table of the chain evaluated in float32 (ORT runs such
  ops in float on the dequantized values, or as QLinearSigmoid's table);
* MatMul of two activations (attention's Q·Kᵀ, A·V): QLinearMatMul, int32
  ``sum((a - zp_a) * (b - zp_b))`` with the MLAS requantization above (kind ``matmul``);
* Concat: identity, or a lookup table per input whose parameters differ; an
  operand computed from constants is a literal (``constants``);
* MaxPool, Reshape, Flatten, Transpose, Squeeze, Gather/Slice with constant
  indices, with equal in/out parameters: as is.

The spans ``quantize_static`` writes around ops without an integer kernel are in
:mod:`irgen.qdq_spans`: Add/Mul with a quantized constant operand (QLinearAdd/
QLinearMul with an initializer), float layers (LayerNorm, BatchNorm left alone,
...: dequantize, the float ops, quantize; ``"realization": "float"``),
elementwise graphs on one tensor as tables (HardSwish, GELU's erf),
channel splits (Slice with shape-computed bounds), the items of a Split, a
Gather of a quantized embedding table by token ids, and QLinearMatMul.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from irgen.api import IrgenError

SCHEME = "qdq"
_MOVE = ("relax.nn.max_pool2d", "relax.reshape", "relax.permute_dims", "relax.flatten", "relax.squeeze",
         "relax.expand_dims", "relax.take", "relax.strided_slice")
_UNARY = {"relax.sigmoid": lambda v: np.float32(1) / (np.float32(1) + np.exp(-v)), "relax.tanh": np.tanh,
          "relax.nn.relu": lambda v: np.maximum(v, np.float32(0))}


def _ops():
    from tvm import relax
    from tvm.relax import op

    from irgen import quant as q
    from irgen.graph import Constant

    return relax, op, q, Constant


def _qparams(qg, call, tensor: str, channels: int | None = None):
    """Scale and zero point of a quantize/dequantize call, checked (irgen.quant.check_qparams)."""
    relax, _, q, Constant = _ops()
    scale, zp = call.args[1], call.args[2]
    if not isinstance(scale, Constant) or not isinstance(zp, Constant):
        raise IrgenError(f"{SCHEME}: tensor {tensor!r} has a scale or zero point that is not a constant: it is "
                         f"computed while the model runs (dynamic quantization, as onnxruntime's quantize_dynamic "
                         f"writes with DynamicQuantizeLinear); irgen needs static quantization parameters "
                         f"(onnxruntime's quantize_static, the TFLite converter's full-integer mode, torch's "
                         f"convert_fx)")
    dtype = str(call.attrs.out_dtype) if str(call.op.name) == "relax.quantize" else str(call.args[0].ty.dtype)
    qt = q.check_qparams(SCHEME, tensor, scale.value.numpy(), zp.value.numpy(), dtype, int(call.attrs.axis), channels)
    qt.range = qg.ranges.get(tensor)  # torch's reduce_range: a quantize that clamps to [0, 127]
    return qt


def _dequantized(qg, expr):
    """(int var, QTensor, dq binding name) when ``expr`` is dequantize(var)."""
    relax, _, _, _ = _ops()
    b = qg.producer(expr)
    if b is None or b.op != "relax.dequantize" or not isinstance(b.value.args[0], relax.Var):
        return None
    src = b.value.args[0]
    qt = _qparams(qg, b.value, src.name)
    if qt.scale.size != 1:
        raise IrgenError(f"{SCHEME}: activation {src.name!r} is quantized per channel; not supported")
    return src, qt, b.name


def _need(qg, expr, what: str, tensor: str):
    r = _dequantized(qg, expr)
    if r is None:
        raise IrgenError(f"{SCHEME}: {what} of {tensor!r} is not a dequantized integer tensor")
    return r


def _need_or_constant(qg, expr, what: str, tensor: str):
    """:func:`_need`, or for a per-tensor dequantized 8-bit constant (Swin V2's position-bias MLP
    multiplies a quantized constant table by its weights: ONNX Runtime's QLinearMatMul of two
    constants) the constant in the activation's place; TVM folds the layer into a literal, which
    the layer reading it records. A per-channel one has no integer kernel (ONNX Runtime runs the
    node unit in float: ``quantize_static``'s ``per_channel`` quantizes the table per channel too)."""
    relax, _, _, Constant = _ops()
    b = qg.producer(expr)
    if b is not None and b.op == "relax.dequantize" and isinstance(b.value.args[0], Constant) \
            and str(b.value.args[0].ty.dtype) in ("int8", "uint8"):
        qt = _qparams(qg, b.value, b.name)
        if qt.scale.size != 1:
            raise IrgenError(f"{SCHEME}: {what} of {tensor!r} is a per-channel constant; no integer kernel")
        return b.value.args[0], qt, b.name
    if isinstance(expr, Constant) and str(expr.ty.dtype).startswith("float"):
        # a 4-bit table (qdq-w4), whose DequantizeLinear the onnx frontend folds: ORT runs the op in float
        raise IrgenError(f"{SCHEME}: {what} of {tensor!r} is a float constant; no integer kernel")
    return _need(qg, expr, what, tensor)


def _const_chain(qg, expr, tensor: str, what: str):
    """Follow dequantize/reshape/permute_dims back to a constant: (array, QTensor, chain)."""
    _, _, q, _ = _ops()

    def qparams(b, arr):
        ax = int(b.value.attrs.axis) % max(arr.ndim, 1)
        return _qparams(qg, b.value, b.name, arr.shape[ax] if arr.ndim else 1)

    return q.follow_constant(qg, expr, qparams, SCHEME, what, tensor)


def _float_weights(qg, expr) -> bool:
    """``expr`` is a float32 constant, maybe behind reshapes and transposes (no dequantize)."""
    from irgen.graph import Constant

    for _ in range(8):
        if isinstance(expr, Constant):
            return str(expr.value.dtype) == "float32"
        b = qg.producer(expr)
        if b is None or b.op not in ("relax.reshape", "relax.permute_dims"):
            return False
        expr = b.value.args[0]
    return False


def _drop(qg, chain):
    return [b.name for b in chain if qg.n_users(b.name) == 1]


def _clamp_of(acts, dtype: str, out) -> tuple[int, int]:
    """Integer clamp range of the output (its dtype's, or the quantize's narrower range) narrowed
    by Relu/Clip inside the span."""
    lo, hi = out.lo, out.hi
    s, z = np.float32(out.scale[0]), int(out.zero_point[0])
    from irgen.quant import quantize_linear

    for b in acts:
        if b.op == "relax.nn.relu":
            lo = max(lo, z)
        else:
            lo = max(lo, int(quantize_linear(float(b.value.args[1].value), s, z, dtype)))
            hi = min(hi, int(quantize_linear(float(b.value.args[2].value), s, z, dtype)))
    return lo, hi


def _offset(qg, x, zp: int):
    _, op, q, _ = _ops()
    return qg.emit(op.subtract(qg.emit(op.astype(x, "int32")), q.rx_const(zp, "int32")))


def _lut(qg, x, table: np.ndarray, in_dtype: str):
    relax, op, q, _ = _ops()
    idx = qg.emit(op.subtract(qg.emit(op.astype(x, "int32")), q.rx_const(int(np.iinfo(in_dtype).min), "int32")))
    # the table as int32 then a cast: the IR's fused_ops keeps the literal without its dtype
    return op.astype(qg.emit(op.take(relax.const(table.astype(np.int32)), idx, axis=0, mode="clip")), str(table.dtype))


def _is_torch(qg) -> bool:
    return getattr(qg, "dialect", None) == "torch-qdq"


def _rx_torch_quantize(qg, f, out, lo=None, hi=None):
    """Relax: float32 ``f`` quantized the way torch's reference ops do (multiply by the inverse scale)."""
    _, op, q, _ = _ops()
    lo = out.lo if lo is None else lo
    hi = out.hi if hi is None else hi
    inv = np.float32(1.0 / float(np.float32(out.scale[0])))
    # float32 * float32 rounded once: an exact float64 product then a cast
    g = qg.emit(op.multiply(qg.emit(op.astype(f, "float64")), q.rx_const(np.float64(inv), "float64")))
    g = qg.emit(op.astype(g, "float32"))
    return q.rx_round_to_int(qg.emit, g, int(out.zero_point[0]), lo, hi, out.dtype)


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


#: unary ops a torch reference graph quantizes around, tabulated with torch's own kernel (ONNX Runtime
#: has no integer kernel for them: an ONNX span of one is a float span)
_TORCH_ONLY_UNARY = {"relax.nn.silu": "silu", "relax.nn.gelu": "gelu"}


def _torch_fn(op_name: str):
    """The float function torch runs for a unary op (its own vectorized kernels: numpy's
    ``exp`` differs from torch's sigmoid in the last bit for ~1 value in 6)."""
    import torch

    fn = {**_TORCH_ONLY_UNARY, "relax.sigmoid": torch.sigmoid, "relax.tanh": torch.tanh,
          "relax.nn.relu": torch.relu}[op_name]
    fn = getattr(torch.nn.functional, fn) if isinstance(fn, str) else fn
    return lambda v: fn(torch.from_numpy(np.ascontiguousarray(v, np.float32))).numpy()


def _table(qin, qout, fn=lambda v: v, torch_rule: bool = False) -> np.ndarray:
    """QlinearBuildLookupTable: quantize(fn(dequantize(i))) for every input value."""
    from irgen.quant import quantize_linear, torch_quantize

    info = np.iinfo(qin.dtype)
    i = np.arange(info.min, info.max + 1, dtype=np.int32)
    v = (i - np.int32(qin.zero_point[0])).astype(np.float32) * np.float32(qin.scale[0])
    if torch_rule:
        return torch_quantize(fn(v).astype(np.float32), np.float32(qout.scale[0]), int(qout.zero_point[0]), qout.lo,
                              qout.hi, qout.dtype)
    return quantize_linear(fn(v).astype(np.float32), np.float32(qout.scale[0]), int(qout.zero_point[0]), qout.dtype)


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
    relax, op, q, Constant = _ops()
    tensor = qb.name
    x, qx, dqx = _need_or_constant(qg, comp.value.args[0], "the input", tensor)
    if not _is_torch(qg) and _float_weights(qg, comp.value.args[1]):
        # 4-bit weights (the onnx frontend folds their DequantizeLinear: ORT runs the op in float)
        raise IrgenError(f"{SCHEME}: weights of {tensor!r} are float: no integer kernel")
    w, qw, wchain = _const_chain(qg, comp.value.args[1], tensor, "weights")
    w, w_offset = _weights_less_zero_point(w, qw, tensor)
    a = comp.value.attrs
    xs = _offset(qg, x, int(qx.zero_point[0]))
    if comp.op == "relax.matmul":
        kind, ch_axis = "dense", -1
        acc = qg.emit(op.matmul(xs, relax.const(w), out_dtype="int32"))
    else:
        kind = "depthwise_conv2d" if int(a.groups) > 1 and int(a.groups) == w.shape[0] else "conv2d"
        acc = qg.emit(op.nn.conv2d(
            xs, relax.const(w), strides=list(a.strides), padding=list(a.padding), dilation=list(a.dilation),
            groups=int(a.groups), data_layout=str(a.data_layout), kernel_layout=str(a.kernel_layout),
            out_layout=str(a.out_layout), out_dtype="int32"))
        ch_axis = str(a.out_layout).index("C")
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
        acc = qg.emit(op.add(acc, relax.const(q.per_axis(bias.reshape(-1), ch_axis, ndim).astype(np.int32))))
        drop += _drop(qg, bchain) + [bias_b.name]
        bias_rec = bq.record()
    w_scale = np.broadcast_to(qw.scale, (n_out,)).astype(np.float32)
    # ORT: output_scale[c] = (x_scale * w_scale[c]) / y_scale, in float32
    scale = (np.float32(qx.scale[0]) * w_scale) / np.float32(out.scale[0])
    lo, hi = _clamp_of(acts, out.dtype, out)
    if _is_torch(qg) and requant is None:
        # torch reference: float op on dequantized values (+ float bias), then quantize_per_tensor
        ws = (np.float32(qx.scale[0]) * w_scale).astype(np.float32)
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


def _ort_bias_int32(bias: np.ndarray, qx, qw, n_out: int):
    """ONNX Runtime's int32 quantization of a float conv/Gemm bias (its WeightBiasQuantization
    transformer): scale ``float32(s_x * s_w[c])``, zero point 0, QuantizeLinear's
    ``saturate(round_half_even(bias / scale))``."""
    from irgen.quant import QTensor

    scale = (np.float32(qx.scale[0]) * np.broadcast_to(qw.scale, (n_out,)).astype(np.float32)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.rint(bias.astype(np.float32) / scale)
    info = np.iinfo(np.int32)
    q = np.clip(np.nan_to_num(v, nan=0.0, posinf=info.max, neginf=info.min), info.min, info.max).astype(np.int32)
    axis = 0 if scale.size > 1 else None
    return q, QTensor(scale=scale if scale.size > 1 else scale[:1], zero_point=np.zeros(scale.size if axis == 0 else 1,
                                                                                          np.int32), dtype="int32", axis=axis)


def _dequantize_torch(qg, x, qx):
    """torch's dequantize_per_tensor: ``float32(x - zp) * float32(s)``, rounded once to float32."""
    _, op, q, _ = _ops()
    e = qg.emit
    f = e(op.astype(e(op.astype(_offset(qg, x, int(qx.zero_point[0])), "float32")), "float64"))
    return e(op.astype(e(op.multiply(f, q.rx_const(np.float64(np.float32(qx.scale[0])), "float64"))), "float32"))


def _realize_binary_torch(qg, qb, ins, comp, acts, out, kind: str):
    """torch reference: ``quantize_per_tensor(relu?(dequantize(a) <op> dequantize(b)))`` in float32,
    ``kind`` ``add`` or ``mul`` (RegNet's and EfficientNet's squeeze-excitation scaling)."""
    _, op, q, _ = _ops()
    rx_op, sym, word = {"add": (op.add, "+", "add"), "mul": (op.multiply, "*", "multiply")}[kind]
    (x1, q1, d1), (x2, q2, d2) = ins
    e = qg.emit
    a, b = (e(op.astype(_dequantize_torch(qg, x, qx), "float64")) for x, qx in ((x1, q1), (x2, q2)))
    # float64 holds the float32 operands' exact sum or product: one rounding, the cast to float32
    f = e(op.astype(e(rx_op(a, b)), "float32"))
    lo, hi = _clamp_of(acts, out.dtype, out)
    inv = float(np.float32(1.0 / float(np.float32(out.scale[0]))))
    # an operand quantized from a constant (MaxViT's relative position bias, computed by torch at
    # import): TVM folds it into a literal, so the record keeps its integers for the recompute
    consts = [_spans().constant_tensor(qg, x) for x in (x1, x2)]
    rec = {"scheme": SCHEME, "kind": kind, "reference": "torch", "inputs": [q1.record(), q2.record()],
           **({"constants": _spans().constants_record(consts)} if any(c is not None for c in consts) else {}),
           "output": out.record(), "requant": {"inverse_output_scale": inv, "rounding": "half_to_even",
           "rounding_rule": f"y = clamp(round_half_even(float32(deq(a) {sym} deq(b)) * inverse_output_scale) + zp_y, "
                            f"clamp); deq(x) = float32(x - zp_x) * s_x (torch: dequantize, float {word}"
                            f"{', relu' if kind == 'add' else ''}, quantize_per_tensor)"},
           "clamp": [lo, hi]}
    return [d1, d2, comp.name] + [b.name for b in acts] + [qb.name], _rx_torch_quantize(qg, f, out, lo, hi), rec


def _qlinear_add_constant(ra, rb, zp_a, zp_b, zp_y) -> np.float32:
    """MLAS's QLinearAdd fixed part, ``zp_y - (ratio_a * zp_a + ratio_b * zp_b)`` in float32
    as its AVX2 build computes it (the first product contracted into an fma)."""
    f32 = np.float32
    inner = f32(np.float64(ra) * np.float64(f32(zp_a)) + np.float64(f32(rb * f32(zp_b))))
    return f32(f32(zp_y) - inner)


def _chain_fn(chain, start: str):
    """A float32 function evaluating ``chain`` (numpy, irgen.reference's ops) on the values of ``start``."""
    from irgen.graph import attrs_to_dict
    from irgen.ir import arg_ref
    from irgen.reference import run_layer

    relax, _, _, _ = _ops()
    index = {b.name: j for j, b in enumerate(chain)}
    ops = []
    for b in chain:
        args = []
        for a in b.value.args:
            if isinstance(a, relax.Var):
                args.append("input:0" if a.name == start else f"op:{index[a.name]}")
            else:
                args.append(arg_ref(a, {}, []))
        ops.append({"relax_op": b.op, "attrs": attrs_to_dict(b.value.attrs) if b.value.attrs is not None else {},
                    "args": args})
    layer = {"name": chain[-1].name, "fused_ops": ops, "results": [f"op:{len(ops) - 1}"]}
    return lambda v: run_layer(layer, [np.asarray(v, np.float32)], {})[0].astype(np.float32)


def _torch_compound(chain, start: str):
    """``(name, torch function)`` when ``chain`` is how TVM's importer writes torch's hardsigmoid
    (``clip(x + 3, 0, 6) / 6``) or hardswish (``x * that``), else None. The table is then
    torch's own kernel: its hardswish rounds otherwise than those four float ops (16% of
    float32 inputs differ in the last bit)."""
    import torch

    relax, _, _, _ = _ops()

    def scalar(e):  # a constant, a scalar literal or a PrimValue, as a float
        v = getattr(e, "value", None)
        v = v.numpy() if hasattr(v, "numpy") else getattr(v, "value", v)
        try:
            a = np.asarray(v, np.float64)
        except (TypeError, ValueError):
            return None
        return float(a.reshape(-1)[0]) if a.size == 1 else None

    def is_var(e, name: str) -> bool:
        return isinstance(e, relax.Var) and e.name == name

    ops = [b.op for b in chain]
    if ops[:3] != ["relax.add", "relax.clip", "relax.divide"] or len(ops) > 4:
        return None
    add, clip, div = chain[:3]
    if not (is_var(add.value.args[0], start) and scalar(add.value.args[1]) == 3.0
            and is_var(clip.value.args[0], add.name) and scalar(clip.value.args[1]) == 0.0
            and scalar(clip.value.args[2]) == 6.0 and is_var(div.value.args[0], clip.name)
            and scalar(div.value.args[1]) == 6.0):
        return None
    if len(ops) == 3:
        name = "hardsigmoid"
    elif ops[3] == "relax.multiply" and sorted(getattr(a, "name", "") for a in chain[3].value.args) == sorted(
            [start, div.name]):
        name = "hardswish"
    else:
        return None
    f = getattr(torch.nn.functional, name)
    return name, lambda v: f(torch.from_numpy(np.ascontiguousarray(v, np.float32))).numpy()


def _realize_table_chain(qg, qb, found, out):
    """An elementwise float chain between a dequantize and the quantize, as a 256-entry table:
    ONNX Runtime runs such ops in float on the dequantized values, one value at a time."""
    (x, qx, dqx), chain = found
    if _is_torch(qg):
        compound = _torch_compound(chain, dqx)
        if compound is None:  # torch runs the chain in float: a float span, as any other
            return _spans().realize_float(qg, qb, qg.producer(qb.value.args[0]), out)
        name, fn = compound
        table = _table(qx, out, fn, torch_rule=True)
        rec = {"scheme": SCHEME, "kind": "lut", "reference": "torch", "op": name, "inputs": [qx.record()],
               "output": out.record(), "table": [int(v) for v in table],
               "requant": {"rounding": "half_to_even", "rounding_rule":
                           f"table[i - min] = quantize_per_tensor(torch.nn.functional.{name}(dequantize(i))) (torch)"}}
        return [dqx] + [b.name for b in chain] + [qb.name], _lut(qg, x, table, qx.dtype), rec
    table = _table(qx, out, _chain_fn(chain, dqx))
    ops = "+".join(b.op.removeprefix("relax.") for b in chain)
    rec = {"scheme": SCHEME, "kind": "lut", "op": ops, "inputs": [qx.record()], "output": out.record(),
           "table": [int(v) for v in table],
           "requant": {"rounding": "half_to_even",
                       "rounding_rule": f"table[i - min] = quantize({ops}(dequantize(i))) in float32"}}
    return [dqx] + [b.name for b in chain] + [qb.name], _lut(qg, x, table, qx.dtype), rec


def _realize_mul(qg, qb, comp, out):
    """MLAS QLinearMul (SSE2): ``rint(float32(float32(int32((a - zp_a) * (b - zp_b))) * r) + float32(zp_y))``
    with ``r = float32(float32(s_a * s_b) / s_y)``, saturated to the output type."""
    _, op, q, _ = _ops()
    tensor = qb.name
    if _is_torch(qg):
        return _realize_binary_torch(qg, qb, [_need(qg, a, "an input", tensor) for a in comp.value.args], comp, [],
                                     out, "mul")
    from irgen.qdq_spans import constants_record, operand

    (x1, q1, d1, c1), (x2, q2, d2, c2) = [operand(qg, a, tensor) for a in comp.value.args]
    ratio = np.float32(np.float32(np.float32(q1.scale[0]) * np.float32(q2.scale[0])) / np.float32(out.scale[0]))
    e = qg.emit
    prod = e(op.multiply(_offset(qg, x1, int(q1.zero_point[0])), _offset(qg, x2, int(q2.zero_point[0]))))
    f = e(op.multiply(e(op.astype(prod, "float32")), q.rx_const(ratio, "float32")))
    f = e(op.add(f, q.rx_const(float(out.zero_point[0]), "float32")))
    info = np.iinfo(out.dtype)
    expr = q.rx_round_to_int(e, f, 0, int(info.min), int(info.max), out.dtype)
    rec = {"scheme": SCHEME, "kind": "mul", "inputs": [q1.record(), q2.record()], "output": out.record(),
           **({"constants": constants_record([c1, c2])} if c1 is not None or c2 is not None else {}),
           "requant": {"scale": float(ratio), "rounding": "half_to_even",
                       "rounding_rule": "y = clamp(round_half_even(float32(float32((x_a - zp_a) * (x_b - zp_b)) * scale) "
                                        "+ float32(zp_y))); scale = float32(float32(s_a * s_b) / s_y) (MLAS QLinearMul)"},
           "clamp": [int(info.min), int(info.max)]}
    return d1 + d2 + [comp.name, qb.name], expr, rec


def _realize_softmax(qg, qb, comp, out):
    """ONNX Runtime's QLinearSoftmax (see ``irgen.quant.ort_softmax``)."""
    relax, op, q, _ = _ops()
    tensor = qb.name
    if _is_torch(qg):  # torch's softmax runs in float: the float span (no integer kernel)
        return None
    x, qx, dqx = _need(qg, comp.value.args[0], "the input", tensor)
    shape = [int(d) for d in x.ty.shape.values]
    axis = int(comp.value.attrs.axis) % len(shape)
    perm = None
    if axis != len(shape) - 1:  # ORT's opset-13 kernel transposes the axis last, and back
        perm = [d for d in range(len(shape)) if d != axis] + [axis]
        x = qg.emit(op.permute_dims(x, perm))
        shape = [shape[d] for d in perm]
    if qx.dtype != out.dtype:
        raise IrgenError(f"{SCHEME}: softmax {tensor!r} changes the integer type ({qx.dtype} -> {out.dtype})")
    signed = out.dtype == "int8"
    table = q.ort_softmax_table(float(qx.scale[0]), shape[-1], signed)
    e = qg.emit
    xi = e(op.astype(x, "int32"))
    idx = e(op.add(e(op.subtract(xi, e(op.max(xi, axis=[-1], keepdims=True)))),
                   q.rx_const(127 if signed else 255, "int32")))
    if signed:
        idx = e(op.bitwise_and(idx, q.rx_const(255, "int32")))
    ex = e(op.take(relax.const(table), idx, axis=0, mode="clip"))  # idx is in 0..255
    total = e(op.sum(ex, axis=[-1], keepdims=True))
    ys = float(np.floor(np.float32(1.0) / np.float32(out.scale[0])))
    # e * floor(1 / s_y) / sum in float64: finite for every output scale (in float32 the product
    # overflows when floor(1 / s_y) > n * e^5, a calibrated scale such as a MatMul input's)
    v = e(op.divide(e(op.multiply(e(op.astype(ex, "float64")), relax.const(ys, "float64"))),
                    e(op.astype(total, "float64"))))
    lo, hi = (-128, 127) if signed else (0, 255)
    vq = e(op.clip(e(op.add(e(op.round(v)), relax.const(float(out.zero_point[0]), "float64"))), lo, hi))
    vq = e(op.astype(vq, "int32"))
    if perm is not None:
        vq = e(op.permute_dims(vq, [perm.index(d) for d in range(len(perm))]))
    rec = {"scheme": SCHEME, "kind": "softmax", "axis": -1 if perm is None else axis, "inputs": [qx.record()],
           "output": out.record(),
           "table": "parameter 'table' (float32[256]): exp((i - 255 + b) * s_x), b = max(0, log(FLT_MAX / n) - 5) / s_x",
           "requant": {"rounding": "half_to_even",
                       "rounding_rule": "y = saturate(rint(e * floor(1 / s_y) / sum) + zp_y), e = table[x - max + 127 "
                                        "(int8) | 255 (uint8)], sum in float32 in row order, the quotient in "
                                        "float64 (ONNX Runtime's QLinearSoftmax)"}}
    return [dqx, comp.name, qb.name], op.astype(vq, out.dtype), rec


def _spans():
    from irgen import qdq_spans as spans

    return spans


def _or_float(qg, qb, f, out, realize, *args):
    """``realize`` an integer kernel; when an operand is no integer tensor (a per-channel or int32
    constant: ORT has no QLinear kernel for it), the float span as ORT runs it."""
    try:
        return realize(qg, qb, *args, out)
    except IrgenError as e:
        if _is_torch(qg) or "no integer kernel" not in str(e):
            raise
        return _spans().realize_float(qg, qb, f, out)


def _realize_add(qg, qb, comp, acts, out):
    _, op, q, _ = _ops()
    tensor = qb.name
    if _is_torch(qg):
        ins = [_need(qg, a, "an input", tensor) for a in comp.value.args]
        return _realize_binary_torch(qg, qb, ins, comp, acts, out, "add")
    from irgen.qdq_spans import constants_record, operand

    (x1, q1, d1, c1), (x2, q2, d2, c2) = [operand(qg, a, tensor) for a in comp.value.args]
    if c1 is not None and c1.size == 1 and (c2 is None or c2.size > 1):
        # QLinearAdd passes a scalar A to MLAS as its scalar B: the roles swap
        (x1, q1, d1, c1), (x2, q2, d2, c2) = (x2, q2, d2, c2), (x1, q1, d1, c1)
    sy = np.float32(out.scale[0])
    ra, rb = np.float32(q1.scale[0]) / sy, np.float32(q2.scale[0]) / sy
    const = _qlinear_add_constant(ra, rb, q1.zero_point[0], q2.zero_point[0], out.zero_point[0])
    e = qg.emit
    # MLAS (AVX2): fma(x_a, ratio_a, fma(x_b, ratio_b, constant)) in float32; float64 holds each fma exactly
    xa, xb = e(op.astype(x1, "float64")), e(op.astype(x2, "float64"))  # in this order: the layer's inputs follow it
    t = e(op.add(e(op.multiply(xb, q.rx_const(rb, "float64"))), q.rx_const(const, "float64")))
    t = e(op.astype(e(op.astype(t, "float32")), "float64"))
    f = e(op.add(e(op.multiply(xa, q.rx_const(ra, "float64"))), t))
    f = e(op.astype(f, "float32"))
    lo, hi = _clamp_of(acts, out.dtype, out)
    expr = q.rx_round_to_int(e, f, 0, lo, hi, out.dtype)
    rec = {"scheme": SCHEME, "kind": "add", "inputs": [q1.record(), q2.record()], "output": out.record(),
           **({"constants": constants_record([c1, c2])} if c1 is not None or c2 is not None else {}),
           "requant": {"scale": [float(ra), float(rb)], "constant": float(const), "rounding": "half_to_even",
                       "rounding_rule": "y = clamp(round_half_even(fma(x_a, scale[0], fma(x_b, scale[1], constant)))), "
                                        "each fma rounded once to float32; constant = float32(zp_y - "
                                        "fma(scale[0], zp_a, float32(scale[1] * zp_b))) (MLAS QLinearAdd, AVX2)"},
           "clamp": [lo, hi]}
    return d1 + d2 + [comp.name] + [b.name for b in acts] + [qb.name], expr, rec


def _realize_global_avg(qg, qb, comp, out):
    _, op, q, _ = _ops()
    tensor = qb.name
    x, qx, dqx = _need(qg, comp.value.args[0], "the input", tensor)
    if _is_torch(qg):  # torch reference: float mean of the dequantized input, then quantize_per_tensor
        rank = len(x.ty.shape.values)
        if (comp.op == "relax.mean" and (rank != 4 or sorted(int(a) % rank for a in comp.value.attrs.axis) != [2, 3])) \
                or (comp.op != "relax.mean" and [int(v) for v in comp.value.attrs.output_size] != [1, 1]):
            # a mean over other axes, an adaptive pool to more than one value (AlexNet's and VGG's to
            # 6x6 and 7x7): a float span
            return _spans().realize_float(qg, qb, comp, out)
        e = qg.emit
        deq = e(op.multiply(e(op.astype(_offset(qg, x, int(qx.zero_point[0])), "float32")), q.rx_const(qx.scale[0], "float32")))
        if comp.op == "relax.mean":
            m = e(op.mean(deq, axis=[int(a) for a in comp.value.attrs.axis], keepdims=bool(comp.value.attrs.keepdims)))
        else:
            m = e(op.nn.adaptive_avg_pool2d(deq, output_size=[int(v) for v in comp.value.attrs.output_size], layout="NCHW"))
        rec = {"scheme": SCHEME, "kind": "global_avg_pool_float", "reference": "torch", "axes": [2, 3],
               "op": comp.op.removeprefix("relax."), "inputs": [qx.record()],
               "output": out.record(), "requant": {"rounding": "half_to_even", "rounding_rule":
               "y = quantize_per_tensor(op(float32(x - zp_x) * s_x)): round_half_even(v * float32(1/s_y)) + zp_y"}}
        return [dqx, comp.name, qb.name], _rx_torch_quantize(qg, m, out), rec
    shape = [int(d) for d in x.ty.shape.values]
    if comp.op == "relax.mean":
        axes = [int(a) % len(shape) for a in comp.value.attrs.axis]
        if not bool(comp.value.attrs.keepdims):
            raise IrgenError(f"{SCHEME}: mean at {tensor!r} without keepdims is not supported")
    else:
        if [int(v) for v in comp.value.attrs.output_size] != [1, 1] or str(comp.value.attrs.layout) != "NCHW":
            raise IrgenError(f"{SCHEME}: adaptive average pool at {tensor!r} is not global; not supported")
        axes = [2, 3]
    count = int(np.prod([shape[a] for a in axes]))
    scale = np.float32(qx.scale[0]) / (np.float32(out.scale[0]) * np.float32(count))
    s = qg.emit(op.sum(qg.emit(op.astype(x, "int32")), axis=axes, keepdims=True))
    acc = qg.emit(op.subtract(s, q.rx_const(int(qx.zero_point[0]) * count, "int32")))
    info = np.iinfo(out.dtype)
    expr = q.rx_requantize_float(qg.emit, acc, scale, int(out.zero_point[0]), int(info.min), int(info.max), out.dtype)
    rec = {"scheme": SCHEME, "kind": "global_avg_pool", "inputs": [qx.record()], "output": out.record(),
           "axes": axes, "requant": {"scale": float(scale), "count": count, "rounding": "half_to_even",
                                     "rounding_rule": "round_half_even(float32(sum(x) - zp_x*count) * s_x/(s_y*count)) + zp_y"},
           "clamp": [int(info.min), int(info.max)]}
    return [dqx, comp.name, qb.name], expr, rec


def _window_mean(qg, deq, a):
    """NCHW average pool in float32 with each window summed in row-major order: padding (and in
    ceil mode zeros past it for the last windows), then one strided slice per window offset added
    in turn, divided by the per-position count (:func:`irgen.quant.pool_windows`)."""
    relax, op, q, _ = _ops()
    e = qg.emit
    n, c, h, w = [int(d) for d in deq.ty.shape.values]
    p = _pool_record(a)
    (kh, kw), (sh, sw), (oh, ow), (pt, pl, pb, pr), count = q.pool_windows((h, w), p)
    xp = e(op.nn.pad(deq, [0, 0, 0, 0, pt, pb, pl, pr])) if (pt, pl, pb, pr) != (0, 0, 0, 0) else deq
    total = None
    for i in range(kh):
        for j in range(kw):
            win = e(op.strided_slice(xp, [2, 3], [i, j], [i + sh * (oh - 1) + 1, j + sw * (ow - 1) + 1], [sh, sw]))
            total = win if total is None else e(op.add(total, win))
    if np.all(count == count.flat[0]):
        return e(op.divide(total, q.rx_const(count.flat[0], "float32")))
    return e(op.divide(total, relax.const(count)))


def _pool_record(a) -> dict:
    """An average pool's attributes as its layer's ``quant.pool`` records them."""
    return {"size": [int(v) for v in a.pool_size], "strides": [int(v) for v in a.strides],
            "padding": [int(v) for v in a.padding], "count_include_pad": bool(a.count_include_pad),
            **({"ceil_mode": True} if bool(a.ceil_mode) else {}), "layout": "NCHW"}


def _uniform_count(a) -> bool:
    """Every window of the pool counts the same number of values (no padding, or padding counted)."""
    return bool(a.count_include_pad) or all(int(v) == 0 for v in a.padding)


def _realize_avg_pool(qg, qb, comp, out):
    relax, op, q, _ = _ops()
    tensor = qb.name
    x, qx, dqx = _need(qg, comp.value.args[0], "the input", tensor)
    a = comp.value.attrs
    if _is_torch(qg) and str(a.layout) == "NCHW" and (bool(a.ceil_mode) or any(int(d) != 1 for d in a.dilation)):
        return _spans().realize_float(qg, qb, comp, out)  # timm's ResNet-D shortcut pool (ceil mode): a float span
    if str(a.layout) != "NCHW" or any(int(d) != 1 for d in a.dilation):
        raise IrgenError(f"{SCHEME}: average pool at {tensor!r} with layout {a.layout} or dilation; not supported")
    e = qg.emit
    deq = e(op.multiply(e(op.astype(_offset(qg, x, int(qx.zero_point[0])), "float32")), q.rx_const(qx.scale[0], "float32")))
    if bool(a.ceil_mode):  # timm's ResNet-D shortcut (AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False))
        shape = [int(d) for d in comp.var.ty.shape.values][2:]
        if list(q.pool_windows([int(d) for d in deq.ty.shape.values][2:], _pool_record(a))[2]) != shape:
            raise IrgenError(f"{SCHEME}: average pool at {tensor!r}: ceil mode gives another output size than {shape}")
        avg = _window_mean(qg, deq, a)
    elif _is_torch(qg) or not _uniform_count(a):
        avg = e(op.nn.avg_pool2d(deq, pool_size=list(a.pool_size), strides=list(a.strides), padding=list(a.padding),
                                 dilation=list(a.dilation), ceil_mode=False, count_include_pad=bool(a.count_include_pad),
                                 layout="NCHW"))
    else:  # the window's values added in row-major order in float32, as explicit ops (irgen.quant._avg_pool_in_order)
        avg = _window_mean(qg, deq, a)
    info = np.iinfo(out.dtype)
    if _is_torch(qg):  # torch: the window summed in row-major order in float32, / count, quantize_per_tensor
        expr = _rx_torch_quantize(qg, avg, out)
    else:  # ORT's QLinearAveragePool: rint(y / s_y + zp_y) in float32, saturated
        f = e(op.add(e(op.divide(avg, q.rx_const(out.scale[0], "float32"))),
                     q.rx_const(float(out.zero_point[0]), "float32")))
        expr = q.rx_round_to_int(e, f, 0, int(info.min), int(info.max), out.dtype)  # zp already in f, as _realize_mul
    rec = {"scheme": SCHEME, "kind": "avg_pool2d", "inputs": [qx.record()], "output": out.record(),
           **({"reference": "torch"} if _is_torch(qg) else {}),
           "pool": _pool_record(a),
           "requant": {"rounding": "half_to_even",
                       "rounding_rule": ("y = quantize(mean of float32 (x - zp_x) * s_x over the window)" if _is_torch(qg)
                                         else "y = saturate(rint(m / s_y + zp_y)), m the float32 mean of (x - zp_x) * s_x "
                                              "over the window's values in row order (ORT's QLinearAveragePool)")},
           "clamp": [int(info.min), int(info.max)]}
    return [dqx, comp.name, qb.name], expr, rec


def _realize_unary(qg, qb, comp, out):
    tensor = qb.name
    x, qx, dqx = _need(qg, comp.value.args[0], "the input", tensor)
    if comp.op == "relax.clip":
        lo_v, hi_v = np.float32(comp.value.args[1].value), np.float32(comp.value.args[2].value)
        fn = lambda v: np.clip(v, lo_v, hi_v)  # noqa: E731
    else:
        fn = _torch_fn(comp.op) if _is_torch(qg) else _UNARY[comp.op]
    table = _table(qx, out, fn, _is_torch(qg))
    rec = {"scheme": SCHEME, "kind": "lut", "op": comp.op.removeprefix("relax."), "inputs": [qx.record()],
           **({"reference": "torch"} if _is_torch(qg) else {}),
           "output": out.record(), "table": [int(v) for v in table],
           "requant": {"rounding": "half_to_even",
                       "rounding_rule": "table[i - min] = quantize(f(dequantize(i))) in float32 (QlinearBuildLookupTable)"}}
    return [dqx, comp.name, qb.name], _lut(qg, x, table, qx.dtype), rec


def _realize_concat(qg, qb, comp, out):
    relax, op, _, _ = _ops()
    tensor = qb.name
    ins, given = [], []
    for f in comp.value.args[0].fields:
        qc = None if _is_torch(qg) else _spans().quantized_constant(qg, f)
        if qc is not None:  # a constant quantized at run time (the class token, folded by the importer)
            ins.append((None, qc[1], qc[2]))
            given.append(qc[0])
            continue
        r = _dequantized(qg, f)
        if r is None and not _is_torch(qg) and _float_operand(qg, f):
            # a float input (an op quantize_static left out of op_types_to_quantize): ORT concatenates in float
            raise IrgenError(f"{SCHEME}: an input of {tensor!r} is computed in float; no integer kernel")
        if r is None and not _is_torch(qg):  # a dequantized constant (a folded class token): QLinearConcat's input
            arr, qt, chain = _const_chain(qg, f, tensor, "an input")
            if qt.scale.size != 1:
                raise IrgenError(f"{SCHEME}: an input of {tensor!r} is a per-channel constant; not supported")
            ins.append((None, qt, _drop(qg, chain)))
            given.append(arr)
            continue
        if r is None:
            r = _need(qg, f, "an input", tensor)
        ins.append((r[0], r[1], [r[2]]))
        given.append(None)
    parts, tables, consts = [], [], []
    for k, (x, qx, _) in enumerate(ins):
        if qx.dtype != out.dtype:
            raise IrgenError(f"{SCHEME}: concatenation {tensor!r} mixes {qx.dtype} and {out.dtype}")
        c = given[k] if given[k] is not None else _spans().constant_tensor(qg, x)
        consts.append(None)
        if c is not None:  # computed from constants (ViT's class token): a literal, as TVM folds it
            if qx.scale[0] != out.scale[0] or qx.zero_point[0] != out.zero_point[0]:
                c = _table(qx, out, torch_rule=_is_torch(qg))[c.astype(np.int64) - int(np.iinfo(qx.dtype).min)]
            consts[k] = c.astype(out.dtype)
            parts.append(relax.const(consts[k]))
            tables.append(None)
            ins[k] = (None, qx, ins[k][2])
        elif qx.scale[0] == out.scale[0] and qx.zero_point[0] == out.zero_point[0]:
            parts.append(x)
            tables.append(None)
        else:
            t = _table(qx, out, torch_rule=_is_torch(qg))
            parts.append(qg.emit(_lut(qg, x, t, qx.dtype)))
            tables.append([int(v) for v in t])
    axis = int(comp.value.attrs.axis)
    # the layer's inputs are the tabled operands (their lookups are bound first), then the others, each once:
    # ``operands[k]`` is the layer input that is operand k (inputs[k] and tables[k] describe operand k)
    names = [getattr(x, "name", None) if isinstance(x, relax.Var) else None for x, _, _ in ins]
    order: list[str] = []
    for tabled in (True, False):
        order += [n for n, t in zip(names, tables) if n is not None and (t is not None) == tabled and n not in order]
    rec = {"scheme": SCHEME, "kind": "concatenate", "axis": axis, "inputs": [qx.record() for _, qx, _ in ins],
           **({"reference": "torch"} if _is_torch(qg) else {}),
           "output": out.record(), "tables": tables,
           "operands": [order.index(n) if n is not None else None for n in names],
           **({"constants": _spans().constants_record(consts)} if any(c is not None for c in consts) else {}),
           "requant": {"rounding": "half_to_even", "rounding_rule": "inputs with other parameters: table[i - min] = "
                       "quantize(dequantize(i)) (QLinearConcat)"}}
    expr = op.concat(parts, axis=axis)
    if any(c is not None for c in consts):  # in int32, then narrowed: the IR's fused_ops keep a literal without its dtype
        wide = [relax.const(c.astype(np.int32)) if c is not None else qg.emit(op.astype(p, "int32"))
                for c, p in zip(consts, parts)]
        expr = op.astype(qg.emit(op.concat(wide, axis=axis)), out.dtype)
    return [d for _, _, ds in ins for d in ds] + [comp.name, qb.name], expr, rec


def _realize_move(qg, qb, comp, out):
    relax, _, _, _ = _ops()
    tensor = qb.name
    x, qx, dqx = _need(qg, comp.value.args[0], "the input", tensor)
    differ = qx.scale[0] != out.scale[0] or qx.zero_point[0] != out.zero_point[0] or qx.dtype != out.dtype
    torch = _is_torch(qg)
    if differ:
        # dequantize -> the move in float -> quantize with other parameters: per element, so a table then
        # the move on the integers. ORT runs such a node unit in float (its integer Slice/Transpose/MaxPool
        # need equal parameters), as torch's reference graph does (Inception V3's pool branch into a
        # concat); a max pool commutes with the table, which never decreases.
        table = _table(qx, out, torch_rule=torch)
        xt = qg.emit(_lut(qg, x, table, qx.dtype))
        v = comp.value
        expr = relax.Call(v.op, [xt] + list(v.args[1:]), v.attrs, v.sinfo_args if hasattr(v, "sinfo_args") else None)
        rule = ("table[i - min] = quantize_per_tensor(dequantize(i)) (torch), then the data movement" if torch else
                "table[i - min] = quantize(dequantize(i)) in float32 (DequantizeLinear, QuantizeLinear), then the "
                "data movement")
        rec = {"scheme": SCHEME, "kind": "lut", **({"reference": "torch"} if torch else {}),
               "op": comp.op.removeprefix("relax."), "inputs": [qx.record()], "output": out.record(),
               "table": [int(t) for t in table], "requant": {"rounding": "half_to_even", "rounding_rule": rule}}
        return [dqx, comp.name, qb.name], expr, rec
    v = comp.value
    expr = relax.Call(v.op, [x] + list(v.args[1:]), v.attrs, v.sinfo_args if hasattr(v, "sinfo_args") else None)
    rec = {"scheme": SCHEME, "kind": "integer", "op": comp.op.removeprefix("relax.").removeprefix("nn."),
           "inputs": [qx.record()], "output": out.record()}
    return [dqx, comp.name, qb.name], expr, rec


def _realize_requantize(qg, qb, comp, out):
    """A dequantize straight into a quantize (torch's reference graph around an op the importer
    drops, such as an eval-mode dropout that torch's FX quantization observed on its own; an ONNX
    DQ -> Q pair): per element, so a table, with the frontend's quantize rule."""
    x, qx, dqx = _need(qg, comp.var, "the input", qb.name)
    torch = _is_torch(qg)
    table = _table(qx, out, torch_rule=torch)
    rule = ("table[i - min] = quantize_per_tensor(dequantize(i)) (torch)" if torch else
            "table[i - min] = quantize(dequantize(i)) in float32 (DequantizeLinear, QuantizeLinear)")
    rec = {"scheme": SCHEME, "kind": "lut", **({"reference": "torch"} if torch else {}), "op": "requantize",
           "inputs": [qx.record()], "output": out.record(), "table": [int(t) for t in table],
           "requant": {"rounding": "half_to_even", "rounding_rule": rule}}
    return [dqx, qb.name], _lut(qg, x, table, qx.dtype), rec


def _realize_quantize(qg, qb, out):
    _, op, q, _ = _ops()
    x = qb.value.args[0]
    if _is_torch(qg):
        rec = {"scheme": SCHEME, "kind": "quantize", "reference": "torch", "inputs": [], "output": out.record(),
               "clamp": [out.lo, out.hi], "requant": {"rounding": "half_to_even",
                           "rounding_rule": "y = saturate(round_half_even(x * float32(1/scale)) + zp) (torch)"}}
        return [qb.name], _rx_torch_quantize(qg, x, out), rec
    info = np.iinfo(out.dtype)
    f = qg.emit(op.divide(x, q.rx_const(out.scale[0], "float32")))
    expr = q.rx_round_to_int(qg.emit, f, int(out.zero_point[0]), int(info.min), int(info.max), out.dtype,
                             nan_to_lo=True)
    rec = {"scheme": SCHEME, "kind": "quantize", "inputs": [], "output": out.record(),
           "requant": {"rounding": "half_to_even",
                       "rounding_rule": "y = saturate(round_half_even(x / scale) + zp); NaN -> the type's minimum"}}
    return [qb.name], expr, rec


def _float_operand(qg, expr) -> bool:
    """``expr`` is a float tensor computed by float ops (not a dequantize, nor from constants)."""
    relax, _, _, _ = _ops()
    b = qg.producer(expr) if isinstance(expr, relax.Var) else None
    return b is not None and b.op != "relax.dequantize" and _spans().constant_value(qg, expr) is None \
        and _spans().quantized_constant(qg, expr) is None


def _still_read(qg, names: list[str], last: str) -> list[str]:
    """``names`` less the bindings another op outside the span still reads (a float HardSwish whose
    result both a table span and a float GlobalAveragePool read), and what those read."""
    drop = set(names)
    while True:
        inside = drop | {last}
        keep = {n for n in drop if qg.n_users(n) > sum(qg.bindings[i].name in inside for i in qg.users.get(n, []))}
        if not keep:
            return [n for n in names if n in drop]
        drop -= keep


def realize(qg, scheme: str = SCHEME, conv_requant=None) -> None:
    """Realize every DQ -> op -> Q span of ``qg`` (a :class:`irgen.quant.QGraph`) in place; ``conv_requant(qg, acc, scale, out, lo, hi, axis, ndim, tensor)``
    replaces ONNX Runtime's float requantization of conv/dense accumulators
    (returning the expression and the record's ``requant``), and ``scheme``
    names the records (both for schemes built on this one, such as ``pow2``)."""
    _realize(qg, conv_requant)
    for rec in qg.quant.values():
        rec["scheme"] = scheme


def _realize(qg, conv_requant) -> None:
    """Each quantize's span realized (:func:`_realize_one`), from the first again after every
    replacement, then the dequantizes left (:func:`_dequantize_rest`)."""
    if not _is_torch(qg):
        _spans().drop_dead_items(qg)
        _spans().static_shape_of(qg)
    i = 0
    while i < len(qg.bindings):
        b = qg.bindings[i]
        i += 1
        if b.op == "relax.quantize" and _realize_one(qg, b, conv_requant):
            i = 0
    _dequantize_rest(qg)


@dataclass
class _Span:
    """The span a quantize ``b`` ends: ``f`` the op it quantizes, ``out`` its output parameters,
    ``comp`` the compute op under the Relu/Clip ops ``acts`` and the bias add ``bias_b`` folded
    into it, ``chain`` the elementwise graph on one dequantized tensor ending at ``f`` (or None)."""

    qg: Any
    b: Any
    f: Any
    out: Any
    comp: Any
    acts: list
    bias_b: Any
    chain: Any
    conv_requant: Any
    torch: bool


def _realize_one(qg, b, conv_requant) -> bool:
    """The span of quantize ``b`` replaced by its integer realization; False when ``b`` is left
    (a constant quantized at run time: its consumers take the integers)."""
    f = qg.producer(b.value.args[0])
    out = _qparams(qg, b.value, b.name, None)
    if out.scale.size != 1:
        raise IrgenError(f"{SCHEME}: activation {b.name!r} is quantized per channel; not supported")
    if not _is_torch(qg) and _spans().constant_value(qg, b.value.args[0]) is not None:
        return False  # a constant quantized at run time: its consumers take the integers (spans.quantized_constant)
    if f is None:
        names, expr, rec = _realize_quantize(qg, b, out)
        qg.replace(names, expr, rec)
        return True
    s = _span(qg, b, f, out, conv_requant)
    names, expr, rec = _realize_span(s)
    _commit(qg, names, expr, rec)
    if s.comp.op == "relax.dynamic_strided_slice":
        _spans().retype(qg)
    return True


def _activations(qg, f) -> tuple[list, Any]:
    """The Relu/Clip ops (one user each) on an add, conv, matmul, Relu or Clip, from ``f`` down,
    and the op under them."""
    acts, comp = [], f
    while comp is not None and comp.op in ("relax.nn.relu", "relax.clip") and qg.n_users(comp.name) == 1:
        p = qg.producer(comp.value.args[0])
        if p is None or p.op not in ("relax.add", "relax.nn.conv2d", "relax.matmul", "relax.nn.relu", "relax.clip"):
            break
        acts.insert(0, comp)
        comp = p
    return acts, comp


def _bias_add(qg, comp) -> tuple[Any, Any]:
    """``(conv or matmul, its bias add)`` when ``comp`` adds a bias (a dequantized or reshaped
    operand; torch: a constant) to a conv/matmul it alone reads; else ``(comp, None)``."""
    if comp.op != "relax.add":
        return comp, None
    Constant = _ops()[3]
    p0, p1 = (qg.producer(a) for a in comp.value.args)
    for cand, other in ((p0, p1), (p1, p0)):
        operand = comp.value.args[1 if cand is p0 else 0]
        # torch: a float bias constant; ONNX: a Gemm's float bias (QuantizeBias=False), which ORT quantizes
        other_ok = (other is not None and other.op in ("relax.dequantize", "relax.reshape")) or (
            other is None and isinstance(operand, Constant)
            and (_is_torch(qg) or str(operand.ty.dtype) == "float32"))
        if cand is not None and cand.op in ("relax.nn.conv2d", "relax.matmul") and other_ok \
                and qg.n_users(cand.name) == 1:
            return cand, comp
    return comp, None


def _span(qg, b, f, out, conv_requant) -> _Span:
    """The span quantize ``b`` of ``f``'s result ends (see :class:`_Span`)."""
    acts, comp = _activations(qg, f)
    comp, bias_b = _bias_add(qg, comp)
    chain = None if bias_b is not None or comp.op in ("relax.nn.conv2d", "relax.matmul") \
        else _spans().elementwise_dag(qg, f)
    return _Span(qg, b, f, out, comp, acts, bias_b, chain, conv_requant, _is_torch(qg))


# ---------------------------------------------------------------- realizers, keyed by op kind
# each takes a _Span and returns (names, expr, rec), or None when the span is not its case


def _table_chain(s: _Span):
    """An elementwise graph on one dequantized tensor (more than one unary op): one lookup table."""
    if s.chain is not None and not (len(s.chain[1]) == 1 and (s.f.op in _UNARY or s.f.op == "relax.clip")):
        return _realize_table_chain(s.qg, s.b, s.chain, s.out)
    return None


def _split_item(s: _Span):
    """One item of a Split (ONNX; torch's ``chunk``: quantize_per_tensor of a dequantized value with
    the same parameters gives the integers back, so the item is a slice of them too)."""
    if _spans().split_item(s.qg, s.f) is not None:
        return _spans().realize_split_item(s.qg, s.b, s.f, s.out)
    return None


def _activation_matmul(s: _Span):
    """MatMul of two activations (QLinearMatMul)."""
    rhs = s.comp.value.args[1]
    if s.bias_b is None and not s.acts and _dequantized(s.qg, rhs) is not None \
            and _spans().quantized_constant(s.qg, rhs) is None:
        if s.torch:  # torch multiplies the dequantized operands in float (LeViT's q @ k^T), not as QLinearMatMul
            return _spans().realize_float(s.qg, s.b, s.f, s.out)
        return _spans().realize_matmul(s.qg, s.b, s.comp, s.out)
    return None


def _gather_table(s: _Span):
    """A Gather of a quantized embedding table by token ids (ONNX)."""
    if not s.torch and _spans().gathered_table(s.qg, s.comp) is not None:
        return _spans().realize_gather_table(s.qg, s.b, s.comp, s.out)
    return None


def _conv(s: _Span):
    """Conv, Gemm, MatMul with a constant operand, with its bias and activations (or the float span)."""
    return _or_float(s.qg, s.b, s.f, s.out,
                     lambda qg_, b_, out_: _realize_conv(qg_, b_, s.comp, s.bias_b, s.acts, out_, s.conv_requant))


def _add(s: _Span):
    """Add, with the Relu/Clip after it (torch: add, relu, quantize), or the float span."""
    return _or_float(s.qg, s.b, s.f, s.out, _realize_add, s.comp, s.acts)


def _activation(s: _Span):
    """A Relu/Clip on a Relu/Clip the chain stopped at: the first activation as a table (two: refused)."""
    if not s.acts:
        return None
    found = _realize_unary(s.qg, s.b, s.acts[0], s.out)
    if len(s.acts) > 1:
        raise IrgenError(f"{SCHEME}: chained activations at {s.b.name!r}; not supported")
    return found


def _float_mean(s: _Span):
    """ReduceMean without keepdims: float in ORT (ONNX)."""
    if not bool(s.comp.value.attrs.keepdims) and not s.torch:
        return _spans().realize_float(s.qg, s.b, s.f, s.out)
    return None


def _float_fed(s: _Span):
    """An op whose quantized span needs a dequantized input (mean, average pools, softmax, the ops
    of :data:`_MOVE`) on a float tensor (ONNX QOperator models leave GlobalAveragePool after a float
    HardSwish, a Gather after LayerNorm): ORT's float op, then QuantizeLinear."""
    if not s.torch and _float_operand(s.qg, s.comp.value.args[0]):
        return _realize_quantize(s.qg, s.b, s.out)
    return None


def _kernel(realize):
    """The realizer that is ``realize(qg, qb, comp, out)``: the integer kernel of the compute op
    (GlobalAveragePool, AveragePool, Concat, the ops that move integers, unary tables, Softmax)."""

    def realizer(s: _Span):
        return realize(s.qg, s.b, s.comp, s.out)

    return realizer


def _slice(s: _Span):
    """A channel split by a Slice with shape-computed bounds (ONNX)."""
    if not s.torch:
        return _spans().realize_slice(s.qg, s.b, s.comp, s.out)
    return None


def _torch_unary(s: _Span):
    """silu, gelu in a torch reference graph: a table of torch's kernel (ONNX: no answer, a float span)."""
    if not s.torch or (s.comp.op == "relax.nn.gelu" and getattr(s.comp.value.attrs, "approximate", "none") != "none"):
        return None
    return _realize_unary(s.qg, s.b, s.comp, s.out)


def _concat(s: _Span):
    """Concat (QLinearConcat), or the float span when an input is float (ONNX)."""
    return _or_float(s.qg, s.b, s.f, s.out, _realize_concat, s.comp)


def _mul(s: _Span):
    """Mul (QLinearMul), or the float span."""
    return _or_float(s.qg, s.b, s.f, s.out, _realize_mul, s.comp)


#: realizers tried on every span before its op kind's
_ANY_KIND = (_table_chain, _split_item)
#: op kind (the compute op's Relax name) -> its realizers, tried in order; the first that
#: answers realizes the span
_REALIZERS = {
    **{kind: (_float_fed, _kernel(_realize_move)) for kind in _MOVE},  # MaxPool, Reshape, Transpose...
    **{kind: (_kernel(_realize_unary),) for kind in _UNARY},  # Sigmoid, Tanh: lookup tables
    "relax.matmul": (_activation_matmul, _conv),
    "relax.take": (_gather_table, _float_fed, _kernel(_realize_move)),
    "relax.nn.conv2d": (_conv,),
    "relax.add": (_add,),
    "relax.nn.relu": (_activation, _kernel(_realize_unary)),
    "relax.clip": (_activation, _kernel(_realize_unary)),
    "relax.mean": (_float_mean, _float_fed, _kernel(_realize_global_avg)),
    "relax.nn.adaptive_avg_pool2d": (_float_fed, _kernel(_realize_global_avg)),
    "relax.nn.avg_pool2d": (_float_fed, _kernel(_realize_avg_pool)),
    "relax.concat": (_concat,),
    "relax.dynamic_strided_slice": (_slice,),
    "relax.nn.softmax": (_float_fed, _kernel(_realize_softmax)),
    "relax.multiply": (_mul,),
    "relax.dequantize": (_kernel(_realize_requantize),),
    **{kind: (_torch_unary,) for kind in _TORCH_ONLY_UNARY},  # torch: SiLU, GELU tables
}


def _no_kernel(s: _Span):
    """A span no realizer answers: dequantize, the float ops, quantize (ONNX: ORT has no integer
    kernel for it; torch: its reference graph runs every op between them in float)."""
    return _spans().realize_float(s.qg, s.b, s.f, s.out)


#: why an integer realizer declines a torch span whose operand is computed in float (a BatchNorm
#: after a concatenation, a layer scale): torch runs the span in float, so the float span follows
_FLOAT_OPERAND = ("is not a dequantized integer tensor", "no integer kernel")


def _realize_span(s: _Span):
    """``(names, expr, rec)``: the bindings the span replaces, its integer expression and record.
    A span whose float ops read a tensor that is not quantized (a model quantized only in part:
    its float ops compute from the model input) is no span: those ops stay float layers, as ORT
    runs them, and the quantize quantizes their float result."""
    try:
        return _realize_span_kinds(s)
    except _spans().UnquantizedSource:
        return _realize_quantize(s.qg, s.b, s.out)


#: activation types ONNX Runtime has no QLinear kernels for (``quantize_static`` with
#: ``activation_type=QInt16``/``QUInt16``): it runs every such span in float
_WIDE = ("int16", "uint16")


def _wide_activations(s: _Span) -> bool:
    """The span quantizes to, or computes from, a 16-bit activation (ONNX)."""
    if s.torch:
        return False
    if s.out.dtype in _WIDE:
        return True
    first = s.comp.value.args[0] if getattr(s.comp.value, "args", None) else None
    d = _dequantized(s.qg, first) if first is not None else None
    return d is not None and d[1].dtype in _WIDE


def _realize_span_kinds(s: _Span):
    if _wide_activations(s) and s.comp.op not in _MOVE:
        # ORT's integer kernels are 8-bit: a 16-bit span is DequantizeLinear, the float op, QuantizeLinear
        # (a split item or a data movement stays a move of the integers, the same values)
        return _split_item(s) or _no_kernel(s)
    for realizer in (*_ANY_KIND, *_REALIZERS.get(s.comp.op, ())):
        try:
            found = realizer(s)
        except _spans().UnquantizedSource:
            raise
        except IrgenError as err:
            if not s.torch or not any(w in str(err) for w in _FLOAT_OPERAND):
                raise
            return _no_kernel(s)
        if found is not None:
            return found
    return _no_kernel(s)


def _commit(qg, names: list[str], expr, rec) -> None:
    """Replace the span's bindings (less a dequantize other ops read too, and what an op outside the
    span still reads) by ``expr``."""
    keep_last = names[-1]
    names = [n for n in dict.fromkeys(names[:-1]) if qg.n_users(n) <= 1 or qg.by_name[n].op != "relax.dequantize"]
    names = _still_read(qg, names, keep_last)
    qg.replace(names + [keep_last], expr, rec)


def _dequantize_rest(qg) -> None:
    """The dequantizes left (of activations or, in ONNX, per-tensor constants feeding float ops or
    the model output) in integer arithmetic; a quantize left is an error."""
    relax, op, q, _ = _ops()
    # what realized spans left unread: a dequantize a span read twice (hardswish's x and x * ...), a
    # split whose items are realized, shape computations of realized slices
    _spans().drop_dead(qg)
    for b in list(qg.bindings):
        if b.op == "relax.quantize":
            found = None if _is_torch(qg) else _spans().run_time_quantized(qg, b)
            if found is None:
                raise IrgenError(f"{SCHEME}: quantize at tensor {b.name!r} is left after folding")
            # a constant quantized at run time whose integers an integer op reads as they are (a
            # gather of Swin V2's position-bias table, GPT-J's rotary table): its integers
            if found[0] is None:
                raise IrgenError(f"{SCHEME}: constant {b.name!r} is quantized per channel at run time; not supported")
            qg.replace([b.name], relax.const(found[0]))  # a constant: the layers reading it record its integers
            continue
        if b.op != "relax.dequantize":
            continue
        src = b.value.args[0]
        if not isinstance(src, relax.Var):
            if qg.n_users(b.name) == 0:
                continue
            if _is_torch(qg):
                # a weight dequantized for a float op whose result is never quantized (PT2E's X86
                # quantizer leaves the last Linear's output float): torch dequantizes it in float32,
                # float32(w - zp) * scale per channel, and the float op reads those values
                qg.replace([b.name], relax.const(_spans()._dequantized_constant(qg, b)))
                continue
        # a constant too (ONNX): ORT dequantizes it in float for the float op that reads it
        # (EfficientViT-M's attention biases, gathered twice before their quantize)
        qx = _qparams(qg, b.value, getattr(src, "name", b.name))
        if qx.scale.size != 1:
            raise IrgenError(f"{SCHEME}: constant {b.name!r} is dequantized per channel for a float op that is not "
                             "quantized; not supported")
        xs = _offset(qg, src, int(qx.zero_point[0]))
        expr = op.multiply(qg.emit(op.astype(xs, "float32")), q.rx_const(qx.scale[0], "float32"))
        rec = {"scheme": SCHEME, "kind": "dequantize", "inputs": [qx.record()],
               "output": q.float_record(), "requant": {"rounding_rule": "y = float32(x - zp) * scale"}}
        qg.replace([b.name], expr, rec)
    left = [b for b in qg.bindings if b.op == "relax.dequantize" and qg.n_users(b.name) > 0]
    if left:
        raise IrgenError(f"{SCHEME}: dequantize at tensor {left[0].name!r} is left after folding")
