"""irgen frontend for ONNX models (``.onnx``), through TVM's Relax ONNX importer.

TVM's importer keeps no source names, so this frontend subclasses it and, as
it walks the ONNX nodes, binds each node's result to a Relax variable named
after the ONNX output tensor; :class:`irgen.plugin.Provenance` maps those names
back to ONNX node and tensor names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from irgen.plugin import Frontend, ImportedModel, IrgenError, Provenance, UnsupportedOpsError, hookimpl

from . import checks, loader
from .converters import CONVERTERS
from .fold import fold_shape_computations, fuse_erf_gelu
from .inline import inline_constant_ifs
from .loader import all_graphs, one_line

__version__ = "0.1.0"


def prepare(path: Path, options: dict[str, Any], for_tvm: bool = True):
    """The model in ``path``, checked and ready for import, and its input specs.

    Every check runs before TVM's importer (which folds constants, so a size
    bomb would be allocated while importing): the file and its external data
    (:mod:`.loader`), the graph's structure and tensors, ``onnx.checker``, the
    ops TVM knows, ``--input-shape``, and the size of every tensor whose shape
    is known statically (:mod:`.checks`). ``If`` nodes with a constant
    condition are replaced by their branch (:mod:`.inline`). ``for_tvm=False``
    (ONNX Runtime, which runs any op and any If) skips the op check and keeps
    an If with a condition computed at run time. For TVM, values computed from the
    fixed input shapes are folded to constants and the erf form of GELU becomes one
    ``Gelu`` node (:mod:`.fold`)."""
    path = Path(path)
    limit = checks.default_limit(options)
    model = loader.load_model(path, limit)
    checks.check_structure(model, path)
    checks.check_tensors(model, path, limit)
    if for_tvm:
        from .qoperator import to_qdq

        to_qdq(model)  # QOperator-format nodes -> their QDQ node units (ONNX Runtime runs the original)
        _check_ops(model, path)
    checks.run_checker(checks.skeleton(model), path)
    inline_constant_ifs(model, path, refuse_dynamic=for_tvm)
    specs = checks.input_specs(model, options.get("input_shapes") or {}, limit, path)
    checks.check_sizes(model, checks.skeleton(model), specs, limit, path)
    if for_tvm:
        fold_shape_computations(model, specs)
        fuse_erf_gelu(model)
    return model, specs


def _load_model(path: Path, options: dict[str, Any] | None = None, for_tvm: bool = True):
    """The checked model (see :func:`prepare`)."""
    return prepare(path, options or {}, for_tvm)[0]


def _check_ops(model, path: Path) -> None:
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    known = set(_get_convert_map()) | {"If", "Constant"}
    missing = sorted({n.op_type for g in all_graphs(model.graph) for n in g.node if n.op_type not in known})
    if missing:
        raise UnsupportedOpsError(f"onnx frontend ({path.name})", [loader.q(m)[1:-1] for m in missing[:50]])


def load_onnx(path: Path, options: dict[str, Any]) -> ImportedModel:
    import contextlib
    import io
    import warnings

    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import onnx_frontend as of

    from irgen.plugin import SafeNames, identifier

    model, specs = prepare(path, options)
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
            own = CONVERTERS.get(op_name)
            theirs = of._get_convert_map().get(op_name)
            sym = own(self.bb, inputs, attrs, opset) if own is not None else NotImplemented
            if sym is not NotImplemented:
                sym = self.bb.normalize(sym)
            elif theirs is not None and NamingImporter.current is not None:
                # TVM's own step, except that a tuple's ops (LayerNormalization's output beside
                # its placeholders) are bound under the node's output names before normalize
                # would bind them unnamed
                sym = theirs.get_converter(opset)(self.bb, inputs, attrs, [self._nodes, self._params])
                if isinstance(sym, relax.Tuple):
                    sym = relax.Tuple([self._emit(f, k) for k, f in enumerate(sym.fields)])
                if isinstance(sym, relax.Expr):
                    sym = self.bb.normalize(sym)
            else:
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
    try:  # the importer prints "Error converting operator ..." on stdout before raising
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            mod = importer.from_onnx(model.graph, opset)
    except BaseException as err:
        _close_builder(importer.bb)
        if isinstance(err, IrgenError) or not isinstance(err, Exception):
            raise
        if isinstance(err, tvm.error.OpNotImplemented):
            raise IrgenError(f"onnx frontend ({path.name}): {one_line(err, 4000)}") from None
        node = NamingImporter.current  # the importer's own errors name the op in their text
        where = f"node {loader.q(node.name)} ({loader.esc(node.op_type, 40)})" if node is not None else "the graph"
        raise IrgenError(
            f"onnx frontend ({path.name}): cannot import {where}: {type(err).__name__}: {one_line(err, 4000)}"
        ) from None
    mod = relax.transform.Normalize()(mod)
    return ImportedModel(
        mod=mod,
        inputs=specs,
        provenance=provenance,
        frontend="onnx",
        output_names=[o.name for o in model.graph.output],
    )


def _close_builder(bb) -> None:
    """End the binding block and scope an importer failure left open in ``bb``; TVM
    otherwise logs "BlockBuilder destroyed with remaining blocks!" on stderr later."""
    try:
        bb._end_block()
    except Exception:  # noqa: BLE001  no block open: the failure came before the function
        return
    bb.end_scope()


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
    model = _load_model(path, options, for_tvm=False)
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

    run.runtime = f"onnxruntime {ort.__version__}"
    run.kernels = ("CPU; Q/DQ groups fused into integer kernels (session.qdqisint8allowed=1)" if quantized
                   else "CPU; no graph optimization")
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
            quant_dialect="onnx-qdq",
        )
    )
