"""irgen's converters of torch's recurrent ops: ``aten.lstm.input``, ``aten.gru.input``,
``aten.rnn_tanh.input``, ``aten.rnn_relu.input`` (``torch.nn.LSTM``, ``GRU``, ``RNN``:
any number of layers, bidirectional, ``batch_first``, with or without initial states).
TVM 0.27 refuses more than one layer and imports only the output sequence.

Each layer and direction is unrolled one step at a time (:func:`irgen.plugin.unroll_recurrent`):
every binding of a step is recorded under the step's own provenance node
``<node>.l<layer>.<forward|reverse>.t<step>``, which layer forming makes one layer (named
after the module path, ``lstm.l0.forward.t3``), its outputs the step's states, compared
with ``<node>:h[layer, direction, step]`` (and ``:c``) that the source runner computes
(:func:`step_states`). The op's results (output sequence, ``h_n``, ``c_n``) are
concatenations of those states, each named after the ``getitem`` that reads it.
"""

from __future__ import annotations

from irgen.plugin import IrgenError

#: the ATen op (overload) -> the cell kind
KINDS = {"lstm.input": "lstm", "gru.input": "gru", "rnn_tanh.input": "rnn", "rnn_relu.input": "rnn"}


def _op(node) -> str:
    """``lstm.input`` for ``aten.lstm.input``."""
    return ".".join(str(node.target).split(".")[-2:])


def _args(node) -> dict:
    """(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)."""
    keys = ("input", "hx", "params", "has_biases", "num_layers", "dropout", "train", "bidirectional", "batch_first")
    defaults = (None, None, (), True, 1, 0.0, False, False, False)
    return {k: node.args[i] if len(node.args) > i else node.kwargs.get(k, d)
            for i, (k, d) in enumerate(zip(keys, defaults))}


def _weight(imp, p, node):
    """The numpy value of a weight node (a parameter or constant the program binds)."""
    import numpy as np
    import tvm

    bound = imp.ctx.bound.get(getattr(p, "name", None))
    if bound is not None:
        return bound.detach().numpy()
    expr = imp.env.get(p)
    if isinstance(expr, tvm.ir.Constant):  # a value torch computed at import (irgen_torch.fold)
        return np.asarray(expr.value.numpy())
    raise IrgenError(f"{imp.ctx.where}: node {node.name!r} ({node.target}): its weight {getattr(p, 'name', p)!r} "
                     f"is computed while the model runs; irgen needs constant recurrent weights")


def cells(imp, node, a: dict) -> list:
    """The op's cells, ``[layer][direction]``."""
    from irgen.plugin import RecurrentCell

    kind = KINDS[_op(node)]
    dirs = 2 if a["bidirectional"] else 1
    per = 4 if a["has_biases"] else 2
    weights = [_weight(imp, p, node) for p in a["params"]]
    if len(weights) != int(a["num_layers"]) * dirs * per:
        proj = kind == "lstm" and len(weights) == int(a["num_layers"]) * dirs * (per + 1)
        raise IrgenError(f"{imp.ctx.where}: node {node.name!r} ({node.target}): "
                         + ("an LSTM with proj_size is not supported" if proj else
                            f"{len(weights)} weights for {a['num_layers']} layer(s) of {dirs} direction(s)"))
    acts = ("relu",) if _op(node) == "rnn_relu.input" else None
    out = []
    for layer in range(int(a["num_layers"])):
        row = []
        for d in range(dirs):
            w_ih, w_hh, *b = weights[(layer * dirs + d) * per:(layer * dirs + d + 1) * per]
            row.append(RecurrentCell(kind, w_ih, w_hh, b[0] if b else None, b[1] if b else None, acts))
        out.append(row)
    return out


def _emitter(imp, node, layer: int, d: int):
    """``emit(t, expr, state)`` for the steps of one layer and direction: each binding
    recorded under the step's provenance node, a state under its source tensor."""
    from irgen.plugin import recurrent_state_tensor

    from .translate import module_path_name

    ctx = imp.ctx
    where = f"l{layer}.{'reverse' if d else 'forward'}"
    base = module_path_name(node)

    def emit(t: int, expr, state):
        key = f"{node.name}.{where}.t{t}"
        ctx.provenance.layer_names.setdefault(key, f"{base}.{where}.t{t}")
        tensor = recurrent_state_tensor(node.name, state, layer, d, t) if state else None
        var = ctx.namer(tensor) if tensor else ctx.namer.fresh(key)
        ctx.provenance.by_var[var] = (key, str(node.target), tensor)
        return imp.block_builder.emit(expr, name_hint=var)

    return emit


def _initial(state, k: int, emit, t0: int):
    """Item ``k`` of an initial state ``[L*D, B, H]`` (None: zeros), read in step ``t0``."""
    import numpy as np
    import tvm
    from tvm import relax

    if state is None:
        return None
    if isinstance(state, tvm.ir.Constant):
        v = np.asarray(state.value.numpy())[k]
        return relax.const(v) if v.any() else None
    return emit(t0, relax.op.take(state, relax.const(k, "int64"), axis=0), None)


def convert_recurrent(imp, node):
    # aten::lstm.input(input, hx[2], params, has_biases, num_layers, dropout, train, bidirectional, batch_first)
    # -> (output, h_n, c_n); aten::gru.input / rnn_tanh.input / rnn_relu.input(input, hx, ...) -> (output, h_n)
    from irgen.plugin import unroll_recurrent
    from tvm import relax

    a = _args(node)
    if a["train"]:
        raise IrgenError(f"{imp.ctx.where}: node {node.name!r} ({node.target}) runs in training mode; export the "
                         f"model after model.eval()")
    x = imp.env[a["input"]]
    steps = int(x.ty.shape.values[1 if a["batch_first"] else 0])
    hx = a["hx"] if isinstance(a["hx"], (list, tuple)) else [a["hx"]]
    h0, c0 = [imp.env[n] if n is not None else None for n in hx] + [None] * (2 - len(hx))
    grid = cells(imp, node, a)
    dirs = len(grid[0])
    states: dict[tuple[int, int], tuple[dict, dict]] = {}
    for layer, row in enumerate(grid):
        for d, cell in enumerate(row):
            emit = _emitter(imp, node, layer, d)
            order = list(range(steps))[::-1] if d else list(range(steps))
            if layer == 0:
                def inputs(t, emit=emit):
                    axis = 1 if a["batch_first"] else 0
                    return [emit(t, relax.op.take(x, relax.const(t, "int64"), axis=axis), None)]
            else:
                def inputs(t, layer=layer):
                    return [states[(layer - 1, e)][0][t] for e in range(dirs)]
            k = layer * dirs + d
            states[(layer, d)] = unroll_recurrent(cell, inputs, order, _initial(h0, k, emit, order[0]),
                                                  _initial(c0, k, emit, order[0]), emit)
    return _results(imp, node, states, len(grid), dirs, steps, bool(a["batch_first"]))


def _results(imp, node, states: dict, layers: int, dirs: int, steps: int, batch_first: bool) -> tuple:
    """The op's results from the states: the last layer's output sequence, then ``h_n``
    (and ``c_n``): each item's last binding named after the ``getitem`` that reads it."""
    from tvm import relax

    from irgen.plugin import concat_states

    bb = imp.block_builder
    hs = [states[(layers - 1, d)][0] for d in range(dirs)]
    batch, hidden = (int(v) for v in hs[0][0].ty.shape.values)
    items = [hs[d][t] for t in range(steps) for d in range(dirs)]
    if batch_first or dirs > 1:  # [B, T*D*H] -> [B, T, D*H] (-> [T, B, D*H])
        seq = concat_states(bb, items, 1, (batch, steps, dirs * hidden))
        if not batch_first:
            seq = relax.op.permute_dims(bb.emit(seq), [1, 0, 2])
    else:  # [T*B, H] -> [T, B, H]
        seq = concat_states(bb, items, 0, (steps, batch, hidden))
    out = [_result(imp, node, 0, seq)]
    for k in range(2 if states[(0, 0)][1] else 1):
        finals = [states[(layer, d)][k][steps - 1 if d == 0 else 0] for layer in range(layers) for d in range(dirs)]
        out.append(_result(imp, node, k + 1, concat_states(bb, finals, 0, (len(finals), batch, hidden))))
    return tuple(out)


def _result(imp, node, k: int, expr):
    """Result ``k`` of the op bound under its provenance node ``<node>.<item>`` and named after
    the ``getitem`` node that reads it (a result nothing reads keeps a name of its own)."""
    from .translate import module_path_name

    ctx = imp.ctx
    label = ("output", "h_n", "c_n")[k]
    reader = next((u.name for u in node.users if len(u.args) > 1 and u.args[1] == k), None)
    key = f"{node.name}.{label}"
    ctx.provenance.layer_names.setdefault(key, f"{module_path_name(node)}.{label}")
    var = ctx.namer(reader) if reader else ctx.namer.fresh(key)
    ctx.provenance.by_var[var] = (key, str(node.target), reader)
    return imp.block_builder.emit(expr, name_hint=var)


# ---------------------------------------------------------------- the source runner's states


def step_states(target: str, args: list) -> dict[str, object]:
    """The per-step states of one recurrent op, computed by torch's own op one step at a time
    from its previous step's states: ``{"h": [L, D, T, B, H], "c": ...}`` (numpy)."""
    import torch

    op = getattr(torch.ops.aten, target.split(".")[-2])
    a = dict(zip(("input", "hx", "params", "has_biases", "num_layers", "dropout", "train", "bidirectional",
                  "batch_first"), args))
    kind = KINDS[".".join(target.split(".")[-2:])]
    x = a["input"].transpose(0, 1) if a.get("batch_first") else a["input"]
    dirs = 2 if a.get("bidirectional") else 1
    per = 4 if a.get("has_biases", True) else 2
    hx = list(a["hx"]) if isinstance(a["hx"], (list, tuple)) else [a["hx"]]
    out: dict[str, list] = {"h": [], "c": []} if kind == "lstm" else {"h": []}
    with torch.no_grad():
        for layer in range(int(a.get("num_layers", 1))):
            per_dir = {s: [] for s in out}
            for d in range(dirs):
                k = layer * dirs + d
                params = list(a["params"][k * per:(k + 1) * per])
                state = [s[k:k + 1] for s in hx]
                seq = {s: [None] * x.shape[0] for s in out}
                for t in (range(x.shape[0] - 1, -1, -1) if d else range(x.shape[0])):
                    first = [state] if kind == "lstm" else state
                    res = op(x[t:t + 1], *first, params, a.get("has_biases", True), 1, 0.0, False, False, False)
                    state = list(res[1:])
                    for j, s in enumerate(out):
                        seq[s][t] = state[j][0]
                for s in out:
                    per_dir[s].append(torch.stack(seq[s]))
            x = torch.cat([h for h in per_dir["h"]], dim=-1)
            for s in out:
                out[s].append(torch.stack(per_dir[s]))
    return {s: torch.stack(v).numpy() for s, v in out.items()}
