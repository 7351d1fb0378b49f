"""irgen's converters of TFLite's fused recurrent ops ``UNIDIRECTIONAL_SEQUENCE_LSTM`` and
``UNIDIRECTIONAL_SEQUENCE_RNN`` (float), which tf_keras' LSTM and SimpleRNN convert to
(Keras 3 writes a ``WHILE`` loop instead: :mod:`irgen_tensorflow.loops`). TVM's converter
takes a coupled input-forget LSTM only.

Each op is unrolled one step at a time (:func:`irgen.plugin.unroll_recurrent`), every binding
of step ``t`` recorded under the provenance node ``<OP>_<i>.forward.t<t>``, which layer forming
makes one ``lstm`` / ``rnn`` layer, its outputs the step's states
(``<OP>_<i>:h[0, 0, t]``, ``:c``; the TFLite interpreter does not give them, so the source check
compares the op's output only). TFLite's gate order (``i, f, c, o``) is irgen's; its cell
computes ``i, f, o = sigmoid(.)``, ``g = act(.)``, ``h = o * act(c)`` with ``act`` the op's fused
activation (TANH, RELU or LOGISTIC). The states start at zero (TFLite's variable tensors) or
from a constant or graph tensor. Refused by name: peepholes, projection, layer normalization,
no input gate (CIFG), a cell or projection clip, and quantized (int8 or dynamic-range) weights.
"""

from __future__ import annotations

import numpy as np

#: TFLite fused activation -> irgen's activation name
_ACTS = {"TANH": "tanh", "RELU": "relu", "SIGMOID": "sigmoid", "LOGISTIC": "sigmoid"}
#: UNIDIRECTIONAL_SEQUENCE_LSTM's optional inputs irgen refuses when present
_LSTM_UNSUPPORTED = {9: "peephole", 10: "peephole", 11: "peephole", 16: "projection", 17: "projection",
                     20: "layer normalization", 21: "layer normalization", 22: "layer normalization",
                     23: "layer normalization"}


def _refuse(conv, why: str):
    from irgen.plugin import IrgenError

    current = conv.irgen_state.get("current") or ("?", "?")
    return IrgenError(f"{conv.irgen_where}: op {current[0]} ({current[1]}): {why}")


def _options(conv, op, cls):
    table = op.BuiltinOptions()
    options = cls()
    if table is not None:
        options.Init(table.Bytes, table.Pos)
    return options


def _activation(conv, fn: int) -> str:
    name = conv.activation_fn_type.get(fn, f"#{fn}")  # TVM's map: enum value -> name
    if name not in _ACTS:
        raise _refuse(conv, f"the fused activation {name} is not supported (TANH, RELU, LOGISTIC)")
    return _ACTS[name]


def _weights(conv, op, indices: list[int], what: str) -> list[np.ndarray]:
    """The float constant inputs at ``indices`` (all must be present)."""
    ins = op.InputsAsNumpy()
    out = []
    for k in indices:
        t = conv.get_tensors([int(ins[k])])[0] if k < len(ins) and ins[k] >= 0 else None
        if t is None:
            raise _refuse(conv, f"its {what} (input {k}) is missing (a coupled input-forget LSTM?), which irgen "
                                "does not support")
        if t.qnn_params is not None or conv.get_tensor_type_str(t.tensor.Type()) != "float32":
            raise _refuse(conv, "quantized recurrent weights are not supported (TFLite's integer LSTM/RNN kernels "
                                "are not implemented in irgen)")
        if t.buffer is None or not t.buffer.DataLength():
            raise _refuse(conv, f"its {what} (input {k}) is computed while the model runs; irgen needs constant "
                                "recurrent weights")
        out.append(np.asarray(conv.get_tensor_value(t), np.float32))
    return out


def _state(conv, op, k: int):
    """The initial state at input ``k``: None (zeros) for a variable tensor or zeros."""
    import tvm

    idx = int(op.InputsAsNumpy()[k])
    t = conv.get_tensors([idx])[0]
    if t.tensor.IsVariable() and not conv.has_expr(idx):
        return None
    expr = conv.get_tensor_expr(t)
    if isinstance(expr, tvm.ir.Constant) and not np.asarray(expr.value.numpy()).any():
        return None
    return expr


def _emitter(conv, node: str, op_type: str):
    """``emit(t, expr, state)``: each binding recorded under the step's node ``<node>.forward.t<t>``."""
    from irgen.plugin import recurrent_state_tensor

    namer, by_var = conv.irgen_namer, conv.irgen_provenance.by_var

    def emit(t: int, expr, state):
        key = f"{node}.forward.t{t}"
        tensor = recurrent_state_tensor(node, state, 0, 0, t) if state else None
        var = namer(tensor) if tensor else namer.fresh(key)
        by_var[var] = (key, op_type, tensor)
        return conv.bb.emit(expr, name_hint=var)

    return emit


def _unroll(conv, op, cell, time_major: bool, h0, c0):
    """The op's output ``[B, T, H]`` (time major ``[T, B, H]``): ``cell`` unrolled over the input."""
    from tvm import relax

    from irgen.plugin import concat_states, unroll_recurrent

    node, op_type = conv.irgen_state["current"]
    x = conv.get_tensor_expr(conv.get_input_tensors(op)[0])
    shape = [int(d) for d in x.ty.shape.values]
    if len(shape) != 3:
        raise _refuse(conv, f"an input of rank {len(shape)} is not supported (3: batch, time, features)")
    steps, batch = (shape[0], shape[1]) if time_major else (shape[1], shape[0])
    emit = _emitter(conv, node, op_type)

    def inputs_at(t: int):
        return [emit(t, relax.op.take(x, relax.const(t, "int64"), axis=0 if time_major else 1), None)]

    hs, _ = unroll_recurrent(cell, inputs_at, list(range(steps)), h0, c0, emit)
    out = (steps, batch, cell.hidden) if time_major else (batch, steps, cell.hidden)
    return concat_states(conv.bb, [hs[t] for t in range(steps)], 0 if time_major else 1, out)


def convert_sequence_lstm(conv, op):
    """UNIDIRECTIONAL_SEQUENCE_LSTM (float): irgen's ``lstm`` steps."""
    from tflite.UnidirectionalSequenceLSTMOptions import UnidirectionalSequenceLSTMOptions

    from irgen.plugin import RecurrentCell

    ins = op.InputsAsNumpy()
    present = sorted({what for k, what in _LSTM_UNSUPPORTED.items() if k < len(ins) and ins[k] >= 0})
    if present:
        raise _refuse(conv, f"{', '.join(present)} weights are not supported")
    options = _options(conv, op, UnidirectionalSequenceLSTMOptions)
    if options.CellClip() or options.ProjClip():
        raise _refuse(conv, f"cell_clip {options.CellClip():g} / proj_clip {options.ProjClip():g} are not supported")
    act = _activation(conv, options.FusedActivationFunction())
    w = _weights(conv, op, [1, 2, 3, 4], "input weights")
    r = _weights(conv, op, [5, 6, 7, 8], "recurrent weights")
    b = _weights(conv, op, [12, 13, 14, 15], "gate biases")
    cell = RecurrentCell("lstm", np.concatenate(w), np.concatenate(r), np.concatenate(b), None,
                         ("sigmoid", act, act))
    return _unroll(conv, op, cell, bool(options.TimeMajor()), _state(conv, op, 18), _state(conv, op, 19))


def convert_sequence_rnn(conv, op):
    """UNIDIRECTIONAL_SEQUENCE_RNN (float): irgen's ``rnn`` steps."""
    from tflite.SequenceRNNOptions import SequenceRNNOptions

    from irgen.plugin import RecurrentCell

    options = _options(conv, op, SequenceRNNOptions)
    act = _activation(conv, options.FusedActivationFunction())
    w, r, b = _weights(conv, op, [1, 2, 3], "weights")
    cell = RecurrentCell("rnn", w, r, b, None, (act,))
    return _unroll(conv, op, cell, bool(options.TimeMajor()), _state(conv, op, 4), None)
