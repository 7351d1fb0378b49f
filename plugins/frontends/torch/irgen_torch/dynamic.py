"""A ``.pt2`` program exported with dynamic shapes: its declared interface
(``Frontend.interface``, :func:`model_interface`) and its graph specialized to the concrete
input shapes of one run (:func:`specialize`).

``torch.export`` with ``dynamic_shapes`` (``Dim``, ``Dim.AUTO``) leaves symbols (``s36``)
in the placeholders' shapes and ``sym_size`` / integer-arithmetic nodes in the graph. irgen
imports and compiles a graph at concrete shapes: :func:`specialize` gives every user input
its ``--input-shape`` (the fixed dimensions must match, one symbol takes one value), runs
torch's fake-tensor propagation over the graph at those shapes (every node's recorded shape
becomes concrete; node names do not change), and replaces each node whose value is then a
plain number (``sym_size``, ``s0 + s1``) with that number, so that the masks and index
tensors built from shapes are input-independent constants (:mod:`irgen_torch.fold`).

The program's range constraints (``torch.export`` gives a dynamic dimension the range
``[2, inf]`` unless told otherwise) are not enforced: irgen runs the graph at the shapes it
is given, as torch's FX interpreter (the source runner) does, and a shape outside the
ranges is the one the graph's operators compute at. An empty KV cache (length 0) and a
decode step of one token are outside torch's default ranges; the graph of a transformers
decoder is shape-generic there. A node that cannot be computed at the given shapes, or a
runtime assertion of the program that fails there, is an :class:`irgen.plugin.IrgenError`.

The interface names each output after the FX node irgen names it (its ``user_outputs``
name) and gives its place in the program's returned structure as ``DeclaredTensor.path``
(``logits``, ``present.0``: dictionary keys and sequence positions of the output pytree,
joined by dots), which ``irgen run --decode`` reads its roles from.
"""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any

from irgen.plugin import DeclaredTensor, IrgenError, ModelInterface

from .archive import one_line
from .guard import quiet_torch
from .loader import load_pt2

#: the program's runtime assertions: dropped once their condition is a true constant
_ASSERTS = ("_assert_scalar", "sym_constrain_range", "sym_constrain_range_for_size", "_assert_async")


# ---------------------------------------------------------------- the declared interface


def _dims(shape) -> tuple[int | str, ...]:
    """Fixed dimensions as ints, symbolic ones (``s36``, ``s36 + s70``) as their expression."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    return tuple(int(d) if is_concrete_int(d) else str(d) for d in shape)


def _dtype(val) -> str:
    return str(val.dtype).replace("torch.", "")


def _leaf_paths(spec, prefix: tuple[str, ...] = ()) -> list[str]:
    """The dotted path of every leaf of a pytree ``spec`` (a ``TreeSpec``), in leaf order:
    string keys where the node's context lists them (a dict, a ``ModelOutput``), positions
    otherwise."""
    if spec.is_leaf():
        return [".".join(prefix)]
    children = list(spec.children())
    ctx = spec.context
    keys = list(ctx) if isinstance(ctx, (list, tuple)) and len(ctx) == len(children) \
        and all(isinstance(k, str) for k in ctx) else [str(k) for k in range(len(children))]
    return [p for k, child in zip(keys, children) for p in _leaf_paths(child, (*prefix, str(k)))]


def _output_paths(ep, count: int) -> list[str | None]:
    try:
        paths = _leaf_paths(ep.call_spec.out_spec)
    except Exception:  # noqa: BLE001  an unusual spec: the outputs keep their node names only
        return [None] * count
    if len(paths) != count:
        return [None] * count
    return [p or None for p in paths]


def declared(ep) -> ModelInterface:
    """``ep``'s user inputs and outputs with their shapes as exported (symbols for the dynamic
    dimensions) and the outputs' pytree paths."""
    users = set(ep.graph_signature.user_inputs)
    inputs = []
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in users:
            val = node.meta.get("val")
            if val is None or not hasattr(val, "shape"):
                raise IrgenError(f"input {node.name!r} is not a tensor; irgen can only feed tensors")
            inputs.append(DeclaredTensor(node.name, _dims(val.shape), _dtype(val)))
    from torch.export.graph_signature import OutputKind

    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    values = out_node.args[0] if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
    user = [(s.arg.name, v) for s, v in zip(ep.graph_signature.output_specs, values)
            if s.kind == OutputKind.USER_OUTPUT]  # not the mutated buffers
    paths = _output_paths(ep, len(user))
    outputs = []
    for (name, value), path in zip(user, paths):
        val = value.meta.get("val") if hasattr(value, "meta") else None
        shape, dtype = (_dims(val.shape), _dtype(val)) if hasattr(val, "shape") else ((), "unknown")
        outputs.append(DeclaredTensor(name, shape, dtype, path))
    return ModelInterface(tuple(inputs), tuple(outputs))


def model_interface(path: Path, options: dict[str, Any]) -> ModelInterface:
    """``Frontend.interface`` of the torch frontend: a ``.pt2`` program's declared inputs and
    outputs (:func:`declared`); the program is loaded as ``irgen run`` loads it, not run."""
    path = Path(path)
    if path.suffix.lower() != ".pt2":
        raise IrgenError(f"{path}: only a torch.export .pt2 program declares its inputs and outputs; a state dict "
                         "is exported at one fixed --input-shape")
    try:
        ep = load_pt2(path, options)
    except IrgenError as err:
        if "pickled data" not in str(err) and "pytree" not in str(err):
            raise
        raise IrgenError(f"{err}. A program that takes a cache object (transformers' DynamicCache, as its "
                         "DynamoExporter writes) needs that class to load; irgen reads a program whose signature "
                         "takes the cache as plain tensors and returns it in a dict, e.g. {'logits': ..., "
                         "'present': [tensors]} (docs/cli.md, LLM decode)") from None
    return declared(ep)


# ---------------------------------------------------------------- concrete shapes


def is_dynamic(ep) -> bool:
    """Whether any user input of ``ep`` has a symbolic dimension."""
    return any(isinstance(d, str) for t in declared_inputs(ep) for d in t.shape)


def declared_inputs(ep) -> tuple[DeclaredTensor, ...]:
    users = set(ep.graph_signature.user_inputs)
    return tuple(DeclaredTensor(n.name, _dims(n.meta["val"].shape), _dtype(n.meta["val"]))
                 for n in ep.graph.nodes if n.op == "placeholder" and n.name in users and "val" in n.meta)


def _concrete(inputs, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Each input's concrete shape: its own if fixed, else its ``--input-shape``, which must keep
    the fixed dimensions and give one symbol one value."""
    bound: dict[str, tuple[int, str]] = {}
    out = {}
    for t in inputs:
        given = shapes.get(t.name)
        if given is None:
            if any(isinstance(d, str) for d in t.shape):
                raise IrgenError(f"input {t.name!r} has the dynamic shape {list(t.shape)}: give its shape with "
                                 f"--input-shape {t.name}=DIMS")
            out[t.name] = tuple(t.shape)
            continue
        given = tuple(int(d) for d in given)
        arg = f"--input-shape {t.name}={','.join(map(str, given))}"
        if len(given) != len(t.shape) or any(isinstance(d, int) and d != g for d, g in zip(t.shape, given)):
            raise IrgenError(f"{arg}: the model's input {t.name!r} has the shape {list(t.shape)}")
        for d, g in zip(t.shape, given):
            if isinstance(d, str):
                seen = bound.setdefault(d, (g, t.name))
                if seen[0] != g:
                    raise IrgenError(f"{arg}: dimension {d} is {seen[0]} in input {seen[1]!r}; the program "
                                     f"says the two are equal")
        out[t.name] = given
    return out


def _fake_propagate(ep, shapes: dict[str, tuple[int, ...]]) -> None:
    """torch's fake-tensor propagation over ``ep``'s graph at ``shapes``: every node's
    ``meta['val']`` at those shapes (concrete, no symbols)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.export.graph_signature import InputKind
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = {**ep.state_dict, **dict(ep.named_buffers()), **ep.constants}
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    args = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            meta = placeholders[spec.arg.name].meta["val"]
            with mode:
                args.append(torch.empty(shapes[spec.arg.name], dtype=meta.dtype))
        else:
            args.append(mode.from_tensor(state[spec.target]) if isinstance(state.get(spec.target), torch.Tensor)
                        else state.get(spec.target))
    try:
        with quiet_torch():
            FakeTensorProp(ep.graph_module, mode).propagate_dont_convert_inputs(*args)
    except Exception as err:  # noqa: BLE001  an op that cannot run at these shapes, a failed assertion
        msg = one_line(str(err).split("While executing")[0], 300)
        raise IrgenError(f"the program cannot run at the input shapes {shapes} (torch: {type(err).__name__}: "
                         f"{msg})") from None


def _replace_numbers(ep) -> None:
    """Each call_function node whose value is now a number (``sym_size``, integer arithmetic on
    shapes) replaced by that number in its users; the program's runtime assertions checked
    and dropped."""
    import torch

    graph = ep.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        target = getattr(node.target, "__name__", str(node.target))
        if any(target.startswith(a) for a in _ASSERTS):
            args = node.args
            if args and isinstance(args[0], (bool, int)) and not args[0]:
                raise IrgenError(f"the program's runtime assertion {node.name!r} fails at these input shapes: "
                                 f"{args[1] if len(args) > 1 else target}")
            if not any(isinstance(a, torch.fx.Node) for a in args[:1]):
                graph.erase_node(node)
            continue
        val = node.meta.get("val")
        if isinstance(val, (bool, int, float)) and node.target is not operator.getitem:
            for user in list(node.users):
                user.args = torch.fx.node.map_arg(user.args, lambda a: val if a is node else a)
                user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda a: val if a is node else a)
            graph.erase_node(node)
    ep.graph_module.recompile()


def specialize(ep, shapes: dict[str, tuple[int, ...]]) -> None:
    """``ep`` (changed in place) at concrete input shapes (see the module text); ``shapes``:
    ``--input-shape`` by input name. A program without dynamic inputs is left as it is."""
    if not is_dynamic(ep):
        return
    concrete = _concrete(declared_inputs(ep), shapes)
    _fake_propagate(ep, concrete)
    _replace_numbers(ep)
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            node.meta.pop("tensor_meta", None)  # TVM's importer reads it before 'val'
    ep._range_constraints = {}
