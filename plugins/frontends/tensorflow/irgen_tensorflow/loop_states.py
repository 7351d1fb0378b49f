"""Per-iteration values of a TFLite ``WHILE`` loop's body tensors, from the interpreter.

irgen unrolls a ``WHILE`` (:mod:`.loops`) and records iteration ``t`` of the main graph's
loop ``WHILE_<k>`` as the source tensors ``<body tensor>@WHILE_<k>.t<t>``. With every tensor
preserved, the interpreter's body tensors hold their values of the last iteration it ran, so
:func:`loop_states` reads iteration ``t`` from a run of a copy of the model whose loop stops
after ``t + 1`` iterations (one run per requested iteration, at most :data:`MAX_RUNS` in all).

It stops a loop only when it can tell how: the condition is a ``LOGICAL_AND`` of ``LESS``
comparisons of loop counters with integer scalar constants (a constant of the condition
subgraph, or a loop value the body passes through unread and that enters as a constant), each
counter entering as a constant and the body adding 1 to it. Those bounds get buffers of their
own in the copy (a buffer may be shared with other tensors), patched per run. A loop is given
up on (its tensors left out: the source check reports them as not available) when it has no
such bounds, when the copy run to the full count does not reproduce the original run bit for
bit, or when a run's counters or results show it did not stop where it should.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np

#: interpreter runs :func:`loop_states` makes beyond the first, all loops together
MAX_RUNS = 512

_SUFFIX = re.compile(r"^WHILE_(\d+)\.t(\d+)$")
_INT_TYPES = {2: np.int32, 4: np.int64}  # tflite TensorType INT32, INT64


def requested(tensors) -> dict[int, dict[int, list[tuple[str, str]]]]:
    """Main-graph loop op index -> iteration -> (requested name, body tensor name)."""
    out: dict[int, dict[int, list[tuple[str, str]]]] = {}
    for name in tensors:
        base, at, suffix = name.rpartition("@")
        m = _SUFFIX.match(suffix) if at else None
        if m:
            out.setdefault(int(m.group(1)), {}).setdefault(int(m.group(2)), []).append((name, base))
    return out


def _ins(op) -> list[int]:
    return [int(t) for t in op.InputsAsNumpy()] if op.InputsLength() else []


def _outs(op) -> list[int]:
    return [int(t) for t in op.OutputsAsNumpy()] if op.OutputsLength() else []


class _Model:
    def __init__(self, content):
        import tflite
        from tflite.BuiltinOperator import BuiltinOperator

        self.m = tflite.Model.GetRootAsModel(content, 0)
        self.codes = {v: k for k, v in vars(BuiltinOperator).items() if not k.startswith("_")}

    def code(self, op) -> str:
        oc = self.m.OperatorCodes(op.OpcodeIndex())
        return self.codes.get(max(oc.BuiltinCode(), oc.DeprecatedBuiltinCode()), "CUSTOM")

    def producers(self, sg) -> dict[int, Any]:
        return {t: sg.Operators(i) for i in range(sg.OperatorsLength()) for t in _outs(sg.Operators(i))}

    def scalar(self, sg, t: int):
        """Tensor ``t``'s value when it is an int32/int64 scalar constant; else None."""
        if not 0 <= t < sg.TensorsLength():
            return None
        tensor = sg.Tensors(t)
        dtype = _INT_TYPES.get(tensor.Type())
        if dtype is None or tensor.ShapeLength() > 1 or tensor.ShapeLength() and tensor.Shape(0) != 1 \
                or tensor.IsVariable():
            return None
        buf = self.m.Buffers(tensor.Buffer())
        data = buf.DataAsNumpy() if buf.DataLength() else None
        if data is None or data.size != np.dtype(dtype).itemsize:
            return None
        return int(np.frombuffer(data.tobytes(), dtype)[0])


def _comparisons(model: _Model, cond) -> list[tuple[int, int]] | None:
    """The condition's (counter input tensor, bound tensor) pairs: its output a LOGICAL_AND tree
    of ``LESS(counter, bound)`` / ``GREATER(bound, counter)``; else None."""
    prod, found, stack = model.producers(cond), [], [int(cond.Outputs(0))]
    inputs = [int(cond.Inputs(k)) for k in range(cond.InputsLength())]
    while stack:
        op = prod.get(stack.pop())
        code = model.code(op) if op is not None else None
        ins = _ins(op) if op is not None else []
        if code == "LOGICAL_AND" and len(ins) == 2:
            stack.extend(ins)
        elif code in ("LESS", "GREATER") and len(ins) == 2:
            counter, bound = ins if code == "LESS" else ins[::-1]
            if counter not in inputs or bound in prod:
                return None
            found.append((counter, bound))
        else:
            return None
    return found


def _counts_up(model: _Model, body, k: int) -> bool:
    """The body's output ``k`` is its input ``k`` plus 1 (an ADD without activation)."""
    op = model.producers(body).get(int(body.Outputs(k)))
    if op is None or model.code(op) != "ADD" or len(_ins(op)) != 2:
        return False
    from tflite.AddOptions import AddOptions

    table = op.BuiltinOptions()
    if table is not None:
        options = AddOptions()
        options.Init(table.Bytes, table.Pos)
        if options.FusedActivationFunction():
            return False
    a, b = _ins(op)
    x = int(body.Inputs(k))
    return a == x and model.scalar(body, b) == 1 or b == x and model.scalar(body, a) == 1


def _bound(model: _Model, main, op, cond, body, t: int):
    """Where bound tensor ``t`` of the condition lives: ("cond", t) for a constant of the condition,
    ("main", parent tensor) for a constant loop value the body passes through unread; its value."""
    value = model.scalar(cond, t)
    if value is not None:
        return ("cond", t), value
    inputs = [int(cond.Inputs(k)) for k in range(cond.InputsLength())]
    if t not in inputs:
        return None
    q = inputs.index(t)
    x = int(body.Inputs(q))
    read = any(x in _ins(body.Operators(i)) for i in range(body.OperatorsLength()))
    parent = _ins(op)[q]
    value = model.scalar(main, parent)
    uses = sum(_ins(main.Operators(i)).count(parent) for i in range(main.OperatorsLength()))
    outputs = [int(main.Outputs(j)) for j in range(main.OutputsLength())]
    if read or int(body.Outputs(q)) != x or value is None or parent in model.producers(main) or uses != 1 \
            or parent in outputs:
        return None
    return ("main", parent), value


def _runs(model: _Model, index: int) -> int:
    """How many WHILE operators (in any subgraph) run subgraph ``index`` as their condition or body."""
    from tflite.WhileOptions import WhileOptions

    count = 0
    for s in range(model.m.SubgraphsLength()):
        sg = model.m.Subgraphs(s)
        for i in range(sg.OperatorsLength()):
            op = sg.Operators(i)
            if model.code(op) == "WHILE" and op.BuiltinOptions() is not None:
                options = WhileOptions()
                options.Init(op.BuiltinOptions().Bytes, op.BuiltinOptions().Pos)
                count += [options.CondSubgraphIndex(), options.BodySubgraphIndex()].count(index)
    return count


def analyze(model: _Model, k: int) -> dict[str, Any] | None:
    """Main-graph operator ``k``'s loop, when :func:`loop_states` can stop it: its body subgraph,
    the bounds to patch (where, base value added to the iteration count), the counters (loop
    value position, entry value), the full trip count. Else None."""
    from tflite.WhileOptions import WhileOptions

    main = model.m.Subgraphs(0)
    if not 0 <= k < main.OperatorsLength() or model.code(main.Operators(k)) != "WHILE":
        return None
    op = main.Operators(k)
    if op.BuiltinOptions() is None:
        return None
    options = WhileOptions()
    options.Init(op.BuiltinOptions().Bytes, op.BuiltinOptions().Pos)
    ci, bi, n = int(options.CondSubgraphIndex()), int(options.BodySubgraphIndex()), model.m.SubgraphsLength()
    if not (0 < ci < n and 0 < bi < n and ci != bi) or _runs(model, ci) != 1:
        return None  # a condition another loop also runs would stop that one too
    cond, body = model.m.Subgraphs(ci), model.m.Subgraphs(bi)
    pairs = _comparisons(model, cond) if cond.OutputsLength() == 1 else None
    if not pairs:
        return None
    inputs = [int(cond.Inputs(j)) for j in range(cond.InputsLength())]
    bounds: dict[tuple, list[int]] = {}  # where -> [value, largest counter entry]
    counters, count = [], None
    for counter, t in pairs:
        p, found = inputs.index(counter), _bound(model, main, op, cond, body, t)
        entry = model.scalar(main, _ins(op)[p]) if p < len(_ins(op)) else None
        if found is None or entry is None or not _counts_up(model, body, p) or _ins(op)[p] in model.producers(main):
            return None
        where, value = found
        bound = bounds.setdefault(where, [value, entry])
        bound[1] = max(bound[1], entry)
        counters.append((p, entry))
        count = value - entry if count is None else min(count, value - entry)
    return {"body": bi, "bounds": {w: v[1] for w, v in bounds.items()}, "counters": counters,
            "count": max(count, 0), "outputs": _outs(op)}


def _private_buffers(content: bytes, loops: dict[int, dict]) -> bytearray | None:
    """A copy of the model in which every bound tensor of ``loops`` has a buffer of its own."""
    from tensorflow.lite.python import schema_py_generated as schema
    from tensorflow.lite.tools import flatbuffer_utils

    obj = flatbuffer_utils.convert_bytearray_to_object(bytearray(content))
    if any(getattr(b, "offset", 0) > 1 for b in obj.buffers or []):
        return None  # buffers outside the flatbuffer
    cond_of = {}
    for k, info in loops.items():
        op = obj.subgraphs[0].operators[k]
        cond_of[k] = op.builtinOptions.condSubgraphIndex
        for where in info["bounds"]:
            tensor = obj.subgraphs[cond_of[k] if where[0] == "cond" else 0].tensors[where[1]]
            buf = schema.BufferT()
            buf.data = np.array(obj.buffers[tensor.buffer].data, np.uint8)
            obj.buffers.append(buf)
            tensor.buffer = len(obj.buffers) - 1
    out = bytearray(flatbuffer_utils.convert_object_to_bytearray(obj))
    for k, info in loops.items():
        info["cond"] = cond_of[k]
    return out


def _patch(content: bytearray, info: dict, n: int) -> bytes:
    """A copy of ``content`` with loop ``info``'s bounds set so that it runs ``n`` iterations
    (the other loops' bounds as they are)."""
    content = bytearray(content)
    model = _Model(content)
    for (where, t), base in info["bounds"].items():
        tensor = model.m.Subgraphs(info["cond"] if where == "cond" else 0).Tensors(t)
        data = model.m.Buffers(tensor.Buffer()).DataAsNumpy()  # a view into ``content``
        data[:] = np.frombuffer(np.array(base + n, _INT_TYPES[tensor.Type()]).tobytes(), np.uint8)
    return bytes(content)


def _body_names(model: _Model, bi: int) -> dict[str, int]:
    """Body tensor name -> index; left out: names that occur more than once (ambiguous), and the
    body's inputs (the WHILE kernel copies the loop values into them: not an iteration's own)."""
    sg, names, twice = model.m.Subgraphs(bi), {}, set()
    twice.update(_name(sg, int(sg.Inputs(j))) for j in range(sg.InputsLength()))
    for i in range(sg.TensorsLength()):
        name = _name(sg, i)
        if name in names:
            twice.add(name)
        else:
            names[name] = i
    return {n: i for n, i in names.items() if n not in twice}


def _name(sg, i: int) -> str:  # as TVM's importer names tensors (irgen's source tensor names)
    raw = sg.Tensors(i).Name()
    return raw.decode("utf-8") if raw is not None else f"tvmgen_tensor_{i}"


def _read(it, sg: int, t: int):
    try:
        return np.array(it.get_tensor(t, sg))
    except (ValueError, RuntimeError):
        return None


def _same(a, b) -> bool:
    return a is not None and b is not None and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _snapshot(it, info: dict, n: int) -> dict[int, np.ndarray] | None:
    """The body tensors of a run that should have stopped after ``n`` iterations, when its
    counters say so and its body results are the loop's results; else None."""
    body = info["body"]
    for p, entry in info["counters"]:
        got = _read(it, 0, info["outputs"][p])
        if got is None or got.size != 1 or int(got.reshape(-1)[0]) != entry + n:
            return None
    values = {t: _read(it, body, t) for t in info["tensors"]}
    for p, t in enumerate(info["body_outputs"]):  # those an operator writes (the body's inputs are copies)
        if t not in info["body_inputs"] and not _same(values.get(t), _read(it, 0, info["outputs"][p])):
            return None
    return values


def loop_states(content: bytes, tensors, invoke: Callable[[bytes], Any], first) -> dict[str, np.ndarray]:
    """Requested tensors ``<body tensor>@WHILE_<k>.t<t>``: their values from runs of the model
    (``invoke(content)`` -> an interpreter that has run) stopped after ``t + 1`` iterations;
    ``first`` the interpreter of the unpatched run. Those it cannot read soundly are left out."""
    wanted = requested(tensors)
    if not wanted:
        return {}
    model = _Model(content)
    loops = {k: info for k in wanted if (info := analyze(model, k)) is not None and info["count"]}
    if not loops:
        return {}
    copy = _private_buffers(content, loops)
    if copy is None:
        return {}
    out: dict[str, np.ndarray] = {}
    runs = 0
    for k, info in sorted(loops.items()):
        body = model.m.Subgraphs(info["body"])
        # the tensors the body's operators write (others, e.g. its inputs, are copies or never written)
        info["body_inputs"] = {int(body.Inputs(j)) for j in range(body.InputsLength())}
        info["tensors"] = sorted(set(model.producers(body)) - info["body_inputs"])
        names = {n: t for n, t in _body_names(model, info["body"]).items() if t in info["tensors"]}
        info["body_outputs"] = [int(body.Outputs(j)) for j in range(body.OutputsLength())]
        last, budget = info["count"] - 1, MAX_RUNS - runs - 1  # one run to the full count, to check
        steps = sorted(t for t in wanted[k] if t < last)[:budget] + ([last] if last in wanted[k] else [])
        if budget < 0 or not steps:
            continue
        full = _snapshot(invoke(_patch(copy, info, info["count"])), info, info["count"])
        runs += 1
        original = _snapshot(first, info, info["count"])
        if full is None or original is None or any(not _same(full[t], original[t]) for t in full
                                                   if original[t] is not None or full[t] is not None):
            continue  # the copy does not reproduce the model's own run: the loop is given up on
        found = {}
        for t in steps:
            values = full if t == last else _snapshot(invoke(_patch(copy, info, t + 1)), info, t + 1)
            runs += t != last
            if values is None:
                found = {}
                break
            for name, base in wanted[k][t]:
                if base in names and values.get(names[base]) is not None:
                    found[name] = values[names[base]]
        out.update(found)
    return out
