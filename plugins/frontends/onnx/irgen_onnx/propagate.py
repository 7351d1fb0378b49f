"""Q/DQ pairs propagated past data movements, as ONNX Runtime's ``QDQPropagationTransformer`` does.

Quantizers do not always put a QuantizeLinear/DequantizeLinear pair around every op: NNCF,
Brevitas and Intel Neural Compressor quantize a MaxPool's input but not its output, so
``DequantizeLinear -> MaxPool`` feeds the next Conv (and a residual Add) in float. ONNX
Runtime rewrites such graphs when it loads them (a basic-level optimization, on in every
session irgen's source runner opens): for the ops listed in :data:`PROPAGATES` (measured on
ORT 1.32: every opset version of each) it

* moves a DequantizeLinear forward: after an op one of a DequantizeLinear's outputs feeds, it
  inserts ``QuantizeLinear -> DequantizeLinear`` with the DequantizeLinear's scale and zero
  point on the edges to the op's readers (one QuantizeLinear, one DequantizeLinear per reader),
  and on again after each reader that is itself such an op; not where a QuantizeLinear reads
  the op's output (measured: ``DQ -> MaxPool -> {Conv, QuantizeLinear}`` stays, and the Conv
  runs in float: Brevitas' residual branch);
* moves a QuantizeLinear backward: before such an op whose output only that QuantizeLinear
  reads, it inserts the pair with the QuantizeLinear's parameters on the op's data input (when
  only the op reads it), and on up the chain until a DequantizeLinear writes the input.

Both keep the values (a move commutes with quantizing; ``Q(DQ(q)) == q`` for the same
parameters) but change which node units ORT then fuses into integer kernels: the MaxPool runs
on the integers and the Conv after it becomes a QLinearConv. irgen reproduces the rewrite
(:func:`propagate_qdq`), so the qdq scheme sees the node units ORT runs. Only per-tensor
parameters held by constants propagate; backward first, then forward, each over the nodes
of the file in order, as ORT does. The inserted nodes are marked :data:`.fold.INVENTED`: their
outputs are no tensor of the source model (nor can verify ask ORT for them without changing
the graph ORT optimizes), so verify checks the layers reading them end to end. Hence a pair
goes only where it changes a node unit: next to an op ORT fuses into an integer kernel that
computes (:data:`COMPUTES`: a Conv, an Add... reading or writing through it); elsewhere it would
change no value (a move on integers is the move on their dequantized values) and the ops stay
as the file writes them. Not reproduced: a pair on an edge to a graph output (its values are
the op's own) and through a value read inside a subgraph.
"""

from __future__ import annotations

from typing import Any

#: the ops ONNX Runtime propagates Q/DQ pairs through (its ``CanNodePropagate``)
PROPAGATES = frozenset({"MaxPool", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Slice"})
#: the ops whose node unit a propagated pair can change (ORT's QDQ selectors that compute: QLinearConv,
#: QGemm, QLinearAdd..., and a Relu/Clip a QuantizeLinear makes redundant after one of them)
COMPUTES = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul", "Add", "Mul", "Concat", "AveragePool",
                      "GlobalAveragePool", "Sigmoid", "Softmax", "LeakyRelu", "Where", "Relu", "Clip"})
_DOMAINS = ("", "ai.onnx")
_QDQ_DOMAINS = ("", "ai.onnx", "com.microsoft")


class _Graph:
    """A graph's live edges while pairs are inserted: who writes and who reads each value."""

    def __init__(self, g):
        from .order import _subgraph_reads

        self.g = g
        self.nodes = list(g.node)  # the wrappers stay alive: their ids name them
        self.outputs = {o.name for o in g.output}
        self.producer: dict[str, Any] = {}
        self.readers: dict[str, list[tuple[Any, int | None]]] = {}
        for n in self.nodes:
            self._add(n)
            for x in _subgraph_reads(n):  # read inside a subgraph: an edge no pair goes on
                self.readers.setdefault(x, []).append((n, None))
        consts = {n.output[0]: n for n in self.nodes if n.op_type == "Constant" and len(n.output) == 1}
        self.constants = {t.name for t in g.initializer}
        self.scalars = {t.name for t in g.initializer if len(t.dims) == 0 or list(t.dims) == [1]}
        self.scalars |= {name for name, n in consts.items() if _scalar_constant(n)}
        self.names = {n.name for n in self.nodes} | set(self.producer) | {t.name for t in g.initializer} \
            | {v.name for v in g.input}

    def _add(self, n) -> None:
        for o in n.output:
            if o:
                self.producer.setdefault(o, n)
        for k, x in enumerate(n.input):
            if x:
                self.readers.setdefault(x, []).append((n, k))

    def fresh(self, base: str) -> str:
        from .loader import unique_name

        return unique_name(self.names, base)


def _scalar_constant(node) -> bool:
    """A Constant node holding one value (a scalar or a one-element vector)."""
    for a in node.attribute:
        if a.name == "value" and a.HasField("t"):
            return len(a.t.dims) == 0 or list(a.t.dims) == [1]
        if a.name in ("value_float", "value_int"):
            return True
    return False


def _is(node, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in _QDQ_DOMAINS


def _propagates(node) -> bool:
    return node is not None and node.domain in _DOMAINS and node.op_type in PROPAGATES and bool(node.input) \
        and bool(node.output) and bool(node.input[0])


def _per_tensor(gr: _Graph, node) -> bool:
    """ORT's ``QOrDQNodeHasConstantScalarScaleAndZeroPoint``: a constant scalar scale and zero point."""
    operands = [x for x in node.input[1:3] if x]
    return len(node.input) > 1 and bool(node.input[1]) and all(x in gr.scalars for x in operands)


def _previous_edge(gr: _Graph, node):
    """The edge into ``node``'s data input, when only ``node`` reads that value (ORT's
    ``GetPreviousEdge``): ``(writer or None for a graph input, value, node, 0)``, or None."""
    name = node.input[0]
    src = gr.producer.get(name)
    if name in gr.constants or (src is not None and src.op_type == "Constant"):
        return None  # a constant: ORT folds what it feeds (and the pair would not change a value)
    if src is None:
        return None, name, node, 0
    if name in gr.outputs or len(gr.readers.get(name, [])) != 1:
        return None
    return src, name, node, 0


def _next_edges(gr: _Graph, node) -> list:
    """The edges out of ``node``'s first output to the nodes reading it (ORT's ``GetNextEdges``; the
    edge to a graph output is left out, see the module text)."""
    name = node.output[0]
    return [(node, name, r, k) for r, k in gr.readers.get(name, [])]


def _insert_pair(gr: _Graph, edges: list, qdq, q_attrs: list, dq_attrs: list) -> None:
    """``QuantizeLinear -> DequantizeLinear`` with ``qdq``'s scale and zero point on ``edges``
    (all from one value): one QuantizeLinear, a DequantizeLinear per edge (ORT's ``InsertQDQPairs``),
    with the attributes ``q_attrs`` and ``dq_attrs``."""
    from onnx import helper

    from .fold import INVENTED

    name = edges[0][1]
    params = [x for x in qdq.input[1:3]]
    q_out = gr.fresh(f"{name}_q_to_dq")
    q = helper.make_node("QuantizeLinear", [name, *params], [q_out], name=gr.fresh(f"{name}_q"),
                         domain=qdq.domain, doc_string=INVENTED)
    q.attribute.extend(q_attrs)
    gr.nodes.append(q)
    gr._add(q)
    for k, (_, _, dst, index) in enumerate(edges):
        out = gr.fresh(f"{name}_post_dq{k or ''}")
        dq = helper.make_node("DequantizeLinear", [q_out, *params], [out], name=gr.fresh(f"{name}_dq{k or ''}"),
                              domain=qdq.domain, doc_string=INVENTED)
        dq.attribute.extend(dq_attrs)
        gr.nodes.append(dq)
        gr._add(dq)
        gr.readers[name] = [(r, i) for r, i in gr.readers[name] if not (r is dst and i == index)]
        dst.input[index] = out
        gr.readers.setdefault(out, []).append((dst, index))


def _computes(node) -> bool:
    return node is not None and node.domain in _DOMAINS and node.op_type in COMPUTES


def _backward(gr: _Graph, q) -> int:
    """Pairs with ``q``'s parameters up the chain of :data:`PROPAGATES` ops before it."""
    edge = _previous_edge(gr, q)
    done = 0
    while edge is not None and edge[0] is not None and _propagates(edge[0]):
        edge = _previous_edge(gr, edge[0])
        if edge is None or _is(edge[0], "DequantizeLinear"):
            break
        if _computes(edge[0]):  # (only there does the pair change a node unit, see the module text)
            _insert_pair(gr, [edge], q, list(q.attribute), [a for a in q.attribute if a.name in ("axis", "block_size")])
            done += 1
    return done


def _forward(gr: _Graph, dq) -> int:
    """Pairs with ``dq``'s parameters after each chain of :data:`PROPAGATES` ops it feeds, breadth
    first; ORT leaves a value that a QuantizeLinear reads (and what follows it) as it is."""
    groups = [_next_edges(gr, r) for r, k in gr.readers.get(dq.output[0], []) if k is not None and _propagates(r)]
    done = 0
    while groups:
        edges = groups.pop(0)
        if not edges or any(index is None or _is(dst, "QuantizeLinear") for _, _, dst, index in edges):
            continue  # (an edge into a subgraph: see the module text)
        if any(_computes(dst) for _, _, dst, _ in edges):  # (see the module text)
            _insert_pair(gr, [e for e in edges if _computes(e[2])], dq, list(dq.attribute), list(dq.attribute))
            done += 1
        groups.extend(_next_edges(gr, dst) for _, _, dst, _ in edges if _propagates(dst))
    return done


def propagate_qdq(model) -> int:
    """ONNX Runtime's Q/DQ propagation (see the module text) on the top-level graph of ``model``;
    returns how many pairs were inserted."""
    from .fold import _set_nodes
    from .order import topological_order

    gr = _Graph(model.graph)
    original = list(gr.nodes)
    done = sum(_backward(gr, n) for n in original if _is(n, "QuantizeLinear") and _per_tensor(gr, n))
    done += sum(_forward(gr, n) for n in original if _is(n, "DequantizeLinear") and n.output and n.output[0]
                and _per_tensor(gr, n))
    if done:
        _set_nodes(model.graph, [gr.nodes[i] for i in topological_order(gr.nodes)])
    return done
