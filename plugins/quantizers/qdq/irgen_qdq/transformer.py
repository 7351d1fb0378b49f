"""Spans of transformers and channel splits: ``Slice``/``Split`` on a quantized tensor, a data
movement on the integers (:func:`realize_slice`; each quantized output of a ``Split``, ViT's q, k,
v: :func:`realize_split_item`); ``Gather`` of a quantized embedding table by token ids
(:func:`realize_gather_table`); MatMul of two activations as QLinearMatMul (:func:`realize_matmul`,
kind ``matmul``, recomputed by :func:`recompute_matmul`)."""

from __future__ import annotations

import numpy as np

from irgen.plugin import IrgenError

from .common import SCHEME, _dequantized, _is_torch, _lut, _need, _offset, _ops, _qparams, _table
from .operands import _dequantized_constant


def _evaluate(qg, expr):
    """The value of a shape computation (shape_of on static shapes, constants, index arithmetic) in numpy."""
    from tvm import relax

    from irgen.plugin import Constant, attrs_to_dict, run_op

    if isinstance(expr, Constant):
        return expr.value.numpy()
    if isinstance(expr, relax.ShapeExpr):
        return np.asarray([int(d) for d in expr.values], np.int64)
    b = qg.producer(expr)
    if b is not None and isinstance(b.value, relax.ShapeExpr):  # a static shape_of (static_shape_of)
        return _evaluate(qg, b.value)
    if b is None or not isinstance(b.value, relax.Call):
        raise IrgenError(f"{SCHEME}: cannot evaluate {getattr(expr, 'name', expr)!r}: not a shape computation")
    v = b.value
    if b.op == "relax.shape_of":
        shape = getattr(getattr(v.args[0], "ty", None), "shape", None)
        if shape is not None and hasattr(shape, "values"):
            return np.asarray([int(d) for d in shape.values], np.int64)
        return np.asarray(np.shape(_evaluate(qg, v.args[0])), np.int64)
    if b.op in ("relax.dequantize", "relax.quantize"):
        raise IrgenError(f"{SCHEME}: {b.name!r} is not a shape computation")
    args = [_evaluate(qg, a) for a in v.args]
    if b.op == "relax.shape_to_tensor":
        return np.asarray(args[0], np.int64)
    if b.op == "relax.scatter_elements":
        data, idx, upd = (np.asarray(a) for a in args)
        out = data.copy()
        np.put_along_axis(out, idx.astype(np.int64), np.broadcast_to(upd, idx.shape).astype(out.dtype),
                          int(v.attrs.axis))
        return out
    return np.asarray(run_op(b.op, args, attrs_to_dict(v.attrs) if v.attrs is not None else {}, b.name))


def realize_slice(qg, qb, comp, out):
    """``Slice`` on a quantized tensor (ShuffleNet's channel split) whose begin/end/steps are computed
    from static shapes: a strided slice of the integers (ORT drops the Q/DQ around Slice)."""
    from tvm.relax import op

    tensor = qb.name
    x, qx, dqx = _need(qg, comp.value.args[0], "the input", tensor)
    if qx.scale[0] != out.scale[0] or qx.zero_point[0] != out.zero_point[0] or qx.dtype != out.dtype:
        raise IrgenError(f"{SCHEME}: the slice at {tensor!r} changes quantization parameters; not supported")
    shape = [int(d) for d in x.ty.shape.values]
    begin, end, strides = (_evaluate(qg, a).reshape(-1) for a in comp.value.args[1:4])
    axes, b0, e0, s0 = [], [], [], []
    for a, dim in enumerate(shape):
        if a >= len(begin):
            break
        start, stop, step = slice(int(begin[a]), int(end[a]), int(strides[a])).indices(dim)
        if (start, stop, step) != (0, dim, 1):
            axes.append(a), b0.append(start), e0.append(stop), s0.append(step)
    expr = op.strided_slice(x, axes, b0, e0, s0)
    rec = {"scheme": SCHEME, "kind": "integer", "op": "strided_slice", "inputs": [qx.record()], "output": out.record(),
           "slice": {"axes": axes, "begin": b0, "end": e0, "strides": s0}}
    return [dqx, comp.name, qb.name], expr, rec


def split_item(qg, f):
    """``(split binding, int var, QTensor, dq name)`` when ``f`` is an item of ``relax.split`` of a
    dequantized tensor read only by one quantize, else None."""
    from tvm import relax

    if f is None or not isinstance(f.value, relax.TupleGetItem) or qg.n_users(f.name) != 1:
        return None
    sb = qg.producer(f.value.tuple_value)
    if sb is None or sb.op != "relax.split":
        return None
    d = _dequantized(qg, sb.value.args[0])
    return None if d is None else (sb, *d)


def realize_split_item(qg, qb, f, out):
    """One output of ``Split`` on a quantized tensor (ViT's q, k, v): a slice of the integers
    (ORT's QDQ Split runs on the integers when the parameters agree); the split and its dequantize
    go when their last item is realized."""
    from tvm.relax import op

    tensor = qb.name
    sb, x, qx, _ = split_item(qg, f)
    table = None
    if qx.scale[0] != out.scale[0] or qx.zero_point[0] != out.zero_point[0] or qx.dtype != out.dtype:
        # each item quantized with its own parameters (torchvision ShuffleNetV2's chunk under FX PTQ; ORT
        # runs such a Split in float): a table, then the slice, as a requantizing Slice is
        torch = _is_torch(qg)
        table = _table(qx, out, torch_rule=torch)
    shape = [int(d) for d in x.ty.shape.values]
    a = sb.value.attrs
    axis = int(a.axis) % len(shape)
    ios = a.indices_or_sections
    if isinstance(ios, (int, np.integer)) or hasattr(ios, "value"):
        n = int(ios.value if hasattr(ios, "value") else ios)
        size = -(-shape[axis] // n)
        bounds = [min(k * size, shape[axis]) for k in range(1, n)]
    else:
        bounds = [int(v) for v in ios]
    edges = [0] + bounds + [shape[axis]]
    k = int(f.value.index)
    begin, end = edges[k], edges[k + 1]
    rec = {"scheme": SCHEME, "kind": "integer", "op": "strided_slice", "inputs": [qx.record()], "output": out.record(),
           "slice": {"axes": [axis], "begin": [begin], "end": [end], "strides": [1]}}
    if table is not None:
        x = qg.emit(_lut(qg, x, table, qx.dtype))
        rec.update(kind="lut", table=[int(t) for t in table], **({"reference": "torch"} if torch else {}),
                   requant={"rounding": "half_to_even", "rounding_rule": "table[i - min] = quantize(dequantize(i)), "
                            "then the slice"})
    return [f.name, qb.name], op.strided_slice(x, [axis], [begin], [end], [1]), rec


def gathered_table(qg, comp):
    """``(integer table, QTensor, dq binding)`` when ``comp`` takes rows of a dequantized constant
    (an embedding table gathered by token ids), else None."""
    from irgen.plugin import Constant

    dq = qg.producer(comp.value.args[0])
    if dq is None or dq.op != "relax.dequantize" or not isinstance(dq.value.args[0], Constant):
        return None
    return dq.value.args[0].value.numpy(), dq


def realize_gather_table(qg, qb, comp, out):
    """``Gather(DQ(table), ids) -> Q``: ORT gathers the integers (Q/DQ dropped when the parameters
    agree, else the float values requantized); both are ``Q_out(DQ(table))`` gathered, which irgen
    computes once: a gather of an integer table by the (integer) indices."""
    from tvm import relax

    from irgen.plugin import quantize_linear

    arr, dq = gathered_table(qg, comp)
    qt = _qparams(qg, dq.value, dq.name, arr.shape[int(dq.value.attrs.axis) % arr.ndim] if arr.ndim else 1)
    same = qt.scale.size == 1 and qt.scale[0] == out.scale[0] and qt.zero_point[0] == out.zero_point[0] \
        and str(arr.dtype) == out.dtype
    table = arr if same else quantize_linear(_dequantized_constant(qg, dq), np.float32(out.scale[0]),
                                             int(out.zero_point[0]), out.dtype)
    v = comp.value
    expr = relax.Call(v.op, [relax.const(table)] + list(v.args[1:]), v.attrs)
    rec = {"scheme": SCHEME, "kind": "integer", "op": "take", "inputs": [], "output": out.record(),
           "table": qt.record(),
           "requant": {"rounding": "half_to_even", "rounding_rule":
                       "parameter 'table' = the integer table (when its parameters are the output's) or "
                       "quantize(dequantize(table)) with the output's parameters; y = table[ids]"}}
    names = [dq.name] if qg.n_users(dq.name) == 1 else []
    return names + [comp.name, qb.name], expr, rec


def realize_matmul(qg, qb, comp, out):
    """MatMul of two quantized activations (attention's Q·Kᵀ and A·V) as ORT's QLinearMatMul:
    int32 ``sum((a - zp_a) * (b - zp_b))``, MLAS requantization by ``float32(s_a * s_b) / s_y``."""
    from tvm.relax import op

    _, _, q, _ = _ops()
    tensor = qb.name
    a, qa, da = _need(qg, comp.value.args[0], "the first input", tensor)
    b, qb_, db = _need(qg, comp.value.args[1], "the second input", tensor)
    xa = _offset(qg, a, int(qa.zero_point[0]))
    xb = xa if a.same_as(b) and qa.zero_point[0] == qb_.zero_point[0] else _offset(qg, b, int(qb_.zero_point[0]))
    acc = qg.emit(op.matmul(xa, xb, out_dtype="int32"))
    scale = np.float32(np.float32(qa.scale[0]) * np.float32(qb_.scale[0])) / np.float32(out.scale[0])
    lo, hi = out.lo, out.hi  # the dtype's, or a narrower range (irgen_qdq.ranges)
    expr = q.rx_requantize_float(qg.emit, acc, np.float32(scale), int(out.zero_point[0]), lo, hi, out.dtype)
    rec = {"scheme": SCHEME, "kind": "matmul", "inputs": [qa.record(), qb_.record()], "output": out.record(),
           **({"operands": [0, 0]} if a.same_as(b) else {}),
           "requant": {"scale": float(scale), "rounding": "half_to_even",
                       "rounding_rule": "y = clamp(round_half_even(float32(acc) * scale) + zp_y, clamp); acc = int32 "
                                        "sum((a - zp_a) * (b - zp_b)); scale = float32(s_a * s_b) / s_y (QLinearMatMul)"},
           "clamp": [lo, hi]}
    return [da, db, comp.name, qb.name], expr, rec


def recompute_matmul(layer, inputs, params=None) -> np.ndarray:
    """A ``matmul`` layer (QLinearMatMul of two activations) from its record."""
    from irgen.plugin import requantize_float

    qr = layer["quant"]
    out = qr["output"]
    ops = [inputs[k] for k in qr.get("operands") or (0, 1)]
    za, zb = (int(i["zero_point"]) for i in qr["inputs"])
    acc = np.matmul(ops[0].astype(np.int64) - za, ops[1].astype(np.int64) - zb)
    lo, hi = qr["clamp"]
    return requantize_float(acc.astype(np.int32), np.float32(qr["requant"]["scale"]), int(out["zero_point"]), lo, hi,
                            out["dtype"])
