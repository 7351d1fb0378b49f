"""Compile (claim step 2): the formed layers grouped into one Relax function each, compiled by
TVM at the opt level, and the :class:`irgen.plan.Plan` that captures golden data for any input,
with the debug graph in the graph executor's JSON schema."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from irgen.api import Backend, ImportedModel, IrgenError
from irgen.forming import (check_backend, form_graph, FormedGraph, layer_records, LayerNames, name_layers,
                           static_shapes_of)
from irgen.output import Progress
from irgen.plan import kernel_node_name, Plan, PlanKernel


def compile_plan(graph: FormedGraph, imported: ImportedModel, names: LayerNames, records: list, opt_level: int,
             progress: Progress) -> Plan:
    """Compile the formed graph and work out, before any run, which kernel output is each
    layer output, model output and ``debug/`` entry: the plan ``capture`` runs."""
    from irgen import execute
    from irgen.graph import group_module
    from irgen.widen import widen

    progress.stage(f"compile (opt level {opt_level}: {execute.OPT_LEVELS[opt_level]})")
    layers, aliases = graph.layers, names.aliases
    assignment = {m: l.index for l in layers for m in l.members}
    fn_names = {l.index: "layer_" + names.layer[l.index].replace(".", "_").replace("-", "_") for l in layers}
    mod, assignment = widen(graph.mod, assignment, {l.index: rec.record["arith"] for l, rec in zip(layers, records)
                                                    if rec.record.get("arith")}, {o for l in layers for o in l.outputs})
    exe, kernels, where, program = execute.lower(
        mod, opt_level, lambda m: group_module(m, assignment, fn_names),
        grouping=(tuple(sorted(assignment.items())), tuple(sorted(fn_names.items()))))

    # which kernel output is each layer output / model output
    outs = [aliases.get(v, v) for v in out_vars(graph.main_out)]
    for i, v in enumerate(outs):
        if v not in where and f"@out:{i}" in where:
            where[v] = where[f"@out:{i}"]

    def source_of(var: str) -> tuple[int, int] | None:
        return where.get(aliases.get(var, var))

    wanted: dict[tuple[int, int], list[str]] = {}
    producers: dict[str, str] = {}
    for layer, rec in zip(layers, records):
        for o in layer.outputs:
            loc = source_of(o)
            if loc is None:
                raise IrgenError(f"internal: layer {rec.record['name']!r} output {o!r} is not computed by any kernel")
            wanted.setdefault(loc, []).append(names.tensor[o])
            producers.setdefault(names.tensor.get(o, o), rec.record["name"])

    debug = DebugGraph(graph.func.params, imported.inputs, kernels, where, aliases, [source_of(v) for v in outs])
    # the records as JSON reads them back: a plan from the cache gives the same files
    plain = json.loads(json.dumps([rec.record for rec in records]))
    return Plan(
        frontend=imported.frontend,
        scheme=graph.scheme.name if graph.scheme else None,
        opt_level=opt_level,
        inputs=list(imported.inputs),
        output_names=list(imported.output_names),
        model_script=imported.mod.script(show_meta=False),
        records=plain,
        params=[dict(rec.params) for rec in records],
        static_shapes=static_shapes_of(graph, names),
        kernels=[PlanKernel(k.callee, list(k.outputs), list(k.out_types), list(k.storage),
                            None if k.arg_types is None else list(k.arg_types), k.symbol) for k in kernels],
        wanted=wanted,
        outputs=[names.tensor.get(v, v) for v in outs],
        producers=producers,
        debug_graph=debug.to_json(),
        debug_names=debug.tensor_names(),
        consts=[_ConstValue(c) for c in debug.consts],  # read when needed (the library may not hold them)
        exe=exe,
        program=program,
    )


class _ConstValue:
    """A constant of a freshly compiled plan, as an array when asked (``plan.array``)."""

    __slots__ = ("const",)

    def __init__(self, const) -> None:
        self.const = const

    def load(self) -> np.ndarray:
        """The constant's memory itself (no copy to write it into the compile cache or to
        hand it to a kernel, which only reads it: writable, as DLPack exports only those);
        a copy where numpy cannot view the dtype."""
        try:
            return np.from_dlpack(self.const.value)
        except (TypeError, ValueError, BufferError, RuntimeError):
            return self.const.value.numpy()


def build_plan(host, imported: ImportedModel, be: Backend, quantizer: str | None, opt_level: int,
               limit: int | None, progress: Progress, accumulate: str | None = None) -> Plan:
    """Form layers (scheme, fusion rules), name them, check the backend's constraints,
    compile: the plan that captures golden data for any input. ``accumulate``: what float16 and
    bfloat16 layers accumulate in (``--accumulate``; :mod:`irgen.widen`)."""
    from irgen.graph import check_tensor_sizes, module_bindings

    # before constant folding allocates anything
    check_tensor_sizes(module_bindings(imported.mod), limit, imported.provenance)
    graph = form_graph(host, imported, be, quantizer, progress)
    check_tensor_sizes(graph.bindings, limit, imported.provenance)
    names = name_layers(graph, imported)
    records = layer_records(graph, imported, names, be, accumulate)
    check_backend(graph, names, records, be)
    return compile_plan(graph, imported, names, records, opt_level, progress)


def out_vars(expr) -> list[str]:
    from tvm import relax

    if isinstance(expr, relax.Tuple):
        return [f.name for f in expr.fields]
    return [expr.name]


class DebugGraph:
    """``_tvmdbg_graph_dump.json`` in the graph executor's schema, from the kernel sequence."""

    def __init__(self, params, specs, kernels, where, aliases, heads):
        from irgen.graph import Constant

        self.kernels = kernels
        self.nodes: list[dict[str, Any]] = []
        self.entry_shapes: list[list[int]] = []
        self.entry_dtypes: list[str] = []
        self.entry_storage: list[int] = []
        self.node_of_input: dict[str, int] = {}
        self.consts: list[Any] = []
        self.const_node: list[int] = []
        self.kernel_node: list[int] = []
        storage = 0
        for p, s in zip(params, specs):
            self.node_of_input[p.name] = len(self.nodes)
            self._add({"op": "null", "name": s.name, "inputs": []}, [(list(s.shape), s.dtype, storage)])
            storage += 1
        for k in kernels:
            for a in k.inputs:
                if isinstance(a, Constant) and not any(a.same_as(c) for c in self.consts):
                    self.consts.append(a)
                    arr_ty = a.ty
                    self.const_node.append(len(self.nodes))
                    shape = [int(d) for d in arr_ty.shape.values]
                    self._add({"op": "null", "name": f"p{len(self.consts) - 1}", "inputs": []}, [(shape, str(arr_ty.dtype), storage)])
                    storage += 1
        base = storage
        for ki, k in enumerate(kernels):
            ins = []
            for a in k.inputs:
                if isinstance(a, Constant):
                    ci = next(i for i, c in enumerate(self.consts) if c.same_as(a))
                    ins.append([self.const_node[ci], 0, 0])
                else:
                    a = aliases.get(a, a)
                    if a in self.node_of_input:
                        ins.append([self.node_of_input[a], 0, 0])
                    elif a in where:
                        src_k, j = where[a]
                        ins.append([self.kernel_node[src_k], j, 0])
            self.kernel_node.append(len(self.nodes))
            st = k.storage if len(k.storage) == len(k.outputs) else [-1] * len(k.outputs)
            entries = [(list(s), d, (base + sid) if sid >= 0 else -1) for (s, d), sid in zip(k.out_types, st)]
            self._add(
                {
                    "op": "tvm_op",
                    "name": self.kernel_node_name(ki, None),
                    "attrs": {"func_name": k.symbol, "flatten_data": "0", "num_inputs": str(len(ins)), "num_outputs": str(len(k.outputs))},
                    "inputs": ins,
                },
                entries,
            )
        self.heads = [[self.kernel_node[k], j, 0] for k, j in (h for h in heads if h is not None)]
        # reshape views share their input's storage
        for ki, k in enumerate(kernels):
            if k.callee == "vm.builtin.reshape":
                nid = self.kernel_node[ki]
                src = self.nodes[nid]["inputs"][0] if self.nodes[nid]["inputs"] else None
                if src is not None:
                    self.entry_storage[self.row_ptr[nid]] = self.entry_storage[self.row_ptr[src[0]] + src[1]]

    row_ptr: list[int]

    def _add(self, node: dict[str, Any], entries) -> None:
        if not hasattr(self, "row_ptr"):
            self.row_ptr = [0]
        self.nodes.append(node)
        for shape, dtype, sid in entries:
            self.entry_shapes.append(shape)
            self.entry_dtypes.append(dtype)
            self.entry_storage.append(sid)
        self.row_ptr.append(self.row_ptr[-1] + len(entries))

    def kernel_node_name(self, ki: int, j: int | None) -> str:
        k = self.kernels[ki]
        return kernel_node_name(k.callee, len(k.outputs), ki, j)

    def tensor_names(self) -> list[str]:
        names = [n["name"] for n in self.nodes if n["op"] == "null"]
        for ki, k in enumerate(self.kernels):
            names += [self.kernel_node_name(ki, j) for j in range(len(k.outputs))]
        return names

    def leading_tensors(self, inputs):
        for spec_node, arr in zip(self.node_of_input.values(), inputs):
            yield self.nodes[spec_node]["name"], tvm_tensor(arr)
        for ci, c in enumerate(self.consts):
            yield f"p{ci}", c.value

    def to_json(self) -> dict[str, Any]:
        arg_nodes = [i for i, n in enumerate(self.nodes) if n["op"] == "null"]
        return {
            "nodes": self.nodes,
            "arg_nodes": arg_nodes,
            "heads": self.heads,
            "node_row_ptr": self.row_ptr,
            "attrs": {
                "shape": ["list_shape", self.entry_shapes],
                "dltype": ["list_str", self.entry_dtypes],
                "storage_id": ["list_int", self.entry_storage],
            },
        }


def tvm_tensor(arr):
    import tvm

    return tvm.runtime.tensor(arr)
