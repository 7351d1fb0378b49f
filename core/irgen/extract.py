"""``irgen extract OUT --layer NAME -o DIR``: one layer as a self-contained test vector.

DIR is an irgen output folder of one layer: ``ir.json`` (the layer's record, its inputs as
the model inputs, its outputs as the model outputs), its parameter files, input files and
golden output files in the formats of the backend that wrote OUT (copied from OUT with
their extra files, e.g. npu-int8's ``.hex`` and ``.npy``), what the serializers OUT was
written with make of that IR besides ``ir.json`` (npu-int8's C header), and
``manifest.json``. ``irgen verify DIR --mode single`` checks it like any output.

``irgen compare --extract-failing DIR`` writes the first locally wrong layer so, with the
device's own inputs: the inputs are the dump's values, the golden outputs what the layer
computes from them (stored by the backend, :func:`store`), and the device's outputs are
kept beside them in ``device/`` (``.npy``). DIR is written whole or not at all
(:class:`irgen.output.OutputFolder`).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from irgen.api import IrgenError, StoredTensor, TensorInfo
from irgen.output import OutputFolder, write_manifest
from irgen.plugins import PluginHost
from irgen.runners import check_size
from irgen.safeio import DEFAULT_MAX_TENSOR_BYTES, inside, open_regular

__all__ = ["extract_layer", "store"]


def store(backend, path: Path, array: np.ndarray, info: TensorInfo, root: Path) -> tuple[str, dict | None]:
    """``array`` written as the backend writes a tensor (``store_tensor``, ``write_tensor`` or
    ``.npy``) at ``path`` (without suffix) inside ``root``: (main file relative to ``root``,
    the record's ``storage`` with its extra files, or None)."""
    array = np.ascontiguousarray(array)
    if backend is not None and backend.store_tensor is not None:
        stored = backend.store_tensor(path, array, info)
        if not isinstance(stored, StoredTensor):
            raise IrgenError(f"backend {backend.name!r}: store_tensor must return a StoredTensor")
        extra = list(stored.extra_files)
        storage = {**(stored.storage or {}), "files": [Path(p).relative_to(root).as_posix() for p in extra]}
        return Path(stored.file).relative_to(root).as_posix(), storage
    if backend is not None and backend.write_tensor is not None:
        return Path(backend.write_tensor(path, array)).relative_to(root).as_posix(), None
    main = path.with_name(path.name + ".npy")
    np.save(main, array, allow_pickle=False)
    return main.relative_to(root).as_posix(), None


def _copy(out: Path, rel: str, folder: OutputFolder, what: str, limit: int | None) -> None:
    """OUT's file ``rel`` (confined to OUT, sized first) copied to the same place in the folder."""
    src = inside(out, rel, what)
    check_size(src, what, limit)
    with open_regular(src, what) as f, open(folder.path(rel), "wb") as dst:
        shutil.copyfileobj(f, dst)


def _layer_of(ir: dict, name: str) -> dict:
    for layer in ir["layers"]:
        if layer["name"] == name:
            return layer
    near = [l["name"] for l in ir["layers"] if name.lower() in l["name"].lower()][:5]
    raise IrgenError(f"no layer named {name!r:.100} in ir.json" + (f" (did you mean {', '.join(near)}?)" if near else
                                                                  f"; it has {len(ir['layers'])} layers"))


def _info(rec: dict, kind: str, layer: dict) -> TensorInfo:
    return TensorInfo(name=rec["name"], kind=kind, shape=tuple(rec["shape"]), dtype=str(rec["dtype"]),
                      layout=rec.get("layout"), op=layer["op"] if kind == "activation" else None,
                      layer=layer["name"] if kind == "activation" else None)


def _tensors(rec: dict, value: np.ndarray | None, kind: str, layer: dict, ctx: dict) -> dict:
    """One tensor record of the extract: OUT's files copied, or ``value`` stored anew."""
    rec = dict(rec)
    if value is None:
        for rel in [rec.get("file"), *((rec.get("storage") or {}).get("files") or [])]:
            if rel:
                _copy(ctx["out"], rel, ctx["folder"], f"tensor {rec['name']!r:.100}", ctx["limit"])
        return rec
    value = np.asarray(value)
    if list(value.shape) != list(rec["shape"]):
        raise IrgenError(f"tensor {rec['name']!r:.100}: {list(value.shape)} given, the record says {rec['shape']}")
    stem = str(Path(rec.get("file") or f"activations/{rec['name']}").with_suffix(""))
    file, storage = store(ctx["backend"], ctx["folder"].path(stem), value.astype(rec["dtype"], copy=False),
                          _info(rec, kind, layer), ctx["folder"].tmp)
    rec["file"] = file
    rec.pop("storage", None)
    if storage is not None:
        rec["storage"] = storage
    return rec


def _mini_ir(ir: dict, layer: dict, inputs: list[dict], outputs: list[dict]) -> dict[str, Any]:
    """The IR of the extract: the layer alone, its inputs the model's inputs, its outputs the
    model's outputs (named as in the source model where the layer's record says);
    ``producer.extracted_from`` says which layer of which model it was."""
    one = copy.deepcopy(layer)
    one["inputs"] = [{**r, "producer": "input"} for r in inputs]
    one["outputs"] = [{**r, "producer": layer["name"]} for r in outputs]
    sources = (layer.get("source") or {}).get("outputs") or []
    model_outputs = [{**r, "source": sources[k] if k < len(sources) else None} for k, r in enumerate(one["outputs"])]
    producer = {**(ir.get("producer") or {}),
                "extracted_from": {"layer": layer["name"], "index": ir["layers"].index(layer)}}
    return {**{k: v for k, v in ir.items() if k not in ("producer", "inputs", "outputs", "layers")},
            "producer": producer, "inputs": one["inputs"], "outputs": model_outputs, "layers": [one]}


def extract_layer(out: str | Path, name: str, dest: str | Path, *, host=None, inputs: list | None = None,
                  outputs: list | None = None, device: list | None = None, force: bool = False,
                  limit: int | None = DEFAULT_MAX_TENSOR_BYTES) -> Path:
    """Write layer ``name`` of ``out`` as a test vector into ``dest`` (see the module docstring);
    ``inputs``/``outputs``: arrays to store instead of OUT's files (the device's inputs and
    what the layer computes from them); ``device``: the device's outputs, kept in ``device/``."""
    from irgen.verify import load_ir

    out = Path(out)
    ir = load_ir(out)
    layer = _layer_of(ir, name)
    if host is None:
        host = PluginHost().load()
    producer = ir.get("producer") or {}
    backend = host.backends.get(producer["backend"]) if producer.get("backend") in host.backends else None
    with OutputFolder(Path(dest), force) as folder:
        ctx = {"out": out.resolve(), "folder": folder, "limit": limit, "backend": backend}
        ins = [_tensors(r, None if inputs is None else inputs[k], "input", layer, ctx)
               for k, r in enumerate(layer.get("inputs") or [])]
        outs = [_tensors(r, None if outputs is None else outputs[k], "activation", layer, ctx)
                for k, r in enumerate(layer["outputs"])]
        for rec in (layer.get("params") or {}).values():
            _tensors(rec, None, "parameter", layer, ctx)
        mini = _mini_ir(ir, layer, ins, outs)
        folder.path("ir.json").write_text(json.dumps(mini, indent=1) + "\n")
        for sname in [s for s in producer.get("serializers") or [] if s != "json" and s in host.serializers]:
            host.serializers.get(sname).write(mini, folder.tmp)
        for k, value in enumerate(device or []):
            if value is not None:
                np.save(folder.path(f"device/{Path(str(outs[k]['file'])).with_suffix('').name}.npy"), np.asarray(value))
        write_manifest(folder, {"extracted_from": str(out), "layer": layer["name"],
                                "inputs": "the device's" if inputs is not None else "OUT's"})
    return Path(dest)
