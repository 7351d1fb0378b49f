"""ONNX Runtime's integer arithmetic in numpy, as its CPU kernels compute it: what verify's
recompute of the ``qdq`` layers reads (:mod:`irgen_qdq.recompute`) and the tables the
realization builds (:mod:`irgen_qdq.kernels`, :mod:`irgen_qdq.pooling`).

The generic pieces (``quantize_linear``, ``requantize_float``: ONNX QuantizeLinear and the
MLAS requantization) are irgen's (:mod:`irgen.plugin`); these are the kernels' own: the
pooling kernels' ``quantize_value``, QLinearSoftmax's table and row arithmetic, and the
windows of an average pool summed in row order.
"""

from __future__ import annotations

import numpy as np


def quantize_value_ort(y, scale, zero_point: int, dtype: str) -> np.ndarray:
    """ONNX Runtime's ``quantize_value`` of its QLinear pooling kernels: ``y / scale + zp`` in
    float32 (the zero point added before rounding), rounded half to even, saturated."""
    info = np.iinfo(dtype)
    f = np.asarray(y, np.float32) / np.asarray(scale, np.float32) + np.float32(zero_point)
    return np.clip(np.rint(f), info.min, info.max).astype(dtype)


def ort_softmax_table(x_scale: float, reduce_len: int, signed: bool) -> np.ndarray:
    """ONNX Runtime's QLinearSoftmax table (``QlinearBuildLookupTableUint32``, float
    entries): ``exp((i - 255 + b) * s_x)`` in double, with the headroom shift
    ``b = max(0, log(FLT_MAX / n) - 5) / s_x``, at index ``i`` (``uint8(i - 128)`` for int8)."""
    xs = float(np.float32(x_scale))
    shift = max(0.0, float(np.log(np.float64(np.float32(np.finfo(np.float32).max) / np.float32(reduce_len)))) - 5.0) / xs
    i = np.arange(256, dtype=np.float64)
    vals = np.exp((i - 255.0 + shift) * xs).astype(np.float32)
    table = np.empty(256, np.float32)
    table[((np.arange(256) - 128) & 255) if signed else np.arange(256)] = vals
    return table


def ort_softmax(x, table, y_scale: float, y_zero_point: int, dtype: str) -> np.ndarray:
    """ONNX Runtime's QLinearSoftmax over the last axis: ``e = table[x - max + 127 (int8)
    or + 255 (uint8)]``, a float32 sum in row order, ``rint(e * floor(1 / s_y) / sum) + zp``
    saturated to the type. ONNX Runtime 1.32 gives the quotient of float64 arithmetic: finite
    where the float32 product ``e * floor(1 / s_y)`` overflows (one element, whose table entry is
    ``FLT_MAX / e^5``; an output scale calibrated below 1/256, as ``quantize_static`` leaves a
    softmax that only a quantized MatMul reads), and results above the type's maximum saturate."""
    from irgen.plugin import sum_in_order

    xi = np.asarray(x).astype(np.int64)
    signed = dtype == "int8"
    idx = ((127 if signed else 255) - xi.max(axis=-1, keepdims=True) + xi) & 255
    e = np.asarray(table, np.float32)[idx]
    total = sum_in_order(e, axis=-1, keepdims=True)
    ys = np.float64(np.floor(np.float32(1.0) / np.float32(y_scale)))
    v = np.rint(e.astype(np.float64) * ys / total.astype(np.float64)) + int(y_zero_point)
    lo, hi = (-128, 127) if signed else (0, 255)
    return np.clip(v, lo, hi).astype(np.int8 if signed else np.uint8)


def pool_windows(hw, p: dict):
    """The windows of a 2-D or 3-D average pool (``p`` as a layer's ``quant.pool`` records it) over
    an input of spatial size ``hw`` (H, W or D, H, W): kernel, strides, output size, the padding
    that makes every window whole (all leading pads, then all trailing: in ceil mode zeros past the
    declared padding, as ONNX Runtime and torch size the output: the last window starts inside the
    input or its leading padding) and each output's count, float32 [*out], as ONNX Runtime's
    QLinearAveragePool divides: the input's values in the window, or the whole kernel when
    padding counts (past the padding too, where its float AveragePool would not count the part
    past it: measured on ORT 1.32, tests/test_qdq_exporter_patterns.py)."""
    nd = len(hw)
    k, st, pads = tuple(p["size"]), tuple(p["strides"]), tuple(p["padding"])
    lead, trail = pads[:nd], pads[nd:]
    out, extra = [], []
    for n, kk, s, a, b in zip(hw, k, st, lead, trail):
        span = n + a + b - kk
        o = (-(-span // s) if p.get("ceil_mode") else span // s) + 1
        if p.get("ceil_mode") and (o - 1) * s >= n + a:
            o -= 1
        out.append(o)
        extra.append(max(0, (o - 1) * s + kk - (n + a + b)))
    out = tuple(out)
    trail = tuple(b + e for b, e in zip(trail, extra))
    if p["count_include_pad"]:
        count = np.full(out, np.float32(np.prod(k)))
    else:
        one = np.pad(np.ones(tuple(hw), np.float32), tuple(zip(lead, trail)))
        count = np.zeros(out, np.float32)
        for offset in np.ndindex(*k):
            count = count + one[_window(offset, st, out)]
    return k, st, out, lead + trail, count


def _window(offset, strides, out) -> tuple:
    """The strided slices of the spatial axes that pick window offset ``offset`` of every output."""
    return tuple(slice(i, i + s * (o - 1) + 1, s) for i, s, o in zip(offset, strides, out))


def avg_pool_in_order(deq: np.ndarray, p: dict) -> np.ndarray:
    """NCHW (NCDHW) average pool in float32: each window's in-bounds values added in row-major
    order, / count (:func:`pool_windows`)."""
    nd = deq.ndim - 2
    k, st, out, pads, count = pool_windows(deq.shape[2:], p)
    x = np.pad(deq.astype(np.float32), ((0, 0), (0, 0), *zip(pads[:nd], pads[nd:])))
    total = np.zeros((*x.shape[:2], *out), np.float32)
    for offset in np.ndindex(*k):
        total = total + x[(slice(None), slice(None), *_window(offset, st, out))]
    return total / count
