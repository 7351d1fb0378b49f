"""The importer: a ``torch.export`` program -> Relax (:func:`translate`), and the
frontend's ``load`` (:func:`load_torch`).

:func:`translate` runs in named steps: collect the graph signature
(:func:`user_inputs`, the user inputs' names and static shapes), bind the
parameters, buffers and constants to their placeholders (:func:`bound_tensors`),
convert each node with TVM's ``ExportedProgramImporter`` under
:class:`NamingImporter` (irgen's :data:`~irgen_torch.converters.CONVERTERS`
over TVM's, each FX node's binding named after the node), then rename the
bindings TVM named and return the module with its inputs, outputs and
provenance (:func:`_finish`).
"""

from __future__ import annotations

import dataclasses
import gc
import re
import warnings
from functools import cache
from pathlib import Path
from typing import Any

from irgen.plugin import (
    ImportedModel,
    InputSpec,
    IrgenError,
    SafeNames,
    UnsupportedOpsError,
    identifier,
    regular_file,
)

from .converters import CONVERTERS, Context
from .dynamic import specialize
from .reduced import ReducedEmit
from .fold import constant_nodes
from .hops import inline_autocast
from .loader import load_pt2, load_pth
from .weights import tvm_weight

# ---------------------------------------------------------------- the graph signature


def user_inputs(ep) -> list[InputSpec]:
    """The program's user inputs, in order, with their static shapes and dtypes."""
    specs = []
    names = set(ep.graph_signature.user_inputs)
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in names:
            val = node.meta.get("val", node.meta.get("tensor_meta"))
            if val is None or not hasattr(val, "shape"):
                raise IrgenError(f"input {node.name!r} is not a tensor; irgen can only feed tensors")
            shape = []
            for d in val.shape:
                try:
                    shape.append(int(d))
                except Exception:  # noqa: BLE001  a symbolic dim
                    raise IrgenError(f"input {node.name!r} has a dynamic dimension {d}; give its shape with "
                                     f"--input-shape {node.name}=DIMS") from None
            specs.append(InputSpec(node.name, tuple(shape), str(val.dtype).replace("torch.", "")))
    return specs


def _named(ep, specs: list[InputSpec], names: list[str], where: str) -> list[InputSpec]:
    """The user inputs under the names the user gave (``--input-shape NAME=DIMS`` of a ``.pth``)."""
    taken = {n.name for n in ep.graph.nodes} - {s.name for s in specs}
    for name in names:
        if name in taken:
            raise IrgenError(f"{where}: input name {name!r} (--input-shape) is also the name of a node in the "
                             f"exported graph; choose another")
    return [InputSpec(n, s.shape, s.dtype) for n, s in zip(names, specs)]


def _check_input_shapes(specs: list[InputSpec], shapes: dict[str, tuple[int, ...]]) -> None:
    """A ``.pt2`` program's input shapes are fixed: every ``--input-shape`` must name one of its
    inputs and give exactly its shape."""
    declared = {s.name: s for s in specs}
    for name, shape in shapes.items():
        given = f"--input-shape {name}={','.join(map(str, shape))}"
        if name not in declared:
            listing = ", ".join(f"{s.name!r} {tuple(s.shape)}" for s in specs) or "none"
            raise IrgenError(f"{given}: the model has no input {name!r} (its inputs: {listing})")
        if tuple(declared[name].shape) != tuple(shape):
            raise IrgenError(f"{given}: the model's input {name!r} has the fixed shape {tuple(declared[name].shape)}")


# ---------------------------------------------------------------- parameters and constants


def bound_tensors(ep) -> dict[str, Any]:
    """Placeholder name -> the buffer/parameter/constant tensor it is bound to (quantization
    parameters, weights)."""
    bound: dict[str, Any] = {}
    state = {**dict(ep.named_buffers()), **dict(ep.constants), **dict(ep.named_parameters())}
    for spec in ep.graph_signature.input_specs:
        if spec.target in state:
            bound[spec.arg.name] = state[spec.target]
    return bound


# ---------------------------------------------------------------- converting the nodes


@cache
def _naming_importer():
    """:class:`NamingImporter`, built on first use (TVM is imported only then)."""
    from tvm import relax
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    class NamingImporter(ExportedProgramImporter):
        """TVM's importer with irgen's converters; names the binding of each FX node's result
        after the node; skips the nodes torch computed (:mod:`irgen_torch.fold`), imported as
        constants."""

        def __init__(self, ctx: Context):
            self.ctx = ctx
            super().__init__()

        def _translate_fx_graph(self, graph_module, nodes, inputs_vars, custom_ops=None):
            return super()._translate_fx_graph(graph_module, _uncomputed(self, nodes), inputs_vars, custom_ops)

        def _check_unsupported_func_type(self, nodes):
            return super()._check_unsupported_func_type([n for n in nodes if n.name not in self.ctx.computed])

        def create_convert_map(self):
            cmap = super().create_convert_map()
            for k, fn in CONVERTERS.items():
                cmap[k] = self._bind(fn)
            return {k: self._wrap(v) for k, v in cmap.items()}

        def _bind(self, fn):
            def convert(node):
                return fn(self, node)

            return convert

        def _wrap(self, fn):
            def convert(node, *rest):
                self.ctx.current = node
                before = self._known_names()
                bb = self.block_builder
                self.block_builder = ReducedEmit(bb)  # float16/bfloat16 convs and matmuls in their type
                try:
                    out = fn(node, *rest)
                finally:
                    self.block_builder = bb
                return _named_result(self, node, out, before)

            return convert

        def _known_names(self) -> set[str]:
            return {v.name for v in self.env.values() if isinstance(v, relax.Var)}

        @staticmethod
        def _convert_pytorch_tensor_to_tvm(tensor_value):
            """A parameter, buffer or constant: a large one on the run's weight file (:mod:`.weights`)."""
            return tvm_weight(tensor_value, ExportedProgramImporter._convert_pytorch_tensor_to_tvm)

        def create_input_vars(self, exported_program):
            params, users, ranges = super().create_input_vars(exported_program)
            self._params = list(params.values()) + list(users.values())
            return params, users, ranges

    return NamingImporter


def _uncomputed(importer, nodes) -> list:
    """The ``nodes`` torch did not compute (:mod:`irgen_torch.fold`); the value of each computed
    one that has a value is bound in ``importer.env`` as a constant."""
    from tvm import relax

    from .runner import to_numpy  # (runner imports this module)

    computed = importer.ctx.computed
    rest = []
    for node in nodes:
        if node.name not in computed:
            rest.append(node)
        elif computed[node.name] is not None:  # a bfloat16 value through ml_dtypes (torch's numpy() refuses it)
            importer.env[node] = relax.const(to_numpy(computed[node.name]))
    return rest


def _named_result(importer, node, out, before: set[str]):
    """``out``, what a converter returned for FX ``node``, with each expression in it named
    after the node (:func:`_named_expr`; a tuple's items ``{node}_{k}``); records the node's
    layer name. ``before``: the variable names the importer knew before the converter ran."""
    from tvm import relax

    op_type = str(node.target)
    importer.ctx.provenance.layer_names.setdefault(node.name, module_path_name(node))
    if isinstance(out, relax.Tuple):
        return relax.Tuple([_named_expr(importer, node, op_type, f, f"{node.name}_{k}", before)
                            for k, f in enumerate(out.fields)])
    if isinstance(out, (tuple, list)):
        return type(out)(_named_expr(importer, node, op_type, f, f"{node.name}_{k}", before)
                         if isinstance(f, relax.Expr) else f for k, f in enumerate(out))
    if isinstance(out, relax.Expr):
        return _named_expr(importer, node, op_type, out, node.name, before)
    return out


def _named_expr(importer, node, op_type: str, expr, tensor: str, before: set[str]):
    """``expr`` bound to a variable named after ``tensor`` when it is a call or a tuple item; a
    variable the converter bound itself (new since ``before``, not renamed yet, not a parameter)
    is recorded for renaming after ``tensor`` instead, unless the converter named it and
    recorded its provenance itself (a recurrent op's results). Provenance records the node
    either way."""
    from tvm import relax

    ctx = importer.ctx
    if isinstance(expr, (relax.Call, relax.TupleGetItem)):
        var = ctx.namer(tensor)
        ctx.provenance.by_var[var] = (node.name, op_type, tensor)
        return importer.block_builder.emit(expr, name_hint=var)
    if isinstance(expr, relax.Var) and expr.name not in before and expr.name not in ctx.renames \
            and expr.name not in ctx.provenance.by_var and not any(p.name == expr.name for p in importer._params):
        var = ctx.namer(tensor)
        ctx.renames[expr.name] = var
        ctx.provenance.by_var[var] = (node.name, op_type, tensor)
    return expr


def _check_ops(ep, importer, where: str, computed=()) -> None:
    known = set(importer.convert_map)
    missing = []
    for node in ep.graph.nodes:
        if node.name in computed:
            continue
        if node.op == "call_function" and getattr(node.target, "__name__", str(node.target)) not in known:
            missing.append(str(node.target))
        elif node.op not in ("placeholder", "call_function", "output", "get_attr"):
            missing.append(f"{node.op}:{node.target}")
    dynamic = [m for m in missing if "choose_qparams" in m]
    if dynamic:
        raise IrgenError(
            f"{where}: {dynamic[0]}: activations are quantized with parameters computed while the model runs "
            "(dynamic quantization: torch's default_dynamic_qconfig, quantize_dynamic, or a PT2E quantizer with "
            "is_dynamic=True); irgen needs static quantization parameters (calibrate with prepare_fx / "
            "prepare_pt2e and a static config, then convert)"
        )
    if missing:
        raise UnsupportedOpsError(where, missing)


def _convert(ep, ctx: Context):
    """Every node through the naming importer: the Relax module; an importer error names the node."""
    importer = _naming_importer()(ctx)
    _check_ops(ep, importer, ctx.where, ctx.computed)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importer.from_exported_program(
                ep,
                keep_params_as_input=False,
                unwrap_unit_return_tuple=True,
                no_bind_return_tuple=False,
                custom_convert_map=None,
            )
    except IrgenError:
        raise
    except Exception as err:  # noqa: BLE001  the importer's errors: name the node
        node = ctx.current
        at = f"node {node.name!r} ({node.target})" if node is not None else "the graph"
        msg = " ".join(str(err).split())[:300] or type(err).__name__
        raise IrgenError(f"{ctx.where}: cannot import {at}: {type(err).__name__}: {msg}") from None


# ---------------------------------------------------------------- outputs and provenance


def _rename(mod, names: dict[str, str]):
    """Rebuild ``main`` with binding vars renamed (old name_hint -> new name)."""
    from tvm import relax
    from tvm.relax.expr_functor import PyExprMutator, mutator

    @mutator
    class Renamer(PyExprMutator):
        def visit_dataflow_var_def_(self, var):
            new = names.get(var.name)
            if new is None:
                return var
            return relax.DataflowVar(new, var.ty)

        def visit_var_def_(self, var):
            new = names.get(var.name)
            if new is None or isinstance(var, relax.DataflowVar):
                return var
            return relax.Var(new, var.ty)

    func = mod["main"]
    new_func = Renamer().visit_expr(func)
    mod = mod.__class__({"main": new_func}) if len(mod.functions) == 1 else mod
    if len(mod.functions) != 1:
        mod["main"] = new_func
    return relax.transform.Normalize()(mod)


def _finish(ep, mod, ctx: Context, specs: list[InputSpec]) -> ImportedModel:
    """The bindings TVM named renamed after their nodes; a pure graph (one dataflow block)
    checked; the module with its inputs, output names and provenance."""
    from tvm import relax

    if ctx.renames:
        mod = _rename(mod, ctx.renames)
    func = mod["main"]
    blocks = func.body.blocks if isinstance(func.body, relax.SeqExpr) else []
    if len(blocks) != 1 or not isinstance(blocks[0], relax.DataflowBlock):
        raise IrgenError(f"{ctx.where}: the program has side effects or control flow (no single dataflow block); irgen needs a pure graph")
    outs = [s for s in ep.graph_signature.user_outputs]
    ranges = dict(ctx.ranges_by_var)
    ranges.update({var: ctx.ranges_by_node[node] for var, (node, _, _) in ctx.provenance.by_var.items()
                   if node in ctx.ranges_by_node})
    return ImportedModel(mod=mod, inputs=specs, provenance=ctx.provenance, frontend="torch", output_names=outs,
                         quant_ranges=ranges)


def module_path_name(node) -> str:
    """A layer name for FX ``node`` from the module it runs in: ``layer1.0.conv1.conv2d`` for the
    node ``conv2d_3`` inside ``model.layer1[0].conv1`` (the node's name, its counter dropped,
    after the module path); the node's own name at the top level or without that record."""
    stack = node.meta.get("nn_module_stack") or {}
    path = next(reversed(stack.values()), ("", None))[0] if stack else ""
    if not isinstance(path, str) or not path:
        return node.name
    return f"{path}.{re.sub(r'_[0-9]+$', '', node.name)}"


# ---------------------------------------------------------------- the driver


def translate(ep, where: str, input_names: list[str] | None = None) -> ImportedModel:
    """``ep`` (an ``ExportedProgram``) as a Relax module; ``input_names`` rename the user inputs."""
    inline_autocast(ep, where)  # autocast switched off around a region: its body's nodes
    specs = user_inputs(ep)
    if input_names:
        specs = _named(ep, specs, input_names, where)
    namer = SafeNames(lambda n: "t_" + identifier(n))
    for s in specs:
        namer(s.name)  # inputs keep their names; no binding may take them
    # the tensors bound to placeholders, then the input-independent values, computed by torch (masks, index tensors)
    bound = bound_tensors(ep)
    ctx = Context(where=where, bound=bound, namer=namer, computed=constant_nodes(ep))
    mod = _convert(ep, ctx)
    return _finish(ep, mod, ctx, specs)


def load_torch(path: Path, options: dict[str, Any]) -> ImportedModel:
    where = f"torch frontend ({path.name})"
    regular_file(path, "model")  # a FIFO or a device is refused before torch opens it
    if path.suffix.lower() == ".pt2":
        ep = load_pt2(path, options)
        specialize(ep, options.get("input_shapes") or {})  # dynamic shapes: the graph at --input-shape
        _check_input_shapes(user_inputs(ep), options.get("input_shapes") or {})
        imported = translate(ep, where)
    else:
        ep, name, code = load_pth(path, options)
        # the input is called what --input-shape calls it; the compile cache keys on the model's code
        imported = dataclasses.replace(translate(ep, where, [name]), code_modules=code)
    # the program's FX graph is a web of reference cycles, which only a collection frees: until one
    # runs, torch's copy of every weight would stay in memory beside the module's (:mod:`.weights`)
    del ep
    gc.collect()
    return imported
