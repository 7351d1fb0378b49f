"""ONNX Runtime's ``com.microsoft.DynamicQuantizeLSTM`` (what ``quantize_dynamic`` makes of an
``LSTM``), unrolled one step at a time as the float ``LSTM`` is (:mod:`irgen_onnx.recurrent`),
each step computing what ONNX Runtime's CPU kernel computes, to the bit.

The kernel (``DynamicQuantizeLSTM`` -> ``UniDirectionalLstm::Compute`` with ``uint8``
weights, ``rnn::detail::ComputeGemm``) per direction:

* ``X`` (all steps and batch rows at once) and, at each step, the previous ``h`` (``[B, H]``;
  zeros at the first step without an initial state) are quantized to uint8 with parameters
  of their own range (``GetQuantizationParameter``): ``lo = min(min x, 0)``,
  ``hi = max(max x, 0)``, ``scale = hi == lo ? 1 : (hi - lo) / 255``,
  ``zp = round_half_even(clamp(0 - lo / scale, 0, 255))`` (float32), and
  ``q = clamp(round_half_even(x / scale) + zp, 0, 255)`` (``MlasQuantizeLinear``);
* ``acc = Σ (q - zp) · w`` in int32 (``W``, ``R`` int8 with zero point 0, or uint8 less
  their one zero point), scaled by ``m = scale · w_scale`` (float32; per tensor or per
  output column): ``gates = float(acc_x) · m_x``, then ``gates + float(acc_h) · m_h``
  (MLAS's output processor: a multiply, then an add), then ``+ (b_W + b_R)`` (float32),
  clipped under ``clip``;
* ``i, f, o = σ(...)``, ``g = tanh(...)``, ``c' = c·f + i·g``, ``h' = tanh(c')·o``, with MLAS's
  own ``MlasComputeLogistic`` / ``MlasComputeTanh`` (x86 FMA3 kernels: odd rational
  approximations evaluated with fused multiply-adds, :data:`LOGISTIC`, :data:`TANH`).

Each step is a layer (``op`` ``lstm``) whose ``fused_ops`` spell all of that: ``min`` / ``max``
of the whole input sequence (every step reads it, as the float LSTM's steps do), the scale
and zero point, the quantization of its row, the int32 ``matmul`` by the int8 weights
(parameters ``weight``, ``weight1``), the rescale, and the activations as ``relax.sigmoid`` /
``relax.tanh`` kernels whose ``approximation`` attribute gives the polynomial the numpy
reference evaluates (:func:`irgen.reference.rational_fma`).

The per-step source states (:func:`step_states`): ONNX Runtime's node run one step at a time
from the previous step's states, its input widened by two columns that hold the whole
sequence's minimum and maximum, multiplied by weight rows of zero: the step's input is then
quantized with the sequence's parameters, as in the full run, and the zero rows add nothing
to the int32 sums.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from irgen.plugin import IrgenError

from . import recurrent as rec

OP = "DynamicQuantizeLSTM"

#: MLAS's logistic (``MlasLogisticKernelFma3``): ``max(v·P(v²)/Q(v²) + 0.5, 0)``, ``v`` clamped to ±18
LOGISTIC = {"clamp": [-18.0, 18.0],
            "p": [4.37031012579801e-11, 1.15627324459942e-07, 6.08574864600143e-05, 8.51377133304701e-03,
                  2.48287947061529e-01],
            "q": [6.10247389755681e-13, 5.76102136993427e-09, 6.29106785017040e-06, 1.70198817374094e-03,
                  1.16817656904453e-01, 9.93151921023180e-01],
            "offset": 0.5, "floor": 0.0,
            "rule": "ONNX Runtime's MlasComputeLogistic (x86 FMA3 kernel)"}
#: MLAS's tanh (x86 FMA3 kernel): ``v·P(v²)/Q(v²)``, ``v`` clamped to ±9
TANH = {"clamp": [-9.0, 9.0],
        "p": [-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11, 5.12229709037114e-08,
              1.48572235717979e-05, 6.37261928875436e-04, 4.89352455891786e-03],
        "q": [1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03],
        "rule": "ONNX Runtime's MlasComputeTanh (x86 FMA3 kernel)"}

_ACTS = {"sigmoid": ("relax.sigmoid", LOGISTIC), "tanh": ("relax.tanh", TANH)}


def _refuse(node, why: str) -> IrgenError:
    return IrgenError(f"onnx frontend: node {node.name or node.output[0]!r} ({node.op_type}): {why}")


# ---------------------------------------------------------------- the activations' kernels


def _kernel(shape: list[int], spec: dict):
    """The TIR kernel of ``spec`` over a float32 tensor of ``shape`` (``llvm.fma``: one rounding)."""
    from tvm import te, tirx

    f = lambda v: tirx.const(np.float32(v), "float32")  # noqa: E731

    def fma(a, b, c):
        return tirx.call_llvm_pure_intrin("float32", "llvm.fma", a, b, c)

    shape = [tirx.IntImm("int64", int(v)) for v in shape]  # Relax's shapes are int64
    x = te.placeholder(shape, "float32", name="x")

    def body(*i):
        v = tirx.min(tirx.max(x(*i), f(spec["clamp"][0])), f(spec["clamp"][1]))
        v2 = v * v
        p, q = (fma(v2, f(c[0]), f(c[1])) for c in (spec["p"], spec["q"]))
        for c in spec["p"][2:]:
            p = fma(p, v2, f(c))
        for c in spec["q"][2:]:
            q = fma(q, v2, f(c))
        r = (v * p) / q
        if spec.get("offset"):
            r = r + f(spec["offset"])
        return tirx.max(r, f(spec["floor"])) if spec.get("floor") is not None else r

    y = te.compute(shape, body, name="y")
    return te.create_prim_func([x, y])


def activation(bb, x, name: str):
    """MLAS's ``name`` (sigmoid, tanh) of float32 ``x``: a ``call_tir`` of its kernel."""
    from irgen.plugin import add_kernel
    from tvm import relax

    op, spec = _ACTS[name]
    shape = [int(v) for v in x.ty.shape.values]
    attrs = {"approximation": spec}
    digest = hashlib.sha256(json.dumps([shape, attrs], sort_keys=True).encode()).hexdigest()[:12]
    kernel = f"mlas_{name}_{digest}"
    gv = add_kernel(bb, _kernel(shape, spec).with_attr("global_symbol", kernel), kernel, op, attrs)
    return relax.call_tir(gv, relax.Tuple([x]), relax.TensorType(shape, "float32"))


# ---------------------------------------------------------------- the dynamic quantization


def _f32(v: float):
    from tvm import relax

    return relax.const(np.float32(v), "float32")


def quantization(bind, x):
    """``(scale, zero point)`` of float32 ``x`` (whole tensor), float32 ``[1]``, as
    ``GetQuantizationParameter`` for uint8."""
    from tvm.relax import op

    lo = bind(op.minimum(bind(op.reshape(bind(op.min(x)), [1])), _f32(0.0)))  # [1]: float32 in numpy as in Relax
    hi = bind(op.maximum(bind(op.reshape(bind(op.max(x)), [1])), _f32(0.0)))
    scale = bind(op.where(bind(op.equal(hi, lo)), _f32(1.0), bind(op.divide(bind(op.subtract(hi, lo)),
                                                                            _f32(255.0)))))
    zp = bind(op.round(_saturate(bind, bind(op.subtract(_f32(0.0), bind(op.divide(lo, scale)))))))
    return scale, zp


def _saturate(bind, v):
    """``max(0, min(255, v))`` (not a ``relax.clip``: a step's one clip is ONNX's cell clip)."""
    from tvm.relax import op

    return bind(op.maximum(bind(op.minimum(v, _f32(255.0))), _f32(0.0)))


def quantized(bind, x, scale, zp):
    """``q - zp`` (int32) of ``x`` quantized with ``scale`` and ``zp`` (``MlasQuantizeLinear``:
    ``x / scale`` rounded half to even, plus ``zp``, saturated; the clamp before or after the
    rounding is the same with integer bounds)."""
    from tvm.relax import op

    q = _saturate(bind, bind(op.add(bind(op.round(bind(op.divide(x, scale)))), zp)))
    return bind(op.astype(bind(op.subtract(q, zp)), "int32"))


def product(bind, x, scale, zp, w, w_scale):
    """``float32(Σ (q - zp) · w) · (scale · w_scale)``: ``x`` ``[B, K]`` quantized, by the
    integer constant ``w`` ``[K, N]``."""
    from tvm.relax import op

    acc = bind(op.matmul(quantized(bind, x, scale, zp), w, out_dtype="int32"))
    return bind(op.multiply(bind(op.astype(acc, "float32")), bind(op.multiply(scale, w_scale))))


# ---------------------------------------------------------------- the node's weights


class QuantizedCell:
    """One direction: int weights ``w`` ``[I, 4H]`` and ``r`` ``[H, 4H]`` and their float32
    scales (``[4H]`` or ``[]``) in irgen's gate order (``i, f, g, o``), the summed bias."""

    def __init__(self, w, w_scale, r, r_scale, bias, clip):
        from tvm import relax

        self.w, self.r = relax.const(w), relax.const(r)
        self.w_scale, self.r_scale = relax.const(w_scale), relax.const(r_scale)
        self.bias = None if bias is None else relax.const(bias)
        self.clip = clip
        self.hidden = int(r.shape[0])


_ORDER = [0, 2, 3, 1]  # ONNX's iofc -> irgen's ifgo


def _columns(a: np.ndarray) -> np.ndarray:
    """The last axis' 4 gate blocks in irgen's order (a scalar scale stays as it is)."""
    if a.ndim == 0:
        return a
    blocks = np.split(a, 4, axis=-1)
    return np.ascontiguousarray(np.concatenate([blocks[k] for k in _ORDER], axis=-1))


def _integers(node, q: np.ndarray, zp: np.ndarray, what: str) -> np.ndarray:
    """The weights less their zero point, as the integer type the int32 sums read."""
    if q.dtype == np.int8:
        if zp.any():
            raise _refuse(node, f"int8 {what} weights with a non-zero zero point (ONNX Runtime requires zero)")
        return q
    if q.dtype != np.uint8:
        raise _refuse(node, f"{what} weights of {q.dtype}: int8 or uint8 expected")
    if np.unique(zp).size != 1:
        raise _refuse(node, f"uint8 {what} weights with zero points that differ between channels")
    return (q.astype(np.int16) - np.int16(zp.reshape(-1)[0]))


def cells(node, inputs: list, attrs: dict, dirs: int) -> list[QuantizedCell]:
    """The node's directions (constant weights, scales and zero points; no peepholes)."""
    const = [rec._constant(inputs[k] if len(inputs) > k else None, node, name)
             for k, name in ((1, "W"), (2, "R"), (3, "B"), (7, "P"), (8, "W_scale"), (9, "W_zero_point"),
                             (10, "R_scale"), (11, "R_zero_point"))]
    w, r, b, p, w_s, w_zp, r_s, r_zp = const
    if p is not None and p.any():
        raise _refuse(node, "peephole weights (P) are not supported")
    if int(attrs.get("input_forget", 0)):
        raise _refuse(node, "input_forget=1 is not supported")
    if any(v is None for v in (w_s, w_zp, r_s, r_zp)):
        raise _refuse(node, "its weight scales and zero points are required")
    clip = attrs.get("clip")
    out = []
    for d in range(dirs):
        n = w.shape[-1]
        bias = None if b is None else _columns(np.asarray(b[d][:n], np.float32) + np.asarray(b[d][n:], np.float32))
        out.append(QuantizedCell(_columns(_integers(node, w[d], w_zp[d], "W")),
                                 _columns(np.asarray(w_s[d], np.float32)),
                                 _columns(_integers(node, r[d], r_zp[d], "R")),
                                 _columns(np.asarray(r_s[d], np.float32)), bias,
                                 None if clip is None else float(clip)))
    return out


# ---------------------------------------------------------------- the steps


def _step(bb, cell: QuantizedCell, x, xq: tuple, h, c, bind):
    """One step from the input row ``x`` (quantized with the sequence's ``xq``) and the
    previous states (None: zeros): ``(h', c')``."""
    from tvm import relax
    from tvm.relax import op

    gates = product(bind, x, *xq, cell.w, cell.w_scale)
    if h is not None:  # (zeros quantize to their zero point: their product adds nothing)
        gates = bind(op.add(gates, product(bind, h, *quantization(bind, h), cell.r, cell.r_scale)))
    if cell.bias is not None:
        gates = bind(op.add(gates, cell.bias))
    if cell.clip is not None:
        gates = bind(op.clip(gates, -cell.clip, cell.clip))
    parts = bind(op.split(gates, 4, axis=-1))
    i, f, g, o = (bind(activation(bb, bind(relax.TupleGetItem(parts, k)), "tanh" if k == 2 else "sigmoid"))
                  for k in range(4))
    ig = op.multiply(i, g)
    c_new = bind(ig, "c") if c is None else bind(op.add(bind(op.multiply(c, f)), bind(ig)), "c")
    return bind(op.multiply(bind(activation(bb, c_new, "tanh")), o), "h"), c_new


def convert(bb, inputs: list, attrs: dict, opset: int, ctx: Any):
    """``DynamicQuantizeLSTM`` -> its steps, then ``Y``, ``Y_h``, ``Y_c`` (as ONNX ``LSTM``)."""
    from tvm import relax

    node = ctx.current
    x = inputs[0]
    steps = int(x.ty.shape.values[0])
    rec._check_lengths(node, inputs, steps)
    if str(x.ty.dtype) != "float32":
        raise _refuse(node, f"a {x.ty.dtype} input: float32 expected")
    direction = rec._text(attrs.get("direction", b"forward"))
    names = ["forward", "reverse"] if direction == "bidirectional" else [direction]
    acts = [rec._text(a).lower() for a in attrs.get("activations") or []]
    if acts not in ([], ["sigmoid", "tanh", "tanh"] * len(names)) or attrs.get("activation_alpha") \
            or attrs.get("activation_beta"):
        raise _refuse(node, f"activations {acts} are not supported (the defaults Sigmoid, Tanh, Tanh only: irgen "
                            f"reproduces MLAS's approximations of those)")
    grid = cells(node, inputs, attrs, len(names))
    h0s = inputs[5] if len(inputs) > 5 else None
    c0s = inputs[6] if len(inputs) > 6 else None
    states = []
    for d, cell in enumerate(grid):
        emit = rec._emitter(bb, ctx, node, d, names[d])
        order = list(range(steps))[::-1] if names[d] == "reverse" else list(range(steps))
        h = rec._initial(h0s, d, 0, emit, order[0])
        c = rec._initial(c0s, d, 0, emit, order[0])
        hs, cs = {}, {}
        for t in order:
            def bind(expr, state=None, t=t, emit=emit):
                return emit(t, expr, state)

            xq = quantization(bind, x)  # the whole sequence's parameters, as ORT quantizes X at once
            row = bind(relax.op.take(x, relax.const(t, "int64"), axis=0))
            h, c = _step(bb, cell, row, xq, h, c, bind)
            hs[t], cs[t] = h, c
        states.append((hs, cs))
    return rec._results(bb, ctx, node, states, names, steps, 0)


# ---------------------------------------------------------------- the source runner's states


def step_states(node, values: dict) -> dict[str, np.ndarray]:
    """The per-step states of ``node`` (``{"h": [1, D, T, B, H], "c": ...}``), ONNX Runtime's
    node run one step at a time per direction from the previous step's states, its input
    widened by the sequence's minimum and maximum over zero weight rows (see the module text)."""
    from onnx import helper

    from .runner import inference_session

    def value(k):
        name = node.input[k] if len(node.input) > k else ""
        return np.asarray(values[name]) if name else None

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    x, w, r = value(0), value(1), value(2)  # x [T, B, I]; w [D, I, 4H]
    dirs, hidden = w.shape[0], r.shape[1]
    extra = np.broadcast_to(np.array([x.min(), x.max()], x.dtype), (1, x.shape[1], 2))
    w_zp = value(9)
    fill = w_zp.reshape(dirs, -1)[:, 0] if w.dtype == np.uint8 else np.zeros(dirs, w.dtype)  # rows worth zero
    pad = np.broadcast_to(fill.astype(w.dtype)[:, None, None], (dirs, 2, w.shape[2]))
    wide = np.concatenate([w, pad], axis=1)
    init = [value(5), value(6)]
    out = {s: np.zeros((1, dirs, x.shape[0], x.shape[1], hidden), x.dtype) for s in ("h", "c")}
    reverse = [rec._text(attrs.get("direction", b"forward")) == "reverse"] if dirs == 1 else [False, True]
    keep = {k: v for k, v in attrs.items() if k != "direction"}
    for d in range(dirs):
        per = {k: (None if value(k) is None else value(k)[d:d + 1]) for k in (3, 7, 8, 9, 10, 11)}
        sess = inference_session(_one_step_model(keep, wide[d:d + 1], r[d:d + 1], per, x).SerializeToString(),
                                 True)  # one intra-op thread, as the full run (irgen_onnx.runner)
        state = [np.zeros((1, x.shape[1], hidden), x.dtype) if v is None else v[d:d + 1] for v in init]
        for t in (range(x.shape[0] - 1, -1, -1) if reverse[d] else range(x.shape[0])):
            feeds = {"x": np.concatenate([x[t:t + 1], extra], axis=2), "h": state[0], "c": state[1]}
            state = sess.run(None, feeds)
            for j, s in enumerate(out):
                out[s][0, d, t] = state[j][0]
    return out


def _one_step_model(attrs: dict, w, r, per: dict, x):
    """One forward ``DynamicQuantizeLSTM`` over one step of the widened input: inputs ``x``,
    ``h``, ``c``; outputs ``Y_h``, ``Y_c``."""
    from onnx import helper, numpy_helper

    names = {3: "B", 7: "P", 8: "W_scale", 9: "W_zero_point", 10: "R_scale", 11: "R_zero_point"}
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(r, "R")]
    inits += [numpy_helper.from_array(v, names[k]) for k, v in per.items() if v is not None]
    ins = ["x", "W", "R", "B" if per[3] is not None else "", "", "h", "c", "P" if per[7] is not None else "",
           "W_scale", "W_zero_point", "R_scale", "R_zero_point"]
    node = helper.make_node(OP, ins, ["", "Y_h", "Y_c"], domain="com.microsoft", **attrs)
    state = [1, x.shape[1], r.shape[1]]
    io = [helper.make_tensor_value_info("x", 1, [1, x.shape[1], w.shape[1]])]
    io += [helper.make_tensor_value_info(n, 1, state) for n in ("h", "c")]
    graph = helper.make_graph([node], "step", io, [helper.make_tensor_value_info(n, 1, state) for n in ("Y_h", "Y_c")],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=8)
