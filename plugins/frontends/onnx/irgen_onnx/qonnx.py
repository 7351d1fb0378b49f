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
* a Quant of an activation: QuantizeLinear -> DequantizeLinear, when its range is int8's or
  uint8's (8 bits, not narrow), it rounds half to even (``ROUND``, ``HALF_EVEN``) and its zero
  point is 0 (Brevitas' default activation quantizers). QuantizeLinear rounds ``x / scale`` and
  then adds the zero point, QONNX rounds the sum: with a zero point of 0 the same, otherwise not
  (an odd zero point rounds every tie the other way; an even one, a sum float32 rounds onto a tie).

Scales and zero points must be constants, per tensor or per channel (one axis). The
DequantizeLinear writes the Quant's output tensor, so the layers keep its names. Any other
Quant (an activation of another bit width, narrow range or rounding) is refused naming the node
and why; ``BipolarQuant`` and ``Trunc`` stay unsupported ops.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from irgen.plugin import IrgenError

from .loader import all_nodes, q, tensor_array, unique_name

DOMAINS = ("qonnx.custom_op.general", "finn.custom_op.general", "onnx.brevitas")
#: QONNX's rounding modes (``resolve_rounding_mode``), on float32 values
ROUNDING = {
    "ROUND": np.round, "HALF_EVEN": np.round, "CEIL": np.ceil, "FLOOR": np.floor, "DOWN": np.fix,
    "UP": lambda v: np.sign(v) * np.ceil(np.abs(v)),
    "HALF_UP": lambda v: np.sign(v) * np.floor(np.abs(v) + np.float32(0.5)),
    "HALF_DOWN": lambda v: np.sign(v) * np.ceil(np.abs(v) - np.float32(0.5)),
}


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
            return [self.dq(node, data, s, z.astype(dtype), axis, node.output[0])]
        if (lo, hi) not in ((-128, 127), (0, 255)):
            raise self.fail(node, f"an activation quantized to {lo}..{hi} (8 bits, not narrow: int8's or uint8's "
                                  "range only)")
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
        dq = self.helper.make_node("DequantizeLinear", [quantized, s_name, z_name], [node.output[0]],
                                   name=unique_name(self.used, (node.name or node.output[0]) + "_DequantizeLinear"),
                                   **({} if axis is None else {"axis": axis}))
        return [qnode, dq]

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
    quants = [n for n in g.node if n.op_type == "Quant" and n.domain in DOMAINS]
    if not quants:
        return 0
    low = _Lowering(model, Path(path))
    if _opset(model) < 13:
        raise low.fail(quants[0], f"the model's opset {_opset(model)} has no per-axis QuantizeLinear (13 and later)")
    nodes = []
    for n in g.node:
        nodes.extend(low.lower(n) if n.op_type == "Quant" and n.domain in DOMAINS else [n])
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
