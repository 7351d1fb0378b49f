"""A simulated device for ``irgen compare``'s tests and bench: it writes a per-layer dump of an
output folder, laid out like OUT (the same files, in the backend's formats), computing every
layer from the values the device itself produced before (numpy reference, chained), with
hardware bugs injected into chosen layers.

A fault is ``fault(ctx) -> list of arrays | Memory``: ``ctx.outputs`` is what the layer
computes from the device's own inputs (``ctx.inputs``), ``ctx.params`` its parameters; the
arrays returned replace the outputs (later layers compute from them). A :class:`Memory`
is what the device wrote in memory, in the storage's physical form (``ctx.physical``:
layout and channel padding, as the backend's ``storage`` says): written as such.

The bugs are modelled here from the layer's record on purpose, not with
``irgen.diagnose``: the accumulator comes from the layer's own ``fused_ops`` (run up to
its bias add), its real multiplier from the ``quant`` record's scales.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from irgen.api import TensorInfo
from irgen.dumpmap import Physical
from irgen.extract import store
from irgen.reference import run_layer
from irgen.runners import Golden, LayerRunner, TensorFiles
from irgen.verify import load_ir


@dataclass
class Memory:
    """The physical arrays a faulty device wrote, one per output."""

    arrays: list[np.ndarray]


@dataclass
class Ctx:
    layer: dict
    inputs: list[np.ndarray]
    outputs: list[np.ndarray]
    params: dict[str, np.ndarray]
    golden: Golden
    run: Callable[..., list[np.ndarray]] = field(repr=False, default=None)

    def physical(self, k: int = 0) -> Physical:
        return Physical.of(self.layer["outputs"][k])


def _host():
    from irgen.plugins import PluginHost

    return PluginHost().load()


def write_dump(out: Path, dump: Path, faults: dict[str, Callable[[Ctx], Any]] | None = None,
               skip: set[str] = frozenset(), inputs: dict[str, np.ndarray] | None = None, host=None) -> dict:
    """Write ``dump`` from ``out`` (see the module docstring); ``skip``: layers or tensors left
    out (a partial dump); ``inputs``: model inputs the device gets instead of OUT's (written
    into the dump too). Returns the IR."""
    out, dump = Path(out), Path(dump)
    ir = load_ir(out)
    host = host or _host()
    be = host.backends.get(ir["producer"]["backend"])
    files = TensorFiles(out, ir, None, lambda: be)
    golden, runner = Golden(files, ir), LayerRunner(files)
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    feeds = {r["name"]: golden.get(r["name"]) for r in ir["inputs"]}
    for rec in ir["inputs"]:
        if inputs and rec["name"] in inputs:
            feeds[rec["name"]] = inputs[rec["name"]]
            _write(be, dump, rec, None, feeds[rec["name"]], "input")
    faults = faults or {}

    def alter(layer, outs, ins):
        fault = faults.get(layer["name"])
        if fault is None:
            got = outs
        else:
            got = fault(Ctx(layer, ins, outs, runner.params(layer), golden,
                            lambda **kw: runner.run(kw.get("layer", layer), kw.get("inputs", ins),
                                                    params=kw.get("params"), check=False)[0]))
        for k, rec in enumerate(layer["outputs"]):
            if layer["name"] not in skip and rec["name"] not in skip:
                _write(be, dump, rec, layer, got.arrays[k] if isinstance(got, Memory) else got[k], "activation",
                       memory=isinstance(got, Memory))
        if isinstance(got, Memory):  # what later layers read: the logical view of that memory
            return [Physical.of(rec).to_logical(a) for rec, a in zip(layer["outputs"], got.arrays)]
        return got

    for _ in runner.chain(ir, feeds, alter):
        pass
    return ir


def _write(be, dump: Path, rec: dict, layer: dict | None, value: np.ndarray, kind: str, memory: bool = False) -> None:
    path = dump / rec["file"]
    path.parent.mkdir(parents=True, exist_ok=True)
    value = np.asarray(value)
    if memory:  # the physical bytes as they are (a .bin of npu-int8, or a .npy)
        if path.suffix == ".npy":
            np.save(path, value)
        else:
            value.astype(value.dtype.newbyteorder("<")).tofile(path)
        return
    if rec.get("storage"):
        info = TensorInfo(rec["name"], kind, tuple(rec["shape"]), rec["dtype"], rec.get("layout"),
                          op=layer and layer["op"], layer=layer and layer["name"])
        store(be, path.with_name(path.name[: -len(path.suffix)]), value.astype(rec["dtype"]), info, dump)
    else:
        np.save(path, value.astype(rec["dtype"]))


# ------------------------------------------------------------------ the bugs, modelled from the record


def accumulator(ctx: Ctx) -> np.ndarray:
    """The int64 accumulator (bias included) of a convolution or dense layer: its fused_ops
    run up to the op after the conv/matmul when that op adds the bias."""
    ops = ctx.layer["fused_ops"]
    k = next(i for i, op in enumerate(ops) if op["relax_op"] in ("relax.nn.conv2d", "relax.matmul"))
    if k + 1 < len(ops) and ops[k + 1]["relax_op"] == "relax.add" and f"op:{k}" in ops[k + 1]["args"]:
        k += 1
    return run_layer({**ctx.layer, "results": [f"op:{k}"]}, ctx.inputs, ctx.params)[0].astype(np.int64)


def channel_axis(layer: dict) -> int:
    if layer["op"] == "dense":
        return -1
    attrs = layer.get("attrs") or {}
    return str(attrs.get("out_layout") or attrs.get("data_layout") or "NCHW").index("C")


def multiplier(ctx: Ctx, acc: np.ndarray) -> np.ndarray:
    """The real requantization multiplier s_x * s_w[c] / s_y, broadcast along the output channels."""
    q = ctx.layer["quant"]
    s = float(np.ravel(q["inputs"][0]["scale"])[0]) * np.ravel(np.asarray(q["weight"]["scale"], float)) \
        / float(np.ravel(q["output"]["scale"])[0])
    axis = channel_axis(ctx.layer) % acc.ndim
    shape = [1] * acc.ndim
    shape[axis] = -1
    return np.broadcast_to(s, (acc.shape[axis],)).reshape(shape)


def requantized(ctx: Ctx, acc: np.ndarray | None = None, mult: np.ndarray | None = None,
                rnd: Callable = np.rint, zp: int | None = None, clamp: tuple | None = None, wrap: bool = False):
    """``clamp(rnd(acc * mult) + zp)`` in the output's dtype (``wrap``: wrapped into it instead)."""
    q = ctx.layer["quant"]
    acc = accumulator(ctx) if acc is None else acc
    mult = multiplier(ctx, acc) if mult is None else mult
    zp = int(np.ravel(q["output"]["zero_point"])[0]) if zp is None else zp
    y = rnd(acc * mult) + zp
    dtype = ctx.outputs[0].dtype
    info = np.iinfo(dtype)
    if wrap:
        return [(np.mod(y - info.min, 1 << (8 * dtype.itemsize)) + info.min).astype(dtype)]
    lo, hi = clamp or q.get("clamp") or (info.min, info.max)
    return [np.clip(y, lo, hi).astype(dtype)]


def padded_input(ctx: Ctx, value: float) -> list[np.ndarray]:
    """The layer computed with its input padded by ``value`` (in the input's own dtype)
    instead of what the layer pads with: its conv's padding made 0, the input padded first."""
    attrs = ctx.layer.get("attrs") or {}
    layout = str(attrs.get("data_layout") or "NCHW")
    pt, pl, pb, pr = attrs["padding"]
    widths = [(0, 0)] * 4
    widths[layout.index("H")], widths[layout.index("W")] = (pt, pb), (pl, pr)
    x = np.pad(ctx.inputs[0], widths, constant_values=value)
    ops = [{**op, "attrs": {**op["attrs"], "padding": [0, 0, 0, 0]}} if op["relax_op"] == "relax.nn.conv2d" else op
           for op in ctx.layer["fused_ops"]]
    return [np.asarray(v) for v in run_layer({**ctx.layer, "fused_ops": ops}, [x, *ctx.inputs[1:]], ctx.params)]
