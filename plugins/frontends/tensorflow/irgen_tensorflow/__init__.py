"""irgen frontends for TensorFlow models: ``.tflite`` through TVM's Relax TFLite importer.

Two frontends: ``tflite`` (this module) and ``keras`` (:mod:`irgen_tensorflow.keras_frontend`:
Keras files and SavedModel folders converted to TFLite in-process, then imported here).

TVM's importer keeps no source names, so this frontend subclasses its
``OperatorConverter`` and, as it walks the TFLite operators, binds each
operator's result to a Relax variable named after the TFLite output tensor;
:class:`irgen.api.Provenance` maps those names back to the operator
(``f"{BUILTIN}_{op_index}"``, TFLite operators have no names) and tensor names.

Only the ``tflite`` flatbuffer reader is needed here; TensorFlow itself is not
imported.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from irgen import hookimpl
from irgen.api import Frontend, ImportedModel, InputSpec, IrgenError, Provenance, UnsupportedOpsError

__version__ = "0.1.0"

_IDENTIFIER = b"TFL3"
# TFLite TensorType -> numpy dtype name (tflite/TensorType.py)
_TYPES = {
    0: "float32", 1: "float16", 2: "int32", 3: "uint8", 4: "int64", 5: "string", 6: "bool",
    7: "int16", 8: "complex64", 9: "int8", 10: "float64", 11: "complex128", 12: "uint64",
    13: "resource", 14: "variant", 15: "uint32", 16: "uint16", 17: "int4",
}
_WEIGHT_QUANT = {"int8", "uint8", "int4"}


def _load_model(path: Path):
    try:
        buf = path.read_bytes()
    except OSError as err:
        raise IrgenError(f"{path}: cannot read ({err.strerror or err})") from None
    return _parse_model(buf, str(path))


def _parse_model(buf: bytes, label: str):
    """The ``tflite.Model`` in ``buf``; ``label`` names it in errors (a path)."""
    import tflite

    if len(buf) < 8 or buf[4:8] != _IDENTIFIER:
        raise IrgenError(f"{label}: not a TFLite model (no 'TFL3' flatbuffer identifier at bytes 4..8)")
    try:
        model = tflite.Model.GetRootAsModel(buf, 0)
        n = model.SubgraphsLength()
        if n < 1:
            raise ValueError("the model has no subgraph")
        sg = model.Subgraphs(0)
        if sg.OperatorsLength() < 1:
            raise ValueError("the main subgraph has no operators")
        for i in range(sg.TensorsLength()):  # touch every tensor: a truncated file fails here
            sg.Tensors(i).ShapeAsNumpy()
    except Exception as err:  # flatbuffers raises plain struct/index errors on garbage
        raise IrgenError(f"{label}: not a readable TFLite model ({type(err).__name__}: {err})") from None
    return model


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
        if float_acts and int_weights:
            raise IrgenError(
                f"{where}: op {op_name}: dynamic-range quantized (float activations, int8 weights) "
                f"at tensor {_tensor_name(subgraph, int_weights[0])!r} is not supported; convert with full-integer quantization"
            )


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


def _input_specs(model, shapes: dict[str, tuple[int, ...]]) -> list[InputSpec]:
    sg = model.Subgraphs(0)
    specs = []
    for k in range(sg.InputsLength()):
        idx = sg.Inputs(k)
        t = sg.Tensors(idx)
        name = _tensor_name(sg, idx)
        dtype = _TYPES.get(t.Type(), f"type{t.Type()}")
        if dtype not in ("float32", "float16", "int8", "uint8", "int16", "int32", "int64", "bool"):
            raise IrgenError(f"input {name!r} has TFLite type {dtype}, which irgen cannot feed")
        if name in shapes:
            shape = tuple(int(d) for d in shapes[name])
        else:
            shape = tuple(int(d) for d in t.ShapeAsNumpy()) if t.ShapeLength() else ()
            sig = [int(d) for d in t.ShapeSignatureAsNumpy()] if t.ShapeSignatureLength() else list(shape)
            if any(d < 0 for d in shape) or (any(d < 0 for d in sig) and not shape):
                raise IrgenError(f"input {name!r} has an open dimension; give it with --input-shape {name}=1,...")
        specs.append(InputSpec(name, shape, dtype))
    return specs


def load_tflite(path: Path, options: dict[str, Any]) -> ImportedModel:
    if options.get("calibration") is not None:
        raise IrgenError(f"{path}: --calibration is for Keras files and SavedModel folders; a .tflite model is already converted")
    return import_tflite(_load_model(path), f"tflite frontend ({path.name})", options, "tflite")


def import_tflite(model, where: str, options: dict[str, Any], frontend: str) -> ImportedModel:
    """Import a parsed ``tflite.Model`` (see :func:`_parse_model`) into Relax.

    ``where`` prefixes errors (e.g. ``"tflite frontend (m.tflite)"``); ``frontend``
    is the name recorded in the IR. The ``keras`` frontend converts to TFLite and
    comes through here too.
    """
    import tvm
    from tvm import relax
    from tvm.relax.frontend.tflite import tflite_frontend as tf_fe

    from irgen.names import SafeNames, identifier

    subgraph = model.Subgraphs(0)
    checker = tf_fe.OperatorConverter(model, subgraph, tf_fe.ExprTable(), relax.BlockBuilder())
    _check_ops(checker, subgraph, where)
    specs = _input_specs(model, options.get("input_shapes") or {})

    provenance = Provenance()
    namer = SafeNames(lambda n: "t_" + identifier(n))
    param_names = [namer(s.name) for s in specs]  # inputs first: they keep the plain names
    current: list[Any] = [None]  # (op name, op type) being converted

    class NamingConverter(tf_fe.OperatorConverter):
        """Binds each TFLite operator's results to variables named after its output tensors."""

        def _emit(self, expr, tensor: str, op):
            if isinstance(expr, (relax.Call, relax.TupleGetItem)):
                var = namer(tensor)
                provenance.by_var[var] = (op[0], op[1], tensor)
                return self.bb.emit(expr, name_hint=var)
            return expr

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if not main_bb:  # the first converter is main's; control-flow bodies get their own
                main_bb.append(self.bb)

        def convert_op_to_relax(self):
            for op_idx in range(self.subgraph.OperatorsLength()):
                op = self.subgraph.Operators(op_idx)
                code = self.get_op_code_str(op)
                outs = self.get_output_tensors(op)
                here = (f"{code}_{op_idx}", code)
                top = self.bb is main_bb[0]
                if top:
                    current[0] = here
                ret = self.convert_map[code](op=op)
                if ret is None:  # prefetched: the output is optimized out
                    continue
                ret = self.bb.normalize(ret)
                names = [tf_fe.get_tensor_name(self.subgraph, t.tensor_idx) for t in outs]
                if not top:  # a control-flow body: leave it unnamed
                    for k, n in enumerate(names):
                        self.exp_tab.set_expr(n, ret if len(names) == 1 else ret[k])
                    continue
                if len(names) == 1:
                    self.exp_tab.set_expr(names[0], self._emit(ret, names[0], here))
                    continue
                if isinstance(ret, relax.Call) and isinstance(ret.ty, relax.TupleType):
                    tup = self.bb.emit(ret, name_hint=namer(f"{here[0]}_tuple"))
                    fields = [relax.TupleGetItem(tup, k) for k in range(len(names))]
                else:
                    fields = [ret[k] for k in range(len(names))]
                for n, f in zip(names, fields):
                    self.exp_tab.set_expr(n, self._emit(f, n, here))

    main_bb: list[Any] = []

    shape_dict = {s.name: tuple(s.shape) for s in specs}
    dtype_dict = {s.name: s.dtype for s in specs}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = tf_fe.from_tflite(model, shape_dict, dtype_dict, op_converter=NamingConverter)
    except IrgenError:
        raise
    except tvm.error.OpNotImplemented as err:
        at = f" (op {current[0][0]})" if current[0] else ""
        raise IrgenError(f"{where}{at}: {' '.join(str(err).split())}") from None
    except Exception as err:  # noqa: BLE001  the importer's errors: name the op
        at = f"op {current[0][0]} ({current[0][1]})" if current[0] else "the graph"
        msg = " ".join(str(err).split()) or type(err).__name__
        raise IrgenError(f"{where}: cannot import {at}: {type(err).__name__}: {msg[:300]}") from None

    mod = _finish_main(mod, param_names)
    return ImportedModel(
        mod=mod,
        inputs=specs,
        provenance=provenance,
        frontend=frontend,
        output_names=[_tensor_name(subgraph, subgraph.Outputs(k)) for k in range(subgraph.OutputsLength())],
    )


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
    return relax.transform.Normalize()(mod)


def interpreter_runner(content: bytes, where: str):
    """The TFLite interpreter (reference kernels, every tensor preserved) on a
    flatbuffer; tensors by name. Used by ``irgen verify`` (tflite and keras)."""
    import numpy as np

    from irgen_tensorflow.keras_frontend import _tf

    tf = _tf()  # an IrgenError when TensorFlow is not installed

    def run(inputs: dict[str, Any], tensors: list[str]) -> dict[str, Any]:
        it = tf.lite.Interpreter(
            model_content=content,
            experimental_op_resolver_type=tf.lite.experimental.OpResolverType.BUILTIN_REF,
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
        wanted = set(tensors)
        out: dict[str, Any] = {}
        for d in it.get_tensor_details():
            if d["name"] in wanted and d["name"] not in out:
                try:
                    out[d["name"]] = np.array(it.get_tensor(d["index"]))
                except (ValueError, RuntimeError):
                    continue
        return out

    return run


def source_runner(path: Path, options: dict[str, Any]):
    return interpreter_runner(Path(path).read_bytes(), f"tflite frontend ({Path(path).name})")


@hookimpl
def irgen_register_frontends(register):
    register(
        Frontend(
            name="tflite",
            suffixes=(".tflite",),
            load=load_tflite,
            description="TensorFlow Lite flatbuffers through TVM's Relax TFLite importer",
            runner=source_runner,
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
            description="Keras .keras/.h5 files and SavedModel folders, converted with TFLiteConverter "
            "(int8 with --calibration DIR), then imported as tflite",
        )
    )
