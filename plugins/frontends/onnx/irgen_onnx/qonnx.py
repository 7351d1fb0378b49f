"""QONNX ``Quant`` nodes lowered to the QuantizeLinear/DequantizeLinear they compute.

QONNX (Brevitas' ``export_qonnx``, FINN) writes quantization as one node,
``Quant(x, scale, zeropt, bitwidth)`` with attributes ``signed``, ``narrow`` and
``rounding_mode`` (domain ``qonnx.custom_op.general``; ``finn.custom_op.general`` and
``onnx.brevitas`` in older exports), which computes in float32 (QONNX's ``int_quant``)::

    y = (clip(round(x / scale + zeropt), lo, hi) - zeropt) * scale

with ``lo..hi`` the bit width's range: signed ``-2**(b-1) (+1 when narrow) .. 2**(b-1)-1``,
unsigned ``0 .. 2**b-1 (-1 when narrow)``. No runtime irgen checks against has a kernel for it
(ONNX Runtime has none; QONNX executes it in numpy), so the model is lowered, for TVM and for
the source check alike, to the standard ops that compute the same values:

* a Quant of a constant (weights, biases): the integers computed here as QONNX computes them
  (any rounding mode, bit widths up to 32), stored as int8 or uint8 (8 bits or fewer) or int32,
  read by a DequantizeLinear with the Quant's scale and zero point;
* a Quant of an activation: QuantizeLinear -> DequantizeLinear, when its range fits int8 or
  uint8 (8 bits or fewer), it rounds half to even (``ROUND``, ``HALF_EVEN``) and its zero point
  is 0 (Brevitas' default activation quantizers); a range narrower than the type (fewer bits,
  narrow) puts an integer Clip to it between the two, as Brevitas' QCDQ export does (the qdq
  scheme folds it into the layer before: its record's ``range``). QuantizeLinear rounds
  ``x / scale`` and then adds the zero point, QONNX rounds the sum: with a zero point of 0 the
  same, otherwise not (an odd zero point rounds every tie the other way; an even one, a sum
  float32 rounds onto a tie).
* ``BipolarQuant`` (``where(x >= 0, 1, -1) * scale``): of a constant, int8 -1/+1 and a
  DequantizeLinear; of an activation, GreaterOrEqual and Where.
* ``Trunc`` (versions 1 and 2): the float32 ops QONNX computes (:meth:`_Lowering.trunc`).

Scales and zero points must be constants, per tensor or per channel (one axis). The
DequantizeLinear writes the Quant's output tensor, so the layers keep its names. Any other
Quant (an activation of more bits, other rounding, a zero point) is refused naming the node
and why.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from irgen.plugin import IrgenError

from .loader import all_nodes, q, tensor_array, unique_name

DOMAINS = ("qonnx.custom_op.general", "finn.custom_op.general", "onnx.brevitas")
#: what every doc string irgen puts on a node starts with (the loader clears them in the file)
IRGEN_MARK = "irgen:"
#: the doc string of a DequantizeLinear of weights narrower than their integer type, then "LO..HI"
#: (:func:`quant_ranges` gives the frontend's ``ImportedModel.quant_ranges``)
RANGE = "irgen: integer range "
#: the QONNX ops lowered, and the method of :class:`_Lowering` that lowers each
LOWERED = {"Quant": "lower", "IntQuant": "lower", "BipolarQuant": "bipolar", "Trunc": "trunc"}
#: QONNX's rounding modes (``resolve_rounding_mode``), on float32 values
ROUNDING = {
    "ROUND": np.round, "HALF_EVEN": np.round, "CEIL": np.ceil, "FLOOR": np.floor, "DOWN": np.fix,
    "UP": lambda v: np.sign(v) * np.ceil(np.abs(v)),
    "HALF_UP": lambda v: np.sign(v) * np.floor(np.abs(v) + np.float32(0.5)),
    "HALF_DOWN": lambda v: np.sign(v) * np.ceil(np.abs(v) - np.float32(0.5)),
}


#: Trunc's rounding modes lowered, and the ONNX op of each (QONNX's ROUND is numpy's half to even)
_TRUNC_ROUNDING = {"ROUND": "Round", "HALF_EVEN": "Round", "FLOOR": "Floor", "CEIL": "Ceil"}


def _range(bits: int, signed: bool, narrow: bool) -> tuple[int, int]:
    """QONNX's ``min_int`` and ``max_int``."""
    if signed:
        return -(2 ** (bits - 1)) + int(narrow), 2 ** (bits - 1) - 1
    return 0, 2 ** bits - 1 - int(narrow)


def _container(lo: int, hi: int):
    """The integer type a DequantizeLinear reads the range ``lo..hi`` in."""
    for dtype in (np.int8, np.uint8, np.int32):
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return dtype
    return None


class _Lowering:
    def __init__(self, model, path: Path):
        from onnx import helper

        self.model, self.path, self.g = model, path, model.graph
        self.inits = {t.name: t for t in self.g.initializer}
        self.consts = {n.output[0]: n for n in self.g.node
                       if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and len(n.output) == 1}
        self.used = {x for n in self.g.node for x in (*n.input, *n.output)} | set(self.inits)
        self.used |= {v.name for v in (*self.g.input, *self.g.output)}
        self.new_inits: list = []
        self.helper = helper

    def fail(self, node, why: str) -> IrgenError:
        return IrgenError(f"onnx frontend ({self.path.name}): QONNX {node.op_type} {q(node.name or node.output[0])}: "
                          f"{why}; irgen lowers a Quant to QuantizeLinear/DequantizeLinear only where they "
                          f"compute the same (docs/toolkits.md)")

    def constant(self, name: str):
        from .constants import _constant_node_value

        if name in self.inits:
            return np.asarray(tensor_array(self.inits[name]))
        if name in self.consts:
            return _constant_node_value(self.consts[name])
        return None

    def _axis(self, node, scale: np.ndarray, zp: np.ndarray, rank: int | None):
        """``(scale, zero point, axis)`` in DequantizeLinear's form: scalars, or vectors along one axis."""
        try:
            shape = np.broadcast_shapes(scale.shape, zp.shape)
        except ValueError:
            raise self.fail(node, f"its scale (shape {scale.shape}) and zero point (shape {zp.shape}) do not "
                                  "broadcast") from None
        big = [k for k, d in enumerate(shape) if d != 1]
        if not big:
            return scale.reshape(()), zp.reshape(()), None
        if len(big) > 1 or rank is None or len(shape) > rank:
            raise self.fail(node, f"its scale and zero point (shape {tuple(shape)}) are not per tensor nor per "
                                  "channel along one axis")
        axis = rank - len(shape) + big[0]
        return (np.broadcast_to(scale, shape).reshape(-1), np.broadcast_to(zp, shape).reshape(-1), axis)

    def params(self, node):
        """``(scale, zero point, lo, hi, rounding mode)`` of a Quant, checked."""
        attrs = {a.name: self.helper.get_attribute_value(a) for a in node.attribute}
        vals = [self.constant(x) if x else None for x in node.input[1:4]]
        if len(node.input) != 4 or any(v is None for v in vals):
            raise self.fail(node, "its scale, zero point and bit width are not constants")
        scale, zp, bits = (np.asarray(v) for v in vals)
        if any(a.dtype.kind not in "biuf" or a.size == 0 for a in (scale, zp, bits)):
            raise self.fail(node, "its scale, zero point and bit width are not numbers")
        b = float(bits.reshape(-1)[0])
        if bits.size != 1 or not np.isfinite(b) or b != int(b) or not 2 <= b <= 32:
            raise self.fail(node, f"bit width {bits.reshape(-1)[:4].tolist()} is not an integer from 2 to 32")
        scale, zp = scale.astype(np.float32), zp.astype(np.float64)
        if not np.all(np.isfinite(scale)) or not np.all(scale > 0):
            raise self.fail(node, "a scale is not finite and positive")
        if not np.all(np.isfinite(zp)) or not np.all(zp == np.round(zp)):
            raise self.fail(node, "a zero point is not an integer")
        mode = attrs.get("rounding_mode", b"ROUND")
        mode = (mode.decode(errors="replace") if isinstance(mode, bytes) else str(mode)).upper()
        if mode not in ROUNDING:
            raise self.fail(node, f"rounding mode {q(mode)} is not QONNX's")
        lo, hi = _range(int(b), bool(attrs.get("signed", 1)), bool(attrs.get("narrow", 0)))
        if zp.min() < lo or zp.max() > hi:
            raise self.fail(node, f"a zero point is outside its range {lo}..{hi}")
        return scale, zp.astype(np.float32), lo, hi, mode

    def lower(self, node) -> list:
        """The nodes that replace the Quant ``node``."""
        scale, zp, lo, hi, mode = self.params(node)
        x = self.constant(node.input[0])
        dtype = _container(lo, hi)
        if x is not None:
            if dtype is None:
                raise self.fail(node, f"its range {lo}..{hi} fits no integer type DequantizeLinear reads")
            if x.dtype != np.float32:
                raise self.fail(node, f"a constant of type {x.dtype} (float32 only)")
            try:
                if np.broadcast_shapes(x.shape, scale.shape, zp.shape) != x.shape:
                    raise ValueError
            except ValueError:
                raise self.fail(node, f"its scale (shape {scale.shape}) and zero point (shape {zp.shape}) do not "
                                      f"broadcast to the constant's shape {x.shape}") from None
            v = x / scale + zp  # QONNX's int_quant, in float32
            ints = np.clip(ROUNDING[mode](v).astype(np.float64), lo, hi).astype(dtype)
            s, z, axis = self._axis(node, scale, zp, ints.ndim)
            data = self.add_init(node.output[0] + "_int", ints)
            dq = self.dq(node, data, s, z.astype(dtype), axis, node.output[0])
            if (lo, hi) != (int(np.iinfo(dtype).min), int(np.iinfo(dtype).max)):
                dq.doc_string = f"{RANGE}{lo}..{hi}"  # a 4-bit weight in int8: its record's range
            return [dq]
        if dtype not in (np.int8, np.uint8):
            raise self.fail(node, f"an activation quantized to {lo}..{hi} (8 bits or fewer: a range within "
                                  "int8's or uint8's only)")
        if mode not in ("ROUND", "HALF_EVEN"):
            raise self.fail(node, f"an activation rounded {mode} (QuantizeLinear rounds half to even)")
        if np.any(zp != 0):
            raise self.fail(node, "an activation with a zero point other than 0 (QONNX rounds x / scale + zero "
                                  "point, QuantizeLinear rounds x / scale, then adds it: ties round apart)")
        rank = self.rank(node.input[0], scale, zp)
        s, z, axis = self._axis(node, scale, zp, rank)
        z = z.astype(dtype)
        quantized = unique_name(self.used, node.output[0] + "_quantized")
        s_name, z_name = self.add_init(quantized + "_scale", s), self.add_init(quantized + "_zero_point", z)
        qnode = self.helper.make_node("QuantizeLinear", [node.input[0], s_name, z_name], [quantized],
                                      name=unique_name(self.used, (node.name or node.output[0]) + "_QuantizeLinear"),
                                      **({} if axis is None else {"axis": axis}))
        clipped = self.narrowed(node, quantized, lo, hi, dtype)
        dq = self.helper.make_node("DequantizeLinear", [clipped[-1].output[0] if clipped else quantized, s_name,
                                                        z_name], [node.output[0]],
                                   name=unique_name(self.used, (node.name or node.output[0]) + "_DequantizeLinear"),
                                   **({} if axis is None else {"axis": axis}))
        return [qnode, *clipped, dq]

    def narrowed(self, node, quantized: str, lo: int, hi: int, dtype) -> list:
        """An integer Clip to ``lo..hi`` after the QuantizeLinear when the range is narrower than
        the type's (fewer than 8 bits, or narrow): Brevitas' QCDQ form, which the qdq scheme folds
        into the layer before it (its record's ``range``)."""
        info = np.iinfo(dtype)
        if (lo, hi) == (int(info.min), int(info.max)):
            return []
        bounds = [self.add_init(quantized + "_lo", np.asarray(lo, dtype)), self.add_init(quantized + "_hi",
                                                                                          np.asarray(hi, dtype))]
        out = unique_name(self.used, quantized + "_clipped")
        return [self.helper.make_node("Clip", [quantized, *bounds], [out],
                                      name=unique_name(self.used, (node.name or node.output[0]) + "_Clip"))]

    def bipolar(self, node) -> list:
        """BipolarQuant(x, scale) = where(x >= 0, 1, -1) * scale (QONNX's ``binary_quant``): of a
        constant, int8 weights of -1 and 1 read by a DequantizeLinear; of an activation, a
        GreaterOrEqual and a Where that pick ``scale`` or ``-scale`` (no integer kernel runs it)."""
        scale = self.constant(node.input[1]) if len(node.input) > 1 else None
        if scale is None or np.asarray(scale).dtype.kind not in "biuf":
            raise self.fail(node, "its scale is not a constant")
        scale = np.asarray(scale, np.float32)
        if not np.all(np.isfinite(scale)) or not np.all(scale > 0):
            raise self.fail(node, "a scale is not finite and positive")
        x = self.constant(node.input[0])
        if x is not None:
            ints = np.where(np.asarray(x, np.float32) >= 0, 1, -1).astype(np.int8)
            s, z, axis = self._axis(node, scale, np.zeros_like(scale), ints.ndim)
            return [self.dq(node, self.add_init(node.output[0] + "_int", ints), s, z.astype(np.int8), axis,
                            node.output[0])]
        zero = self.add_init(node.output[0] + "_zero", np.float32(0))
        pos, neg = self.add_init(node.output[0] + "_pos", scale), self.add_init(node.output[0] + "_neg", -scale)
        ge = unique_name(self.used, node.output[0] + "_nonnegative")
        base = node.name or node.output[0]
        return [self.helper.make_node("GreaterOrEqual", [node.input[0], zero], [ge],
                                      name=unique_name(self.used, base + "_GreaterOrEqual")),
                self.helper.make_node("Where", [ge, pos, neg], [node.output[0]],
                                      name=unique_name(self.used, base + "_Where"))]

    def trunc(self, node) -> list:
        """QONNX ``Trunc`` as the float32 ops QONNX computes (``trunc_v1`` with 5 inputs, ``trunc_v2``
        with 6): ``y = round(x / scale + zp) / t``, clamped to the output bit width's range (v2),
        rounded by ``rounding_mode``, then ``(y - zp') * s'``; v2: ``t = 2**round(log2(out_scale /
        scale))``, ``zp' = zp / t``, ``s' = out_scale``; v1: ``t = 2**(in_bits - out_bits)``,
        ``zp' = zp``, ``s' = scale``. Brevitas' TruncAdaptiveAvgPool2d writes it after an average."""
        attrs = {a.name: self.helper.get_attribute_value(a) for a in node.attribute}
        mode = attrs.get("rounding_mode", b"FLOOR")
        mode = (mode.decode(errors="replace") if isinstance(mode, bytes) else str(mode)).upper()
        if mode not in _TRUNC_ROUNDING:
            raise self.fail(node, f"rounding mode {q(mode)} (ROUND, HALF_EVEN, FLOOR and CEIL are lowered)")
        if len(node.input) not in (5, 6):
            raise self.fail(node, f"{len(node.input)} inputs (Trunc has 5, or 6 from its version 2)")
        vals = [self.constant(x) if x else None for x in node.input[1:]]
        needed = (0, 1, 3, 4) if len(node.input) == 6 else (0, 1, 2, 3)
        if any(vals[k] is None or np.asarray(vals[k]).dtype.kind not in "biuf" for k in needed):
            raise self.fail(node, "its scales, zero point and bit widths are not constants")
        scale, zp = np.asarray(vals[0], np.float32), np.asarray(vals[1], np.float32)
        if len(node.input) == 6:
            out_scale = np.asarray(vals[3], np.float32)
            t = (np.float32(2) ** np.round(np.log2(out_scale / scale))).astype(np.float32)
            lo, hi = _range(int(np.asarray(vals[4]).reshape(-1)[0]), bool(attrs.get("signed", 1)),
                            bool(attrs.get("narrow", 0)))
            steps = [("Div", scale), ("Add", zp), ("Round", None), ("Div", t),
                     ("Clip", (np.float32(lo), np.float32(hi))), (_TRUNC_ROUNDING[mode], None),
                     ("Sub", (zp / t).astype(np.float32)), ("Mul", out_scale)]
        else:
            bits = np.asarray(vals[2], np.float32) - np.asarray(vals[3], np.float32)
            t = (np.float32(2) ** bits).astype(np.float32)
            steps = [("Div", scale), ("Add", zp), ("Round", None), ("Div", t), (_TRUNC_ROUNDING[mode], None),
                     ("Sub", zp), ("Mul", scale)]
        return self.chain(node, steps)

    def chain(self, node, steps: list) -> list:
        """The nodes of ``steps`` ((op, constant operand(s) or None) each) from the node's input to
        its output; an Add or Sub of zeros is left out."""
        steps = [(op, c) for op, c in steps if not (op in ("Add", "Sub") and not np.any(c))]
        nodes, x, base = [], node.input[0], node.name or node.output[0]
        for k, (op, c) in enumerate(steps):
            ins = [x] + ([] if c is None else [self.add_init(f"{base}_{op}_{k}", v) for v in
                                                (c if isinstance(c, tuple) else (c,))])
            out = node.output[0] if k == len(steps) - 1 else unique_name(self.used, f"{base}_{op}_{k}_output")
            nodes.append(self.helper.make_node(op, ins, [out], name=unique_name(self.used, f"{base}_{op}_{k}")))
            x = out
        return nodes

    def rank(self, name: str, scale: np.ndarray, zp: np.ndarray) -> int | None:
        """The rank of activation ``name`` when its type says it (a per-channel Quant needs it)."""
        if max(scale.size, zp.size) == 1:
            return None
        for v in (*self.g.value_info, *self.g.input, *self.g.output):
            if v.name == name and v.type.tensor_type.HasField("shape"):
                return len(v.type.tensor_type.shape.dim)
        return len(np.broadcast_shapes(scale.shape, zp.shape))  # QONNX broadcasts against the activation

    def dq(self, node, data: str, s: np.ndarray, z: np.ndarray, axis, out: str):
        s_name = self.add_init(data + "_scale", s)
        z_name = self.add_init(data + "_zero_point", z)
        return self.helper.make_node("DequantizeLinear", [data, s_name, z_name], [out],
                                     name=unique_name(self.used, (node.name or out) + "_DequantizeLinear"),
                                     **({} if axis is None else {"axis": axis}))

    def add_init(self, base: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        name = unique_name(self.used, base)
        self.new_inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name


def _opset(model) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def lower_qonnx(model, path: Path) -> int:
    """Lower the top-level graph's QONNX ``Quant`` nodes (see the module text); returns how many."""
    from .fold import _set_nodes

    g = model.graph
    quants = [n for n in g.node if n.op_type in LOWERED and n.domain in DOMAINS]
    if not quants:
        return 0
    low = _Lowering(model, Path(path))
    if _opset(model) < 13:
        raise low.fail(quants[0], f"the model's opset {_opset(model)} has no per-axis QuantizeLinear (13 and later)")
    nodes = []
    for n in g.node:
        nodes.extend(getattr(low, LOWERED[n.op_type])(n) if n.op_type in LOWERED and n.domain in DOMAINS else [n])
    _set_nodes(g, nodes)
    read = {x for n in all_nodes(model) for x in n.input} | {o.name for o in g.output}
    operands = {x for n in quants for x in n.input}
    for t in [t for t in g.initializer if t.name in operands and t.name not in read]:  # read by Quants alone
        g.initializer.remove(t)
        for v in [v for v in g.input if v.name == t.name]:  # an initializer listed as an input too (Brevitas)
            g.input.remove(v)
    g.initializer.extend(low.new_inits)
    if not any(n.domain in DOMAINS for n in all_nodes(model)):
        kept = [o for o in model.opset_import if o.domain not in DOMAINS]
        del model.opset_import[:]
        model.opset_import.extend(kept)
    return len(quants)


def quant_ranges(model) -> dict[str, tuple[int, int]]:
    """Tensor name -> integer range of the weights the lowering stored in a wider type
    (:data:`RANGE` on their DequantizeLinear)."""
    out = {}
    for n in model.graph.node:
        if n.op_type == "DequantizeLinear" and n.doc_string.startswith(RANGE):
            lo, _, hi = n.doc_string[len(RANGE):].partition("..")
            out[n.output[0]] = (int(lo), int(hi))
    return out
