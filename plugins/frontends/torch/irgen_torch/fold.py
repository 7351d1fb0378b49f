"""The part of an exported program that does not depend on the user inputs, computed by torch.

Models build masks and index tensors from shapes and constants: BERT's and
GPT-2's attention masks (``arange`` / ``ge`` / ``diff`` / ``cumsum`` /
``index`` / ``__and__``), Swin's shifted-window mask (``new_zeros`` then
``fill_`` into slices of it, an in-place write through views that TVM's
importer cannot express). The input shapes of a ``.pt2`` program are fixed, so
those values are constants: here torch computes them (node by node, in graph
order, so in-place writes land where torch puts them) and the importer gets
each one as a ``relax.const`` where an input-dependent node reads it.

Left alone (converted as usual): anything that reads a model parameter or a
quantization op (weights keep their own representation), and values that are
not tensors.
"""

from __future__ import annotations

from typing import Any

#: ops whose result depends only on their first argument's shape and dtype, not its values
SHAPE_ONLY = frozenset({
    "new_zeros.default", "new_ones.default", "new_full.default", "new_empty.default", "zeros_like.default",
    "ones_like.default", "full_like.default", "empty_like.default", "sym_size.int",
})
#: a node reading these is left to the importer (quantized weights keep their form)
_KEEP = ("quantize", "fake_quant")


def _name(target) -> str:
    return getattr(target, "__name__", str(target))


def constant_nodes(ep) -> dict[str, Any]:
    """``{FX node name: torch.Tensor or None}``: the input-independent call_function nodes of
    ``ep`` (see the module text) with their values; none of them needs converting (None: a
    tuple whose readers are all here)."""
    import torch
    from torch.export.graph_signature import InputKind

    kinds = {s.arg.name: s.kind for s in ep.graph_signature.input_specs}
    state = {**dict(ep.named_buffers()), **dict(ep.constants), **dict(ep.named_parameters())}
    targets = {s.arg.name: s.target for s in ep.graph_signature.input_specs}
    const: set[str] = set()   # input-independent
    weighty: set[str] = set()  # reads a parameter or a quantization op
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            kind = kinds.get(node.name)
            if kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR, InputKind.PARAMETER) and targets.get(node.name) in state:
                const.add(node.name)
                if kind == InputKind.PARAMETER:
                    weighty.add(node.name)
            continue
        if node.op != "call_function":
            continue
        name = _name(node.target)
        args = node.all_input_nodes
        deps = args[1:] if name in SHAPE_ONLY else args
        if all(a.name in const for a in deps):
            const.add(node.name)
            if any(k in name for k in _KEEP) or any(a.name in weighty for a in deps):
                weighty.add(node.name)
    fold = [n for n in ep.graph.nodes if n.op == "call_function" and n.name in const and n.name not in weighty]
    if not fold:
        return {}
    values: dict[str, Any] = {}
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in const:
            values[node.name] = state[targets[node.name]]

    def value(a):
        if a.name in values:
            return values[a.name]
        if a.name in const:
            raise LookupError(a.name)  # an input torch could not compute
        meta = a.meta.get("val")  # an input-dependent argument of a shape-only op: its shape is enough
        return torch.zeros(tuple(int(d) for d in meta.shape), dtype=meta.dtype)

    with torch.no_grad():
        for node in fold:
            try:
                args = torch.fx.node.map_arg(node.args, value)
                kwargs = torch.fx.node.map_arg(node.kwargs, value)
                values[node.name] = node.target(*args, **kwargs)
            except Exception:  # noqa: BLE001  torch cannot run it alone: leave it (and what reads it) to the importer
                pass
    skip: dict[str, Any] = {}
    for node in fold:
        if node.name not in values:
            continue
        v = values[node.name]
        if isinstance(v, torch.Tensor):
            skip[node.name] = v.detach().clone()
        elif all(u.name in values for u in node.users):
            skip[node.name] = None  # a tuple read only by computed nodes
    return skip
