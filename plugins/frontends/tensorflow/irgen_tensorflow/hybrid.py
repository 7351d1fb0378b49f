"""TFLite's dynamic-range ("hybrid") kernels, which TVM's importer refuses.

The converter's dynamic-range quantization (``optimizations=[Optimize.DEFAULT]``
without a representative dataset) keeps float activations and stores the
weights of CONV_2D, DEPTHWISE_CONV_2D and FULLY_CONNECTED as int8, one scale per
output channel. At run time TFLite quantizes each op's float input, per batch
(per row for FULLY_CONNECTED), multiplies integers, and scales the int32
accumulator back to float (``tensor_utils::AsymmetricQuantizeFloats`` and the
reference ``HybridConvPerChannel``, ``DepthwiseConvHybridPerChannel`` and the
fully connected ``EvalHybridDense``). Each converter here builds that
arithmetic in Relax, step for step:

* the input's range ``rmin = min(0, min x)``, ``rmax = max(0, max x)``; the
  scale ``float32(float32(rmax - rmin) / 255.0)`` (the division in double); the
  zero point the one of ``-128 - rmin / scale`` and ``127 - rmax / scale`` with
  the smaller error, rounded half away from zero and clamped (double); an
  all-zero input gives scale 0 and zero point 0;
* ``q = clamp(zero_point + round(x * float32(1.0 / scale)), -128, 127)``, the
  product in float32 rounded as TFLite's x86 build does,
  ``trunc(f + copysign(0.5, f))`` (a FULLY_CONNECTED without
  ``asymmetric_quantize_inputs``: ``range = max(|min|, |max|)``,
  ``q = clamp(round(x * (127 / range)), -127, 127)``, scale ``range / 127``);
* ``acc = sum((q - zero_point) * w)`` in int32 (padding contributes nothing);
* CONV_2D: ``float32(acc) * w_scale[c] * scale + bias``; DEPTHWISE_CONV_2D:
  ``float32(acc) * (w_scale[c] * scale) + bias``; FULLY_CONNECTED:
  ``bias + float32(acc) * (scale * w_scale[c])``; then the fused activation.

The results are float tensors: float layers, compared with the interpreter as
float layers are.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from irgen.plugin import rx_round_half_away

#: the operators with a hybrid kernel irgen builds
HYBRID_OPS = frozenset({"CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED"})


def is_hybrid(conv, op) -> bool:
    """A float input, an int8 constant weight with quantization parameters, a float result."""
    ins = conv.get_input_tensors(op)
    outs = conv.get_output_tensors(op)
    if len(ins) < 2 or ins[0].qnn_params is not None or ins[1].qnn_params is None:
        return False
    return all(o.qnn_params is None for o in outs) and ins[1].tensor.Type() == 9  # INT8


def _f32(v: float):
    from tvm import relax

    return relax.const(np.float32(v), "float32")


def _f64(v: float):
    from tvm import relax

    return relax.const(np.float64(v), "float64")


def _vector_round(bb, f):
    """TFLite's x86 build rounds the products ``x * (1 / scale)`` as its vectorized code does:
    ``trunc(f + copysign(0.5, f))`` in float32 (so 0.49999997 becomes 1), as int32. Measured on
    the interpreter's hybrid FULLY_CONNECTED: 3000 of 3000 random rows full of rounding ties,
    where ``std::round`` (which the portable source reads) missed 1084."""
    from tvm.relax import op

    half = bb.normalize(op.where(bb.normalize(op.less(f, _f32(0.0))), _f32(-0.5), _f32(0.5)))
    return bb.normalize(op.astype(bb.normalize(op.trunc(bb.normalize(op.add(f, half)))), "int32"))


def _asymmetric(bb, x, axes: list[int]):
    """``AsymmetricQuantizeFloats`` over ``axes`` (kept): ``(q - zero_point)`` as int32 and the
    float32 scale."""
    from tvm.relax import op

    zero = _f32(0.0)
    rmin = bb.normalize(op.minimum(bb.normalize(op.min(x, axis=axes, keepdims=True)), zero))
    rmax = bb.normalize(op.maximum(bb.normalize(op.max(x, axis=axes, keepdims=True)), zero))
    span = bb.normalize(op.subtract(rmax, rmin))  # float32, as TFLite subtracts
    flat = bb.normalize(op.equal(span, zero))  # all zero: scale 0, zero point 0
    scale64 = bb.normalize(op.divide(bb.normalize(op.astype(span, "float64")), _f64(255.0)))
    safe = bb.normalize(op.where(flat, _f64(1.0), scale64))
    a = bb.normalize(op.divide(bb.normalize(op.astype(rmin, "float64")), safe))
    b = bb.normalize(op.divide(bb.normalize(op.astype(rmax, "float64")), safe))
    from_min = bb.normalize(op.subtract(_f64(-128.0), a))
    from_max = bb.normalize(op.subtract(_f64(127.0), b))
    err_min = bb.normalize(op.add(_f64(128.0), bb.normalize(op.abs(a))))
    err_max = bb.normalize(op.add(_f64(127.0), bb.normalize(op.abs(b))))
    zpd = bb.normalize(op.where(bb.normalize(op.less(err_min, err_max)), from_min, from_max))
    nudged = bb.normalize(op.clip(rx_round_half_away(bb.normalize, zpd), -128, 127))
    offset = bb.normalize(op.where(flat, _f64(0.0), nudged))
    scale = bb.normalize(op.where(flat, zero, bb.normalize(op.astype(scale64, "float32"))))
    # float32(1.0 / double(scale)); 0 for a zero scale
    inv64 = bb.normalize(op.divide(_f64(1.0), bb.normalize(op.where(flat, _f64(1.0),
                                                                    bb.normalize(op.astype(scale, "float64"))))))
    inv = bb.normalize(op.where(flat, zero, bb.normalize(op.astype(inv64, "float32"))))
    off = bb.normalize(op.astype(offset, "int32"))
    q = bb.normalize(op.clip(bb.normalize(op.add(_vector_round(bb, bb.normalize(op.multiply(x, inv))), off)),
                             -128, 127))
    return bb.normalize(op.subtract(q, off)), scale


def _symmetric(bb, x, axes: list[int]):
    """``SymmetricQuantizeFloats`` over ``axes`` (kept): ``q`` as int32 and the float32 scale."""
    from tvm.relax import op

    zero = _f32(0.0)
    rng = bb.normalize(op.maximum(bb.normalize(op.abs(bb.normalize(op.min(x, axis=axes, keepdims=True)))),
                                  bb.normalize(op.abs(bb.normalize(op.max(x, axis=axes, keepdims=True))))))
    flat = bb.normalize(op.equal(rng, zero))
    safe = bb.normalize(op.where(flat, _f32(1.0), rng))
    scale = bb.normalize(op.where(flat, _f32(1.0), bb.normalize(op.divide(safe, _f32(127.0)))))
    inv = bb.normalize(op.where(flat, zero, bb.normalize(op.divide(_f32(127.0), safe))))
    return bb.normalize(op.clip(_vector_round(bb, bb.normalize(op.multiply(x, inv))), -127, 127)), scale


def _activation(bb, y, fused: int, code: str):
    from tvm.relax import op

    if fused == 0:
        return y
    if fused == 1:
        return bb.normalize(op.nn.relu(y))
    if fused == 2:
        return bb.normalize(op.clip(y, -1.0, 1.0))
    if fused == 3:
        return bb.normalize(op.clip(y, 0.0, 6.0))
    raise ValueError(f"{code}: dynamic-range kernel with fused activation {fused} is not supported")


def _options(op, cls):
    options = cls()
    table = op.BuiltinOptions()
    options.Init(table.Bytes, table.Pos)
    return options


def _weights(conv, t, code: str, channels: int, axis: int, per_tensor_ok: bool = False):
    """(int8 weights, float32 scale per output channel). ``per_tensor_ok``: one scale for every
    channel is taken as that scale per channel (FULLY_CONNECTED: TFLite multiplies it into the
    row's scale, ``acc * (scale * w_scale)``, the same product)."""
    w = np.asarray(conv.get_tensor_value(t))
    q = t.tensor.Quantization()
    scales = np.asarray(q.ScaleAsNumpy(), np.float32).reshape(-1)
    zps = np.asarray(q.ZeroPointAsNumpy()).reshape(-1) if q.ZeroPointLength() else np.zeros(1, np.int64)
    if np.any(zps != 0):
        raise ValueError(f"{code}: dynamic-range weights with non-zero zero points are not supported")
    if scales.size == 1 and channels > 1 and per_tensor_ok:
        return w.astype(np.int8), np.full(channels, scales[0], np.float32)
    if scales.size == 1 and channels > 1:
        raise ValueError(f"{code}: dynamic-range weights with one scale for {channels} channels (TFLite's per-tensor "
                         "hybrid kernel) are not supported")
    if scales.size != channels or int(q.QuantizedDimension()) != axis:
        raise ValueError(f"{code}: {scales.size} weight scales on axis {q.QuantizedDimension()} for {channels} "
                         "output channels")
    return w.astype(np.int8), scales


def _bias(conv, ins, channels: int):
    from tvm import relax

    if len(ins) < 3 or ins[2].tensor_idx < 0:
        return None
    b = np.asarray(conv.get_tensor_value(ins[2]))
    if b.dtype != np.float32 or b.size != channels:
        raise ValueError("dynamic-range kernel with a bias that is not float32 per output channel")
    return relax.const(b.reshape(-1))


def _same_pad(size: int, kernel: int, stride: int) -> tuple[int, int]:
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def convert_conv(conv, op, depthwise: bool):
    """Hybrid CONV_2D / DEPTHWISE_CONV_2D (TFLite's per-channel hybrid kernels)."""
    from tflite.Conv2DOptions import Conv2DOptions
    from tflite.DepthwiseConv2DOptions import DepthwiseConv2DOptions
    from tvm import relax
    from tvm.relax import op as rop

    bb = conv.bb
    code = "DEPTHWISE_CONV_2D" if depthwise else "CONV_2D"
    ins = conv.get_input_tensors(op)
    o = _options(op, DepthwiseConv2DOptions if depthwise else Conv2DOptions)
    dil = (int(o.DilationHFactor()), int(o.DilationWFactor()))
    n, h, w_, c = (int(d) for d in ins[0].tensor.ShapeAsNumpy())
    wt = ins[1]
    if depthwise:
        _, kh, kw, channels = (int(d) for d in wt.tensor.ShapeAsNumpy())
        w, scales = _weights(conv, wt, code, channels, 3)
        kernel = w.reshape(kh, kw, channels, 1) if c > 1 else w.reshape(kh, kw, 1, channels)
        layout, groups = ("HWOI" if c > 1 else "HWIO"), c
    else:
        channels, kh, kw, cin = (int(d) for d in wt.tensor.ShapeAsNumpy())
        if dil != (1, 1):  # TFLite's per-channel hybrid conv runs with dilation 1 whatever the options say
            raise ValueError("CONV_2D: a dilated dynamic-range convolution is not supported")
        w, scales = _weights(conv, wt, code, channels, 0)
        kernel, layout, groups = w.transpose(1, 2, 3, 0), "HWIO", c // cin
    stride = (int(o.StrideH()), int(o.StrideW()))
    if int(o.Padding()) == 0:  # SAME
        top, bottom = _same_pad(h, dil[0] * (kh - 1) + 1, stride[0])
        left, right = _same_pad(w_, dil[1] * (kw - 1) + 1, stride[1])
        padding = [top, left, bottom, right]
    else:
        padding = [0, 0, 0, 0]
    x = conv.get_tensor_expr(ins[0])
    xq, scale = _asymmetric(bb, x, [1, 2, 3])  # per batch: scale [N, 1, 1, 1]
    acc = bb.normalize(rop.nn.conv2d(xq, relax.const(np.ascontiguousarray(kernel)), strides=list(stride),
                                     padding=padding, dilation=list(dil), groups=groups, data_layout="NHWC",
                                     kernel_layout=layout, out_dtype="int32"))
    accf = bb.normalize(rop.astype(acc, "float32"))
    wscale = relax.const(scales)
    if depthwise:
        y = bb.normalize(rop.multiply(accf, bb.normalize(rop.multiply(wscale, scale))))
    else:
        y = bb.normalize(rop.multiply(bb.normalize(rop.multiply(accf, wscale)), scale))
    bias = _bias(conv, ins, channels)
    if bias is not None:
        y = bb.normalize(rop.add(y, bias))
    return _activation(bb, y, int(o.FusedActivationFunction()), code)


def convert_fully_connected(conv, op):
    """Hybrid FULLY_CONNECTED (``EvalHybridDense``): each row of ``[prod(dims[:-1]), K]`` quantized
    on its own."""
    from tflite.FullyConnectedOptions import FullyConnectedOptions
    from tvm import relax
    from tvm.relax import op as rop

    bb = conv.bb
    ins = conv.get_input_tensors(op)
    o = _options(op, FullyConnectedOptions)
    dims = [int(d) for d in ins[0].tensor.ShapeAsNumpy()]
    units, k = (int(d) for d in ins[1].tensor.ShapeAsNumpy())
    w, scales = _weights(conv, ins[1], "FULLY_CONNECTED", units, 0, per_tensor_ok=True)
    rows = int(np.prod(dims)) // k
    x = bb.normalize(rop.reshape(conv.get_tensor_expr(ins[0]), [rows, k]))
    if o.AsymmetricQuantizeInputs():
        xq, scale = _asymmetric(bb, x, [1])
    else:
        xq, scale = _symmetric(bb, x, [1])
    acc = bb.normalize(rop.matmul(xq, relax.const(np.ascontiguousarray(w.T)), out_dtype="int32"))
    # the two scales multiplied first (measured: 300 of 300 random rows bit-exact; the portable
    # source's (acc * scale) * w_scale missed all)
    y = bb.normalize(rop.multiply(bb.normalize(rop.astype(acc, "float32")),
                                  bb.normalize(rop.multiply(scale, relax.const(scales)))))
    bias = _bias(conv, ins, units)
    if bias is not None:
        y = bb.normalize(rop.add(bias, y))
    y = _activation(bb, y, int(o.FusedActivationFunction()), "FULLY_CONNECTED")
    if o.KeepNumDims() and len(dims) > 2:
        return rop.reshape(y, dims[:-1] + [units])
    return y


def convert(conv, code: str, fallback, op):
    """``code``'s converter: the hybrid kernel when ``op`` is dynamic-range quantized, else
    ``fallback(op=op)`` (the converter it replaces)."""
    if not is_hybrid(conv, op):
        return fallback(op=op)
    if code == "FULLY_CONNECTED":
        return convert_fully_connected(conv, op)
    return convert_conv(conv, op, depthwise=code == "DEPTHWISE_CONV_2D")
