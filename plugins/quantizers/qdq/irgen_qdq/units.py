"""Which ONNX spans ONNX Runtime fuses into an integer kernel: its QDQ selectors' rules.

ONNX Runtime (1.32, ``qdq_selectors.cc``) replaces ``DequantizeLinear -> op -> QuantizeLinear``
by an integer kernel only when the node unit's integer types agree; otherwise it runs the unit
as written, the op in float on the dequantized values, then QuantizeLinear. Quantizers that mix
types write such units: NNCF quantizes a ReLU's output to uint8 and a convolution's output
before a residual Add to int8, so the next convolution reads uint8 and writes int8 (float in
ORT) and the Add reads int8 and uint8 (float in ORT). The rules, per op kind (:data:`UNITS`):

* every data input comes from a DequantizeLinear (Conv, Gemm, MatMul, Add, Mul, Concat: one
  computed by float ops makes the unit float; the pools' float inputs are their own realizers');
* Conv, Gemm, MatMul (with a constant or an activation second operand): the input's type is
  the output's; an int8 input needs int8 weights; a Conv's float bias must be one ORT quantizes
  (:mod:`irgen_qdq.bias`: the input dequantized per tensor);
* Add, Mul (QLinearAdd/QLinearMul): both inputs' types are the output's;
* Concat (QLinearConcat): every input's type is the output's;
* AveragePool, GlobalAveragePool, Softmax: the input's type is the output's;
* a Relu or Clip between the op and its QuantizeLinear joins the unit only when the
  QuantizeLinear makes it redundant (ORT's ``IsClipMadeRedundantByQ``): a Relu when the zero
  point is the type's minimum, a Clip when its quantized bounds cover the type's range.

:func:`float_reason` says why ORT runs a span in float (None when it fuses it); the realizer
then makes it a float span (:func:`irgen_qdq.float_span.realize_float`). ORT fuses a unit whose
activation is quantized per channel all the same and then fails in the kernel (QLinearConv
takes one input scale), so such a unit is refused (:func:`check_unfused`); any other span with
a per-channel activation (:func:`per_channel`) is a float span. The ops whose
integer kernel keeps the values (MaxPool, Reshape...: a table when the parameters differ) and
the lookup tables (the float op per value) need no rule.
"""

from __future__ import annotations

import numpy as np

from irgen.plugin import IrgenError

from .common import SCHEME

#: the ops a weight reaches a Gemm/MatMul through
_WEIGHT_PATH = ("relax.permute_dims", "relax.reshape")


def _dequantized_type(qg, expr, through=()) -> str | None:
    """The integer type under the dequantize that gives ``expr`` (through the ops of ``through``),
    or None when it is no dequantize."""
    for _ in range(4):
        b = qg.producer(expr) if hasattr(expr, "name") else None
        if b is None:
            return None
        if b.op == "relax.dequantize":
            return str(b.value.args[0].ty.dtype)
        if b.op not in through:
            return None
        expr = b.value.args[0]
    return None


def _per_channel(qg, expr) -> bool:
    """``expr`` is an activation dequantized with a scale per channel."""
    b = qg.producer(expr) if hasattr(expr, "name") else None
    if b is None or b.op != "relax.dequantize" or not hasattr(b.value.args[0], "name"):
        return False
    return np.asarray(b.value.args[1].value.numpy()).size > 1


def _redundant(act, out) -> bool:
    """ORT's ``IsClipMadeRedundantByQ``: the Relu/Clip ``act`` changes nothing the quantize with
    ``out``'s parameters keeps."""
    info = np.iinfo(out.dtype)
    zp = int(out.zero_point[0])
    if act.op == "relax.nn.relu":
        return zp == int(info.min)
    scale = np.float32(out.scale[0])
    lo, hi = (np.float32(act.value.args[k].value) for k in (1, 2))
    return int(np.rint(lo / scale)) + zp <= int(info.min) and int(np.rint(hi / scale)) + zp >= int(info.max)


def _activations(s) -> str | None:
    for act in s.acts:
        if s.out.scale.size != 1 or not _redundant(act, s.out):
            return f"the {act.op.removeprefix('relax.').removeprefix('nn.')} before its quantize is not redundant"
    return None


def _same_types(s, args, what: str) -> str | None:
    """Every dequantized operand in ``args`` has the output's integer type."""
    for a in args:
        t = _dequantized_type(s.qg, a)
        if t is not None and t != s.out.dtype:
            return f"{what} reads {t} and writes {s.out.dtype}"
    return None


def _float_input(s, args) -> str | None:
    """An operand in ``args`` computed by float ops: ORT's selectors need a DequantizeLinear on each."""
    from .operands import _float_operand

    return "an input is computed in float" if any(_float_operand(s.qg, a) for a in args) else None


def _conv(s) -> str | None:
    """QLinearConv, QGemm, QLinearMatMul (ConvNodeGroupSelector, GemmNodeGroupSelector, MatMulNodeGroupSelector)."""
    x, w = s.comp.value.args[0], s.comp.value.args[1]
    tx, tw = _dequantized_type(s.qg, x), _dequantized_type(s.qg, w, _WEIGHT_PATH)
    found = _float_input(s, [x] if tw is not None else [x, w]) or _same_types(s, [x], "the input")
    if found is None and tx == "int8" and tw is not None and tw != "int8":
        found = f"an int8 input meets {tw} weights"
    return found or _float_bias(s) or _activations(s)


def _float_bias(s) -> str | None:
    """A Conv's float bias that ORT leaves float: every input of the unit must be dequantized, and
    ORT quantizes a float bias only when the input is dequantized per tensor (``WeightBiasQuantization``,
    :mod:`irgen_qdq.bias`); NNCF quantizes a depthwise convolution's input per channel."""
    from .bias import _float_bias_operand, _scales

    if s.comp.op not in ("relax.nn.conv2d", "relax.nn.conv3d") or s.bias_b is None:
        return None
    if _float_bias_operand(s.qg, s) is not None and _scales(s.qg, s) is None:
        return "its float bias stays float (the input is not dequantized per tensor)"
    return None


def _binary(s) -> str | None:
    """QLinearAdd, QLinearMul (BinaryNodeGroupSelector)."""
    args = list(s.comp.value.args)
    return _float_input(s, args) or _same_types(s, args, "an input") or _activations(s)


def _variadic(s) -> str | None:
    """QLinearConcat (VariadicNodeGroupSelector)."""
    args = list(s.comp.value.args[0].fields)
    return _float_input(s, args) or _same_types(s, args, "an input")


def _unary(s) -> str | None:
    """QLinearAveragePool, QLinearGlobalAveragePool, QLinearSoftmax, QLinearSigmoid... (UnaryNodeGroupSelector)."""
    return _same_types(s, [s.comp.value.args[0]], "the input")


#: compute op (Relax) -> the rule of the ORT selector of its node unit: the reason ORT runs it in float, or None
UNITS = {
    "relax.nn.conv2d": _conv, "relax.nn.conv3d": _conv, "relax.matmul": _conv, "relax.add": _binary, "relax.multiply": _binary,
    "relax.concat": _variadic, "relax.nn.avg_pool2d": _unary, "relax.nn.adaptive_avg_pool2d": _unary,
    "relax.mean": _unary, "relax.nn.softmax": _unary,
}


def float_reason(s) -> str | None:
    """Why ONNX Runtime runs the span ``s`` (a :class:`irgen_qdq.realize._Span` of an ONNX graph)
    in float rather than as an integer kernel, or None (see the module text)."""
    rule = UNITS.get(s.comp.op)
    if rule is None or (s.chain is not None and s.comp.op in ("relax.add", "relax.multiply")):
        return None  # (an elementwise graph on one tensor: a table, the float ops per value)
    return rule(s)


def per_channel(qg, comp, out) -> bool:
    """The span of ``comp`` reads or writes (``out``) an activation quantized per channel."""
    from tvm import relax

    args = [f for a in getattr(comp.value, "args", []) for f in (a.fields if isinstance(a, relax.Tuple) else [a])]
    return out.scale.size != 1 or any(_per_channel(qg, a) for a in args)


def check_unfused(s) -> None:
    """A span with an activation quantized per channel (:func:`per_channel`) that ORT fuses all
    the same is refused: ORT's integer kernels take one scale per activation and fail on a vector
    (measured: QLinearConv, ORT 1.32), so the source runtime cannot run the model."""
    if s.comp.op in UNITS and float_reason(s) is None:
        raise IrgenError(f"{SCHEME}: {s.b.name!r}: ONNX Runtime fuses this {s.comp.op.removeprefix('relax.')} into "
                         "an integer kernel although an activation is quantized per channel, and the kernel fails on "
                         "it (one scale per activation): the source runtime cannot run the model")
