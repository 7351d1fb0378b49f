"""A float convolution bias as ONNX Runtime rounds it before it runs a Conv in float.

ONNX Runtime's ``WeightBiasQuantization`` transformer (on in every session irgen's source
runner opens) rewrites the float bias of a ``Conv`` whose input is dequantized per tensor, whose
weights are dequantized (per tensor, or per output channel), and whose output goes, through
Relu/Clip ops only, into one QuantizeLinear: the bias becomes
``DequantizeLinear(int32(round_half_even(b / (s_x * s_w[c]))), s_x * s_w[c])`` (the products and
the quotient in float32). When the unit then fuses into QLinearConv, that int32 bias is the
kernel's (:func:`irgen_qdq.conv._ort_bias_int32`); when ORT runs the unit in float (the integer
types differ, a Clip is not redundant...) the float Conv adds the dequantized rounded bias, not
the model's. :func:`round_float_bias` puts that bias into the span before it is realized in float.
"""

from __future__ import annotations

import numpy as np


def _float_bias_operand(qg, s):
    """``(the bias operand of the span's bias add, its float32 values)`` when it is a float constant
    (maybe reshaped), else None."""
    from irgen.plugin import Constant

    other = s.bias_b.value.args[1] if s.bias_b.value.args[0].same_as(s.comp.var) else s.bias_b.value.args[0]
    e = other
    for _ in range(4):
        if isinstance(e, Constant):
            arr = e.value.numpy()
            return (other, arr) if arr.dtype == np.float32 else None
        b = qg.producer(e)
        if b is None or b.op != "relax.reshape":
            return None
        e = b.value.args[0]
    return None


def _scales(qg, s):
    """``(s_x, s_w)`` of the span's conv when its input is a per-tensor dequantize of an activation and
    its weights a dequantize of a constant, else None."""
    from irgen.plugin import Constant

    dx = qg.producer(s.comp.value.args[0])
    dw = qg.producer(s.comp.value.args[1])
    if dx is None or dx.op != "relax.dequantize" or dw is None or dw.op != "relax.dequantize" \
            or not isinstance(dw.value.args[0], Constant):
        return None
    sx = np.asarray(dx.value.args[1].value.numpy(), np.float32).reshape(-1)
    sw = np.asarray(dw.value.args[1].value.numpy(), np.float32).reshape(-1)
    return (sx[0], sw) if sx.size == 1 else None


def round_float_bias(s) -> bool:
    """The float bias of the span's Conv replaced by the bias ONNX Runtime computes with (see the
    module text); True when it was."""
    from tvm import relax
    from tvm.relax import op

    qg = s.qg
    if s.torch or s.comp.op not in ("relax.nn.conv2d", "relax.nn.conv3d") or s.bias_b is None or any(qg.n_users(b.name) != 1 for b in s.acts):
        return False
    found, scales = _float_bias_operand(qg, s), _scales(qg, s)
    if found is None or scales is None:
        return False
    other, bias = found
    n = bias.size
    if scales[1].size not in (1, n):
        return False
    scale = (scales[0] * np.broadcast_to(scales[1], (n,))).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        rounded = np.rint(bias.reshape(-1).astype(np.float32) / scale)
    info = np.iinfo(np.int32)
    if not np.all(np.isfinite(rounded)) or np.any(np.abs(rounded) > info.max):
        return False  # (ORT's Cast of an out-of-range float is its own)
    dequantized = (rounded.astype(np.int32).astype(np.float32) * scale).astype(np.float32)
    shape = [int(d) for d in other.ty.shape.values]
    new = relax.const(dequantized.reshape(shape))
    left = s.bias_b.value.args[0].same_as(s.comp.var)
    qg.replace([s.bias_b.name], op.add(s.comp.var, new) if left else op.add(new, s.comp.var))
    return True
