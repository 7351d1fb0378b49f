"""irgen frontends for TensorFlow models: ``.tflite`` through TVM's Relax TFLite importer.

Two frontends: ``tflite`` (this module) and ``keras`` (:mod:`irgen_tensorflow.keras_frontend`:
Keras files and SavedModel folders converted to TFLite in-process, then imported here).

TVM's importer keeps no source names, so this frontend subclasses its
``OperatorConverter`` and, as it walks the TFLite operators, binds each
operator's result to a Relax variable named after the TFLite output tensor;
:class:`irgen.plugin.Provenance` maps those names back to the operator
(``f"{BUILTIN}_{op_index}"``, TFLite operators have no names) and tensor names.

Only the ``tflite`` flatbuffer reader is needed here; TensorFlow itself is not
imported.
"""

from __future__ import annotations

import functools
import gc
import struct
import warnings
from pathlib import Path
from typing import Any

from irgen.plugin import (Frontend, ImportedModel, InputSpec, IrgenError, Option, Provenance, UnsupportedOpsError,
                          hookimpl)
from irgen_tensorflow import hybrid
from irgen_tensorflow.tflite_check import TYPES as _TYPES
from irgen_tensorflow.tflite_check import Unreadable, check_model

__version__ = "0.1.0"

_WEIGHT_QUANT = {"int8", "uint8", "int4"}
# errors the flatbuffer reader raises on bytes that are not what the schema says
_READER_ERRORS = (struct.error, IndexError, ValueError, TypeError, OverflowError, UnicodeDecodeError,
                  AttributeError, MemoryError)


def max_tensor_bytes(options: dict[str, Any]) -> int | None:
    """``--max-tensor-bytes`` from the frontend options (the default limit when a
    caller passes no such option)."""
    from irgen.plugin import DEFAULT_MAX_TENSOR_BYTES

    return options.get("max_tensor_bytes", DEFAULT_MAX_TENSOR_BYTES)


def _load_model(path: Path, limit: int | None = None):
    from irgen.plugin import read_bytes

    buf = read_bytes(path, "model")  # a regular file only: never a FIFO or a device
    return _parse_model(buf, str(path), limit)


def _parse_model(buf: bytes, label: str, limit: int | None = None):
    """The ``tflite.Model`` in ``buf``, checked (:func:`tflite_check.check_model`), read as
    the TFLite interpreter reads it (:mod:`irgen_tensorflow.external`: buffers stored after
    the flatbuffer, operator codes); ``label`` names it in errors (a path); ``limit`` is
    ``--max-tensor-bytes``."""
    import tflite

    from irgen_tensorflow.external import as_interpreted

    try:
        outside = check_model(buf, limit, label)
        return as_interpreted(buf, outside)
    except Unreadable as err:
        raise IrgenError(f"{label}: not a readable TFLite model ({err})") from None
    except IrgenError:
        raise
    except _READER_ERRORS as err:
        raise IrgenError(f"{label}: not a readable TFLite model ({type(err).__name__}: {_short(err)})") from None


def _short(err: BaseException, n: int = 300) -> str:
    return (" ".join(str(err).split()) or type(err).__name__)[:n]


def _from_reader(err: BaseException) -> bool:
    """Whether ``err`` came out of the flatbuffer reader (bytes the schema did not expect)."""
    if isinstance(err, (struct.error, UnicodeDecodeError)):
        return True
    tb = err.__traceback__
    last = None
    while tb is not None:
        last = tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    if last is None:
        return False
    import flatbuffers
    import tflite

    readers = (Path(flatbuffers.__file__).parent, Path(tflite.__file__).parent)
    return any(Path(last).parent == d for d in readers)


def _tensor_name(subgraph, idx: int) -> str:
    from tvm.relax.frontend.tflite.tflite_frontend import get_tensor_name

    return get_tensor_name(subgraph, idx)


def _op_names(converter, subgraph) -> list[tuple[str, str]]:
    """(op name, op type) of every operator of the main subgraph, in order."""
    out = []
    for i in range(subgraph.OperatorsLength()):
        op = subgraph.Operators(i)
        try:
            code = converter.get_op_code_str(op)
        except NotImplementedError:
            oc = converter.model.OperatorCodes(op.OpcodeIndex())
            custom = oc.CustomCode()
            code = f"CUSTOM({custom.decode(errors='replace')})" if custom else f"BUILTIN_{max(oc.DeprecatedBuiltinCode(), oc.BuiltinCode())}"
        out.append((f"{code}_{i}", code))
    return out


def _check_ops(converter, subgraph, where: str) -> None:
    """All unsupported ops at once, then dynamic-range (hybrid) quantization."""
    names = _op_names(converter, subgraph)
    missing = sorted({code for _, code in names if code not in converter.convert_map})
    if missing:
        raise UnsupportedOpsError(where, missing)
    for i, (op_name, code) in enumerate(names):
        op = subgraph.Operators(i)
        ins = [int(t) for t in op.InputsAsNumpy() if t >= 0] if op.InputsLength() else []
        float_acts = [t for t in ins if _TYPES.get(subgraph.Tensors(t).Type()) == "float32" and not _is_const(converter, subgraph, t)]
        int_weights = [t for t in ins if _TYPES.get(subgraph.Tensors(t).Type()) in _WEIGHT_QUANT and _is_const(converter, subgraph, t)]
        if code == "SOFTMAX" and _softmax_beta(op) != 1.0:
            raise IrgenError(
                f"{where}: op {op_name}: SOFTMAX with beta={_softmax_beta(op):g} is not supported "
                "(TVM's TFLite importer computes softmax(x) and drops beta)"
            )
        if code in ("ADD", "SUB") and _pot_scale_int16(subgraph, op):
            raise IrgenError(
                f"{where}: op {op_name}: an int16 {code} whose scales are all powers of two, with the op's "
                "pot_scale_int16 option, runs TFLite's power-of-two kernel, which irgen does not have")
        if float_acts and int_weights and code not in hybrid.HYBRID_OPS:  # irgen builds these
            raise IrgenError(
                f"{where}: op {op_name}: dynamic-range quantized (float activations, int8 weights) "
                f"at tensor {_tensor_name(subgraph, int_weights[0])!r} is not supported; convert with full-integer quantization"
            )


def _pot_scale_int16(subgraph, op) -> bool:
    """Whether an int16 ADD/SUB takes TFLite's power-of-two kernel: its ``pot_scale_int16`` option
    set (the schema's default) and every scale a power of two (add.cc/sub.cc, Prepare)."""
    import math

    from tflite.AddOptions import AddOptions

    ts = [subgraph.Tensors(int(t)) for t in list(op.InputsAsNumpy()) + list(op.OutputsAsNumpy()) if t >= 0]
    if not ts or any(_TYPES.get(t.Type()) != "int16" for t in ts):
        return False
    scales = [float(t.Quantization().Scale(0)) if t.Quantization() is not None and t.Quantization().ScaleLength()
              else 0.0 for t in ts]
    if not all(s > 0 and math.frexp(s)[0] == 0.5 for s in scales):
        return False
    table = op.BuiltinOptions()
    if table is None:
        return True
    options = AddOptions()  # SubOptions has the same layout for this field (slot 6)
    options.Init(table.Bytes, table.Pos)
    return bool(options.PotScaleInt16())


def _softmax_beta(op) -> float:
    from tflite.SoftmaxOptions import SoftmaxOptions

    table = op.BuiltinOptions()
    if table is None:
        return 1.0
    options = SoftmaxOptions()
    options.Init(table.Bytes, table.Pos)
    return float(options.Beta())


def _is_const(converter, subgraph, idx: int) -> bool:
    buf = converter.model.Buffers(subgraph.Tensors(idx).Buffer())
    return buf is not None and buf.DataLength() > 0


def _input_specs(model, shapes: dict[str, tuple[int, ...]], limit: int | None = None) -> list[InputSpec]:
    """The main subgraph's inputs. ``shapes`` (``--input-shape``) may only name
    inputs of the model and only set its open dimensions (-1 in the tensor's
    shape signature); a TFLite model's other dimensions are fixed."""
    from irgen.plugin import check_tensor_size

    sg = model.Subgraphs(0)
    declared = []
    for k in range(sg.InputsLength()):
        idx = sg.Inputs(k)
        t = sg.Tensors(idx)
        shape = tuple(int(d) for d in t.ShapeAsNumpy()) if t.ShapeLength() else ()
        sig = tuple(int(d) for d in t.ShapeSignatureAsNumpy()) if t.ShapeSignatureLength() else shape
        declared.append((_tensor_name(sg, idx), t, shape, sig))
    names = [d[0] for d in declared]
    for name in shapes:
        if name not in names:
            listed = ", ".join(f"{n!r} {_dims(sig)}" for n, _, _, sig in declared) or "none"
            raise IrgenError(f"--input-shape {name}: the model has no input {name!r} (its inputs: {listed})")
    specs = []
    for name, t, shape, sig in declared:
        dtype = _TYPES.get(t.Type(), f"type{t.Type()}")
        if dtype not in ("float32", "float16", "int8", "uint8", "int16", "int32", "int64", "bool"):
            raise IrgenError(f"input {name!r} has TFLite type {dtype}, which irgen cannot feed")
        unranked = not sig and not t.HasRank()
        if name in shapes:
            want = tuple(int(d) for d in shapes[name])
            fits = unranked or (len(want) == len(sig) and all(w == d or d < 0 for w, d in zip(want, sig)))
            if not fits:
                open_ = [i for i, d in enumerate(sig) if d < 0]
                given = f"--input-shape {name}={','.join(map(str, want))}"
                if not open_:
                    raise IrgenError(f"{given}: input {name!r} has the fixed shape {_dims(sig)} in the model")
                raise IrgenError(f"{given}: input {name!r} has the shape {_dims(sig)} in the model; only its "
                                 "-1 dimensions can be set")
            shape = want
        elif any(d < 0 for d in shape) or (any(d < 0 for d in sig) and not shape):
            raise IrgenError(f"input {name!r} has an open dimension; give it with --input-shape {name}=1,...")
        check_tensor_size(f"input {name!r}", shape, dtype, limit)
        specs.append(InputSpec(name, shape, dtype, _input_quantization(t, dtype)))
    return specs


def _input_quantization(t, dtype: str) -> tuple[float, int] | None:
    """(scale, zero point) of an integer input with one per-tensor scale, else None."""
    if dtype not in ("int8", "uint8", "int16"):
        return None
    q = t.Quantization()
    if q is None or q.ScaleLength() != 1 or q.ZeroPointLength() != 1:
        return None
    scale = float(q.Scale(0))
    return (scale, int(q.ZeroPoint(0))) if 0 < scale < float("inf") else None


def _dims(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def load_tflite(path: Path, options: dict[str, Any]) -> ImportedModel:
    if options.get("calibration") is not None:
        raise IrgenError(f"{path}: --calibration is for Keras files and SavedModel folders; a .tflite model is already converted")
    model = _load_model(Path(path), max_tensor_bytes(options))
    return import_tflite(model, f"tflite frontend ({Path(path).name})", options, "tflite", label=str(path))


def import_tflite(model, where: str, options: dict[str, Any], frontend: str, label: str | None = None) -> ImportedModel:
    """Import a parsed ``tflite.Model`` (see :func:`_parse_model`) into Relax.

    ``where`` prefixes errors (e.g. ``"tflite frontend (m.tflite)"``); ``frontend``
    is the name recorded in the IR; ``label`` names the file in "not a readable
    TFLite model" errors (default ``where``). The ``keras`` frontend converts to
    TFLite and comes through here too.

    Every failure is one :class:`IrgenError`; what TVM's C++ code logs on the way
    (e.g. a half-built BlockBuilder's warning) is kept off stderr.
    """
    from irgen_tensorflow.quiet import captured_fds, captured_text

    label = label or where
    state: dict[str, Any] = {"current": None, "main_bb": []}
    failure: IrgenError | None = None
    with captured_fds() as log:
        try:
            result = _import(model, where, options, frontend, state)
        except IrgenError as err:
            failure = err
        except Exception as err:  # noqa: BLE001  the reader's and the importer's errors: one line
            failure = _import_error(err, where, label, state["current"])
        if failure is not None:
            # free the half-built BlockBuilders now, while their C++ warning is captured
            failure = failure.with_traceback(None)
            failure.__context__ = failure.__cause__ = None
            state.clear()
            gc.collect()
        else:
            noise = captured_text(log)
    if failure is not None:
        raise failure from None
    if noise.strip():
        import sys

        sys.stderr.write(noise)
    return result


def _import_error(err: Exception, where: str, label: str, current) -> IrgenError:
    import tvm

    at = f"op {current[0]} ({current[1]})" if current else None
    if _from_reader(err):
        return IrgenError(f"{label}: not a readable TFLite model ({at + ': ' if at else ''}"
                          f"{type(err).__name__}: {_short(err)})")
    if isinstance(err, tvm.error.OpNotImplemented):
        return IrgenError(f"{where}{f' (op {current[0]})' if current else ''}: {_short(err)}")
    if isinstance(err, RecursionError):
        return IrgenError(f"{where}: cannot import {at or 'the graph'}: nested too deeply")
    return IrgenError(f"{where}: cannot import {at or 'the graph'}: {type(err).__name__}: {_short(err)}")


def _import(model, where: str, options: dict[str, Any], frontend: str, state: dict[str, Any]) -> ImportedModel:
    """Import the checked TFLite ``model``'s main subgraph into a Relax module whose variables are
    named after the TFLite tensors; ``state["current"]`` names the operator being converted (for
    errors), ``state["main_bb"]`` receives main's BlockBuilder."""
    from tvm import relax
    from tvm.relax.frontend.tflite import tflite_frontend as tf_fe

    from irgen.plugin import SafeNames, check_tensor_sizes, identifier, module_bindings

    limit = max_tensor_bytes(options)
    subgraph = model.Subgraphs(0)
    checker = tf_fe.OperatorConverter(model, subgraph, tf_fe.ExprTable(), relax.BlockBuilder())
    _check_ops(checker, subgraph, where)
    specs = _input_specs(model, options.get("input_shapes") or {}, limit)

    provenance = Provenance()
    namer = SafeNames(lambda n: "t_" + identifier(n))
    param_names = [namer(s.name) for s in specs]  # inputs first: they keep the plain names
    converter = _naming_converter(where, namer, provenance, state)
    shape_dict = {s.name: tuple(s.shape) for s in specs}
    dtype_dict = {s.name: s.dtype for s in specs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = tf_fe.from_tflite(model, shape_dict, dtype_dict, op_converter=converter)
    state["current"] = None
    mod = _finish_main(mod, param_names)
    # a constant such as a PAD amount or a RESHAPE target can make a tensor far larger than declared
    check_tensor_sizes(module_bindings(mod), limit, provenance, where)
    return ImportedModel(
        mod=mod,
        inputs=specs,
        provenance=provenance,
        frontend=frontend,
        output_names=[_tensor_name(subgraph, subgraph.Outputs(k)) for k in range(subgraph.OutputsLength())],
    )


def _naming_converter(where: str, namer, provenance: Provenance, state: dict[str, Any]) -> type:
    """The ``OperatorConverter`` subclass for one import: irgen's converters and dynamic-range
    kernels, its fused-activation bounds and wide biases, and every main-graph operator's results
    bound to variables named after its output tensors (``namer``), recorded in ``provenance``."""
    from tvm import relax
    from tvm.relax.frontend.tflite import tflite_frontend as tf_fe

    from irgen_tensorflow import converters

    main_bb: list[Any] = state["main_bb"]

    class NamingConverter(tf_fe.OperatorConverter):
        """Binds each TFLite operator's results to variables named after its output tensors."""

        def _emit(self, expr, tensor: str, op):
            if isinstance(expr, (relax.Call, relax.TupleGetItem)):
                var = namer(tensor)
                provenance.by_var[var] = (op[0], op[1], tensor)
                return self.bb.emit(expr, name_hint=var)
            return expr

        _SUPPORTED_QUANTIZED_OPS = tf_fe.OperatorConverter._SUPPORTED_QUANTIZED_OPS | converters.QUANTIZED_OK
        # what a WHILE loop's unrolled steps (:mod:`.loops`) name and record their bindings with
        irgen_where, irgen_namer, irgen_provenance, irgen_state = where, namer, provenance, state

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for code, fn in converters.CONVERTERS.items():
                self.convert_map[code] = functools.partial(fn, self)
            for code in hybrid.HYBRID_OPS:  # dynamic-range kernels, the op's converter otherwise
                self.convert_map[code] = functools.partial(hybrid.convert, self, code, self.convert_map[code])
            if not main_bb:  # the first converter is main's; control-flow bodies get their own
                main_bb.append(self.bb)

        def convert_qnn_fused_activation_function(self, expr, fused_activation_fn, scale, zero_point, dtype):
            at = f"{where}: op {state['current'][0]}" if state.get("current") else where
            rng = converters.activation_range(fused_activation_fn, scale, zero_point, dtype, at)
            if rng is None:
                return super().convert_qnn_fused_activation_function(expr, fused_activation_fn, scale, zero_point, dtype)
            return relax.op.clip(expr, min=float(rng[0]), max=float(rng[1]))

        def dequantize(self, expr, tensor):
            wide = converters.wide_bias(expr, tensor)
            return wide if wide is not None else super().dequantize(expr, tensor)

        def check_unsupported_ops(self):
            """TVM's check, less its refusal of dynamic-range ops irgen builds (:mod:`.hybrid`);
            irgen's own check (:func:`_check_ops`) ran before."""
            _check_quantized_ops(self)

        def convert_op_to_relax(self):
            for op_idx in range(self.subgraph.OperatorsLength()):
                _convert_op(self, op_idx, main_bb, state, namer)

    return NamingConverter


def _check_quantized_ops(conv) -> None:
    """Refuse, as TVM's ``check_unsupported_ops`` does, a quantized operator TVM's importer and
    irgen's converters cannot build; a dynamic-range op :mod:`.hybrid` builds passes."""
    import tvm

    for op_idx in range(conv.subgraph.OperatorsLength()):
        op = conv.subgraph.Operators(op_idx)
        code = conv.get_op_code_str(op)
        if code in hybrid.HYBRID_OPS and hybrid.is_hybrid(conv, op):
            continue
        tensors = conv.get_input_tensors(op) + conv.get_output_tensors(op)
        if any(t.qnn_params is not None for t in tensors) and code not in conv._SUPPORTED_QUANTIZED_OPS:
            raise tvm.error.OpNotImplemented(
                f"The following quantized TFLite operators are not supported in frontend TFLite yet: '{code}'")


def _convert_op(conv, op_idx: int, main_bb: list[Any], state: dict[str, Any], namer) -> None:
    """Convert operator ``op_idx`` of ``conv``'s subgraph and set its output tensors' expressions:
    in main (``main_bb[0]``), named variables (``state["current"]`` names the operator meanwhile);
    in a control-flow body, the unnamed expressions."""
    from tvm.relax.frontend.tflite import tflite_frontend as tf_fe

    from irgen_tensorflow import converters

    op = conv.subgraph.Operators(op_idx)
    code = conv.get_op_code_str(op)
    outs = conv.get_output_tensors(op)
    here = (f"{code}_{op_idx}", code)
    top = conv.bb is main_bb[0]
    if top:
        state["current"] = here
    ret = conv.convert_map[code](op=op)
    if ret is None:  # prefetched: the output is optimized out
        return
    ret = conv.bb.normalize(converters.fold_constant(conv, op, ret))
    names = [tf_fe.get_tensor_name(conv.subgraph, t.tensor_idx) for t in outs]
    if not top:  # a control-flow body: leave it unnamed
        for k, n in enumerate(names):
            conv.exp_tab.set_expr(n, ret if len(names) == 1 else ret[k])
        return
    _bind_outputs(conv, ret, names, here, namer)


def _bind_outputs(conv, ret, names: list[str], here: tuple[str, str], namer) -> None:
    """Bind main-graph operator ``here``'s result ``ret`` to variables named after its output
    tensors ``names`` (``namer`` makes them unique; a call returning a tuple is bound once, then
    one variable per field)."""
    from tvm import relax

    if len(names) == 1:
        conv.exp_tab.set_expr(names[0], conv._emit(ret, names[0], here))
        return
    if isinstance(ret, relax.Call) and isinstance(ret.ty, relax.TupleType):
        tup = conv.bb.emit(ret, name_hint=namer(f"{here[0]}_tuple"))
        fields = [relax.TupleGetItem(tup, k) for k in range(len(names))]
    else:
        fields = [ret[k] for k in range(len(names))]
    for n, f in zip(names, fields):
        conv.exp_tab.set_expr(n, conv._emit(f, n, here))


def _finish_main(mod, param_names: list[str]):
    """Sanitized parameter names; drop the ``params``/``num_input`` attributes.

    ``from_tflite`` binds every weight as an inline ``relax.const`` and also lists
    the same arrays in ``main``'s ``params`` attribute; irgen keeps the inline
    constants only.
    """
    import tvm
    from tvm import relax

    func = mod["main"]
    new_params = [relax.Var(n, p.ty) for n, p in zip(param_names, func.params)]
    bound = func.bind_params({p: q for p, q in zip(func.params, new_params)})
    attrs = {k: v for k, v in (func.attrs or {}).items() if k not in ("params", "num_input")}
    new = relax.Function(new_params, bound.body, func.ret_ty if hasattr(func, "ret_ty") else None, func.is_pure)
    if attrs:
        new = new.with_attrs(attrs)
    mod = tvm.IRModule({"main": new})
    from irgen.plugin import tuple_output_outside_dataflow

    return tuple_output_outside_dataflow(relax.transform.Normalize()(mod))


#: the TFLite interpreter's kernels the source check can use: (op resolver, what the report calls them)
TFLITE_KERNELS = {
    "reference": ("BUILTIN_REF", "reference kernels"),
    # the default resolver's kernels without the XNNPACK delegate (which would hide intermediate tensors)
    "optimized": ("BUILTIN_WITHOUT_DEFAULT_DELEGATES", "builtin optimized kernels"),
}


def interpreter_runner(content: bytes, where: str, kernels: str = "reference"):
    """The TFLite interpreter (every tensor preserved) on a flatbuffer; tensors by
    name. Used by ``irgen verify`` (tflite and keras). ``kernels``: a key of
    :data:`TFLITE_KERNELS`. The reference kernels abort on some int8 models (e.g. a
    softmax whose input scale they cannot represent); the runner's ``fallback``
    tells ``irgen verify`` to run the builtin optimized kernels then."""
    import numpy as np

    from irgen_tensorflow.keras_frontend import _tf

    tf = _tf()  # an IrgenError when TensorFlow is not installed
    resolver, described = TFLITE_KERNELS.get(kernels, TFLITE_KERNELS["reference"])

    def invoke(model: bytes, inputs: dict[str, Any]):
        it = tf.lite.Interpreter(
            model_content=model,
            experimental_op_resolver_type=getattr(tf.lite.experimental.OpResolverType, resolver),
            experimental_preserve_all_tensors=True,
        )
        it.allocate_tensors()
        details = it.get_input_details()
        for k, d in enumerate(details):
            value = inputs.get(d["name"])
            if value is None and len(inputs) == len(details):
                value = list(inputs.values())[k]
            it.set_tensor(d["index"], value)
        it.invoke()
        return it

    def run(inputs: dict[str, Any], tensors: list[str]) -> dict[str, Any]:
        it = invoke(content, inputs)
        wanted = set(tensors)
        out: dict[str, Any] = {}
        for d in it.get_tensor_details():
            if d["name"] in wanted and d["name"] not in out:
                try:
                    out[d["name"]] = np.array(it.get_tensor(d["index"]))
                except (ValueError, RuntimeError):
                    continue
        # a WHILE loop's body tensors, one iteration a run (:mod:`.loop_states`)
        from irgen_tensorflow.loop_states import loop_states

        out.update(loop_states(content, wanted - out.keys(), lambda m: invoke(m, inputs), it))
        return out

    run.runtime, run.kernels = "TFLite interpreter", described
    run.fallback = {"tflite_kernels": "optimized"} if resolver == "BUILTIN_REF" else None
    run.exact = resolver == "BUILTIN_REF"  # the tflite-int8 scheme reproduces the reference kernels
    return run


def source_runner(path: Path, options: dict[str, Any]):
    """The TFLite interpreter on the model file, checked as :func:`load_tflite` checks it;
    its reference kernels, or the builtin optimized ones with option ``tflite_kernels``
    "optimized" (``irgen verify`` retries with them when the reference kernels crash)."""
    from irgen.plugin import read_bytes

    path = Path(path)
    content = read_bytes(path, "model")  # a regular file only: never a FIFO or a device
    _parse_model(content, str(path), max_tensor_bytes(options))
    return interpreter_runner(content, f"tflite frontend ({path.name})", options.get("tflite_kernels", "reference"))


@hookimpl
def irgen_register_frontends(register):
    register(
        Frontend(
            name="tflite",
            suffixes=(".tflite",),
            load=load_tflite,
            description="TensorFlow Lite flatbuffers through TVM's Relax TFLite importer",
            runner=source_runner,
            quant_dialect="tflite",
        )
    )
    from irgen_tensorflow import keras_frontend  # light: TensorFlow is imported only by load

    register(
        Frontend(
            name="keras",
            suffixes=(*keras_frontend.KERAS_SUFFIXES, "SavedModel folder"),
            load=keras_frontend.load_keras,
            claims=keras_frontend.claims,
            runner=keras_frontend.source_runner,
            quant_dialect="tflite",  # converted to TFLite first
            description="Keras .keras/.h5 files and SavedModel folders, converted with TFLiteConverter "
            "(int8 with --calibration DIR), then imported as tflite",
        )
    )


@hookimpl
def irgen_register_options(register):
    register(Option(
        name="calibration", kind="path", metavar="DIR", group="keras models", record=True, commands=("run", "verify"),
        help="keras frontend: quantize to full-integer int8, calibrating with DIR/*.npy (one sample each); "
             "irgen verify: the folder, when it is no longer where manifest.json records it",
    ))
