"""ONNX QOperator-format models rewritten into their QDQ equivalent.

``onnxruntime.quantization.quantize_static(..., quant_format=QuantFormat.QOperator)``
writes integer ops (QLinearConv, QGemm, QLinearMatMul, com.microsoft's
QLinearAdd, QLinearMul, QLinearGlobalAveragePool, QLinearAveragePool,
QLinearConcat, QLinearSigmoid, QLinearLeakyRelu, QLinearSoftmax) and leaves
plain ops (MaxPool, Reshape, Flatten, Transpose, ...) on the uint8/int8
tensors between them. TVM's importer knows none of the com.microsoft ops; the
QDQ form of the same model is what the ``qdq`` scheme realizes: ONNX Runtime
fuses each DequantizeLinear -> float op -> QuantizeLinear node unit into
exactly these integer kernels.

So each QOperator node becomes DequantizeLinear on its inputs (the int32 bias
dequantized with scale ``float32(x_scale * w_scale)`` and zero point 0, as
ORT's quantizer computed it), the float op under the node's name, and
QuantizeLinear to the node's original output tensor name, so every layer's
provenance names a tensor the original model produces in ONNX Runtime. A plain
op on quantized tensors gets DequantizeLinear -> op -> QuantizeLinear with its
input's parameters (an exact round trip for ops that move or select values;
a constant operand of the quantized type, Pad's value, is dequantized with them).

One function per op type in :data:`REWRITES`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from irgen.plugin import IrgenError

from .loader import tensor_array, unique_name

_DOMAINS = ("", "ai.onnx", "com.microsoft")

#: plain ops that move or select quantized values: DQ -> op -> Q with the input's parameters is exact
_PASSTHROUGH = frozenset({
    "MaxPool", "GlobalMaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Slice",
    "Gather", "Split", "Identity", "Expand", "Tile", "DepthToSpace", "SpaceToDepth", "Resize",
    "ReduceMax", "ReduceMin", "Relu", "Pad",
})


class _Rewriter:
    def __init__(self, model):
        from onnx import numpy_helper

        self.model = model
        self.graph = model.graph
        self.inits = {t.name: t for t in self.graph.initializer}
        self.consts = {n.output[0]: n for n in self.graph.node
                       if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and n.output}
        self.nodes: list = []
        self.new_inits: list = []
        self.qparams: dict[str, tuple[str, str]] = {}  # quantized tensor -> (scale, zero point) names
        self.qconsts: dict[str, np.ndarray] = {}  # QuantizeLinear of a constant -> its dequantized value
        self.used = {o for n in self.graph.node for o in (*n.input, *n.output)} | set(self.inits)
        self.used |= {v.name for v in (*self.graph.input, *self.graph.output)}
        self._np = numpy_helper

    def quantized_constant(self, n) -> None:
        """Record the dequantized value of a QuantizeLinear of a constant (per tensor)."""
        c, scale = self.value(n.input[0]), self.value(n.input[1])
        zp = self.value(_inp(n, 2)) if _inp(n, 2) else np.zeros((), np.uint8)
        if c is None or scale is None or zp is None or scale.size != 1 or zp.size != 1 or c.dtype != np.float32:
            return
        info = np.iinfo(zp.dtype)
        s, z = np.float32(scale.reshape(())), int(zp.reshape(()))
        q = np.clip(np.rint(c / s) + z, info.min, info.max)
        self.qconsts[n.output[0]] = ((q - z) * s).astype(np.float32)

    def fresh(self, base: str) -> str:
        return unique_name(self.used, base)

    def value(self, name: str) -> np.ndarray | None:
        if name in self.inits:
            return tensor_array(self.inits[name])
        c = self.consts.get(name)
        if c is not None:
            for a in c.attribute:
                if a.name == "value" and a.HasField("t"):
                    return tensor_array(a.t)
        return None

    def const(self, base: str, array: np.ndarray) -> str:
        name = self.fresh(base)
        t = self._np.from_array(np.asarray(array), name)
        self.new_inits.append(t)
        self.inits[name] = t
        return name

    def node(self, op_type: str, inputs, outputs, name: str, attrs=(), **kw) -> None:
        from onnx import helper

        n = helper.make_node(op_type, list(inputs), list(outputs), name=self.fresh(name) if name in self.used else name, **kw)
        n.attribute.extend(attrs)
        self.nodes.append(n)

    def axis(self, scale: str, axis: int) -> dict:
        v = self.value(scale)
        return {"axis": axis} if v is not None and v.size > 1 else {}

    def dq(self, x: str, scale: str, zp: str, owner, axis: int = 0) -> str:
        """A DequantizeLinear of ``x`` for one consumer (each node unit owns its DQs)."""
        out = self.fresh(f"{x}_dq")
        self.node("DequantizeLinear", [x, scale, zp] if zp else [x, scale], [out], f"{owner.name or owner.op_type}_dq_{x}",
                  **self.axis(scale, axis))
        return out

    def dq_bias(self, b: str, x_scale: str, w_scale: str, owner, factor: float = 1.0) -> str:
        xs, ws = self.value(x_scale), self.value(w_scale)
        if xs is None or ws is None:
            raise IrgenError(f"onnx frontend: {owner.op_type} node {owner.name!r}: the bias scale needs constant "
                             f"input and weight scales")
        scale = (np.float32(xs.reshape(())) * ws.astype(np.float32).reshape(-1)).astype(np.float32)
        if factor != 1.0:
            scale = (scale * np.float32(factor)).astype(np.float32)
        if scale.size == 1:
            scale = scale.reshape(())
        s = self.const(f"{b}_scale", scale)
        z = self.const(f"{b}_zero_point", np.zeros(scale.shape, np.int32))
        return self.dq(b, s, z, owner, 0)

    def q(self, f: str, scale: str, zp: str, out: str, owner) -> None:
        self.node("QuantizeLinear", [f, scale, zp] if zp else [f, scale], [out], f"{owner.name or owner.op_type}_q")
        self.qparams[out] = (scale, zp)

    def float_op(self, op_type: str, inputs, owner, attrs=None, **kw) -> str:
        out = self.fresh(f"{owner.output[0]}_float")
        keep = [a for a in owner.attribute if attrs is None or a.name in attrs]
        self.node(op_type, inputs, [out], owner.name or f"{op_type}_{owner.output[0]}", keep, **kw)
        return out


def _inp(n, k: int) -> str:
    return n.input[k] if k < len(n.input) else ""


def _qlinear_conv(rw: _Rewriter, n) -> None:
    x = rw.dq(n.input[0], n.input[1], n.input[2], n)
    w = rw.dq(n.input[3], n.input[4], n.input[5], n, 0)
    ins = [x, w]
    if _inp(n, 8):
        ins.append(rw.dq_bias(n.input[8], n.input[1], n.input[4], n))
    rw.q(rw.float_op("Conv", ins, n), n.input[6], n.input[7], n.output[0], n)


def _qlinear_matmul(rw: _Rewriter, n) -> None:
    a = rw.dq(n.input[0], n.input[1], n.input[2], n)
    bv = rw.value(n.input[3])
    b = rw.dq(n.input[3], n.input[4], n.input[5], n, bv.ndim - 1 if bv is not None else -1)
    rw.q(rw.float_op("MatMul", [a, b], n, attrs=()), n.input[6], n.input[7], n.output[0], n)


def _qgemm(rw: _Rewriter, n) -> None:
    attrs = {a.name: a for a in n.attribute}
    trans_b = attrs["transB"].i if "transB" in attrs else 0
    alpha = attrs["alpha"].f if "alpha" in attrs else 1.0
    a = rw.dq(n.input[0], n.input[1], n.input[2], n)
    b = rw.dq(n.input[3], n.input[4], n.input[5], n, 0 if trans_b else 1)
    ins = [a, b]
    if _inp(n, 6):
        ins.append(rw.dq_bias(n.input[6], n.input[1], n.input[4], n, alpha))
    f = rw.float_op("Gemm", ins, n, attrs=("alpha", "transA", "transB"))
    if _inp(n, 7):
        rw.q(f, n.input[7], _inp(n, 8), n.output[0], n)
    else:  # no output scale: QGemm's output is float
        rw.node("Identity", [f], [n.output[0]], f"{n.name or 'QGemm'}_out")


def _binary(op_type: str) -> Callable:
    def rewrite(rw: _Rewriter, n) -> None:
        a = rw.dq(n.input[0], n.input[1], n.input[2], n)
        b = rw.dq(n.input[3], n.input[4], n.input[5], n)
        rw.q(rw.float_op(op_type, [a, b], n, attrs=()), n.input[6], _inp(n, 7), n.output[0], n)
    return rewrite


def _unary(op_type: str, attrs: tuple[str, ...] = ()) -> Callable:
    def rewrite(rw: _Rewriter, n) -> None:
        if any(a.name == "channels_last" and a.i for a in n.attribute):
            raise IrgenError(f"onnx frontend: {n.op_type} node {n.name!r} with channels_last=1 is not supported")
        x = rw.dq(n.input[0], n.input[1], n.input[2], n)
        rw.q(rw.float_op(op_type, [x], n, attrs=attrs), n.input[3], _inp(n, 4), n.output[0], n)
    return rewrite


def _qlinear_concat(rw: _Rewriter, n) -> None:
    ins = [rw.dq(n.input[k], n.input[k + 1], n.input[k + 2], n) for k in range(2, len(n.input), 3)]
    rw.q(rw.float_op("Concat", ins, n, attrs=("axis",)), n.input[0], n.input[1], n.output[0], n)


#: QOperator op type -> its rewrite into DequantizeLinear, the float op, QuantizeLinear
REWRITES: dict[str, Callable] = {
    "QLinearConv": _qlinear_conv,
    "QLinearMatMul": _qlinear_matmul,
    "QGemm": _qgemm,
    "QLinearAdd": _binary("Add"),
    "QLinearMul": _binary("Mul"),
    "QLinearGlobalAveragePool": _unary("GlobalAveragePool"),
    "QLinearAveragePool": _unary("AveragePool", ("auto_pad", "ceil_mode", "count_include_pad", "kernel_shape",
                                                 "pads", "strides", "dilations")),
    "QLinearConcat": _qlinear_concat,
    "QLinearSigmoid": _unary("Sigmoid"),
    "QLinearLeakyRelu": _unary("LeakyRelu", ("alpha",)),
    "QLinearSoftmax": _unary("Softmax", ("axis",)),
}


def _passthrough(rw: _Rewriter, n) -> None:
    """A plain op on quantized tensors: DQ -> op -> Q with its (first) quantized input's parameters."""
    params = next(rw.qparams[i] for i in n.input if i in rw.qparams)
    zp = rw.value(params[1]) if params[1] else None
    dtype = zp.dtype if zp is not None else np.dtype(np.uint8)

    def operand(i: str) -> str:
        if i in rw.qconsts and n.op_type == "Pad":  # a constant quantized at run time: its float value
            return rw.const(f"{i}_value", rw.qconsts[i])
        if i in rw.qparams:
            return rw.dq(i, *rw.qparams[i], n)
        v = rw.value(i) if i else None  # a constant of the quantized type (Pad's value): the same parameters
        scale = rw.value(params[0])
        if v is None or v.dtype != dtype or scale is None or scale.size != 1:
            return i
        z = zp.astype(np.int64) if zp is not None else 0
        return rw.const(f"{i}_value", ((v.astype(np.int64) - z) * np.float32(scale.reshape(()))).astype(np.float32))

    ins = [operand(i) for i in n.input]
    outs = [rw.fresh(f"{o}_float") if o else "" for o in n.output]
    rw.node(n.op_type, ins, outs, n.name or f"{n.op_type}_{n.output[0]}", n.attribute, domain=n.domain)
    for f, o in zip(outs, n.output):
        if o:
            rw.q(f, *params, o, n)


def is_qoperator(model) -> bool:
    return any(n.op_type in REWRITES and n.domain in _DOMAINS for n in model.graph.node)


def to_qdq(model):
    """``model`` (changed in place) with every QOperator node in its QDQ form; other models unchanged."""
    if not is_qoperator(model):
        return model
    rw = _Rewriter(model)
    for n in model.graph.node:
        rewrite = REWRITES.get(n.op_type) if n.domain in _DOMAINS else None
        if rewrite is not None:
            rewrite(rw, n)
        elif n.op_type == "QuantizeLinear" and n.domain in ("", "ai.onnx"):
            rw.nodes.append(n)
            rw.qparams[n.output[0]] = (n.input[1], _inp(n, 2))
            rw.quantized_constant(n)
        elif n.op_type in _PASSTHROUGH and n.domain in ("", "ai.onnx") and any(i in rw.qparams for i in n.input):
            _passthrough(rw, n)
        else:
            rw.nodes.append(n)
    read = {i for n in rw.nodes for i in n.input} | {o.name for o in model.graph.output}
    del model.graph.node[:]  # a constant's QuantizeLinear whose value was taken as a float constant goes
    model.graph.node.extend(n for n in rw.nodes if not (n.output and n.output[0] in rw.qconsts and n.output[0] not in read))
    model.graph.initializer.extend(rw.new_inits)
    return model
