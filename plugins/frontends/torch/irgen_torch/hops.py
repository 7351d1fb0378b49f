"""Higher-order ops of an exported program inlined before import.

``torch.export`` keeps a region under ``torch.autocast`` as one node,
``higher_order.wrap_with_autocast(device, dtype, enabled, cache_enabled,
submodule, *operands)``, whose body is a submodule graph. TVM's importer has
no converter for it. Models switch autocast *off* around code that must stay
in float32 (timm's EfficientViT linear attention: ``torch.autocast(device,
enabled=False)``): there the region computes exactly what its body does, so
the body's nodes replace the node (:func:`inline_autocast`). A region with
autocast *on* would run its ops in another dtype; irgen refuses it by name.
"""

from __future__ import annotations

from irgen.plugin import IrgenError

_AUTOCAST = "wrap_with_autocast"


def inline_autocast(ep, where: str) -> int:
    """Replace every ``wrap_with_autocast`` node with autocast disabled by its body's nodes (in
    ``ep``'s graph, in place); returns how many were inlined. An enabled one is refused."""
    import operator

    g, gm = ep.graph, ep.graph_module
    count = 0
    while True:
        node = next((n for n in g.nodes if n.op == "call_function" and
                     getattr(n.target, "__name__", "") == _AUTOCAST), None)
        if node is None:
            break
        device, dtype, enabled, _cache, sub_node, *operands = node.args
        if enabled:
            raise IrgenError(f"{where}: node {node.name!r} runs under torch.autocast({device!r}, {dtype}): its ops "
                             f"would compute in another dtype; export the model without autocast")
        sub = getattr(gm, sub_node.target, None) if getattr(sub_node, "op", None) == "get_attr" else None
        if sub is None or not hasattr(sub, "graph"):
            raise IrgenError(f"{where}: node {node.name!r}: its autocast region is not a graph")
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(operands) or any(n.op == "get_attr" for n in sub.graph.nodes):
            raise IrgenError(f"{where}: node {node.name!r}: its autocast region does not read just its operands")
        with g.inserting_before(node):
            result = g.graph_copy(sub.graph, dict(zip(placeholders, operands)))
        result = result if isinstance(result, (tuple, list)) else (result,)
        for user in list(node.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                raise IrgenError(f"{where}: node {node.name!r}: {user.name!r} reads its results as a whole")
            user.replace_all_uses_with(result[user.args[1]])
            g.erase_node(user)
        g.erase_node(node)
        if not sub_node.users:
            g.erase_node(sub_node)
            if not any(n.op == "get_attr" and n.target == sub_node.target for n in g.nodes):
                delattr(gm, sub_node.target)
        count += 1
    if count:
        gm.recompile()
    return count
