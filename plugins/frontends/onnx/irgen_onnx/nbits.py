"""Block-wise 4-bit weights: ``com.microsoft.MatMulNBits`` and opset-21 block ``DequantizeLinear``.

Both store a weight as 4-bit integers with one float32 scale (and zero point) per block of
``block_size`` consecutive elements along one axis. Before import (:func:`lower_block_weights`)
each becomes an ``IrgenBlockWeight`` node (domain :data:`DOMAIN`) that dequantizes the weight
the op reads, and :func:`block_weight` converts that node into Relax as

    dequantize(values [rows * blocks, block_size] int8, scale [rows * blocks], zero_point, axis=0)
      -> reshape [rows, blocks * block_size] -> strided_slice to the axis' length
      -> permute_dims (when the blocks run along the weight's first axis)

so the ``qdq`` scheme (``irgen_qdq.blockwise``) finds the blocks and the 4-bit integers again and
realizes the MatMul reading them as a weight-only layer: the packed 4-bit weights, the per-block
scales and zero points as its parameters, and ONNX Runtime's float32 accumulation order.

* ``MatMulNBits`` (``onnxruntime.quantization.matmul_nbits_quantizer``): ``B`` is uint8
  ``[N, blocks, block_size / 2]``, two 4-bit values per byte, the low nibble the even element
  along K; ``scales`` float32 ``[N, blocks]``; ``zero_points`` packed the same way (absent:
  8). ``Y = A @ dequantize(B)^T (+ bias)``. It becomes ``IrgenBlockWeight -> MatMul (-> Add)``,
  the MatMul keeping the node's output name. Refused, naming the node: ``bits`` other than 4,
  ``g_idx`` (act-order), float zero points, and ``accuracy_level`` 4 (ONNX Runtime then quantizes
  the activation to int8 per block on the fly, MLAS CompInt8: another computation than the
  graph's, which irgen does not realize; quantize with ``accuracy_level`` 0 to 3, which run in
  float32 on an x86 CPU).
* ``DequantizeLinear`` with ``block_size`` of a 2-D INT4/UINT4 initializer: the same node.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from irgen.plugin import IrgenError

from .fold import INVENTED
from .loader import q, tensor_array

#: the domain and op type of the node :func:`lower_block_weights` writes
DOMAIN = "ai.irgen.lowbit"
BLOCK_OP = "IrgenBlockWeight"
_INT4, _UINT4 = 22, 21  # TensorProto.INT4, TensorProto.UINT4
#: MatMulNBits' accuracy levels that compute in float32 on an x86 CPU for a float32 input (0: unset,
#: 1: fp32; 2 and 3, fp16 and bf16, fall back to fp32 there: measured equal to level 0)
FLOAT_LEVELS = (0, 1, 2, 3)


#: the doc string of a node :func:`lower_block_weights` wrote for a source node of another op type
SOURCE_OP = "irgen: computes source op "


def source_op_type(node) -> str:
    """The source model's op type of ``node``: the op a node :func:`lower_block_weights` wrote
    stands for (``MatMulNBits``, ``DequantizeLinear``), else its own."""
    if node.domain == DOMAIN:
        return next((a.s.decode() for a in node.attribute if a.name == "source"), node.op_type)
    if node.doc_string.startswith(SOURCE_OP):
        return node.doc_string[len(SOURCE_OP):]
    return node.op_type


def _attr(node, name: str, default: int = 0) -> int:
    return next((int(a.i) for a in node.attribute if a.name == name), default)


def _nibbles(packed: np.ndarray, count: int) -> np.ndarray:
    """The 4-bit values of ``packed`` bytes along the last axis, the low nibble first, cut to ``count``."""
    p = np.asarray(packed, np.uint8)
    return np.stack([p & 15, p >> 4], -1).reshape(*p.shape[:-1], -1)[..., :count]


def _block_node(name: str, values: np.ndarray, scales: np.ndarray, zps: np.ndarray, out: str, *, rows: int,
                length: int, axis: int, signed: bool, source: str, inits: list, invented: bool):
    """The ``IrgenBlockWeight`` node (and its three initializers) giving the float weight ``out``:
    ``values`` ``[rows, blocks, block_size]`` integers, ``scales``/``zps`` ``[rows, blocks]``."""
    from onnx import helper, numpy_helper

    r, nb, bs = values.shape
    names = [f"{name}__irgen_q4", f"{name}__irgen_scale", f"{name}__irgen_zero_point"]
    dtype = np.int8 if signed else np.uint8  # the 4-bit type's signedness, for the qdq scheme
    inits += [numpy_helper.from_array(values.reshape(r * nb, bs).astype(dtype), names[0]),
              numpy_helper.from_array(np.ascontiguousarray(scales, np.float32).reshape(-1), names[1]),
              numpy_helper.from_array(zps.reshape(-1).astype(dtype), names[2])]
    node = helper.make_node(BLOCK_OP, names, [out], name=name, domain=DOMAIN, rows=rows, length=length,
                            axis=axis, signed=int(signed), source=source)
    if invented:
        node.doc_string = INVENTED
    return node


def _from_matmul_nbits(n, const, inits: list, path) -> list:
    """``MatMulNBits`` as ``IrgenBlockWeight -> MatMul (-> Add)``, or an error naming what is not supported."""
    from onnx import helper

    where = f"onnx frontend ({path.name}): MatMulNBits node {q(n.name)}"
    bits, level = _attr(n, "bits", 4), _attr(n, "accuracy_level", 0)
    k, nn, bs = _attr(n, "K"), _attr(n, "N"), _attr(n, "block_size")
    if bits != 4:
        raise IrgenError(f"{where}: bits={bits} is not supported (4-bit weights only)")
    if level not in FLOAT_LEVELS:
        raise IrgenError(f"{where}: accuracy_level={level} is not supported: ONNX Runtime then quantizes the "
                         f"activation to int8 per block on the fly (MLAS CompInt8), which irgen does not realize; "
                         f"quantize with accuracy_level 0 to 3 (float32 compute on an x86 CPU)")
    if len(n.input) > 4 and n.input[4]:
        raise IrgenError(f"{where}: g_idx (act-order) is not supported")
    b, s = const(n.input[1]), const(n.input[2])
    z = const(n.input[3]) if len(n.input) > 3 and n.input[3] else None
    if b is None or s is None or (len(n.input) > 3 and n.input[3] and z is None):
        raise IrgenError(f"{where}: its weights, scales and zero points must be initializers")
    if z is not None and z.dtype != np.uint8:
        raise IrgenError(f"{where}: zero points of type {z.dtype} are not supported (packed uint8 only)")
    if bs < 16 or bs & (bs - 1) or s.dtype != np.float32:
        raise IrgenError(f"{where}: block_size {bs} with {s.dtype} scales is not supported")
    nb = -(-k // bs) if k > 0 and nn > 0 else 0
    if not nb or b.size != nn * nb * bs // 2 or s.size != nn * nb or (z is not None and z.size != nn * -(-nb // 2)):
        raise IrgenError(f"{where}: B {list(b.shape)}, scales {list(s.shape)} and zero points "
                         f"{None if z is None else list(z.shape)} do not fit K={k}, N={nn}, block_size={bs}")
    vals = _nibbles(b.reshape(nn, nb, bs // 2), bs)
    zps = np.full((nn, nb), 8, np.int64) if z is None else _nibbles(z.reshape(nn, -1), nb)
    w = f"{n.name or n.output[0]}__irgen_weight"
    nodes = [_block_node(n.name or n.output[0], vals, s.reshape(nn, nb), zps, w, rows=nn, length=k, axis=0,
                         signed=False, source="MatMulNBits", inits=inits, invented=True)]
    bias = n.input[5] if len(n.input) > 5 and n.input[5] else ""
    mm_out = f"{n.output[0]}__irgen_matmul" if bias else n.output[0]
    nodes.append(helper.make_node("MatMul", [n.input[0], w], [mm_out], name=n.name, doc_string=SOURCE_OP + n.op_type))
    if bias:
        nodes[-1].doc_string = INVENTED
        nodes.append(helper.make_node("Add", [mm_out, bias], [n.output[0]], name=n.name,
                                      doc_string=SOURCE_OP + n.op_type))
    return nodes


def _from_block_dq(n, t, const, inits: list) -> list | None:
    """A block DequantizeLinear of the 2-D 4-bit initializer ``t`` as ``IrgenBlockWeight``, or None."""
    bs = _attr(n, "block_size")
    w, s = const(n.input[0]), const(n.input[1])
    z = const(n.input[2]) if len(n.input) > 2 and n.input[2] else None
    if w is None or s is None or w.ndim != 2 or s.dtype != np.float32 or s.ndim != 2 or bs <= 0:
        return None
    axis = _attr(n, "axis", 1) % 2
    wt = w.astype(np.int64) if axis == 1 else w.astype(np.int64).T  # rows x (blocked axis)
    st = s if axis == 1 else s.T
    rows, length = wt.shape
    nb = -(-length // bs)
    if st.shape != (rows, nb) or (z is not None and z.shape != s.shape):
        return None
    zt = np.zeros((rows, nb), np.int64) if z is None else (z.astype(np.int64) if axis == 1 else z.astype(np.int64).T)
    vals = np.zeros((rows, nb * bs), np.int64)
    vals[:, :length] = wt
    # the blocks along the weight's axis 1 (its rows are the other axis), or along axis 0 (transposed)
    return [_block_node(n.name or n.output[0], vals.reshape(rows, nb, bs), st, zt, n.output[0], rows=rows,
                        length=length, axis=axis, signed=t.data_type == _INT4, source="DequantizeLinear",
                        inits=inits, invented=False)]


def _weight_only(weight: str, readers: dict[str, list], producer: dict) -> bool:
    """``weight`` is read by one MatMul, as its second operand, whose first is no DequantizeLinear's
    output: a weight-only layer. (A block weight of a quantized activation's op is folded into float
    by :func:`irgen_onnx.fold.fold_4bit_weights`: that op is a float span of the ``qdq`` scheme.)"""
    users = readers.get(weight, [])
    if len(users) != 1 or users[0].op_type != "MatMul" or list(users[0].input).index(weight) != 1:
        return False
    src = producer.get(users[0].input[0])
    return src is None or src.op_type != "DequantizeLinear"


def lower_block_weights(model, path) -> int:
    """Every ``MatMulNBits`` and block ``DequantizeLinear`` of a 4-bit initializer as an
    ``IrgenBlockWeight`` node (see the module text). Returns how many nodes changed."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    produced = {o for n in g.node for o in n.output}

    def const(name: str):
        return tensor_array(inits[name]) if name in inits and name not in produced else None

    new_inits: list = []
    nodes, changed, replaced = [], 0, set()
    readers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    producer = {o: n for n in g.node for o in n.output}
    for n in g.node:
        out = None
        if n.op_type == "MatMulNBits" and n.domain == "com.microsoft":
            out = _from_matmul_nbits(n, const, new_inits, path)
        elif n.op_type == "DequantizeLinear" and n.domain in ("", "ai.onnx") and _attr(n, "block_size") > 0 \
                and n.input[0] in inits and inits[n.input[0]].data_type in (_INT4, _UINT4) \
                and _weight_only(n.output[0], readers, producer):
            out = _from_block_dq(n, inits[n.input[0]], const, new_inits)
        changed += out is not None
        nodes.extend(out if out is not None else [n])
        if out is not None:
            replaced.update(n.input[1:4] if n.op_type == "MatMulNBits" else n.input)
    if not changed:
        return 0
    del g.node[:]
    g.node.extend(nodes)
    read = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    dead = [t for t in g.initializer if t.name in replaced and t.name not in read]  # TVM would read them too
    for t in dead:
        g.initializer.remove(t)
    g.initializer.extend(new_inits)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(__import__("onnx").helper.make_opsetid(DOMAIN, 1))
    return changed


def block_weight(bb, inputs: list, attrs: dict[str, Any], opset: int):
    """``IrgenBlockWeight`` -> the Relax dequantize of its blocks, reshaped to the weight (module text)."""
    from tvm import relax

    values, scale, zp = inputs[:3]
    rows, length, axis = int(attrs["rows"]), int(attrs["length"]), int(attrs["axis"])
    r, bs = (int(d) for d in values.ty.shape.values)
    steps = [lambda w: relax.op.reshape(w, [rows, r // rows * bs])]
    if length < r // rows * bs:
        steps.append(lambda w: relax.op.strided_slice(w, axes=[1], begin=[0], end=[length]))
    if axis == 0:
        steps.append(lambda w: relax.op.permute_dims(w, [1, 0]))
    w = relax.op.dequantize(values, scale, zp, axis=0, out_dtype="float32")
    for step in steps:  # each bound but the last, which the importer binds to the node's output
        w = step(bb.emit(w))
    return w
