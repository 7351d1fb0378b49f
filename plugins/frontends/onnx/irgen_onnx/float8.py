"""float8 QuantizeLinear/DequantizeLinear (opset 19+, FLOAT8E4M3FN and FLOAT8E5M2 zero points).

ONNX Runtime's CPU provider has no float8 compute kernel: it quantizes ``x`` to float8 as
``cast_to_float8(x / scale)`` (round to nearest even; ``saturate=1``, the default, clamps to
the largest finite value), dequantizes ``float32(q) * scale`` and runs the ops between in float.

* A DequantizeLinear of a float8 initializer (a weight) becomes a float32 initializer of its
  values, ``float32(q) * scale`` per tensor or per axis, as ONNX Runtime computes it
  (:func:`fold_float8_weights`).
* A QuantizeLinear or DequantizeLinear with a float8 zero point is converted by
  :func:`quantize` / :func:`dequantize` into Relax ``quantize``/``dequantize`` with a float8
  ``out_dtype`` (TVM's importer refuses a float8 zero point; its own float8 quantize rounds to
  integers, so these calls are never compiled as they are: the ``qdq`` scheme realizes each
  ``quantize -> dequantize`` pair with ONNX Runtime's rounding, ``irgen_qdq.float8``).

Refused, naming the node: a non-zero float8 zero point, ``saturate=0`` (ONNX Runtime 1.32 then
mixes saturation and NaN in a way no spec describes), FLOAT8E4M3FNUZ/E5M2FNUZ.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from irgen.plugin import IrgenError

from .loader import q, tensor_array

#: ONNX float8 types irgen realizes -> TVM dtype
FLOAT8 = {17: "float8_e4m3fn", 19: "float8_e5m2"}  # TensorProto.FLOAT8E4M3FN, FLOAT8E5M2
_UNSUPPORTED = {18: "FLOAT8E4M3FNUZ", 20: "FLOAT8E5M2FNUZ"}


def _axis(node, default: int = 1) -> int:
    return next((int(a.i) for a in node.attribute if a.name == "axis"), default)


def fold_float8_weights(model, path) -> int:
    """Every DequantizeLinear of a float8 initializer as a float32 initializer (module text)."""
    from onnx import numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    produced = {o for n in g.node for o in n.output}
    keep, folded = [], []
    for n in g.node:
        t = inits.get(n.input[0]) if n.op_type == "DequantizeLinear" and n.input else None
        if t is None or n.input[0] in produced or t.data_type not in (*FLOAT8, *_UNSUPPORTED):
            keep.append(n)
            continue
        check_node(n, path, t.data_type, inits)
        w = tensor_array(t).astype(np.float32)
        s = tensor_array(inits[n.input[1]]) if n.input[1] in inits else None
        if s is None or s.dtype != np.float32 or any(a.name == "block_size" for a in n.attribute):
            raise IrgenError(f"onnx frontend ({path.name}): DequantizeLinear {q(n.name)} of a float8 weight needs a "
                             f"float32 initializer scale per tensor or per axis")
        if s.size > 1:
            shape = [1] * w.ndim
            shape[_axis(n) % w.ndim] = s.size
            s = s.reshape(shape)
        folded.append(numpy_helper.from_array((w * s).astype(np.float32), n.output[0]))
    if not folded:
        return 0
    del g.node[:]
    g.node.extend(keep)
    read = {i for n in g.node for i in n.input}
    for t in [t for t in g.initializer if t.data_type in FLOAT8 and t.name not in read]:
        g.initializer.remove(t)
    g.initializer.extend(folded)
    return len(folded)


def check_node(n, path, dtype: int, inits: dict) -> None:
    """Refuse a float8 Q/DQ node irgen does not realize (module text)."""
    where = f"onnx frontend ({path.name}): {n.op_type} {q(n.name)}"
    if dtype in _UNSUPPORTED:
        raise IrgenError(f"{where}: {_UNSUPPORTED[dtype]} is not supported (float8 E4M3FN and E5M2 are)")
    if n.op_type == "QuantizeLinear" and any(a.name == "saturate" and a.i == 0 for a in n.attribute):
        raise IrgenError(f"{where}: saturate=0 is not supported (ONNX Runtime's float8 overflow then is neither "
                         f"the spec's NaN/inf nor a saturation); use the default saturate=1")
    z = inits.get(n.input[2]) if len(n.input) > 2 else None
    if z is not None and np.any(tensor_array(z).astype(np.float32) != 0):
        raise IrgenError(f"{where}: a non-zero float8 zero point is not supported")


def check_float8_nodes(model, path) -> None:
    """Refuse the float8 Q/DQ nodes irgen does not realize, before import (names the node)."""
    inits = {t.name: t for t in model.graph.initializer}
    for n in model.graph.node:
        out_type = next((int(a.i) for a in n.attribute if a.name == "output_dtype"), 0)
        if n.op_type == "QuantizeLinear" and out_type in (*FLOAT8, *_UNSUPPORTED) \
                and not (len(n.input) > 2 and n.input[2]):
            raise IrgenError(f"onnx frontend ({path.name}): QuantizeLinear {q(n.name)}: a float8 output_dtype "
                             f"without a zero point is not supported (give a float8 zero point of 0)")
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") and len(n.input) > 2 and n.input[2] in inits \
                and inits[n.input[2]].data_type in (*FLOAT8, *_UNSUPPORTED):
            check_node(n, path, inits[n.input[2]].data_type, inits)


def _float8_zero_point(inputs: list) -> str | None:
    """The TVM float8 dtype of a Q/DQ node's zero point, or None."""
    z = inputs[2] if len(inputs) > 2 else None
    dtype = str(getattr(getattr(z, "ty", None), "dtype", ""))
    return dtype if dtype in FLOAT8.values() else None


def _scale_axis(inputs: list, attrs: dict[str, Any]) -> tuple[Any, int]:
    from tvm import relax

    x, scale = inputs[0], inputs[1]
    rank = len(x.ty.shape.values) if getattr(x.ty, "shape", None) is not None else 1
    axis = int(attrs.get("axis", 1)) % max(rank, 1) if scale.ty.shape is not None and len(scale.ty.shape.values) else 0
    return relax.const(np.float16(0)), axis


def quantize(bb, inputs: list, attrs: dict[str, Any], opset: int):
    """A float8 QuantizeLinear as Relax ``quantize`` to the float8 dtype (module text), else NotImplemented."""
    from tvm import relax

    dtype = _float8_zero_point(inputs)
    if dtype is None:
        return NotImplemented
    zero, axis = _scale_axis(inputs, attrs)
    return relax.op.quantize(inputs[0], inputs[1], zero, axis=axis, out_dtype=dtype)


def dequantize(bb, inputs: list, attrs: dict[str, Any], opset: int):
    """A float8 DequantizeLinear as Relax ``dequantize`` to float32 (module text), else NotImplemented."""
    from tvm import relax

    if _float8_zero_point(inputs) is None:
        return NotImplemented
    zero, axis = _scale_axis(inputs, attrs)
    return relax.op.dequantize(inputs[0], inputs[1], zero, axis=axis, out_dtype="float32")
