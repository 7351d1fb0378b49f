"""irgen's own converters for ONNX ops where TVM's importer emits something
irgen cannot use (one function per op, looked up in :data:`CONVERTERS` before
TVM's table).

``Clip``: TVM's importer emits two ``call_tir``s of TE-generated ``maximum`` /
``minimum`` kernels, opaque to layer forming and to verify's numpy reference;
here constant bounds become one ``relax.clip`` (ReLU6 stays a recognizable
op) and tensor bounds ``relax.maximum`` / ``relax.minimum``.

``Pad``: TVM's importer emits a ``call_tir`` of ``topi.nn.pad``; here it is one
``relax.nn.pad`` (modes constant, reflect, edge → replicate, wrap → circular).

``Tile`` with constant repeats: TVM's importer emits a ``call_tir`` of ``topi.tile``;
here it is one ``relax.tile`` (GPT-J's rotary tables: verify's numpy reference, and a
QDQ scheme evaluating a constant operand, can run it).

``LSTM``, ``GRU``, ``RNN`` (none in TVM 0.27): unrolled one step at a time, each step a
layer (:mod:`irgen_onnx.recurrent`); ONNX Runtime's ``DynamicQuantizeLSTM`` likewise, each step
ONNX Runtime's integer arithmetic (:mod:`irgen_onnx.dynamic_lstm`).

A converter returns ``NotImplemented`` to leave a node form it does not handle
to TVM's converter.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import dynamic_lstm, float8, nbits, recurrent


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


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}


def _const_list(expr) -> list | None:
    import tvm

    if isinstance(expr, tvm.ir.Constant):
        return expr.value.numpy().reshape(-1).tolist()
    return None


def pad(bb, inputs: list, attrs: dict, opset: int):
    from tvm import relax

    x = inputs[0]
    mode = attrs.get("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    if mode not in _PAD_MODES:
        return NotImplemented
    if opset < 11:
        pads, value = list(attrs.get("pads", [])), float(attrs.get("value", 0.0))
    else:
        pads = _const_list(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else None
        value = 0.0
        if len(inputs) > 2 and inputs[2] is not None:
            v = _const_list(inputs[2])
            if v is None or len(v) != 1:
                return NotImplemented
            value = float(v[0])
    rank = len(x.ty.shape) if getattr(x.ty, "shape", None) is not None else None
    if pads is None or rank is None or len(pads) % 2:
        return NotImplemented
    half = len(pads) // 2
    axes = list(range(half))
    if len(inputs) > 3 and inputs[3] is not None:
        axes = _const_list(inputs[3])
        if axes is None or len(axes) != half:
            return NotImplemented
    elif half != rank:
        return NotImplemented
    width = [0] * (2 * rank)
    for k, a in enumerate(axes):
        a = int(a) % rank
        width[2 * a], width[2 * a + 1] = int(pads[k]), int(pads[half + k])
    if min(width) < 0:
        return NotImplemented  # negative pads crop: TVM's converter
    if mode == "constant":
        return relax.op.nn.pad(x, width, "constant", value)
    return relax.op.nn.pad(x, width, _PAD_MODES[mode])


def tile(bb, inputs, attrs, opset):
    """Tile with constant repeats -> ``relax.tile``."""
    from tvm import relax

    reps = _const_list(inputs[1]) if len(inputs) > 1 and inputs[1] is not None else None
    if reps is None or opset < 6:
        return NotImplemented
    return relax.op.tile(inputs[0], [int(r) for r in reps])


#: ONNX op type -> converter(bb, inputs, attrs, opset) -> Relax expression
CONVERTERS: dict[str, Callable[..., Any]] = {
    "Clip": clip,
    "Pad": pad,
    "Tile": tile,
    nbits.BLOCK_OP: nbits.block_weight,  # MatMulNBits and block DequantizeLinear weights (irgen_onnx.nbits)
    "QuantizeLinear": float8.quantize,  # float8 zero points only (irgen_onnx.float8); others: TVM's
    "DequantizeLinear": float8.dequantize,
    **dict.fromkeys(("LSTM", "GRU", "RNN"), recurrent.convert),
    dynamic_lstm.OP: dynamic_lstm.convert,  # ONNX Runtime's int8 LSTM (irgen_onnx.dynamic_lstm)
}

#: the ops whose converter binds and names its own results: ``fn(bb, inputs, attrs, opset, ctx)``
#: (:class:`irgen_onnx.translate.Context`: the node, the namer, the provenance), returning the
#: node's outputs bound
WITH_CONTEXT = frozenset({"LSTM", "GRU", "RNN", dynamic_lstm.OP})
