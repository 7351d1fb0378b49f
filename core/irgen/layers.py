"""Hardware layers: the bindings of ``main`` grouped into layers by a backend's fusion rules
(:func:`form_layers`), or, in a quantized model, cut at the scheme's layers and merged with
their followers (:func:`cut_layers`, :func:`merge_quantized_rolls`,
:func:`fuse_quantized_layers`). A :class:`Layer` lists its member bindings in order."""

from __future__ import annotations

from dataclasses import dataclass, field, replace as _replace
from typing import Any

from tvm import relax

from irgen.api import FusionRule, IrgenError, Provenance
from irgen.canonical import rotation
from irgen.graph import Binding, Constant, tensor_type, users_of, var_names
from irgen.ops import CANONICAL_OPS, LAYER_OP_NAMES, OP_NAMES, quant_op
from irgen.recurrent import RECURRENT_OPS, recurrent_kind


@dataclass
class Layer:
    """One hardware layer: consecutive bindings that run as one kernel."""

    index: int
    members: list[str]  # binding names, in order
    anchor: str  # binding name of the op that names the layer
    rule: str | None = None
    outputs: list[str] = field(default_factory=list)  # binding names holding the layer's results
    name: str = ""
    op: str | None = None  # the IR op its fusion rule names it (default: the anchor's)
    #: a quantized layer a fusion rule extended with integer followers: the members of the
    #: anchor's own layer (its scheme's recompute covers them; the followers' ops run after)
    head: list[str] | None = None
    #: a quantized layer a fusion rule extended with followers that requantize (a residual
    #: add, an activation table) or read other tensors: the members of each scheme layer
    #: merged, in order (the anchor's first); ``quant.steps`` holds one record per step
    steps: list[list[str]] | None = None


def form_layers(
    bindings: list[Binding], rules: list[FusionRule], provenance: Provenance, main_output: relax.Expr
) -> list[Layer]:
    """Group bindings into hardware layers with a backend's fusion rules.

    Tuple-get-item and alias bindings stay outside layers: they name results
    of the layer that produced the tuple or value.
    """
    users = users_of(bindings)
    layers, assigned = _rule_layers(bindings, rules, users, recurrent_cells(bindings, provenance))
    idx = {b.name: i for i, b in enumerate(bindings)}
    layers, assigned = _absorb_item_views(layers, bindings, users, provenance, assigned, idx)

    # ops a converter split into several bindings: merge unnamed results used only by
    # one other layer (a roll over two axes: both slices of the second read the first)
    # into that layer, of the same source node
    merged_into: dict[int, int] = {}

    def root(k: int) -> int:
        while k in merged_into:
            k = merged_into[k]
        return k

    for layer in reversed(layers):  # readers first: their own merges are known
        last = layer.members[-1]
        if last in provenance.by_var:
            continue
        u = users.get(last, [])
        if not u or any(bindings[k].name not in assigned for k in u) or last in set(var_names(main_output)):
            continue
        targets = {root(assigned[bindings[k].name]) for k in u}
        if len(targets) != 1:
            continue
        target = targets.pop()
        if target == layer.index:
            continue
        merged_into[layer.index] = target
    if merged_into:

        groups: dict[int, list[str]] = {}
        for layer in layers:
            groups.setdefault(root(layer.index), []).extend(layer.members)
        new_layers = []
        for layer in layers:
            if layer.index in merged_into:
                continue
            members = sorted(groups[layer.index], key=idx.__getitem__)
            anchor = layer.anchor if layer.rule or layer.op else members[0]
            new_layers.append(Layer(len(new_layers), members, anchor, layer.rule, op=layer.op))
        layers = new_layers
        assigned = {m: layer.index for layer in layers for m in layer.members}

    layers = _execution_order(layers, bindings, assigned)

    # a layer's results: members used outside the layer (or by main's output)
    out_names = set(var_names(main_output))
    for layer in layers:
        mset = set(layer.members)
        for m in layer.members:
            outside = [k for k in users.get(m, []) if bindings[k].name not in mset]
            if outside or m in out_names:
                layer.outputs.append(m)
        if not layer.outputs:
            layer.outputs.append(layer.members[-1])
        if layer.op in RECURRENT_OPS:  # a cell step's hidden state (its last op) first, then its cell state
            layer.outputs.sort(key=lambda o: o != layer.members[-1])
    _name_tuple_results(layers, bindings, users, out_names)
    return layers


def recurrent_cells(bindings: list[Binding], provenance: Provenance) -> dict[str, Layer]:
    """The steps of recurrent ops (:mod:`irgen.recurrent`), by the name of each member: the
    bindings a frontend recorded under one provenance node of an LSTM, GRU or RNN op type
    that hold a matrix product (a step, not the concatenation of the op's results). Each is
    one layer of that op (``lstm``, ``gru``, ``rnn``), anchored at its first matmul."""
    groups: dict[str, list[Binding]] = {}
    for b in bindings:
        src = provenance.by_var.get(b.name)
        if src is not None and b.kind in ("call", "tgi") and recurrent_kind(src[1]):
            groups.setdefault(src[0], []).append(b)
    cells: dict[str, Layer] = {}
    for members in groups.values():
        anchor = next((m.name for m in members if m.op == "relax.matmul"), None)
        if anchor is None:
            continue
        kind = recurrent_kind(provenance.by_var[anchor][1])
        layer = Layer(-1, [m.name for m in members], anchor, op=kind)
        cells.update(dict.fromkeys(layer.members, layer))
    return cells


def _rule_layers(bindings: list[Binding], rules: list[FusionRule], users: dict[str, list[int]],
                 cells: dict[str, Layer]) -> tuple[list[Layer], dict[str, int]]:
    """The layers the fusion rules form, each anchored at the first binding not in a layer
    yet (a recurrent op's step is one layer: ``cells``, :func:`recurrent_cells`), and each
    binding's layer index."""
    assigned: dict[str, int] = {}
    layers: list[Layer] = []
    for i, b in enumerate(bindings):
        if b.name in assigned or (b.kind in ("tgi", "alias", "const") and b.name not in cells):
            continue
        layer = cells.get(b.name) or Layer(len(layers), [b.name], b.name)
        layer.index = len(layers)
        for rule in (r for r in rules if b.op in r.anchor and b.name not in cells):
            members = _apply_rule(rule, i, bindings, users, assigned)
            if members is not None:
                layer.members, layer.rule, layer.op = members, rule.name, rule.op
                break
        for m in layer.members:
            assigned[m] = layer.index
        layers.append(layer)
    return layers, assigned


def _name_tuple_results(layers: list[Layer], bindings: list[Binding], users: dict[str, list[int]],
                        out_names: set[str]) -> None:
    """A tuple result (batch_norm, dropout, split) is named by its items: the item reads
    (tuple-get-items) that something uses, or the first when none is."""
    by_name = {b.name: b for b in bindings}
    for layer in layers:
        items: list[str] = []
        for o in layer.outputs:
            if isinstance(by_name[o].var.ty, relax.TupleType):
                used = [
                    bindings[k].name for k in users.get(o, [])
                    if bindings[k].kind == "tgi" and (users.get(bindings[k].name) or bindings[k].name in out_names)
                ]
                items.extend(used or [bindings[k].name for k in users.get(o, []) if bindings[k].kind == "tgi"][:1])
            else:
                items.append(o)
        layer.outputs = items


def _apply_rule(rule: FusionRule, i: int, bindings: list[Binding], users: dict[str, list[int]],
                assigned: dict[str, int]) -> list[str] | None:
    """The members of a layer ``rule`` forms from its anchor ``bindings[i]``, or None when
    a required follower is missing."""
    members = [bindings[i].name]
    tail = i
    absorbed = set()
    for k, followers in enumerate(rule.followers):
        u = users.get(bindings[tail].name, [])
        if len(u) != 1:
            break
        nxt = bindings[u[0]]
        if nxt.op not in followers or nxt.name in assigned:
            continue
        tensors = [a for a in nxt.value.args if isinstance(a, relax.Var)]
        prev = bindings[tail].name
        if rule.tensor_operands:
            if sum(a.name == prev for a in tensors) != 1:
                continue
        else:
            first = nxt.value.args[0]
            if not (isinstance(first, relax.Var) and first.name == prev):
                continue
            if len(tensors) > 1:
                continue  # a second tensor input is a layer of its own (e.g. a residual add)
        members.append(nxt.name)
        absorbed.add(k)
        tail = u[0]
    if not rule.required <= absorbed:
        return None
    return members


def _execution_order(layers: list[Layer], bindings: list[Binding], assigned: dict[str, int]) -> list[Layer]:
    """The layers in an order they can run in, renumbered: main's order, except that a
    layer waits for the layers whose results it reads. A fused layer whose later member
    reads a tensor bound after its first (attention's values) moves after that tensor's
    layer; ``ir.json`` lists layers in this order."""
    import heapq

    by_name = {b.name: b for b in bindings}

    def producer(name: str) -> int | None:
        seen = set()
        while name not in assigned and name in by_name and name not in seen:
            seen.add(name)
            v = by_name[name].value
            if isinstance(v, relax.TupleGetItem) and isinstance(v.tuple_value, relax.Var):
                name = v.tuple_value.name
            elif isinstance(v, relax.Var):
                name = v.name
            else:
                return None
        return assigned.get(name)

    deps: dict[int, set[int]] = {}
    for layer in layers:
        mset = set(layer.members)
        deps[layer.index] = {p for m in layer.members for n in var_names(by_name[m].value)
                             if n not in mset and (p := producer(n)) is not None and p != layer.index}
    if all(d < layer for layer, ds in deps.items() for d in ds):
        return layers
    readers: dict[int, list[int]] = {}
    for k, ds in deps.items():
        for d in ds:
            readers.setdefault(d, []).append(k)
    left = {k: len(ds) for k, ds in deps.items()}
    heap = [k for k, n in left.items() if n == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        k = heapq.heappop(heap)
        order.append(k)
        for r in readers.get(k, []):
            left[r] -= 1
            if left[r] == 0:
                heapq.heappush(heap, r)
    if len(order) != len(layers):
        raise IrgenError("internal: the formed layers read each other's results in a cycle")
    return [_replace(layers[k], index=i) for i, k in enumerate(order)]


#: ops that only view one item of a multi-output op differently (unbind = split + squeeze per item)
_ITEM_VIEWS = {"relax.squeeze", "relax.reshape", "relax.expand_dims"}


def _unit_axes_only(view: Binding) -> bool:
    """``view`` only drops or adds axes of size 1 (unbind's squeeze), not a reshape of the
    item's data (GPT-2's ``split`` then ``view`` per head: a source op of its own)."""
    t_in, t_out = tensor_type(view.value.args[0]), tensor_type(view.var)
    return t_in is not None and t_out is not None and [d for d in t_in[0] if d != 1] == [d for d in t_out[0] if d != 1]


def _absorb_item_views(layers, bindings, users, provenance, assigned, idx):
    """An unnamed op with several results (the split of an ``unbind``) and the
    one-op layers that each view one of its items (a squeeze per item) are one
    layer: its results are the named items, the tensors the source model has."""
    absorbed: dict[int, int] = {}
    for layer in layers:
        last = bindings[idx[layer.members[-1]]]
        if last.name in provenance.by_var or not isinstance(last.var.ty, relax.TupleType):
            continue
        u = users.get(last.name, [])
        if not u or any(bindings[k].kind != "tgi" for k in u):
            continue
        take = []
        for k in u:
            cu = users.get(bindings[k].name, [])
            t = assigned.get(bindings[cu[0]].name) if len(cu) == 1 else None
            if t is None or t == layer.index or len(layers[t].members) != 1 or layers[t].rule is not None:
                break
            view = bindings[cu[0]]
            if view.op not in _ITEM_VIEWS or t in absorbed or t in take or not _unit_axes_only(view):
                break
            take.append(t)
        else:
            for k, t in zip(u, take):
                absorbed[t] = layer.index
                layer.members += [bindings[k].name, layers[t].members[0]]
            layer.members.sort(key=idx.__getitem__)
    if not absorbed:
        return layers, assigned
    kept = []
    for layer in layers:
        if layer.index in absorbed:
            continue
        kept.append(Layer(len(kept), layer.members, layer.anchor, layer.rule, op=layer.op))
    return kept, {m: layer.index for layer in kept for m in layer.members}


_COMPUTE = {"relax.nn.conv2d", "relax.nn.conv1d", "relax.nn.conv2d_transpose", "relax.nn.conv3d",
            "relax.nn.conv3d_transpose", "relax.matmul"}


def cut_layers(bindings: list[Binding], provenance: Provenance, main_output: relax.Expr) -> list[Layer]:
    """Layers of a realized quantized graph: each binding named after a source
    tensor closes a layer holding the unnamed bindings before it that it reads
    (the integer arithmetic a scheme put in place of one source op). An unnamed
    binding it does not read waits for the named binding that does (an importer's
    index arithmetic before a gather the scheme emitted later)."""
    layers: list[Layer] = []
    pending: list[str] = []
    by_name = {b.name: b for b in bindings}
    cells = recurrent_cells(bindings, provenance)  # a recurrent op's step left in float: one layer
    for b in bindings:
        cell = cells.get(b.name)
        if cell is not None and b.name != cell.members[-1]:
            continue
        if b.kind in ("tgi", "alias", "const") and cell is None:
            continue
        # an unnamed op with several results (a split the scheme left in float) is read through
        # its items, never by name: it closes a layer of its own
        if b.name not in provenance.by_var and not isinstance(b.var.ty, relax.TupleType):
            pending.append(b.name)
            continue
        own = cell.members if cell is not None else [b.name]
        needed, mine = {n for m in own for n in var_names(by_name[m].value)}, set()
        for m in reversed(pending):
            if m in needed:
                mine.add(m)
                needed.update(var_names(by_name[m].value))
        members = [m for m in pending if m in mine] + own
        pending = [m for m in pending if m not in mine]
        anchor = cell.anchor if cell is not None else next((m for m in members if by_name[m].op in _COMPUTE), b.name)
        layers.append(Layer(len(layers), members, anchor, "quantized", [b.name], op=cell and cell.op))
    if pending:
        layers.append(Layer(len(layers), pending, pending[-1], "quantized", [pending[-1]]))
    out_names = set(var_names(main_output))
    users = users_of(bindings)
    for layer in layers:  # intermediate results used elsewhere are outputs too (after a cell's h)
        mset = set(layer.members)
        for m in layer.members[:-1]:
            if m in out_names or any(bindings[k].name not in mset for k in users.get(m, [])):
                layer.outputs.insert(len(layer.outputs) if layer.op in RECURRENT_OPS else len(layer.outputs) - 1, m)
    _name_tuple_results(layers, bindings, users, out_names)
    return layers


def merge_quantized_rolls(layers: list[Layer], bindings: list[Binding], main_output: relax.Expr) -> list[Layer]:
    """A roll that a quantized graph keeps as one layer per op (a quantizer quantizes each Slice
    and Concat of an exported ``torch.roll``) becomes one layer of op ``roll``, as in a float
    graph: per axis two slices of one tensor and their concat (:func:`irgen.canonical.rotation`),
    each layer exact data movement (its one member the slice or the concat: the scheme put
    no requantization there), the slices read by the concat alone; a chain of such rotations
    (a roll over several axes) is one layer."""

    by_name = {b.name: b for b in bindings}
    layer_of = {m: l.index for l in layers for m in l.members}
    users = users_of(bindings)
    out_names = set(var_names(main_output))

    def alone(layer: Layer, op: str) -> bool:
        return len(layer.members) == 1 and by_name[layer.members[0]].op == op

    def read_only_by(name: str, readers: set[int]) -> bool:
        return name not in out_names and all(layer_of.get(bindings[k].name) in readers for k in users.get(name, []))

    groups: dict[int, list[int]] = {}  # the layer index of a rotation's concat -> the layers of its roll
    for layer in layers:
        if not alone(layer, "relax.concat"):
            continue
        b = by_name[layer.members[0]]
        fields = getattr(b.value.args[0], "fields", [])
        pieces = [layer_of.get(f.name) if isinstance(f, relax.Var) else None for f in fields]
        if len(pieces) != 2 or None in pieces or len(set(pieces)) != 2 \
                or not all(alone(layers[k], "relax.strided_slice") and read_only_by(layers[k].outputs[0], {layer.index})
                           for k in pieces) or rotation(b, by_name) is None:
            continue
        group = sorted(pieces) + [layer.index]
        x = by_name[layers[pieces[0]].members[0]].value.args[0]
        before = layer_of.get(x.name) if isinstance(x, relax.Var) else None
        if before in groups and read_only_by(x.name, set(pieces)):  # the roll's next axis
            group = groups.pop(before) + group
        groups[layer.index] = group
    if not groups:
        return layers
    merged = {k for g in groups.values() for k in g}
    out: list[Layer] = []
    for layer in layers:
        if layer.index in groups:
            members = [m for k in groups[layer.index] for m in layers[k].members]
            out.append(Layer(len(out), members, members[-1], layer.rule, list(layer.outputs), op="roll"))
        elif layer.index not in merged:
            out.append(_replace(layer, index=len(out)))
    return out


def fuse_quantized_layers(layers: list[Layer], bindings: list[Binding], rules: list[FusionRule],
                          quants: dict[int, dict[str, Any] | None], main_output: relax.Expr) -> list[Layer]:
    """A backend's fusion rules over the layers of a realized quantized graph.

    A scheme cuts its graph into one layer per source op (its integer arithmetic in
    place of that op; ``quants``: each layer's ``quant`` record by index). Here a rule
    whose anchor names a layer's op absorbs the following layers its ``followers`` name,
    each read only by the next, as :func:`form_layers` does for single ops. A layer's op
    is its compute op (``relax.nn.conv2d``, ``relax.matmul``, ``relax.nn.max_pool2d``)
    or, for a layer that requantizes and a rule with ``requantized_followers``, the op
    it stands for (a quantized add matches ``relax.add``, a relu table ``relax.nn.relu``).

    A follower that is an exact integer layer (``kind`` ``integer``: max pool, reshape)
    reading only the previous result joins with any rule: the merged layer keeps the
    anchor layer's members as ``head`` (``quant.fused_after``). Under a rule's
    ``requantized_followers``, a follower with a requantization of its own (a residual
    add, an activation table) or, under ``tensor_operands`` too, reading other tensors
    (the residual add's other operand, which becomes an input of the merged layer)
    joins as well, and the merged layer is a chain of steps: ``steps`` lists each
    scheme layer's members (``quant.steps``, one record per step). A follower with
    weights of its own (a convolution, a matmul) or a second table is never absorbed.
    Merged layers whose inputs are computed after their anchor run where they can."""
    graph = _QuantizedLayers(layers, bindings, quants, main_output)
    taken: set[int] = set()
    fused: list[Layer] = []
    for layer in layers:
        if layer.index in taken:
            continue
        layer, absorbed = graph.fuse_at(layer, rules, taken)
        taken.update(c.index for c in absorbed)
        fused.append(layer)
    for k, layer in enumerate(fused):
        layer.index = k
    # a merged layer reading a tensor computed after its anchor (a residual add's other
    # operand) runs after that tensor's layer
    return _execution_order(fused, bindings, {m: l.index for l in fused for m in l.members})


class _QuantizedLayers:
    """The layers of a realized quantized graph as :func:`fuse_quantized_layers` reads them:
    which layer binds each tensor, who reads it, and each layer's ``quant`` record."""

    def __init__(self, layers: list[Layer], bindings: list[Binding], quants: dict[int, dict[str, Any] | None],
                 main_output: relax.Expr):
        self.layers = layers
        self.bindings = bindings
        self.quants = quants
        self.by_name = {b.name: b for b in bindings}
        self.layer_of = {m: l.index for l in layers for m in l.members}
        self.users = users_of(bindings)
        self.out_names = set(var_names(main_output))

    def reads(self, layer: Layer) -> set[str]:
        """The tensors ``layer`` reads from outside its members."""
        mset = set(layer.members)
        return {a for m in layer.members for a in var_names(self.by_name[m].value) if a not in mset}

    def requantizes(self, layer: Layer) -> bool:
        """``layer`` has a requantization of its own (not an exact integer layer)."""
        return (self.quants.get(layer.index) or {}).get("kind") not in (None, "integer")

    def matches(self, layer: Layer, names: frozenset[str], rule: FusionRule) -> bool:
        """``layer``'s op is one of the Relax ops ``names``: its compute op, or under the rule's
        ``requantized_followers`` the op a requantizing layer stands for."""
        if self.by_name[layer.anchor].op in names:
            return True
        return (rule.requantized_followers and self.requantizes(layer)
                and _quantized_op(layer, self.quants[layer.index], self.by_name) in {_short(n) for n in names})

    def tables(self, layer: Layer) -> int:
        """How many lookup tables (a ``take`` from a constant) ``layer`` has."""
        return sum(1 for m in layer.members if self.by_name[m].op == "relax.take"
                   and isinstance(self.by_name[m].value.args[0], Constant))

    def next_layer(self, layer: Layer, followers: frozenset[str], rule: FusionRule, chain: list[Layer],
                   taken: set[int]) -> Layer | None:
        """The layer that may join ``chain`` after its tail ``layer`` as one of ``followers``:
        the only reader of ``layer``'s one output (not a model output), not taken, matching,
        and either an exact integer layer reading nothing else or allowed by ``rule``'s
        ``requantized_followers`` and ``tensor_operands`` (same scheme as the anchor, no
        weights, at most one table in the chain); None when there is none."""
        if len(layer.outputs) != 1 or layer.outputs[0] in self.out_names or layer.outputs[0] != layer.members[-1]:
            return None
        out = layer.outputs[0]
        readers = {self.layer_of.get(self.bindings[k].name) for k in self.users.get(out, [])}
        if len(readers) != 1 or None in readers:
            return None
        nxt = self.layers[readers.pop()]
        if nxt.index in taken or self.quants.get(nxt.index) is None or not self.matches(nxt, followers, rule):
            return None
        extra = self.reads(nxt) - {out}
        if not self.requantizes(nxt) and not extra:
            return nxt  # an exact integer follower: the anchor's requantization covers the layer
        anchor_q = self.quants.get(chain[0].index)
        if (not rule.requantized_followers or anchor_q is None
                or self.quants[nxt.index].get("scheme") != anchor_q.get("scheme")
                or (extra and not rule.tensor_operands)
                or any(self.by_name[m].op in _COMPUTE for m in nxt.members)
                or self.tables(nxt) + sum(self.tables(c) for c in chain) > 1):
            return None
        return nxt

    def fuse_at(self, layer: Layer, rules: list[FusionRule], taken: set[int]) -> tuple[Layer, list[Layer]]:
        """The first rule anchored at ``layer`` whose required followers all join applied:
        (the merged layer, the layers it absorbed); ``(layer, [])`` when it absorbs none."""
        for rule in (r for r in rules if self.matches(layer, r.anchor, r)):
            chain, absorbed, tail = [layer], set(), layer
            for k, followers in enumerate(rule.followers):
                nxt = self.next_layer(tail, followers, rule, chain, taken)
                if nxt is not None:
                    chain.append(nxt)
                    absorbed.add(k)
                    tail = nxt
            if rule.required <= absorbed:
                best = chain[1:]
                if best:
                    stepwise = any(self.requantizes(c) or self.reads(c) != {p.outputs[0]} for p, c in zip(chain, best))
                    layer = Layer(layer.index, [m for c in chain for m in c.members], layer.anchor, rule.name,
                                  list(best[-1].outputs), op=rule.op, head=list(layer.members),
                                  steps=[list(c.members) for c in chain] if stepwise else None)
                return layer, best
        return layer, []


def _short(relax_op: str) -> str:
    """The IR op a rule's Relax op name stands for (``relax.nn.relu`` -> ``relu``)."""
    name = LAYER_OP_NAMES.get(relax_op) or OP_NAMES.get(relax_op) or relax_op.removeprefix("relax.").removeprefix("nn.")
    return CANONICAL_OPS.get(name, name)


def _quantized_op(layer: Layer, quant: dict[str, Any], by_name: dict[str, Binding]) -> str:
    """The IR op of a layer a scheme realized with a requantization (``add``, ``relu``...)."""
    op = quant_op(quant, [by_name[m] for m in layer.members])
    return CANONICAL_OPS.get(op, op)


