"""The numpy reference of a layer's declared reduced-precision arithmetic (``arith``).

A ``float16``/``bfloat16`` layer declares in ``ir.json`` how it computes
(docs/output-format.md, "Reduced-precision float layers"):

* ``storage``: the type of its inputs, parameters and outputs;
* ``accumulate``: ``float32`` (the default): every op of ``fused_ops`` computes in float32 on
  the storage values (exact in float32), a convolution or matrix product adds its products in
  float32 in the order of its reduction loops (input channel, kernel row, kernel column; ``k``
  of a matrix product) from zero, and the layer rounds its outputs to the storage type
  once, to nearest even (``"round": "layer"``); or the storage type (``--accumulate fp16``/
  ``bf16``, ``"round": "op"``): convolutions and matrix products round each product to
  ``products`` (float16; float32 for bfloat16, where a product is exact) and each partial sum
  to the storage type, and every op's float32 result is rounded to the storage type.

:func:`run` recomputes a layer so (:data:`OPS32`: the float32 ops in TVM's order, and the C
library's ``expf``/``erff``/``logf`` where TVM's kernels call them); ``irgen.reference.run_layer``
dispatches to it. numpy, ml_dtypes and the C library only.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import numpy as np

__all__ = ["run", "typed", "source_ulp_limit", "accumulation_length", "inexact_ops", "storage_dtype", "to_storage",
           "conv_f32", "matmul_f32", "OPS32", "EXACT_BY_NATURE"]


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype of a storage type name (``bfloat16`` from ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def typed(arr: np.ndarray, dtype: Any) -> np.ndarray:
    """A tensor file's array in its record's dtype: a ``bfloat16`` tensor is written as numpy
    writes ml_dtypes' bfloat16 (2-byte void, ``'<V2'``) and read back as bfloat16."""
    if dtype == "bfloat16" and arr.dtype.kind == "V" and arr.dtype.itemsize == 2 and arr.dtype.fields is None:
        return arr.view(storage_dtype("bfloat16"))
    return arr


def to_storage(x: np.ndarray, storage: np.dtype) -> np.ndarray:
    """float32 values rounded to the storage type, to nearest even."""
    return np.asarray(x, np.float32).astype(storage)


#: one add of an accumulator: (sum so far, product) -> new sum
Step = Callable[[np.ndarray, np.ndarray], np.ndarray]

#: result types of a convolution or matrix product computed in float32 (a storage type: the
#: layer's rounding, at its outputs)
_OUT = (None, "", "float32", "float16", "bfloat16")


def _is_storage(x: Any, storage: np.dtype) -> bool:
    return isinstance(x, np.ndarray) and x.dtype == storage


def _pair(v: Any, n: int = 2) -> tuple[int, ...]:
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return tuple(int(x) for x in (v * n if len(v) == 1 else v))


def conv2d_geometry(x: np.ndarray, w: np.ndarray, attrs: dict):
    """A 2-D NCHW/OIHW convolution's padded input, strides, dilations and output size:
    ``(xp, (sh, sw), (dh, dw), (oh, ow))``."""
    h, wd = x.shape[2:]
    kh, kw = w.shape[2:]
    sh, sw = _pair(attrs.get("strides", [1, 1]))
    dh, dw = _pair(attrs.get("dilation", [1, 1]))
    pad = _pair(attrs.get("padding", [0, 0, 0, 0]), 4)
    pt, pl, pb, pr = pad if len(pad) == 4 else (pad[0], pad[1], pad[0], pad[1])
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    oh, ow = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1, (wd + pl + pr - dw * (kw - 1) - 1) // sw + 1
    return xp, (sh, sw), (dh, dw), (oh, ow)


def conv_f32(x: np.ndarray, w: np.ndarray, attrs: dict, step: Step | None = None) -> np.ndarray:
    """A float32 convolution (NCHW/OIHW, 1-D as NCW/OIW) as TVM's kernel adds it: per output,
    the products over (input channel of the group, kernel row, kernel column) in that order,
    added one by one in float32 from zero (``step(acc, product)``: another accumulator's add)."""
    layouts = (str(attrs.get("data_layout") or "NCHW"), str(attrs.get("kernel_layout") or "OIHW"))
    if layouts not in (("NCHW", "OIHW"), ("NCW", "OIW")) or attrs.get("out_dtype") not in _OUT:
        raise NotImplementedError(f"float32 accumulation of a {layouts} convolution")
    x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
    if x.ndim == 3:  # 1-D: a 2-D convolution of height 1
        a = {**attrs, "strides": [1, _pair(attrs.get("strides", 1), 1)[0]],
             "dilation": [1, _pair(attrs.get("dilation", 1), 1)[0]]}
        p = _pair(attrs.get("padding", 0), 2)
        a["padding"] = [0, p[0], 0, p[-1]]
        return conv_f32(x[:, :, None], w[:, :, None], {**a, "data_layout": "NCHW", "kernel_layout": "OIHW"},
                        step)[:, :, 0]
    g = int(attrs.get("groups", 1))
    n, o, cg, kh, kw = x.shape[0], *w.shape
    xp, (sh, sw), (dh, dw), (oh, ow) = conv2d_geometry(x, w, attrs)
    chan = (np.arange(o) // (o // g)) * cg  # first input channel of each output's group
    acc = np.zeros((n, o, oh, ow), np.float32)
    for rc in range(cg):
        for i in range(kh):
            for j in range(kw):
                win = xp[:, chan + rc, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw]
                p = win * w[:, rc, i, j][None, :, None, None]
                if step is None:
                    acc += p
                else:
                    acc = step(acc, p)
    return acc


def conv_transpose_f32(x: np.ndarray, w: np.ndarray, attrs: dict, step: Step | None = None) -> np.ndarray:
    """A float32 2-D transposed convolution (NCHW/IOHW, one group) as TVM legalizes it: the input
    dilated by the strides (zeros between), padded by ``kernel - 1 - padding`` (the far end also
    by ``output_padding``), then a convolution with the flipped, transposed kernel
    (:func:`conv_f32`'s order)."""
    layouts = (str(attrs.get("data_layout") or "NCHW"), str(attrs.get("kernel_layout") or "IOHW"))
    if layouts != ("NCHW", "IOHW") or int(attrs.get("groups", 1)) != 1 \
            or _pair(attrs.get("dilation", [1, 1])) != (1, 1) or attrs.get("out_dtype") not in _OUT:
        raise NotImplementedError(f"float32 accumulation of a {layouts} transposed convolution with {attrs}")
    x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
    n, c, h, wd = x.shape
    _, o, kh, kw = w.shape
    sh, sw = _pair(attrs.get("strides", [1, 1]))
    pad = _pair(attrs.get("padding", [0, 0, 0, 0]), 4)
    pt, pl, pb, pr = pad if len(pad) == 4 else (pad[0], pad[1], pad[0], pad[1])
    eh, ew = _pair(attrs.get("output_padding", [0, 0]))
    dil = np.zeros((n, c, (h - 1) * sh + 1, (wd - 1) * sw + 1), np.float32)
    dil[:, :, ::sh, ::sw] = x
    xp = np.pad(dil, ((0, 0), (0, 0), (kh - 1 - pt, kh - 1 - pb + eh), (kw - 1 - pl, kw - 1 - pr + ew)))
    kt = np.ascontiguousarray(np.transpose(w[:, :, ::-1, ::-1], (1, 0, 2, 3)))
    return conv_f32(xp, kt, {"strides": [1, 1], "padding": [0, 0, 0, 0], "dilation": [1, 1]}, step)


def matmul_f32(a: np.ndarray, b: np.ndarray, attrs: dict, step: Step | None = None) -> np.ndarray:
    """``relax.matmul`` in float32 as TVM's kernel adds it: the products over ``k`` in order,
    added one by one from zero (1-D operands as numpy's matmul treats them; ``step``: as
    :func:`conv_f32`)."""
    if attrs.get("out_dtype") not in _OUT:
        raise NotImplementedError(f"float32 accumulation of a matmul to {attrs.get('out_dtype')}")
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    va, vb = a.ndim == 1, b.ndim == 1
    a2 = a[None] if va else a
    b2 = b[:, None] if vb else b
    acc = np.zeros(np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2]) + (a2.shape[-2], b2.shape[-1]), np.float32)
    for k in range(a2.shape[-1]):
        p = a2[..., :, k:k + 1] * b2[..., k:k + 1, :]
        if step is None:
            acc += p
        else:
            acc = step(acc, p)
    if va:
        acc = acc[..., 0, :]
    if vb:
        acc = acc[..., 0]
    return acc


# ---------------------------------------------------------------- float32 functions as TVM's kernels call them


@functools.cache
def _libm(name: str) -> Callable[[np.ndarray], np.ndarray]:
    """The C library's float32 function ``name`` (``expf``, ``erff``, ``logf``) elementwise: TVM's
    kernels call it for ``exp``, ``erf`` and ``log`` (numpy's own float32 functions differ in the
    last bit)."""
    import ctypes
    import ctypes.util

    lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    ufunc = np.frompyfunc(lambda v: fn(v), 1, 1)

    def run(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float32)
        return np.asarray(ufunc(x.astype(np.float64)), np.float32).reshape(x.shape) if x.size else x.copy()

    return run


def exp32(x: np.ndarray) -> np.ndarray:
    return _libm("expf")(x)


def _sigmoid32(x: np.ndarray) -> np.ndarray:
    """``1 / (1 + exp(-x))`` in float32."""
    x = np.asarray(x, np.float32)
    return (np.float32(1) / (np.float32(1) + exp32(-x))).astype(np.float32)


def _tanh32(x: np.ndarray) -> np.ndarray:
    """TVM's float32 tanh: ``sign(x) * (1 - e) / (1 + e)``, ``e = exp(-2|x|)``."""
    x = np.asarray(x, np.float32)
    e = exp32(np.float32(-2) * np.abs(x))
    t = ((np.float32(1) - e) / (np.float32(1) + e)).astype(np.float32)
    return np.where(x < 0, -t, t).astype(np.float32)


def _gelu32(x: np.ndarray) -> np.ndarray:
    """``x * (0.5 + erf(x * 0.70710678) * 0.5)`` in float32."""
    x = np.asarray(x, np.float32)
    e = _libm("erff")(x * np.float32(0.70710678118654757))
    return (x * (np.float32(0.5) + e * np.float32(0.5))).astype(np.float32)


def _gelu_tanh32(x: np.ndarray) -> np.ndarray:
    """``0.5x * (1 + tanh(0.79788456x * (1 + 0.044715x * x)))`` in float32."""
    x = np.asarray(x, np.float32)
    inner = (np.float32(0.79788456080286541) * x) * (np.float32(1) + (np.float32(0.044714999999999998) * x) * x)
    return ((np.float32(0.5) * x) * (np.float32(1) + _tanh32(inner.astype(np.float32)))).astype(np.float32)


def _softmax_f32(x: np.ndarray, axis: int) -> np.ndarray:
    """``relax.nn.softmax`` in float32 as TVM legalizes it: max, exp(x - max), the sum in index
    order, one division."""
    x = np.asarray(x, np.float32)
    e = exp32(x - x.max(axis=axis, keepdims=True))
    total = np.take(np.cumsum(e, axis=axis, dtype=np.float32), [-1], axis=axis)
    return (e / total).astype(np.float32)


def _log_softmax_f32(x: np.ndarray, axis: int) -> np.ndarray:
    """``x - max - log(sum(exp(x - max)))`` in float32, the sum in index order."""
    x = np.asarray(x, np.float32)
    m = x.max(axis=axis, keepdims=True)
    total = np.take(np.cumsum(exp32(x - m), axis=axis, dtype=np.float32), [-1], axis=axis)
    return ((x - m) - _libm("logf")(total)).astype(np.float32)


def _unary32(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[list[Any], dict], np.ndarray]:
    return lambda args, attrs: fn(args[0])


def _reduce_last(x: np.ndarray, axes) -> tuple[np.ndarray, list[int]]:
    """``x`` (float32) with ``axes`` moved last and flattened in row-major order (as TVM's
    reduction loops nest), and the kept axes."""
    axes = sorted({int(a) % x.ndim for a in axes})
    rest = [a for a in range(x.ndim) if a not in axes]
    return np.transpose(x, rest + axes).reshape([x.shape[a] for a in rest] + [-1]), axes


def _sum_f32(flat: np.ndarray) -> np.ndarray:
    """float32 sums of the last axis, added in index order from zero."""
    return np.cumsum(flat, axis=-1, dtype=np.float32)[..., -1:]


def _kept(y: np.ndarray, x: np.ndarray, axes: list[int]) -> np.ndarray:
    """A reduction's result (kept axes, then 1) in ``x``'s rank, reduced axes of size 1."""
    return y.reshape([1 if a in axes else x.shape[a] for a in range(x.ndim)])


def _moments_f32(x: np.ndarray, axes) -> tuple[np.ndarray, np.ndarray]:
    """relax.variance's float32 arithmetic: the mean (sum in order / n), then the mean of the
    squared differences, each sum in order; both in ``x``'s rank."""
    x = np.asarray(x, np.float32)
    flat, ax = _reduce_last(x, axes)
    n = np.float32(flat.shape[-1])
    mean = _sum_f32(flat) / n
    d = flat - mean
    return _kept(mean, x, ax), _kept(_sum_f32(d * d) / n, x, ax)


def _variance_f32(args, attrs, root: bool = False) -> np.ndarray:
    x = np.asarray(args[0], np.float32)
    axis = attrs.get("axis")
    _, var = _moments_f32(x, range(x.ndim) if axis is None else np.atleast_1d(axis))
    var = np.sqrt(var) if root else var
    if not attrs.get("keepdims", False):
        reduced = {int(v) % x.ndim for v in np.atleast_1d(axis)} if axis is not None else set(range(x.ndim))
        var = var.reshape([d for a, d in enumerate(x.shape) if a not in reduced])
    return var.astype(np.float32)


def _rsqrt_f32(v: np.ndarray) -> np.ndarray:
    return (np.float32(1) / np.sqrt(v.astype(np.float32))).astype(np.float32)


def _affine(y: np.ndarray, gamma, beta, attrs: dict, shape) -> np.ndarray:
    if attrs.get("scale", True):
        y = y * np.asarray(gamma, np.float32).reshape(shape)
    if attrs.get("center", True):
        y = y + np.asarray(beta, np.float32).reshape(shape)
    return y.astype(np.float32)


def _layer_norm_f32(args, attrs) -> np.ndarray:
    """relax.nn.layer_norm as TVM legalizes it: two passes (mean; sum of squared differences),
    ``(x - mean) * rsqrt(var + eps) * gamma + beta``."""
    x = np.asarray(args[0], np.float32)
    axes = [int(a) % x.ndim for a in np.atleast_1d(attrs.get("axes", -1))]
    mean, var = _moments_f32(x, axes)
    y = (x - mean) * _rsqrt_f32(var + np.float32(attrs.get("epsilon", 1e-5)))
    return _affine(y, args[1], args[2], attrs, [x.shape[a] if a in axes else 1 for a in range(x.ndim)])


def _one_pass_norm(x: np.ndarray, axes, eps: float) -> np.ndarray:
    """instance/group norm as TVM legalizes them: one pass of sum and sum of squares,
    ``(x - s/n) * rsqrt(q/n - (s/n)^2 + eps)``."""
    flat, ax = _reduce_last(x, axes)
    n = np.float32(flat.shape[-1])
    mean = _sum_f32(flat) / n
    var = _sum_f32(flat * flat) / n - mean * mean
    return x - _kept(mean, x, ax), _kept(_rsqrt_f32(var + np.float32(eps)), x, ax)


def _instance_norm_f32(args, attrs) -> np.ndarray:
    x = np.asarray(args[0], np.float32)
    ca = int(attrs.get("channel_axis", 1)) % x.ndim
    axes = [int(a) % x.ndim for a in attrs.get("axes") or [a for a in range(x.ndim) if a not in (0, ca)]]
    d, r = _one_pass_norm(x, axes, float(attrs.get("epsilon", 1e-5)))
    return _affine(d * r, args[1], args[2], attrs, [x.shape[ca] if a == ca else 1 for a in range(x.ndim)])


def _group_norm_f32(args, attrs) -> np.ndarray:
    x = np.asarray(args[0], np.float32)
    ca = int(attrs.get("channel_axis", 1)) % x.ndim
    if ca != 1:
        raise NotImplementedError("float32 group norm over a channel axis other than 1")
    g = int(attrs["num_groups"])
    xg = x.reshape((x.shape[0], g, x.shape[1] // g) + x.shape[2:])
    d, r = _one_pass_norm(xg, range(2, xg.ndim), float(attrs.get("epsilon", 1e-5)))
    gamma = np.asarray(args[1], np.float32).reshape((1, g, x.shape[1] // g) + (1,) * (x.ndim - 2))
    beta = np.asarray(args[2], np.float32).reshape(gamma.shape)
    return _affine(d * r, gamma, beta, attrs, gamma.shape).reshape(x.shape)


def _ncw(attrs: dict) -> dict:
    """A 1-D convolution's attributes with its default layouts."""
    return {**attrs, "data_layout": attrs.get("data_layout") or "NCW",
            "kernel_layout": attrs.get("kernel_layout") or "OIW"}


#: relax ops computed in float32 in the declared order (the rest: :data:`irgen.reference.OPS`
#: on float32 values)
OPS32: dict[str, Callable[[list[Any], dict], Any]] = {
    "relax.nn.conv2d": lambda args, attrs: conv_f32(args[0], args[1], attrs),
    "relax.nn.conv1d": lambda args, attrs: conv_f32(args[0], args[1], _ncw(attrs)),
    "relax.matmul": lambda args, attrs: matmul_f32(args[0], args[1], attrs),
    "relax.nn.conv2d_transpose": lambda args, attrs: conv_transpose_f32(args[0], args[1], attrs),
    "relax.nn.softmax": lambda args, attrs: _softmax_f32(args[0], int(attrs.get("axis", -1))),
    "relax.nn.log_softmax": lambda args, attrs: _log_softmax_f32(args[0], int(attrs.get("axis", -1))),
    "relax.exp": _unary32(exp32),
    "relax.rsqrt": _unary32(_rsqrt_f32),
    "relax.log": _unary32(lambda x: _libm("logf")(x)),
    "relax.erf": _unary32(lambda x: _libm("erff")(x)),
    "relax.tanh": _unary32(_tanh32),
    "relax.sigmoid": _unary32(_sigmoid32),
    "relax.nn.silu": _unary32(lambda x: (np.asarray(x, np.float32) * _sigmoid32(x)).astype(np.float32)),
    "relax.nn.gelu": _unary32(_gelu32),
    "relax.nn.gelu_tanh": _unary32(_gelu_tanh32),
    "relax.variance": _variance_f32,
    "relax.std": lambda args, attrs: _variance_f32(args, attrs, root=True),
    "relax.nn.layer_norm": _layer_norm_f32,
    "relax.nn.instance_norm": _instance_norm_f32,
    "relax.nn.group_norm": _group_norm_f32,
}


#: ops the reference computes exactly as TVM's float32 kernels do (besides :data:`OPS32`): a
#: correctly rounded float32 result (add, multiply, divide, sqrt, ...), no arithmetic (data
#: movement, max, compare), or TVM's order already (``irgen.reference``'s float32 mean, sum,
#: adaptive average pool)
EXACT_BY_NATURE = frozenset(f"relax.{n}" for n in (
    "add subtract multiply divide maximum minimum negative abs square sqrt sign floor ceil trunc round clip where "
    "astype concat stack permute_dims reshape broadcast_to flatten squeeze expand_dims split strided_slice "
    "dynamic_strided_slice take gather_elements gather_nd one_hot tile repeat flip tril triu full full_like zeros "
    "ones zeros_like ones_like arange max min argmax argmin mean sum less greater greater_equal less_equal equal "
    "not_equal isnan isinf isfinite logical_and logical_or logical_xor logical_not nn.relu nn.leakyrelu nn.prelu "
    "nn.max_pool1d nn.max_pool2d nn.max_pool3d nn.avg_pool1d nn.avg_pool2d nn.avg_pool3d nn.adaptive_avg_pool2d "
    "nn.pad nn.pixel_shuffle nn.dropout").split())


def inexact_ops(layer: dict) -> list[str]:
    """The layer's ops whose float32 result the reference computes otherwise than TVM (in
    float64, or in another order: a 3-D convolution, attention, a non-adaptive average pool,
    ...): their results may differ from the golden data in the last bit of the storage type."""
    known = EXACT_BY_NATURE | set(OPS32)
    return sorted({str(op.get("relax_op")) for op in layer.get("fused_ops") or []
                   if op.get("relax_op") not in known and not _picks((op.get("attrs") or {}))})


def _picks(attrs: dict) -> bool:
    """A resize that picks input values (nearest neighbour): no arithmetic on them."""
    return str(attrs.get("method", "")) == "nearest_neighbor"


def _storage_step(storage: np.dtype, products: np.dtype) -> Step:
    """One add of an accumulator in the storage type: the product (exact in float32) rounded to
    ``products``, then the sum rounded to the storage type (values kept as float32)."""
    def step(acc: np.ndarray, p: np.ndarray) -> np.ndarray:
        if products != np.float32:
            p = p.astype(products).astype(np.float32)
        return (acc + p).astype(storage).astype(np.float32)

    return step


def _per_op(storage: np.dtype, products: np.dtype) -> dict[str, Callable[[list[Any], dict], Any]]:
    """The ops of a layer that accumulates in its storage type (``"round": "op"``)."""
    step = _storage_step(storage, products)
    ops = dict(OPS32)
    ops.update({
        "relax.nn.conv2d": lambda args, attrs: conv_f32(args[0], args[1], attrs, step),
        "relax.nn.conv1d": lambda args, attrs: conv_f32(args[0], args[1], _ncw(attrs), step),
        "relax.nn.conv2d_transpose": lambda args, attrs: conv_transpose_f32(args[0], args[1], attrs, step),
        "relax.matmul": lambda args, attrs: matmul_f32(args[0], args[1], attrs, step),
    })
    return ops


def _float32_results(layer: dict, storage: str) -> dict:
    """``layer`` with every op's ``out_dtype`` of the storage type made float32: the ops compute
    in float32 (the rounding to the storage type is the layer's, or ``after``'s)."""
    ops = [{**op, "attrs": {**op["attrs"], "out_dtype": "float32"}}
           if isinstance(op.get("attrs"), dict) and op["attrs"].get("out_dtype") == storage else op
           for op in layer.get("fused_ops") or []]
    return {**layer, "fused_ops": ops}


def run(layer: dict, inputs: list[np.ndarray], params: dict[str, np.ndarray],
        program: Callable[[dict, list, dict, dict | None, Callable | None], list[np.ndarray]]) -> list[np.ndarray]:
    """The layer's outputs in its declared arithmetic. ``program(layer, inputs, params, ops, after)``
    runs the layer's ``fused_ops`` with ``ops`` overriding the reference's op table and ``after``
    applied to each op's result."""
    arith = layer["arith"]
    wide_layer = _float32_results(layer, str(arith.get("storage")))
    storage = storage_dtype(str(arith.get("storage")))
    acc = str(arith.get("accumulate"))
    if acc not in ("float32", arith.get("storage")) or arith.get("round") != ("layer" if acc == "float32" else "op"):
        raise NotImplementedError(f"declared arithmetic {arith}")
    wide_in = [np.asarray(x).astype(np.float32) if _is_storage(np.asarray(x), storage) else x for x in inputs]
    wide_params = {k: v.astype(np.float32) if _is_storage(v, storage) else v for k, v in params.items()}
    if acc == "float32":
        outs = program(wide_layer, wide_in, wide_params, OPS32, None)
    else:  # every op's float32 result rounded to the storage type
        products = storage_dtype(str(arith.get("products") or "float32"))

        def rounded(r: Any) -> Any:
            return r.astype(storage).astype(np.float32) if isinstance(r, np.ndarray) and r.dtype == np.float32 else r

        outs = program(wide_layer, wide_in, wide_params, _per_op(storage, products), rounded)
    named = [str(r.get("dtype")) for r in layer.get("outputs") or []]
    return [to_storage(o, storage) if (np.asarray(o).dtype == np.float32 and k < len(named)
                                       and named[k] == arith.get("storage")) else o
            for k, o in enumerate(outs)]


def accumulation_length(layer: dict) -> int:
    """The most products one output of the layer's convolutions and matrix products adds
    (input channels of a group x kernel size; ``k`` of a matrix product); 1 without any."""
    shapes = {f"input:{k}": r.get("shape") for k, r in enumerate(layer.get("inputs") or [])}
    shapes.update({f"param:{k}": r.get("shape") for k, r in (layer.get("params") or {}).items()})
    longest = 1
    for op in layer.get("fused_ops") or []:
        args = [shapes.get(a) if isinstance(a, str) else None for a in op.get("args") or []]
        name = op.get("relax_op")
        if name in ("relax.nn.conv1d", "relax.nn.conv2d", "relax.nn.conv3d") and len(args) > 1 and args[1]:
            longest = max(longest, int(np.prod(args[1][1:])))
        elif name == "relax.matmul" and len(args) > 1:
            k = args[0][-1] if args[0] else (args[1][-2] if args[1] and len(args[1]) > 1 else None)
            longest = max(longest, int(k or 1))
    return longest


def source_ulp_limit(layer: dict, max_ulp: int) -> int:
    """The ulp a layer may differ from its source runtime by, recomputed from the runtime's inputs
    (docs/verify.md): ``max_ulp``; accumulating in the storage type (``--accumulate fp16``/``bf16``,
    which no runtime does), ``max_ulp * ceil(sqrt(K))``, K its :func:`accumulation_length` (the
    rounding errors of K partial sums grow like sqrt(K))."""
    arith = layer.get("arith") or {}
    if arith.get("accumulate") in (None, "float32"):
        return max_ulp
    return max_ulp * (math.isqrt(accumulation_length(layer) - 1) + 1)  # ceil(sqrt(K))
