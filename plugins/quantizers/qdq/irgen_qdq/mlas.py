"""A float span's convolution as ONNX Runtime's MLAS computes it, to the last bit.

Where ONNX Runtime cannot run a QDQ node unit as an integer kernel (a bias quantized with
another scale: torchvision's ResNets share one zero bias between convolutions, and
``quantize_static`` quantizes it once), it runs ``DequantizeLinear -> Conv -> QuantizeLinear``
in float: ``MlasConv``. Its float32 sums are not a float64 sum rounded once: MLAS expands the
input (im2col: input channel, kernel row, kernel column; a 3-D convolution by ``MlasConvVol2Col``:
input channel, kernel depth, kernel row, kernel column), and its SGEMM kernel adds the
products of each slice of ``K`` (the expanded length) with a chain of fused multiply-adds from
zero, then adds the slice to the output in float32; the bias is added after (``MlasActivation``).
The slice length (:func:`k_block`) follows ``MlasConvOperation``/``MlasSgemmOperation``: 128,
doubled while the N slice (128, halved with it, above 16) would be at least twice the output
positions (``od*oh*ow`` in 3-D), or grown past ``K`` when the positions are at least ``K``. A
float64 sum differed from it on 11% of ResNet-50's values at 224x224 (1 LSB, drifting to 11), and
on a few values of torchvision's 3-D video networks (mc3_18, r2plus1d_18).

:func:`emit_conv` realizes such a convolution with a TIR kernel calling LLVM's ``llvm.fma``
(one rounding, on every CPU), and records it as ``relax.nn.conv2d`` (NCHW/OIHW) or
``relax.nn.conv3d`` (NCDHW/OIDHW) with ``accumulation`` (``irgen.reference.conv2d_fma_blocked``,
``conv3d_fma_blocked`` recompute it in numpy). Not covered, and computed in float64 as before: one
output channel per group (depthwise: MLAS's ``M == 1`` kernel has its own loop), other layouts
and 1-D convolutions. ONNX Runtime gives each thread a segment of the positions
(``ThreadStrideN``) and slices K by the segment's length, which changes the order of a
convolution of few positions: the golden data is its one-thread order, and ``irgen verify``
runs onnxruntime with one intra-op thread (``irgen_onnx.runner.session_options``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

_STRIDE_N, _STRIDE_K = 128, 128  # MLAS_SGEMM_STRIDEN, MLAS_SGEMM_STRIDEK


def k_block(n: int, k: int) -> int:
    """The length of MLAS's K slices for an SGEMM of ``n`` output positions and depth ``k``."""
    stride_n, stride_k = _STRIDE_N, _STRIDE_K
    if n >= k:
        while stride_k // 2 >= k:
            stride_n, stride_k = stride_n * 2, stride_k // 2
    else:
        while stride_n > 16 and stride_n // 2 >= n:
            stride_n, stride_k = stride_n // 2, stride_k * 2
    return stride_k


#: the layouts (data, kernel) MLAS's order is known for, by the input's rank: im2col and vol2col
_LAYOUTS = {4: ("NCHW", "OIHW"), 5: ("NCDHW", "OIDHW")}


def applies(call, x_shape, w_shape) -> bool:
    """Whether MLAS's im2col (vol2col) + SGEMM order is the one this convolution takes (see the module text)."""
    a = call.attrs
    layouts = _LAYOUTS.get(len(x_shape))
    if layouts is None or len(w_shape) != len(x_shape):
        return False
    data, kernel = layouts
    if (str(a.data_layout), str(a.kernel_layout), str(a.out_layout or a.data_layout)) != (data, kernel, data):
        return False
    return w_shape[0] // int(a.groups) > 1


def conv_attrs(call, x_shape, w_shape, out_shape) -> dict[str, Any]:
    """The convolution's attributes as ``fused_ops`` writes them, with its ``accumulation``."""
    from irgen.plugin import attrs_to_dict

    k = int(np.prod(w_shape[1:]))
    n = int(np.prod([int(v) for v in out_shape[2:]]))  # the output positions: oh*ow (od*oh*ow)
    axes = "kernel depth, kernel row, kernel column" if len(out_shape) == 5 else "kernel row, kernel column"
    expand = "vol2col" if len(out_shape) == 5 else "im2col"
    return {**attrs_to_dict(call.attrs), "out_dtype": "float32",
            "accumulation": {"dtype": "float32", "fma": True, "order": "im2col", "k_block": k_block(n, k),
                             "rule": f"per output: fused multiply-adds over k (input channel, {axes}) from "
                                     "zero in blocks of k_block, the blocks added in order in float32 "
                                     f"(ONNX Runtime's MLAS {expand} + SGEMM)"}}


def _kernel(x_shape, w_shape, out_shape, attrs: dict[str, Any]):
    """The TIR kernel: ``out = conv(x, w)`` in the declared accumulation order."""
    from tvm.script import tirx as T

    n, c, h, wd = (int(v) for v in x_shape)
    o, cg, kh, kw = (int(v) for v in w_shape)
    oh, ow = int(out_shape[2]), int(out_shape[3])
    g = int(attrs["groups"])
    og = o // g
    sh, sw = (int(v) for v in attrs["strides"])
    dh, dw = (int(v) for v in attrs["dilation"])
    pt, pl = int(attrs["padding"][0]), int(attrs["padding"][1])
    kk = cg * kh * kw
    block = int(attrs["accumulation"]["k_block"])
    nblocks = (kk + block - 1) // block
    khw = kh * kw

    @T.prim_func(private=True, s_tir=True)
    def kernel(x: T.Buffer((T.int64(n), T.int64(c), T.int64(h), T.int64(wd)), "float32", layout=None),
               w: T.Buffer((T.int64(o), T.int64(cg), T.int64(kh), T.int64(kw)), "float32", layout=None),
               y: T.Buffer((T.int64(n), T.int64(o), T.int64(oh), T.int64(ow)), "float32", layout=None)):
        with T.sblock("root"):
            part = T.sblock_alloc_buffer((1,), "float32", scope="local")
            for bo in T.parallel(n * o):
                for oy, ox in T.grid(oh, ow):
                    for kb in range(nblocks):
                        part[0] = T.float32(0)
                        for kr in range(T.min(block, kk - kb * block)):
                            k = kb * block + kr
                            ci = k // khw
                            i = (k % khw) // kw
                            j = k % kw
                            iy = oy * sh - pt + i * dh
                            ix = ox * sw - pl + j * dw
                            inside = T.And(T.And(iy >= 0, iy < h), T.And(ix >= 0, ix < wd))  # else the padding: a zero
                            xv = T.Select(inside, x[bo // o, (bo % o) // og * cg + ci, T.max(T.min(iy, h - 1), 0),
                                                    T.max(T.min(ix, wd - 1), 0)], T.float32(0))
                            part[0] = T.call_llvm_pure_intrin("float32", "llvm.fma", w[bo % o, ci, i, j], xv, part[0])
                        if kb == 0:
                            y[bo // o, bo % o, oy, ox] = part[0]
                        else:
                            y[bo // o, bo % o, oy, ox] = y[bo // o, bo % o, oy, ox] + part[0]

    return kernel


def _kernel3d(x_shape, w_shape, out_shape, attrs: dict[str, Any]):
    """The TIR kernel of a 3-D convolution (NCDHW/OIDHW): :func:`_kernel` with a kernel depth
    (k: input channel, kernel depth, kernel row, kernel column: MLAS's vol2col)."""
    from tvm.script import tirx as T

    n, c, d, h, wd = (int(v) for v in x_shape)
    o, cg, kd, kh, kw = (int(v) for v in w_shape)
    od, oh, ow = (int(v) for v in out_shape[2:])
    g = int(attrs["groups"])
    og = o // g
    sd, sh, sw = (int(v) for v in attrs["strides"])
    dd, dh, dw = (int(v) for v in attrs["dilation"])
    pf, pt, pl = (int(v) for v in attrs["padding"][:3])
    kk = cg * kd * kh * kw
    block = int(attrs["accumulation"]["k_block"])
    nblocks = (kk + block - 1) // block
    khw = kh * kw
    kdhw = kd * khw

    @T.prim_func(private=True, s_tir=True)
    def kernel(x: T.Buffer((T.int64(n), T.int64(c), T.int64(d), T.int64(h), T.int64(wd)), "float32", layout=None),
               w: T.Buffer((T.int64(o), T.int64(cg), T.int64(kd), T.int64(kh), T.int64(kw)), "float32", layout=None),
               y: T.Buffer((T.int64(n), T.int64(o), T.int64(od), T.int64(oh), T.int64(ow)), "float32", layout=None)):
        with T.sblock("root"):
            part = T.sblock_alloc_buffer((1,), "float32", scope="local")
            for bo in T.parallel(n * o):
                for oz, oy, ox in T.grid(od, oh, ow):
                    for kb in range(nblocks):
                        part[0] = T.float32(0)
                        for kr in range(T.min(block, kk - kb * block)):
                            k = kb * block + kr
                            ci = k // kdhw
                            q = (k % kdhw) // khw
                            i = (k % khw) // kw
                            j = k % kw
                            iz = oz * sd - pf + q * dd
                            iy = oy * sh - pt + i * dh
                            ix = ox * sw - pl + j * dw
                            inside = T.And(T.And(T.And(iz >= 0, iz < d), T.And(iy >= 0, iy < h)),
                                           T.And(ix >= 0, ix < wd))  # else the padding: a zero
                            xv = T.Select(inside, x[bo // o, (bo % o) // og * cg + ci, T.max(T.min(iz, d - 1), 0),
                                                    T.max(T.min(iy, h - 1), 0), T.max(T.min(ix, wd - 1), 0)],
                                          T.float32(0))
                            wv = w[bo % o, ci, q, i, j]
                            part[0] = T.call_llvm_pure_intrin("float32", "llvm.fma", wv, xv, part[0])
                        if kb == 0:
                            y[bo // o, bo % o, oz, oy, ox] = part[0]
                        else:
                            y[bo // o, bo % o, oz, oy, ox] = y[bo // o, bo % o, oz, oy, ox] + part[0]

    return kernel


#: by the input's rank: (the TIR kernel, the relax op building the output shape, the op recorded)
_CONVS = {4: (_kernel, "conv2d", "relax.nn.conv2d"), 5: (_kernel3d, "conv3d", "relax.nn.conv3d")}


def emit_conv(qg, e, call, x32, w: np.ndarray):
    """The convolution ``call`` of float32 ``x32`` (a bound value) by the float32 weights ``w`` as
    MLAS computes it: a ``call_tir`` of a kernel added to ``qg.mod``, bound with ``e``."""
    from tvm import relax

    x_shape = [int(v) for v in x32.ty.shape.values]
    kernel, conv, recorded = _CONVS[len(x_shape)]
    out_shape = [int(v) for v in relax.BlockBuilder().normalize(getattr(relax.op.nn, conv)(
        x32, relax.const(w), **_conv_kwargs(call.attrs, len(x_shape)))).ty.shape.values]
    attrs = conv_attrs(call, x_shape, w.shape, out_shape)
    digest = hashlib.sha256(json.dumps([x_shape, list(w.shape), attrs], sort_keys=True).encode()).hexdigest()[:12]
    gv = qg.add_kernel(kernel(x_shape, w.shape, out_shape, attrs), f"fma_{conv}_{digest}", recorded, attrs)
    return e(relax.call_tir(gv, relax.Tuple([x32, relax.const(w)]), relax.TensorType(out_shape, "float32")))


def _conv_kwargs(a, rank: int = 4) -> dict[str, Any]:
    data, kernel = _LAYOUTS[rank]
    return {"strides": [int(v) for v in a.strides], "padding": [int(v) for v in a.padding],
            "dilation": [int(v) for v in a.dilation], "groups": int(a.groups), "data_layout": data,
            "kernel_layout": kernel}
