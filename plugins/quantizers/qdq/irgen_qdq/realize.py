"""The QDQ realization engine: ONNX QuantizeLinear/DequantizeLinear (and torch's
reference-quantized) graphs in ONNX Runtime's integer arithmetic.

The ``qdq`` scheme realizes with it as is; a scheme built on it (``pow2``) calls
:func:`realize` with its own requantization of convolution and dense accumulators
(``conv_requant``) and its own name (``scheme``).

``onnxruntime.quantization.quantize_static(..., quant_format=QuantFormat.QDQ)``
writes DequantizeLinear -> float op -> QuantizeLinear spans; ONNX Runtime's CPU
provider fuses them into integer kernels (QLinearConv, QGemm, QLinearAdd,
QLinearAveragePool, QLinearGlobalAveragePool, QLinearConcat, QLinearMul,
QLinearSoftmax, lookup tables). For int8 activations compare with ORT created
with ``session.qdqisint8allowed=1`` (see docs/quantization.md).
The engine rewrites each span into the same integer arithmetic:

* Conv, Gemm, MatMul: int32 accumulation of ``(x - zp_x) * w`` plus the int32
  bias; MLAS requantization: ``float32(acc) * (s_x * s_w[c] / s_y)`` (float32),
  clamped to ``[lo - zp_y, hi - zp_y]``, rounded half to even, ``+ zp_y``;
  a Relu/Clip inside the span narrows the clamp;
* Add: ``fma(x_a, r_a, fma(x_b, r_b, zp_y - fma(r_a, zp_a, r_b*zp_b)))`` in
  float32 with ``r = s/s_y``, rounded half to even, saturated (MLAS QLinearAdd,
  AVX2 kernel);
* Mul: ``float32(float32((x_a - zp_a) * (x_b - zp_b)) * float32(s_a*s_b/s_y)) + zp_y``
  rounded half to even, saturated (MLAS QLinearMul);
* Softmax (last axis): QLinearSoftmax's float ``exp`` table, float32 row sum,
  ``rint(e * floor(1/s_y) / sum) + zp_y``;
* GlobalAveragePool: int32 sum minus ``zp_x * N`` requantized by ``s_x / (s_y * N)``;
* AveragePool: dequantized float average, quantized;
* elementwise unary ops (Sigmoid, Relu, ...), and any chain of elementwise ops
  on one dequantized tensor and constants (HardSigmoid as multiply, add, clip):
  a 256-entry lookup table of the chain evaluated in float32 (ORT runs such
  ops in float on the dequantized values, or as QLinearSigmoid's table);
* MatMul of two activations (attention's Q·Kᵀ, A·V): QLinearMatMul, int32
  ``sum((a - zp_a) * (b - zp_b))`` with the MLAS requantization above (kind ``matmul``);
* Concat: identity, or a lookup table per input whose parameters differ; an
  operand computed from constants is a literal (``constants``);
* MaxPool, Reshape, Flatten, Transpose, Squeeze, Gather/Slice with constant
  indices, with equal in/out parameters: as is.

The spans ``quantize_static`` writes around ops without an integer kernel are in
:mod:`irgen_qdq.operands`, :mod:`irgen_qdq.float_span` and
:mod:`irgen_qdq.transformer`: Add/Mul with a quantized constant operand (QLinearAdd/
QLinearMul with an initializer), float layers (LayerNorm, BatchNorm left alone,
...: dequantize, the float ops, quantize; ``"realization": "float"``),
elementwise graphs on one tensor as tables (HardSwish, GELU's erf),
channel splits (Slice with shape-computed bounds), the items of a Split, a
Gather of a quantized embedding table by token ids, and QLinearMatMul.

The realizers are keyed by the compute op's kind (:data:`_REALIZERS`); each answers a span or
declines it, and a span no realizer answers is a float span. So is a span ORT does not fuse
into an integer kernel (:mod:`irgen_qdq.units`: integer types that differ, a Relu/Clip the
quantize does not make redundant, a float input, an activation quantized per channel, as
NNCF, Brevitas and Intel Neural Compressor write them), a Conv's float bias rounded first as
ORT rounds it (:mod:`irgen_qdq.bias`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from irgen.plugin import IrgenError

from .bias import round_float_bias
from .blockwise import realize_blockwise
from .ranges import fold_integer_clips
from .common import _CONVS, SCHEME, _MOVE, _UNARY, _dequantized, _is_torch, _offset, _ops, _qparams
from .concat import _realize_concat
from .float8 import realize_float8
from .conv import _realize_conv
from .float_span import UnquantizedSource, dequantized_activation, realize_float, rx_along
from .kernels import (_or_float, _realize_add, _realize_move, _realize_mul, _realize_quantize, _realize_requantize,
                      _realize_softmax, _realize_table_chain, _realize_unary)
from .operands import (_dequantized_constant, _float_operand, constant_value, elementwise_dag, operand,
                       quantized_constant, run_time_quantized)
from .pooling import _realize_avg_pool, _realize_global_avg
from .tidy import drop_dead, drop_dead_items, retype, static_shape_of
from .torch_spans import _TORCH_ONLY_UNARY
from .transformer import gathered_table, realize_gather_table, realize_matmul, realize_slice, realize_split_item, split_item
from .units import check_unfused, float_reason, per_channel


def realize(qg, scheme: str = SCHEME, conv_requant=None) -> None:
    """Realize every DQ -> op -> Q span of ``qg`` (a ``QGraph``) in place; ``conv_requant(qg, acc, scale, out, lo, hi, axis, ndim, tensor)``
    replaces ONNX Runtime's float requantization of conv/dense accumulators
    (returning the expression and the record's ``requant``), and ``scheme``
    names the records (both for schemes built on this one, such as ``pow2``)."""
    _realize(qg, conv_requant)
    for rec in qg.quant.values():
        rec["scheme"] = scheme


def _realize(qg, conv_requant) -> None:
    """Each quantize's span realized (:func:`_realize_one`), from the first again after every
    replacement, then the dequantizes left (:func:`_dequantize_rest`)."""
    if not _is_torch(qg):
        drop_dead_items(qg)
        static_shape_of(qg)
        fold_integer_clips(qg)  # Q -> integer Clip -> DQ: a tensor narrower than its type (.ranges)
        realize_float8(qg)  # float8 quantize -> dequantize pairs (ONNX Runtime runs the ops between in float)
        realize_blockwise(qg)  # float activations times 4-bit block weights: weight-only layers
    i = 0
    while i < len(qg.bindings):
        b = qg.bindings[i]
        i += 1
        if b.op == "relax.quantize" and _realize_one(qg, b, conv_requant):
            i = 0
    _dequantize_rest(qg)


@dataclass
class _Span:
    """The span a quantize ``b`` ends: ``f`` the op it quantizes, ``out`` its output parameters,
    ``comp`` the compute op under the Relu/Clip ops ``acts`` and the bias add ``bias_b`` folded
    into it, ``chain`` the elementwise graph on one dequantized tensor ending at ``f`` (or None)."""

    qg: Any
    b: Any
    f: Any
    out: Any
    comp: Any
    acts: list
    bias_b: Any
    chain: Any
    conv_requant: Any
    torch: bool


def _realize_one(qg, b, conv_requant) -> bool:
    """The span of quantize ``b`` replaced by its integer realization; False when ``b`` is left
    (a constant quantized at run time: its consumers take the integers)."""
    f = qg.producer(b.value.args[0])
    out = _qparams(qg, b.value, b.name, None)
    if not _is_torch(qg) and constant_value(qg, b.value.args[0]) is not None:
        return False  # a constant quantized at run time: its consumers take the integers (spans.quantized_constant)
    if out.scale.size != 1 and (f is None or _is_torch(qg)):
        # (ONNX: a span that quantizes per channel is a float span, see _realize_span_kinds)
        raise IrgenError(f"{SCHEME}: activation {b.name!r} is quantized per channel; not supported")
    if f is None:
        names, expr, rec = _realize_quantize(qg, b, out)
        qg.replace(names, expr, rec)
        return True
    s = _span(qg, b, f, out, conv_requant)
    names, expr, rec = _realize_span(s)
    _commit(qg, names, expr, rec)
    if s.comp.op == "relax.dynamic_strided_slice":
        retype(qg)
    return True


def _activations(qg, f) -> tuple[list, Any]:
    """The Relu/Clip ops (one user each) on an add, conv, matmul, Relu or Clip, from ``f`` down,
    and the op under them."""
    acts, comp = [], f
    while comp is not None and comp.op in ("relax.nn.relu", "relax.clip") and qg.n_users(comp.name) == 1:
        p = qg.producer(comp.value.args[0])
        if p is None or p.op not in ("relax.add", *_CONVS, "relax.matmul", "relax.nn.relu", "relax.clip"):
            break
        acts.insert(0, comp)
        comp = p
    return acts, comp


def _bias_add(qg, comp) -> tuple[Any, Any]:
    """``(conv or matmul, its bias add)`` when ``comp`` adds a bias (a dequantized or reshaped
    operand; torch: a constant) to a conv/matmul it alone reads; else ``(comp, None)``."""
    if comp.op != "relax.add":
        return comp, None
    Constant = _ops()[3]
    p0, p1 = (qg.producer(a) for a in comp.value.args)
    for cand, other in ((p0, p1), (p1, p0)):
        operand = comp.value.args[1 if cand is p0 else 0]
        # torch: a float bias constant; ONNX: a Gemm's float bias (QuantizeBias=False), which ORT quantizes
        other_ok = (other is not None and other.op in ("relax.dequantize", "relax.reshape")) or (
            other is None and isinstance(operand, Constant)
            and (_is_torch(qg) or str(operand.ty.dtype) == "float32"))
        if cand is not None and cand.op in (*_CONVS, "relax.matmul") and other_ok \
                and qg.n_users(cand.name) == 1:
            return cand, comp
    return comp, None


def _span(qg, b, f, out, conv_requant) -> _Span:
    """The span quantize ``b`` of ``f``'s result ends (see :class:`_Span`)."""
    acts, comp = _activations(qg, f)
    comp, bias_b = _bias_add(qg, comp)
    chain = None if bias_b is not None or comp.op in (*_CONVS, "relax.matmul") or per_channel(qg, comp, out) \
        else elementwise_dag(qg, f)
    return _Span(qg, b, f, out, comp, acts, bias_b, chain, conv_requant, _is_torch(qg))


def _table_chain(s: _Span):
    """An elementwise graph on one dequantized tensor (more than one unary op): one lookup table."""
    if s.chain is not None and not (len(s.chain[1]) == 1 and (s.f.op in _UNARY or s.f.op == "relax.clip")):
        return _realize_table_chain(s.qg, s.b, s.chain, s.out)
    return None


def _split_item(s: _Span):
    """One item of a Split (ONNX; torch's ``chunk``: quantize_per_tensor of a dequantized value with
    the same parameters gives the integers back, so the item is a slice of them too)."""
    if split_item(s.qg, s.f) is not None:
        return realize_split_item(s.qg, s.b, s.f, s.out)
    return None


def _activation_matmul(s: _Span):
    """MatMul of two activations (QLinearMatMul)."""
    rhs = s.comp.value.args[1]
    if s.bias_b is None and not s.acts and _dequantized(s.qg, rhs) is not None \
            and quantized_constant(s.qg, rhs) is None:
        if s.torch:  # torch multiplies the dequantized operands in float (LeViT's q @ k^T), not as QLinearMatMul
            return realize_float(s.qg, s.b, s.f, s.out)
        return realize_matmul(s.qg, s.b, s.comp, s.out)
    return None


def _gather_table(s: _Span):
    """A Gather of a quantized embedding table by token ids (ONNX)."""
    if not s.torch and gathered_table(s.qg, s.comp) is not None:
        return realize_gather_table(s.qg, s.b, s.comp, s.out)
    return None


def _conv(s: _Span):
    """Conv, Gemm, MatMul with a constant operand, with its bias and activations (or the float span)."""
    try:
        return _realize_conv(s.qg, s.b, s.comp, s.bias_b, s.acts, s.out, s.conv_requant)
    except IrgenError as e:
        if s.torch or "no integer kernel" not in str(e):
            raise
        return _no_kernel(s)


def _add(s: _Span):
    """Add, with the Relu/Clip after it (torch: add, relu, quantize), or the float span."""
    return _or_float(s.qg, s.b, s.f, s.out, _realize_add, s.comp, s.acts)


def _activation(s: _Span):
    """A Relu/Clip on a Relu/Clip the chain stopped at: the first activation as a table (two: refused)."""
    if not s.acts:
        return None
    found = _realize_unary(s.qg, s.b, s.acts[0], s.out)
    if len(s.acts) > 1:
        raise IrgenError(f"{SCHEME}: chained activations at {s.b.name!r}; not supported")
    return found


def _float_mean(s: _Span):
    """ReduceMean without keepdims: float in ORT (ONNX)."""
    if not bool(s.comp.value.attrs.keepdims) and not s.torch:
        return realize_float(s.qg, s.b, s.f, s.out)
    return None


def _float_fed(s: _Span):
    """An op whose quantized span needs a dequantized input (mean, average pools, softmax, the ops
    of :data:`_MOVE`) on a float tensor (ONNX QOperator models leave GlobalAveragePool after a float
    HardSwish, a Gather after LayerNorm): ORT's float op, then QuantizeLinear."""
    if not s.torch and _float_operand(s.qg, s.comp.value.args[0]):
        return _realize_quantize(s.qg, s.b, s.out)
    return None


def _kernel(realize):
    """The realizer that is ``realize(qg, qb, comp, out)``: the integer kernel of the compute op
    (GlobalAveragePool, AveragePool, Concat, the ops that move integers, unary tables, Softmax)."""
    def realizer(s: _Span):
        return realize(s.qg, s.b, s.comp, s.out)

    return realizer


def _slice(s: _Span):
    """A channel split by a Slice with shape-computed bounds (ONNX)."""
    if not s.torch:
        return realize_slice(s.qg, s.b, s.comp, s.out)
    return None


def _torch_unary(s: _Span):
    """silu, gelu in a torch reference graph: a table of torch's kernel (ONNX: no answer, a float span)."""
    if not s.torch or (s.comp.op == "relax.nn.gelu" and getattr(s.comp.value.attrs, "approximate", "none") != "none"):
        return None
    return _realize_unary(s.qg, s.b, s.comp, s.out)


def _concat(s: _Span):
    """Concat (QLinearConcat), or the float span when an input is float (ONNX)."""
    return _or_float(s.qg, s.b, s.f, s.out, _realize_concat, s.comp)


def _mul(s: _Span):
    """Mul (QLinearMul), or the float span."""
    return _or_float(s.qg, s.b, s.f, s.out, _realize_mul, s.comp)


#: realizers tried on every span before its op kind's
_ANY_KIND = (_table_chain, _split_item)


#: op kind (the compute op's Relax name) -> its realizers, tried in order; the first that
#: answers realizes the span
_REALIZERS = {
    **{kind: (_float_fed, _kernel(_realize_move)) for kind in _MOVE},  # MaxPool, Reshape, Transpose...
    **{kind: (_kernel(_realize_unary),) for kind in _UNARY},  # Sigmoid, Tanh: lookup tables
    "relax.matmul": (_activation_matmul, _conv),
    "relax.take": (_gather_table, _float_fed, _kernel(_realize_move)),
    **dict.fromkeys(_CONVS, (_conv,)),
    "relax.add": (_add,),
    "relax.nn.relu": (_activation, _kernel(_realize_unary)),
    "relax.clip": (_activation, _kernel(_realize_unary)),
    "relax.mean": (_float_mean, _float_fed, _kernel(_realize_global_avg)),
    **dict.fromkeys(("relax.nn.adaptive_avg_pool2d", "relax.nn.adaptive_avg_pool3d"),
                    (_float_fed, _kernel(_realize_global_avg))),
    **dict.fromkeys(("relax.nn.avg_pool2d", "relax.nn.avg_pool3d"), (_float_fed, _kernel(_realize_avg_pool))),
    "relax.concat": (_concat,),
    "relax.dynamic_strided_slice": (_slice,),
    "relax.nn.softmax": (_float_fed, _kernel(_realize_softmax)),
    "relax.multiply": (_mul,),
    "relax.dequantize": (_kernel(_realize_requantize),),
    **{kind: (_torch_unary,) for kind in _TORCH_ONLY_UNARY},  # torch: SiLU, GELU tables
}


def _no_kernel(s: _Span):
    """A span no realizer answers: dequantize, the float ops, quantize (ONNX: ORT has no integer
    kernel for it; torch: its reference graph runs every op between them in float). A Conv's
    float bias is first rounded as ORT rounds it (:func:`irgen_qdq.bias.round_float_bias`)."""
    if round_float_bias(s):
        s.f = s.qg.producer(s.b.value.args[0])  # the span's last binding, rebound
    return realize_float(s.qg, s.b, s.f, s.out)


#: why an integer realizer declines a span whose operand is computed in float (torch: a BatchNorm
#: after a concatenation, a layer scale; ONNX: :func:`_reads_float`): the runtime runs the span in
#: float, so the float span follows
_FLOAT_OPERAND = ("is not a dequantized integer tensor", "no integer kernel")


def _realize_span(s: _Span):
    """``(names, expr, rec)``: the bindings the span replaces, its integer expression and record.
    A span whose float ops read a tensor that is not quantized (a model quantized only in part:
    its float ops compute from the model input) is no span: those ops stay float layers, as ORT
    runs them, and the quantize quantizes their float result."""
    try:
        return _realize_span_kinds(s)
    except UnquantizedSource:
        return _realize_quantize(s.qg, s.b, s.out)


#: activation types ONNX Runtime has no QLinear kernels for (``quantize_static`` with
#: ``activation_type=QInt16``/``QUInt16``): it runs every such span in float
_WIDE = ("int16", "uint16")


def _wide_activations(s: _Span) -> bool:
    """The span quantizes to, or computes from, a 16-bit activation (ONNX)."""
    if s.torch:
        return False
    if s.out.dtype in _WIDE:
        return True
    first = s.comp.value.args[0] if getattr(s.comp.value, "args", None) else None
    d = dequantized_activation(s.qg, first) if first is not None else None
    return d is not None and d[1].dtype in _WIDE


def _realize_span_kinds(s: _Span):
    if _wide_activations(s) and s.comp.op not in _MOVE:
        # ORT's integer kernels are 8-bit: a 16-bit span is DequantizeLinear, the float op, QuantizeLinear
        # (a split item or a data movement stays a move of the integers, the same values)
        return _split_item(s) or _no_kernel(s)
    if not s.torch and per_channel(s.qg, s.comp, s.out):
        check_unfused(s)  # (ORT fuses some such units, then fails in the kernel)
        return _no_kernel(s)  # NNCF's depthwise inputs: per-channel activations have no integer kernel in ORT
    if not s.torch and float_reason(s) is not None:
        return _no_kernel(s)  # a node unit ORT's selectors do not fuse (integer types that differ...)
    for realizer in (*_ANY_KIND, *_REALIZERS.get(s.comp.op, ())):
        try:
            found = realizer(s)
        except UnquantizedSource:
            raise
        except IrgenError as err:
            if not any(w in str(err) for w in _FLOAT_OPERAND) or not (s.torch or _reads_float(s)):
                raise
            return _no_kernel(s)
        if found is not None:
            return found
    return _no_kernel(s)


def _reads_float(s: _Span) -> bool:
    """The span's compute op reads a float tensor that float ops compute (ONNX: quantizers that
    leave a MaxPool, a Concat, a BatchNormalization or a residual Add unquantized, NNCF, Brevitas,
    Intel Neural Compressor). ORT's selectors need a DequantizeLinear on every data input, so it
    runs the node unit in float: so does irgen (:func:`_no_kernel`)."""
    relax = _ops()[0]
    args = s.comp.value.args if isinstance(s.comp.value, relax.Call) else []
    fields = [f for a in args for f in (a.fields if isinstance(a, relax.Tuple) else [a])]
    return any(_float_operand(s.qg, a) for a in fields)


def _commit(qg, names: list[str], expr, rec) -> None:
    """Replace the span's bindings (less a dequantize other ops read too, and what an op outside the
    span still reads) by ``expr``."""
    keep_last = names[-1]
    names = [n for n in dict.fromkeys(names[:-1]) if qg.n_users(n) <= 1 or qg.by_name[n].op != "relax.dequantize"]
    names = _still_read(qg, names, keep_last)
    qg.replace(names + [keep_last], expr, rec)


def _still_read(qg, names: list[str], last: str) -> list[str]:
    """``names`` less the bindings another op outside the span still reads (a float HardSwish whose
    result both a table span and a float GlobalAveragePool read), and what those read."""
    drop = set(names)
    while True:
        inside = drop | {last}
        keep = {n for n in drop if qg.n_users(n) > sum(qg.bindings[i].name in inside for i in qg.users.get(n, []))}
        if not keep:
            return [n for n in names if n in drop]
        drop -= keep


def _per_channel(qg, b) -> bool:
    """Dequantize ``b`` of a constant has a scale per channel."""
    arr = b.value.args[0].value.numpy()
    ax = int(b.value.attrs.axis) % max(arr.ndim, 1)
    return _qparams(qg, b.value, b.name, arr.shape[ax] if arr.ndim else 1).scale.size != 1


def _dequantize_rest(qg) -> None:
    """The dequantizes left (of activations or, in ONNX, per-tensor constants feeding float ops or
    the model output) in integer arithmetic; a quantize left is an error."""
    relax = _ops()[0]
    # what realized spans left unread: a dequantize a span read twice (hardswish's x and x * ...), a
    # split whose items are realized, shape computations of realized slices
    drop_dead(qg)
    for b in list(qg.bindings):
        if b.op == "relax.quantize":
            found = None if _is_torch(qg) else run_time_quantized(qg, b)
            if found is None:
                raise IrgenError(f"{SCHEME}: quantize at tensor {b.name!r} is left after folding")
            # a constant quantized at run time whose integers an integer op reads as they are (a
            # gather of Swin V2's position-bias table, GPT-J's rotary table): its integers
            if found[0] is None:
                raise IrgenError(f"{SCHEME}: constant {b.name!r} is quantized per channel at run time; not supported")
            qg.replace([b.name], relax.const(found[0]))  # a constant: the layers reading it record its integers
            continue
        if b.op != "relax.dequantize":
            continue
        src = b.value.args[0]
        if not isinstance(src, relax.Var):
            if qg.n_users(b.name) == 0:
                continue
            if _is_torch(qg) or _per_channel(qg, b):
                # a weight dequantized for a float op whose result is never quantized (PT2E's X86
                # quantizer leaves the last Linear's output float; NNCF and ``nncf.strip`` leave the
                # classifier's Gemm float): the runtime dequantizes it in float32, float32(w - zp) *
                # scale per channel (ORT's DequantizeLinear, torch's dequantize), and the float op
                # reads those values: a float constant of the layer reading it
                qg.replace([b.name], relax.const(_dequantized_constant(qg, b)))
                continue
        # a per-tensor constant too (ONNX): ORT dequantizes it in float for the float op that reads
        # it (EfficientViT-M's attention biases, gathered twice before their quantize)
        _dequantize_layer(qg, b, src)
    left = [b for b in qg.bindings if b.op == "relax.dequantize" and qg.n_users(b.name) > 0]
    if left:
        raise IrgenError(f"{SCHEME}: dequantize at tensor {left[0].name!r} is left after folding")


def _dequantize_layer(qg, b, src) -> None:
    """Dequantize ``b`` of ``src`` as a layer: ``float32(x - zp) * scale``, per tensor, or per
    channel along its axis (ONNX: NNCF quantizes an activation per channel, ORT's
    DequantizeLinear dequantizes each channel with its own parameters)."""
    _, op, q, _ = _ops()
    qx = _qparams(qg, b.value, getattr(src, "name", b.name))
    if qx.scale.size == 1:
        xs = _offset(qg, src, int(qx.zero_point[0]))
        scale = q.rx_const(qx.scale[0], "float32")
    else:
        ndim = len(src.ty.shape.values)
        xs = qg.emit(op.subtract(qg.emit(op.astype(src, "int32")), rx_along(qx, qx.zero_point, ndim, "int32")))
        scale = rx_along(qx, qx.scale, ndim, "float32")
    expr = op.multiply(qg.emit(op.astype(xs, "float32")), scale)
    rec = {"scheme": SCHEME, "kind": "dequantize", "inputs": [qx.record()],
           "output": q.float_record(), "requant": {"rounding_rule": "y = float32(x - zp) * scale"}}
    qg.replace([b.name], expr, rec)
