"""Quantized tensors narrower than their integer type: an integer Clip between a quantize and
its dequantizes.

Brevitas' QCDQ export writes a quantizer of fewer than 8 bits (or a narrow range) as
``QuantizeLinear -> Clip(lo, hi) -> DequantizeLinear`` on an int8/uint8 tensor, and irgen's
QONNX lowering writes a ``Quant`` of fewer than 8 bits the same way. ONNX Runtime runs the Clip
as its own integer kernel after the integer op the QuantizeLinear ends; clamping that op's
result to ``[lo, hi]`` in the first place gives the same integers. :func:`fold_integer_clips`
folds such a Clip into the quantize before it when that layer clamps its result anyway (a
model input's quantize, a convolution or matrix product), and the tensor's range
(``QGraph.ranges``) says ``[lo, hi]``: the layer clamps to it, and its ``quant`` record gives
``"range": [lo, hi]`` (a 4-bit signed tensor: ``[-8, 7]``) beside its int8 ``dtype``. Behind any
other layer the Clip stays an integer ``clip`` layer of its own.
"""

from __future__ import annotations

import numpy as np

from .common import _CONVS, _ops

_INTEGER = ("int8", "uint8", "int16", "uint16")
#: the float ops whose quantized realization clamps to a range (convolutions and matrix
#: products requantize into ``[lo, hi]``; a model input's quantize saturates into it)
_CLAMPING = (*_CONVS, "relax.matmul")
_UNDER = ("relax.nn.relu", "relax.clip", "relax.add")


def _clamps(qg, qb) -> bool:
    """Whether the layer quantize ``qb`` ends clamps its integers to a range: a model input's
    quantize, or a convolution or matrix product under its bias add and Relu/Clip; any other
    span (a table, an integer add, a pooling) keeps the Clip as its own integer layer."""
    relax = _ops()[0]
    x = qb.value.args[0]
    for _ in range(4):
        p = qg.producer(x) if isinstance(x, relax.Var) else None
        if p is None:
            return isinstance(x, relax.Var)  # the model's float input
        if p.op in _CLAMPING:
            return True
        if p.op not in _UNDER:
            return False
        x = p.value.args[0]
    return False


def _bound(expr) -> int | None:
    """A clip bound as an int (the clip's scalar, or a scalar constant), None when it is not one."""
    value = getattr(expr, "value", None)
    if hasattr(value, "numpy"):  # a constant tensor
        arr = value.numpy()
        return int(arr.reshape(())) if arr.size == 1 else None
    value = getattr(value, "value", value)  # a PrimValue's IntImm
    return int(value) if isinstance(value, (int, float, np.integer, np.floating)) else None


def _folding(qg, b):
    """(the quantize binding, lo, hi) when ``b`` is an integer clip of a quantize read by nothing
    else, whose every reader is a dequantize; else None."""
    relax = _ops()[0]
    x = b.value.args[0]
    qb = qg.producer(x) if isinstance(x, relax.Var) else None
    if qb is None or qb.op != "relax.quantize" or qg.n_users(qb.name) != 1 or not _clamps(qg, qb):
        return None
    dtype = str(qb.value.attrs.out_dtype)
    lo, hi = _bound(b.value.args[1]), _bound(b.value.args[2])
    if dtype not in _INTEGER or lo is None or hi is None:
        return None
    readers = [qg.bindings[i] for i in qg.users.get(b.name, [])]
    if not readers or len(readers) != qg.n_users(b.name) or any(r.op != "relax.dequantize" for r in readers):
        return None
    info = np.iinfo(dtype)
    old_lo, old_hi = qg.ranges.get(qb.name, (int(info.min), int(info.max)))
    lo, hi = max(lo, old_lo), min(hi, old_hi)
    return (qb, lo, hi) if lo <= hi else None


def fold_integer_clips(qg) -> int:
    """Fold every integer Clip of a quantized tensor read only by dequantizes into the quantize
    before it, the clip's bounds becoming the tensor's range; returns how many were folded."""
    folded = 0
    for b in [b for b in qg.bindings if b.op == "relax.clip"]:
        found = _folding(qg, b)
        if found is None:
            continue
        qb, lo, hi = found
        qg.replace([qb.name, b.name], qb.value)  # the clip's tensor is the quantize's now
        qg.ranges[b.name] = (lo, hi)
        folded += 1
    return folded
