"""Concat (QLinearConcat): each operand as is, through a table when its parameters differ from
the output's, or a literal when computed from constants; :func:`recompute_concat` is its numpy twin."""

from __future__ import annotations

import numpy as np

from irgen.plugin import IrgenError

from .common import SCHEME, _const_chain, _dequantized, _drop, _is_torch, _lut, _need, _ops, _table
from .operands import _float_operand, constant_tensor, constants_record, quantized_constant


def _realize_concat(qg, qb, comp, out):
    relax, op, _, _ = _ops()
    tensor = qb.name
    ins, given = [], []
    for f in comp.value.args[0].fields:
        qc = None if _is_torch(qg) else quantized_constant(qg, f)
        if qc is not None:  # a constant quantized at run time (the class token, folded by the importer)
            ins.append((None, qc[1], qc[2]))
            given.append(qc[0])
            continue
        r = _dequantized(qg, f)
        if r is None and not _is_torch(qg) and _float_operand(qg, f):
            # a float input (an op quantize_static left out of op_types_to_quantize): ORT concatenates in float
            raise IrgenError(f"{SCHEME}: an input of {tensor!r} is computed in float; no integer kernel")
        if r is None and not _is_torch(qg):  # a dequantized constant (a folded class token): QLinearConcat's input
            arr, qt, chain = _const_chain(qg, f, tensor, "an input")
            if qt.scale.size != 1:
                raise IrgenError(f"{SCHEME}: an input of {tensor!r} is a per-channel constant; not supported")
            ins.append((None, qt, _drop(qg, chain)))
            given.append(arr)
            continue
        if r is None:
            r = _need(qg, f, "an input", tensor)
        ins.append((r[0], r[1], [r[2]]))
        given.append(None)
    parts, tables, consts = [], [], []
    for k, (x, qx, _) in enumerate(ins):
        if qx.dtype != out.dtype:
            raise IrgenError(f"{SCHEME}: concatenation {tensor!r} mixes {qx.dtype} and {out.dtype}")
        c = given[k] if given[k] is not None else constant_tensor(qg, x)
        consts.append(None)
        if c is not None:  # computed from constants (ViT's class token): a literal, as TVM folds it
            if qx.scale[0] != out.scale[0] or qx.zero_point[0] != out.zero_point[0]:
                c = _table(qx, out, torch_rule=_is_torch(qg))[c.astype(np.int64) - int(np.iinfo(qx.dtype).min)]
            consts[k] = c.astype(out.dtype)
            parts.append(relax.const(consts[k]))
            tables.append(None)
            ins[k] = (None, qx, ins[k][2])
        elif qx.scale[0] == out.scale[0] and qx.zero_point[0] == out.zero_point[0]:
            parts.append(x)
            tables.append(None)
        else:
            t = _table(qx, out, torch_rule=_is_torch(qg))
            parts.append(qg.emit(_lut(qg, x, t, qx.dtype)))
            tables.append([int(v) for v in t])
    axis = int(comp.value.attrs.axis)
    # the layer's inputs are the tabled operands (their lookups are bound first), then the others, each once:
    # ``operands[k]`` is the layer input that is operand k (inputs[k] and tables[k] describe operand k)
    names = [getattr(x, "name", None) if isinstance(x, relax.Var) else None for x, _, _ in ins]
    order: list[str] = []
    for tabled in (True, False):
        order += [n for n, t in zip(names, tables) if n is not None and (t is not None) == tabled and n not in order]
    rec = {"scheme": SCHEME, "kind": "concatenate", "axis": axis, "inputs": [qx.record() for _, qx, _ in ins],
           **({"reference": "torch"} if _is_torch(qg) else {}),
           "output": out.record(), "tables": tables,
           "operands": [order.index(n) if n is not None else None for n in names],
           **({"constants": constants_record(consts)} if any(c is not None for c in consts) else {}),
           "requant": {"rounding": "half_to_even", "rounding_rule": "inputs with other parameters: table[i - min] = "
                       "quantize(dequantize(i)) (QLinearConcat)"}}
    expr = op.concat(parts, axis=axis)
    if any(c is not None for c in consts):  # in int32, then narrowed: the IR's fused_ops keep a literal without its dtype
        wide = [relax.const(c.astype(np.int32)) if c is not None else qg.emit(op.astype(p, "int32"))
                for c, p in zip(consts, parts)]
        expr = op.astype(qg.emit(op.concat(wide, axis=axis)), out.dtype)
    return [d for _, _, ds in ins for d in ds] + [comp.name, qb.name], expr, rec


def recompute_concat(layer, inputs, params=None) -> np.ndarray:
    """A ``concatenate`` layer: operand k is the layer input ``operands[k]`` (through ``tables[k]``
    when its parameters differ from the output's, QLinearConcat) or the literal ``constants[k]``."""
    qr = layer["quant"]
    out = qr["output"]
    consts = qr.get("constants") or {}
    order = qr.get("operands") or list(range(len(qr["tables"])))
    parts = []
    for k, t in enumerate(qr["tables"]):
        c = consts.get(str(k))
        if c is not None:
            parts.append(np.asarray(c["values"], out["dtype"]).reshape(c["shape"]))
            continue
        inp = inputs[order[k]]
        parts.append(inp if t is None else np.asarray(t, out["dtype"])[inp.astype(np.int64) - np.iinfo(inp.dtype).min])
    return np.concatenate(parts, axis=qr["axis"])
