"""The importer: a checked ONNX model -> Relax (:func:`load_onnx`, the frontend's ``load``).

:func:`load_onnx` runs in named steps: check and fix the model
(:func:`irgen_onnx.prepare.prepare`), take its default-domain opset
(:func:`_opset`), convert each node with TVM's ``ONNXGraphImporter`` under
:class:`NamingImporter` (irgen's :data:`~irgen_onnx.converters.CONVERTERS` over
TVM's, each node's results bound to variables named after its ONNX outputs;
:func:`_convert`), an importer error turned into one that names the node
(:func:`_import_error`), then normalize and return the module with its inputs,
outputs and provenance (:func:`_finish`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Callable

from irgen.plugin import ImportedModel, InputSpec, IrgenError, Provenance, SafeNames, identifier

from . import loader, recurrent
from .converters import CONVERTERS, WITH_CONTEXT
from .fold import INVENTED
from .loader import one_line
from .nbits import source_op_type
from .prepare import prepare


@dataclass
class Context:
    """One import's state: the namer of bindings, the provenance it fills, and the
    ONNX node being converted (``None`` inside an If branch or before the first node)."""

    namer: Callable[[str], str] = field(default_factory=lambda: SafeNames(lambda n: "t_" + identifier(n)))
    provenance: Provenance = field(default_factory=Provenance)
    current: Any = None
    #: the name each recurrent node's steps go by (:func:`irgen_onnx.recurrent.base_names`)
    recurrent_names: dict[str, str] = field(default_factory=dict)


def _opset(model) -> int | None:
    """The model's opset of the default ONNX domain."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


# ---------------------------------------------------------------- converting the nodes


@cache
def _naming_importer():
    """:class:`NamingImporter`, built on first use (TVM is imported only then)."""
    from tvm import relax
    from tvm.relax.frontend.onnx import onnx_frontend as of

    class NamingImporter(of.ONNXGraphImporter):
        """Binds each ONNX node's results to variables named after its outputs."""

        def __init__(self, ctx: Context, *args, **kwargs):
            self.ctx = ctx
            super().__init__(*args, **kwargs)

        def _construct_nodes(self, graph):
            class One:
                pass

            for node in graph.node:
                one = One()
                one.node = [node]
                # If-branches are converted into their own blocks: leave them unnamed
                self.ctx.current = node if node.op_type != "If" else None
                super()._construct_nodes(one)

        def _parse_array(self, tensor_proto):
            """A tensor's value, as TVM's importer makes it; a deferred initializer is read
            from its file now (:func:`.loader.tensor_array`), one at a time, and a large one
            kept on the run's weight file (``weight_tensor``), not in memory."""
            from irgen.plugin import weight_tensor

            return weight_tensor(loader.tensor_array(tensor_proto).reshape(tuple(tensor_proto.dims)))

        def _name(self, k: int) -> str:
            node = self.ctx.current
            tensor = node.output[k] if k < len(node.output) else f"{node.name or node.op_type}:{k}"
            var = self.ctx.namer(tensor)
            source = k < len(node.output) and node.doc_string != INVENTED  # a node irgen added has no source tensor
            self.ctx.provenance.by_var[var] = (node.name or f"{node.op_type}_{tensor}", source_op_type(node),
                                               tensor if source else None)
            return var

        def _emit(self, expr, k: int):
            if isinstance(expr, (relax.Call, relax.TupleGetItem)):
                return self.bb.emit(expr, name_hint=self._name(k))
            return expr

        def _convert_operator(self, op_name, inputs, attrs, opset):
            theirs = of._get_convert_map().get(op_name)
            sym = _own(self.bb, op_name, inputs, attrs, opset, self.ctx)
            if sym is not NotImplemented:
                sym = self.bb.normalize(sym)
            elif theirs is not None and self.ctx.current is not None:
                sym = self._theirs(theirs, inputs, attrs, opset)
            else:
                sym = super()._convert_operator(op_name, inputs, attrs, opset)
            if self.ctx.current is None:  # inside a subgraph
                return sym
            return self._bind(sym)

        def _theirs(self, theirs, inputs, attrs, opset):
            """TVM's own step, except that a tuple's ops (LayerNormalization's output beside
            its placeholders) are bound under the node's output names before normalize
            would bind them unnamed."""
            sym = theirs.get_converter(opset)(self.bb, inputs, attrs, [self._nodes, self._params])
            if isinstance(sym, relax.Tuple):
                sym = relax.Tuple([self._emit(f, k) for k, f in enumerate(sym.fields)])
            if isinstance(sym, relax.Expr):
                sym = self.bb.normalize(sym)
            return sym

        def _bind(self, sym):
            """``sym`` bound under the current node's output names (a tuple field by field)."""
            if isinstance(sym, relax.Tuple):
                return relax.Tuple([self._emit(f, k) for k, f in enumerate(sym.fields)])
            if isinstance(sym, relax.Call) and isinstance(sym.ty, relax.TupleType):
                tup = self.bb.emit(sym, name_hint=self.ctx.namer(f"{self.ctx.current.name}_tuple"))
                return relax.Tuple([self._emit(relax.TupleGetItem(tup, k), k) for k in range(len(sym.ty.fields))])
            return self._emit(sym, 0)

    NamingImporter._check_for_unsupported_ops = _check_ops  # irgen's own converters count as known ops
    return NamingImporter


def _check_ops(importer, graph) -> None:
    """TVM's check of the ops before importing, irgen's own converters counting as known ops."""
    import tvm
    from tvm.relax.frontend.onnx import onnx_frontend as of

    known = set(of._get_convert_map()) | set(CONVERTERS) | {"If", "Constant"}
    missing = sorted({n.op_type for n in graph.node if n.op_type not in known})
    if missing:
        raise tvm.error.OpNotImplemented(f"The following operators are not supported for frontend ONNX: "
                                         f"{', '.join(missing)}")


def _own(bb, op_name: str, inputs: list, attrs: dict, opset: int, ctx: Context):
    """irgen's converter of ``op_name`` applied (one of :data:`~irgen_onnx.converters.WITH_CONTEXT`
    binds and names its results itself, given ``ctx``), or NotImplemented."""
    convert = CONVERTERS.get(op_name)
    if convert is None:
        return NotImplemented
    if op_name not in WITH_CONTEXT:
        return convert(bb, inputs, attrs, opset)
    if ctx.current is None:
        raise IrgenError(f"{op_name} inside an If branch is not supported")
    return convert(bb, inputs, attrs, opset, ctx)


def _convert(model, specs: list[InputSpec], opset: int | None, ctx: Context, path: Path):
    """Every node through the naming importer: the Relax module; an importer error names the node."""
    import contextlib
    import io
    import warnings

    shape_dict = {s.name: list(s.shape) for s in specs}
    dtype_dict = {s.name: s.dtype for s in specs}
    importer = _naming_importer()(ctx, shape_dict, dtype_dict, keep_params_in_input=False, sanitize=True)
    try:  # the importer prints "Error converting operator ..." on stdout before raising
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            return importer.from_onnx(model.graph, opset)
    except BaseException as err:
        _close_builder(importer.bb)
        if isinstance(err, IrgenError) or not isinstance(err, Exception):
            raise
        raise _import_error(err, ctx.current, path) from None


def _import_error(err: Exception, node, path: Path) -> IrgenError:
    """The error for the importer's ``err`` while converting ``node`` (``None``: the graph)."""
    import tvm

    if isinstance(err, tvm.error.OpNotImplemented):
        return IrgenError(f"onnx frontend ({path.name}): {one_line(err, 4000)}")
    # the importer's own errors name the op in their text
    where = f"node {loader.q(node.name)} ({loader.esc(node.op_type, 40)})" if node is not None else "the graph"
    return IrgenError(f"onnx frontend ({path.name}): cannot import {where}: {type(err).__name__}: {one_line(err, 4000)}")


def _close_builder(bb) -> None:
    """End the binding block and scope an importer failure left open in ``bb``; TVM
    otherwise logs "BlockBuilder destroyed with remaining blocks!" on stderr later."""
    try:
        bb._end_block()
    except Exception:  # noqa: BLE001  no block open: the failure came before the function
        return
    bb.end_scope()


# ---------------------------------------------------------------- the driver


def _finish(model, mod, specs: list[InputSpec], ctx: Context) -> ImportedModel:
    """The normalized module with its inputs, the ONNX output names and the provenance."""
    from tvm import relax

    from .qonnx import quant_ranges

    ranges = quant_ranges(model)  # weights narrower than their type (a QONNX 4-bit Quant): by binding name
    return ImportedModel(
        mod=relax.transform.Normalize()(mod),
        inputs=specs,
        provenance=ctx.provenance,
        frontend="onnx",
        output_names=[o.name for o in model.graph.output],
        quant_ranges={var: ranges[tensor] for var, (_, _, tensor) in ctx.provenance.by_var.items()
                      if tensor in ranges},
    )


def load_onnx(path: Path, options: dict[str, Any]) -> ImportedModel:
    """The ONNX model in ``path`` as a Relax module, each binding named after its ONNX tensor."""
    model, specs = prepare(path, options)
    ctx = Context(recurrent_names=recurrent.base_names(model.graph))
    mod = _convert(model, specs, _opset(model), ctx, path)
    return _finish(model, mod, specs, ctx)
