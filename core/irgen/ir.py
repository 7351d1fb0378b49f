"""Claim step 3.3: the custom IR's layer records, built from formed layers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tvm
from tvm import relax

from irgen.api import Provenance
from irgen.canonical import is_roll, rotation
from irgen.graph import Binding, Constant, attrs_to_dict, const_view, tensor_type, to_json
from irgen.layers import Layer
from irgen.quant import MAC_KINDS, kernel_op
from irgen.ops import (CANONICAL_OPS, COMPOUND_OPS, LAYER_OP_NAMES, MULTI_STEP_OPS, OP_NAMES,  # noqa: F401  (re-exported)
                       SOURCE_OP_NAMES, quant_op, quantized_roll, short_op, source_op_name)

from irgen.recurrent import GATES, recurrent_kind
from irgen.schema import IR_VERSION  # noqa: E402,F401  (defined beside the schema, re-exported)

_ACTIVATIONS = {"relax.nn.relu", "relax.clip", "relax.sigmoid", "relax.tanh", "relax.nn.gelu", "relax.nn.silu"}
_WEIGHTED = {"relax.nn.conv2d", "relax.nn.conv1d", "relax.nn.conv2d_transpose", "relax.nn.conv3d",
             "relax.nn.conv3d_transpose", "relax.matmul"}



def _attention_attrs(members: list[Binding]) -> dict[str, Any]:
    """A fused attention chain's attributes: ``scale`` (what the scores are multiplied by;
    a divisor as its reciprocal, the divide is still what runs), ``masked`` (an additive
    mask), ``key_transposed`` (the key input is kᵀ, as the first matmul reads it)."""
    scale = None
    for b in members[1:]:
        if b.op in ("relax.multiply", "relax.divide"):
            c = next((a for a in b.value.args if isinstance(a, Constant)), None)
            if c is not None and c.value.numpy().size == 1:
                v = float(c.value.numpy().ravel()[0])
                scale = v if b.op == "relax.multiply" else 1.0 / v
    return {"scale": scale, "masked": any(b.op == "relax.add" for b in members), "key_transposed": True}


def _roll_attrs(members: list[Binding]) -> dict[str, Any]:
    """A roll layer's attributes in ``torch.roll``'s convention (``out[i] = x[(i - shift) mod n]``
    along each axis), one entry per rotation step in the order the steps run: ``shifts``
    (``0 < shift < n``) and ``axes`` (non-negative), read off each concat's slices, so the
    same roll has the same attrs whatever frontend wrote it."""
    by = {b.name: b for b in members}
    steps = [rotation(b, by) for b in members if b.op == "relax.concat"]
    return {"shifts": [int(s) for _, _, s in steps], "axes": [int(a) for _, a, _ in steps]}




def _recurrent_attrs(kind: str):
    """A recurrent cell step's attributes (docs/layer-ops.md): ``hidden_size``, ``gates`` (the
    row blocks of its weights, in order) and ``clip`` (ONNX's cell clip, or None)."""

    def attrs(members: list[Binding]) -> dict[str, Any]:
        out = {"hidden_size": int(tensor_type(members[-1].var)[0][-1]), "gates": list(GATES[kind]), "clip": None}
        clip = next((b for b in members if b.op == "relax.clip"), None)
        if clip is not None:
            out["clip"] = float(arg_ref(clip.value.args[2], {}, [])["value"])
        return out

    return attrs


# attributes of a layer a fusion rule formed (beside its anchor's), by the rule's op; of a recurrent step
LAYER_ATTRS = {"attention": _attention_attrs, **{k: _recurrent_attrs(k) for k in GATES}}

# attributes a layer op implies beyond its Relax attrs (the GELU form)
IMPLIED_ATTRS = {
    "relax.nn.gelu": {"approximate": "none"},
    "relax.nn.gelu_tanh": {"approximate": "tanh"},
}







def _depthwise(attrs: dict[str, Any], data: Binding | None) -> bool:
    """A grouped convolution (``attrs``, and ``data``: the binding whose first argument is its
    input) with one group per input channel."""
    groups = int(attrs.get("groups") or 1)
    if groups <= 1:
        return False
    t = tensor_type(data.value.args[0]) if data is not None and isinstance(data.value, relax.Call) else None
    if t is None or len(t[0]) not in (4, 5):
        return False
    layout = str(attrs.get("data_layout") or ("NCHW" if len(t[0]) == 4 else "NCDHW"))
    return t[0][layout.index("C")] == groups


def _conv_groups(b: Binding) -> dict[str, Any]:
    """A convolution binding's ``groups`` and ``data_layout`` (what :func:`_depthwise` reads)."""
    a = b.value.attrs
    return {"groups": int(a.groups), "data_layout": str(a.data_layout)} if hasattr(a, "groups") else {}








@dataclass
class LayerRecord:
    """A layer's IR record plus its parameter arrays (written as files by the pipeline)."""

    record: dict[str, Any]
    params: dict[str, np.ndarray] = field(default_factory=dict)


def _role(anchor: Binding, b: Binding, arg_index: int) -> str:
    op = b.op
    kernel = _kernel_op(b)
    roles = kernel[1].get("arg_roles") if kernel is not None else None
    if roles and 0 < arg_index <= len(roles):  # a scheme's kernel names its arguments (after the GlobalVar)
        return str(roles[arg_index - 1])
    if op in _WEIGHTED and arg_index == 1:
        return "weight"
    if op == "relax.nn.batch_norm":
        return ["data", "gamma", "beta", "moving_mean", "moving_var"][arg_index]
    if op == "relax.take" and arg_index == 0:
        return "table"
    first = b.value.args[0] if isinstance(b.value, relax.Call) and b.value.args else None
    feeds_on_anchor = isinstance(first, relax.Var) and first.name == anchor.name
    if b is not anchor and anchor.op in _WEIGHTED and feeds_on_anchor:
        if op == "relax.add":
            return "bias"
        if op == "relax.multiply":
            return "scale"
    return "operand"


def arg_ref(a: relax.Expr, names: dict[str, str], params: list[tuple[Constant, str]]) -> Any:
    """How ``ir.json`` refers to an op argument: a variable by its IR name (``names`` maps Relax
    names to IR names), a constant that is a layer parameter as ``"param:<role>"`` (``params``
    lists ``(constant, role)``), another constant as ``{"value": ...}``, a shape as
    ``{"shape": [...]}``, a tuple as a list of references."""
    if isinstance(a, relax.Var):
        return names.get(a.name, a.name)
    if isinstance(a, Constant):
        for c, role in params:
            if c.same_as(a):
                return f"param:{role}"
        return {"value": to_json(a.value.numpy().tolist()) if hasattr(a.value, "numpy") else to_json(a.value)}
    if isinstance(a, relax.ShapeExpr):
        return {"shape": [int(x) for x in a.values]}
    if isinstance(a, relax.Tuple):
        return [arg_ref(f, names, params) for f in a.fields]
    if hasattr(a, "value"):
        return {"value": to_json(a.value)}
    return {"value": str(a)}


_arg_ref = arg_ref  # the former private name (tests/test_reference_ops.py imports it)


class ConstantRef:
    """A tensor constant in a ``quant`` record's own program (a float span's ``program``), until
    the layer record is built: then ``"param:<role>"``, the layer parameter it is, as ``fused_ops``
    names it (:func:`resolve_constant_refs`), so the record does not repeat a weight inline."""

    __slots__ = ("const",)

    def __init__(self, const: Constant):
        self.const = const

    def __repr__(self) -> str:
        return f"ConstantRef({tuple(self.const.value.shape)})"


def program_arg(a: relax.Expr, refs: dict[str, str]) -> Any:
    """An argument of a quant record's program: a variable by ``refs``, a tensor constant of more
    than one value as a :class:`ConstantRef` (a layer parameter once the record is built), else as
    :func:`arg_ref` writes it."""
    if isinstance(a, relax.Var):
        return refs[a.name]
    if isinstance(a, relax.Tuple):
        return [program_arg(f, refs) for f in a.fields]
    if isinstance(a, Constant) and isinstance(a.ty, relax.TensorType) and hasattr(a.value, "numpy") \
            and a.value.numpy().size > 1:
        return ConstantRef(a)
    return arg_ref(a, {}, [])


def resolve_constant_refs(value: Any, params: list[tuple[Constant, str]]) -> Any:
    """``value`` (a quant record) with every :class:`ConstantRef` made ``"param:<role>"`` of the
    layer parameter it is, or its value inline when it is none."""
    if isinstance(value, ConstantRef):
        return arg_ref(value.const, {}, params)
    if isinstance(value, dict):
        return {k: resolve_constant_refs(v, params) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_constant_refs(v, params) for v in value]
    return value


def build_layer_record(
    layer: Layer,
    by_name: dict[str, Binding],
    provenance: Provenance,
    tensor_name: dict[str, str],
    layer_name: str,
    quant: dict[str, Any] | None = None,
    steps: list[dict[str, Any] | None] | None = None,
) -> LayerRecord:
    """The IR record of one layer.

    ``tensor_name`` maps Relax var names of layer inputs/outputs to IR tensor
    names. ``fused_ops`` is a small program: each op's ``args`` name a layer
    input (``input:K``), a parameter (``param:ROLE``), an earlier op's result
    (``op:J``) or a literal; it is what the numpy reference runs.

    ``quant`` is the anchor's record; ``steps`` (a layer a fusion rule merged from several
    scheme layers that requantize, :attr:`irgen.layers.Layer.steps`) each merged layer's,
    which become ``quant.steps`` (:func:`_stepwise_quant`).

    Steps: the layer's inputs, its parameters, the ``fused_ops`` program, the
    anchor's attributes and activation, the source nodes folded in, the layer op;
    then the bias is made one value per channel (:func:`_uniform_bias`).
    """
    members = [by_name[m] for m in layer.members]
    anchor = by_name[layer.anchor]
    ext = _layer_inputs(members, set(layer.members))
    params, arrays = _layer_params(members, anchor, quant)
    if quant is not None and quant.get("program") is not None:
        quant = resolve_constant_refs(quant, params)
    ops, refs = _fused_ops(members, ext, params)
    attrs = _layer_attrs(layer, members, anchor, ops, quant)
    source = _layer_source(layer, provenance)
    op, attrs = _layer_op(layer, members, anchor, attrs, ext, by_name, quant, source)
    record = {
        "name": layer_name,
        "op": op,
        "fused_ops": ops,
        "attrs": attrs,
        "inputs": [tensor_name.get(n, n) for n in ext],
        "outputs": [tensor_name.get(o, o) for o in layer.outputs],
        "results": _results(layer, by_name, refs),
        "params": {},
        "quant": quant,
        "source": source,
    }
    _uniform_bias(record, arrays)
    if steps is not None:
        record["quant"] = _stepwise_quant(layer, by_name, ext, steps, len(record["fused_ops"]) - len(members))
        record["attrs"] = _stepwise_attrs(layer, by_name, attrs, steps[-1])
    return LayerRecord(record, arrays)


def _stepwise_quant(layer: Layer, by_name: dict[str, Binding], ext: list[str], steps: list[dict[str, Any] | None],
                    extra_ops: int) -> dict[str, Any]:
    """The ``quant`` of a layer merged from several scheme layers that requantize: ``kind``
    ``fused``, ``steps`` one record per merged layer in order, each the scheme's own record
    plus ``ops`` (how many consecutive ``fused_ops`` are the step's; the first step's count
    the bias reshape :func:`_uniform_bias` put first) and ``args`` (the step's inputs in
    its record's order: ``input:K``, the layer's input K, or ``step:J``, step J's result).
    ``inputs`` are the layer's inputs' quantization (null where no step's record gives it),
    ``output`` the last step's."""
    if any(q is None for q in steps):
        raise ValueError(f"internal: a merged layer of {layer.anchor!r} has a step without a quant record")
    result_of: dict[str, int] = {}
    inputs: list[Any] = [None] * len(ext)
    records = []
    for i, (names, q) in enumerate(zip(layer.steps or [], steps)):
        step_ext = _layer_inputs([by_name[m] for m in names], set(names))
        own = q.get("inputs") if isinstance(q.get("inputs"), list) and len(q["inputs"]) == len(step_ext) else None
        args = []
        for p, v in enumerate(step_ext):
            if v in result_of:
                args.append(f"step:{result_of[v]}")
                continue
            k = ext.index(v)
            args.append(f"input:{k}")
            if inputs[k] is None and own is not None:
                inputs[k] = own[p]
        result_of[names[-1]] = i
        records.append({**q, "ops": len(names) + (extra_ops if i == 0 else 0), "args": args})
    return {"scheme": records[0]["scheme"], "kind": "fused", "inputs": inputs, "output": records[-1].get("output"),
            "steps": records}


def _stepwise_attrs(layer: Layer, by_name: dict[str, Binding], attrs: dict[str, Any], last: dict[str, Any]
                    ) -> dict[str, Any]:
    """The anchor's attributes; ``activation`` the last step when that is an activation (a
    relu table after a conv), else none: the anchor's clamp no longer ends the layer."""
    attrs = {k: v for k, v in attrs.items() if k != "activation"}
    members = [by_name[m] for m in (layer.steps or [[]])[-1]]
    op = quant_op(last, members) if last.get("kind") not in (None, "integer") else short_op(members[-1])
    op = CANONICAL_OPS.get(op, op)
    if op in STEP_ACTIVATIONS:
        attrs["activation"] = {"op": op}
    return attrs


#: the layer ops that are an activation when they end a merged layer
STEP_ACTIVATIONS = frozenset({"relu", "clip", "sigmoid", "tanh", "gelu", "silu"}) | COMPOUND_OPS


def _layer_inputs(members: list[Binding], mset: set[str]) -> list[str]:
    """The variables the layer reads from outside, in order of first use."""
    ext: list[str] = []
    for b in members:
        for a in _walk_vars(b.value):
            if a not in mset and a not in ext:
                ext.append(a)
    return ext


def _layer_params(members: list[Binding], anchor: Binding, quant: dict[str, Any] | None
                  ) -> tuple[list[tuple[Constant, str]], dict[str, np.ndarray]]:
    """The tensor constants that are parameters (``weight``, ``bias``, ``table``...), by role.

    A scalar literal stays inline in its op's args; in a quantized layer only the
    conv/dense weight and bias and a table are parameters (the integer arithmetic
    constants stay inline: ``quant`` explains them); in a float span (``kind: float``,
    the float ops between a dequantize and a quantize) every constant of more than one
    value: its weights, biases, norms' parameters, position tables."""
    float_span = quant is not None and (quant.get("kind") == "float" or quant.get("realization") == "float")
    params: list[tuple[Constant, str]] = []
    arrays: dict[str, np.ndarray] = {}
    for b in members:
        for j, a in enumerate(_flat_args(b.value)):
            if isinstance(a, Constant) and isinstance(a.ty, relax.TensorType) and not any(a.same_as(c) for c, _ in params):
                arr = const_view(a)
                if arr.ndim == 0 and b.op not in _WEIGHTED:
                    continue
                role = _role(anchor, b, j)
                if float_span:
                    if arr.size <= 1:
                        continue
                elif quant is not None and role != "table" and (
                    quant.get("kind") not in MAC_KINDS
                    or role not in ("weight", "bias") or role in arrays
                ):
                    continue
                base, k = role, 1
                while role in arrays:
                    role = f"{base}{k}"
                    k += 1
                params.append((a, role))
                arrays[role] = arr
    return params, arrays


def _fused_ops(members: list[Binding], ext: list[str], params: list[tuple[Constant, str]]
               ) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The ``fused_ops`` program (one op per member) and each variable's reference."""
    refs = {n: f"input:{i}" for i, n in enumerate(ext)}
    ops = []
    for j, b in enumerate(members):
        kernel = _kernel_op(b)
        if kernel is not None:  # a scheme's TIR kernel of a Relax op (irgen.quant.QGraph.add_kernel)
            op, attrs = kernel
            ops.append({"op": OP_NAMES.get(op, op.removeprefix("relax.")), "relax_op": op, "attrs": attrs,
                        "args": [arg_ref(a, refs, params) for a in b.value.args[1].fields]})
            refs[b.name] = f"op:{j}"
            continue
        ops.append(
            {
                "op": short_op(b),
                "relax_op": b.op or b.kind,
                "attrs": attrs_to_dict(b.value.attrs) if isinstance(b.value, relax.Call) else {"index": int(b.value.index)} if b.kind == "tgi" else {},
                "args": [arg_ref(a, refs, params) for a in op_args(b.value)],
            }
        )
        refs[b.name] = f"op:{j}"
    return ops, refs


def _kernel_op(b: Binding) -> tuple[str, dict[str, Any]] | None:
    """(op, attributes) of a ``call_tir`` of a kernel a scheme added, else None."""
    v = b.value
    if b.op != "relax.call_tir" or not isinstance(v.args[0], tvm.ir.GlobalVar):
        return None
    return kernel_op(v.args[0].name_hint)


def _layer_attrs(layer: Layer, members: list[Binding], anchor: Binding, ops: list[dict[str, Any]],
                 quant: dict[str, Any] | None) -> dict[str, Any]:
    """The anchor's attributes, plus ``activation`` when one is the layer's last step
    (a clip inside hardswish is not one; a quantized layer's clip precedes its cast)."""
    attrs = {**IMPLIED_ATTRS.get(anchor.op or "", {}), **ops[layer.members.index(layer.anchor)]["attrs"]}
    # a quantized layer extended with integer followers (max pool...): its activation is the anchor's
    head = set(layer.head or layer.members)
    acts = [b for b in members if b.op in _ACTIVATIONS and b is not anchor and b.name in head]
    if quant is None and acts and acts[-1] is not members[-1]:
        acts = []
    if acts:
        act = acts[-1]
        a = {"op": short_op(act), **IMPLIED_ATTRS.get(act.op or "", {})}
        if act.op == "relax.clip":
            a["min"] = arg_ref(act.value.args[1], {}, [])["value"]
            a["max"] = arg_ref(act.value.args[2], {}, [])["value"]
        attrs["activation"] = a
    return attrs


def _layer_source(layer: Layer, provenance: Provenance) -> dict[str, list[str]]:
    """The source nodes folded into the layer (in graph order), their op types, the source
    tensors they compute and those the layer's outputs are."""
    nodes: list[str] = []
    op_types: list[str] = []
    tensors: list[str] = []
    # a tuple result's items (a batch norm's [0]) are outputs, not members: their node too
    items = [o for o in layer.outputs if o not in layer.members]
    for m in [*layer.members, *items]:
        for name in [*provenance.merged.get(m, []), m]:
            if name in provenance.by_var:
                node, op_type, tensor = provenance.by_var[name]
                if node not in nodes:
                    nodes.append(node)
                    op_types.append(op_type)
                if tensor and tensor not in tensors:
                    tensors.append(tensor)
    # one per output (None where an output has no source tensor), but for those at the end
    out_src = [provenance.by_var[o][2] if o in provenance.by_var else None for o in layer.outputs]
    while out_src and out_src[-1] is None:
        out_src.pop()
    return {"nodes": nodes, "op_types": op_types, "tensors": tensors, "outputs": out_src}


def _results(layer: Layer, by_name: dict[str, Binding], refs: dict[str, str]) -> list[str]:
    """Which op result each output is: ``op:J``, or ``op:J.K`` for item K of a tuple result."""
    results = []
    for o in layer.outputs:
        if o in refs:
            results.append(refs[o])
        else:
            tgi = by_name[o].value
            results.append(f"{refs[tgi.tuple_value.name]}.{int(tgi.index)}")
    return results


def _layer_op(layer: Layer, members: list[Binding], anchor: Binding, attrs: dict[str, Any], ext: list[str],
              by_name: dict[str, Binding], quant: dict[str, Any] | None, source: dict[str, list[str]]
              ) -> tuple[str, dict[str, Any]]:
    """The layer's op in the canonical vocabulary (docs/layer-ops.md), and its attrs as that op has them."""
    nodes, op_types = source["nodes"], source["op_types"]
    op = short_op(anchor)
    if quant is not None and quant.get("kind") not in (None, "integer") and layer.op is None:
        op = quant_op(quant, members)
        if op == "gelu" and "approximate" in (quant.get("params") or {}):  # a table of either form
            attrs = {**attrs, "approximate": "tanh" if quant["params"]["approximate"] else "none"}
    elif layer.op is not None:
        op = layer.op
        extra = LAYER_ATTRS.get(op, lambda _: {})(members)
        # a recurrent step: its own attributes (and the activation it ends with), not its first matmul's
        attrs = {**extra, **{k: v for k, v in attrs.items() if k == "activation"}} if recurrent_kind(op) \
            else {**attrs, **extra}
    elif layer.rule is None and len(members) > 1 and len(set(op_types)) == 1 and not recurrent_kind(op_types[0]):
        op = source_op_name(op_types[0])  # (a recurrent op's steps are layers of their own: its results are not it)
    elif layer.rule is None and is_roll(members):  # a roll the exporter wrote as slices and concats
        op = "roll"
    op = CANONICAL_OPS.get(op, op)
    if op == "roll" and is_roll(members):  # .pt2's aten.roll steps and quantized rolls too
        attrs = _roll_attrs(members)
    weighted = [m for m in members if m.op in _WEIGHTED]
    if quant is None and anchor.op not in _WEIGHTED and len(weighted) == 1 and len(set(nodes)) == 1:
        # one source op the frontend wrote as many steps around one conv or matmul (a
        # dynamic-range kernel: the input quantized at run time, the result scaled back): that op
        w = weighted[0]
        op = CANONICAL_OPS.get(short_op(w), short_op(w))
        if op in ("conv2d", "conv3d") and _depthwise({**attrs, **_conv_groups(w)}, w):
            op = f"depthwise_{op}"
    if op in ("conv2d", "conv3d") and _depthwise(attrs, by_name.get(layer.anchor)):
        op = f"depthwise_{op}"
    if quant is None and len(members) > 1 and len(set(nodes)) == 1 and source_op_name(op_types[0]) in MULTI_STEP_OPS:
        # one source op that the importer wrote as several steps (ONNX HardSigmoid: multiply,
        # add, clip; torch's resize with its own coordinates): the layer is that op, whatever
        # step the fusion rule anchored on
        op = source_op_name(op_types[0])
        attrs = {k: v for k, v in attrs.items() if k != "activation"}
    return op, attrs


def _shift_refs(ref: Any, by: int) -> Any:
    """``ref`` with every ``op:J`` (``op:J.K``) reference moved ``by`` ops on."""
    if isinstance(ref, list):
        return [_shift_refs(r, by) for r in ref]
    if isinstance(ref, str) and ref.startswith("op:"):
        j, dot, k = ref[3:].partition(".")
        return f"op:{int(j) + by}{dot}{k}"
    return ref


def _uniform_bias(record: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """A bias parameter is stored as ``[C]`` whatever shape the graph broadcasts it in
    (``[1,C,1,1]`` after an NCHW conv, ``[1,1,1,C]`` after an NHWC one, ``[1,N]`` after a
    dense): ``fused_ops`` gains a first step reshaping ``param:bias`` to that shape, and
    the ops that read it read that step; so does a float span's ``quant.program``."""
    bias = arrays.get("bias")
    if bias is None or bias.ndim <= 1 or sum(d != 1 for d in bias.shape) > 1:
        return
    arrays["bias"] = bias.reshape(-1)
    step = {"op": "reshape", "relax_op": "relax.reshape", "attrs": {},
            "args": ["param:bias", {"shape": [int(d) for d in bias.shape]}]}

    def arg(a: Any) -> Any:
        return "op:0" if a == "param:bias" else [arg(x) for x in a] if isinstance(a, list) else _shift_refs(a, 1)

    record["fused_ops"] = [step, *({**op, "args": [arg(a) for a in op["args"]]} for op in record["fused_ops"])]
    record["results"] = [_shift_refs(r, 1) for r in record["results"]]
    quant = record.get("quant") or {}
    if quant.get("program") is not None:
        quant["program"] = [step, *({**op, "args": [arg(a) for a in op["args"]]} for op in quant["program"])]
        if quant.get("result") is not None:
            quant["result"] = _shift_refs(quant["result"], 1)


def _flat_args(v: relax.Expr) -> list[relax.Expr]:
    if isinstance(v, relax.Call):
        out = []
        for a in v.args:
            if isinstance(a, relax.Tuple):
                out.extend(a.fields)
            else:
                out.append(a)
        return out
    if isinstance(v, relax.TupleGetItem):
        return [v.tuple_value]
    if isinstance(v, relax.Var):
        return [v]
    return []


def op_args(v: relax.Expr) -> list[relax.Expr]:
    """The arguments of one fused op as ``fused_ops`` records them: a tuple of tensors
    (concat's operands) is flattened, a tuple of literals (strided_slice's axes, begin,
    end, strides) stays one argument, a list in ``ir.json``."""
    if not isinstance(v, relax.Call):
        return _flat_args(v)
    out = []
    for a in v.args:
        if isinstance(a, relax.Tuple) and not (a.fields and all(isinstance(f, (tvm.tirx.IntImm, tvm.tirx.FloatImm)) for f in a.fields)):
            out.extend(a.fields)
        else:
            out.append(a)
    return out


def _walk_vars(v: relax.Expr) -> list[str]:
    return [a.name for a in _flat_args(v) if isinstance(a, relax.Var)]
