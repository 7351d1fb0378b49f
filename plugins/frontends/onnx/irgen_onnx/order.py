"""Nodes put in topological order on import, as ONNX Runtime does when it resolves a graph.

ONNX requires every node to come after the nodes whose outputs it reads, and
``onnx.checker`` refuses a graph that breaks the rule; ONNX Runtime does not: it
builds its graph from the edges and sorts it (``Graph::Resolve``), so a file whose
nodes are out of order loads and runs. Quantizers write such files: AMD Quark's
NPU passes append the ``Mul`` they put after a ``GlobalAveragePool`` or a
``Sigmoid`` at the end of the list, after the ``QuantizeLinear`` that reads it.

:func:`sort_graphs` sorts every graph of the model before the checker runs. The sort
is stable: the nodes are taken in the file's order, and a node whose input is
written by a node not taken yet has that producer (and, first, its own missing
producers) moved to just before it. A graph already in order is left exactly as it
is, and a misplaced node moves no further than to its first reader. A node's inputs
include the outer-scope names its subgraphs (``If``/``Loop``/``Scan`` bodies) read.
A real cycle stays an error, naming the nodes on it; a name no node writes is left
to the checker (a graph input, an initializer, an outer-scope name, or a dangling
input, which the checker names).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from irgen.plugin import IrgenError

from .loader import all_graphs, esc

#: nodes named in the message about a cycle
_CYCLE_NAMES = 8


def _subgraph_reads(node) -> set[str]:
    """The names ``node``'s subgraphs read from outside themselves (their implicit inputs)."""
    reads: set[str] = set()
    for a in node.attribute:
        for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
            defined = {v.name for v in g.input} | {t.name for t in g.initializer}
            for n in g.node:  # a subgraph is sorted by the checker's rule too; its own names first
                defined.update(o for o in n.output if o)
            for n in g.node:
                reads.update(x for x in n.input if x and x not in defined)
                reads.update(x for x in _subgraph_reads(n) if x not in defined)
    return reads


def _label(node, index: int) -> str:
    return f"{esc(node.name, 60)!r} ({esc(node.op_type, 30)})" if node.name else f"#{index} ({esc(node.op_type, 30)})"


def topological_order(nodes, where: str = "") -> list[int]:
    """The indices of ``nodes`` in a stable topological order (see the module text); an
    :class:`IrgenError` naming the nodes of a cycle if there is one (``where``: the message's start)."""
    producer: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for o in n.output:
            if o:
                producer.setdefault(o, i)
    deps: list[list[int]] = []
    for i, n in enumerate(nodes):
        names = [x for x in n.input if x]
        if any(a.HasField("g") or a.graphs for a in n.attribute):
            names += sorted(_subgraph_reads(n) - set(names))
        seen: set[int] = set()
        row = []
        for x in names:
            j = producer.get(x)
            if j is not None and j not in seen:
                seen.add(j)
                row.append(j)
        deps.append(row)
    state = [0] * len(nodes)  # 0: not taken, 1: waiting for its producers, 2: taken
    order: list[int] = []
    for start in range(len(nodes)):
        if state[start]:
            continue
        state[start] = 1
        stack: list[tuple[int, Any]] = [(start, iter(deps[start]))]
        while stack:
            i, todo = stack[-1]
            for j in todo:
                if state[j] == 0:
                    state[j] = 1
                    stack.append((j, iter(deps[j])))
                    break
                if state[j] == 1:  # j waits for itself: the nodes from j up the stack form a cycle
                    at = next(k for k, (m, _) in enumerate(stack) if m == j)
                    cycle = [m for m, _ in stack[at:]]
                    names = ", ".join(_label(nodes[m], m) for m in cycle[:_CYCLE_NAMES])
                    more = f" and {len(cycle) - _CYCLE_NAMES} more" if len(cycle) > _CYCLE_NAMES else ""
                    raise IrgenError(f"{where}not a valid ONNX model: the graph has a cycle: "
                                     f"{len(cycle)} node{'s' if len(cycle) > 1 else ''} read each other's outputs "
                                     f"({names}{more})")
            else:
                stack.pop()
                state[i] = 2
                order.append(i)
    return order


def sort_graphs(model, path: Path) -> int:
    """Every graph of ``model`` (subgraphs too) put in topological order, as ONNX Runtime sorts
    it on load (see the module text); returns how many nodes moved."""
    moved = 0
    for g in reversed(list(all_graphs(model.graph))):  # a subgraph before the graph holding it
        nodes = list(g.node)
        order = topological_order(nodes, f"{path}: ")
        if order == list(range(len(nodes))):
            continue
        moved += sum(1 for k, i in enumerate(order) if k != i)
        copies = []
        for i in order:  # copied first: clearing the field releases its messages
            c = type(nodes[i])()
            c.CopyFrom(nodes[i])
            copies.append(c)
        del g.node[:]
        g.node.extend(copies)
    return moved
