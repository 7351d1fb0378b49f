"""Checks of an untrusted ONNX graph, all done before TVM's importer sees it.

- structure: every tensor written once (SSA), no node output shadowing a graph
  input or initializer (or a name of an enclosing graph), tensors with a known
  element type, non-negative dims and as much data as their shape says, then
  ``onnx.checker`` (op arity, attributes, dangling inputs, topological order);
- inputs: ``--input-shape`` only names real inputs and only sets their open
  dimensions; every input's size under ``--max-tensor-bytes``;
- sizes: every tensor whose shape ONNX shape inference (with data propagation)
  knows statically, plus ConstantOfShape/Expand/Tile/Range fed by constants,
  must stay under ``--max-tensor-bytes``: TVM's importer folds constants while
  importing and would otherwise allocate a size bomb before anything runs.

The checker and shape inference run on a *skeleton* of the model: large
initializers are replaced by graph inputs of the same type and shape, so a
model with a gigabyte of weights is not serialized (and copied) again.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator

from irgen.plugin import DEFAULT_MAX_TENSOR_BYTES, InputSpec, IrgenError

from .loader import (all_graphs, all_nodes, check_size, data_bytes, deferred, esc, np_dtype, one_line, q, tensor_array,
                     type_name)

#: initializers above this many bytes are left out of the skeleton (replaced by an input)
SKELETON_KEEP_BYTES = 1 << 16
#: ops whose output size follows from a constant input; checked directly too
_SHAPED_BY_CONSTANT = ("ConstantOfShape", "Expand", "Tile", "Range")
#: attributes that hold an ONNX element type (Cast, EyeLike, Random*, QuantizeLinear, ...)
_TYPE_ATTRS = ("to", "dtype", "output_dtype")


def _node(node, index: int | None = None) -> str:
    name = q(node.name) if node.name else (f"#{index}" if index is not None else "(unnamed)")
    return f"node {name} ({esc(node.op_type, 40)})"


# ------------------------------------------------------------------ structure


def _check_graph(graph, path: Path, outer: dict[str, str], where: str) -> None:
    """SSA within ``graph`` and against the names of its enclosing graphs (``outer``)."""
    defined: dict[str, str] = {}
    for v in graph.input:
        if not v.name:
            raise IrgenError(f"{path}: {where}a graph input has no name")
        if v.name in defined:
            raise IrgenError(f"{path}: {where}input {q(v.name)} is listed twice")
        defined[v.name] = "a graph input"
    inits: set[str] = set()
    for t in graph.initializer:
        if not t.name.strip():
            raise IrgenError(f"{path}: {where}an initializer has no name")
        if t.name in inits:
            raise IrgenError(f"{path}: {where}initializer {q(t.name)} is given twice")
        inits.add(t.name)
        defined[t.name] = "an initializer"  # an initializer may also be listed as an input (IR < 4)
    for name, what in defined.items():
        if name in outer:
            raise IrgenError(f"{path}: {where}{what} {q(name)} shadows {outer[name]} of an enclosing graph")
    # a subgraph sees the names defined before its node (as onnx.checker does)
    writers: dict[str, Any] = {}
    for i, node in enumerate(graph.node):
        scope = None
        for a in node.attribute:
            if a.name in _TYPE_ATTRS and a.type == a.INT and (a.i or a.name == "to") and np_dtype(a.i) is None:
                raise IrgenError(f"{path}: {where}{_node(node, i)}: attribute {q(a.name)} names an unknown "
                                 f"element type ({a.i})")
            subs = ([a.g] if a.HasField("g") else []) + list(a.graphs)
            for g in subs:
                if scope is None:
                    scope = {**outer, **defined, **{o: f"the output of {_node(n, j)}" for o, (n, j) in writers.items()}}
                _check_graph(g, path, scope, f"{where}{_node(node, i)} attribute {q(a.name)}: ")
        for out in node.output:
            if not out:
                continue
            if out in writers:
                first, j = writers[out]
                raise IrgenError(
                    f"{path}: {where}tensor {q(out)} is written by two nodes, {_node(first, j)} and {_node(node, i)}"
                )
            if out in defined:
                raise IrgenError(f"{path}: {where}{_node(node, i)} writes {q(out)}, which is {defined[out]}")
            if out in outer:
                raise IrgenError(f"{path}: {where}{_node(node, i)} writes {q(out)}, which is {outer[out]} "
                                 f"of an enclosing graph")
            writers[out] = (node, i)


def _named_tensors(model) -> Iterator[tuple[str, Any]]:
    for g in all_graphs(model.graph):
        for t in g.initializer:
            yield f"initializer {q(t.name)}", t
    for node in all_nodes(model):
        for a in node.attribute:
            owner = f"attribute {q(a.name)} of {_node(node)}"
            if a.HasField("t"):
                yield f"tensor {q(a.t.name)} ({owner})" if a.t.name else f"the tensor of {owner}", a.t
            for t in a.tensors:
                yield f"tensor {q(t.name)} ({owner})", t


def _typed_count(t) -> tuple[int, int] | None:
    """(values stored in the typed field, values expected) for a tensor without raw_data."""
    from onnx import helper

    try:
        field = helper.tensor_dtype_to_field(t.data_type)
    except (KeyError, ValueError, TypeError):
        return None
    n = math.prod(int(d) for d in t.dims)
    if t.data_type in (14, 15):  # COMPLEX64, COMPLEX128: (real, imaginary) pairs
        n *= 2
    elif t.data_type in (21, 22, 23, 25, 26):  # packed sub-byte types: one byte per int32
        n = data_bytes(t.dims, t.data_type)
    return len(getattr(t, field)), n


def check_tensors(model, path: Path, limit: int | None) -> None:
    """Every tensor stored in the model: a known type, dims >= 0, under the limit, and all its data."""
    from onnx import TensorProto

    for g in all_graphs(model.graph):
        if g.sparse_initializer:
            raise IrgenError(f"{path}: sparse initializer {q(g.sparse_initializer[0].values.name)} "
                             f"is not supported")
    for what, t in _named_tensors(model):
        if t.data_type == TensorProto.UNDEFINED or np_dtype(t.data_type) is None:
            raise IrgenError(f"{path}: {what} has an unknown element type ({t.data_type})")
        check_size(f"{path}: {what}", t.dims, t.data_type, limit)
        if t.data_location == TensorProto.EXTERNAL:
            if deferred(t) is not None:  # load_external_data checked its source and length
                continue
            raise IrgenError(f"{path}: {what}: external data not loaded")  # load_external_data did it
        if t.HasField("raw_data"):
            need = data_bytes(t.dims, t.data_type)
            if t.data_type == TensorProto.STRING:
                raise IrgenError(f"{path}: {what}: a string tensor cannot have raw data")
            if len(t.raw_data) != need:
                raise IrgenError(f"{path}: {what} has {len(t.raw_data)} bytes of data; its shape {tuple(t.dims)} "
                                 f"({type_name(t.data_type)}) needs {need}")
        else:
            counts = _typed_count(t)
            if counts is not None and counts[0] != counts[1]:
                raise IrgenError(f"{path}: {what} has {counts[0]} values; its shape {tuple(t.dims)} needs {counts[1]}")


def check_structure(model, path: Path) -> None:
    _check_graph(model.graph, path, {}, "")
    for v in model.graph.output:
        if not v.name:
            raise IrgenError(f"{path}: the graph has an output without a name")


def run_checker(skel, path: Path) -> None:
    """``onnx.checker`` (without shape inference) on the skeleton, its complaint as one line.

    The checker wants a shape on every graph input and output; ONNX itself lets
    one out (unknown rank), and exporters do, so the skeleton gets an empty one."""
    import onnx

    for g in all_graphs(skel.graph):
        for v in (*g.input, *g.output):
            if v.type.WhichOneof("value") == "tensor_type" and not v.type.tensor_type.HasField("shape"):
                v.type.tensor_type.shape.SetInParent()
    try:
        onnx.checker.check_model(skel, full_check=False)
    except Exception as err:  # noqa: BLE001  ValidationError, and C++ errors of other kinds
        raise IrgenError(f"{path}: not a valid ONNX model: {one_line(err, 1000)}") from None


# ------------------------------------------------------------------ the skeleton


def _copy_fields(dst, src, skip: tuple[str, ...]) -> None:
    for fd, value in src.ListFields():
        if fd.name in skip:
            continue
        if fd.is_repeated:
            getattr(dst, fd.name).extend(value)
        elif fd.type == fd.TYPE_MESSAGE:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def skeleton(model, keep_bytes: int = SKELETON_KEEP_BYTES):
    """A copy of ``model`` whose top-level initializers over ``keep_bytes`` became graph inputs."""
    import onnx
    from onnx import helper

    skel = onnx.ModelProto()
    _copy_fields(skel, model, ("graph",))
    g = skel.graph
    _copy_fields(g, model.graph, ("initializer", "input"))
    g.input.extend(model.graph.input)
    listed = {v.name for v in model.graph.input}
    for t in model.graph.initializer:
        # raw data over keep_bytes (check_tensors matched its length to the dims): out without
        # measuring the message, which ByteSize does by serializing it (ResNet-18: 0.08 s a call)
        big = (t.HasField("raw_data") or deferred(t) is not None) and data_bytes(t.dims, t.data_type) > keep_bytes
        if not big and t.ByteSize() <= keep_bytes:
            g.initializer.append(t)
        elif t.name not in listed:
            g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return skel


# ------------------------------------------------------------------ inputs


def _declared(vi) -> list:
    dims = []
    for d in vi.type.tensor_type.shape.dim:
        if d.HasField("dim_value") and d.dim_value > 0:
            dims.append(int(d.dim_value))
        elif d.HasField("dim_value") and d.dim_value < 0:
            dims.append(int(d.dim_value))
        else:
            dims.append(d.dim_param or "?")
    return dims


def _shape_text(dims) -> str:
    return "[" + ", ".join(str(d) if isinstance(d, int) else one_line(d, 40) for d in dims) + "]"


def _real_inputs(model) -> list:
    inits = {t.name for t in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in inits]


def input_specs(model, shapes: dict[str, tuple[int, ...]], limit: int | None, path: Path) -> list[InputSpec]:
    """The model's inputs with their shapes (``--input-shape`` filling open dims), each size-checked."""
    inputs = _real_inputs(model)
    listing = ", ".join(f"{esc(vi.name)} {_shape_text(_declared(vi))}" for vi in inputs[:20]) or "none"
    if len(inputs) > 20:
        listing += ", ..."
    by_name = {vi.name: vi for vi in inputs}
    for name, dims in shapes.items():
        spec = f"--input-shape {esc(name)}={','.join(str(d) for d in dims)}"
        if name not in by_name:
            raise IrgenError(f"{spec}: the model has no input {q(name)} (inputs: {listing})")
        if not dims or any(int(d) < 0 for d in dims):
            raise IrgenError(f"{spec}: every dimension must be a non-negative integer (0: an empty tensor, such as an empty KV cache)")
        vi = by_name[name]
        if vi.type.tensor_type.HasField("shape"):
            declared = _declared(vi)
            if len(declared) != len(dims):
                raise IrgenError(f"{spec}: input {q(name)} has rank {len(declared)} (shape {_shape_text(declared)})")
            for k, (d, want) in enumerate(zip(declared, dims)):
                if isinstance(d, int) and d > 0 and d != int(want):
                    if all(isinstance(x, int) for x in declared):
                        raise IrgenError(f"{spec}: input {q(name)} has the fixed shape {_shape_text(declared)}")
                    raise IrgenError(f"{spec}: input {q(name)} has the shape {_shape_text(declared)}, "
                                     f"whose dimension {k} is fixed at {d}")
    specs = []
    for vi in inputs:
        what = f"input {q(vi.name)}"
        if vi.type.WhichOneof("value") != "tensor_type":
            raise IrgenError(f"{path}: {what} is a {vi.type.WhichOneof('value') or 'value of no type'}, not a tensor")
        tt = vi.type.tensor_type
        dtype = np_dtype(tt.elem_type) if tt.elem_type else None
        if dtype is None or dtype == object:
            raise IrgenError(f"{path}: {what} has an unsupported element type ({type_name(tt.elem_type)})")
        if vi.name in shapes:
            shape = tuple(int(d) for d in shapes[vi.name])
        elif not tt.HasField("shape"):
            raise IrgenError(f"{what} has no declared shape; give it with --input-shape {esc(vi.name)}=D1,D2,...")
        else:
            shape = []
            for d in _declared(vi):
                if isinstance(d, int) and d < 0:
                    raise IrgenError(f"{path}: {what} has a negative dimension in its shape {_shape_text(_declared(vi))}")
                if not isinstance(d, int):
                    raise IrgenError(
                        f"{what} has an open dimension {q(d, 40)}; give it with --input-shape {esc(vi.name)}=1,..."
                    )
                shape.append(d)
            shape = tuple(shape)
        check_size(what, shape, tt.elem_type, limit)
        specs.append(InputSpec(vi.name, shape, str(dtype)))
    return specs


# ------------------------------------------------------------------ sizes


def _static(vi) -> tuple[list[int], int] | None:
    """(dims, element type) of a tensor value whose shape is fully known."""
    if vi.type.WhichOneof("value") != "tensor_type":
        return None
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    dims = []
    for d in tt.shape.dim:
        if not d.HasField("dim_value"):
            return None
        dims.append(int(d.dim_value))
    return dims, (tt.elem_type if np_dtype(tt.elem_type) is not None else 2)  # unknown: count bytes


def infer(skel, specs: list[InputSpec]):
    """The skeleton with the inputs' shapes fixed, shape-inferred; None when inference fails."""
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(skel)
    fixed = {s.name: s.shape for s in specs}
    for vi in m.graph.input:
        if vi.name in fixed:
            shape = vi.type.tensor_type.shape
            del shape.dim[:]
            for d in fixed[vi.name]:
                shape.dim.add().dim_value = int(d)
    try:
        return onnx.shape_inference.infer_shapes(m, check_type=False, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001  inference is a help here, not a gate
        return None


def _const_values(model) -> dict[str, Any]:
    """name -> TensorProto for every top-level initializer and Constant ``value``."""
    consts: dict[str, Any] = {t.name: t for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.output:
            for a in n.attribute:
                if a.name == "value" and a.HasField("t"):
                    consts[n.output[0]] = a.t
    return consts


def _ints(t, limit_elements: int = 1 << 16) -> list[int] | None:
    if math.prod(int(d) for d in t.dims) > limit_elements:
        return None
    try:
        arr = tensor_array(t).reshape(-1)
        return [int(v) for v in arr]
    except Exception:  # noqa: BLE001
        return None


def _scalar(t) -> float | None:
    if math.prod(int(d) for d in t.dims) != 1:
        return None
    try:
        return float(tensor_array(t).reshape(-1)[0])
    except Exception:  # noqa: BLE001
        return None


def _direct_checks(model, known: dict[str, tuple[list[int], int]], limit: int | None, path: Path) -> None:
    """Outputs sized by a constant input (ConstantOfShape, Expand, Tile, Range), inference or not."""
    from onnx import TensorProto

    consts = _const_values(model)
    for i, node in enumerate(model.graph.node):
        if node.op_type not in _SHAPED_BY_CONSTANT or node.domain not in ("", "ai.onnx") or not node.output:
            continue
        what = f"{path}: tensor {q(node.output[0])} ({_node(node, i)})"
        ins = list(node.input)
        if node.op_type == "ConstantOfShape" and ins and ins[0] in consts:
            dims = _ints(consts[ins[0]])
            elem = TensorProto.FLOAT
            for a in node.attribute:
                if a.name == "value" and a.HasField("t"):
                    elem = a.t.data_type
            if dims is not None:
                check_size(what, dims, elem, limit)
        elif node.op_type == "Expand" and len(ins) > 1 and ins[1] in consts:
            dims = _ints(consts[ins[1]])
            elem = known[ins[0]][1] if ins[0] in known else TensorProto.UINT8
            if dims is not None:  # the output is at least this large
                check_size(what, dims, elem, limit)
        elif node.op_type == "Tile" and len(ins) > 1 and ins[1] in consts and ins[0] in known:
            reps = _ints(consts[ins[1]])
            dims, elem = known[ins[0]]
            if reps is not None and len(reps) == len(dims):
                check_size(what, [d * r for d, r in zip(dims, reps)], elem, limit)
        elif node.op_type == "Range" and len(ins) == 3 and all(n in consts for n in ins):
            start, stop, delta = (_scalar(consts[n]) for n in ins)
            if None in (start, stop, delta):
                continue
            if delta == 0:
                raise IrgenError(f"{what}: delta is 0, the range never ends")
            try:
                count = max(math.ceil((stop - start) / delta), 0)
            except (OverflowError, ValueError):
                raise IrgenError(f"{what}: the range ({start}, {stop}, {delta}) has no finite length") from None
            check_size(what, [count], consts[ins[0]].data_type, limit)


def check_sizes(model, skel, specs: list[InputSpec], limit: int | None, path: Path) -> None:
    """Every tensor whose size is known before running stays under ``limit``; see the module text."""
    producer = {o: (n, i) for i, n in enumerate(model.graph.node) for o in n.output if o}
    known: dict[str, tuple[list[int], int]] = {}
    inferred = infer(skel, specs)
    if inferred is not None:
        g = inferred.graph
        for vi in (*g.value_info, *g.output):
            st = _static(vi)
            if st is None:
                continue
            known[vi.name] = st
            by = f" ({_node(*producer[vi.name])})" if vi.name in producer else ""
            check_size(f"{path}: tensor {q(vi.name)}{by}", st[0], st[1], limit)
    elem = {vi.name: vi.type.tensor_type.elem_type for vi in model.graph.input}
    for s in specs:
        known.setdefault(s.name, (list(s.shape), elem.get(s.name, 2)))
    _direct_checks(model, known, limit, path)


def default_limit(options: dict[str, Any]) -> int:
    return options.get("max_tensor_bytes") or DEFAULT_MAX_TENSOR_BYTES
