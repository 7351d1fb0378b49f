"""What every part of the QDQ realization shares: the scheme's name, the quantization
parameters of a quantize/dequantize (checked), the integer operand behind a dequantize, the
clamp a Relu/Clip narrows, and the Relax builders of an offset and of a 256-entry table
(:func:`_table` builds it with ONNX Runtime's or torch's quantize rule)."""

from __future__ import annotations

import numpy as np

from irgen.plugin import IrgenError

from .torch_ref import torch_quantize

SCHEME = "qdq"

_MOVE = ("relax.nn.max_pool2d", "relax.nn.max_pool3d", "relax.reshape", "relax.permute_dims", "relax.flatten",
         "relax.squeeze", "relax.expand_dims", "relax.take", "relax.strided_slice")
#: the convolutions realized as an integer accumulation (beside ``relax.matmul``)
_CONVS = ("relax.nn.conv2d", "relax.nn.conv3d")
#: the record kinds of an integer convolution or dense layer (its accumulator, then a requantization)
MAC_KINDS = ("conv2d", "depthwise_conv2d", "conv3d", "depthwise_conv3d", "dense")
_UNARY = {"relax.sigmoid": lambda v: np.float32(1) / (np.float32(1) + np.exp(-v)), "relax.tanh": np.tanh,
          "relax.nn.relu": lambda v: np.maximum(v, np.float32(0))}


def _ops():
    from tvm import relax
    from tvm.relax import op

    import irgen.plugin as q
    from irgen.plugin import Constant

    return relax, op, q, Constant


def _qparams(qg, call, tensor: str, channels: int | None = None):
    """Scale and zero point of a quantize/dequantize call, checked (``check_qparams``)."""
    relax, _, q, Constant = _ops()
    scale, zp = call.args[1], call.args[2]
    if not isinstance(scale, Constant) or not isinstance(zp, Constant):
        raise IrgenError(f"{SCHEME}: tensor {tensor!r} has a scale or zero point that is not a constant: it is "
                         f"computed while the model runs (dynamic quantization, as onnxruntime's quantize_dynamic "
                         f"writes with DynamicQuantizeLinear); irgen needs static quantization parameters "
                         f"(onnxruntime's quantize_static, the TFLite converter's full-integer mode, torch's "
                         f"convert_fx)")
    dtype = str(call.attrs.out_dtype) if str(call.op.name) == "relax.quantize" else str(call.args[0].ty.dtype)
    try:
        qt = q.check_qparams(SCHEME, tensor, scale.value.numpy(), zp.value.numpy(), dtype, int(call.attrs.axis),
                             channels)
    except IrgenError as err:
        if "infinite scale" not in str(err):
            raise
        raise IrgenError(f"{err} (onnxruntime's quantize_static: nodes_to_exclude, or op_types_to_quantize without "
                         f"it)") from None
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
    from irgen.plugin import Constant

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
    from irgen.plugin import quantize_linear

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


def _table(qin, qout, fn=lambda v: v, torch_rule: bool = False) -> np.ndarray:
    """QlinearBuildLookupTable: quantize(fn(dequantize(i))) for every input value."""
    from irgen.plugin import quantize_linear

    info = np.iinfo(qin.dtype)
    i = np.arange(info.min, info.max + 1, dtype=np.int32)
    v = (i - np.int32(qin.zero_point[0])).astype(np.float32) * np.float32(qin.scale[0])
    if torch_rule:
        return torch_quantize(fn(v).astype(np.float32), np.float32(qout.scale[0]), int(qout.zero_point[0]), qout.lo,
                              qout.hi, qout.dtype)
    return quantize_linear(fn(v).astype(np.float32), np.float32(qout.scale[0]), int(qout.zero_point[0]), qout.dtype)
