"""irgen frontend for ONNX models (``.onnx``), through TVM's Relax ONNX importer.

TVM's importer keeps no source names, so this frontend subclasses it and, as
it walks the ONNX nodes, binds each node's result to a Relax variable named
after the ONNX output tensor; :class:`irgen.api.Provenance` maps those names
back to ONNX node and tensor names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from irgen import hookimpl
from irgen.api import Frontend, ImportedModel, InputSpec, IrgenError, Provenance, UnsupportedOpsError

__version__ = "0.1.0"


def _load_model(path: Path):
    import onnx
    from google.protobuf.message import DecodeError
    from onnx import external_data_helper

    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError, OSError) as err:
        raise IrgenError(f"{path}: not a readable ONNX model ({type(err).__name__}: {err})") from None
    if not model.graph.node:
        raise IrgenError(f"{path}: not a readable ONNX model (the graph has no nodes)")
    # external data: only files inside the model's folder
    base = path.resolve().parent
    tensors = [t for t in external_data_helper._get_all_tensors(model) if external_data_helper.uses_external_data(t)]
    for t in tensors:
        info = {e.key: e.value for e in t.external_data}
        target = (base / info.get("location", "")).resolve()
        if base not in target.parents:
            raise IrgenError(f"{path}: tensor {t.name!r} points to external data outside the model's folder: {info.get('location')!r}")
        if not target.is_file():
            raise IrgenError(f"{path}: external data file of tensor {t.name!r} is missing: {info.get('location')!r}")
    if tensors:
        external_data_helper.load_external_data_for_model(model, str(base))
    return model


def _check_ops(model, path: Path) -> None:
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    known = set(_get_convert_map()) | {"If", "Constant"}
    missing = sorted({n.op_type for n in model.graph.node if n.op_type not in known})
    if missing:
        raise UnsupportedOpsError(f"onnx frontend ({path.name})", missing)


def _input_specs(model, shapes: dict[str, tuple[int, ...]]) -> list[InputSpec]:
    from onnx import helper

    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dtype = str(helper.tensor_dtype_to_np_dtype(tt.elem_type))
        if vi.name in shapes:
            shape = tuple(shapes[vi.name])
        else:
            dims = []
            for d in tt.shape.dim:
                if d.HasField("dim_value") and d.dim_value > 0:
                    dims.append(int(d.dim_value))
                else:
                    raise IrgenError(
                        f"input {vi.name!r} has an open dimension {d.dim_param or '?'!r}; "
                        f"give it with --input-shape {vi.name}=1,..."
                    )
            shape = tuple(dims)
        specs.append(InputSpec(vi.name, shape, dtype))
    return specs


def load_onnx(path: Path, options: dict[str, Any]) -> ImportedModel:
    import warnings

    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import onnx_frontend as of

    from irgen.names import SafeNames, identifier

    model = _load_model(path)
    _check_ops(model, path)
    specs = _input_specs(model, options.get("input_shapes") or {})
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    provenance = Provenance()
    namer = SafeNames(lambda n: "t_" + identifier(n))

    class NamingImporter(of.ONNXGraphImporter):
        """Binds each ONNX node's results to variables named after its outputs."""

        current: Any = None

        def _construct_nodes(self, graph):
            class One:
                pass

            for node in graph.node:
                one = One()
                one.node = [node]
                # If-branches are converted into their own blocks: leave them unnamed
                NamingImporter.current = node if node.op_type != "If" else None
                super()._construct_nodes(one)

        def _name(self, k: int) -> str:
            node = NamingImporter.current
            tensor = node.output[k] if k < len(node.output) else f"{node.name or node.op_type}:{k}"
            var = namer(tensor)
            provenance.by_var[var] = (node.name or f"{node.op_type}_{tensor}", node.op_type, tensor if k < len(node.output) else None)
            return var

        def _emit(self, expr, k: int):
            if isinstance(expr, (relax.Call, relax.TupleGetItem)):
                return self.bb.emit(expr, name_hint=self._name(k))
            return expr

        def _convert_operator(self, op_name, inputs, attrs, opset):
            sym = super()._convert_operator(op_name, inputs, attrs, opset)
            if NamingImporter.current is None:  # inside a subgraph
                return sym
            if isinstance(sym, relax.Tuple):
                return relax.Tuple([self._emit(f, k) for k, f in enumerate(sym.fields)])
            if isinstance(sym, relax.Call) and isinstance(sym.ty, relax.TupleType):
                tup = self.bb.emit(sym, name_hint=namer(f"{NamingImporter.current.name}_tuple"))
                return relax.Tuple([self._emit(relax.TupleGetItem(tup, k), k) for k in range(len(sym.ty.fields))])
            return self._emit(sym, 0)

    shape_dict = {s.name: list(s.shape) for s in specs}
    dtype_dict = {s.name: s.dtype for s in specs}
    importer = NamingImporter(shape_dict, dtype_dict, keep_params_in_input=False, sanitize=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importer.from_onnx(model.graph, opset)
    except IrgenError:
        raise
    except tvm.error.OpNotImplemented as err:
        raise IrgenError(f"onnx frontend ({path.name}): {err}") from None
    except Exception as err:  # the importer's own errors name the op in their text
        node = NamingImporter.current
        where = f"node {node.name!r} ({node.op_type})" if node is not None else "the graph"
        raise IrgenError(f"onnx frontend ({path.name}): cannot import {where}: {type(err).__name__}: {err}") from None
    mod = relax.transform.Normalize()(mod)
    return ImportedModel(
        mod=mod,
        inputs=specs,
        provenance=provenance,
        frontend="onnx",
        output_names=[o.name for o in model.graph.output],
    )


def source_runner(path: Path, options: dict[str, Any]):
    """ONNX Runtime on the model, every requested tensor made a graph output.

    Types come from an ONNX shape-inferred copy. Float models run without
    graph optimizations (each node as written); quantized (QDQ) models with
    ONNX Runtime's default optimizations and ``session.qdqisint8allowed=1``,
    which fuse every QDQ group into the integer kernels irgen reproduces."""
    try:
        import onnx
        import onnxruntime as ort
    except ImportError as err:
        raise IrgenError(f"onnx source check needs onnxruntime ({err})") from None
    model = _load_model(path)
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001  fall back to untyped outputs
        pass
    quantized = any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)
    produced = {o for n in model.graph.node for o in n.output if o}
    value_info = {v.name: v for v in model.graph.value_info}

    def run(inputs: dict[str, Any], tensors: list[str]) -> dict[str, Any]:
        m = onnx.ModelProto()
        m.CopyFrom(model)
        have = {o.name for o in m.graph.output}
        for name in tensors:
            if name in produced and name not in have:
                m.graph.output.append(value_info[name] if name in value_info else onnx.ValueInfoProto(name=name))
                have.add(name)
        so = ort.SessionOptions()
        if not quantized:
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        else:  # int8-activation Q/DQ groups run as integer kernels too (else ORT runs some in float on x86)
            so.add_session_config_entry("session.qdqisint8allowed", "1")
        sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        feeds = {i.name: inputs[i.name] for i in sess.get_inputs() if i.name in inputs}
        names = [o.name for o in sess.get_outputs()]
        values = dict(zip(names, sess.run(names, feeds)))
        values.update({k: v for k, v in inputs.items()})
        return {t: values[t] for t in tensors if t in values}

    return run


@hookimpl
def irgen_register_frontends(register):
    register(
        Frontend(
            name="onnx",
            suffixes=(".onnx",),
            load=load_onnx,
            description="ONNX models through TVM's Relax ONNX importer",
            runner=source_runner,
        )
    )
