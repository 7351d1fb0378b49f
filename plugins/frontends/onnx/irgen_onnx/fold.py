"""Shape computations folded to constants before TVM's importer sees the graph.

Exporters (torch's TorchScript exporter above all) write the sizes a model
computes from its input shape as ONNX graph arithmetic: ``Shape`` → ``Gather``
→ ``Sub`` → ``Mod`` → ``Concat`` → ``ConstantOfShape`` → ``Reshape`` → ``Pad``
(Swin's window padding, ``F.pad(x, (0, (w - W % w) % w))``). The input shapes
are fixed when irgen imports, so all of it is constant; TVM's importer folds
only part of it and then refuses ("Reshape expects the input tensor to have
known shape"). Here every node whose value follows from the static shapes
(a ``Shape``/``Size`` of a tensor whose shape ONNX shape inference knows, and
any shape-computation op all of whose inputs are such values or constants) is
evaluated with ONNX's reference evaluator and replaced by a ``Constant`` node
with the same name and output, so provenance keeps the source names. Only
small integer/shape-sized values are folded (at most :data:`MAX_ELEMENTS`
elements each); the model's float data flow is left to TVM.

A quantizer may quantize that arithmetic too: ONNX Runtime's ``quantize_static``
puts a ``QuantizeLinear``/``DequantizeLinear`` pair after every float node it
calibrated, the size computations of TF-style "same" padding included (timm's
``tf_efficientnet_lite0``: ``Unsqueeze`` → Q → DQ → ``Concat`` → Q → DQ → ``Cast``
→ ``Pad``). Such a pair is folded too, as the reference evaluator computes it, but
only where every use of its value ends in a size operand (:func:`_size_only`):
a ``DequantizeLinear`` of a weight, or of a constant that meets the activations
(``x * DQ(Q(0.5))``), stays for the quantization scheme.

The erf form of GELU, which exporters write as five nodes (Div, Erf, Add, Mul,
Mul), becomes one ``Gelu`` node (:func:`fuse_erf_gelu`): one layer, ``relax.nn.gelu``.

Two rewrites put what ``quantize_static`` writes around transformers into the form the QDQ
scheme realizes, with ONNX Runtime's values: a shared weight requantized after the exporter's
``Identity`` becomes an integer initializer (:func:`fold_requantized_weights`), and an input
moved or cast to its own type before its first QuantizeLinear is quantized first
(:func:`quantize_inputs_first`; the nodes irgen adds carry :data:`INVENTED`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from irgen.plugin import quantize_linear

from .loader import tensor_array

#: the largest value (elements) folded
MAX_ELEMENTS = 1 << 12
#: ops that compute shapes and sizes (evaluated when all their inputs are known)
_SHAPE_OPS = frozenset({
    "Shape", "Size", "Gather", "Unsqueeze", "Squeeze", "Concat", "Cast", "Slice", "Add", "Sub", "Mul", "Div",
    "Mod", "Floor", "Ceil", "Equal", "Where", "Not", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And",
    "Or", "Reshape", "ConstantOfShape", "Range", "Expand", "ReduceProd", "ReduceSum", "ReduceMax", "ReduceMin",
    "Min", "Max", "Abs", "Neg", "Identity", "Flatten", "Tile", "Sign", "Clip", "Transpose", "Split",
})


#: the operands of an op that are sizes, axes or a pad value (a constant for TVM's importer)
_SIZE_OPERANDS: dict[str, frozenset[int]] = {
    "Pad": frozenset({1, 2, 3}), "Reshape": frozenset({1}), "Slice": frozenset({1, 2, 3, 4}),
    "Resize": frozenset({1, 2, 3}), "Upsample": frozenset({1}), "Expand": frozenset({1}), "Tile": frozenset({1}),
    "ConstantOfShape": frozenset({0}), "Unsqueeze": frozenset({1}), "Squeeze": frozenset({1}),
    "Split": frozenset({1}), "TopK": frozenset({1}), "OneHot": frozenset({1}), "Range": frozenset({0, 1, 2}),
    "ReduceSum": frozenset({1}), "ReduceMean": frozenset({1}), "ReduceMax": frozenset({1}),
    "ReduceMin": frozenset({1}), "ReduceProd": frozenset({1}),
}
_QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})


def _size_only(model) -> set[int]:
    """The indices of the nodes whose every output is used only as a size operand
    (:data:`_SIZE_OPERANDS`) or by other such nodes of :data:`_SHAPE_OPS` or Q/DQ:
    the nodes whose values matter only as sizes (or not at all: a value left unused
    once its ``Shape`` was folded). A graph output is not. (The
    largest such set: every candidate starts in it and leaves when a use of its
    value does not qualify, which may disqualify its producers in turn; quantizers
    write unsorted graphs, so no node order is assumed.)"""
    nodes = model.graph.node
    producer: dict[str, int] = {}
    uses: dict[str, list[tuple[int, int]]] = {}
    for i, node in enumerate(nodes):
        for name in node.output:
            if name:
                producer[name] = i
        for k, name in enumerate(node.input):
            if name:
                uses.setdefault(name, []).append((i, k))
    graph_outputs = {o.name for o in model.graph.output}
    size_only = {i for i, n in enumerate(nodes) if n.op_type in _SHAPE_OPS or n.op_type in _QDQ_OPS}

    def qualifies(i: int) -> bool:
        outs = [o for o in nodes[i].output if o]
        return bool(outs) and all(
            o not in graph_outputs and
            all(k in _SIZE_OPERANDS.get(nodes[j].op_type, ()) or j in size_only for j, k in uses.get(o, ()))
            for o in outs)

    work = list(size_only)
    while work:
        i = work.pop()
        if i in size_only and not qualifies(i):
            size_only.discard(i)
            work.extend(producer[x] for x in nodes[i].input if x in producer and producer[x] in size_only)
    return size_only


def _static_shapes(inferred, model, specs) -> dict[str, list[int]]:
    from .checks import _static

    shapes: dict[str, list[int]] = {s.name: [int(d) for d in s.shape] for s in specs}
    if inferred is not None:
        g = inferred.graph
        for vi in (*g.value_info, *g.output, *g.input):
            st = _static(vi)
            if st is not None:
                shapes.setdefault(vi.name, st[0])
    for t in model.graph.initializer:
        shapes.setdefault(t.name, [int(d) for d in t.dims])
    return shapes


def _small(arr: np.ndarray) -> bool:
    return arr.size <= MAX_ELEMENTS


def _bounded(node, vals: list) -> bool:
    """Ops whose output size is set by an input value: evaluate only when that stays small."""
    op = node.op_type
    try:
        if op == "ConstantOfShape":
            return math.prod(int(v) for v in vals[0].reshape(-1)) <= MAX_ELEMENTS
        if op == "Expand":
            shape = np.broadcast_shapes(vals[0].shape, tuple(int(v) for v in vals[1].reshape(-1)))
            return math.prod(shape) <= MAX_ELEMENTS
        if op == "Tile":
            return vals[0].size * math.prod(int(v) for v in vals[1].reshape(-1)) <= MAX_ELEMENTS
        if op == "Range":
            start, stop, delta = (float(v.reshape(-1)[0]) for v in vals)
            return delta != 0 and max(math.ceil((stop - start) / delta), 0) <= MAX_ELEMENTS
    except Exception:  # noqa: BLE001  malformed: leave it to the importer's own errors
        return False
    return True


def _evaluate(node, vals: list, opsets) -> list | None:
    import onnx
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    ins = [helper.make_tensor_value_info(f"i{k}", helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
           for k, v in enumerate(vals)]
    n = onnx.NodeProto()
    n.CopyFrom(node)
    del n.input[:]
    names = []
    k = 0
    for name in node.input:
        if name:
            names.append(f"i{k}")
            k += 1
        else:
            names.append("")
    n.input.extend(names)
    del n.output[:]
    n.output.extend([f"o{j}" for j in range(len(node.output))])
    outs = [helper.make_empty_tensor_value_info(f"o{j}") for j in range(len(node.output))]
    g = helper.make_graph([n], "fold", ins, outs)
    m = helper.make_model(g, opset_imports=list(opsets))
    try:
        res = ReferenceEvaluator(m).run(None, {f"i{j}": v for j, v in enumerate(vals)})
    except Exception:  # noqa: BLE001  the reference evaluator cannot: leave the node to TVM
        return None
    out = [np.asarray(r) for r in res]
    return out if all(_small(r) for r in out) else None


def _qdq(node, vals: list) -> list | None:
    """A per-tensor QuantizeLinear/DequantizeLinear of a constant, as ONNX Runtime computes
    it in float32 (``rint(x / scale) + zero_point``, saturated; ``(q - zero_point) * scale``).
    The reference evaluator has no kernel before opset 19. Per-axis or other types: None."""
    x, scale = vals[0], vals[1]
    zp = vals[2] if len(vals) > 2 else np.zeros((), np.uint8)
    if scale.size != 1 or zp.size != 1 or scale.dtype != np.float32 or len(node.output) != 1:
        return None
    scale, zpv = np.float32(scale.reshape(())), int(zp.reshape(()))
    if node.op_type == "DequantizeLinear":
        if x.dtype.kind not in "iu":
            return None
        return [((x.astype(np.int64) - zpv).astype(np.float32) * scale).astype(np.float32)]
    if x.dtype != np.float32 or zp.dtype not in (np.dtype(t) for t in ("int8", "uint8", "int16", "uint16")):
        return None  # 16-bit too: quantize_static's activation_type=QInt16 quantizes a pad value so
    if not np.isfinite(x / scale).all():  # a size operand never is; leave such a node to the run
        return None
    return [quantize_linear(x, scale, zpv, str(zp.dtype))]


def fold_shape_computations(model, specs, max_rounds: int = 32) -> int:
    """Replace, in ``model`` (top-level graph), every node computable from the fixed input
    shapes by a ``Constant`` of its value; returns how many nodes were replaced. Shape
    inference stops at a shape it cannot compute (a Reshape to a computed shape), so this
    repeats (infer, fold) until nothing more folds."""
    total = 0
    for _ in range(max_rounds):
        n = _fold_once(model, specs)
        total += n
        if n == 0:
            break
    return total


def _topological(nodes) -> list[int]:
    """The indices of ``nodes`` with every producer before its users (quantizers append their
    Q/DQ nodes out of order); a node in a cycle or fed by a missing name keeps its place at the end."""
    producer = {name: i for i, n in enumerate(nodes) for name in n.output if name}
    waiting = [sum(1 for x in set(n.input) if x in producer) for n in nodes]
    users: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        for x in set(n.input):
            if x in producer:
                users.setdefault(producer[x], []).append(i)
    ready = [i for i in range(len(nodes)) if waiting[i] == 0]
    ready.reverse()
    order: list[int] = []
    while ready:
        i = ready.pop()
        order.append(i)
        for j in users.get(i, ()):
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)
    if len(order) < len(nodes):
        seen = set(order)
        order += [i for i in range(len(nodes)) if i not in seen]
    return order


def _fold_once(model, specs) -> int:
    from onnx import helper, numpy_helper

    from .checks import infer, skeleton

    inferred = infer(skeleton(model), specs)
    shapes = _static_shapes(inferred, model, specs)
    consts: dict[str, np.ndarray] = {}
    for t in model.graph.initializer:
        if math.prod(int(d) for d in t.dims) <= MAX_ELEMENTS:
            try:
                consts[t.name] = tensor_array(t)
            except Exception:  # noqa: BLE001
                pass
    replaced: dict[int, list[Any]] = {}
    size_only = None
    for i in _topological(model.graph.node):
        node = model.graph.node[i]
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value" and a.HasField("t") and math.prod(int(d) for d in a.t.dims) <= MAX_ELEMENTS:
                    try:
                        consts[node.output[0]] = tensor_array(a.t)
                    except Exception:  # noqa: BLE001
                        pass
            continue
        if node.op_type in _QDQ_OPS:
            if node.input and node.input[0] in consts:
                size_only = _size_only(model) if size_only is None else size_only
            if not node.input or node.input[0] not in consts or i not in size_only:
                continue
        elif node.op_type not in _SHAPE_OPS or any(a.type in (5, 10) for a in node.attribute):  # no subgraphs
            continue
        if node.op_type in ("Shape", "Size"):
            if not node.input or node.input[0] not in shapes:
                continue
            dims = np.asarray(shapes[node.input[0]], np.int64)
            if node.op_type == "Size":
                values = [np.asarray(math.prod(int(d) for d in dims), np.int64)]
            else:
                attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
                values = [dims[slice(attrs.get("start", 0), attrs.get("end"))]]
        else:
            ins = [x for x in node.input if x]
            if not ins or not all(x in consts for x in ins):
                continue
            vals = [consts[x] for x in ins]
            if not _bounded(node, vals):
                continue
            values = _qdq(node, vals) if node.op_type in _QDQ_OPS else _evaluate(node, vals, model.opset_import)
            if values is None:
                continue
        for name, v in zip(node.output, values):
            consts[name] = v
        replaced[i] = [helper.make_node("Constant", [], [name], name=node.name if len(node.output) == 1 else
                                        f"{node.name}:{k}", value=numpy_helper.from_array(np.asarray(v), name))
                       for k, (name, v) in enumerate(zip(node.output, values)) if name]
    if not replaced:
        return 0
    nodes = []
    for i, node in enumerate(model.graph.node):
        nodes.extend(replaced.get(i, [node]))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return len(replaced)


# ------------------------------------------------------------------ GELU as one node

_SQRT2 = math.sqrt(2.0)


def _scalar_const(consts: dict, name: str) -> float | None:
    v = consts.get(name)
    if v is None or v.size != 1 or v.dtype.kind != "f":
        return None
    return float(v.reshape(-1)[0])


def fuse_erf_gelu(model) -> int:
    """The erf form of GELU as exporters write it, ``x * 0.5 * (1 + erf(x / sqrt(2)))`` (Div or Mul
    by 1/sqrt(2), Erf, Add 1, two Muls with x and 0.5 in either order), replaced by one ``Gelu``
    node named after the last Mul and writing its output (the tensor ONNX Runtime reports);
    the intermediate values must have no other reader. Returns how many were fused."""
    from onnx import helper

    g = model.graph
    matcher = _ErfGelu(g)
    drop: set[str] = set()
    replace: dict[str, Any] = {}
    for erf in g.node:
        if erf.op_type != "Erf" or erf.domain not in ("", "ai.onnx"):
            continue
        found = matcher.match(erf)
        if found is None:
            continue
        x, fused, m2 = found
        drop.update(n.output[0] for n in fused)
        replace[m2.output[0]] = helper.make_node("Gelu", [x], [m2.output[0]], name=m2.name or m2.output[0])
    if not replace:
        return 0
    nodes = []
    for n in g.node:
        if n.output and n.output[0] in replace:
            nodes.append(replace[n.output[0]])
        elif not (n.output and n.output[0] in drop):
            nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    return len(replace)


def _other_input(node, name: str) -> str | None:
    """The other input of a two-input ``node`` that reads ``name``; None otherwise."""
    ins = list(node.input)
    if len(ins) != 2 or name not in ins:
        return None
    return ins[1] if ins[0] == name else ins[0]


class _ErfGelu:
    """The erf-form GELUs of one ONNX graph, node by node (:func:`fuse_erf_gelu`): the graph's
    one-element constants, each tensor's producer and readers."""

    def __init__(self, g):
        self.consts: dict[str, np.ndarray] = {}
        for t in g.initializer:
            if math.prod(int(d) for d in t.dims) == 1:
                self.consts[t.name] = tensor_array(t)
        for n in g.node:
            if n.op_type == "Constant":
                for a in n.attribute:
                    if a.name == "value" and a.HasField("t") and math.prod(int(d) for d in a.t.dims) == 1:
                        self.consts[n.output[0]] = tensor_array(a.t)
        self.producer = {o: n for n in g.node for o in n.output}
        self.readers: dict[str, list] = {}
        for n in g.node:
            for i in n.input:
                self.readers.setdefault(i, []).append(n)
        self.graph_outputs = {o.name for o in g.output}

    def only_reader(self, name: str, node) -> bool:
        """``node`` is the one reader of tensor ``name``, not a graph output."""
        return name not in self.graph_outputs and [r is node for r in self.readers.get(name, [])] == [True]

    def match(self, erf) -> tuple[str, list, Any] | None:
        """The GELU around the Erf node ``erf``: (its input x, the nodes it replaces but the last
        Mul, that last Mul); None when ``erf`` is not part of one."""
        scale = self.producer.get(erf.input[0])
        if scale is None or scale.op_type not in ("Div", "Mul") or not self.only_reader(scale.output[0], erf):
            return None
        x = scale.input[0]
        c = _scalar_const(self.consts, scale.input[1])
        if c is None or not np.isclose(c if scale.op_type == "Div" else 1.0 / c if c else 0.0, _SQRT2, rtol=1e-5):
            return None
        add = self.plus_one(erf)
        first = self.mul_after(add.output[0]) if add is not None else None
        second = self.mul_after(first[0].output[0]) if first is not None else None
        if second is None:  # two Muls: {x, half, add} multiplied in some order
            return None
        (m1, a), (m2, b) = first, second
        half = self.half(x, m1, a, b)
        if half is None:
            return None
        return x, [*half, scale, erf, add, m1], m2

    def plus_one(self, erf):
        """The Add of 1 that alone reads ``erf``'s output; None when there is none."""
        adds = self.readers.get(erf.output[0], [])
        if len(adds) != 1 or adds[0].op_type != "Add" or not self.only_reader(erf.output[0], adds[0]):
            return None
        add = adds[0]
        one = _other_input(add, erf.output[0])
        if one is None or _scalar_const(self.consts, one) != 1.0:
            return None
        return add

    def mul_after(self, tensor: str) -> tuple[Any, str] | None:
        """The Mul that alone reads ``tensor`` (not a graph output), and its other input; None
        when there is none."""
        muls = self.readers.get(tensor, [])
        if len(muls) != 1 or muls[0].op_type != "Mul" or tensor in self.graph_outputs:
            return None
        other = _other_input(muls[0], tensor)
        return None if other is None else (muls[0], other)

    def half(self, x: str, m1, a: str, b: str) -> list | None:
        """How the two Muls' other inputs ``a`` and ``b`` multiply by ``x`` and 0.5: ``[]`` for
        ``(x * (1 + erf)) * 0.5``, ``[the Mul(x, 0.5) node]`` for ``(0.5 * x) * (1 + erf)``
        (it goes too); None for anything else."""
        if a == x and _scalar_const(self.consts, b) == 0.5:
            return []  # (x * (1 + erf)) * 0.5
        if b == x and a in self.producer and self.producer[a].op_type == "Mul" and self.only_reader(a, m1):
            half = self.producer[a]  # (0.5 * x) * (1 + erf): a = Mul(x, 0.5)
            h = _other_input(half, x)
            if h is None or _scalar_const(self.consts, h) != 0.5:
                return None
            return [half]
        return None


# ------------------------------------------------------------------ auto_pad as explicit pads

#: ops whose ``auto_pad`` TVM's importer realizes as a ``call_tir`` of a TE pad (opaque to layer
#: forming and to verify's numpy reference)
_AUTO_PAD_OPS = frozenset({"Conv", "AveragePool", "MaxPool"})


def explicit_auto_pads(model, specs) -> int:
    """Every ``auto_pad`` (``SAME_UPPER``, ``SAME_LOWER``, ``VALID``) of a Conv or pool whose
    input shape is known, written as the explicit ``pads`` ONNX defines for it: per spatial
    axis ``total = max(0, (ceil(n / s) - 1) * s + (k - 1) * d + 1 - n)``, the odd one at the
    end (``SAME_UPPER``) or at the start (``SAME_LOWER``). TVM then imports a plain padded
    convolution or pool (timm's ConvMixer writes ``padding="same"`` convolutions this way).
    Returns how many nodes changed."""
    from onnx import helper

    from .checks import infer, skeleton

    todo = [n for n in model.graph.node if n.op_type in _AUTO_PAD_OPS and n.domain in ("", "ai.onnx")
            and any(a.name == "auto_pad" and a.s in (b"SAME_UPPER", b"SAME_LOWER", b"VALID") for a in n.attribute)]
    if not todo:
        return 0
    shapes = _static_shapes(infer(skeleton(model), specs), model, specs)
    changed = 0
    for node in todo:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        x = shapes.get(node.input[0])
        kernel = attrs.get("kernel_shape")
        if kernel is None and node.op_type == "Conv" and len(node.input) > 1 and node.input[1] in shapes:
            kernel = shapes[node.input[1]][2:]
        if x is None or kernel is None or len(x) != len(kernel) + 2:
            continue
        rank = len(kernel)
        strides = attrs.get("strides") or [1] * rank
        dilations = attrs.get("dilations") or [1] * rank
        mode = attrs["auto_pad"].decode() if isinstance(attrs["auto_pad"], bytes) else str(attrs["auto_pad"])
        begin, end = [0] * rank, [0] * rank
        if mode != "VALID":
            for i, (n, k, s, d) in enumerate(zip(x[2:], kernel, strides, dilations)):
                total = max(0, (-(-n // s) - 1) * s + (k - 1) * d + 1 - n)
                small, large = total // 2, total - total // 2
                begin[i], end[i] = (small, large) if mode == "SAME_UPPER" else (large, small)
        keep = [a for a in node.attribute if a.name not in ("auto_pad", "pads")]
        del node.attribute[:]
        node.attribute.extend(keep)
        node.attribute.append(helper.make_attribute("pads", begin + end))
        changed += 1
    return changed


def _weights_only(q, readers: dict[str, list[tuple[Any, int]]]) -> bool:
    """``q``'s integers are read only through DequantizeLinear nodes whose results are the
    weights (input 1) of Conv, ConvTranspose, Gemm or MatMul nodes (``readers``: each tensor's
    ``(node, input index)`` uses)."""
    dqs = readers.get(q.output[0], [])
    if not dqs or any(n.op_type != "DequantizeLinear" or k != 0 for n, k in dqs):
        return False
    uses = [u for d, _ in dqs for u in readers.get(d.output[0], [])]
    return bool(uses) and all(n.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and k == 1 for n, k in uses)


def _per_axis(node, shape, s: np.ndarray, z: np.ndarray):
    """A Q/DQ node's scale and zero point shaped to broadcast along its ``axis`` over a tensor of
    ``shape`` (per tensor: as they are); None when they do not fit that axis."""
    if s.size <= 1 and z.size <= 1:
        return s, z
    axis = next((int(a.i) for a in node.attribute if a.name == "axis"), 1) % max(len(shape), 1)
    if s.ndim != 1 or s.size != shape[axis] or z.size not in (1, s.size):
        return None
    bshape = [-1 if i == axis else 1 for i in range(len(shape))]
    return s.reshape(bshape), z.reshape(bshape if z.size > 1 else ())


#: the integer types of an activation's QuantizeLinear
_Q_TYPES = tuple(np.dtype(t) for t in ("int8", "uint8", "int16", "uint16"))


def foldable_quantize(node, w, s, z) -> tuple[np.ndarray, np.ndarray] | None:
    """(scale, zero point) shaped to broadcast over ``w`` when QuantizeLinear ``node`` of the
    constants ``w``, ``s``, ``z`` can be folded exactly (float32 values and scale, an integer type
    of :data:`_Q_TYPES`, per tensor or per axis, finite ``w / s``), else None."""
    if w is None or s is None or z is None or w.dtype != np.float32 or s.dtype != np.float32 \
            or z.dtype not in _Q_TYPES:
        return None
    fit = _per_axis(node, w.shape, s, z)
    if fit is None:
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        if not np.isfinite(w / fit[0]).all():
            return None
    return fit


def _quantized_float_initializer(node, const) -> np.ndarray | None:
    """The integers a QuantizeLinear of a float32 initializer gives (per tensor or per axis), as
    ONNX Runtime folds it: ``saturate(round_half_even(w / scale) + zero_point)`` in float32."""
    w = const(node.input[0])
    z = const(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros((), np.uint8)
    fit = foldable_quantize(node, w, const(node.input[1]), z)
    if fit is None:
        return None
    s, z = fit
    return quantize_linear(w, s, z.astype(np.int64), str(z.dtype))


def fold_requantized_weights(model) -> int:
    """A QuantizeLinear of a dequantized integer initializer (through ``Identity`` nodes)
    becomes an integer initializer: its output, computed as ONNX Runtime computes the two
    nodes (``(w - zero_point) * scale`` in float32, then :func:`quantize_linear`). So does a
    QuantizeLinear of a float initializer (``quantize_static``'s ``AddQDQPairToWeight``, per
    tensor or per channel: :func:`_quantized_float_initializer`).

    The TorchScript exporter gives each further use of a shared parameter an ``Identity``
    (ALBERT's layers, tied embeddings), and ``quantize_static`` treats that output as an
    activation: ``DequantizeLinear(w) -> Identity -> QuantizeLinear -> DequantizeLinear``
    with the range it calibrated. After the fold the consumer's weights are a dequantized
    integer constant again. Per-tensor QuantizeLinear only; the nodes left without readers
    go. Returns how many were folded."""
    from onnx import numpy_helper

    g = model.graph
    nodes = list(g.node)  # the wrappers stay alive: their ids name them below
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in nodes for o in n.output}

    def const(name: str):
        return tensor_array(inits[name]) if name in inits else None

    readers: dict[str, list[tuple[Any, int]]] = {}
    for n in nodes:
        for k, name in enumerate(n.input):
            readers.setdefault(name, []).append((n, k))
    folded: dict[str, np.ndarray] = {}
    drop: set[int] = set()
    for n in nodes:
        if n.op_type != "QuantizeLinear" or not _plain_qdq(n) or len(n.input) < 2 or len(n.output) != 1:
            continue
        if n.input[0] in inits and n.input[0] not in producer:
            if not _weights_only(n, readers):
                continue  # another constant quantized at run time (a table): the qdq scheme quantizes it
            q = _quantized_float_initializer(n, const)  # quantize_static's AddQDQPairToWeight
        else:
            q = _requantized_initializer(n, producer, const)
        if q is not None:
            folded[n.output[0]] = q
            drop.add(id(n))
    if not folded:
        return 0
    _set_nodes(g, _without_unread_qdq([n for n in nodes if id(n) not in drop], {o.name for o in g.output}))
    g.initializer.extend(numpy_helper.from_array(v, name) for name, v in folded.items())
    return len(folded)


def _plain_qdq(node) -> bool:
    """A Q/DQ node of the default domain without the attributes of newer opsets (``block_size``,
    ``output_dtype``, ``precision``)."""
    return node.domain in ("", "ai.onnx") and not any(a.name in ("block_size", "output_dtype", "precision")
                                                        for a in node.attribute)


def _requantized_initializer(q, producer: dict[str, Any], const) -> np.ndarray | None:
    """The integers QuantizeLinear ``q`` (per tensor) gives when it reads a DequantizeLinear of an
    integer initializer (through ``Identity`` nodes), as ONNX Runtime computes the two nodes:
    ``(w - zero_point) * scale`` in float32, then :func:`quantize_linear`; None when it does not
    (``const``: an initializer's values, or None)."""
    src = producer.get(q.input[0])
    while src is not None and src.op_type == "Identity":
        src = producer.get(src.input[0])
    if src is None or src.op_type != "DequantizeLinear" or not _plain_qdq(src) or len(src.input) < 2:
        return None
    w, s1 = const(src.input[0]), const(src.input[1])
    z1 = const(src.input[2]) if len(src.input) > 2 and src.input[2] else None
    s2 = const(q.input[1])
    z2 = const(q.input[2]) if len(q.input) > 2 and q.input[2] else np.zeros((), np.uint8)
    if w is None or s1 is None or s2 is None or z2 is None or (len(src.input) > 2 and src.input[2] and z1 is None):
        return None
    if w.dtype.kind not in "iu" or s1.dtype != np.float32 or s2.dtype != np.float32 or s2.size != 1 or z2.size != 1 \
            or z2.dtype not in _Q_TYPES:
        return None
    z1 = np.zeros((), np.int64) if z1 is None else z1
    fit = _per_axis(src, w.shape, s1, z1)  # per axis: along the DequantizeLinear's axis
    if fit is None:
        return None
    s1, z1 = fit
    f = ((w.astype(np.int64) - z1.astype(np.int64)).astype(np.float32) * s1).astype(np.float32)
    if not np.isfinite(f / np.float32(s2.reshape(()))).all():
        return None
    return quantize_linear(f, np.float32(s2.reshape(())), int(z2.reshape(())), str(z2.dtype))


def _without_unread_qdq(nodes: list, outputs: set[str]) -> list:
    """``nodes`` without the DequantizeLinear and Identity nodes no one reads any more, repeatedly
    (a graph output in ``outputs`` stays)."""
    keep = nodes
    while True:
        read = {i for n in keep for i in n.input} | outputs
        dead = [n for n in keep if n.op_type in ("Identity", "DequantizeLinear") and not any(o in read for o in n.output)]
        if not dead:
            return keep
        keep = [n for n in keep if all(n is not d for d in dead)]


def _dequantized_4bit(node, const) -> np.ndarray | None:
    """The float32 values of a DequantizeLinear of 4-bit integers, as ONNX Runtime computes
    them: ``float32(w - zero_point) * scale`` per tensor, per axis or per block (``block_size``)."""
    w, s = const(node.input[0]), const(node.input[1])
    z = const(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros((), np.int64)
    if w is None or s is None or z is None or s.dtype != np.float32:
        return None
    w, z = w.astype(np.int64), z.astype(np.int64)
    if s.size > 1 or z.size > 1:
        axis = next((int(a.i) for a in node.attribute if a.name == "axis"), 1) % max(w.ndim, 1)
        block = next((int(a.i) for a in node.attribute if a.name == "block_size"), 0)
        if block > 0:  # blocked: scale shaped as w with the axis divided into blocks
            if s.ndim != w.ndim or z.size not in (1, s.size) or (z.size > 1 and z.shape != s.shape):
                return None
            s = np.repeat(s, block, axis=axis)[tuple(slice(0, d) for d in w.shape)]
            z = np.repeat(z, block, axis=axis)[tuple(slice(0, d) for d in w.shape)] if z.size > 1 else z.reshape(())
            if s.shape != w.shape:
                return None
        else:
            fit = _per_axis(node, w.shape, s, z)
            if fit is None:
                return None
            s, z = fit
    return ((w - z).astype(np.float32) * s).astype(np.float32)


def standard_8bit_qdq(model) -> int:
    """com.microsoft's QuantizeLinear/DequantizeLinear of 8-bit types become ONNX's (the same
    arithmetic): ``quantize_static`` writes every Q/DQ node in that domain once one tensor is
    4-bit (before opset 21), and ONNX's shape inference, hence the folding of shape arithmetic,
    knows only ONNX's. The zero point's initializer gives the type. Returns how many changed."""
    inits = {t.name: t for t in model.graph.initializer}
    eight = (2, 3)  # UINT8, INT8
    changed = 0
    for n in model.graph.node:
        if n.domain != "com.microsoft" or n.op_type not in _QDQ_OPS or len(n.input) < 3 \
                or n.input[2] not in inits or inits[n.input[2]].data_type not in eight:
            continue
        n.domain = ""
        changed += 1
    return changed


def _quantized_4bit(node, x: np.ndarray, const, types: dict[str, int]) -> np.ndarray | None:
    """A QuantizeLinear of float32 values ``x`` to a 4-bit type (its zero point's), as ONNX Runtime
    computes it: ``saturate(round_half_even(x / scale) + zero_point)``, per tensor or per axis."""
    s = const(node.input[1])
    zname = node.input[2] if len(node.input) > 2 else ""
    if s is None or not zname or s.dtype != np.float32 or x.dtype != np.float32:
        return None
    z, signed = const(zname), _FOUR_BIT_SIGNED.get(types.get(zname))
    if z is None or signed is None:
        return None
    lo, hi = (-8, 7) if signed else (0, 15)
    z = z.astype(np.int64)
    fit = _per_axis(node, x.shape, s, z)
    if fit is None:
        return None
    s, z = fit
    return quantize_linear(x, s, z, "int64", (lo, hi))


#: ONNX's 4-bit integer types (INT4, UINT4; ONNX Runtime has no integer kernel for them) -> signed
_FOUR_BIT_SIGNED = {22: True, 21: False}
_FOUR_BIT = tuple(_FOUR_BIT_SIGNED)


def fold_4bit_weights(model) -> int:
    """Dequantized INT4/UINT4 initializers (``quantize_static`` with ``weight_type=QInt4`` or
    ``QUInt4``) become float32 initializers of their values: a DequantizeLinear of one, and the
    chains a shared weight gets (``DequantizeLinear -> Identity -> QuantizeLinear`` to 4 bits
    again -> ``DequantizeLinear``: ALBERT's layers), each node as ONNX Runtime computes it.

    ONNX Runtime has no integer kernel for 4-bit weights: it runs such a Conv, Gemm or MatMul in
    float on the dequantized weights (a MatMul as ``MatMulNBits``, in float32 when asked to), so
    the op is a float layer in irgen too, between the dequantize and quantize of its activations.
    (TVM's importer cannot read 4-bit initializers either: it copied them at one byte per value.)
    Returns how many nodes were folded."""
    from onnx import numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    produced = {o for n in g.node for o in n.output}
    vals: dict[str, np.ndarray] = {}  # folded values: float32, or 4-bit integers (int64) in ``four``
    four = {t.name for t in g.initializer if t.data_type in _FOUR_BIT and t.name not in produced}
    types = {t.name: t.data_type for t in g.initializer}

    def const(name: str):
        if name in vals:
            return vals[name]
        return tensor_array(inits[name]) if name in inits and name not in produced else None

    nodes = list(g.node)  # the wrappers stay alive: their ids name them below
    done: set[int] = set()
    for n in nodes:  # topological order, as ONNX requires
        # quantize_static writes com.microsoft's Q/DQ nodes for 4-bit types before opset 21
        if n.domain not in ("", "ai.onnx", "com.microsoft") or len(n.output) != 1 or not n.input:
            continue
        v = None
        if n.op_type == "DequantizeLinear" and n.input[0] in four and len(n.input) >= 2:
            v = _dequantized_4bit(n, const)
        elif n.op_type == "Identity" and n.input[0] in vals:
            v = vals[n.input[0]]
            if n.input[0] in four:
                four.add(n.output[0])
        elif n.op_type == "QuantizeLinear" and n.input[0] in vals and n.input[0] not in four and len(n.input) >= 3:
            v = _quantized_4bit(n, vals[n.input[0]], const, types)
            if v is not None:
                four.add(n.output[0])
        if v is not None:
            vals[n.output[0]] = v
            done.add(id(n))
    if not done:
        return 0
    _set_nodes(g, [n for n in nodes if id(n) not in done])
    read = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    for name in sorted(read & set(vals)):  # a folded 4-bit value still read: as int8 (TVM reads those)
        v = vals[name]
        g.initializer.append(numpy_helper.from_array(v.astype(np.int8) if name in four else v, name))
    for t in [t for t in g.initializer if t.data_type in _FOUR_BIT and t.name not in read]:
        g.initializer.remove(t)
    return len(done)


#: the ``doc_string`` of a node irgen added: its outputs have no tensor in the source model
#: (the importer records no source tensor for them; a model's own such doc strings are cleared)
INVENTED = "irgen: added before import; not in the source model"
#: ops that only move a tensor's values (and ``Identity``): quantizing before them is quantizing after
_MOVES = frozenset({"Unsqueeze", "Squeeze", "Reshape", "Flatten", "Transpose", "Identity"})


def quantize_inputs_first(model) -> int:
    """A QuantizeLinear that reads a float graph input through ops that only move its values
    (``Unsqueeze``, ``Reshape``, ``Transpose``..., and a ``Cast`` to the type it has) quantizes
    the input itself instead; the ops then move the integers, the last one writing the
    QuantizeLinear's output.

    ``quantize_static`` quantizes the first tensor it calibrated, and the exporters put such
    ops in front: wav2vec2's ``Unsqueeze`` of the waveform, DINOv2's and CLIP's ``Cast`` of the
    pixels to the weights' type. The scheme needs a dequantized integer tensor under every
    op it realizes. Moving values commutes with quantizing them (a ``Cast`` to the same type
    is an ``Identity``), so the integers are ONNX Runtime's; the float tensors between the
    input and the QuantizeLinear are renamed (``<name>_quantized``: no counterpart in ONNX
    Runtime). Each must have the next op as its only reader; per-tensor parameters only.
    Returns how many."""
    from onnx import TensorProto, helper

    g = model.graph
    nodes = list(g.node)  # the wrappers stay alive: their ids name them below
    inits = {t.name: t for t in g.initializer}
    inputs = {v.name: v.type.tensor_type.elem_type for v in g.input if v.name not in inits}
    producer = {o: n for n in nodes for o in n.output}
    readers: dict[str, int] = {}
    for n in nodes:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    outputs = {o.name for o in g.output}

    def moves(n, dtype: int) -> bool:
        if n.domain not in ("", "ai.onnx"):
            return False
        if n.op_type == "Cast":
            return next((int(a.i) for a in n.attribute if a.name == "to"), None) == dtype
        return n.op_type in _MOVES

    def per_tensor(name: str) -> bool:
        t = inits.get(name)
        return t is not None and math.prod(int(d) for d in t.dims) == 1

    # the id of a chain's first op -> (the graph input, the ops from it to the Q, the Q)
    firsts: dict[int, tuple[str, list, Any]] = {}
    for q in nodes:
        if q.op_type != "QuantizeLinear" or q.domain not in ("", "ai.onnx") or len(q.input) < 2 \
                or not per_tensor(q.input[1]) or (len(q.input) > 2 and q.input[2] and not per_tensor(q.input[2])):
            continue
        tensor, chain = q.input[0], []
        while tensor not in inputs:
            n = producer.get(tensor)
            if n is None or tensor in outputs or readers.get(tensor) != 1 or not n.input:
                break
            chain.insert(0, n)
            tensor = n.input[0]
        if chain and tensor in inputs and inputs[tensor] in (TensorProto.FLOAT, TensorProto.FLOAT16) \
                and all(moves(n, inputs[tensor]) for n in chain):
            firsts[id(chain[0])] = (tensor, chain, q)
    if not firsts:
        return 0
    drop, new = set(), []
    for n in nodes:
        hit = firsts.get(id(n))
        if hit is not None:
            x, chain, q = hit
            qname = f"{x}_QuantizeLinear_before_{chain[0].name or chain[0].op_type}"
            new.append(helper.make_node("QuantizeLinear", [x, *q.input[1:]], [f"{qname}_Output"], name=qname,
                                        domain=q.domain, doc_string=INVENTED))
            new[-1].attribute.extend(q.attribute)
            source = f"{qname}_Output"
            for k, c in enumerate(chain):  # on the integers now; the last writes the QuantizeLinear's output
                if c.op_type == "Cast":
                    c.op_type = "Identity"
                    del c.attribute[:]
                c.input[0] = source
                source = q.output[0] if k == len(chain) - 1 else f"{c.output[0]}_quantized"
                c.output[0] = source
                if k < len(chain) - 1:
                    c.doc_string = INVENTED
            drop.add(id(q))
        if id(n) not in drop:
            new.append(n)
    _set_nodes(g, new)
    return len(firsts)


def _set_nodes(g, nodes: list) -> None:
    """``g``'s nodes replaced by ``nodes`` (copied first: clearing the field releases its messages)."""
    copies = []
    for n in nodes:
        c = type(n)()
        c.CopyFrom(n)
        copies.append(c)
    del g.node[:]
    g.node.extend(copies)
