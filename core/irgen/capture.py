"""Capture and write: a plan run on one input, every kernel's output written as the VM produces
it (in the backend's format), the parameter files, ``ir.json`` and the serializers' files, and
``manifest.json``; the records of ``ir.json`` are built from the plan's and the files written."""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np

from irgen import __version__, spill
from irgen.api import Backend, IrgenError, StoredTensor, TensorInfo
from irgen.compile import tvm_tensor
from irgen.forming import param_layout, tensor_layouts
from irgen.names import SafeNames
from irgen.output import file_identity, OutputFolder, ParamsStreamWriter, Progress, sha256_file, write_manifest
from irgen.plan import array, Plan, Stored
from irgen.plugins import call_plugin
from irgen.safeio import npz_member
from irgen.schema import IR_VERSION
from irgen.serializers import write_json


class TensorWriter:
    """``write(stem, array, name, kind, ...) -> file path relative to OUT``, in the backend's
    format (``store_tensor``, ``write_tensor`` or ``.npy``). Keeps what ``ir.json`` and
    ``manifest.json`` record of each file: ``storage`` (main file -> the tensor record's
    ``storage``) and ``manifest`` (file -> dtype, shape, layout, byte order, tensor)."""

    def __init__(self, folder: OutputFolder, be: Backend, registry, records: list[dict], static_shapes,
                 compress: bool = False):
        self.folder, self.be, self.registry = folder, be, registry
        if compress and (be.store_tensor is not None or be.write_tensor is not None):
            raise IrgenError(f"--compress: backend {be.name!r} stores tensors in its own format")
        self.compress = compress
        self.groups: dict[str, str] = {}  # (npz) layer or input -> file stem
        self.group_namers = {"activations": SafeNames(), "parameters": SafeNames()}
        self.storage: dict[str, dict[str, Any]] = {}
        self.manifest: dict[str, dict[str, Any]] = {}
        # the logical layout of the activations and inputs, and the layer computing each
        self.layouts = tensor_layouts(records, static_shapes)
        self.computed_by: dict[str, tuple[str, str]] = {}  # activation -> (layer name, op)
        for r in records:
            for o in r["outputs"]:
                self.computed_by.setdefault(o, (r["name"], r["op"]))

    def _rel(self, path: Path) -> str:
        return Path(path).relative_to(self.folder.tmp).as_posix()

    def __call__(self, stem: str, arr: np.ndarray, name: str, kind: str, role: str | None = None,
                 layout: str | None = None, op: str | None = None, layer: str | None = None) -> str:
        if kind != "parameter":
            layout = self.layouts.get(name)
            layer, op = self.computed_by.get(name, (None, None))
        logical = {"tensor": name, "dtype": str(arr.dtype), "shape": list(arr.shape), "layout": layout}
        if self.compress:
            return self._npz(kind, layer or name, arr, logical)
        if self.be.store_tensor is None:
            path = (self.be.write_tensor or write_npy)(self.folder.path(stem), arr)
            rel = self._rel(path)
            order = _npy_byte_order(arr.dtype) if self.be.write_tensor is None else None
            self.manifest[rel] = {**logical, "byte_order": order}
            return rel
        info = TensorInfo(name=name, kind=kind, shape=tuple(arr.shape), dtype=str(arr.dtype), layout=layout,
                          role=role, op=op, layer=layer)
        return self._store(stem, arr, info)

    def _npz(self, kind: str, group: str, arr: np.ndarray, logical: dict[str, Any]) -> str:
        """``--compress``: the tensor as a member of its layer's compressed ``.npz`` (parameters
        in ``parameters/<layer>.npz``, outputs in ``activations/<layer>.npz``, a model input in
        ``activations/<input>.npz``), named :func:`irgen.safeio.npz_member` of its name."""
        import zipfile

        folder = "parameters" if kind == "parameter" else "activations"
        key = f"{folder}/{group}"
        if key not in self.groups:
            self.groups[key] = f"{folder}/{self.group_namers[folder](group)}.npz"
        rel = self.groups[key]
        with zipfile.ZipFile(self.folder.path(rel), "a", compression=zipfile.ZIP_DEFLATED) as zf:
            with zf.open(npz_member(logical["tensor"]), "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asarray(arr), allow_pickle=False)
        entry = self.manifest.setdefault(rel, {"format": "npz", "tensors": {}})
        entry["tensors"][logical["tensor"]] = {k: logical[k] for k in ("dtype", "shape", "layout")}
        entry["tensors"][logical["tensor"]]["byte_order"] = _npy_byte_order(arr.dtype)
        return rel

    def _store(self, stem: str, arr: np.ndarray, info: TensorInfo) -> str:
        be = self.be
        stored = call_plugin(self.registry, be.name, f"store tensor {info.name!r}", be.store_tensor,
                             self.folder.path(stem), arr, info)
        if not isinstance(stored, StoredTensor):
            raise IrgenError(f"backend {be.name!r}: store_tensor must return a StoredTensor, got {stored!r:.100}")
        extra = stored.extra_files
        extra = {p: {} for p in extra} if not isinstance(extra, dict) else extra
        root = self.folder.tmp.resolve()
        for p in [stored.file, *extra]:
            if not Path(p).resolve().is_relative_to(root) or not Path(p).is_file():
                raise IrgenError(f"backend {be.name!r}: store_tensor of {info.name!r} names {p}, "
                                 "not a file it wrote in the output folder")
        storage = dict(stored.storage or {})
        storage["files"] = [self._rel(p) for p in extra]
        rel = self._rel(stored.file)
        self.storage[rel] = storage
        base = {"tensor": info.name, "dtype": storage.get("dtype", info.dtype),
                "shape": list(storage.get("shape", info.shape)), "layout": storage.get("layout", info.layout),
                "byte_order": storage.get("byte_order")}
        self.manifest[rel] = base
        for p, fields in extra.items():
            self.manifest[self._rel(p)] = {**base, **(fields or {})}
        return rel


#: ``--debug``: what ``debug/`` holds besides the layer outputs in ``activations/``
DEBUG_LEVELS = {
    "none": "no debug/ folder",
    "layers": "debug/_tvmdbg_graph_dump.json, the executed kernel graph (default)",
    "all": "as layers, plus debug/output_tensors.params: every kernel's output, the graph executor's dump",
}


def capture(folder: OutputFolder, plan: Plan, arrays: list[np.ndarray], write, progress: Progress,
             debug: str = "layers", layers_wanted=None):
    """Run the plan's executable on ``arrays`` with the capture instrument; write each layer
    output as it is produced (memory does not grow with the number of layers) and ``debug/``.

    ``layers_wanted(layer_name) -> bool`` picks the layers whose outputs are written (``--layers``).
    Returns (files by tensor name, (shape, dtype) by tensor name)."""
    from irgen import vm

    file_namer = SafeNames()
    stems: dict[str, str] = {}  # tensor name -> file path without suffix
    tensor_files: dict[str, str] = {}  # tensor name -> file written
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    kept = set(plan.outputs)  # model outputs are always written
    wanted = {loc: [n for n in names if layers_wanted is None or n in kept or layers_wanted(plan.producers.get(n, ""))]
              for loc, names in plan.wanted.items()}
    for spec in plan.inputs:
        stems[spec.name] = f"activations/{file_namer(spec.name)}"
    for tensors in plan.wanted.values():  # every name reserved, so a subset keeps the full run's file names
        for n in tensors:
            stems.setdefault(n, f"activations/{file_namer(n)}")

    writer = None
    if debug == "all":
        writer = ParamsStreamWriter(folder.path("debug/output_tensors.params"), plan.debug_names)
    for spec, arr in zip(plan.inputs, arrays):
        tensor_files[spec.name] = write(stems[spec.name], arr, spec.name, "input")
        shapes[spec.name] = (tuple(arr.shape), str(arr.dtype))
    if writer is not None:
        for spec, arr in zip(plan.inputs, arrays):
            writer.add(spec.name, tvm_tensor(arr))
        for ci, value in enumerate(plan.consts):  # one at a time
            writer.add(f"p{ci}", tvm_tensor(array(value)))

    layers = {p for names in wanted.values() for n in names for p in [plan.producers.get(n)]}
    progress.stage(f"run {len(plan.kernels)} kernels, capture {len(layers)} layers")
    done = [0]
    total = sum(len(v) for v in wanted.values())
    failed: list[BaseException] = []

    def on_output(ki: int, j: int, tensor) -> None:
        try:
            names = wanted.get((ki, j))
            if not names and writer is None:
                return
            arr = vm.to_numpy(tensor)  # a copy: the VM reuses this storage later
            if writer is not None:
                writer.add(plan.kernel_tensor_name(ki, j), tvm_tensor(arr))
            if not names:
                return
            for n in names:
                tensor_files[n] = write(stems[n], arr, n, "activation")
                shapes[n] = (tuple(arr.shape), str(arr.dtype))
                done[0] += 1
                progress.step("layers", done[0], total)
        except (OSError, IrgenError) as err:  # TVM would wrap it in a RuntimeError: keep the original
            failed.append(err)
            raise

    try:
        if plan.program is not None:  # irgen's executor: each kernel's weights read just before it
            vm.run_program(plan.exe, plan.program, plan.kernels, arrays, lambda ci: array(plan.consts[ci]), on_output)
        else:  # fallback: the Relax VM, the weights embedded in the library
            vm.run(plan.exe, arrays, plan.kernels, on_output)
    except Exception:
        if failed:
            raise failed[0] from None
        raise
    if writer is not None:
        writer.close()
    if debug != "none":
        folder.path("debug/_tvmdbg_graph_dump.json").write_text(json.dumps(plan.debug_graph, indent=1) + "\n")
    for (ki, j), names in plan.wanted.items():  # tensors not written still have their shape in ir.json
        for n in names:
            shapes.setdefault(n, plan.kernels[ki].out_types[j])
    return tensor_files, shapes


def _write_params(plan: Plan, write) -> dict[tuple[int, str], dict[str, Any]]:
    """Write every layer's parameter files; their records by (layer index, role). Layers of
    one op that hold the same array in one role (the steps of a recurrent layer: one
    weight for every step) share its file, each record under its own name, when files are
    ``.npy`` or a backend's ``write_tensor`` (``--compress`` and ``store_tensor`` name a file's
    tensors: one file per record there)."""
    param_namer = SafeNames()
    out: dict[tuple[int, str], dict[str, Any]] = {}
    written: dict[tuple, dict[str, Any]] = {}
    share = not getattr(write, "compress", False) and getattr(getattr(write, "be", None), "store_tensor", None) is None
    for i, (r, params) in enumerate(zip(plan.records, plan.params)):
        for role, value in params.items():  # one array read (from the compile cache) at a time
            same = (str(value.path) if isinstance(value, Stored) else id(value), role, r["op"]) if share else None
            if same in written:
                out[(i, role)] = {**written[same], "name": f"{r['name']}.{role}"}
                continue
            arr = array(value)
            stem = param_namer(f"{r['name']}.{role}")
            layout = param_layout(r, role, arr)
            fname = write(f"parameters/{stem}", arr, f"{r['name']}.{role}", "parameter", role=role, layout=layout,
                          op=r["op"], layer=r["name"])
            rec = {"name": f"{r['name']}.{role}", "shape": list(arr.shape), "dtype": str(arr.dtype), "layout": layout,
                   "file": fname}
            if fname in write.storage:
                rec["storage"] = write.storage[fname]
            out[(i, role)] = rec
            if same is not None:
                written[same] = rec
            spill.release(arr)
    return out


class SharedParams:
    """The parameter files of one plan, written once (into the first sample's folder of
    ``irgen run --inputs``) and hard-linked into every other sample's folder: the same
    bytes and records as if each sample had written them, without the copies."""

    def __init__(self, plan: Plan, write) -> None:
        self.folder = write.folder.tmp
        self.records = _write_params(plan, write)
        self.manifest = {rel: dict(v) for rel, v in write.manifest.items() if rel.startswith("parameters/")}
        self.storage = {rel: v for rel, v in write.storage.items() if rel.startswith("parameters/")}
        # each file's sha256 for every sample's manifest.json, hashed once (a link is the same file)
        self.digests = {file_identity((self.folder / rel).stat()): sha256_file(self.folder / rel)
                        for rel in self.manifest}

    def link_into(self, write) -> dict[tuple[int, str], dict[str, Any]]:
        """Put the parameter files into ``write``'s folder (linked; copied where the file
        system cannot link) and record them in its manifest and storage."""
        import shutil

        target = write.folder.tmp
        if target.resolve() != self.folder.resolve():
            for rel in self.manifest:
                dst = write.folder.path(rel)
                try:
                    os.link(self.folder / rel, dst)
                except OSError:
                    shutil.copyfile(self.folder / rel, dst)
        write.manifest.update({rel: dict(v) for rel, v in self.manifest.items()})
        write.storage.update(self.storage)
        return self.records  # read only, as every record an output is built from


def output_records(plan: Plan, tensor_files, shapes, write, shared: SharedParams | None = None
                   ) -> tuple[list[dict], dict[str, str], dict[str, dict]]:
    """Write the parameter files (or link the shared ones), then build ``ir.json``'s layer
    records: each of the plan's records with its parameter, input and output tensor records
    (shape, dtype, layout, file, producer). The plan's records are not changed. Returns the
    records, the activation layouts and the parameter records by file."""
    params = shared.link_into(write) if shared is not None else _write_params(plan, write)
    layouts = tensor_layouts(plan.records, shapes)

    def tensors(names: list[str], producer) -> list[dict[str, Any]]:
        return [tensor_record(n, shapes, tensor_files, layouts, producer(n), write.storage) for n in names]

    by_layer: dict[int, dict[str, dict]] = {}
    for (i, role), rec in params.items():
        by_layer.setdefault(i, {})[role] = rec
    records = [{**r, "params": {**r["params"], **by_layer.get(i, {})},
                "inputs": tensors(r["inputs"], lambda n: plan.producers.get(n, "input")),
                "outputs": tensors(r["outputs"], lambda n, layer=r["name"]: layer)}
               for i, r in enumerate(plan.records)]
    return records, layouts, {rec["file"]: rec for rec in params.values()}


def write_output(host, plan: Plan, arrays: list[np.ndarray], folder: OutputFolder, model: Path, model_sha: str,
                 be: Backend, sers: list, options: dict[str, Any], command: list[str] | None,
                 progress: Progress, shared: SharedParams | None = None) -> tuple[dict[str, Any], dict]:
    """Capture ``plan`` on ``arrays`` into ``folder`` (entered): activations, parameters,
    ``graph/``, ``debug/``, ``ir.json`` and the other serializers' files, ``manifest.json``.
    Returns the IR dict and the manifest's file records."""
    tvm = tvm_version()
    folder.path("graph/model.relax.txt").write_text(plan.model_script)
    write = TensorWriter(folder, be, host.backends, plan.records, plan.static_shapes, bool(options.get("compress")))
    patterns = options.get("layers") or []
    chosen = (lambda layer: any(fnmatch.fnmatchcase(layer, p) for p in patterns)) if patterns else None
    tensor_files, shapes = capture(folder, plan, arrays, write, progress, options.get("debug") or "layers", chosen)

    progress.stage("write IR and parameters")
    records, layouts, params = output_records(plan, tensor_files, shapes, write, shared)
    ir = {
        "ir_version": IR_VERSION,
        "producer": {
            "irgen": __version__,
            "tvm": tvm,
            "frontend": plan.frontend,
            "quantizer": plan.scheme,
            "backend": be.name,
            "serializer": "json",
            "serializers": [ser.name for ser in sers],
            "opt_level": plan.opt_level,
        },
        "model": {"path": str(model), "sha256": model_sha},
        "inputs": [tensor_record(s.name, shapes, tensor_files, layouts, "input", write.storage)
                   for s in plan.inputs],
        "outputs": [{**tensor_record(t, shapes, tensor_files, layouts, plan.producers.get(t, "input"), write.storage),
                     **({"source": plan.output_names[k]} if k < len(plan.output_names) else {})}
                    for k, t in enumerate(plan.outputs)],
        "layers": records,
    }
    shape_dtype = {
        "inputs": {s.name: {"shape": list(s.shape), "dtype": s.dtype} for s in plan.inputs},
        "params": {p["name"]: {"shape": p["shape"], "dtype": p["dtype"], "file": p["file"]}
                   for p in params.values()},
    }
    folder.path("graph/shape_dtype.json").write_text(json.dumps(shape_dtype, indent=1) + "\n")
    serialize(host, sers, ir, folder)
    write_manifest(
        folder,
        {
            "irgen": __version__,
            "tvm": tvm,
            "python": sys.version.split()[0],
            "plugins": {kind: {n: reg.owner(n) for n in reg.names()} for kind, reg in host.registries.items()},
            "command": shlex.join(command) if command else None,
            "cwd": str(Path.cwd()),
            "model": ir["model"],
            "frontend_options": frontend_options(options, host),
            "key": plan.keyed,  # what the compile was keyed on (irgen.runkey): the sweep's resume checks it
        },
        write.manifest,
        shared.digests if shared is not None else None,
    )
    return ir, write.manifest


class SampleFolder:
    """One sample's folder inside the output folder of ``irgen run --inputs``."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)

    def path(self, rel: str) -> Path:
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p


def serialize(host, sers: list, ir: dict[str, Any], folder: OutputFolder) -> None:
    """``ir.json``, the canonical IR that verify and inspect read, and beside it what each
    other serializer writes: new files in the output folder, never ``ir.json`` or a file
    that irgen or another serializer wrote."""
    def snapshot() -> dict[Path, tuple[int, int]]:
        return {p: (st.st_size, st.st_mtime_ns) for p in folder.tmp.rglob("*") if (st := p.lstat())}

    root = folder.tmp.resolve()
    for ser in sers:
        if ser.write is write_json:
            continue
        before = snapshot()
        # a plugin gets its own copy: the records share their parts with the plan's (and other samples')
        wrote = call_plugin(host.serializers, ser.name, "write the IR", ser.write, copy.deepcopy(ir), folder.tmp) or []
        for p in wrote:
            if not Path(p).resolve().is_relative_to(root):
                raise IrgenError(f"serializer {ser.name!r} wrote {p}, outside the output folder")
        after = snapshot()
        changed = sorted(str(p.relative_to(folder.tmp)) for p, sig in before.items() if after.get(p) != sig)
        if (folder.tmp / "ir.json").exists():
            changed.insert(0, "ir.json")
        if changed:
            raise IrgenError(f"serializer {ser.name!r} wrote over {', '.join(changed[:5])}: ir.json (the canonical "
                             "IR) and the files before it are irgen's; a serializer writes new files beside them")
    write_json(ir, folder.tmp)


#: the core options ``irgen verify`` needs to load the model again as ``irgen run`` did;
#: plugins add theirs (``Option(record=True)``)
FRONTEND_OPTIONS = ("input_shapes", "allow_pickle")


def frontend_options(options: dict[str, Any], host=None) -> dict[str, Any]:
    """The options of a run the source check needs, as JSON (recorded in ``manifest.json``):
    the core ones and every plugin option registered with ``record=True``."""
    kinds = {name: opt.kind for name, opt in host.options.items() if opt.record} if host is not None else {}
    rec: dict[str, Any] = {}
    for key in (*FRONTEND_OPTIONS, *kinds):
        v = options.get(key)
        if v in (None, False, {}, []):
            continue
        if key == "input_shapes":
            v = {k: [int(d) for d in dims] for k, dims in v.items()}
        elif kinds.get(key) == "path":
            v = str(Path(v).resolve())
        elif isinstance(v, Path):
            v = str(v)
        rec[key] = v
    return rec


def write_npy(path_without_suffix: Path, arr: np.ndarray) -> Path:
    """``np.save``'s bytes, written with Python's own file write: a full disk is an
    ``OSError`` that says so (numpy's ``tofile`` reports only the byte counts)."""
    path = path_without_suffix.with_name(path_without_suffix.name + ".npy")
    arr = np.asanyarray(arr)
    header = np.lib.format.header_data_from_array_1_0(arr)
    if arr.flags.c_contiguous:
        data = arr
    elif arr.flags.f_contiguous:  # np.save writes a Fortran-ordered array as is
        data = arr.T
    else:
        data = np.ascontiguousarray(arr)
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        # as bytes: a dtype the buffer protocol lacks (ml_dtypes' bfloat16, '<V2' in the header) too
        f.write(memoryview(data.reshape(-1).view(np.uint8)) if data.size else b"")
    return path


def tensor_record(name: str, shapes, files, layouts, producer, storage=None) -> dict[str, Any]:
    shape, dtype = shapes.get(name, ((), None))
    rec = {"name": name, "shape": list(shape), "dtype": dtype, "layout": layouts.get(name), "file": files.get(name),
           "producer": producer}
    if files.get(name) in (storage or {}):
        rec["storage"] = storage[files[name]]
    return rec


def _npy_byte_order(dtype: np.dtype) -> str:
    """The byte order of ``dtype``'s values in a ``.npy`` file: ``little`` or ``big``."""
    order = np.dtype(dtype).byteorder
    if order in ("=", "|"):
        return sys.byteorder
    return "big" if order == ">" else "little"


def tvm_version() -> str:
    """TVM's version, without importing it when it is not loaded (a run from the compile cache)."""
    if "tvm" in sys.modules:
        return sys.modules["tvm"].__version__
    import importlib.metadata

    try:
        return importlib.metadata.version("apache-tvm")
    except importlib.metadata.PackageNotFoundError:  # a source build
        import tvm

        return tvm.__version__
