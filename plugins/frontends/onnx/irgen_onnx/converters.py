"""irgen's own converters for ONNX ops where TVM's importer emits something
irgen cannot use (one function per op, looked up in :data:`CONVERTERS` before
TVM's table).

``Clip``: TVM's importer emits two ``call_tir``s of TE-generated ``maximum`` /
``minimum`` kernels, opaque to layer forming and to verify's numpy reference;
here constant bounds become one ``relax.clip`` (ReLU6 stays a recognizable
op) and tensor bounds ``relax.maximum`` / ``relax.minimum``.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


def _bound(expr, default: float):
    """A scalar bound: a float, or None when it is not a constant (then a tensor bound)."""
    import tvm

    if expr is None:
        return default
    if isinstance(expr, tvm.ir.Constant):
        v = expr.value.numpy()
        if v.size != 1:
            return None
        v = float(v.reshape(()))
        return default if np.isnan(v) else v  # ONNX Runtime: a NaN bound does not bound
    return None


def _limits(dtype: str) -> tuple[float, float]:
    if dtype.startswith(("int", "uint")):
        info = np.iinfo(dtype)
        return float(info.min), float(info.max)
    return -np.inf, np.inf


def clip(bb, inputs: list, attrs: dict, opset: int):
    from tvm import relax

    x = inputs[0]
    dtype = str(x.ty.dtype)
    lo_default, hi_default = _limits(dtype)
    if opset < 11:
        lo, hi = float(attrs.get("min", lo_default)), float(attrs.get("max", hi_default))
        lo_e = hi_e = None
    else:
        lo_e = inputs[1] if len(inputs) > 1 else None
        hi_e = inputs[2] if len(inputs) > 2 else None
        lo, hi = _bound(lo_e, lo_default), _bound(hi_e, hi_default)
    if lo is not None and hi is not None and np.isfinite([lo, hi]).all():
        return _clip_op(x, lo, hi, dtype)
    if lo is not None and not np.isfinite(lo):  # no lower bound (the IR holds no infinities)
        lo_e = None
    elif lo is not None:
        lo_e = relax.const(lo, dtype)
    if hi is not None and not np.isfinite(hi):
        hi_e = None
    elif hi is not None:
        hi_e = relax.const(hi, dtype)
    out = x  # a tensor bound: elementwise maximum / minimum (the first unnamed, in the node's layer)
    if lo_e is not None:
        out = relax.op.maximum(out, lo_e)
        if hi_e is not None:
            out = bb.emit(out)
    if hi_e is not None:
        out = relax.op.minimum(out, hi_e)
    return out


def _clip_op(x, lo: float, hi: float, dtype: str):
    from tvm import relax

    if dtype.startswith(("int", "uint")):
        return relax.op.clip(x, int(lo), int(hi))
    return relax.op.clip(x, lo, hi)


#: ONNX op type -> converter(bb, inputs, attrs, opset) -> Relax expression
CONVERTERS: dict[str, Callable[..., Any]] = {
    "Clip": clip,
}
