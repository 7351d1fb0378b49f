"""GlobalAveragePool (an int32 sum minus ``zp_x * N``, requantized by ``s_x / (s_y * N)``) and
AveragePool (the dequantized window averaged in float32, the values added in row order, then
QLinearAveragePool's ``rint(m / s_y + zp_y)``); a torch reference graph's pools in float32, then
torch's quantize."""

from __future__ import annotations

import numpy as np

from irgen.plugin import IrgenError

from .common import SCHEME, _is_torch, _need, _offset, _ops
from .float_span import realize_float
from .ort import pool_windows
from .torch_spans import _rx_torch_quantize


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
            return realize_float(qg, qb, comp, out)
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
    in turn, divided by the per-position count (:func:`irgen_qdq.ort.pool_windows`)."""
    relax, op, q, _ = _ops()
    e = qg.emit
    n, c, h, w = [int(d) for d in deq.ty.shape.values]
    p = _pool_record(a)
    (kh, kw), (sh, sw), (oh, ow), (pt, pl, pb, pr), count = pool_windows((h, w), p)
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
        return realize_float(qg, qb, comp, out)  # timm's ResNet-D shortcut pool (ceil mode): a float span
    if str(a.layout) != "NCHW" or any(int(d) != 1 for d in a.dilation):
        raise IrgenError(f"{SCHEME}: average pool at {tensor!r} with layout {a.layout} or dilation; not supported")
    e = qg.emit
    deq = e(op.multiply(e(op.astype(_offset(qg, x, int(qx.zero_point[0])), "float32")), q.rx_const(qx.scale[0], "float32")))
    if bool(a.ceil_mode):  # timm's ResNet-D shortcut (AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False))
        shape = [int(d) for d in comp.var.ty.shape.values][2:]
        if list(pool_windows([int(d) for d in deq.ty.shape.values][2:], _pool_record(a))[2]) != shape:
            raise IrgenError(f"{SCHEME}: average pool at {tensor!r}: ceil mode gives another output size than {shape}")
        avg = _window_mean(qg, deq, a)
    elif _is_torch(qg) or not _uniform_count(a):
        avg = e(op.nn.avg_pool2d(deq, pool_size=list(a.pool_size), strides=list(a.strides), padding=list(a.padding),
                                 dilation=list(a.dilation), ceil_mode=False, count_include_pad=bool(a.count_include_pad),
                                 layout="NCHW"))
    else:  # the window's values added in row-major order in float32, as explicit ops (irgen_qdq.ort.avg_pool_in_order)
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
