"""A numpy-only reference interpreter of ``ir.json`` layers.

Each layer's ``fused_ops`` is a small program (see :func:`irgen.ir.build_layer_record`):
op ``j`` runs its Relax op (``relax_op``) on ``args`` that name a layer input
(``"input:K"``), a parameter (``"param:ROLE"``), an earlier op's result
(``"op:J"``) or a literal (``{"value": ...}``, ``{"shape": [...]}``).

This module imports only numpy: it is an independent check of what TVM
computed (the base of ``irgen verify``).

Layer outputs: the layer's ``results`` name the op result of each output
(``op:J`` or ``op:J.K``, item K of a tuple result); :func:`run_layer` returns
them in order.

Arithmetic: convolutions and matrix products accumulate in float64 (integer
inputs in int64) and are cast back to the op's result dtype, so the result is
at least as exact as TVM's float32 kernels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from irgen import declared
from irgen.irfile import read_ir
from irgen.safeio import inside, load_npy

__all__ = ["UnsupportedLayer", "run_layer", "run_op", "load_layer_params", "load_layer_inputs", "OPS"]


class UnsupportedLayer(Exception):
    """A layer uses an op (or an argument form) the reference does not implement."""

    def __init__(self, layer: str, op: str, detail: str = ""):
        self.layer = layer
        self.op = op
        msg = f"layer {layer!r}: op {op!r} is not supported by the numpy reference"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


# ----------------------------------------------------------------- helpers


def _pair(v: Any, n: int = 2) -> tuple[int, ...]:
    if isinstance(v, (list, tuple)):
        if len(v) == 1:
            return tuple(int(v[0]) for _ in range(n))
        return tuple(int(x) for x in v)
    return tuple(int(v) for _ in range(n))


def _acc_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype.kind in "fc" else np.dtype(np.int64)


def _check_layout(attrs: dict, key: str, want: str) -> None:
    v = attrs.get(key)
    if v not in (None, want):
        raise NotImplementedError(f"{key}={v} (only {want})")


def _windows(x: np.ndarray, kernel, strides, dilation, out) -> np.ndarray:
    """(N, C, *spatial) padded -> (N, C, *out, *kernel) strided view (any number of spatial axes)."""
    st = x.strides
    sp = st[2:]
    return np.lib.stride_tricks.as_strided(
        x,
        shape=(*x.shape[:2], *out, *kernel),
        strides=(st[0], st[1], *(a * s for a, s in zip(sp, strides)), *(a * d for a, d in zip(sp, dilation))),
        writeable=False,
    )


def _spatial_pads(v: Any, nd: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Relax padding of ``nd`` spatial axes (1, ``nd`` or ``2 * nd`` values) -> (before, after)."""
    p = _pair(v, nd)
    if len(p) == nd:
        return p, p
    if len(p) == 2 * nd:
        return p[:nd], p[nd:]
    raise ValueError(f"bad padding {v!r}")


# ----------------------------------------------------------------- ops


def _perm(src: str, dst: str) -> list[int]:
    return [src.index(ch) for ch in dst]


def conv2d(x: np.ndarray, w: np.ndarray, attrs: dict) -> np.ndarray:
    """2-D convolution in any data/kernel layout (computed in NCHW/OIHW)."""
    return _conv_layouts(x, w, attrs, "NCHW", "OIHW")


def conv3d(x: np.ndarray, w: np.ndarray, attrs: dict) -> np.ndarray:
    """3-D convolution in any data/kernel layout (computed in NCDHW/OIDHW)."""
    return _conv_layouts(x, w, attrs, "NCDHW", "OIDHW")


def _conv_layouts(x: np.ndarray, w: np.ndarray, attrs: dict, data: str, kernel: str) -> np.ndarray:
    """A convolution whose layouts are permutations of ``data`` / ``kernel`` (its canonical ones)."""
    nd = len(data) - 2
    dl = str(attrs.get("data_layout") or data)
    kl = str(attrs.get("kernel_layout") or kernel)
    ol = str(attrs.get("out_layout") or dl)
    if sorted(dl) != sorted(data) or sorted(kl) != sorted(kernel) or sorted(ol) != sorted(data):
        raise NotImplementedError(f"conv{nd}d layouts {dl}/{kl}/{ol}")
    x = np.transpose(x, _perm(dl, data))
    w = np.transpose(w, _perm(kl, kernel))
    out_dtype = np.dtype(attrs.get("out_dtype") or np.result_type(x.dtype, w.dtype))
    before, after = _spatial_pads(attrs.get("padding", [0] * nd), nd)
    y = _conv(x, w, _pair(attrs.get("strides", [1] * nd), nd), _pair(attrs.get("dilation", [1] * nd), nd),
              before, after, int(attrs.get("groups", 1)), out_dtype)
    return np.transpose(y, _perm(data, ol))


def _conv(x: np.ndarray, w: np.ndarray, strides, dilation, before, after, g: int, out_dtype: np.dtype) -> np.ndarray:
    """Convolution of ``x`` (N, C, *spatial) with ``w`` (O, C / g, *kernel), accumulated in float64
    (integers in int64), cast to ``out_dtype``."""
    nd = x.ndim - 2
    acc = _acc_dtype(out_dtype)
    n, c = x.shape[:2]
    o, ci = w.shape[:2]
    kernel = w.shape[2:]
    if c != ci * g or o % g:
        raise ValueError(f"conv{nd}d shapes {x.shape} x {w.shape} with groups={g}")
    exact_in_float = False
    if acc.kind == "i" and x.size and w.size:
        # integer sums whose every partial sum stays below 2**53 are exact in float64,
        # where the product runs on BLAS instead of numpy's slow integer matmul
        bound = float(np.abs(x).max()) * float(np.abs(w).max()) * ci * int(np.prod(kernel))
        exact_in_float = bound < 2.0**53
    work = np.dtype(np.float64) if exact_in_float else acc
    xp = np.pad(x.astype(work), ((0, 0), (0, 0), *zip(before, after)))
    out = tuple((xp.shape[2 + i] - dilation[i] * (kernel[i] - 1) - 1) // strides[i] + 1 for i in range(nd))
    depth, positions = ci * int(np.prod(kernel)), int(np.prod(out))
    # the windows as (N, G, C/G x kernel, positions) columns: one batched BLAS matrix product
    win = _windows(xp, kernel, strides, dilation, out)
    cols = win.transpose(0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd)).reshape(n, g, depth, positions)
    y = np.matmul(w.astype(work).reshape(g, o // g, depth), cols)
    if exact_in_float:
        y = y.astype(acc)  # whole numbers, exactly
    return y.reshape(n, o, *out).astype(out_dtype)


def conv1d(x: np.ndarray, w: np.ndarray, attrs: dict) -> np.ndarray:
    """1-D convolution (NCW/OIW, as TVM's importers write it): :func:`conv2d` over a height of one."""
    layouts = (str(attrs.get("data_layout") or "NCW"), str(attrs.get("kernel_layout") or "OIW"))
    if layouts != ("NCW", "OIW") or str(attrs.get("out_layout") or "NCW") != "NCW":
        raise NotImplementedError(f"conv1d layouts {layouts[0]}/{layouts[1]}")
    pad = _pair(attrs.get("padding", [0, 0]))
    y = conv2d(x[:, :, None, :], w[:, :, None, :], {
        "strides": [1, _pair(attrs.get("strides", [1]), 1)[0]], "dilation": [1, _pair(attrs.get("dilation", [1]), 1)[0]],
        "padding": [0, pad[0], 0, pad[-1]], "groups": attrs.get("groups", 1), "out_dtype": attrs.get("out_dtype")})
    return y[:, :, 0, :]


def conv2d_transpose(x: np.ndarray, w: np.ndarray, attrs: dict) -> np.ndarray:
    """2-D transposed convolution (NCHW data, IOHW kernel: TVM's importers' layout)."""
    return _conv_transpose(x, w, attrs, "NCHW", "IOHW")


def conv3d_transpose(x: np.ndarray, w: np.ndarray, attrs: dict) -> np.ndarray:
    """3-D transposed convolution (NCDHW data, IODHW kernel)."""
    return _conv_transpose(x, w, attrs, "NCDHW", "IODHW")


def _conv_transpose(x: np.ndarray, w: np.ndarray, attrs: dict, data: str, kernel: str) -> np.ndarray:
    """A transposed convolution: every input pixel scatters ``x * w`` into the output at
    ``stride * position + dilation * kernel offset``, then the padding is cut off
    (``output_padding`` extends the far end)."""
    nd = len(data) - 2
    dl, kl = str(attrs.get("data_layout") or data), str(attrs.get("kernel_layout") or kernel)
    if dl != data or kl != kernel or str(attrs.get("out_layout") or dl) != data:
        raise NotImplementedError(f"conv{nd}d_transpose layouts {dl}/{kl}")
    strides = _pair(attrs.get("strides", [1] * nd), nd)
    dilation = _pair(attrs.get("dilation", [1] * nd), nd)
    before, after = _spatial_pads(attrs.get("padding", [0] * nd), nd)
    extra = _pair(attrs.get("output_padding", [0] * nd), nd)
    g = int(attrs.get("groups", 1))
    out_dtype = np.dtype(attrs.get("out_dtype") or np.result_type(x.dtype, w.dtype))
    acc = _acc_dtype(out_dtype)
    n, c, *size = x.shape
    ci, og, *k = w.shape
    if c != ci or c % g:
        raise ValueError(f"conv{nd}d_transpose shapes {x.shape} x {w.shape} with groups={g}")
    full = [(size[i] - 1) * strides[i] + dilation[i] * (k[i] - 1) + 1 + extra[i] for i in range(nd)]
    y = np.zeros((n, g, og, *full), acc)
    xg = x.astype(acc).reshape(n, g, c // g, *size)
    wg = w.astype(acc).reshape(g, c // g, og, *k)
    for offset in np.ndindex(*k):
        contrib = np.einsum("ngc...,gco->ngo...", xg, wg[(slice(None),) * 3 + offset])
        at = tuple(slice(offset[i] * dilation[i], offset[i] * dilation[i] + (size[i] - 1) * strides[i] + 1, strides[i])
                   for i in range(nd))
        y[(slice(None),) * 3 + at] += contrib
    y = y.reshape(n, g * og, *full)[(slice(None),) * 2 + tuple(slice(before[i], full[i] - after[i]) for i in range(nd))]
    return y.astype(out_dtype)


def _pool(x: np.ndarray, attrs: dict, kind: str, canonical: str) -> np.ndarray:
    """Max or average pooling in a layout that permutes ``canonical`` (NCHW, NCDHW)."""
    layout = str(attrs.get("layout") or canonical)
    out_layout = str(attrs.get("out_layout") or layout)
    if sorted(layout) != sorted(canonical) or sorted(out_layout) != sorted(canonical):
        raise NotImplementedError(f"pool{len(canonical) - 2}d layouts {layout}/{out_layout}")
    y = _pool_nc(np.transpose(x, _perm(layout, canonical)), attrs, kind)
    return np.transpose(y, _perm(canonical, out_layout))


def _pool_out(size: int, k: int, s: int, d: int, p0: int, p1: int, ceil: bool) -> tuple[int, int]:
    """One spatial axis of a pooling: its output size, and how far the last window reaches past
    the padding (ceil mode)."""
    eff = d * (k - 1) + 1
    span = size + p0 + p1 - eff
    if ceil:
        o = -(-span // s) + 1
        # the last window must start inside the input or the left padding
        if (o - 1) * s >= size + p0:
            o -= 1
    else:
        o = span // s + 1
    return o, max(0, (o - 1) * s + eff - (size + p0 + p1))


def _pool_nc(x: np.ndarray, attrs: dict, kind: str) -> np.ndarray:
    """Pooling of ``x`` (N, C, *spatial)."""
    nd = x.ndim - 2
    k = _pair(attrs["pool_size"], nd)
    st = _pair(attrs.get("strides", [1] * nd), nd)
    dil = _pair(attrs.get("dilation", [1] * nd), nd)
    before, after = _spatial_pads(attrs.get("padding", [0] * (2 * nd)), nd)
    ceil = bool(attrs.get("ceil_mode", False))
    size = x.shape[2:]
    outs = [_pool_out(size[i], k[i], st[i], dil[i], before[i], after[i], ceil) for i in range(nd)]
    out, over = tuple(o for o, _ in outs), [e for _, e in outs]
    pads = ((0, 0), (0, 0), *((before[i], after[i] + over[i]) for i in range(nd)))
    if kind == "max":
        fill = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
        xp = np.pad(x, pads, constant_values=fill)
        return _windows(xp, k, st, dil, out).max(axis=tuple(range(2 + nd, 2 + 2 * nd))).astype(x.dtype)
    # a float window is summed in x's own type, row by row, as TVM's kernel does: a quantized
    # layer's float step (a quantized average pool computed in float) must round exactly as the golden data did
    acc = x.dtype if x.dtype.kind == "f" else _acc_dtype(x.dtype)
    xp = np.pad(x.astype(acc), pads)
    win = _windows(xp, k, st, dil, out)
    s = np.zeros(win.shape[:2 + nd], acc)
    for offset in np.ndindex(*k):
        s += win[(Ellipsis, *offset)]
    if attrs.get("count_include_pad", False):
        # padding counts, the ceil-mode overhang beyond it does not
        ones = np.pad(np.ones((1, 1, *(size[i] + before[i] + after[i] for i in range(nd))), acc),
                      ((0, 0), (0, 0), *((0, e) for e in over)))
    else:
        ones = np.pad(np.ones((1, 1, *size), acc), pads)
    cnt = _windows(ones, k, st, dil, out).sum(axis=tuple(range(2 + nd, 2 + 2 * nd)))
    y = s / np.maximum(cnt, 1).astype(acc)
    return y.astype(x.dtype)


#: a matmul's second operand is widened to the accumulator type this many bytes of it at a time
_WIDEN_BYTES = 64 << 20


def _matmul(a: np.ndarray, b: np.ndarray, attrs: dict) -> np.ndarray:
    out_dtype = np.dtype(attrs.get("out_dtype") or np.result_type(a.dtype, b.dtype))
    acc = _acc_dtype(out_dtype)
    step = max(1, _WIDEN_BYTES // max(1, acc.itemsize * int(np.prod(b.shape[:-1]))))
    if b.ndim < 2 or b.shape[-1] <= step:
        return np.matmul(a.astype(acc), b.astype(acc)).astype(out_dtype)
    # a large weight (an LLM's vocabulary projection): widened a block of columns at a time, not
    # all at once (each output element is the same sum over the same row of ``a``)
    wide = a.astype(acc)
    return np.concatenate([np.matmul(wide, b[..., j:j + step].astype(acc)).astype(out_dtype)
                           for j in range(0, b.shape[-1], step)], axis=-1)


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    xd = x.astype(np.float64)
    e = np.exp(xd - xd.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(x.dtype)


def _batch_norm(x, gamma, beta, mean, var, attrs: dict):
    axis = int(attrs.get("axis", 1)) % x.ndim
    eps = float(attrs.get("epsilon", 1e-5))
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]

    def r(a):
        return np.asarray(a, np.float64).reshape(shape)

    g = r(gamma) if attrs.get("scale", True) else 1.0
    b = r(beta) if attrs.get("center", True) else 0.0
    y = (x.astype(np.float64) - r(mean)) / np.sqrt(r(var) + eps) * g + b
    return (y.astype(x.dtype), np.asarray(mean), np.asarray(var))


def _mean(x: np.ndarray, attrs: dict) -> np.ndarray:
    axis = attrs.get("axis")
    axis = None if axis is None else tuple(int(a) % max(x.ndim, 1) for a in axis)
    keepdims = bool(attrs.get("keepdims", False))
    if x.dtype != np.float32 or x.ndim == 0:
        return np.mean(x.astype(np.float64), axis=axis, keepdims=keepdims).astype(x.dtype)
    # float32 as TVM's kernel: the reduced elements added in row-major order, then / count (a float64
    # mean differed in the last bit, and after a quantize by one LSB: torch's quantized ShuffleNetV2)
    axes = tuple(range(x.ndim)) if axis is None else tuple(sorted(set(axis)))
    rest = [a for a in range(x.ndim) if a not in axes]
    flat = np.transpose(x, rest + list(axes)).reshape([x.shape[a] for a in rest] + [-1])
    y = sum_in_order(flat, axis=-1) / np.float32(flat.shape[-1])
    if keepdims:
        y = y.reshape([1 if a in axes else x.shape[a] for a in range(x.ndim)])
    return np.asarray(y, np.float32)


def _reduce(fn, x: np.ndarray, attrs: dict) -> np.ndarray:
    axis = attrs.get("axis")
    axis = None if axis is None else tuple(int(a) for a in axis)
    if fn is np.sum and x.dtype.kind == "f":
        fn = sum_in_order
    return np.asarray(fn(x, axis=axis, keepdims=bool(attrs.get("keepdims", False)))).astype(x.dtype)


def sum_in_order(x: np.ndarray, axis=None, keepdims: bool = False) -> np.ndarray:
    """``np.sum``, but a float sum over one axis adds in index order (TVM's
    reduction loop; numpy's pairwise sum rounds differently)."""
    if x.dtype.kind != "f" or axis is None or len(np.atleast_1d(axis)) != 1 or x.ndim == 0:
        return np.sum(x, axis=axis, keepdims=keepdims)
    ax = int(np.atleast_1d(axis)[0])
    total = np.take(np.cumsum(x, axis=ax, dtype=x.dtype), [-1], axis=ax)
    return total if keepdims else np.squeeze(total, axis=ax)


def _adaptive_avg_pool(x: np.ndarray, attrs: dict, canonical: str) -> np.ndarray:
    """Adaptive average pooling of ``x`` (N, C, *spatial): output cell ``i`` of an axis of size
    ``n`` averages ``[floor(i n / o), ceil((i + 1) n / o))``."""
    _check_layout(attrs, "layout", canonical)
    nd = x.ndim - 2
    out = attrs.get("output_size")
    size = x.shape[2:]
    out = size if out is None else _pair(out, nd)
    acc = np.float32 if x.dtype == np.float32 else np.float64
    y = np.empty(x.shape[:2] + tuple(out), acc)
    for cell in np.ndindex(*out):
        bounds = [((cell[a] * size[a]) // out[a], -((-(cell[a] + 1) * size[a]) // out[a])) for a in range(nd)]
        # the window summed in row-major order in the tensor's float type, then / count, as
        # TVM's kernel does (a float64 mean differed by one LSB after the quantize of torch's
        # quantized MobileNetV2's global pool)
        total = np.zeros(x.shape[:2], acc)
        for at in np.ndindex(*(hi - lo for lo, hi in bounds)):
            total = total + x[(slice(None), slice(None), *(lo + d for (lo, _), d in zip(bounds, at)))].astype(acc)
        y[(slice(None), slice(None), *cell)] = total / acc(np.prod([hi - lo for lo, hi in bounds]))
    return y.astype(x.dtype)


def _shape(v: Any) -> tuple[int, ...]:
    if isinstance(v, dict) and "shape" in v:
        return tuple(int(d) for d in v["shape"])
    if isinstance(v, np.ndarray):
        return tuple(int(d) for d in v.reshape(-1))
    if isinstance(v, (list, tuple)):
        return tuple(int(d) for d in v)
    raise ValueError(f"not a shape: {v!r}")


def _scalar(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return v.item() if v.size == 1 else v
    return v


def _binary(fn: Callable) -> Callable:
    def run(args, attrs):
        a, b = args
        dtype = np.result_type(*(x.dtype for x in (a, b) if isinstance(x, np.ndarray))) if any(
            isinstance(x, np.ndarray) for x in (a, b)
        ) else None
        y = fn(np.asarray(a), np.asarray(b))
        return y.astype(dtype) if dtype is not None else y

    return run


def _divide(a, b):
    if a.dtype.kind in "iu" and b.dtype.kind in "iu":  # TVM's integer divide truncates, as C does
        q = np.floor_divide(a, b)
        return q + ((np.remainder(a, b) != 0) & ((a < 0) != (b < 0)))
    return a / b


def _clip(args, attrs):
    x, lo, hi = args
    return np.clip(x, _scalar(lo), _scalar(hi)).astype(x.dtype)


def _unary_f(fn: Callable) -> Callable:
    def run(args, attrs):
        (x,) = args
        return fn(x.astype(np.float64)).astype(x.dtype)

    return run


def _activation(fn: Callable) -> Callable:
    """A float activation: ``fn`` in float64 then cast, or a declared ``approximation``."""
    exact = _unary_f(fn)
    return lambda args, attrs: (rational_fma(args[0], attrs["approximation"]) if attrs.get("approximation")
                                else exact(args, attrs))


def _concat(args, attrs):
    return np.concatenate([np.asarray(a) for a in args], axis=int(attrs.get("axis", 0)))


def _permute(args, attrs):
    (x,) = args
    axes = attrs.get("axes")
    return np.transpose(x, None if axes is None else [int(a) for a in axes])


def _reshape(args, attrs):
    x, shape = args
    return np.reshape(x, _shape(shape))


def _flatten(args, attrs):
    (x,) = args
    return x.reshape(-1)


def _squeeze(args, attrs):
    (x,) = args
    axis = attrs.get("axis")
    return np.squeeze(x, axis=None if axis is None else tuple(int(a) for a in axis))


def _expand_dims(args, attrs):
    (x,) = args
    y = x
    axes = sorted(int(a) % (x.ndim + len(attrs["axis"])) for a in attrs["axis"])
    for a in axes:
        y = np.expand_dims(y, a)
    return y


def _lrn(args, attrs):
    # relax.nn.local_response_norm if it ever appears (TVM's semantics: ONNX LRN)
    (x,) = args
    size = int(attrs["size"])
    axis = int(attrs.get("axis", 1)) % x.ndim
    alpha, beta, bias = float(attrs["alpha"]), float(attrs["beta"]), float(attrs["bias"])
    xd = x.astype(np.float64)
    sq = xd * xd
    pad = [(0, 0)] * x.ndim
    pad[axis] = ((size - 1) // 2, size // 2)
    sqp = np.pad(sq, pad)
    acc = np.zeros_like(sq)
    for k in range(size):
        acc += np.take(sqp, range(k, k + x.shape[axis]), axis=axis)
    return (xd / np.power(bias + alpha / size * acc, beta)).astype(x.dtype)


def _dropout(args, attrs):
    """Inference dropout: identity; relax.nn.dropout returns (output, mask)."""
    (x,) = args
    return (x, np.ones_like(x))


def _where(args, attrs):
    c, a, b = (np.asarray(x) for x in args)
    dtype = np.result_type(*(x for x in (a, b) if x.ndim)) if (a.ndim or b.ndim) else np.result_type(a, b)
    return np.where(c, a, b).astype(dtype)


def _qparam(v: Any, x: np.ndarray, axis: int, dtype: str) -> np.ndarray:
    """A quantize/dequantize scale or zero point, shaped to broadcast along ``axis`` of ``x``."""
    a = np.asarray(v, dtype)
    if a.size <= 1:
        return a.reshape(())
    shape = [1] * x.ndim
    shape[axis % x.ndim] = a.size
    return a.reshape(shape)


def _scatter_nd(args, attrs):
    """relax.scatter_nd (ONNX ScatterND): ``data`` with ``updates`` written at the index tuples of
    ``indices`` (their last axis), in order, each replacing or combined by ``reduction``."""
    data, idx, upd = (np.asarray(a) for a in args)
    reduction = str(attrs.get("reduction") or "update")
    combine = {"update": lambda old, new: new, "add": np.add, "mul": np.multiply, "min": np.minimum,
               "max": np.maximum}.get(reduction)
    if combine is None:
        raise NotImplementedError(f"scatter_nd reduction {reduction}")
    out = data.copy()
    k = idx.shape[-1]
    where = idx.reshape(-1, k).astype(np.int64)
    upd = upd.reshape((where.shape[0],) + data.shape[k:])
    for i, ix in enumerate(where):
        t = tuple(int(v) for v in ix)
        out[t] = combine(out[t], upd[i])
    return out


def _quantize(args, attrs):
    """relax.quantize as TVM legalizes it: ``clip(round(x / scale) + zp)``, float32, round half to even."""
    x, scale, zp = args
    axis = int(attrs.get("axis", -1))
    out = str(attrs.get("out_dtype") or "int8")
    f = np.asarray(x, np.float32) / _qparam(scale, x, axis, "float32")
    if "int" in out:
        f = np.rint(f)
        info = np.iinfo(out)
        f = f + _qparam(zp, x, axis, "float32")
        return np.clip(f, info.min, info.max).astype(out)
    return (f + _qparam(zp, x, axis, "float32")).astype(out)


#: float8 dtype -> its largest finite value
_FLOAT8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def _float8_quantize(args, attrs):
    """A quantize to float8 with a constant ``scale`` attribute: ``float8(x / scale)`` (float32
    division, round to nearest even with ml_dtypes; ``saturate``: clamped to the largest finite
    value first, NaN kept), and with ``dequantize`` that value times the scale in float32."""
    import ml_dtypes

    dtype = str(attrs["out_dtype"])
    if dtype not in _FLOAT8_MAX or "scale" not in attrs:
        raise NotImplementedError(f"quantize to {dtype}")
    s = np.float32(attrs["scale"])
    v = np.asarray(args[0], np.float32) / s
    if attrs.get("saturate", True):
        top = np.float32(_FLOAT8_MAX[dtype])
        v = np.where(np.abs(v) > top, np.copysign(top, v), v).astype(np.float32)
    q = v.astype(getattr(ml_dtypes, dtype))
    return (q.astype(np.float32) * s).astype(np.float32) if attrs.get("dequantize") else q


def _dequantize(args, attrs):
    """relax.dequantize as TVM legalizes it: ``float32(int32(x) - zp) * float32(scale)``."""
    x, scale, zp = args
    x = np.asarray(x)
    axis = int(attrs.get("axis", -1))
    out = str(attrs.get("out_dtype") or "float32")
    if out != "float32":
        raise NotImplementedError(f"dequantize to {out}")
    wide = "float32" if x.dtype.kind == "f" else "int32"
    sub = x.astype(wide) - _qparam(zp, x, axis, wide)
    return sub.astype(np.float32) * _qparam(scale, x, axis, "float32")


def _power(a, b):
    return np.power(a, b)


def _erf(x):
    import math

    return np.vectorize(math.erf, otypes=[np.float64])(np.asarray(x, np.float64))


def _layer_norm(args, attrs):
    """relax.nn.layer_norm: ``(x - mean) / sqrt(var + eps) * gamma + beta`` over ``axes``, in float64."""
    x, gamma, beta = (np.asarray(a) for a in args[:3])
    axes = tuple(int(a) % x.ndim for a in np.atleast_1d(attrs.get("axes", -1)))
    xd = x.astype(np.float64)
    mean = xd.mean(axis=axes, keepdims=True)
    var = ((xd - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (xd - mean) / np.sqrt(var + float(attrs.get("epsilon", 1e-5)))
    if attrs.get("scale", True):
        y = y * gamma.astype(np.float64)
    if attrs.get("center", True):
        y = y + beta.astype(np.float64)
    return y.astype(x.dtype)


def _strided_slice(args, attrs):
    """relax.strided_slice with constant axes, begin, end (and strides)."""
    x = np.asarray(args[0])
    axes, begin, end = (np.atleast_1d(np.asarray(_shape_or(a))) for a in args[1:4])
    strides = np.atleast_1d(np.asarray(_shape_or(args[4]))) if len(args) > 4 else np.ones(len(axes), np.int64)
    index = [slice(None)] * x.ndim
    for a, b, e, st in zip(axes, begin, end, strides):
        index[int(a) % x.ndim] = slice(int(b), int(e), int(st))
    return x[tuple(index)]


def _shape_or(v):
    return v["shape"] if isinstance(v, dict) and "shape" in v else v


#: relax.nn.pad modes -> numpy's
_PAD_MODES = {"reflect": "reflect", "replicate": "edge", "circular": "wrap"}


def _pad(args, attrs):
    """relax.nn.pad: ``pad_width`` is (before, after) per axis, flattened; constant (``pad_value``),
    reflect (mirror without the edge), replicate (edge) or circular (wrap) mode."""
    x = np.asarray(args[0])
    mode = str(attrs.get("pad_mode", "constant"))
    w = [int(v) for v in attrs["pad_width"]]
    widths = [(w[2 * a], w[2 * a + 1]) for a in range(x.ndim)]
    if mode == "constant":
        return np.pad(x, widths, constant_values=np.asarray(attrs.get("pad_value", 0)).astype(x.dtype))
    if mode not in _PAD_MODES:
        raise NotImplementedError(f"pad mode {mode!r}")
    return np.pad(x, widths, mode=_PAD_MODES[mode])


# ------------------------------------- transformer, resize and elementwise ops (TVM's legalization)


def _f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def _axes(attrs: dict, key: str = "axis") -> tuple[int, ...] | None:
    v = attrs.get(key)
    return None if v is None else tuple(int(a) for a in np.atleast_1d(v))


def _split(args, attrs):
    """relax.split -> a tuple; an int is sections of ceil(n / sections) each (topi.split), a list is indices."""
    x = np.asarray(args[0])
    axis = int(attrs.get("axis", 0)) % x.ndim
    ios = attrs["indices_or_sections"]
    if isinstance(ios, (list, tuple)):
        idx = [int(i) for i in ios]
    else:
        step = -(-x.shape[axis] // int(ios))
        idx = [step * k for k in range(1, int(ios))]
    return tuple(np.split(x, idx, axis=axis))


def _erf64(x: np.ndarray) -> np.ndarray:
    import math

    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _gelu(args, attrs):
    """relax.nn.gelu (erf form): ``x * (0.5 + erf(x * sqrt(0.5)) * 0.5)``."""
    x = np.asarray(args[0])
    xd = _f64(x)
    return (xd * (0.5 + _erf64(xd * 0.5**0.5) * 0.5)).astype(x.dtype)


def _gelu_tanh(args, attrs):
    """relax.nn.gelu_tanh: ``0.5 * x * (1 + tanh(sqrt(2/pi) * x * (1 + 0.044715 * x * x)))``."""
    x = np.asarray(args[0])
    xd = _f64(x)
    return (0.5 * xd * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * xd * (1.0 + 0.044715 * xd * xd)))).astype(x.dtype)


def _silu(args, attrs):
    x = np.asarray(args[0])
    xd = _f64(x)
    return (xd / (1.0 + np.exp(-xd))).astype(x.dtype)


def _cumsum(args, attrs, fn=np.cumsum):
    """relax.cumsum / cumprod: in the accumulator dtype (``dtype``), inclusive unless ``exclusive``,
    in index order (a float32 running sum, as TVM's scan)."""
    x = np.asarray(args[0])
    axis = attrs.get("axis")
    if axis is None:
        x, axis = x.reshape(-1), 0
    axis = int(axis)
    dtype = np.dtype(str(attrs.get("dtype") or x.dtype))
    y = fn(x.astype(dtype), axis=axis, dtype=dtype)
    if attrs.get("exclusive"):
        y = y - x.astype(dtype) if fn is np.cumsum else y / x.astype(dtype)
    return y


def _resize_coord(out_size: int, in_size: int, mode: str, roi: tuple[float, float]) -> np.ndarray:
    """topi.image.get_inx in float32: the input coordinate of each output index."""
    x = np.arange(out_size, dtype=np.float32)
    scale = np.float32(in_size) / np.float32(out_size)
    if mode == "half_pixel":
        return (x + np.float32(0.5)) * scale - np.float32(0.5)
    if mode == "align_corners":
        return np.float32(in_size - 1) / np.float32(max(out_size - 1, 1)) * x if out_size > 1 else x * 0
    if mode == "asymmetric":
        return scale * x
    if mode == "pytorch_half_pixel":
        return (x + np.float32(0.5)) * scale - np.float32(0.5) if out_size > 1 else x * 0
    if mode == "tf_half_pixel_for_nn":
        return (x + np.float32(0.5)) * scale
    raise NotImplementedError(f"resize2d coordinate_transformation_mode {mode!r}")


def _nearest(c: np.ndarray, rounding: str, mode: str) -> np.ndarray:
    rounding = rounding or ("round" if mode == "align_corners" else "floor")
    if rounding == "round":
        return np.rint(c)
    if rounding == "round_prefer_floor":
        return np.ceil(c - np.float32(0.5))
    if rounding == "round_prefer_ceil":
        return np.floor(c + np.float32(0.5))
    if rounding == "floor":
        return np.floor(c + np.float32(1e-5))
    if rounding == "ceil":
        return np.ceil(c - np.float32(1e-5))
    raise NotImplementedError(f"resize2d rounding_method {rounding!r}")


def _cubic_taps(c: np.ndarray, size: int, alpha: np.float32, exclude: bool):
    """topi's cubic interpolation along one axis: the 4 weights (Keys' spline with
    coefficient ``alpha``, in float32) of the taps at floor(c) - 1 .. floor(c) + 2, and the
    tap indices clamped to the image. With ``exclude`` (ONNX ``exclude_outside``) taps
    outside the image weigh 0 and the others are renormalized."""
    f = np.floor(c)
    t = (c - f).astype(np.float32)
    base = f.astype(np.int64)
    t2, t3 = t * t, t * t * t
    two, three = np.float32(2), np.float32(3)
    w = [alpha * (t3 - two * t2 + t),
         (alpha + two) * t3 - (three + alpha) * t2 + np.float32(1),
         -(alpha + two) * t3 + (three + two * alpha) * t2 - alpha * t,
         -alpha * t3 + alpha * t2]
    if exclude:
        w = [np.where((base - 1 + i < 0) | (base + i > size), np.float32(0), wi).astype(np.float32)
             for i, wi in enumerate(w)]
        total = ((w[0] + w[1]) + w[2]) + w[3]
        w = [wi / total for wi in w]
    taps = [np.clip(base - 1 + i, 0, size - 1) for i in range(4)]
    return w, taps


def _resize_input(args, attrs, canonical: str):
    """(data, data in the ``canonical`` layout, its own layout, method, coordinate transformation
    mode) of a resize."""
    x = np.asarray(args[0])
    layout = str(attrs.get("layout") or canonical)
    if sorted(layout) != sorted(canonical):
        raise NotImplementedError(f"resize{len(canonical) - 2}d layout {layout}")
    return (x, np.transpose(x, _perm(layout, canonical)), layout, str(attrs.get("method") or "linear"),
            str(attrs.get("coordinate_transformation_mode") or "half_pixel"))


def _resize2d(args, attrs):
    """relax.image.resize2d (topi.image.resize2d): nearest_neighbor, linear or cubic,
    coordinates in float32, source indices clamped to the image."""
    x, xn, layout, method, mode = _resize_input(args, attrs, "NCHW")
    h, w = xn.shape[2:]
    oh, ow = _pair(_shape(args[1]) if not isinstance(args[1], (int, float)) else args[1])
    cy, cx = _resize_coord(oh, h, mode, (0, 0)), _resize_coord(ow, w, mode, (0, 0))
    if method == "nearest_neighbor":
        rounding = str(attrs.get("rounding_method") or "")
        iy = np.clip(_nearest(cy, rounding, mode).astype(np.int64), 0, h - 1)
        ix = np.clip(_nearest(cx, rounding, mode).astype(np.int64), 0, w - 1)
        y = xn[:, :, iy][:, :, :, ix]
    elif method == "linear":
        y0, x0 = np.floor(cy), np.floor(cx)
        ty, tx = (cy - y0).astype(np.float32), (cx - x0).astype(np.float32)
        y0, x0 = y0.astype(np.int64), x0.astype(np.int64)
        ys = [np.clip(y0 + j, 0, h - 1) for j in (0, 1)]
        xs = [np.clip(x0 + i, 0, w - 1) for i in (0, 1)]
        p = [[xn[:, :, ys[j]][:, :, :, xs[i]].astype(np.float32) for i in (0, 1)] for j in (0, 1)]
        txb, tyb = tx[None, None, None, :], ty[None, None, :, None]

        def lerp(a, b, t):
            return a * (np.float32(1.0) - t) + b * t

        y = lerp(lerp(p[0][0], p[0][1], txb), lerp(p[1][0], p[1][1], txb), tyb)
    elif method == "cubic":
        alpha = np.float32(attrs.get("cubic_alpha", -0.75))
        exclude = bool(int(attrs.get("cubic_exclude", 0) or 0))
        wy, ys = _cubic_taps(cy, h, alpha, exclude)
        wx, xs = _cubic_taps(cx, w, alpha, exclude)
        # topi's order: each of the 4 rows interpolated along x, then the rows along y
        rows = []
        for j in range(4):
            xr = xn[:, :, ys[j]].astype(np.float32)
            acc = np.float32(0)
            for i in range(4):
                acc = acc + xr[:, :, :, xs[i]] * wx[i][None, None, None, :]
            rows.append(acc)
        y = np.float32(0)
        for j in range(4):
            y = y + rows[j] * wy[j][None, None, :, None]
    else:
        raise NotImplementedError(f"resize2d method {method!r}")
    y = y.astype(str(attrs.get("out_dtype") or x.dtype))
    return np.transpose(y, _perm("NCHW", layout))


def _resize3d(args, attrs):
    """relax.image.resize3d (topi.image.resize3d): nearest_neighbor or linear (trilinear: along
    x, then y, then z), coordinates in float32, source indices clamped to the volume."""
    x, xn, layout, method, mode = _resize_input(args, attrs, "NCDHW")
    if mode == "tf_crop_and_resize":
        raise NotImplementedError("resize3d coordinate_transformation_mode 'tf_crop_and_resize'")
    size = xn.shape[2:]
    out = _pair(_shape(args[1]), 3)
    coords = [_resize_coord(out[a], size[a], mode, (0, 0)) for a in range(3)]

    def gather(idx):  # the voxels at (z, y, x) index vectors, clamped
        iz, iy, ix = (np.clip(i, 0, size[a] - 1) for a, i in enumerate(idx))
        return xn[:, :, iz][:, :, :, iy][:, :, :, :, ix]

    if method == "nearest_neighbor":
        rounding = str(attrs.get("rounding_method") or "")
        y = gather([_nearest(c, rounding, mode).astype(np.int64) for c in coords])
    elif method == "linear":
        base = [np.floor(c) for c in coords]
        t = [(c - b).astype(np.float32) for c, b in zip(coords, base)]
        base = [b.astype(np.int64) for b in base]
        tz, ty, tx = t[0][:, None, None], t[1][None, :, None], t[2][None, None, :]

        def lerp(a, b, w):
            return a * (np.float32(1.0) - w) + b * w

        p = {(k, j, i): gather([base[0] + k, base[1] + j, base[2] + i]).astype(np.float32)
             for k in (0, 1) for j in (0, 1) for i in (0, 1)}
        planes = [lerp(lerp(p[k, 0, 0], p[k, 0, 1], tx), lerp(p[k, 1, 0], p[k, 1, 1], tx), ty) for k in (0, 1)]
        y = lerp(planes[0], planes[1], tz)
    else:
        raise NotImplementedError(f"resize3d method {method!r}")
    y = y.astype(str(attrs.get("out_dtype") or x.dtype))
    return np.transpose(y, _perm("NCDHW", layout))


def _attention(args, attrs):
    """relax.nn.attention / attention_bias: q, k, v in (batch, seq, heads, dim);
    ``softmax(q k^T * scale (+ bias), causal mask) v`` (scale 1/sqrt(dim) by default)."""
    q, k, v = (_f64(a) for a in args[:3])
    dtype = np.asarray(args[0]).dtype
    if attrs.get("window_size") is not None:
        raise NotImplementedError("sliding-window attention")
    q, k, v = (np.transpose(a, (0, 2, 1, 3)) for a in (q, k, v))
    p = q @ np.swapaxes(k, -1, -2)
    scale = attrs.get("scale")
    p = p * float(scale) if scale is not None else p / np.sqrt(float(np.float32(q.shape[-1])))
    if len(args) > 3 and args[3] is not None:
        p = p + _f64(args[3])
    causal = attrs.get("causal_mask")
    if causal is not None:
        s, skv = p.shape[-2:]
        off = 0 if causal == "TopLeft" else abs(s - skv)
        keep = np.tril(np.ones((s, skv), bool), k=off)
        p = np.where(keep, p, -np.inf)
    e = np.exp(p - p.max(axis=-1, keepdims=True))
    o = (e / e.sum(axis=-1, keepdims=True)) @ v
    return np.transpose(o, (0, 2, 1, 3)).astype(dtype)


def _dynamic_strided_slice(args, attrs):
    """relax.dynamic_strided_slice: begin, end, strides are tensors over every axis."""
    x = np.asarray(args[0])
    b, e, s = (np.asarray(a).astype(np.int64).reshape(-1) for a in args[1:4])
    return x[tuple(slice(int(b[i]), int(e[i]), int(s[i])) for i in range(len(b)))]


def _full(args, attrs):
    return np.full(_shape(args[0]), _scalar(np.asarray(args[1])), dtype=str(attrs.get("dtype") or np.asarray(args[1]).dtype))


def _full_like(args, attrs):
    x = np.asarray(args[0])
    return np.full(x.shape, _scalar(np.asarray(args[1])), dtype=str(attrs.get("dtype") or x.dtype))


def _const_like(value: float) -> Callable:
    def run(args, attrs):
        x = np.asarray(args[0])
        return np.full(x.shape, value, dtype=str(attrs.get("dtype") or x.dtype))

    return run


def _const_shape(value: float) -> Callable:
    def run(args, attrs):
        return np.full(_shape(args[0]), value, dtype=str(attrs.get("dtype") or "float32"))

    return run


def _arange(args, attrs):
    start, end, step = (_scalar(np.asarray(a)) for a in args[:3])
    return np.arange(start, end, step).astype(str(attrs.get("dtype") or "int64"))


def _moments(kind: str) -> Callable:
    """relax.variance / relax.std: population moments over ``axis``, in float64."""

    def run(args, attrs):
        x = np.asarray(args[0])
        v = np.var(_f64(x), axis=_axes(attrs), keepdims=bool(attrs.get("keepdims", False)))
        return (np.sqrt(v) if kind == "std" else v).astype(x.dtype)

    return run


def _arg_reduce(fn: Callable) -> Callable:
    def run(args, attrs):
        x = np.asarray(args[0])
        axis = attrs.get("axis")
        y = fn(x, axis=None if axis is None else int(axis), keepdims=bool(attrs.get("keepdims", False)))
        return np.asarray(y).astype(np.int64)

    return run


def _trilu(fn: Callable) -> Callable:
    def run(args, attrs):
        k = int(_scalar(np.asarray(args[1]))) if len(args) > 1 else int(attrs.get("k", 0))
        return fn(np.asarray(args[0]), k=k)

    return run


def _leakyrelu(args, attrs):
    x = np.asarray(args[0])
    return np.where(x > 0, x, x * np.asarray(attrs.get("alpha", 0.01), x.dtype)).astype(x.dtype)


def _prelu(args, attrs):
    x, alpha = np.asarray(args[0]), np.asarray(args[1])
    shape = [1] * x.ndim
    axis = int(attrs.get("axis", 1)) % x.ndim
    shape[axis] = alpha.size if alpha.size > 1 else 1
    return np.where(x > 0, x, x * alpha.reshape(shape)).astype(x.dtype)


def _softplus(args, attrs):
    """relax.nn.softplus: ``log(1 + exp(beta x)) / beta``, linear above ``threshold``."""
    x = np.asarray(args[0])
    beta, thr = float(attrs.get("beta", 1.0)), float(attrs.get("threshold", 20.0))
    bx = _f64(x) * beta
    return np.where(bx > thr, _f64(x), np.log1p(np.exp(np.minimum(bx, thr))) / beta).astype(x.dtype)


def _log_softmax(args, attrs):
    x = np.asarray(args[0])
    xd = _f64(x)
    axis = int(attrs.get("axis", -1))
    m = xd.max(axis=axis, keepdims=True)
    return (xd - m - np.log(np.exp(xd - m).sum(axis=axis, keepdims=True))).astype(x.dtype)


def _rms_norm(args, attrs):
    """relax.nn.rms_norm: ``x / sqrt(mean(x^2) + eps) * weight`` over ``axes``."""
    x, w = np.asarray(args[0]), np.asarray(args[1])
    axes = tuple(int(a) % x.ndim for a in np.atleast_1d(attrs.get("axes", -1)))
    xd = _f64(x)
    y = xd / np.sqrt((xd * xd).mean(axis=axes, keepdims=True) + float(attrs.get("epsilon", 1e-5)))
    return (y * _f64(w)).astype(x.dtype)


def _group_norm(args, attrs):
    """relax.nn.group_norm: channels split into ``num_groups``; mean/var over each group and ``axes``."""
    x, gamma, beta = (np.asarray(a) for a in args[:3])
    g = int(attrs["num_groups"])
    ca = int(attrs.get("channel_axis", 1)) % x.ndim
    axes = [int(a) % x.ndim for a in attrs.get("axes") or []]
    xd = np.moveaxis(_f64(x), ca, 1)
    n, c = xd.shape[:2]
    xg = xd.reshape((n, g, c // g) + xd.shape[2:])
    red = (2,) + tuple(a + 1 if a > ca else a + 2 for a in axes if a != ca) if axes else tuple(range(2, xg.ndim))
    red = tuple(sorted(set(red)))
    mean = xg.mean(axis=red, keepdims=True)
    var = ((xg - mean) ** 2).mean(axis=red, keepdims=True)
    y = ((xg - mean) / np.sqrt(var + float(attrs.get("epsilon", 1e-5)))).reshape(xd.shape)
    shape = [1] * x.ndim
    shape[1] = c
    if attrs.get("scale", True):
        y = y * _f64(gamma).reshape(shape)
    if attrs.get("center", True):
        y = y + _f64(beta).reshape(shape)
    return np.moveaxis(y, 1, ca).astype(x.dtype)


def _instance_norm(args, attrs):
    x, gamma, beta = (np.asarray(a) for a in args[:3])
    ca = int(attrs.get("channel_axis", 1)) % x.ndim
    axes = tuple(int(a) % x.ndim for a in attrs.get("axes") or [a for a in range(x.ndim) if a not in (0, ca)])
    xd = _f64(x)
    mean = xd.mean(axis=axes, keepdims=True)
    var = ((xd - mean) ** 2).mean(axis=axes, keepdims=True)
    y = (xd - mean) / np.sqrt(var + float(attrs.get("epsilon", 1e-5)))
    shape = [1] * x.ndim
    shape[ca] = x.shape[ca]
    if attrs.get("scale", True):
        y = y * _f64(gamma).reshape(shape)
    if attrs.get("center", True):
        y = y + _f64(beta).reshape(shape)
    return y.astype(x.dtype)


def _pixel_shuffle(args, attrs):
    """relax.nn.pixel_shuffle (NCHW): (N, C*r*r, H, W) -> (N, C, H*r, W*r), as torch."""
    x = np.asarray(args[0])
    r = int(attrs["upscale_factor"])
    n, c, h, w = x.shape[-4:] if x.ndim == 4 else (1,) + x.shape
    y = x.reshape(n, c // (r * r), r, r, h, w).transpose(0, 1, 4, 2, 5, 3)
    return y.reshape(n, c // (r * r), h * r, w * r).reshape(x.shape[:-3] + (c // (r * r), h * r, w * r))


def _one_hot(args, attrs):
    idx = np.asarray(args[0]).astype(np.int64)
    on, off = (_scalar(np.asarray(a)) for a in args[1:3])
    depth = int(attrs["depth"])
    axis = int(attrs.get("axis", -1))
    hot = np.arange(depth) == idx[..., None]
    # the values' dtype (a PrimValue's) is not in ir.json: float32 for floats, int64 for integers, as TVM's defaults
    y = np.where(hot, on, off).astype("float32" if np.asarray(on).dtype.kind == "f" else "int64")
    return np.moveaxis(y, -1, axis) if axis != -1 else y


def _gather_nd(args, attrs):
    data, idx = np.asarray(args[0]), np.asarray(args[1]).astype(np.int64)
    if int(attrs.get("batch_dims", 0)):
        raise NotImplementedError("gather_nd with batch_dims")
    return data[tuple(np.moveaxis(idx, -1, 0))]


def _index_tensor(args, attrs):
    """relax.index_tensor: ``data[I0, I1, ...]``, numpy's advanced indexing (a ``.pt2``'s
    ``aten.index.Tensor``; the index tensors broadcast together)."""
    return np.asarray(args[0])[tuple(np.asarray(a).astype(np.int64) for a in args[1:])]


def _matmul_like_einsum(args, attrs):
    """relax.einsum: accumulated in float64 (integers in int64), cast to the operands' dtype."""
    ops = [np.asarray(a) for a in args]
    dtype = np.result_type(*ops)
    return np.einsum(str(attrs["subscripts"]), *(o.astype(_acc_dtype(dtype)) for o in ops)).astype(dtype)


def _bool(fn: Callable) -> Callable:
    return lambda args, attrs: fn(*(np.asarray(a) for a in args))


def _take(args, attrs):
    """A gather in TVM's index mode: ``wrap`` (irgen's for computed indices) and ``clip`` as
    numpy's; ``fast`` (indices checked in range) as numpy's default, which refuses others."""
    mode = str(attrs.get("mode") or "fast")
    axis = attrs.get("axis")
    return np.take(np.asarray(args[0]), np.asarray(args[1]).astype(np.int64), axis=None if axis is None else int(axis),
                   mode=mode if mode in ("wrap", "clip") else "raise")


OPS: dict[str, Callable[[list[Any], dict], Any]] = {
    "relax.nn.conv2d": lambda args, attrs: (conv2d_fma_blocked if attrs.get("accumulation") else conv2d)(
        args[0], args[1], attrs),
    "relax.nn.conv1d": lambda args, attrs: conv1d(args[0], args[1], attrs),
    "relax.nn.conv2d_transpose": lambda args, attrs: conv2d_transpose(args[0], args[1], attrs),
    "relax.nn.conv3d": lambda args, attrs: (conv3d_fma_blocked if attrs.get("accumulation") else conv3d)(
        args[0], args[1], attrs),
    "relax.nn.conv3d_transpose": lambda args, attrs: conv3d_transpose(args[0], args[1], attrs),
    "relax.matmul": lambda args, attrs: (matmul_block_weight(args, attrs) if attrs.get("weight")
                                         else matmul_ordered(args[0], args[1], attrs, *args[2:])
                                         if attrs.get("accumulation")
                                         else _matmul(args[0], args[1], attrs)),
    "relax.add": _binary(np.add),
    "relax.subtract": _binary(np.subtract),
    "relax.multiply": _binary(np.multiply),
    "relax.divide": _binary(_divide),
    "relax.power": _binary(_power),
    "relax.maximum": _binary(np.maximum),
    "relax.minimum": _binary(np.minimum),
    "relax.nn.relu": lambda args, attrs: np.maximum(args[0], np.zeros((), args[0].dtype)),
    "relax.clip": _clip,
    "relax.sigmoid": _activation(lambda x: 1.0 / (1.0 + np.exp(-x))),
    "relax.tanh": _activation(np.tanh),
    "relax.sqrt": _unary_f(np.sqrt),
    "relax.rsqrt": _unary_f(lambda x: 1.0 / np.sqrt(x)),
    "relax.exp": _unary_f(np.exp),
    "relax.nn.max_pool2d": lambda args, attrs: _pool(args[0], attrs, "max", "NCHW"),
    "relax.nn.avg_pool2d": lambda args, attrs: _pool(args[0], attrs, "avg", "NCHW"),
    "relax.nn.max_pool3d": lambda args, attrs: _pool(args[0], attrs, "max", "NCDHW"),
    "relax.nn.avg_pool3d": lambda args, attrs: _pool(args[0], attrs, "avg", "NCDHW"),
    "relax.nn.adaptive_avg_pool2d": lambda args, attrs: _adaptive_avg_pool(args[0], attrs, "NCHW"),
    "relax.nn.adaptive_avg_pool3d": lambda args, attrs: _adaptive_avg_pool(args[0], attrs, "NCDHW"),
    "relax.mean": lambda args, attrs: _mean(args[0], attrs),
    "relax.sum": lambda args, attrs: _reduce(np.sum, args[0], attrs),
    "relax.max": lambda args, attrs: _reduce(np.max, args[0], attrs),
    "relax.min": lambda args, attrs: _reduce(np.min, args[0], attrs),
    "relax.negative": lambda args, attrs: np.negative(args[0]),
    "relax.abs": lambda args, attrs: np.abs(args[0]),
    "relax.left_shift": _binary(np.left_shift),
    "relax.right_shift": _binary(np.right_shift),
    "relax.bitwise_and": _binary(np.bitwise_and),
    "relax.floor_divide": _binary(np.floor_divide),
    "relax.less": lambda args, attrs: np.less(args[0], args[1]),
    "relax.greater": lambda args, attrs: np.greater(args[0], args[1]),
    "relax.greater_equal": lambda args, attrs: np.greater_equal(args[0], args[1]),
    "relax.less_equal": lambda args, attrs: np.less_equal(args[0], args[1]),
    "relax.equal": lambda args, attrs: np.equal(args[0], args[1]),
    "relax.where": _where,
    "relax.astype": lambda args, attrs: np.asarray(args[0]).astype(str(attrs["dtype"])),
    "relax.concat": _concat,
    "relax.stack": lambda a, at: np.stack([np.asarray(x) for x in a], axis=int(at.get("axis") or 0)),
    "relax.permute_dims": _permute,
    "relax.reshape": _reshape,
    "relax.broadcast_to": lambda a, at: np.broadcast_to(a[0], _shape(a[1])).copy(),
    # a static shape as an int64 tensor (the shape arithmetic TVM's ONNX importer emits for Shape)
    "relax.shape_to_tensor": lambda a, at: np.asarray(_shape(a[0]), np.int64),
    "relax.flatten": _flatten,
    "relax.squeeze": _squeeze,
    "relax.expand_dims": _expand_dims,
    "relax.split": _split,
    "relax.nn.gelu": _gelu,
    "relax.nn.gelu_tanh": _gelu_tanh,
    "relax.nn.silu": _silu,
    "relax.nn.attention": _attention,
    "relax.nn.attention_bias": _attention,
    "relax.image.resize2d": _resize2d,
    "relax.image.resize3d": _resize3d,
    "relax.dynamic_strided_slice": _dynamic_strided_slice,
    "relax.cumsum": _cumsum,
    "relax.cumprod": lambda args, attrs: _cumsum(args, attrs, np.cumprod),
    "relax.isnan": lambda args, attrs: np.isnan(args[0]),
    "relax.isinf": lambda args, attrs: np.isinf(args[0]),
    "relax.isfinite": lambda args, attrs: np.isfinite(args[0]),
    "relax.full": _full,
    "relax.full_like": _full_like,
    "relax.zeros": _const_shape(0),
    "relax.ones": _const_shape(1),
    "relax.zeros_like": _const_like(0),
    "relax.ones_like": _const_like(1),
    "relax.arange": _arange,
    "relax.not_equal": _bool(np.not_equal),
    "relax.logical_and": _bool(np.logical_and),
    "relax.logical_or": _bool(np.logical_or),
    "relax.logical_xor": _bool(np.logical_xor),
    "relax.logical_not": _bool(np.logical_not),
    "relax.bitwise_or": _binary(np.bitwise_or),
    "relax.bitwise_xor": _binary(np.bitwise_xor),
    "relax.bitwise_not": lambda args, attrs: np.invert(args[0]),
    "relax.floor_mod": _binary(np.mod),
    "relax.mod": _binary(np.fmod),
    "relax.log": _unary_f(np.log),
    "relax.sin": _unary_f(np.sin),
    "relax.cos": _unary_f(np.cos),
    "relax.tan": _unary_f(np.tan),
    "relax.atan": _unary_f(np.arctan),
    "relax.square": lambda args, attrs: np.square(args[0]),
    "relax.sign": lambda args, attrs: np.sign(args[0]),
    "relax.ceil": lambda args, attrs: np.ceil(args[0]),
    "relax.trunc": lambda args, attrs: np.trunc(args[0]),
    "relax.prod": lambda args, attrs: _reduce(np.prod, args[0], attrs),
    "relax.variance": _moments("var"),
    "relax.std": _moments("std"),
    "relax.argmax": _arg_reduce(np.argmax),
    "relax.argmin": _arg_reduce(np.argmin),
    "relax.tril": _trilu(np.tril),
    "relax.triu": _trilu(np.triu),
    "relax.tile": lambda args, attrs: np.tile(args[0], [int(r) for r in attrs["repeats"]]),
    "relax.repeat": lambda args, attrs: np.repeat(args[0], int(attrs["repeats"]), axis=attrs.get("axis")),
    "relax.flip": lambda args, attrs: np.flip(args[0], axis=int(attrs["axis"])),
    "relax.einsum": lambda args, attrs: _matmul_like_einsum(args, attrs),
    "relax.gather_elements": lambda args, attrs: np.take_along_axis(
        np.asarray(args[0]), np.asarray(args[1]).astype(np.int64), axis=int(attrs.get("axis", 0))),
    "relax.gather_nd": _gather_nd,
    "relax.index_tensor": _index_tensor,
    "relax.one_hot": _one_hot,
    "relax.nn.leakyrelu": _leakyrelu,
    "relax.nn.prelu": _prelu,
    "relax.nn.softplus": _softplus,
    "relax.nn.log_softmax": _log_softmax,
    "relax.nn.rms_norm": _rms_norm,
    "relax.nn.group_norm": _group_norm,
    "relax.nn.instance_norm": _instance_norm,
    "relax.nn.pixel_shuffle": _pixel_shuffle,
    "relax.nn.softmax": lambda args, attrs: _softmax(args[0], int(attrs.get("axis", -1))),
    "relax.nn.batch_norm": lambda args, attrs: _batch_norm(*args[:5], attrs),
    "relax.nn.local_response_norm": _lrn,
    "relax.nn.dropout": _dropout,
    "relax.floor": lambda args, attrs: np.floor(args[0]),
    "relax.round": lambda args, attrs: np.rint(args[0]),  # half to even, as TVM's round on CPU
    "relax.take": _take,
    "relax.quantize": lambda args, attrs: (_float8_quantize if str(attrs.get("out_dtype") or "").startswith("float8")
                                           else _quantize)(args, attrs),
    "relax.scatter_nd": _scatter_nd,
    "relax.dequantize": _dequantize,
    "relax.erf": _unary_f(_erf),
    "relax.nn.layer_norm": _layer_norm,
    "relax.strided_slice": _strided_slice,
    "relax.nn.pad": _pad,
    "tgi": lambda args, attrs: args[0][int(attrs["index"])],
}


def run_op(relax_op: str, args: list[Any], attrs: dict, layer: str = "?", ops: dict | None = None) -> Any:
    """Run one fused op on resolved arguments (``ops``: entries that replace :data:`OPS`'s)."""
    fn = (ops or {}).get(relax_op) or OPS.get(relax_op)
    if fn is None:
        raise UnsupportedLayer(layer, relax_op)
    try:
        return fn(args, attrs)
    except UnsupportedLayer:
        raise
    except NotImplementedError as e:
        raise UnsupportedLayer(layer, relax_op, str(e)) from None


def _resolve(ref: Any, layer: str, op: str, inputs: list, params: dict, results: list) -> Any:
    if isinstance(ref, str):
        kind, _, key = ref.partition(":")
        if kind == "input" and key.isdigit() and int(key) < len(inputs):
            return inputs[int(key)]
        if kind == "op" and key.isdigit() and int(key) < len(results):
            return results[int(key)]
        if kind == "param" and key in params:
            return params[key]
        raise UnsupportedLayer(layer, op, f"unresolvable argument {ref!r}")
    if isinstance(ref, dict):
        if "shape" in ref:
            return ref
        if "value" in ref:
            v = from_json_number(ref["value"])
            if isinstance(v, str):
                raise UnsupportedLayer(layer, op, f"non-numeric literal {v!r}")
            return v if not isinstance(v, list) else np.asarray(v)
    if isinstance(ref, list):
        return [_resolve(r, layer, op, inputs, params, results) for r in ref]
    raise UnsupportedLayer(layer, op, f"unknown argument form {ref!r}")


#: the strings ``ir.json`` writes for floats JSON cannot hold (``irgen.graph.to_json``)
NON_FINITE = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}


def from_json_number(value: Any) -> Any:
    """A literal of ``ir.json`` with the strings of :data:`NON_FINITE` made floats again (in lists too)."""
    if isinstance(value, str):
        return NON_FINITE.get(value, value)
    if isinstance(value, list):
        return [from_json_number(v) for v in value]
    return value


#: Relax ops whose two operands have one dtype
_SAME_DTYPE = frozenset({"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.power",
                         "relax.maximum", "relax.minimum"})


def _literals_typed(refs: list, args: list) -> list:
    """An array literal (``{"value": [...]}``: ``ir.json`` keeps no dtype for it) of a binary op
    in its tensor operand's dtype, as the Relax op had it (a float32 mean divided by its
    per-position counts stays float32; numpy would make it float64)."""
    out = list(args)
    for k in (0, 1):
        other = args[1 - k]
        if isinstance(refs[k], dict) and isinstance(refs[k].get("value"), list) and isinstance(other, np.ndarray) \
                and not (isinstance(refs[1 - k], dict) and "value" in refs[1 - k]):
            out[k] = np.asarray(args[k]).astype(other.dtype)
    return out


def run_layer(layer: dict, inputs: list[np.ndarray], params: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Execute a layer's ``fused_ops`` and return its output arrays (one per output record); a
    reduced-precision layer in its declared arithmetic (``arith``, :mod:`irgen.declared`)."""
    if isinstance(layer.get("arith"), dict):
        return declared.run(layer, inputs, params, _run_program)
    return _run_program(layer, inputs, params, None)


def _run_program(layer: dict, inputs: list, params: dict, table: dict | None,
                 after: Callable[[Any], Any] | None = None) -> list[np.ndarray]:
    """The layer's ``fused_ops`` run with ``table`` over :data:`OPS`, ``after`` applied to each result."""
    name = layer.get("name", "?")
    results: list[Any] = []
    ops = layer.get("fused_ops") or []
    if not ops:
        raise UnsupportedLayer(name, "<none>", "layer has no fused_ops")
    for op in ops:
        rop = op.get("relax_op") or op.get("op")
        refs = op.get("args", [])
        args = [_resolve(a, name, rop, inputs, params, results) for a in refs]
        if rop in _SAME_DTYPE and len(args) == 2:
            args = _literals_typed(refs, args)
        r = run_op(rop, args, op.get("attrs") or {}, name, table)
        results.append(after(r) if after is not None else r)

    picked = []
    for ref in layer.get("results") or [f"op:{len(ops) - 1}"]:
        j, _, k = ref.removeprefix("op:").partition(".")
        r = results[int(j)]
        if k:
            r = r[int(k)]
        elif isinstance(r, tuple):
            raise UnsupportedLayer(name, ops[int(j)].get("relax_op", "?"), f"result {ref} is a tuple")
        picked.append(np.asarray(r))
    return picked


def _load(out_dir: Path, rec: dict) -> np.ndarray:
    """A tensor file named by an ``ir.json`` record: confined to OUT, plain ``.npy`` only."""
    return declared.typed(load_npy(inside(out_dir, rec.get("file"), f"tensor {rec.get('name')!r}"), "tensor"),
                          rec.get("dtype"))


def load_layer_params(out_dir: str | Path, layer: dict) -> dict[str, np.ndarray]:
    """``{role: array}`` from ``parameters/*.npy`` of one layer record."""
    return {role: _load(Path(out_dir), rec) for role, rec in (layer.get("params") or {}).items()}


def load_layer_inputs(out_dir: str | Path, layer: dict) -> list[np.ndarray]:
    """The layer's input activations (``activations/*.npy``) in ``input:K`` order."""
    return [_load(Path(out_dir), rec) for rec in layer.get("inputs") or []]


def load_ir(out_dir: str | Path) -> dict:
    return read_ir(out_dir)


# ------------------------------------------- a declared float32 accumulation (fused multiply-add)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``round_to_float32(a * b + c)`` with one rounding, as a fused multiply-add computes it, for
    float32 operands (broadcast). ``a * b`` is exact in float64; the sum is rounded to odd in
    float64 (its error, found exactly by two-sum, decides the last bit), and a value rounded to
    odd at 53 bits rounds to 24 bits as the exact sum would."""
    p = np.asarray(a, np.float64) * np.asarray(b, np.float64)
    c64 = np.asarray(c, np.float64)
    s = p + c64
    v = s - p
    err = (p - (s - v)) + (c64 - v)  # s + err == p + c exactly
    bits = s.view(np.int64)
    inexact_even = (err != 0) & ((bits & 1) == 0)
    toward = np.where((err > 0) == (s > 0), 1, -1)  # one ulp away from zero, or toward it
    return np.where(inexact_even, bits + toward, bits).view(np.float64).astype(np.float32)


def rational_fma(x: np.ndarray, spec: dict) -> np.ndarray:
    """An odd rational approximation in float32 as ``spec`` (a ``relax.sigmoid`` / ``relax.tanh``
    kernel's ``approximation``) declares it: ``v = min(max(x, lo), hi)`` (``clamp``), ``v2 = v·v``,
    ``P`` and ``Q`` by Horner's rule in ``v2`` with fused multiply-adds from their first two
    coefficients (``p``, ``q``: highest degree first), ``v·P / Q``, plus ``offset``, then at
    least ``floor`` (when given); every step rounded to float32."""
    f32 = np.float32
    lo, hi = (f32(b) for b in spec["clamp"])
    v = np.minimum(np.maximum(np.asarray(x, f32), lo), hi)
    v2 = v * v

    def horner(coefs):
        acc = fma32(v2, f32(coefs[0]), f32(coefs[1]))
        for c in coefs[2:]:
            acc = fma32(acc, v2, f32(c))
        return acc

    r = (v * horner(spec["p"])) / horner(spec["q"])
    if spec.get("offset"):
        r = r + f32(spec["offset"])
    if spec.get("floor") is not None:
        r = np.maximum(r, f32(spec["floor"]))
    return r.astype(f32)


def matmul_block_weight(args: list, attrs: dict) -> np.ndarray:
    """``x [..., K] @ w [K, N]`` whose weight is block-quantized 4-bit integers (``attrs["weight"]``:
    ``args`` are x, the packed bytes ``[rows, blocks, block_size/2]`` (element 2j in the low
    nibble), the scales and zero points ``[rows, blocks]``; ``w = float32(q - zero_point) * scale``,
    ``rows`` along ``w``'s axis 1 when ``weight.axis`` is 0, else along its axis 0), summed in
    the ``accumulation`` order: ``order: "k"``, fused multiply-adds from zero per ``k_block``
    slice, the slices added; ``order: "lanes16"`` (one row), 16 fused multiply-add chains (lane
    ``k % 16``), folded as :func:`_fold_lanes16` says; ``order: "groups4"`` (one row) and
    ``"lanes8"`` (one column), as :func:`matmul_groups4` and :func:`matmul_lanes8` say."""
    spec, acc = attrs["weight"], attrs.get("accumulation") or {}
    if spec.get("bits") != 4 or acc.get("order") not in ("k", "lanes16", "groups4", "lanes8") \
            or acc.get("fma") != (acc.get("order") in ("k", "lanes16")):
        raise NotImplementedError(f"block weight {spec.get('bits')} bits, accumulation {acc}")
    x, packed, scale, zp = (np.asarray(a) for a in args[:4])
    p = packed.astype(np.int64)
    q = np.stack([p & 15, p >> 4], -1).reshape(*p.shape[:-1], -1)
    q = np.where(q >= 8, q - 16, q) if spec.get("dtype") == "int4" else q
    w = ((q - zp.astype(np.int64)[..., None]).astype(np.float32) * scale.astype(np.float32)[..., None]).astype(np.float32)
    w = w.reshape(w.shape[0], -1)[:, :int(spec["length"])]
    w = np.ascontiguousarray(w.T if int(spec["axis"]) == 0 else w)
    x2 = x.astype(np.float32).reshape(-1, w.shape[0])
    if acc["order"] == "lanes16":
        lanes = np.zeros((16, x2.shape[0], w.shape[1]), np.float32)
        for k in range(w.shape[0]):
            lanes[k % 16] = fma32(x2[:, k:k + 1], w[k:k + 1], lanes[k % 16])
        return _fold_lanes16(lanes).reshape(*x.shape[:-1], w.shape[1])
    return matmul_ordered(x, w, attrs)


def _initial(acc: dict, initial, rows: int, n: int) -> np.ndarray | None:
    """The value a matmul's sums start from: ``initial`` broadcast to ``[rows, n]`` when the
    ``accumulation`` says ``"initial": "bias"``, else None (zero)."""
    if bool(acc.get("initial")) != (initial is not None):
        raise NotImplementedError(f"matmul accumulation {acc} with {0 if initial is None else 1} initial value")
    return None if initial is None else np.broadcast_to(np.asarray(initial, np.float32), (rows, n)).copy()


def matmul_groups4(x: np.ndarray, w: np.ndarray, attrs: dict, initial: np.ndarray | None = None) -> np.ndarray:
    """``x [..., K] @ w [K, N]`` in float32, in the ``accumulation`` order ``groups4`` (one row of
    ``x``, MLAS's single-row SGEMM kernel): per output, from zero, each group of four consecutive
    k (then one of two, then one, for the last ``K % 4``) summed as ``((p0 + p1) + p2) + p3``, each
    product ``x[k] * w[k, n]`` and each sum rounded to float32 (no fused multiply-add), and the
    group's sum added to the output (which starts at ``initial``, a bias, when given)."""
    acc = attrs["accumulation"]
    if acc.get("fma") or acc.get("order") != "groups4" or np.ndim(w) != 2:
        raise NotImplementedError(f"matmul accumulation {acc}")
    f = np.float32
    w = np.asarray(w, f)
    x2 = np.asarray(x, f).reshape(-1, w.shape[0])
    kk = w.shape[0]
    total = _initial(acc, initial, x2.shape[0], w.shape[1])
    total = np.zeros((x2.shape[0], w.shape[1]), f) if total is None else total
    k0 = 0
    for size in [4] * (kk // 4) + [2] * (kk % 4 // 2) + [1] * (kk % 2):
        part = (x2[:, k0:k0 + 1] * w[k0:k0 + 1]).astype(f)
        for k in range(k0 + 1, k0 + size):
            part = (part + (x2[:, k:k + 1] * w[k:k + 1]).astype(f)).astype(f)
        total = (part + total).astype(f)
        k0 += size
    return total.reshape(*np.shape(x)[:-1], w.shape[1])


def matmul_lanes8(x: np.ndarray, w: np.ndarray, attrs: dict, initial: np.ndarray | None = None) -> np.ndarray:
    """``x [M, K] @ w [K, N]`` (M or N is 1) in float32, in the ``accumulation`` order ``lanes8``
    (MLAS's one-row kernel of a transposed B, and of one column): per output, 8 partial sums from
    zero, the product of element k (rounded to float32) added to lane ``k % 8``; the R outputs
    (along the axis that is not 1) folded by place: in whole groups of four as ``(((l0 + l1) + l2)
    + l3) + (((l4 + l5) + l6) + l7)``, the next two of the last ``R % 4`` as ``((l0 + l2) + (l4 +
    l6)) + ((l1 + l3) + (l5 + l7))``, a last one as ``((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 +
    l7))``; every sum rounded to float32; ``initial`` (a bias) added to the fold."""
    acc = attrs["accumulation"]
    f = np.float32
    w = np.asarray(w, f)
    x2 = np.asarray(x, f).reshape(-1, w.shape[0])
    if acc.get("fma") or acc.get("order") != "lanes8" or w.ndim != 2 or min(x2.shape[0], w.shape[1]) != 1:
        raise NotImplementedError(f"matmul accumulation {acc}")
    a = np.zeros((8, x2.shape[0], w.shape[1]), f)
    for k in range(w.shape[0]):
        a[k % 8] = (a[k % 8] + (x2[:, k:k + 1] * w[k:k + 1]).astype(f)).astype(f)

    def s(*v):  # left to right, each sum rounded
        t = v[0]
        for u in v[1:]:
            t = (t + u).astype(f)
        return t

    fold4 = s(s(a[0], a[1], a[2], a[3]), s(a[4], a[5], a[6], a[7]))
    fold2 = s(s(s(a[0], a[2]), s(a[4], a[6])), s(s(a[1], a[3]), s(a[5], a[7])))
    fold1 = s(s(s(a[0], a[1]), s(a[2], a[3])), s(s(a[4], a[5]), s(a[6], a[7])))
    outputs = max(x2.shape[0], w.shape[1])
    place = np.arange(outputs).reshape(x2.shape[0], w.shape[1])
    four = outputs - outputs % 4
    y = np.where(place < four, fold4, np.where(place < four + (outputs % 4 & 2), fold2, fold1)).astype(f)
    start = _initial(acc, initial, x2.shape[0], w.shape[1])
    y = y if start is None else (y + start).astype(f)
    return y.reshape(*np.shape(x)[:-1], w.shape[1])


#: a float32 matmul's ``accumulation`` order -> its numpy recompute ``(x, w, attrs, initial)``
MATMUL_ORDERS: dict[str, Callable[..., np.ndarray]] = {
    "k": lambda x, w, attrs, initial=None: matmul_fma_blocked(x, w, attrs, initial),
    "groups4": lambda x, w, attrs, initial=None: matmul_groups4(x, w, attrs, initial),
    "lanes8": lambda x, w, attrs, initial=None: matmul_lanes8(x, w, attrs, initial),
}


def matmul_ordered(x: np.ndarray, w: np.ndarray, attrs: dict, initial: np.ndarray | None = None) -> np.ndarray:
    """``x [..., K] @ w [K, N]`` in the order ``attrs["accumulation"]`` declares (:data:`MATMUL_ORDERS`),
    from ``initial`` (a third operand: a bias the sums start from, ``"initial": "bias"``) if given."""
    acc = attrs["accumulation"]
    fn = MATMUL_ORDERS.get(acc.get("order"))
    if fn is None:
        raise NotImplementedError(f"matmul accumulation {acc}")
    return fn(x, w, attrs, initial)


def matmul_fma_blocked(x: np.ndarray, w: np.ndarray, attrs: dict, initial: np.ndarray | None = None) -> np.ndarray:
    """``x [..., K] @ w [K, N]`` in float32, in the ``accumulation`` order ``k``: per output, fused
    multiply-adds from zero over each slice of ``k_block`` values of K, the slices added in order
    (MLAS's SGEMM); with ``initial`` (``accumulation["initial"]``: a bias ``[N]``) added to it."""
    acc = attrs["accumulation"]
    if not acc.get("fma") or acc.get("order") != "k" or np.ndim(w) != 2:
        raise NotImplementedError(f"matmul accumulation {acc}")
    w = np.asarray(w, np.float32)
    x2 = np.asarray(x, np.float32).reshape(-1, w.shape[0])
    total = _fma_blocked_gemm(x2, w, int(acc["k_block"]), _initial(acc, initial, x2.shape[0], w.shape[1]))
    return total.reshape(*np.shape(x)[:-1], w.shape[1])


def _fold_lanes16(a: np.ndarray) -> np.ndarray:
    """The sum of 16 float32 lanes ``a[0..15]`` (each ``[M, N]``) in MLAS's AVX-512 order: columns in
    whole groups of four (``N - N % 4`` first ones) as ``FoldAccumulators``, ``g_j =
    ((a[4j] + a[4j+1]) + a[4j+2]) + a[4j+3]``, ``(g_0 + g_2) + (g_1 + g_3)``; the others as
    ``_mm512_reduce_add_ps``: ``h_i = a[i] + a[i+8]``, ``t_i = h_i + h_{i+4}``, ``(t_0 + t_2) + (t_1 + t_3)``."""
    f = np.float32
    g = [(((a[4 * j] + a[4 * j + 1]).astype(f) + a[4 * j + 2]).astype(f) + a[4 * j + 3]).astype(f) for j in range(4)]
    grouped = ((g[0] + g[2]).astype(f) + (g[1] + g[3]).astype(f)).astype(f)
    h = [(a[i] + a[i + 8]).astype(f) for i in range(8)]
    t = [(h[i] + h[i + 4]).astype(f) for i in range(4)]
    tree = ((t[0] + t[2]).astype(f) + (t[1] + t[3]).astype(f)).astype(f)
    full = a.shape[-1] - a.shape[-1] % 4
    return np.concatenate([grouped[..., :full], tree[..., full:]], -1)


def conv2d_fma_blocked(x: np.ndarray, w: np.ndarray, attrs: dict) -> np.ndarray:
    """A float32 2-D convolution (NCHW/OIHW) in the accumulation order ``attrs["accumulation"]``
    declares: per output, the products over ``k`` (the index of input channel, kernel row, kernel
    column in that order, zeros where the window reads padding) are added by a chain of fused
    multiply-adds from zero in blocks of ``k_block``, and the blocks' sums are added in order in
    float32 (ONNX Runtime's MLAS convolutions: im2col, then SGEMM's K slices)."""
    return _conv_fma_blocked(x, w, attrs, "NCHW", "OIHW")


def conv3d_fma_blocked(x: np.ndarray, w: np.ndarray, attrs: dict) -> np.ndarray:
    """A float32 3-D convolution (NCDHW/OIDHW) in the accumulation order ``attrs["accumulation"]``
    declares: :func:`conv2d_fma_blocked` with ``k`` the index of input channel, kernel depth,
    kernel row, kernel column in that order (ONNX Runtime's MLAS convolutions: vol2col, then
    SGEMM's K slices over the output positions od*oh*ow)."""
    return _conv_fma_blocked(x, w, attrs, "NCDHW", "OIDHW")


def _conv_fma_blocked(x: np.ndarray, w: np.ndarray, attrs: dict, data: str, kernel: str) -> np.ndarray:
    """:func:`conv2d_fma_blocked` and :func:`conv3d_fma_blocked`: in layouts ``data``/``kernel``,
    the columns of each group (input channel, then the kernel axes, by output position) through
    :func:`_fma_blocked_gemm`."""
    acc = attrs["accumulation"]
    if (str(attrs.get("data_layout") or data), str(attrs.get("kernel_layout") or kernel)) != (data, kernel) \
            or acc.get("order") != "im2col" or not acc.get("fma"):
        raise NotImplementedError(f"accumulation {acc}")
    nd = len(data) - 2
    x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
    g = int(attrs.get("groups", 1))
    n, o, cg, size = x.shape[0], w.shape[0], w.shape[1], w.shape[2:]
    before, after = _spatial_pads(attrs.get("padding", [0] * nd), nd)
    strides, dilation = _pair(attrs.get("strides", [1] * nd), nd), _pair(attrs.get("dilation", [1] * nd), nd)
    xp = np.pad(x, ((0, 0), (0, 0), *zip(before, after)))
    out = tuple((xp.shape[2 + i] - dilation[i] * (size[i] - 1) - 1) // strides[i] + 1 for i in range(nd))
    # (N, C, *out, *kernel) -> (N, C, *kernel, *out): k = (channel, kernel axes), by output position
    win = _windows(xp, size, strides, dilation, out).transpose(0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd))
    y = np.empty((n, o, int(np.prod(out))), np.float32)
    og = o // g
    for b in range(n):
        for gi in range(g):
            cols = win[b, gi * cg:(gi + 1) * cg].reshape(cg * int(np.prod(size)), -1)
            y[b, gi * og:(gi + 1) * og] = _fma_blocked_gemm(w[gi * og:(gi + 1) * og].reshape(og, -1), cols,
                                                            int(acc["k_block"]))
    return y.reshape(n, o, *out)


def _fma_blocked_gemm(wm: np.ndarray, cols: np.ndarray, block: int, total: np.ndarray | None = None) -> np.ndarray:
    """``wm [M, K] @ cols [K, N]`` in float32: fused multiply-adds from zero over each K slice of
    ``block``, the slices' sums added in order (MLAS's SGEMM), to ``total`` when given."""
    for k0 in range(0, wm.shape[1], block):
        part = np.zeros((wm.shape[0], cols.shape[1]), np.float32)
        for k in range(k0, min(wm.shape[1], k0 + block)):
            part = fma32(wm[:, k:k + 1], cols[k:k + 1], part)
        total = part if total is None else (total + part).astype(np.float32)
    return total

