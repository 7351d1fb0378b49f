"""Layer forming (claim step 3): batch norms folded, the quantization scheme realized (if any),
``main`` cut into hardware layers with the backend's fusion rules, each layer named after its
source node, its record built, and the backend's constraints checked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from irgen.api import Backend, ImportedModel, IrgenError, Quantizer, UnsupportedOpsError
from irgen.names import SafeNames
from irgen.output import Progress
from irgen.plugins import call_plugin


def pick_quantizer(host, qg, name: str | None):
    """The scheme to realize: ``--quantizer NAME`` (which overrides detection, but never makes a
    float model quantized), else the first that detects the model."""
    quantizing = [b.name for b in qg.bindings if b.op in ("relax.quantize", "relax.dequantize")]
    if name:
        scheme = host.quantizers.get(name)
        if not quantizing:
            raise IrgenError(f"--quantizer {name}: the model is not quantized (no quantize or dequantize op), so "
                             "no scheme can read it; run a float model without --quantizer")
        return scheme
    found = [q for _, q in sorted(host.quantizers.items(), key=lambda kv: -kv[1].priority)
             if call_plugin(host.quantizers, q.name, "detect the model's quantization", q.detect, qg)]
    if found:
        return found[0]
    if quantizing:
        known = ", ".join(host.quantizers.names()) or "none installed"
        raise IrgenError(
            f"the model is quantized (e.g. tensor {quantizing[0]!r}) but no quantization scheme recognizes it "
            f"(schemes: {known}); force one with --quantizer NAME"
        )
    return None


@dataclass
class FormedGraph:
    """The model's ``main`` after batch-norm folding and the quantization scheme, cut into layers."""

    mod: Any
    func: Any
    bindings: list
    main_out: Any
    layers: list
    by_name: dict
    quant: dict[str, dict]
    scheme: Quantizer | None


@dataclass
class LayerNames:
    """Layer names (by layer index), IR tensor names (by Relax var) and var aliases."""

    layer: dict[int, str]
    tensor: dict[str, str]
    aliases: dict[str, str]


def form_graph(host, imported: ImportedModel, be: Backend, quantizer: str | None, progress: Progress) -> FormedGraph:
    """Fold batch norms, realize the quantization scheme (if any), cut ``main`` into layers."""
    from tvm import relax

    from irgen.graph import (check_gather_indices, drop_dead_bindings, flatten_tuples, fold_batch_norm, fold_constants,
                             guard_gathers, main_bindings, static_shapes, tuple_output_outside_dataflow)
    from irgen.layers import cut_layers, form_layers, fuse_quantized_layers, merge_quantized_rolls
    from irgen.quant import QGraph

    progress.stage("form layers")
    mod = guard_gathers(tuple_output_outside_dataflow(drop_dead_bindings(imported.mod)), imported.provenance)
    mod = fold_batch_norm(mod, imported.provenance)
    quant: dict[str, dict] = {}
    qg = QGraph(mod, frontend=imported.frontend, dialect=imported.dialect, ranges=dict(imported.quant_ranges),
                source_ops={v: op_type for v, (_, op_type, _) in imported.provenance.by_var.items()})
    scheme = pick_quantizer(host, qg, quantizer)
    if scheme is not None:
        progress.stage(f"quantization scheme {scheme.name}")
        call_plugin(host.quantizers, scheme.name, "realize the model's quantization", scheme.realize, qg)
        mod, quant = qg.module(), qg.quant
        for last, names in getattr(qg, "folded", {}).items():  # the layer's source: every node folded in
            merged = imported.provenance.merged.setdefault(last, [])
            merged.extend(m for n in names for m in [*imported.provenance.merged.get(n, []), n] if m not in merged)
    else:  # a scheme reads the graph as imported (its own shape arithmetic, tuples)
        from irgen.canonical import canonicalize
        from irgen.graph import fold_data_movement

        # an item no one reads (max_pool2d_with_indices' indices) is dead once its tuple is gone
        mod = drop_dead_bindings(flatten_tuples(static_shapes(mod), imported.provenance))
        mod = canonicalize(fold_data_movement(mod), imported.provenance)
    func, bindings = main_bindings(fold_constants(mod))
    check_gather_indices(bindings, imported.provenance)  # indices folding made constant
    main_out = func.body.body
    if scheme is not None:
        layers = merge_quantized_rolls(cut_layers(bindings, imported.provenance, main_out), bindings, main_out)
        by_name = {b.name: b for b in bindings}
        quants = {l.index: layer_quant(l.members, quant, by_name) for l in layers}
        layers = fuse_quantized_layers(layers, bindings, be.fusion_rules, quants, main_out)
    else:
        layers = form_layers(bindings, be.fusion_rules, imported.provenance, main_out)
    return FormedGraph(mod, func, bindings, main_out, layers, {b.name: b for b in bindings}, quant, scheme)


def name_layers(graph: FormedGraph, imported: ImportedModel) -> LayerNames:
    """Layers after their anchor's source node, tensors after the source tensors."""
    layer_namer = SafeNames()
    prov = imported.provenance.by_var
    layer_names: dict[int, str] = {}
    merged = imported.provenance.merged
    for layer in graph.layers:
        # a tuple result's items (a batch norm's [0]) are its outputs, not members: they carry the node
        src = next((prov[m] for m in [*layer.members, *layer.outputs] if m in prov), None)
        if graph.quant:  # a quantized layer is named after its compute node, not a (de)quantize node
            folded = [n for m in layer.members for n in [*merged.get(m, []), m] if n in prov]
            src = next((prov[n] for n in folded if "quant" not in prov[n][1].lower()), src)
        # two layers from one source node (a fake-quant split in two) get distinct names
        source = src[0] if src else layer.anchor
        layer_names[layer.index] = layer_namer.fresh(imported.provenance.layer_names.get(source, source))
    tensor_name: dict[str, str] = {}
    for p, spec in zip(graph.func.params, imported.inputs):
        tensor_name[p.name] = spec.name
    for layer in graph.layers:
        for o in layer.outputs:
            t = prov.get(o)
            tensor_name[o] = t[2] if t and t[2] else o
    # an alias (an Identity, a Dropout at inference) names the same tensor
    aliases = alias_map(graph.bindings)
    for alias, target in aliases.items():
        if target in tensor_name:
            tensor_name[alias] = tensor_name[target]
    return LayerNames(layer_names, tensor_name, aliases)


def layer_quant(members: list[str], quant: dict[str, dict], by_name: dict | None = None) -> dict | None:
    """The ``quant`` record of the layer of ``members``: its last member's that has one; for
    exact rotations merged into one layer (a quantized roll), an ``integer`` record of them."""
    q = next((quant[m] for m in reversed(members) if m in quant), None)
    if q is not None and by_name is not None:
        from irgen.ir import quantized_roll

        q = quantized_roll(q, [by_name[m] for m in members]) or q
    return q


def layer_records(graph: FormedGraph, imported: ImportedModel, names: LayerNames, be: Backend,
                  accumulate: str | None = None) -> list:
    """One :class:`irgen.ir.LayerRecord` per layer, a float16/bfloat16 one with its declared
    arithmetic (``accumulate``: ``--accumulate``); every op the backend lacks, at once."""
    from irgen.ir import build_layer_record
    from irgen.widen import accumulate_dtype, declared_arith, storage_of

    records = []
    for layer in graph.layers:
        q = layer_quant(layer.head or layer.members, graph.quant, graph.by_name)
        # followers a fusion rule added: with their own requantization, one quant record per step;
        # exact integer ones run their ops after the scheme's
        steps = [layer_quant(s, graph.quant, graph.by_name) for s in layer.steps] if layer.steps else None
        if q is not None and layer.head and not steps:
            q = {**q, "fused_after": len(layer.members) - len(layer.head)}
        records.append(build_layer_record(layer, graph.by_name, imported.provenance, names.tensor,
                                          names.layer[layer.index], q, steps=steps))
        if q is None:  # a float16/bfloat16 layer declares its arithmetic (irgen.widen)
            storage = storage_of([graph.by_name[m] for m in layer.members])
            if storage is not None:
                records[-1].record["arith"] = declared_arith(storage, accumulate_dtype(storage, accumulate))
    if accumulate and not any("arith" in rec.record for rec in records):
        raise IrgenError(f"--accumulate {accumulate}: the model has no float16 or bfloat16 layer (its float32 "
                         "layers compute in float32)")
    if be.supported_ops is not None:
        bad = sorted({rec.record["op"] for rec in records} - set(be.supported_ops))
        if bad:
            raise UnsupportedOpsError(f"backend {be.name!r}", bad)
    return records


def static_shapes_of(graph: FormedGraph, names: LayerNames) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every tensor of the formed graph by its IR name, from the Relax types."""
    from irgen.graph import tensor_type

    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for v in [*graph.func.params, *(b.var for b in graph.bindings)]:
        t = tensor_type(v)
        if t is not None:
            shapes[names.tensor.get(v.name, v.name)] = t
    return shapes


def check_backend(graph: FormedGraph, names: LayerNames, records: list, be: Backend) -> None:
    """The backend's constraints on the formed layers, before anything is compiled: its
    activation layout and ``check_layer``. Every offending layer is named at once."""
    if not be.layout and be.check_layer is None:
        return
    shapes = static_shapes_of(graph, names)
    layouts = tensor_layouts([rec.record for rec in records], shapes)

    def tensor(n: str) -> dict[str, Any]:
        shape, dtype = shapes.get(n, (None, None))
        return {"name": n, "shape": list(shape) if shape is not None else None, "dtype": dtype, "layout": layouts.get(n)}

    broken: list[str] = []
    for rec in records:
        r = rec.record
        why: list[str] = []
        if be.layout:
            other = sorted({layouts[o] for o in r["outputs"] if len(layouts.get(o, "")) == 4 and layouts[o] != be.layout})
            if other:
                why.append(f"activations in {'/'.join(other)}, the backend takes {be.layout}")
        if be.check_layer is not None:
            view = {"name": r["name"], "op": r["op"], "attrs": r["attrs"], "quant": r["quant"],
                    "inputs": [tensor(n) for n in r["inputs"]], "outputs": [tensor(n) for n in r["outputs"]],
                    "params": {role: {"name": f"{r['name']}.{role}", "shape": list(a.shape), "dtype": str(a.dtype),
                                      "layout": param_layout(r, role, a)} for role, a in rec.params.items()}}
            why += _call_check(be, view)
        if why:
            broken.append(f"{r['name']} ({r['op']}): {'; '.join(why)}")
    if broken:
        shown = "\n  ".join(broken[:50])
        more = f"\n  ... and {len(broken) - 50} more" if len(broken) > 50 else ""
        raise IrgenError(f"backend {be.name!r} cannot run {len(broken)} layer(s) of this model:\n  {shown}{more}")


def _call_check(be: Backend, view: dict[str, Any]) -> list[str]:
    try:
        why = be.check_layer(view)
    except Exception as err:  # noqa: BLE001  a plugin's check: named, one line
        raise IrgenError(f"backend {be.name!r}: check_layer failed on layer {view['name']!r} "
                         f"({type(err).__name__}: {err})") from None
    if isinstance(why, str) or not all(isinstance(w, str) for w in why or []):
        raise IrgenError(f"backend {be.name!r}: check_layer must return a list of sentences, got {why!r:.100}")
    return list(why or [])


def param_layout(rec: dict, role: str, arr: np.ndarray) -> str | None:
    if role == "weight" and rec["op"] in ("conv2d", "depthwise_conv2d", "conv2d_transpose") and arr.ndim == 4:
        return str(rec["attrs"].get("kernel_layout", "OIHW"))
    if role == "weight" and rec["op"] in ("conv3d", "depthwise_conv3d", "conv3d_transpose") and arr.ndim == 5:
        return str(rec["attrs"].get("kernel_layout", "OIDHW"))
    if role == "weight" and rec["op"] == "dense":
        return "IO"  # the graph computes x @ W
    if role == "bias" and arr.ndim == 1:
        return "C"  # one value per output channel (ir._uniform_bias)
    return None


_LAYOUT_ATTRS = ("out_layout", "data_layout", "layout")


def tensor_layouts(records: list[dict], shapes) -> dict[str, str]:
    """Activation layouts: from the ops that state one (conv, pool), carried
    through ops that keep their input's layout; 2-D tensors are ``NC``."""
    layouts: dict[str, str] = {}
    for r in records:  # inputs take the layout of the first op that states one
        stated = next((str(r["attrs"][k]) for k in _LAYOUT_ATTRS if r["attrs"].get(k)), None)
        for n in r["inputs"]:
            if stated and len(shapes.get(n, ((),))[0]) == len(stated):
                layouts.setdefault(n, stated)
    for r in records:
        stated = next((str(r["attrs"][k]) for k in _LAYOUT_ATTRS if r["attrs"].get(k)), None)
        carried = next((layouts[n] for n in r["inputs"] if n in layouts), None)
        for n in r["outputs"]:
            rank = len(shapes.get(n, ((),))[0])
            for cand in (stated, carried, "NC" if rank == 2 else None):
                if cand and len(cand) == rank:
                    layouts[n] = cand
                    break
    return layouts


def alias_map(bindings) -> dict[str, str]:
    """Alias var -> the var it names (transitively)."""
    out: dict[str, str] = {}
    for b in bindings:
        if b.kind == "alias":
            out[b.name] = out.get(b.value.name, b.value.name)
    return out
