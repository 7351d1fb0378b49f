"""``irgen run``: the claims' three steps on Relax, end to end.

1. import the model (frontend plugin) -> ``graph/model.relax.txt``, ``graph/shape_dtype.json``
2. compile at ``--opt-level`` and run with the VM instrument -> ``debug/``
3. form layers (backend's fusion rules) -> ``ir.json``, ``parameters/``, ``activations/``

Every tensor is written as the VM produces it; the output folder appears
complete or not at all.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from irgen import __version__, runkey, schedule, share, spill, target
from irgen.api import (Backend, ImportedModel, InputSpec, IrgenError, Quantizer, StoredTensor, TensorInfo,
                       UnsupportedOpsError)
from irgen.names import SafeNames
from irgen.output import file_identity, OutputFolder, ParamsStreamWriter, Progress, sha256_file, write_manifest
from irgen.plan import array, Plan, PLAN_FORMAT, PlanKernel
from irgen.plugins import call_plugin
from irgen.safeio import (check_tensor_size, DEFAULT_MAX_TENSOR_BYTES, file_or_folder, load_npy, recording_reads,
                          regular_tree)
from irgen.schema import IR_VERSION
from irgen.serializers import write_json


def parse_input_shapes(specs: list[str], limit: int | None = None) -> dict[str, tuple[int, ...]]:
    """``--input-shape NAME=D1,D2,...`` values; every dimension a positive integer, and the
    element count within ``limit`` bytes even at one byte per element."""
    shapes = {}
    for spec in specs:
        name, sep, dims = spec.rpartition("=")
        try:
            if not sep or not name:
                raise ValueError
            shape = tuple(int(d) for d in dims.split(","))
        except ValueError:
            raise IrgenError(f"--input-shape {spec!r}: expected NAME=D1,D2,...") from None
        if any(d <= 0 for d in shape):
            raise IrgenError(f"--input-shape {spec!r}: every dimension must be a positive integer")
        if name in shapes:
            raise IrgenError(f"--input-shape {spec!r}: input {name!r} is given twice")
        check_tensor_size(f"--input-shape {name}", shape, "int8", limit)
        shapes[name] = shape
    return shapes


def check_inputs(specs: list[InputSpec], shapes: dict[str, tuple[int, ...]], limit: int | None) -> None:
    """Every ``--input-shape`` names an input of the model and was honoured; every input fits ``limit``."""
    declared = {s.name: s for s in specs}
    listing = ", ".join(f"{s.name} {list(s.shape)}" for s in specs) or "none"
    for name, shape in shapes.items():
        if name not in declared:
            raise IrgenError(f"--input-shape {name}=...: the model has no input {name!r} (inputs: {listing})")
        if tuple(declared[name].shape) != tuple(shape):
            raise IrgenError(f"--input-shape {name}={','.join(map(str, shape))}: input {name!r} has the fixed "
                             f"shape {list(declared[name].shape)}")
    for s in specs:
        check_tensor_size(f"input {s.name!r}", s.shape, s.dtype, limit)


def quantize_input(x: np.ndarray, spec: InputSpec) -> np.ndarray:
    """A float input file for an integer input that has a scale and zero point: quantized
    the way a user does before calling the source runtime (ties to even, clipped)."""
    scale, zero_point = spec.quantization
    info = np.iinfo(spec.dtype)
    q = np.round(x.astype(np.float64) / float(scale)) + int(zero_point)
    return np.clip(q, info.min, info.max).astype(spec.dtype)


def load_inputs(specs: list[InputSpec], given: list[str], seed: int,
                limit: int | None = DEFAULT_MAX_TENSOR_BYTES,
                arrays: dict[str, tuple[np.ndarray, str]] | None = None) -> list[np.ndarray]:
    """The model's input arrays: from ``--input`` files (or ``arrays``: input name ->
    (array, where it came from)), else seeded random data."""
    files: dict[str, Path] = {}
    for item in given:
        name, sep, file = item.partition("=")
        if sep and not Path(item).exists():
            if name not in {s.name for s in specs}:
                raise IrgenError(f"--input {item!r}: the model has no input {name!r} (inputs: {', '.join(s.name for s in specs)})")
            files[name] = Path(file)
        else:
            if len(specs) != 1:
                raise IrgenError(f"--input {item!r}: the model has {len(specs)} inputs; give NAME=FILE for each")
            files[specs[0].name] = Path(item)
    rng = np.random.default_rng(seed)
    out = []
    for s in specs:
        if s.name in files:
            out.append(_checked_input(load_npy(files[s.name], "--input", limit), s, f"--input {files[s.name]}"))
        elif arrays and s.name in arrays:
            out.append(_checked_input(arrays[s.name][0], s, arrays[s.name][1]))
        elif np.issubdtype(np.dtype(s.dtype), np.floating):
            out.append(rng.random(s.shape, dtype=np.float32).astype(s.dtype))
        elif np.issubdtype(np.dtype(s.dtype), np.integer):
            info = np.iinfo(s.dtype)
            out.append(rng.integers(max(info.min, -128), min(info.max, 127), s.shape, endpoint=True).astype(s.dtype))
        elif s.dtype == "bool":
            out.append(rng.random(s.shape) < 0.5)
        else:
            raise IrgenError(f"input {s.name!r}: cannot generate data of dtype {s.dtype}; give --input")
    return out


def _check_form(shape: tuple[int, ...], dtype: np.dtype, s: InputSpec, what: str) -> None:
    """Data of ``shape`` and ``dtype`` can be input ``s``: its shape, and its dtype or a float
    one for an integer input that has a scale (quantized on reading: :func:`quantize_input`)."""
    if tuple(shape) != tuple(s.shape):
        raise IrgenError(f"{what}: shape {tuple(shape)} does not match input {s.name!r} shape {tuple(s.shape)}")
    if str(dtype) != s.dtype and not (s.quantization and dtype.kind == "f" and np.dtype(s.dtype).kind in "iu"):
        raise IrgenError(f"{what}: dtype {dtype} does not match input {s.name!r} dtype {s.dtype}")


def _checked_input(arr: np.ndarray, s: InputSpec, what: str) -> np.ndarray:
    """``arr`` as input ``s``: its shape, its dtype (a float array quantized for an integer
    input that has a scale), finite values; C order, 0-d kept 0-d."""
    _check_form(arr.shape, arr.dtype, s, what)
    if str(arr.dtype) != s.dtype and np.isfinite(arr).all():
        arr = quantize_input(arr, s)
    if str(arr.dtype) != s.dtype:
        raise IrgenError(f"{what}: dtype {arr.dtype} does not match input {s.name!r} dtype {s.dtype}")
    if arr.dtype.kind in "fc" and not np.isfinite(arr).all():
        bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
        raise IrgenError(
            f"{what}: input {s.name!r} holds {bad} NaN/Inf values; TVM's kernels and the source "
            f"runtimes treat them differently (max, min, relu, pooling), so such golden data would not "
            f"match: give finite input")
    return np.array(arr, order="C")


def pick_frontend(host, model: Path, name: str | None):
    if name:
        return host.frontends.get(name)
    for _, fe in host.frontends.items():
        if fe.claims_file(model):
            return fe
    known = ", ".join(f"{n} ({', '.join(f.suffixes)})" for n, f in host.frontends.items()) or "none installed"
    raise IrgenError(f"{model}: no installed frontend reads this file (installed: {known}); the other model "
                     "formats are extras, see the README's Install section, or --frontend NAME")


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


def run_options(args) -> dict[str, Any]:
    """The options of ``irgen run``'s parsed command line as :func:`run` takes them: every
    option, a plugin's too (frontends read theirs, e.g. ``model_class``, from here), with
    ``cache`` and the parsed ``input_shapes``."""
    options = {k: v for k, v in vars(args).items() if k not in ("func", "command", "host")}
    options["cache"] = not options.pop("no_cache", False)
    options["input_shapes"] = parse_input_shapes(getattr(args, "input_shape", []) or [],
                                                 options.get("max_tensor_bytes", DEFAULT_MAX_TENSOR_BYTES))
    return options


def run_cli(args, host) -> int:
    options = run_options(args)
    if getattr(args, "inputs", None) is not None:
        if args.input:
            raise IrgenError("--input and --inputs: give one sample with --input or many with --inputs, not both")
        run_many(host, model=Path(args.model), out=Path(args.output), samples_from=Path(args.inputs), jobs=args.jobs,
                 opt_level=args.opt_level, frontend=args.frontend, backend=args.backend,
                 serializer=args.serializer or ["json"], quantizer=getattr(args, "quantizer", None), force=args.force,
                 progress=Progress(enabled=not args.no_progress), options=options,
                 command=["irgen", *sys.argv[1:]])
        return 0
    if getattr(args, "jobs", None) is not None:
        raise IrgenError("-j/--jobs: only with --inputs (one sample runs in one process)")
    run(
        host,
        model=Path(args.model),
        out=Path(args.output),
        inputs=args.input,
        opt_level=args.opt_level,
        frontend=args.frontend,
        backend=args.backend,
        serializer=args.serializer or ["json"],
        quantizer=getattr(args, "quantizer", None),
        force=args.force,
        seed=args.seed,
        progress=Progress(enabled=not args.no_progress),
        options=options,
        command=["irgen", *sys.argv[1:]],
    )
    return 0


@dataclass
class _Graph:
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
class _Names:
    """Layer names (by layer index), IR tensor names (by Relax var) and var aliases."""

    layer: dict[int, str]
    tensor: dict[str, str]
    aliases: dict[str, str]


def _form_layers(host, imported: ImportedModel, be: Backend, quantizer: str | None, progress: Progress) -> _Graph:
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
    qg = QGraph(mod, frontend=imported.frontend, dialect=imported.dialect, ranges=dict(imported.quant_ranges))
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

        mod = flatten_tuples(static_shapes(mod), imported.provenance)
        mod = canonicalize(fold_data_movement(mod), imported.provenance)
    func, bindings = main_bindings(fold_constants(mod))
    check_gather_indices(bindings, imported.provenance)  # indices folding made constant
    main_out = func.body.body
    if scheme is not None:
        layers = merge_quantized_rolls(cut_layers(bindings, imported.provenance, main_out), bindings, main_out)
        by_name = {b.name: b for b in bindings}
        quants = {l.index: _layer_quant(l.members, quant, by_name) for l in layers}
        layers = fuse_quantized_layers(layers, bindings, be.fusion_rules, quants, main_out)
    else:
        layers = form_layers(bindings, be.fusion_rules, imported.provenance, main_out)
    return _Graph(mod, func, bindings, main_out, layers, {b.name: b for b in bindings}, quant, scheme)


def _name(graph: _Graph, imported: ImportedModel) -> _Names:
    """Layers after their anchor's source node, tensors after the source tensors."""
    layer_namer = SafeNames()
    prov = imported.provenance.by_var
    layer_names: dict[int, str] = {}
    merged = imported.provenance.merged
    for layer in graph.layers:
        src = next((prov[m] for m in layer.members if m in prov), None)
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
    aliases = _alias_map(graph.bindings)
    for alias, target in aliases.items():
        if target in tensor_name:
            tensor_name[alias] = tensor_name[target]
    return _Names(layer_names, tensor_name, aliases)


def _layer_quant(members: list[str], quant: dict[str, dict], by_name: dict | None = None) -> dict | None:
    """The ``quant`` record of the layer of ``members``: its last member's that has one; for
    exact rotations merged into one layer (a quantized roll), an ``integer`` record of them."""
    q = next((quant[m] for m in reversed(members) if m in quant), None)
    if q is not None and by_name is not None:
        from irgen.ir import quantized_roll

        q = quantized_roll(q, [by_name[m] for m in members]) or q
    return q


def _layer_records(graph: _Graph, imported: ImportedModel, names: _Names, be: Backend) -> list:
    """One :class:`irgen.ir.LayerRecord` per layer; every op the backend lacks, at once."""
    from irgen.ir import build_layer_record

    records = []
    for layer in graph.layers:
        q = _layer_quant(layer.head or layer.members, graph.quant, graph.by_name)
        # followers a fusion rule added: with their own requantization, one quant record per step;
        # exact integer ones run their ops after the scheme's
        steps = [_layer_quant(s, graph.quant, graph.by_name) for s in layer.steps] if layer.steps else None
        if q is not None and layer.head and not steps:
            q = {**q, "fused_after": len(layer.members) - len(layer.head)}
        records.append(build_layer_record(layer, graph.by_name, imported.provenance, names.tensor,
                                          names.layer[layer.index], q, steps=steps))
    if be.supported_ops is not None:
        bad = sorted({rec.record["op"] for rec in records} - set(be.supported_ops))
        if bad:
            raise UnsupportedOpsError(f"backend {be.name!r}", bad)
    return records


def _static_shapes(graph: _Graph, names: _Names) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every tensor of the formed graph by its IR name, from the Relax types."""
    from irgen.graph import tensor_type

    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for v in [*graph.func.params, *(b.var for b in graph.bindings)]:
        t = tensor_type(v)
        if t is not None:
            shapes[names.tensor.get(v.name, v.name)] = t
    return shapes


def _check_backend(graph: _Graph, names: _Names, records: list, be: Backend) -> None:
    """The backend's constraints on the formed layers, before anything is compiled: its
    activation layout and ``check_layer``. Every offending layer is named at once."""
    if not be.layout and be.check_layer is None:
        return
    shapes = _static_shapes(graph, names)
    layouts = _layouts([rec.record for rec in records], shapes)

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
                                      "layout": _param_layout(r, role, a)} for role, a in rec.params.items()}}
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


class _TensorWriter:
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
        self.layouts = _layouts(records, static_shapes)
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
            path = (self.be.write_tensor or _write_npy)(self.folder.path(stem), arr)
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

        from irgen.safeio import npz_member

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


def _compile(graph: _Graph, imported: ImportedModel, names: _Names, records: list, opt_level: int,
             progress: Progress) -> Plan:
    """Compile the formed graph and work out, before any run, which kernel output is each
    layer output, model output and ``debug/`` entry: the plan ``_capture`` runs."""
    from irgen import execute
    from irgen.graph import group_module

    progress.stage(f"compile (opt level {opt_level}: {execute.OPT_LEVELS[opt_level]})")
    layers, aliases = graph.layers, names.aliases
    assignment = {m: l.index for l in layers for m in l.members}
    fn_names = {l.index: "layer_" + names.layer[l.index].replace(".", "_").replace("-", "_") for l in layers}
    exe, kernels, where, program = execute.lower(
        graph.mod, opt_level, lambda m: group_module(m, assignment, fn_names),
        grouping=(tuple(sorted(assignment.items())), tuple(sorted(fn_names.items()))))

    # which kernel output is each layer output / model output
    out_vars = [aliases.get(v, v) for v in _out_vars(graph.main_out)]
    for i, v in enumerate(out_vars):
        if v not in where and f"@out:{i}" in where:
            where[v] = where[f"@out:{i}"]

    def source_of(var: str) -> tuple[int, int] | None:
        return where.get(aliases.get(var, var))

    wanted: dict[tuple[int, int], list[str]] = {}
    producers: dict[str, str] = {}
    for layer, rec in zip(layers, records):
        for o in layer.outputs:
            loc = source_of(o)
            if loc is None:
                raise IrgenError(f"internal: layer {rec.record['name']!r} output {o!r} is not computed by any kernel")
            wanted.setdefault(loc, []).append(names.tensor[o])
            producers.setdefault(names.tensor.get(o, o), rec.record["name"])

    debug = _DebugGraph(graph.func.params, imported.inputs, kernels, where, aliases, [source_of(v) for v in out_vars])
    # the records as JSON reads them back: a plan from the cache gives the same files
    plain = json.loads(json.dumps([rec.record for rec in records]))
    return Plan(
        frontend=imported.frontend,
        scheme=graph.scheme.name if graph.scheme else None,
        opt_level=opt_level,
        inputs=list(imported.inputs),
        output_names=list(imported.output_names),
        model_script=imported.mod.script(show_meta=False),
        records=plain,
        params=[dict(rec.params) for rec in records],
        static_shapes=_static_shapes(graph, names),
        kernels=[PlanKernel(k.callee, list(k.outputs), list(k.out_types), list(k.storage),
                            None if k.arg_types is None else list(k.arg_types), k.symbol) for k in kernels],
        wanted=wanted,
        outputs=[names.tensor.get(v, v) for v in out_vars],
        producers=producers,
        debug_graph=debug.to_json(),
        debug_names=debug.tensor_names(),
        consts=[_ConstValue(c) for c in debug.consts],  # read when needed (the library may not hold them)
        exe=exe,
        program=program,
    )


class _ConstValue:
    """A constant of a freshly compiled plan, as an array when asked (``plan.array``)."""

    __slots__ = ("const",)

    def __init__(self, const) -> None:
        self.const = const

    def load(self) -> np.ndarray:
        """The constant's memory itself (no copy to write it into the compile cache or to
        hand it to a kernel, which only reads it: writable, as DLPack exports only those);
        a copy where numpy cannot view the dtype."""
        try:
            return np.from_dlpack(self.const.value)
        except (TypeError, ValueError, BufferError, RuntimeError):
            return self.const.value.numpy()


#: ``--debug``: what ``debug/`` holds besides the layer outputs in ``activations/``
DEBUG_LEVELS = {
    "none": "no debug/ folder",
    "layers": "debug/_tvmdbg_graph_dump.json, the executed kernel graph (default)",
    "all": "as layers, plus debug/output_tensors.params: every kernel's output, the graph executor's dump",
}


def _capture(folder: OutputFolder, plan: Plan, arrays: list[np.ndarray], write, progress: Progress,
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
            writer.add(spec.name, _tvm_tensor(arr))
        for ci, value in enumerate(plan.consts):  # one at a time
            writer.add(f"p{ci}", _tvm_tensor(array(value)))

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
                writer.add(plan.kernel_tensor_name(ki, j), _tvm_tensor(arr))
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
    """Write every layer's parameter files; their records by (layer index, role)."""
    param_namer = SafeNames()
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for i, (r, params) in enumerate(zip(plan.records, plan.params)):
        for role, value in params.items():  # one array read (from the compile cache) at a time
            arr = array(value)
            stem = param_namer(f"{r['name']}.{role}")
            layout = _param_layout(r, role, arr)
            fname = write(f"parameters/{stem}", arr, f"{r['name']}.{role}", "parameter", role=role, layout=layout,
                          op=r["op"], layer=r["name"])
            rec = {"name": f"{r['name']}.{role}", "shape": list(arr.shape), "dtype": str(arr.dtype), "layout": layout,
                   "file": fname}
            if fname in write.storage:
                rec["storage"] = write.storage[fname]
            out[(i, role)] = rec
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
        return {k: json.loads(json.dumps(v)) for k, v in self.records.items()}


def _complete_records(plan: Plan, records: list[dict], tensor_files, shapes, write,
                      shared: SharedParams | None = None) -> dict[str, dict]:
    """Write the parameter files (or link the shared ones) and fill each record's params,
    inputs and outputs (shapes, dtypes, layouts, files, producers); returns the layouts and
    the parameter records by file."""
    params = shared.link_into(write) if shared is not None else _write_params(plan, write)
    param_records: dict[str, dict] = {}
    for (i, role), rec in params.items():
        records[i]["params"][role] = rec
        param_records[rec["file"]] = rec
    layouts = _layouts(records, shapes)
    for r in records:
        r["inputs"] = [_tensor_record(n, shapes, tensor_files, layouts, plan.producers.get(n, "input"), write.storage)
                       for n in r["inputs"]]
        r["outputs"] = [_tensor_record(n, shapes, tensor_files, layouts, r["name"], write.storage)
                        for n in r["outputs"]]
    return {"layouts": layouts, "params": param_records}


def run(
    host,
    model: Path,
    out: Path,
    inputs: list[str] = (),
    opt_level: int = 3,
    frontend: str | None = None,
    backend: str = "generic",
    serializer: str | list[str] | tuple[str, ...] = ("json",),
    quantizer: str | None = None,
    force: bool = False,
    seed: int = 0,
    progress: Progress | None = None,
    options: dict[str, Any] | None = None,
    command: list[str] | None = None,
) -> dict[str, Any]:
    """Generate the IR and golden data for ``model`` into ``out``; returns the IR dict.

    Stages: import (frontend) -> form layers (scheme, fusion rules) -> name ->
    layer records -> compile (the plan; from the compile cache when it has it) ->
    capture every activation -> parameters and tensor records -> ``ir.json``,
    ``graph/``, ``manifest.json``. Everything is written into a hidden sibling
    folder that becomes ``out`` only when complete.

    ``options``: besides the plugins' own, ``debug`` (``DEBUG_LEVELS``), ``layers``
    (glob patterns of the layers whose outputs are written), ``cache`` (False: neither
    read nor write the compile cache).
    """
    progress = progress or Progress(enabled=False)
    options = dict(options or {})
    protect = [("the input file", Path(i.partition("=")[2] if "=" in i and not Path(i).exists() else i)) for i in inputs]
    setup = _Setup(host, model, out, opt_level, frontend, backend, serializer, quantizer, force, options, protect)
    fe, be, sers, folder, model_sha = setup.fe, setup.be, setup.sers, setup.folder, setup.model_sha

    # the weights wait on disk beside the output (where its partial folder goes), not in memory
    with spill.weights_on_disk(folder.final.parent):
        plan, arrays = prepare(host, model, setup.key, fe, be, list(inputs), opt_level, quantizer, seed, options,
                               progress)
        with folder:
            ir, files = write_output(host, plan, arrays, folder, model, model_sha, be, sers, options, command, progress)
    progress.done(f"wrote {out} ({len(plan.records)} layers, {len(plan.kernels)} kernels"
                  f"{', compiled model from the cache' if plan.from_cache else ''})")
    return ir


class _Setup:
    """What ``run`` and ``run_many`` check and pick before any model file is read: the
    options, the model path, the frontend, backend and serializers, and the output folder
    (which must not hold the model, the current folder, ``protect``'s paths or a plugin's
    path option); ``options`` gains ``max_tensor_bytes`` and the plugins are configured."""

    def __init__(self, host, model: Path, out: Path, opt_level: int, frontend: str | None, backend: str,
                 serializer, quantizer: str | None, force: bool, options: dict[str, Any],
                 protect: list[tuple[str, Path]]):
        options.setdefault("max_tensor_bytes", DEFAULT_MAX_TENSOR_BYTES)
        debug = options.get("debug") or "layers"
        if debug not in DEBUG_LEVELS:
            raise IrgenError(f"--debug {debug}: must be one of {', '.join(DEBUG_LEVELS)}")
        if file_or_folder(model, "model").is_dir():
            regular_tree(model)  # every file of a folder model, checked before a frontend reads any
        if opt_level not in range(5):
            raise IrgenError(f"--opt-level {opt_level}: must be 0..4")
        self.fe = pick_frontend(host, model, frontend)
        self.be: Backend = host.backends.get(backend)
        names = [serializer] if isinstance(serializer, str) else serializer
        self.sers = [host.serializers.get(n) for n in dict.fromkeys(names)]
        protect = [("the model", model), ("the current folder", Path.cwd()), *protect]
        for name, opt in host.options.items():  # a plugin's file or folder option (e.g. --calibration DIR)
            if opt.kind == "path" and options.get(name):
                protect.append((f"the {opt.flag} path", Path(options[name])))
        host.configure(options)
        self.folder = OutputFolder(out, force, protect)
        self.model_digest = runkey.digest_path(model)
        self.model_sha = self.model_digest.sha256
        self.key = run_key(host, model, opt_level, self.fe.name, self.be.name, quantizer, options, self.model_digest)


def run_key(host, model: Path, opt_level: int, frontend: str | None, backend: str, quantizer: str | None,
            options: dict[str, Any], digest: runkey.PathDigest | None = None) -> runkey.PlanKey:
    """The compile key of ``irgen run MODEL`` with these choices (``frontend`` None: chosen by
    file type; ``digest``: the model's, when hashed already), computed without importing the
    model: the compile cache's entry name, and the sweep's resume fingerprint."""
    options = {"max_tensor_bytes": DEFAULT_MAX_TENSOR_BYTES, **options}
    fe = pick_frontend(host, model, frontend)
    be = host.backends.get(backend)
    return runkey.plan_key(host, model, digest or runkey.digest_path(model), fe.name, be.name, quantizer, opt_level,
                           options, compile_settings())


def compile_settings() -> dict[str, Any]:
    """What the compile steps themselves depend on, for the run's key: the schedule, kernel
    sharing, the target CPU and the plan format."""
    return {"schedule": schedule.key(), "share": share.key(), "target": target.key(), "plan_format": PLAN_FORMAT}


def prepare(host, model: Path, key: runkey.PlanKey, fe, be: Backend, inputs: list[str], opt_level: int,
            quantizer: str | None, seed: int, options: dict[str, Any], progress: Progress
            ) -> tuple[Plan, list[np.ndarray]]:
    """The model's compiled plan (from the compile cache, else import, form layers and
    compile, then store it there) and the input arrays, checked before compiling."""
    from irgen import cache

    limit = options.get("max_tensor_bytes", DEFAULT_MAX_TENSOR_BYTES)
    use_cache = options.get("cache", True) and cache.enabled()
    plan, note = cache.load(key) if use_cache else (None, None)
    if note:
        progress.stage(f"compile cache: {note}")
    if plan is not None:
        progress.stage(f"compiled model from the cache ({cache.folder()})")
        check_inputs(plan.inputs, options.get("input_shapes") or {}, limit)
        return plan, load_inputs(plan.inputs, inputs, seed, limit)

    progress.stage(f"import {model.name} ({fe.name} frontend)")
    with recording_reads() as reads:  # the files the import reads besides the model: the key's dependencies
        imported: ImportedModel = call_plugin(host.frontends, fe.name, "import", fe.load, model, options)
    if imported.dialect is None:
        imported.dialect = fe.quant_dialect
    check_inputs(imported.inputs, options.get("input_shapes") or {}, limit)
    arrays = load_inputs(imported.inputs, inputs, seed, limit)
    with recording_reads(reads):  # weights an import left on disk are read while compiling
        plan = build_plan(host, imported, be, quantizer, opt_level, limit, progress)
    plan.frontend = fe.name  # the plugin that read the file (ir.json's producer), whoever's importer it used
    plan.keyed = {"key": key.digest, "depends": runkey.dependencies(reads, imported.code_modules, key.paths)}
    request = {"model": str(model.resolve()), "frontend": fe.name, "backend": be.name, "quantizer": quantizer,
               "opt_level": opt_level, "options": _request_options(options, key)}
    library = cache.library(key) if use_cache and cache.store(key, plan, request) else None
    if library is not None:
        # run the stored library and read the stored arrays, as the next run will: its machine
        # code is generated once (for the file), not a second time by the JIT, and the compile's
        # copies of the weights can go
        from irgen import execute, vm

        plan.exe = vm.load_library(library)
        plan.use_stored(library.parent)
        execute.forget()
    return plan, arrays


def _request_options(options: dict[str, Any], key: runkey.PlanKey) -> dict[str, Any]:
    """The run's keyed options as given (a file or folder option as its absolute path), for
    ``irgen cache verify``."""
    out = {}
    for k, keyed in key.doc["options"].items():
        out[k] = keyed["path"] if isinstance(keyed, dict) and "path" in keyed \
            else json.loads(json.dumps(options[k], default=str))
    return out


def build_plan(host, imported: ImportedModel, be: Backend, quantizer: str | None, opt_level: int,
               limit: int | None, progress: Progress) -> Plan:
    """Form layers (scheme, fusion rules), name them, check the backend's constraints,
    compile: the plan that captures golden data for any input."""
    from irgen.graph import check_tensor_sizes, module_bindings

    # before constant folding allocates anything
    check_tensor_sizes(module_bindings(imported.mod), limit, imported.provenance)
    graph = _form_layers(host, imported, be, quantizer, progress)
    check_tensor_sizes(graph.bindings, limit, imported.provenance)
    names = _name(graph, imported)
    records = _layer_records(graph, imported, names, be)
    _check_backend(graph, names, records, be)
    return _compile(graph, imported, names, records, opt_level, progress)


def write_output(host, plan: Plan, arrays: list[np.ndarray], folder: OutputFolder, model: Path, model_sha: str,
                 be: Backend, sers: list, options: dict[str, Any], command: list[str] | None,
                 progress: Progress, shared: SharedParams | None = None) -> tuple[dict[str, Any], dict]:
    """Capture ``plan`` on ``arrays`` into ``folder`` (entered): activations, parameters,
    ``graph/``, ``debug/``, ``ir.json`` and the other serializers' files, ``manifest.json``.
    Returns the IR dict and the manifest's file records."""
    tvm_version = _tvm_version()
    records = json.loads(json.dumps(plan.records))  # this output's copy: completing fills in files
    folder.path("graph/model.relax.txt").write_text(plan.model_script)
    write = _TensorWriter(folder, be, host.backends, records, plan.static_shapes, bool(options.get("compress")))
    patterns = options.get("layers") or []
    chosen = (lambda layer: any(fnmatch.fnmatchcase(layer, p) for p in patterns)) if patterns else None
    tensor_files, shapes = _capture(folder, plan, arrays, write, progress, options.get("debug") or "layers", chosen)

    progress.stage("write IR and parameters")
    done = _complete_records(plan, records, tensor_files, shapes, write, shared)
    layouts = done["layouts"]
    ir = {
        "ir_version": IR_VERSION,
        "producer": {
            "irgen": __version__,
            "tvm": tvm_version,
            "frontend": plan.frontend,
            "quantizer": plan.scheme,
            "backend": be.name,
            "serializer": "json",
            "serializers": [ser.name for ser in sers],
            "opt_level": plan.opt_level,
        },
        "model": {"path": str(model), "sha256": model_sha},
        "inputs": [_tensor_record(s.name, shapes, tensor_files, layouts, "input", write.storage)
                   for s in plan.inputs],
        "outputs": [_tensor_record(t, shapes, tensor_files, layouts, plan.producers.get(t, "input"), write.storage)
                    for t in plan.outputs],
        "layers": records,
    }
    for o, name in zip(ir["outputs"], plan.output_names):
        o["source"] = name
    shape_dtype = {
        "inputs": {s.name: {"shape": list(s.shape), "dtype": s.dtype} for s in plan.inputs},
        "params": {p["name"]: {"shape": p["shape"], "dtype": p["dtype"], "file": p["file"]}
                   for p in done["params"].values()},
    }
    folder.path("graph/shape_dtype.json").write_text(json.dumps(shape_dtype, indent=1) + "\n")
    _serialize(host, sers, ir, folder)
    write_manifest(
        folder,
        {
            "irgen": __version__,
            "tvm": tvm_version,
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


class _SampleFolder:
    """One sample's folder inside the output folder of ``irgen run --inputs``."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)

    def path(self, rel: str) -> Path:
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p


#: the samples of ``irgen run --inputs`` may hold this many times ``--max-tensor-bytes`` together
SAMPLES_TOTAL_FACTOR = 4

#: one sample's arrays before their data is read: input name -> (file, array name in a
#: ``.npz`` or None for a ``.npy``, the array's header)
_Headers = dict[str, tuple[Path, "str | None", Any]]


def read_samples(source: Path, specs: list[InputSpec], limit: int | None
                 ) -> list[tuple[str, dict[str, tuple[np.ndarray, str]]]]:
    """``--inputs``: (sample name, input name -> (array, where it came from)) per sample,
    sorted by name.

    A folder holds one sample per ``.npy`` file (a one-input model) or per ``.npz`` file
    (its arrays named after the model's inputs); a ``.npz`` file holds one sample per
    array (a one-input model). Every array's header is read and checked against its input
    (shape, dtype) first, and the samples' total size against ``SAMPLES_TOTAL_FACTOR``
    times ``limit``, before any data is read or decompressed; two samples that would be
    written to one folder are refused."""
    from irgen.safeio import load_npy, load_npz

    samples = _sample_headers(source, specs, limit)
    _check_samples(source, samples, specs, limit)
    arrays: dict[tuple[Path, str | None], np.ndarray] = {}
    for file in sorted({f for _, headers in samples for f, _, _ in headers.values()}):
        wanted = {a: h for _, headers in samples for f, a, h in headers.values() if f == file}
        if None in wanted:
            arrays[(file, None)] = load_npy(file, "--inputs", limit, expect=wanted[None])
        else:
            arrays.update(((file, a), arr) for a, arr in load_npz(file, "--inputs", limit, expect=wanted).items())
    return [(name, {i: (arrays[(f, a)], _sample_where(f, a)) for i, (f, a, _) in headers.items()})
            for name, headers in samples]


def _sample_where(file: Path, array: str | None) -> str:
    return f"--inputs {file}" + ("" if array is None else f" array {array!r:.100}")


def _sample_headers(source: Path, specs: list[InputSpec], limit: int | None) -> list[tuple[str, _Headers]]:
    """(sample name, its arrays' headers) per sample of ``--inputs``, sorted by name; no data read."""
    from irgen.safeio import npy_header, npz_headers

    names = [s.name for s in specs]
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if p.suffix in (".npy", ".npz") and not p.name.startswith("."))
        if not files:
            raise IrgenError(f"--inputs {source}: no .npy or .npz files")
        samples: list[tuple[str, _Headers]] = []
        for p in files:
            if p.suffix == ".npy":
                if len(specs) != 1:
                    raise IrgenError(f"--inputs {p}: the model has {len(specs)} inputs ({', '.join(names)}); give "
                                     "one .npz per sample with an array named after each")
                samples.append((p.stem, {names[0]: (p, None, npy_header(p, "--inputs", limit))}))
                continue
            headers = npz_headers(p, "--inputs", limit, names)
            lacking = [n for n in names if n not in headers]
            if lacking:
                raise IrgenError(f"--inputs {p}: no array named {lacking[0]!r} (the model's inputs: {', '.join(names)})")
            samples.append((p.stem, {n: (p, n, headers[n]) for n in names}))
        return samples
    if source.suffix != ".npz":
        raise IrgenError(f"--inputs {source}: expected a folder of .npy/.npz samples or one .npz file")
    if len(specs) != 1:
        raise IrgenError(f"--inputs {source}: one .npz of samples needs a one-input model (it has {len(specs)})")
    headers = npz_headers(source, "--inputs", limit)
    if not headers:
        raise IrgenError(f"--inputs {source}: the .npz holds no arrays")
    return [(k, {names[0]: (source, k, headers[k])}) for k in sorted(headers)]


def _check_samples(source: Path, samples: list[tuple[str, _Headers]], specs: list[InputSpec],
                   limit: int | None) -> None:
    """Every array fits its input (as :func:`load_inputs` checks one), the samples together
    fit ``SAMPLES_TOTAL_FACTOR * limit`` bytes, and no two share an output folder."""
    from irgen.names import sanitize
    from irgen.safeio import human_bytes

    bound = None if limit is None else SAMPLES_TOTAL_FACTOR * limit
    total, folders = 0, {}
    by_name = {s.name: s for s in specs}
    for k, (name, headers) in enumerate(samples):
        file = next(iter(headers.values()))[0]
        origin = f"{file.name!r:.100}" if source.is_dir() else f"array {name!r:.100}"
        stem = sanitize(name)
        if stem.lower() in folders:  # the output folder OUT/<stem> (case-folding file systems too)
            raise IrgenError(f"--inputs {source}: {folders[stem.lower()]} and {origin} would both be the "
                             f"sample folder {stem!r:.100}; rename one")
        folders[stem.lower()] = origin
        for i, (file, array, h) in headers.items():
            _check_form(h.shape, h.dtype, by_name[i], _sample_where(file, array))
            total += h.nbytes
        if bound is not None and total > bound:
            raise IrgenError(f"--inputs {source}: the first {k + 1} of {len(samples)} samples already hold "
                             f"{human_bytes(total)}, over the limit of {human_bytes(bound)} for all samples together "
                             f"({SAMPLES_TOTAL_FACTOR} x --max-tensor-bytes); raise --max-tensor-bytes if this is "
                             "meant, or give the samples to several runs")


def run_many(host, model: Path, out: Path, samples_from: Path, jobs: int | None = None, opt_level: int = 3,
             frontend: str | None = None, backend: str = "generic", serializer=("json",), quantizer: str | None = None,
             force: bool = False, progress: Progress | None = None, options: dict[str, Any] | None = None,
             command: list[str] | None = None) -> list[str]:
    """``irgen run --inputs``: one complete output per sample under ``out/<sample>/``, with one
    import and compile, on ``jobs`` cores (``None``: all; see :func:`_split_cores`), in worker
    processes; the samples share the parameter files. Each sample's folder holds what
    ``irgen run --input SAMPLE`` writes. Returns the sample names."""
    progress = progress or Progress(enabled=False)
    options = dict(options or {})
    if jobs is not None and jobs < 1:
        raise IrgenError(f"-j {jobs}: must be at least 1")
    setup = _Setup(host, model, out, opt_level, frontend, backend, serializer, quantizer, force, options,
                   [("the --inputs samples", samples_from)])
    fe, be, sers, folder, model_sha = setup.fe, setup.be, setup.sers, setup.folder, setup.model_sha
    file_or_folder(samples_from, "--inputs")
    limit = options["max_tensor_bytes"]

    with spill.weights_on_disk(folder.final.parent):  # as in run()
        plan, _ = prepare(host, model, setup.key, fe, be, [], opt_level, quantizer, 0, options, progress)
        samples = read_samples(samples_from, plan.inputs, limit)
        stems = SafeNames()
        arrays = {stems(name): load_inputs(plan.inputs, [], 0, limit, given) for name, given in samples}  # all checked first
        named = list(arrays)
        workers, threads = _split_cores(jobs, len(named))
        progress.stage(f"capture {len(named)} samples ({workers} worker{'s' if workers > 1 else ''}, "
                       f"{threads} kernel thread{'s' if threads > 1 else ''} each)")

        with folder:
            first = _SampleFolder(folder.tmp / named[0])
            shared = SharedParams(plan, _TensorWriter(first, be, host.backends, json.loads(json.dumps(plan.records)),
                                                      plan.static_shapes, bool(options.get("compress"))))
            quiet = Progress(enabled=False)

            def one(name: str) -> None:
                write_output(host, plan, arrays[name], _SampleFolder(folder.tmp / name), model, model_sha, be, sers,
                             options, command, quiet, shared)

            _in_workers(named, workers, threads, one, progress)
    progress.done(f"wrote {out} ({len(named)} samples, {len(plan.records)} layers each"
                  f"{', compiled model from the cache' if plan.from_cache else ''})")
    return named


def _split_cores(jobs: int | None, samples: int) -> tuple[int, int]:
    """``-j``'s cores as (worker processes, TVM kernel threads in each). ``jobs`` is the cores
    to use (``None``: every core this process may run on); each worker takes one sample at a
    time, and with fewer samples than cores the workers share out the rest as kernel threads.
    ``TVM_NUM_THREADS``, when set, is each worker's thread count. A worker per core is the
    faster split: a sample's file writing and hashing run on one core, so a worker with two
    kernel threads leaves one idle for that part (64 ResNet-18 samples on 2 cores: 152 ms a
    sample as one worker with two threads, 108 ms as two workers). TVM's own default, half
    the cores on x86 for hyper-threading, is not used."""
    if jobs is None:
        try:
            jobs = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            jobs = os.cpu_count() or 1
    workers = max(1, min(jobs, samples))
    given = os.environ.get("TVM_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return workers, int(given)
    return workers, max(1, jobs // workers)


def _in_workers(names: list[str], jobs: int, threads: int, work: Callable[[str], None], progress: Progress) -> None:
    """``work(name)`` for every name in ``jobs`` forked worker processes (the compiled plan
    is inherited, not reloaded), each taking the next name when it is free, with one progress
    line. A worker runs the kernels on a new thread whose TVM thread pool has ``threads``
    workers (TVM keeps a pool per thread: one inherited from the parent through the fork
    would have lost its threads). The first failure stops the others and is raised."""
    import multiprocessing as mp
    import signal
    import threading
    import time

    from irgen import vm

    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    taken = ctx.Value("q", 0)  # names handed out so far

    def next_name() -> str | None:
        with taken.get_lock():
            i = taken.value
            taken.value = i + 1
        return names[i] if i < len(names) else None

    def samples() -> None:
        name = None
        try:
            vm.use_threads(threads)
            while (name := next_name()) is not None:
                work(name)
                queue.put(("done", name, None))
        except BaseException as err:  # noqa: BLE001  reported to the parent, which raises it
            queue.put(("error", name, f"{type(err).__name__}: {err}" if not isinstance(err, IrgenError)
                       else str(err)))

    def worker() -> None:
        # the parent stops a worker with SIGTERM (on an error, or one still exiting when all
        # samples are written): it dies quietly, not through the CLI's handler (a traceback)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        t = threading.Thread(target=samples, name="irgen-samples")
        t.start()
        t.join()
        os._exit(0)  # an error went to the parent, which stops the others

    procs = [ctx.Process(target=worker, daemon=True) for _ in range(jobs)]
    for p in procs:
        p.start()
    done = 0
    try:
        while done < len(names):
            if queue.empty():
                lost = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if (lost or not any(p.is_alive() for p in procs)) and queue.empty():
                    why = f" (exit code {lost[0]})" if lost else ""
                    raise IrgenError(f"--inputs: a worker process died{why}; {done} of {len(names)} samples "
                                     "were written")
                time.sleep(0.02)
                continue
            status, name, message = queue.get()
            if status == "error":
                raise IrgenError(f"--inputs: sample {name!r}: {message}" if name is not None
                                 else f"--inputs: a worker could not start: {message}")
            done += 1
            progress.step("samples", done, len(names))
    finally:
        if done == len(names):  # every sample written: the workers are exiting on their own
            for p in procs:
                p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join()


def _serialize(host, sers: list, ir: dict[str, Any], folder: OutputFolder) -> None:
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
        wrote = call_plugin(host.serializers, ser.name, "write the IR", ser.write, ir, folder.tmp) or []
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


def _write_npy(path_without_suffix: Path, arr: np.ndarray) -> Path:
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
        f.write(memoryview(data.reshape(-1)).cast("B") if data.size else b"")
    return path


def _param_layout(rec: dict, role: str, arr: np.ndarray) -> str | None:
    if role == "weight" and rec["op"] in ("conv2d", "depthwise_conv2d", "conv2d_transpose") and arr.ndim == 4:
        return str(rec["attrs"].get("kernel_layout", "OIHW"))
    if role == "weight" and rec["op"] == "dense":
        return "IO"  # the graph computes x @ W
    if role == "bias" and arr.ndim == 1:
        return "C"  # one value per output channel (ir._uniform_bias)
    return None


def _tensor_record(name: str, shapes, files, layouts, producer, storage=None) -> dict[str, Any]:
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


_LAYOUT_ATTRS = ("out_layout", "data_layout", "layout")


def _layouts(records: list[dict], shapes) -> dict[str, str]:
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


def _alias_map(bindings) -> dict[str, str]:
    """Alias var -> the var it names (transitively)."""
    out: dict[str, str] = {}
    for b in bindings:
        if b.kind == "alias":
            out[b.name] = out.get(b.value.name, b.value.name)
    return out


def _out_vars(expr) -> list[str]:
    from tvm import relax

    if isinstance(expr, relax.Tuple):
        return [f.name for f in expr.fields]
    return [expr.name]


class _DebugGraph:
    """``_tvmdbg_graph_dump.json`` in the graph executor's schema, from the kernel sequence."""

    def __init__(self, params, specs, kernels, where, aliases, heads):
        from irgen.graph import Constant

        self.kernels = kernels
        self.nodes: list[dict[str, Any]] = []
        self.entry_shapes: list[list[int]] = []
        self.entry_dtypes: list[str] = []
        self.entry_storage: list[int] = []
        self.node_of_input: dict[str, int] = {}
        self.consts: list[Any] = []
        self.const_node: list[int] = []
        self.kernel_node: list[int] = []
        storage = 0
        for p, s in zip(params, specs):
            self.node_of_input[p.name] = len(self.nodes)
            self._add({"op": "null", "name": s.name, "inputs": []}, [(list(s.shape), s.dtype, storage)])
            storage += 1
        for k in kernels:
            for a in k.inputs:
                if isinstance(a, Constant) and not any(a.same_as(c) for c in self.consts):
                    self.consts.append(a)
                    arr_ty = a.ty
                    self.const_node.append(len(self.nodes))
                    shape = [int(d) for d in arr_ty.shape.values]
                    self._add({"op": "null", "name": f"p{len(self.consts) - 1}", "inputs": []}, [(shape, str(arr_ty.dtype), storage)])
                    storage += 1
        base = storage
        for ki, k in enumerate(kernels):
            ins = []
            for a in k.inputs:
                if isinstance(a, Constant):
                    ci = next(i for i, c in enumerate(self.consts) if c.same_as(a))
                    ins.append([self.const_node[ci], 0, 0])
                else:
                    a = aliases.get(a, a)
                    if a in self.node_of_input:
                        ins.append([self.node_of_input[a], 0, 0])
                    elif a in where:
                        src_k, j = where[a]
                        ins.append([self.kernel_node[src_k], j, 0])
            self.kernel_node.append(len(self.nodes))
            st = k.storage if len(k.storage) == len(k.outputs) else [-1] * len(k.outputs)
            entries = [(list(s), d, (base + sid) if sid >= 0 else -1) for (s, d), sid in zip(k.out_types, st)]
            self._add(
                {
                    "op": "tvm_op",
                    "name": self.kernel_node_name(ki, None),
                    "attrs": {"func_name": k.symbol, "flatten_data": "0", "num_inputs": str(len(ins)), "num_outputs": str(len(k.outputs))},
                    "inputs": ins,
                },
                entries,
            )
        self.heads = [[self.kernel_node[k], j, 0] for k, j in (h for h in heads if h is not None)]
        # reshape views share their input's storage
        for ki, k in enumerate(kernels):
            if k.callee == "vm.builtin.reshape":
                nid = self.kernel_node[ki]
                src = self.nodes[nid]["inputs"][0] if self.nodes[nid]["inputs"] else None
                if src is not None:
                    self.entry_storage[self.row_ptr[nid]] = self.entry_storage[self.row_ptr[src[0]] + src[1]]

    row_ptr: list[int]

    def _add(self, node: dict[str, Any], entries) -> None:
        if not hasattr(self, "row_ptr"):
            self.row_ptr = [0]
        self.nodes.append(node)
        for shape, dtype, sid in entries:
            self.entry_shapes.append(shape)
            self.entry_dtypes.append(dtype)
            self.entry_storage.append(sid)
        self.row_ptr.append(self.row_ptr[-1] + len(entries))

    def kernel_node_name(self, ki: int, j: int | None) -> str:
        from irgen.plan import kernel_node_name

        k = self.kernels[ki]
        return kernel_node_name(k.callee, len(k.outputs), ki, j)

    def tensor_names(self) -> list[str]:
        names = [n["name"] for n in self.nodes if n["op"] == "null"]
        for ki, k in enumerate(self.kernels):
            names += [self.kernel_node_name(ki, j) for j in range(len(k.outputs))]
        return names

    def leading_tensors(self, inputs):
        for spec_node, arr in zip(self.node_of_input.values(), inputs):
            yield self.nodes[spec_node]["name"], _tvm_tensor(arr)
        for ci, c in enumerate(self.consts):
            yield f"p{ci}", c.value

    def to_json(self) -> dict[str, Any]:
        arg_nodes = [i for i, n in enumerate(self.nodes) if n["op"] == "null"]
        return {
            "nodes": self.nodes,
            "arg_nodes": arg_nodes,
            "heads": self.heads,
            "node_row_ptr": self.row_ptr,
            "attrs": {
                "shape": ["list_shape", self.entry_shapes],
                "dltype": ["list_str", self.entry_dtypes],
                "storage_id": ["list_int", self.entry_storage],
            },
        }


def _tvm_version() -> str:
    """TVM's version, without importing it when it is not loaded (a run from the compile cache)."""
    if "tvm" in sys.modules:
        return sys.modules["tvm"].__version__
    import importlib.metadata

    try:
        return importlib.metadata.version("apache-tvm")
    except importlib.metadata.PackageNotFoundError:  # a source build
        import tvm

        return tvm.__version__


def _tvm_tensor(arr):
    import tvm

    return tvm.runtime.tensor(arr)
