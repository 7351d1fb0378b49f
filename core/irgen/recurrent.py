"""Recurrent layers (LSTM, GRU, RNN) unrolled into Relax ops, one cell step at a time.

A frontend's converter reads its recurrent op (ONNX ``LSTM``/``GRU``/``RNN``, torch's
``aten.lstm``/``gru``/``rnn_tanh``/``rnn_relu``) into one :class:`Cell` per layer and
direction, the weights in irgen's gate order (:data:`GATES`), and calls :func:`unroll`
for each. Every step is matmuls, adds, a ``split`` into the gates and the elementwise
activations and products, ops the numpy reference knows; the frontend's ``emit`` binds
each of them under the step's provenance node, so layer forming makes each step one
layer (:func:`irgen.layers.form_layers`: a recurrent node's bindings of one step), whose
outputs are the step's hidden state ``h`` and, for an LSTM, its cell state ``c``.
``docs/layer-ops.md`` lists what each step computes.

A step's input ``x_t`` may come in parts (the forward and reverse states of the layer
below in a bidirectional stack): each part is multiplied by its own columns of the input
weights, and the products added, so no concatenation is needed between layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from irgen.api import IrgenError

#: each kind's gates in irgen's order (torch's): the row blocks of ``w``, ``r`` and the biases
GATES = {"lstm": ("i", "f", "g", "o"), "gru": ("r", "z", "n"), "rnn": ("h",)}

#: the recurrent layer ops (``ir.json``'s ``op`` of a cell step)
RECURRENT_OPS = frozenset(GATES)

#: the longest sequence unrolled (each step is a layer of ~20 ops; a model file could ask for millions)
MAX_STEPS = 4096

#: source op types (lower case; an ATen op without its ``aten.`` and overload) -> the cell kind
_SOURCE_KINDS = {"lstm": "lstm", "gru": "gru", "rnn": "rnn", "rnn_tanh": "rnn", "rnn_relu": "rnn",
                 "dynamicquantizelstm": "lstm",  # an LSTM with int8 weights, its inputs quantized as it runs
                 "unidirectional_sequence_lstm": "lstm", "unidirectional_sequence_rnn": "rnn"}


def recurrent_kind(op_type: str) -> str | None:
    """The cell kind of a source op type (``LSTM``, ``aten.gru.input``, ``aten.rnn_tanh.input``),
    or None when it is no recurrent op."""
    t = op_type.lower()
    if t.startswith("aten."):
        t = t.split(".")[1]
    return _SOURCE_KINDS.get(t)


@dataclass
class Cell:
    """One direction of one recurrent layer, weights in :data:`GATES` order.

    ``w``: input weights ``[G*H, I]``; ``r``: recurrence weights ``[G*H, H]``; ``b_w``,
    ``b_r``: their biases ``[G*H]`` (or None); ``activations``: LSTM ``(f, g, h)``
    (default sigmoid, tanh, tanh), GRU ``(f, g)`` (sigmoid, tanh), RNN ``(f,)`` (tanh);
    ``linear_before_reset``: a GRU's new gate ``g(x W_n + b_wn + r * (h R_n + b_rn))``
    (torch's; ONNX attribute 1), else ``g(x W_n + b_wn + (r * h) R_n + b_rn)``; ``clip``:
    ONNX's cell clip, each gate's input clamped to ``[-clip, clip]`` before its activation
    (as ONNX Runtime does; an LSTM's cell state is not clipped before ``h(c)``)."""

    kind: str
    w: np.ndarray
    r: np.ndarray
    b_w: np.ndarray | None = None
    b_r: np.ndarray | None = None
    activations: tuple[str, ...] | None = None
    linear_before_reset: bool = True
    clip: float | None = None
    #: the Relax constants of the weights, made once: every step reads the same (one file of each)
    consts: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def hidden(self) -> int:
        return int(self.r.shape[1])

    def acts(self) -> tuple[str, ...]:
        return self.activations or {"lstm": ("sigmoid", "tanh", "tanh"), "gru": ("sigmoid", "tanh"),
                                    "rnn": ("tanh",)}[self.kind]


#: ``emit(t, expr, state)``: bind ``expr`` as part of step ``t`` (``state`` ``"h"`` or ``"c"``
#: for the step's hidden or cell state, None for the ops inside the step); returns the variable
Emit = Callable[[int, object, "str | None"], object]


def reorder(a: np.ndarray | None, order: list[int], gates: int) -> np.ndarray | None:
    """``a``'s row blocks (``gates`` of them along axis 0) in ``order`` (ONNX's ``iofc`` as
    irgen's ``ifgo``: ``[0, 2, 3, 1]``)."""
    if a is None:
        return None
    blocks = np.split(np.asarray(a), gates, axis=0)
    return np.concatenate([blocks[k] for k in order], axis=0)


def is_zero(expr) -> bool:
    """``expr`` is a constant of zeros (an initial state the exporter wrote as zeros: none)."""
    from irgen.graph import Constant

    return isinstance(expr, Constant) and not np.asarray(expr.value.numpy()).any()


def unroll(cell: Cell, inputs: Callable[[int], list], steps: list[int], h0, c0, emit: Emit
           ) -> tuple[dict[int, object], dict[int, object]]:
    """The states of ``cell`` over ``steps`` (the time indices in the order it runs them:
    reversed for a reverse direction): ``(h by t, c by t)`` (``c`` empty but for an LSTM).

    ``inputs(t)`` gives step ``t``'s input parts ``[B, I_k]`` (their widths add up to
    ``w``'s columns; it may emit, as part of step ``t``); ``h0``, ``c0`` the initial states
    ``[B, H]`` or None for zeros (the first step then has no recurrence term)."""
    if len(steps) > MAX_STEPS:
        raise IrgenError(f"a recurrent op over {len(steps)} time steps: irgen unrolls at most {MAX_STEPS} (one layer "
                         f"each); export the model over a shorter sequence")
    step = {"lstm": _lstm_step, "gru": _gru_step, "rnn": _rnn_step}[cell.kind]
    h, c = (None if h0 is None or is_zero(h0) else h0), (None if c0 is None or is_zero(c0) else c0)
    hs: dict[int, object] = {}
    cs: dict[int, object] = {}
    for t in steps:
        def bind(expr, state=None, t=t):
            return emit(t, expr, state)

        h, c = step(cell, inputs(t), h, c, bind)
        hs[t] = h
        if c is not None:
            cs[t] = c
    return hs, cs


def _const(cell: Cell, key: tuple, make: Callable[[], np.ndarray], dtype: str):
    """The constant ``make()`` of ``cell`` under ``key``, made on first use and the same
    Relax constant at every step after."""
    from tvm import relax

    c = cell.consts.get((key, dtype))
    if c is None:
        c = cell.consts[(key, dtype)] = relax.const(np.ascontiguousarray(make()).astype(dtype), dtype)
    return c


def _rows(rows: slice | None) -> tuple:
    return (None, None) if rows is None else (rows.start, rows.stop)


def _bias_const(cell: Cell, bias: np.ndarray, dtype: str):
    return _const(cell, ("b", bias.tobytes()), lambda: bias, dtype)


def _projection(cell: Cell, xs: list, bias: np.ndarray | None, bind, rows: slice | None = None):
    """``x_0 W_0^T (+ bias) + x_1 W_1^T ...`` over the gate rows ``rows`` (all by default): one
    matmul per input part, its weights transposed at import (``[I_k, rows]``), the bias added
    to the first (the layer's ``weight`` and ``bias``)."""
    from tvm import relax

    dtype = str(xs[0].ty.dtype)
    w = cell.w if rows is None else cell.w[rows]
    acc, col = None, 0
    for x in xs:
        width = int(x.ty.shape.values[-1])
        m = bind(relax.op.matmul(x, _const(cell, ("w", *_rows(rows), col, width), lambda c=col, n=width: w[:, c:c + n].T,
                                           dtype)))
        if acc is None and bias is not None:
            m = bind(relax.op.add(m, _bias_const(cell, bias if rows is None else bias[rows], dtype)))
        acc = m if acc is None else bind(relax.op.add(acc, m))
        col += width
    return acc


def _recurrence(cell: Cell, h, bind, rows: slice | None = None, bias: np.ndarray | None = None):
    """``h R^T (+ bias)`` over the gate rows ``rows``."""
    from tvm import relax

    dtype = str(h.ty.dtype)
    r = cell.r if rows is None else cell.r[rows]
    acc = bind(relax.op.matmul(h, _const(cell, ("r", *_rows(rows)), lambda: r.T, dtype)))
    return acc if bias is None else bind(relax.op.add(acc, _bias_const(cell, bias, dtype)))


def _act(name: str, x, cell: Cell, bind, state=None, clip: bool = True):
    """Activation ``name`` of ``x``, its input clipped first under ONNX's ``clip`` (``clip``)."""
    from tvm import relax

    if clip and cell.clip is not None:
        x = bind(relax.op.clip(x, -float(cell.clip), float(cell.clip)))
    fn = {"sigmoid": relax.op.sigmoid, "tanh": relax.op.tanh, "relu": relax.op.nn.relu}[name]
    return bind(fn(x), state)


def _bias(cell: Cell) -> np.ndarray | None:
    """``b_w + b_r``, or the one given, or None."""
    if cell.b_w is None:
        return cell.b_r
    return cell.b_w if cell.b_r is None else cell.b_w + cell.b_r


def _gates(x, n: int, bind) -> list:
    """``x``'s last axis split into ``n`` equal gates."""
    from tvm import relax

    parts = bind(relax.op.split(x, n, axis=-1))
    return [bind(relax.TupleGetItem(parts, k)) for k in range(n)]


def _lstm_step(cell: Cell, xs: list, h, c, bind):
    """``i, f, g, o = split(x W^T + h R^T + b)``; ``c' = f(f)·c + f(i)·g(g)``; ``h' = f(o)·h(c')``."""
    from tvm import relax

    f_act, g_act, h_act = cell.acts()
    acc = _projection(cell, xs, _bias(cell), bind)
    if h is not None:
        acc = bind(relax.op.add(acc, _recurrence(cell, h, bind)))
    if cell.clip is not None:  # every gate's input, once (not the cell state before h(c'): as ONNX Runtime)
        acc = bind(relax.op.clip(acc, -float(cell.clip), float(cell.clip)))
    i, f, g, o = _gates(acc, 4, bind)
    i, g = _act(f_act, i, cell, bind, clip=False), _act(g_act, g, cell, bind, clip=False)
    if c is None:
        c_new = bind(relax.op.multiply(i, g), "c")
    else:
        fc = bind(relax.op.multiply(_act(f_act, f, cell, bind, clip=False), c))
        c_new = bind(relax.op.add(fc, bind(relax.op.multiply(i, g))), "c")
    o = _act(f_act, o, cell, bind, clip=False)
    return bind(relax.op.multiply(o, _act(h_act, c_new, cell, bind, clip=False)), "h"), c_new


def _gru_step(cell: Cell, xs: list, h, c, bind):
    """``r, z = f(x W_rz^T + h R_rz^T + b_rz)``; ``n = g(x W_n^T + b_wn + r·(h R_n^T + b_rn))``
    (linear before reset; else ``g(x W_n^T + b_wn + (r·h) R_n^T + b_rn)``);
    ``h' = n + z·(h - n)`` (``= (1 - z)·n + z·h``, as torch computes it)."""
    from tvm import relax

    f_act, g_act = cell.acts()
    rz, n = slice(0, 2 * cell.hidden), slice(2 * cell.hidden, 3 * cell.hidden)
    b_rn = None if cell.b_r is None else cell.b_r[n]
    bias = _bias(cell)
    if cell.linear_before_reset and b_rn is not None:  # b_rn stays inside r·(...)
        b_wn = cell.b_w[n] if cell.b_w is not None else np.zeros_like(b_rn)
        bias = np.concatenate([bias[rz], b_wn])
    x_rz, x_n = _split2(_projection(cell, xs, bias, bind), 2 * cell.hidden, bind)
    pre_rz = x_rz if h is None else bind(relax.op.add(x_rz, _recurrence(cell, h, bind, rz)))
    r, z = _gates(_act(f_act, pre_rz, cell, bind), 2, bind)
    if cell.linear_before_reset:
        hn = _recurrence(cell, h, bind, n, b_rn) if h is not None else \
            None if b_rn is None else _bias_const(cell, b_rn, str(x_n.ty.dtype))
        pre = x_n if hn is None else bind(relax.op.add(x_n, bind(relax.op.multiply(r, hn))))
    else:
        pre = x_n if h is None else bind(relax.op.add(x_n, _recurrence(cell, bind(relax.op.multiply(r, h)), bind, n)))
    n_t = _act(g_act, pre, cell, bind)
    if h is None:
        return bind(relax.op.subtract(n_t, bind(relax.op.multiply(z, n_t))), "h"), None
    return bind(relax.op.add(n_t, bind(relax.op.multiply(z, bind(relax.op.subtract(h, n_t))))), "h"), None


def _split2(x, first: int, bind) -> list:
    """``x``'s last axis split after ``first`` columns (a GRU's ``r, z`` and ``n``)."""
    from tvm import relax

    parts = bind(relax.op.split(x, [first], axis=-1))
    return [bind(relax.TupleGetItem(parts, k)) for k in range(2)]


def _rnn_step(cell: Cell, xs: list, h, c, bind):
    """``h' = f(x W^T + h R^T + b)``."""
    from tvm import relax

    acc = _projection(cell, xs, _bias(cell), bind)
    if h is not None:
        acc = bind(relax.op.add(acc, _recurrence(cell, h, bind)))
    return _act(cell.acts()[0], acc, cell, bind, "h"), None


# ---------------------------------------------------------------- per-step source tensors


def states_tensor(node: str, state: str) -> str:
    """The name under which a frontend's source runner gives a recurrent node's per-step
    states: ``<node>:h`` (``<node>:c``, an LSTM's cell states), ``[L, D, T, B, H]`` (layers,
    directions, steps in time order, batch, hidden): the runtime's own op run one step at
    a time from its previous step's states (the op itself outputs only the last step's)."""
    return f"{node}:{state}"


def state_tensor(node: str, state: str, layer: int, direction: int, step: int) -> str:
    """The source tensor of one step's state: ``<node>:h[layer, direction, step]``, an item
    of :func:`states_tensor` (``[B, H]``)."""
    return f"{states_tensor(node, state)}[{layer}, {direction}, {step}]"


def concat_states(bb, items: list, axis: int, shape: tuple):
    """``items`` (states ``[B, H]``) concatenated along ``axis`` (bound with ``bb``), then
    reshaped to ``shape`` (returned unbound: the caller names the result)."""
    from tvm import relax

    x = items[0] if len(items) == 1 else bb.emit(relax.op.concat(items, axis=axis))
    return relax.op.reshape(x, [int(d) for d in shape])
