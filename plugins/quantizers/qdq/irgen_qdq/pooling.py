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


def _spatial_axes(comp, rank: int) -> list[int] | None:
    """The axes a global average pool (a mean over the spatial axes of NCHW or NCDHW, an adaptive
    pool to one value per channel) averages, or None when ``comp`` is no such pool."""
    spatial = list(range(2, rank))
    if rank not in (4, 5):
        return None
    if comp.op == "relax.mean":
        return spatial if sorted(int(a) % rank for a in comp.value.attrs.axis) == spatial else None
    ok = [int(v) for v in comp.value.attrs.output_size] == [1] * (rank - 2) and str(comp.value.attrs.layout) == \
        ("NCHW" if rank == 4 else "NCDHW")
    return spatial if ok else None


def _realize_global_avg(qg, qb, comp, out):
    _, op, q, _ = _ops()
    tensor = qb.name
    x, qx, dqx = _need(qg, comp.value.args[0], "the input", tensor)
    if _is_torch(qg):
        return _torch_global_avg(qg, qb, comp, out, x, qx, dqx)
    shape = [int(d) for d in x.ty.shape.values]
    if comp.op == "relax.mean":
        axes = [int(a) % len(shape) for a in comp.value.attrs.axis]
        if not bool(comp.value.attrs.keepdims):
            raise IrgenError(f"{SCHEME}: mean at {tensor!r} without keepdims is not supported")
    else:
        axes = _spatial_axes(comp, len(shape))
        if axes is None:
            raise IrgenError(f"{SCHEME}: adaptive average pool at {tensor!r} is not global; not supported")
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


def _torch_global_avg(qg, qb, comp, out, x, qx, dqx):
    """torch reference: the float mean of the dequantized input (NCHW or NCDHW), then quantize_per_tensor."""
    _, op, q, _ = _ops()
    axes = _spatial_axes(comp, len(x.ty.shape.values))
    if axes is None:
        # a mean over other axes, an adaptive pool to more than one value (AlexNet's and VGG's to
        # 6x6 and 7x7): a float span
        return realize_float(qg, qb, comp, out)
    e = qg.emit
    deq = e(op.multiply(e(op.astype(_offset(qg, x, int(qx.zero_point[0])), "float32")), q.rx_const(qx.scale[0], "float32")))
    if comp.op == "relax.mean":
        m = e(op.mean(deq, axis=[int(a) for a in comp.value.attrs.axis], keepdims=bool(comp.value.attrs.keepdims)))
    else:
        pool = op.nn.adaptive_avg_pool2d if len(axes) == 2 else op.nn.adaptive_avg_pool3d
        m = e(pool(deq, output_size=[1] * len(axes), layout=str(comp.value.attrs.layout)))
    rec = {"scheme": SCHEME, "kind": "global_avg_pool_float", "reference": "torch", "axes": axes,
           "op": comp.op.removeprefix("relax."), "inputs": [qx.record()],
           "output": out.record(), "requant": {"rounding": "half_to_even", "rounding_rule":
           "y = quantize_per_tensor(op(float32(x - zp_x) * s_x)): round_half_even(v * float32(1/s_y)) + zp_y"}}
    return [dqx, comp.name, qb.name], _rx_torch_quantize(qg, m, out), rec


def _window_mean(qg, deq, a):
    """NCHW (NCDHW) average pool in float32 with each window summed in row-major order: padding
    (and in ceil mode zeros past it for the last windows), then one strided slice per window
    offset added in turn, divided by the per-position count (:func:`irgen_qdq.ort.pool_windows`)."""
    relax, op, q, _ = _ops()
    e = qg.emit
    size = [int(d) for d in deq.ty.shape.values][2:]
    nd = len(size)
    k, st, out, pads, count = pool_windows(size, _pool_record(a))
    if any(pads):
        deq = e(op.nn.pad(deq, [0, 0, 0, 0, *(v for pair in zip(pads[:nd], pads[nd:]) for v in pair)]))
    total = None
    axes = list(range(2, 2 + nd))
    for offset in np.ndindex(*k):
        win = e(op.strided_slice(deq, axes, list(offset), [i + s * (o - 1) + 1 for i, s, o in zip(offset, st, out)],
                                 list(st)))
        total = win if total is None else e(op.add(total, win))
    if np.all(count == count.flat[0]):
        return e(op.divide(total, q.rx_const(count.flat[0], "float32")))
    return e(op.divide(total, relax.const(count)))


def _pool_record(a) -> dict:
    """An average pool's attributes as its layer's ``quant.pool`` records them."""
    return {"size": [int(v) for v in a.pool_size], "strides": [int(v) for v in a.strides],
            "padding": [int(v) for v in a.padding], "count_include_pad": bool(a.count_include_pad),
            **({"ceil_mode": True} if bool(a.ceil_mode) else {}), "layout": str(a.layout)}


def _uniform_count(a) -> bool:
    """Every window of the pool counts the same number of values (no padding, or padding counted)."""
    return bool(a.count_include_pad) or all(int(v) == 0 for v in a.padding)


#: the layouts an average pool is realized in, and its record's kind in each
_LAYOUTS = {"NCHW": "avg_pool2d", "NCDHW": "avg_pool3d"}


def _realize_avg_pool(qg, qb, comp, out):
    relax, op, q, _ = _ops()
    tensor = qb.name
    x, qx, dqx = _need(qg, comp.value.args[0], "the input", tensor)
    a = comp.value.attrs
    layout = str(a.layout)
    # torch's 3-D pool in ceil mode not counting the padding is the window's float32 sum in row order
    # / the values in it (_window_mean); the 2-D one (timm's ResNet-D shortcut) stays a float span
    ceil_as_torch = layout == "NCDHW" and bool(a.ceil_mode) and not bool(a.count_include_pad)
    if _is_torch(qg) and layout in _LAYOUTS and ((bool(a.ceil_mode) and not ceil_as_torch)
                                                 or any(int(d) != 1 for d in a.dilation)):
        return realize_float(qg, qb, comp, out)  # a float span, as torch computes it
    if layout not in _LAYOUTS or any(int(d) != 1 for d in a.dilation):
        raise IrgenError(f"{SCHEME}: average pool at {tensor!r} with layout {a.layout} or dilation; not supported")
    e = qg.emit
    deq = e(op.multiply(e(op.astype(_offset(qg, x, int(qx.zero_point[0])), "float32")), q.rx_const(qx.scale[0], "float32")))
    if bool(a.ceil_mode):  # timm's ResNet-D shortcut (AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False))
        shape = [int(d) for d in comp.var.ty.shape.values][2:]
        if list(pool_windows([int(d) for d in deq.ty.shape.values][2:], _pool_record(a))[2]) != shape:
            raise IrgenError(f"{SCHEME}: average pool at {tensor!r}: ceil mode gives another output size than {shape}")
        avg = _window_mean(qg, deq, a)
    elif _is_torch(qg) or not _uniform_count(a):
        pool = op.nn.avg_pool2d if layout == "NCHW" else op.nn.avg_pool3d
        avg = e(pool(deq, pool_size=list(a.pool_size), strides=list(a.strides), padding=list(a.padding),
                     dilation=list(a.dilation), ceil_mode=False, count_include_pad=bool(a.count_include_pad),
                     layout=layout))
    else:  # the window's values added in row-major order in float32, as explicit ops (irgen_qdq.ort.avg_pool_in_order)
        avg = _window_mean(qg, deq, a)
    info = np.iinfo(out.dtype)
    if _is_torch(qg):  # torch: the window summed in row-major order in float32, / count, quantize_per_tensor
        expr = _rx_torch_quantize(qg, avg, out)
    else:  # ORT's QLinearAveragePool: rint(y / s_y + zp_y) in float32, saturated
        f = e(op.add(e(op.divide(avg, q.rx_const(out.scale[0], "float32"))),
                     q.rx_const(float(out.zero_point[0]), "float32")))
        expr = q.rx_round_to_int(e, f, 0, int(info.min), int(info.max), out.dtype)  # zp already in f, as _realize_mul
    rec = {"scheme": SCHEME, "kind": _LAYOUTS[layout], "inputs": [qx.record()], "output": out.record(),
           **({"reference": "torch"} if _is_torch(qg) else {}),
           "pool": _pool_record(a),
           "requant": {"rounding": "half_to_even",
                       "rounding_rule": ("y = quantize(mean of float32 (x - zp_x) * s_x over the window)" if _is_torch(qg)
                                         else "y = saturate(rint(m / s_y + zp_y)), m the float32 mean of (x - zp_x) * s_x "
                                              "over the window's values in row order (ORT's QLinearAveragePool)")},
           "clamp": [int(info.min), int(info.max)]}
    return [dqx, comp.name, qb.name], expr, rec
