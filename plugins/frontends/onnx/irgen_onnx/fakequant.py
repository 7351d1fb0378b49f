"""OpenVINO ``FakeQuantize`` nodes lowered to the QuantizeLinear/DequantizeLinear they compute.

NNCF's torch backend exported to ONNX without ``nncf.strip`` (and ``nncf.strip`` where it
leaves a quantizer two inputs of a Concat share) writes each quantizer as OpenVINO's
``FakeQuantize(x, input_low, input_high, output_low, output_high)`` with attribute ``levels``
(domain ``org.openvinotoolkit``), which OpenVINO defines as::

    x <= min(input_low, input_high): output_low
    x >  max(input_low, input_high): output_high
    otherwise: round((x - input_low) / (input_high - input_low) * (levels - 1))
               / (levels - 1) * (output_high - output_low) + output_low

NNCF writes ``levels=256`` on activations and ``levels=255`` (symmetric, narrow range) on
weights, the four ranges as constants, input ranges equal to output ranges. Such a node is the
uniform quantizer of scale ``s = (input_high - input_low) / (levels - 1)`` and zero point
``z = -input_low / s``; when ``z`` is an integer (within :data:`ZERO_POINT_TOLERANCE` of one:
NNCF's float32 ranges give zero points such as 127.00001) it is lowered:

* a FakeQuantize of a constant (weights): its integers ``q`` (``0..levels-1``) computed here as
  OpenVINO's reference computes them, in float32 and rounding half to even, stored as int8
  ``q - levels // 2`` (so 255 levels are int8's narrow range -127..127, 256 levels all of int8)
  and read by a DequantizeLinear of scale ``s`` and zero point ``z - levels // 2``;
* a FakeQuantize of an activation: QuantizeLinear -> DequantizeLinear of scale ``s``, int8 with
  zero point 0 when ``z`` is ``levels // 2`` (a signed range), else uint8 with zero point ``z``;
  QuantizeLinear's saturation to 0..255 (-128..127) is FakeQuantize's clamp to its input range.
  Fewer than 256 levels (255 signed: -127..127; 16 unsigned: 0..15) put an integer Clip to the
  levels between the two (``_Lowering.narrowed``, the form Brevitas' QCDQ export writes, which the
  ``qdq`` scheme folds into the layer before it where that layer clamps anyway).

Ranges per tensor or per channel (one axis). The DequantizeLinear writes the FakeQuantize's
output tensor, so the layers keep its names. Any other FakeQuantize (input ranges other than
the output ranges, ranges that are not constants, a zero point that is not an integer,
``levels`` outside 2..256) is refused naming the node and why. OpenVINO runs the original nodes for the source
check (:mod:`.openvino_runner`); ONNX Runtime has no kernel for them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .loader import all_nodes, q
from .qonnx import _Lowering, _opset

DOMAINS = ("org.openvinotoolkit",)
#: how far (in steps of the scale) ``-input_low / scale`` may be from an integer zero point
ZERO_POINT_TOLERANCE = 1e-3


def is_fakequantize(node) -> bool:
    return node.op_type == "FakeQuantize" and node.domain in DOMAINS


class _FakeQuantLowering(_Lowering):
    def __init__(self, model, path: Path):
        super().__init__(model, path)
        #: each lowered activation's QuantizeLinear output -> (the FakeQuantize's output, scale, zero point, axis)
        self.quantizers: dict[str, tuple] = {}
        self.identities = {n.output[0]: n.input[0] for n in self.g.node
                           if n.op_type == "Identity" and n.domain in ("", "ai.onnx") and len(n.input) == 1}

    def fail(self, node, why: str):
        from irgen.plugin import IrgenError

        return IrgenError(f"onnx frontend ({self.path.name}): OpenVINO FakeQuantize {q(node.name or node.output[0])}: "
                          f"{why}; irgen lowers a FakeQuantize to QuantizeLinear/DequantizeLinear only where they "
                          f"compute the same (docs/toolkits.md)")

    def constant(self, name: str):
        seen = 0
        while name in self.identities and seen < 64:  # Identity of a constant (a range two quantizers share)
            name, seen = self.identities[name], seen + 1
        return super().constant(name)

    def params(self, node):
        """``(levels, input_low, scale, integer zero point)``, broadcast to one shape, checked."""
        from onnx import helper

        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        levels = attrs.get("levels")
        if not isinstance(levels, int) or not 2 <= levels <= 256:
            raise self.fail(node, f"levels {levels!r:.40} is not an integer from 2 to 256")
        vals = [self.constant(x) if x else None for x in node.input[1:5]]
        if len(node.input) != 5 or any(v is None for v in vals):
            raise self.fail(node, "its input and output ranges are not constants")
        if any(np.asarray(v).dtype.kind not in "biuf" or np.asarray(v).size == 0 for v in vals):
            raise self.fail(node, "its ranges are not numbers")
        try:
            il, ih, ol, oh = np.broadcast_arrays(*(np.asarray(v, np.float32) for v in vals))
        except ValueError:
            raise self.fail(node, f"its ranges' shapes {[np.shape(v) for v in vals]} do not broadcast") from None
        if not (np.array_equal(il, ol) and np.array_equal(ih, oh)):
            raise self.fail(node, "its output range differs from its input range (a requantization, not a "
                                  "quantizer QuantizeLinear/DequantizeLinear compute)")
        if not (np.all(np.isfinite(il)) and np.all(np.isfinite(ih)) and np.all(ih > il)):
            raise self.fail(node, "an input range is not finite with input_high above input_low")
        scale = ((ih - il) / np.float32(levels - 1)).astype(np.float32)
        zp = -il.astype(np.float64) / scale.astype(np.float64)
        zi = np.round(zp)
        if np.any(np.abs(zp - zi) > ZERO_POINT_TOLERANCE) or zi.min() < 0 or zi.max() > levels - 1:
            k = int(np.argmax(np.abs(zp - zi)))
            lo, hi = float(il.reshape(-1)[k]), float(ih.reshape(-1)[k])
            raise self.fail(node, f"its zero point -input_low / scale = {zp.reshape(-1)[k]:.6g} is not an integer "
                                  f"of 0..{levels - 1} (range {lo:.6g}..{hi:.6g}, {levels} levels)")
        return levels, il, ih, scale, zi.astype(np.int64)

    def lower(self, node) -> list:
        """The nodes that replace the FakeQuantize ``node``."""
        levels, il, ih, scale, zp = self.params(node)
        x = self.constant(node.input[0])
        if x is not None:
            return [self.lower_constant(node, np.asarray(x), levels, il, ih, scale, zp)]
        offset = levels // 2
        signed = bool(np.all(zp == offset))  # symmetric: int8 with zero point 0
        z = np.zeros(zp.shape, np.int8) if signed else zp.astype(np.uint8)
        lo, hi = (-offset, levels - 1 - offset) if signed else (0, levels - 1)
        if (lo, hi) not in ((-128, 127), (0, 255)) and not hasattr(self, "narrowed"):
            raise self.fail(node, f"an activation quantized to {levels} levels (256 only: QuantizeLinear saturates "
                                  f"to all of int8's or uint8's range, FakeQuantize clamps to its {levels} levels)")
        rank = self.rank(node.input[0], scale, z)
        s, z, axis = self._axis(node, scale, z, rank)
        return self.qdq(node, s, z, axis, lo, hi)

    def lower_constant(self, node, x: np.ndarray, levels: int, il, ih, scale, zp):
        """A DequantizeLinear of the integers OpenVINO's FakeQuantize computes for the constant ``x``."""
        if x.dtype != np.float32:
            raise self.fail(node, f"a constant of type {x.dtype} (float32 only)")
        try:
            if np.broadcast_shapes(x.shape, il.shape) != x.shape:
                raise ValueError
        except ValueError:
            raise self.fail(node, f"its ranges (shape {il.shape}) do not broadcast to the constant's shape "
                                  f"{x.shape}") from None
        with np.errstate(invalid="ignore", divide="ignore"):
            v = np.round((x - il) / (ih - il) * np.float32(levels - 1))  # OpenVINO's reference, float32
        ints = np.where(x <= il, 0, np.where(x > ih, levels - 1, v))
        offset = levels // 2
        data = self.add_init(node.output[0] + "_int", (ints - offset).astype(np.int8))
        s, z, axis = self._axis(node, scale, (zp - offset).astype(np.int8), x.ndim)
        return self.dq(node, data, s, z, axis, node.output[0])

    def qdq(self, node, s, z, axis, lo: int, hi: int) -> list:
        """QuantizeLinear -> (an integer Clip to ``lo..hi`` when narrower than the type: fewer than
        256 levels, :meth:`narrowed`) -> DequantizeLinear, writing the FakeQuantize's output."""
        from .loader import unique_name

        quantized = unique_name(self.used, node.output[0] + "_quantized")
        s_name, z_name = self.add_init(quantized + "_scale", s), self.add_init(quantized + "_zero_point", z)
        kw = {} if axis is None else {"axis": axis}
        base = node.name or node.output[0]
        clipped = self.narrowed(node, quantized, lo, hi, z.dtype.type) if (lo, hi) not in ((-128, 127), (0, 255)) \
            else []
        for name in (quantized, *(c.output[0] for c in clipped)):
            self.quantizers[name] = (node.output[0], s, z, axis)
        return [self.helper.make_node("QuantizeLinear", [node.input[0], s_name, z_name], [quantized],
                                      name=unique_name(self.used, base + "_QuantizeLinear"), **kw),
                *clipped,
                self.helper.make_node("DequantizeLinear", [clipped[-1].output[0] if clipped else quantized, s_name,
                                                          z_name], [node.output[0]],
                                      name=unique_name(self.used, base + "_DequantizeLinear"), **kw)]


def lower_fakequantize(model, path: Path, quantizers: dict | None = None) -> int:
    """Lower the top-level graph's OpenVINO ``FakeQuantize`` nodes (see the module text); returns how many.
    ``quantizers``: filled with each activation's QuantizeLinear output -> (the FakeQuantize output it
    replaces, scale, zero point, axis): how the source check finds those integers in OpenVINO's float values."""
    from .fold import _set_nodes

    g = model.graph
    fqs = [n for n in g.node if is_fakequantize(n)]
    if not fqs:
        return 0
    low = _FakeQuantLowering(model, Path(path))
    if _opset(model) < 13:
        raise low.fail(fqs[0], f"the model's opset {_opset(model)} has no per-axis QuantizeLinear (13 and later)")
    nodes = []
    for n in g.node:
        nodes.extend(low.lower(n) if is_fakequantize(n) else [n])
    _set_nodes(g, nodes)
    if quantizers is not None:
        quantizers.update(low.quantizers)
    _drop_unread(model, {x for n in fqs for x in n.input})
    g.initializer.extend(low.new_inits)
    if not any(n.domain in DOMAINS for n in all_nodes(model)):
        kept = [o for o in model.opset_import if o.domain not in DOMAINS]
        del model.opset_import[:]
        model.opset_import.extend(kept)
    return len(fqs)


def _drop_unread(model, operands: set[str]) -> None:
    """The initializers, Constant and Identity nodes that only the lowered FakeQuantizes read, removed."""
    g = model.graph
    outputs = {o.name for o in g.output}
    while True:
        read = {x for n in all_nodes(model) for x in n.input} | outputs
        dead = [n for n in g.node if n.op_type in ("Constant", "Identity") and n.domain in ("", "ai.onnx")
                and len(n.output) == 1 and n.output[0] in operands and n.output[0] not in read]
        if not dead:
            break
        for n in dead:
            operands.update(n.input)
            g.node.remove(n)
    read = {x for n in all_nodes(model) for x in n.input} | outputs
    for t in [t for t in g.initializer if t.name in operands and t.name not in read]:
        g.initializer.remove(t)
        for v in [v for v in g.input if v.name == t.name]:
            g.input.remove(v)
