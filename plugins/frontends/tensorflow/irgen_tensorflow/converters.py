"""irgen's own converters for TFLite operators that TVM's importer refuses or
imports wrongly on quantized (int8) tensors.

TVM's ``OperatorConverter`` refuses any quantized operator outside its
``_SUPPORTED_QUANTIZED_OPS``, although several of them only move int8 values
(PAD, STRIDED_SLICE, SLICE, TRANSPOSE, SQUEEZE, TILE, DEPTH_TO_SPACE, SPACE_TO_DEPTH, MIRROR_PAD,
RESIZE_NEAREST_NEIGHBOR, and GATHER: a
dynamic-range model's int8 embedding table, dequantized after the gather) and one does
not read them at all (SHAPE). :data:`CONVERTERS` holds one function per TFLite
operator, ``fn(converter, op) -> relax.Expr``; the frontend's converter installs
them over TVM's and accepts these operators on quantized tensors
(:data:`QUANTIZED_OK`). Operators that compute on quantized values are imported
as TVM does (dequantize -> float op -> quantize; PRELU, which TVM converts in
float only, the same way by irgen); the ``tflite-int8`` scheme then realizes
them in TFLite's integer arithmetic.

:func:`fold_constant` folds an operator whose inputs are all constants (the
``SHAPE -> STRIDED_SLICE -> PACK -> RESHAPE`` chains Keras writes for
``tf.shape``) into a constant, so that the reshape gets a static target shape.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


def _tvm(conv):
    """TVM's own converter class (the base of the frontend's converter)."""
    from tvm.relax.frontend.tflite.tflite_frontend import OperatorConverter

    return OperatorConverter


def _ins(conv, op):
    return conv.get_input_tensors(op)


def _out(conv, op):
    (out,) = conv.get_output_tensors(op)
    return out


def _same_qparams(conv, op, a, b, what: str) -> None:
    if a.qnn_params is None and b.qnn_params is None:
        return
    if a.qnn_params is None or b.qnn_params is None or not conv.has_same_qnn_params(a, b):
        raise ValueError(f"{what}: input and output have different quantization parameters")


def _const_value(conv, tensor) -> np.ndarray | None:
    """The value of an input tensor when it is a constant: a weight buffer, or an
    expression folded to a constant (e.g. a SHAPE result)."""
    import tvm

    if conv.has_expr(tensor.tensor_idx):
        expr = conv.get_expr(tensor.tensor_idx)
        return expr.value.numpy() if isinstance(expr, tvm.ir.Constant) else None
    if tensor.buffer is not None and tensor.buffer.DataLength() > 0:
        return np.asarray(conv.get_tensor_value(tensor))
    return None


def convert_pad(conv, op):
    """PAD / PADV2: a quantized tensor is padded with its zero point (PAD) or with
    the quantized constant (PADV2), as TFLite's int8 kernel does; int8 in, int8 out."""
    from tvm import relax

    ins = _ins(conv, op)
    x, out = ins[0], _out(conv, op)
    _same_qparams(conv, op, x, out, "PAD")
    pads = np.asarray(conv.get_tensor_value(ins[1])).reshape(-1).astype(np.int64).tolist()
    if len(ins) == 3:
        value = np.asarray(conv.get_tensor_value(ins[2])).reshape(-1)
        if value.size != 1:
            raise ValueError("PADV2: constant_values must hold one value")
        if x.qnn_params is not None:
            _same_qparams(conv, op, x, ins[2], "PADV2 constant")
        pad_value = value[0].item()
    elif x.qnn_params is not None:
        pad_value = int(np.asarray(x.qnn_params["zero_point"].value.numpy()).reshape(-1)[0])
    else:
        pad_value = 0
    return relax.op.nn.pad(conv.get_expr(x.tensor_idx), pad_width=pads, pad_value=float(pad_value))


def convert_shape(conv, op):
    """SHAPE: a constant from the input's static shape (it never reads the values)."""
    from tflite.ShapeOptions import ShapeOptions
    from tflite.TensorType import TensorType
    from tvm import relax

    (x,) = _ins(conv, op)
    dtype = "int32"
    table = op.BuiltinOptions()
    if table is not None:
        options = ShapeOptions()
        options.Init(table.Bytes, table.Pos)
        dtype = "int64" if options.OutType() == TensorType.INT64 else "int32"
    shape = [int(d) for d in conv.get_expr(x.tensor_idx).ty.shape.values]
    return relax.const(np.array(shape, dtype))


def dense_slice_spec(rank: int, begin, end, strides, begin_mask: int, end_mask: int, ellipsis_mask: int,
                     new_axis_mask: int, shrink_mask: int):
    """TFLite/TF STRIDED_SLICE's sparse spec (an ellipsis, new axes) made dense, as
    TF's ``BuildDenseSpec``: per input axis ``(begin, end, stride, begin bit, end
    bit, shrink bit)``, and the output's axes in order, each an input axis number
    or ``None`` for a new axis of size 1. Without an ellipsis the unspecified
    trailing axes are taken whole (an implicit ellipsis at the end)."""
    n = len(begin)
    if bin(ellipsis_mask & ((1 << n) - 1)).count("1") > 1:
        raise ValueError("STRIDED_SLICE: more than one ellipsis")
    if not ellipsis_mask & ((1 << n) - 1):
        ellipsis_mask |= 1 << n  # an implicit ellipsis after the spec
        n_spec = n + 1
    else:
        n_spec = n
    real = [i for i in range(n) if not (ellipsis_mask >> i & 1) and not (new_axis_mask >> i & 1)]
    dense = [(0, 0, 1, True, True, False)] * rank
    order: list[int | None] = []
    axis = 0
    for i in range(n_spec):
        if ellipsis_mask >> i & 1:
            covered = rank - len([j for j in real if j > i]) - axis
            if covered < 0:
                raise ValueError("STRIDED_SLICE: the spec has more axes than the tensor")
            order.extend(range(axis, axis + covered))
            axis += covered
        elif new_axis_mask >> i & 1:
            order.append(None)
        else:
            if axis >= rank:
                raise ValueError("STRIDED_SLICE: the spec has more axes than the tensor")
            dense[axis] = (int(begin[i]), int(end[i]), int(strides[i]), bool(begin_mask >> i & 1),
                           bool(end_mask >> i & 1), bool(shrink_mask >> i & 1))
            if not dense[axis][5]:
                order.append(axis)
            axis += 1
    return dense, order


def slice_indices(shape, begin, end, strides, begin_mask: int, end_mask: int, shrink_mask: int,
                  ellipsis_mask: int = 0, new_axis_mask: int = 0):
    """TFLite STRIDED_SLICE: the source indices along each input axis, and the
    output shape (shrunk axes removed, new axes of size 1 inserted)."""
    dense, order = dense_slice_spec(len(shape), begin, end, strides, begin_mask, end_mask, ellipsis_mask,
                                    new_axis_mask, shrink_mask)
    picks = []
    for dim, (b, e, s, bm, em, shrink) in zip(shape, dense):
        if s == 0:
            raise ValueError("STRIDED_SLICE: a stride of 0")
        if shrink:
            k = b + dim if b < 0 else b
            if not 0 <= k < dim:
                raise ValueError(f"STRIDED_SLICE: index {b} out of range for a dimension of {dim}")
            picks.append(np.array([k]))
            continue
        picks.append(np.arange(dim)[slice(None if bm else b, None if em else e, s)])
    return picks, [1 if a is None else len(picks[a]) for a in order]


def convert_strided_slice(conv, op):
    """STRIDED_SLICE on a quantized tensor: int8 values only move, so it is a
    gather of constant indices along each sliced axis, then a reshape to the
    output shape (shrunk axes removed, new axes inserted; an ellipsis expanded as
    TF's dense spec does); other tensors go through TVM's converter."""
    from tflite.StridedSliceOptions import StridedSliceOptions
    from tvm import relax

    ins = _ins(conv, op)
    x, out = ins[0], _out(conv, op)
    if x.qnn_params is None:
        return _tvm(conv).convert_strided_slice(conv, op)
    _same_qparams(conv, op, x, out, "STRIDED_SLICE")
    options = StridedSliceOptions()
    table = op.BuiltinOptions()
    options.Init(table.Bytes, table.Pos)
    if options.Offset():
        raise ValueError("STRIDED_SLICE with offset=true (end relative to begin) is not supported")
    begin, end, strides = (np.asarray(conv.get_tensor_value(t)).reshape(-1) for t in ins[1:4])
    expr = conv.get_expr(x.tensor_idx)
    shape = [int(d) for d in expr.ty.shape.values]
    picks, final = slice_indices(shape, begin, end, strides, options.BeginMask(), options.EndMask(),
                                 options.ShrinkAxisMask(), options.EllipsisMask(), options.NewAxisMask())
    for a, idx in enumerate(picks):
        if len(idx) != shape[a] or np.any(idx != np.arange(shape[a])):
            expr = conv.bb.normalize(relax.op.take(expr, relax.const(idx.astype(np.int32)), axis=a))
    return relax.op.reshape(expr, final)


def convert_slice(conv, op):
    """SLICE on a quantized tensor (TVM refuses it; TF's ``tf.roll`` converts to SLICE,
    SLICE, CONCATENATION per axis): int8 values only move, so it is a unit-stride
    strided_slice over the axes it narrows; other tensors go through TVM's converter."""
    from tvm import relax

    ins = _ins(conv, op)
    x, out = ins[0], _out(conv, op)
    if x.qnn_params is None:
        return _tvm(conv).convert_slice(conv, op)
    _same_qparams(conv, op, x, out, "SLICE")
    expr = conv.get_expr(x.tensor_idx)
    shape = [int(d) for d in expr.ty.shape.values]
    begin, size = (np.asarray(conv.get_tensor_value(t)).reshape(-1).astype(np.int64) for t in ins[1:3])
    if len(begin) != len(shape) or len(size) != len(shape):
        raise ValueError("SLICE: begin and size must have one entry per input axis")
    axes, lo, hi = [], [], []
    for a, (dim, b, n) in enumerate(zip(shape, begin.tolist(), size.tolist())):
        e = dim if n == -1 else b + n
        if not 0 <= b <= e <= dim:
            raise ValueError(f"SLICE: begin {b} size {n} out of range for a dimension of {dim}")
        if (b, e) != (0, dim):
            axes.append(a)
            lo.append(b)
            hi.append(e)
    if not axes:
        return expr
    return relax.op.strided_slice(expr, axes=axes, begin=lo, end=hi)


def _move(code: str, tvm_converter: str) -> Callable[[Any, Any], Any]:
    """The converter of an operator that only moves or copies values (TRANSPOSE; TILE, which
    Keras' nearest UpSampling2D writes with a RESHAPE; DEPTH_TO_SPACE, SPACE_TO_DEPTH; MIRROR_PAD):
    TVM's, on the integers as they are, when input and output share their quantization."""

    def convert(conv, op):
        ins = _ins(conv, op)
        _same_qparams(conv, op, ins[0], _out(conv, op), code)
        return getattr(_tvm(conv), tvm_converter)(conv, op)

    return convert


def _reduce_options(op) -> bool:
    """A REDUCE operator's ``keep_dims`` (False without options, as TVM reads it)."""
    from tflite.BuiltinOptions import BuiltinOptions
    from tflite.ReducerOptions import ReducerOptions

    if not op.BuiltinOptionsType():
        return False
    if op.BuiltinOptionsType() != BuiltinOptions.ReducerOptions:
        raise ValueError("REDUCE: unexpected options")
    options = ReducerOptions()
    table = op.BuiltinOptions()
    options.Init(table.Bytes, table.Pos)
    return bool(options.KeepDims())


def _reduce_extreme(code: str, relax_op: str) -> Callable[[Any, Any], Any]:
    """REDUCE_MAX / REDUCE_MIN: on quantized tensors of one quantization (the converter gives
    the output its input's), the largest or smallest integer, exactly TFLite's kernel (it
    reduces the integers); TVM's dequantize -> reduce -> quantize otherwise."""

    def convert(conv, op):
        from tvm import relax

        ins = _ins(conv, op)
        x_t, out_t = ins[0], _out(conv, op)
        if x_t.qnn_params is None or out_t.qnn_params is None or not conv.has_same_qnn_params(x_t, out_t):
            return getattr(_tvm(conv), "_convert_reduce")(conv, op, getattr(relax.op, relax_op))
        axis = np.asarray(conv.get_tensor_value(ins[1])).reshape(-1)
        return getattr(relax.op, relax_op)(conv.get_expr(x_t.tensor_idx), [int(a) for a in axis], _reduce_options(op))

    return convert


def _arg_extreme(code: str, relax_op: str) -> Callable[[Any, Any], Any]:
    """ARG_MAX / ARG_MIN of a quantized tensor: the index of the largest or smallest integer,
    which is that of the largest or smallest value (dequantizing with a positive scale keeps
    the order and the ties): TFLite's kernel compares the integers too."""

    def convert(conv, op):
        from tvm import relax

        x_t = _ins(conv, op)[0]
        if x_t.qnn_params is not None:
            scale = x_t.qnn_params["scale"].value.numpy().reshape(-1)  # TVM's converter makes it a constant
            if scale.size != 1 or not float(scale[0]) > 0:
                raise ValueError(f"{code}: the input's scale is not one positive value")
        return getattr(_tvm(conv), "_convert_arg_min_max")(conv, op, getattr(relax.op, relax_op))

    return convert


def convert_prelu(conv, op):
    """PRELU of a quantized tensor (TVM converts float ones only): the input and alpha
    dequantized, ``where(x >= 0, x, x * alpha)``, quantized to the output; the ``tflite-int8``
    scheme realizes that span as TFLite's integer kernel."""
    from tvm import relax

    ins = _ins(conv, op)
    x_t, a_t = ins
    out_t = _out(conv, op)
    if x_t.qnn_params is None or a_t.qnn_params is None or out_t.qnn_params is None:
        return _tvm(conv).convert_prelu(conv, op)
    x = conv.dequantize(conv.get_tensor_expr(x_t), x_t)
    alpha = conv.dequantize(conv.get_tensor_expr(a_t), a_t)
    y = relax.op.where(relax.op.greater_equal(x, relax.const(0.0, "float32")), x, relax.op.multiply(x, alpha))
    return conv.quantize(y, out_t)


def convert_squeeze(conv, op):
    ins = _ins(conv, op)
    _same_qparams(conv, op, ins[0], _out(conv, op), "SQUEEZE")
    return _tvm(conv).convert_squeeze(conv, op)


def convert_reshape(conv, op):
    """RESHAPE whose target shape is a constant expression (a folded SHAPE chain)."""
    from tvm import relax

    ins = _ins(conv, op)
    if len(ins) == 2 and conv.has_expr(ins[1].tensor_idx):
        target = _const_value(conv, ins[1])
        if target is not None:
            _same_qparams(conv, op, ins[0], _out(conv, op), "RESHAPE")
            return relax.op.reshape(conv.get_expr(ins[0].tensor_idx), [int(d) for d in target.reshape(-1)])
    return _tvm(conv).convert_reshape(conv, op)


def nearest_indices(in_size: int, out_size: int, align_corners: bool, half_pixel_centers: bool) -> np.ndarray:
    """The source index of each output row/column of TFLite's RESIZE_NEAREST_NEIGHBOR
    (``reference_ops::ResizeNearestNeighbor``): float32 scale, ``floor`` or ``round``."""
    f32 = np.float32
    scale = f32(in_size - 1) / f32(out_size - 1) if align_corners and out_size > 1 else f32(in_size) / f32(out_size)
    offset = f32(0.5) if half_pixel_centers else f32(0.0)
    idx = []
    for i in range(out_size):
        v = (f32(i) + offset) * scale
        k = int(np.round(v)) if align_corners else int(np.floor(v))
        if align_corners:  # TfLiteRound: half away from zero
            k = int(np.floor(v + f32(0.5)))
        idx.append(min(k, in_size - 1))
    return np.maximum(np.array(idx, np.int32), 0)


def convert_resize_nearest(conv, op):
    """RESIZE_NEAREST_NEIGHBOR as two gathers of constant indices (exact for any
    dtype; TFLite's int8 kernel copies values)."""
    from tflite.ResizeNearestNeighborOptions import ResizeNearestNeighborOptions
    from tvm import relax

    ins = _ins(conv, op)
    x, out = ins[0], _out(conv, op)
    if x.qnn_params is None:
        return _tvm(conv).convert_resize_nearest_neighbor(conv, op)
    _same_qparams(conv, op, x, out, "RESIZE_NEAREST_NEIGHBOR")
    options = ResizeNearestNeighborOptions()
    table = op.BuiltinOptions()
    options.Init(table.Bytes, table.Pos)
    size = np.asarray(conv.get_tensor_value(ins[1])).reshape(-1)
    expr = conv.get_expr(x.tensor_idx)
    n, h, w, c = (int(d) for d in expr.ty.shape.values)
    rows = nearest_indices(h, int(size[0]), bool(options.AlignCorners()), bool(options.HalfPixelCenters()))
    cols = nearest_indices(w, int(size[1]), bool(options.AlignCorners()), bool(options.HalfPixelCenters()))
    y = conv.bb.normalize(relax.op.take(expr, relax.const(rows), axis=1))
    return relax.op.take(y, relax.const(cols), axis=2)


def convert_batch_matmul(conv, op):
    """BATCH_MATMUL of two quantized tensors (TVM refuses it): dequantize ->
    matmul -> quantize, the adjoint flags applied to the int8 operands first, for
    the ``tflite-int8`` scheme to realize as TFLite's integer kernel."""
    from tflite.BatchMatMulOptions import BatchMatMulOptions
    from tvm import relax

    ins = _ins(conv, op)
    if ins[0].qnn_params is None:
        return _tvm(conv).convert_batch_matmul(conv, op)
    out = _out(conv, op)
    if ins[1].qnn_params is None or out.qnn_params is None:
        raise ValueError("BATCH_MATMUL: a quantized operand with a float operand or result is not supported")
    options = BatchMatMulOptions()
    table = op.BuiltinOptions()
    options.Init(table.Bytes, table.Pos)
    exprs = []
    for t, adj in ((ins[0], options.AdjX()), (ins[1], options.AdjY())):
        e = conv.get_tensor_expr(t)
        if adj:
            nd = len(e.ty.shape.values) if hasattr(e, "ty") and e.ty is not None else len(t.tensor.ShapeAsNumpy())
            e = conv.bb.normalize(relax.op.permute_dims(e, list(range(nd - 2)) + [nd - 1, nd - 2]))
        exprs.append(conv.bb.normalize(conv.dequantize(e, t)))
    return conv.quantize(relax.op.matmul(exprs[0], exprs[1]), out)


def convert_fully_connected(conv, op):
    """FULLY_CONNECTED as TFLite computes it: without ``keep_num_dims`` the input is
    read as ``[prod(dims[:-1]), K]`` and the result is 2-D (``[1, 1, 1, K]`` -> ``[1, N]``,
    what the converter writes after a ``keepdims`` mean). TVM's converter keeps the
    input's leading dimensions; the result is reshaped to TFLite's shape."""
    from tflite.FullyConnectedOptions import FullyConnectedOptions
    from tvm import relax

    out = _tvm(conv).convert_fully_connected(conv, op)
    options = FullyConnectedOptions()
    table = op.BuiltinOptions()
    options.Init(table.Bytes, table.Pos)
    x = _ins(conv, op)[0]
    dims = [int(d) for d in x.tensor.ShapeAsNumpy()]
    if options.KeepNumDims() or len(dims) <= 2:
        return out
    units = int(_ins(conv, op)[1].tensor.ShapeAsNumpy()[0])
    return relax.op.reshape(conv.bb.normalize(out), [int(np.prod(dims[:-1])), units])


def convert_gelu(conv, op):
    """GELU with its ``approximate`` flag (TVM's converter always takes the erf form and
    refuses int8): ``nn.gelu`` or ``nn.gelu_tanh``; on a quantized tensor dequantize ->
    GELU -> quantize, which the ``tflite-int8`` scheme realizes as TFLite's table."""
    from tflite.GeluOptions import GeluOptions
    from tvm import relax

    (x,) = _ins(conv, op)
    out = _out(conv, op)
    approximate = False
    table = op.BuiltinOptions()
    if table is not None:
        options = GeluOptions()
        options.Init(table.Bytes, table.Pos)
        approximate = bool(options.Approximate())
    gelu = relax.op.nn.gelu_tanh if approximate else relax.op.nn.gelu
    expr = conv.get_tensor_expr(x)
    if x.qnn_params is None:
        return gelu(expr)
    if out.qnn_params is None:
        raise ValueError("GELU: a quantized input with a float result is not supported")
    return conv.quantize(gelu(conv.bb.normalize(conv.dequantize(expr, x))), out)


def convert_while(conv, op):
    """WHILE with a static trip count, unrolled (:mod:`irgen_tensorflow.loops`)."""
    from irgen_tensorflow import loops

    return loops.convert_while(conv, op)


def convert_sequence_lstm(conv, op):
    """UNIDIRECTIONAL_SEQUENCE_LSTM unrolled (:mod:`irgen_tensorflow.sequence_ops`)."""
    from irgen_tensorflow import sequence_ops

    return sequence_ops.convert_sequence_lstm(conv, op)


def convert_sequence_rnn(conv, op):
    """UNIDIRECTIONAL_SEQUENCE_RNN unrolled (:mod:`irgen_tensorflow.sequence_ops`)."""
    from irgen_tensorflow import sequence_ops

    return sequence_ops.convert_sequence_rnn(conv, op)


#: TFLite operator -> converter(converter, op), installed over TVM's
CONVERTERS: dict[str, Callable[[Any, Any], Any]] = {
    "PAD": convert_pad,
    "PADV2": convert_pad,
    "SHAPE": convert_shape,
    "STRIDED_SLICE": convert_strided_slice,
    "SLICE": convert_slice,
    "TRANSPOSE": _move("TRANSPOSE", "convert_transpose"),
    "SQUEEZE": convert_squeeze,
    "TILE": _move("TILE", "convert_tile"),
    "DEPTH_TO_SPACE": _move("DEPTH_TO_SPACE", "convert_depth_to_space"),
    "SPACE_TO_DEPTH": _move("SPACE_TO_DEPTH", "convert_space_to_depth"),
    "MIRROR_PAD": _move("MIRROR_PAD", "convert_mirror_pad"),
    "REDUCE_MAX": _reduce_extreme("REDUCE_MAX", "max"),
    "REDUCE_MIN": _reduce_extreme("REDUCE_MIN", "min"),
    "ARG_MAX": _arg_extreme("ARG_MAX", "argmax"),
    "ARG_MIN": _arg_extreme("ARG_MIN", "argmin"),
    "PRELU": convert_prelu,
    "RESHAPE": convert_reshape,
    "RESIZE_NEAREST_NEIGHBOR": convert_resize_nearest,
    "BATCH_MATMUL": convert_batch_matmul,
    "FULLY_CONNECTED": convert_fully_connected,
    "GELU": convert_gelu,
    "WHILE": convert_while,
    "UNIDIRECTIONAL_SEQUENCE_LSTM": convert_sequence_lstm,
    "UNIDIRECTIONAL_SEQUENCE_RNN": convert_sequence_rnn,
}

def wide_bias(expr, tensor):
    """The float value of the int64 bias of a 16x8 model's CONV_2D, DEPTHWISE_CONV_2D or
    FULLY_CONNECTED (TVM's dequantize takes no int64), or None for any other tensor: a
    dequantized int32 constant when the values fit in int32 (as an int8 model's bias is),
    else ``float32(bias) * scale``, the int64 constant kept. The ``tflite-int8`` scheme reads
    either form back as the int64 bias and adds it in int64, as TFLite does."""
    import tvm
    from tvm import relax

    if not isinstance(expr, tvm.ir.Constant) or str(expr.ty.dtype) != "int64" or not tensor.qnn_params:
        return None
    qp = tensor.qnn_params
    v = expr.value.numpy()
    info = np.iinfo(np.int32)
    if not v.size or (v.min() >= info.min and v.max() <= info.max):
        return relax.op.dequantize(relax.const(v.astype(np.int32), "int32"), scale=qp["scale"],
                                   zero_point=qp["zero_point"], axis=qp["axis"])
    if np.any(qp["zero_point"].value.numpy() != 0):
        from irgen.plugin import IrgenError

        raise IrgenError(f"the int64 bias {tensor.tensor.Name().decode(errors='replace')!r} has a non-zero zero point")
    return relax.op.multiply(relax.op.astype(expr, "float32"), qp["scale"])


def activation_range(fn: int, scale: float, zero_point: int, dtype: str, where: str) -> tuple[int, int] | None:
    """The integer range of a quantized op's fused RELU, RELU6 or RELU_N1_TO_1 as TFLite's
    ``CalculateActivationRangeQuantized`` computes it: ``zero_point + TfLiteRound(v / scale)``
    with a float32 division, rounded half away from zero (TVM's importer divides in double
    and rounds ties to even), within ``dtype``. A bound beyond int32 is refused as TFLite
    refuses the model. None for any other activation."""
    from tflite.ActivationFunctionType import ActivationFunctionType as A

    bounds = {A.RELU: (0.0, None), A.RELU6: (0.0, 6.0), A.RELU_N1_TO_1: (-1.0, 1.0)}.get(fn)
    if bounds is None:
        return None
    from irgen.plugin import IrgenError, quantize_half_away

    info = np.iinfo(dtype)

    def q(v: float) -> int:
        b = quantize_half_away(v, scale, zero_point)
        if b is None:
            raise IrgenError(f"{where}: the fused activation's bound {v:g} divided by the output scale {float(scale)!r} "
                             "is beyond int32; TFLite's interpreter refuses such a model too "
                             "(no_integer_overflow_from_quantization): the output's calibrated range is all but zero")
        return b

    lo, hi = bounds
    return max(int(info.min), q(lo)), int(info.max) if hi is None else min(int(info.max), q(hi))


#: operators accepted on quantized tensors besides TVM's own list
QUANTIZED_OK = frozenset({"PAD", "PADV2", "SHAPE", "STRIDED_SLICE", "SLICE", "TRANSPOSE", "SQUEEZE", "TILE", "PRELU",
                          "RESIZE_NEAREST_NEIGHBOR", "PACK", "BATCH_MATMUL", "GELU", "GATHER", "DEPTH_TO_SPACE",
                          "SPACE_TO_DEPTH", "MIRROR_PAD", "ARG_MAX", "ARG_MIN"})

_FOLD_LIMIT = 4096  # elements: shape arithmetic, not data


def fold_constant(conv, op, expr, dtypes=("int32", "int64")):
    """``expr`` folded to a constant when every input of ``op`` is a constant and
    the result is a small tensor of ``dtypes`` (shape arithmetic; a loop's condition
    adds ``bool``); otherwise ``expr``."""
    import tvm
    from tvm import relax

    if not isinstance(expr, relax.Call):
        return expr
    ins = [t for t in _ins(conv, op) if t.tensor_idx >= 0]
    if not ins or any(_const_value(conv, t) is None for t in ins):
        return expr
    bb = relax.BlockBuilder()
    try:
        with bb.function("main", []):
            with bb.dataflow():
                var = bb.emit_output(expr)
            bb.emit_func_output(var)
        ty = var.ty
        if not isinstance(ty, relax.TensorType) or str(ty.dtype) not in dtypes \
                or not isinstance(ty.shape, relax.ShapeExpr) \
                or not all(isinstance(d, tvm.tirx.IntImm) for d in ty.shape.values) \
                or int(np.prod([int(d) for d in ty.shape.values])) > _FOLD_LIMIT:
            return expr
        folded = relax.transform.FoldConstant()(bb.get())["main"].body
    except Exception:  # noqa: BLE001  not foldable here (e.g. it reads a variable): keep the op
        return expr
    while isinstance(folded, relax.SeqExpr):
        folded = folded.body
    return folded if isinstance(folded, tvm.ir.Constant) else expr
