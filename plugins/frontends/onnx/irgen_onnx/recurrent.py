"""irgen's converters of ONNX's recurrent ops ``LSTM``, ``GRU`` and ``RNN`` (TVM 0.27 has none).

Every attribute the exporters write: ``direction`` (forward, reverse, bidirectional),
``hidden_size``, ``layout`` 0 or 1, ``activations`` among Sigmoid, Tanh and Relu (the
defaults, or an RNN's Relu), ``clip``, GRU's ``linear_before_reset``; inputs
``sequence_lens`` absent or the full length, ``initial_h`` / ``initial_c`` present or
not, no peepholes ``P`` (or zeros); outputs ``Y``, ``Y_h``, ``Y_c``. Constant weights
only (a quantized LSTM's dequantized weights are refused, naming the node).

Each direction is unrolled one step at a time (:func:`irgen.plugin.unroll_recurrent`):
every binding of a step is recorded under the step's own provenance node
``<node>.<forward|reverse>.t<step>``, which layer forming makes one layer, its outputs the
step's states, compared with ``<node>:h[0, direction, step]`` (and ``:c``) that the source
runner computes (:func:`step_states`). ``Y``, ``Y_h`` and ``Y_c`` are concatenations of
those states, layers named ``<node>.Y``, ``<node>.Y_h``, ``<node>.Y_c``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from irgen.plugin import IrgenError

#: ONNX gate order -> irgen's (LSTM ``iofc`` -> ``ifgo``, GRU ``zrh`` -> ``rzn``)
_ORDER = {"LSTM": [0, 2, 3, 1], "GRU": [1, 0, 2], "RNN": [0]}
_KIND = {"LSTM": "lstm", "GRU": "gru", "RNN": "rnn",
         "DynamicQuantizeLSTM": "lstm"}  # ONNX Runtime's, int8 weights (:mod:`irgen_onnx.dynamic_lstm`)
_ACTS = {"LSTM": 3, "GRU": 2, "RNN": 1}


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _refuse(node, why: str) -> IrgenError:
    return IrgenError(f"onnx frontend: node {node.name or node.output[0]!r} ({node.op_type}): {why}")


def _constant(expr, node, what: str) -> np.ndarray | None:
    """The value of an optional constant input (None when absent)."""
    import tvm

    if expr is None:
        return None
    if not isinstance(expr, tvm.ir.Constant):
        raise _refuse(node, f"its {what} is computed while the model runs (a quantized recurrent op?); irgen "
                            f"needs constant recurrent weights")
    return np.asarray(expr.value.numpy())


def _activations(node, attrs: dict, dirs: int) -> list[tuple[str, ...] | None]:
    """Each direction's activations (None: the defaults)."""
    names = [_text(a).lower() for a in attrs.get("activations") or []]
    if attrs.get("activation_alpha") or attrs.get("activation_beta"):
        raise _refuse(node, "activation_alpha / activation_beta are not supported")
    if not names:
        return [None] * dirs
    n = _ACTS[node.op_type]
    bad = [a for a in names if a not in ("sigmoid", "tanh", "relu")]
    if bad or len(names) != n * dirs:
        raise _refuse(node, f"activations {names} are not supported (Sigmoid, Tanh and Relu, {n} per direction)")
    return [tuple(names[d * n:(d + 1) * n]) for d in range(dirs)]


def cells(node, inputs: list, attrs: dict) -> list:
    """One :class:`irgen.plugin.RecurrentCell` per direction, weights in irgen's gate order."""
    from irgen.plugin import RecurrentCell, reorder_gates

    kind, order = _KIND[node.op_type], _ORDER[node.op_type]
    w, r = _constant(inputs[1], node, "W"), _constant(inputs[2], node, "R")
    b = _constant(inputs[3] if len(inputs) > 3 else None, node, "B")
    p = _constant(inputs[7] if len(inputs) > 7 else None, node, "P")
    if p is not None and p.any():
        raise _refuse(node, "peephole weights (P) are not supported")
    if int(attrs.get("input_forget", 0)):
        raise _refuse(node, "input_forget=1 is not supported")
    dirs = w.shape[0]
    acts = _activations(node, attrs, dirs)
    clip = attrs.get("clip")
    out = []
    for d in range(dirs):
        gates = len(order)
        b_w, b_r = (None, None) if b is None else np.split(b[d], 2)
        out.append(RecurrentCell(kind, reorder_gates(w[d], order, gates), reorder_gates(r[d], order, gates),
                                 reorder_gates(b_w, order, gates), reorder_gates(b_r, order, gates), acts[d],
                                 bool(int(attrs.get("linear_before_reset", 0))) if kind == "gru" else True,
                                 None if clip is None else float(clip)))
    return out


def _check_lengths(node, inputs: list, steps: int) -> None:
    lens = _constant(inputs[4] if len(inputs) > 4 else None, node, "sequence_lens")
    if lens is not None and (lens != steps).any():
        raise _refuse(node, f"sequence_lens {lens.tolist()} shorter than the sequence ({steps} steps) are not "
                            f"supported")


def _emitter(bb, ctx, node, d: int, name: str):
    """``emit(t, expr, state)`` for one direction's steps: each binding recorded under the
    step's provenance node ``<node>.<name>.t<t>``, a state under its source tensor."""
    from irgen.plugin import recurrent_state_tensor

    base = _base(node, ctx.recurrent_names)

    def emit(t: int, expr, state):
        key = f"{base}.{name}.t{t}"
        tensor = recurrent_state_tensor(base, state, 0, d, t) if state else None
        var = ctx.namer(tensor) if tensor else ctx.namer.fresh(key)
        ctx.provenance.by_var[var] = (key, node.op_type, tensor)
        return bb.emit(expr, name_hint=var)

    return emit


def base_names(graph) -> dict[str, str]:
    """The name each recurrent node's steps and states go by, by its first named output: the
    node's name, or (a node without a name, or one whose name another node has too) that
    output's, which no other node has."""
    from collections import Counter

    named = Counter(n.name for n in graph.node if n.name)
    return {out: n.name if n.name and named[n.name] == 1 else out
            for n in graph.node if n.op_type in _KIND for out in [next((o for o in n.output if o), "")]}


def _base(node, bases: dict[str, str]) -> str:
    return bases.get(next((o for o in node.output if o), ""), node.name or node.op_type)


def _initial(expr, d: int, axis: int, emit, t0: int):
    """Direction ``d`` of an initial state (``[D, B, H]``, layout 1 ``[B, D, H]``; None: zeros)."""
    import tvm
    from tvm import relax

    if expr is None:
        return None
    if isinstance(expr, tvm.ir.Constant):
        v = np.take(np.asarray(expr.value.numpy()), d, axis=axis)
        return relax.const(v) if v.any() else None
    return emit(t0, relax.op.take(expr, relax.const(d, "int64"), axis=axis), None)


def convert(bb, inputs: list, attrs: dict, opset: int, ctx: Any):
    """ONNX ``LSTM`` / ``GRU`` / ``RNN`` -> its steps, then ``Y``, ``Y_h`` (``Y_c``)."""
    from irgen.plugin import unroll_recurrent
    from tvm import relax

    node = ctx.current
    layout = int(attrs.get("layout", 0))
    x = inputs[0]
    steps = int(x.ty.shape.values[1 if layout else 0])
    _check_lengths(node, inputs, steps)
    direction = _text(attrs.get("direction", b"forward"))
    grid = cells(node, inputs, attrs)
    names = ["forward", "reverse"] if direction == "bidirectional" else [direction]
    h0s = inputs[5] if len(inputs) > 5 else None
    c0s = inputs[6] if len(inputs) > 6 else None
    states = []
    for d, cell in enumerate(grid):
        emit = _emitter(bb, ctx, node, d, names[d])
        order = list(range(steps))[::-1] if names[d] == "reverse" else list(range(steps))

        def inputs_at(t, emit=emit):
            return [emit(t, relax.op.take(x, relax.const(t, "int64"), axis=1 if layout else 0), None)]

        states.append(unroll_recurrent(cell, inputs_at, order, _initial(h0s, d, layout, emit, order[0]),
                                       _initial(c0s, d, layout, emit, order[0]), emit))
    return _results(bb, ctx, node, states, names, steps, layout)


def _results(bb, ctx, node, states: list, names: list[str], steps: int, layout: int):
    """``Y`` ``[T, D, B, H]`` (layout 1 ``[B, T, D, H]``), ``Y_h`` and ``Y_c`` ``[D, B, H]``
    (``[B, D, H]``), each bound under its output's name (a tuple of the node's outputs)."""
    from irgen.plugin import concat_states
    from tvm import relax

    dirs = len(states)
    batch, hidden = (int(v) for v in states[0][0][0].ty.shape.values)
    items = [states[d][0][t] for t in range(steps) for d in range(dirs)]
    y = concat_states(bb, items, layout, (batch, steps, dirs, hidden) if layout else (steps, dirs, batch, hidden))
    finals = [[states[d][k][steps - 1 if names[d] == "forward" else 0] for d in range(dirs)]
              for k in range(2 if states[0][1] else 1)]
    shape = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    exprs = [y, *(concat_states(bb, f, layout, shape) for f in finals)]
    out = []
    for k, expr in enumerate(exprs[:len(node.output)]):
        tensor = node.output[k]
        if not tensor:
            out.append(relax.const(0.0, "float32"))  # an output the node does not name: read by no one
            continue
        var = ctx.namer(tensor)
        ctx.provenance.by_var[var] = (f"{_base(node, ctx.recurrent_names)}.{('Y', 'Y_h', 'Y_c')[k]}", node.op_type,
                                      tensor)
        out.append(bb.emit(expr, name_hint=var))
    return out[0] if len(out) == 1 else relax.Tuple(out)  # (TVM's importer takes one output as it is)


# ---------------------------------------------------------------- the source runner's states


def step_states(model, node, values: dict) -> dict[str, np.ndarray]:
    """The per-step states of recurrent ``node`` (``{"h": [1, D, T, B, H], "c": ...}``), computed
    by ONNX Runtime one step at a time from its previous step's states: a one-step model of
    the node per direction (its attributes, that direction's weights) run ``T`` times.
    ``values``: the tensors the node reads (initializers included), by name."""
    from onnx import helper

    from . import dynamic_lstm
    from .runner import inference_session

    if node.op_type == dynamic_lstm.OP:
        return dynamic_lstm.step_states(node, values)

    def value(k):
        name = node.input[k] if len(node.input) > k else ""
        return np.asarray(values[name]) if name else None

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    layout = int(attrs.get("layout", 0))
    x = value(0) if not layout else np.swapaxes(value(0), 0, 1)  # [T, B, I]
    w, r, b = value(1), value(2), value(3)
    dirs, hidden = w.shape[0], r.shape[-1]
    init = [value(5), value(6) if node.op_type == "LSTM" else None]
    init = [None if v is None else (np.swapaxes(v, 0, 1) if layout else v) for v in init]  # [D, B, H]
    n_out = 2 if node.op_type == "LSTM" else 1
    out = {s: np.zeros((1, dirs, x.shape[0], x.shape[1], hidden), x.dtype) for s in ("h", "c")[:n_out]}
    reverse = [_text(attrs.get("direction", b"forward")) == "reverse"] if dirs == 1 else [False, True]
    acts = [_text(a) for a in attrs.get("activations") or []]
    per = len(acts) // dirs if acts else 0
    for d in range(dirs):
        keep = {k: v for k, v in attrs.items() if k not in ("direction", "layout", "activations")}
        if acts:
            keep["activations"] = acts[d * per:(d + 1) * per]
        sess = inference_session(_one_step_model(node.op_type, keep, w[d:d + 1], r[d:d + 1],
                                                 None if b is None else b[d:d + 1], x).SerializeToString(),
                                 False)
        state = [np.zeros((1, x.shape[1], hidden), x.dtype) if v is None else v[d:d + 1] for v in init[:n_out]]
        for t in (range(x.shape[0] - 1, -1, -1) if reverse[d] else range(x.shape[0])):
            feeds = {"x": x[t:t + 1], "h": state[0], **({"c": state[1]} if n_out == 2 else {})}
            state = sess.run(None, feeds)
            for j, s in enumerate(out):
                out[s][0, d, t] = state[j][0]
    return out


def _one_step_model(op_type: str, attrs: dict, w, r, b, x):
    """A model of one ``op_type`` node (forward, layout 0) over one step of ``x`` ``[T, B, I]``:
    inputs ``x``, ``h`` (``c``), outputs ``Y_h`` (``Y_c``)."""
    from onnx import helper, numpy_helper

    elem = helper.np_dtype_to_tensor_dtype(x.dtype)
    lstm = op_type == "LSTM"
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(r, "R")]
    if b is not None:
        inits.append(numpy_helper.from_array(b, "B"))
    ins = ["x", "W", "R", "B" if b is not None else "", "", "h"] + (["c"] if lstm else [])
    outs = ["", "Y_h"] + (["Y_c"] if lstm else [])
    node = helper.make_node(op_type, ins, outs, **attrs)
    state = [1, x.shape[1], r.shape[-1]]
    io = [helper.make_tensor_value_info("x", elem, [1, *x.shape[1:]])]
    io += [helper.make_tensor_value_info(n, elem, state) for n in ("h", "c")[:2 if lstm else 1]]
    graph = helper.make_graph([node], "step", io, [helper.make_tensor_value_info(n, elem, state) for n in outs[1:]],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)


def states_wanted(model, tensors: list[str]) -> dict[str, Any]:
    """The recurrent nodes whose per-step states (``<node>:h``, ``<node>:c``) ``tensors`` name, by name."""
    from irgen.plugin import recurrent_states_tensor

    wanted, bases = set(tensors), base_names(model.graph)
    return {_base(n, bases): n for n in model.graph.node if n.op_type in _KIND
            and any(recurrent_states_tensor(_base(n, bases), s) in wanted for s in ("h", "c"))}


def states_values(model, nodes: dict[str, Any], values: dict[str, Any]) -> dict[str, np.ndarray]:
    """``<node>:h`` (``:c``) of each of ``nodes`` (:func:`step_states`); ``values`` holds the
    tensors the runtime computed and the model inputs, the initializers are read here."""
    from irgen.plugin import recurrent_states_tensor

    from .loader import tensor_array  # a large weight the loader left in its file is read now

    inits = {i.name: i for i in model.graph.initializer}
    out: dict[str, np.ndarray] = {}
    for base, node in nodes.items():
        known = {n: values[n] if n in values else tensor_array(inits[n]) for n in node.input
                 if n and (n in values or n in inits)}
        for state, v in step_states(model, node, known).items():
            out[recurrent_states_tensor(base, state)] = v
    return out
