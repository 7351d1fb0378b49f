"""ONNX ``If`` nodes whose condition is a constant, replaced by the branch taken.

TVM's Relax importer turns an ``If`` into a ``relax.If`` that later fails to
build ("Tensor constants are not supported in primitive functions"). Exporters
often leave ``If`` nodes with a constant condition (a flag traced as a
constant); those are resolved here before import: the branch taken is inlined
into the graph (its initializers and nodes, local names renamed where they
would collide with a name outside), and its outputs become the ``If``'s outputs
through ``Identity`` nodes. An ``If`` whose condition is computed at run time
is refused with one clear error.
"""

from __future__ import annotations

from pathlib import Path
from irgen.plugin import IrgenError

from .loader import all_graphs, q, tensor_array

#: a constant condition tensor larger than this is not a condition
_MAX_COND_ELEMENTS = 1


def _names_in(graph) -> set[str]:
    """Every value name used anywhere in ``graph`` and its subgraphs."""
    names: set[str] = set()
    for g in all_graphs(graph):
        names.update(v.name for v in (*g.input, *g.output, *g.value_info))
        names.update(t.name for t in g.initializer)
        for n in g.node:
            names.update(n.input)
            names.update(n.output)
    names.discard("")
    return names


def _constant(graph, name: str):
    """The TensorProto holding the value of ``name`` when it is a constant of ``graph``."""
    for t in graph.initializer:
        if t.name == name:
            return t
    for n in graph.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and name in n.output:
            for a in n.attribute:
                if a.name == "value" and a.HasField("t"):
                    return a.t
            return None
    return None


def _condition(graph, node, path: Path) -> bool | None:
    if not node.input or not node.input[0]:
        raise IrgenError(f"{path}: node {q(node.name)} (If) has no condition input")
    t = _constant(graph, node.input[0])
    if t is None:
        return None
    n = 1
    for d in t.dims:
        n *= int(d)
    if n != _MAX_COND_ELEMENTS:
        raise IrgenError(f"{path}: node {q(node.name)} (If): condition {q(node.input[0])} has {n} elements, not one")
    try:
        return bool(tensor_array(t).reshape(-1)[0])
    except Exception as err:  # noqa: BLE001
        raise IrgenError(f"{path}: node {q(node.name)} (If): cannot read condition {q(node.input[0])} "
                         f"({type(err).__name__})") from None


def _branch(node, taken: bool, path: Path):
    key = "then_branch" if taken else "else_branch"
    for a in node.attribute:
        if a.name == key and a.HasField("g"):
            return a.g
    raise IrgenError(f"{path}: node {q(node.name)} (If) has no {key}")


def _rename(graph, mapping: dict[str, str]) -> None:
    """Rename values throughout ``graph`` and its subgraphs (definitions and uses alike)."""
    if not mapping:
        return
    for g in all_graphs(graph):
        for field in (g.input, g.output, g.value_info, g.initializer):
            for v in field:
                if v.name in mapping:
                    v.name = mapping[v.name]
        for n in g.node:
            for i, name in enumerate(n.input):
                if name in mapping:
                    n.input[i] = mapping[name]
            for i, name in enumerate(n.output):
                if name in mapping:
                    n.output[i] = mapping[name]


def _inline_one(model, index: int, taken: bool, path: Path) -> None:
    from onnx import GraphProto, helper

    graph = model.graph
    node = graph.node[index]
    branch = GraphProto()
    branch.CopyFrom(_branch(node, taken, path))
    if len(branch.output) != len(node.output):
        raise IrgenError(f"{path}: node {q(node.name)} (If): the branch taken has {len(branch.output)} outputs, "
                         f"the node {len(node.output)}")
    if branch.sparse_initializer:
        raise IrgenError(f"{path}: node {q(node.name)} (If): sparse initializers are not supported")
    # the branch's own values: renamed where a name outside (or another branch) uses them
    local = [t.name for t in branch.initializer] + [o for n in branch.node for o in n.output if o]
    outside = set()
    for i, n in enumerate(graph.node):
        if i != index:
            outside |= _names_in_node(n)
    outside |= {v.name for v in (*graph.input, *graph.output, *graph.value_info)}
    outside |= {t.name for t in graph.initializer}
    outside |= set(node.input) | set(node.output)
    used = outside | _names_in(branch)
    mapping = {}
    for name in local:
        if name in outside and name not in mapping:
            k = 1
            while f"{name}__if{k}" in used:
                k += 1
            mapping[name] = f"{name}__if{k}"
            used.add(mapping[name])
    _rename(branch, mapping)
    prefix = node.name or "if"
    new_nodes = list(branch.node)
    for k, (src, dst) in enumerate(zip(branch.output, node.output)):
        if dst:
            new_nodes.append(helper.make_node("Identity", [src.name], [dst], name=f"{prefix}/output_{k}"))
    graph.initializer.extend(branch.initializer)
    del graph.node[index]
    for offset, n in enumerate(new_nodes):
        graph.node.insert(index + offset, n)


def _names_in_node(node) -> set[str]:
    names = set(node.input) | set(node.output)
    for a in node.attribute:
        for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            names |= _names_in(g)
    names.discard("")
    return names


def inline_constant_ifs(model, path: Path, refuse_dynamic: bool = True, max_steps: int = 1000) -> int:
    """Replace every top-level ``If`` with a constant condition by its branch; returns how many.

    An ``If`` left whose condition is not a constant is refused (``refuse_dynamic``) or kept."""
    count = 0
    while True:
        ifs = [(i, n) for i, n in enumerate(model.graph.node) if n.op_type == "If" and n.domain in ("", "ai.onnx")]
        if not ifs:
            return count
        for i, n in ifs:
            cond = _condition(model.graph, n, path)
            if cond is not None:
                _inline_one(model, i, cond, path)
                count += 1
                break
        else:
            if not refuse_dynamic:
                return count
            i, n = ifs[0]
            raise IrgenError(
                f"{path}: node {q(n.name)} (If): its condition {q(n.input[0])} is computed at run time; "
                f"irgen imports an If only when its condition is a constant"
            )
        if count >= max_steps:
            raise IrgenError(f"{path}: more than {max_steps} nested If nodes")
