"""``irgen run``: the claims' three steps on Relax, end to end.

1. import the model (frontend plugin) -> ``graph/model.relax.txt``, ``graph/shape_dtype.json``
2. compile at ``--opt-level`` and run with the VM instrument -> ``debug/``
3. form layers (backend's fusion rules) -> ``ir.json``, ``parameters/``, ``activations/``

Every tensor is written as the VM produces it; the output folder appears
complete or not at all. The stages live in their modules: :mod:`irgen.inputs`,
:mod:`irgen.forming`, :mod:`irgen.compile`, :mod:`irgen.capture`, :mod:`irgen.workers`;
this module runs them (:func:`run`, :func:`run_many`, :func:`prepare`) and keys the
compile (:func:`run_key`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from irgen import runkey, schedule, share, spill, target
from irgen.api import Backend, ImportedModel, IrgenError
from irgen.capture import DEBUG_LEVELS, SampleFolder, SharedParams, TensorWriter, write_output
from irgen.compile import build_plan
from irgen.inputs import check_inputs, load_inputs, parse_input_shapes, read_samples
from irgen.names import SafeNames
from irgen.output import OutputFolder, Progress
from irgen.plan import Plan, PLAN_FORMAT
from irgen.plugins import call_plugin
from irgen.safeio import DEFAULT_MAX_TENSOR_BYTES, file_or_folder, recording_reads, regular_tree
from irgen.workers import in_workers, split_cores



def pick_frontend(host, model: Path, name: str | None):
    if name:
        return host.frontends.get(name)
    for _, fe in host.frontends.items():
        if fe.claims_file(model):
            return fe
    known = ", ".join(f"{n} ({', '.join(f.suffixes)})" for n, f in host.frontends.items()) or "none installed"
    raise IrgenError(f"{model}: no installed frontend reads this file (installed: {known}); the other model "
                     "formats are extras, see the README's Install section, or --frontend NAME")


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
        if getattr(args, "decode", None) is not None:
            raise IrgenError("--decode and --inputs: a trace starts from one prompt (--input input_ids=FILE)")
        run_many(host, model=Path(args.model), out=Path(args.output), samples_from=Path(args.inputs), jobs=args.jobs,
                 opt_level=args.opt_level, frontend=args.frontend, backend=args.backend,
                 serializer=args.serializer or ["json"], quantizer=getattr(args, "quantizer", None), force=args.force,
                 progress=Progress(enabled=not args.no_progress), options=options,
                 command=["irgen", *sys.argv[1:]])
        return 0
    if getattr(args, "jobs", None) is not None:
        raise IrgenError("-j/--jobs: only with --inputs (one sample runs in one process)")
    if getattr(args, "decode", None) is not None:
        run_trace(host, args, options)
        return 0
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


def run_trace(host, args, options: dict[str, Any]) -> dict[str, Any]:
    """``irgen run --decode N``: a prefill and N decode steps (:mod:`irgen.decode`), each step
    one :func:`run` with the command's settings and the step's shapes and inputs."""
    from irgen import decode

    model, progress = Path(args.model), Progress(enabled=not args.no_progress)
    fe = pick_frontend(host, model, args.frontend)
    quiet = Progress(enabled=False)

    def step(folder: Path, shapes: dict[str, tuple[int, ...]], arrays) -> None:
        run(host, model=model, out=folder, opt_level=args.opt_level, frontend=fe.name, backend=args.backend,
            serializer=args.serializer or ["json"], quantizer=getattr(args, "quantizer", None), seed=args.seed,
            progress=quiet, options={**options, "input_shapes": shapes}, arrays=arrays,
            command=["irgen", *sys.argv[1:]])

    trace = decode.run_decode(fe, model, Path(args.output), args.decode, step, progress, args.force, args.seed,
                              list(args.input), list(args.input_shape),
                              options.get("max_tensor_bytes", DEFAULT_MAX_TENSOR_BYTES),
                              host.backends.get(args.backend))
    progress.done(f"wrote {args.output} ({len(trace['steps'])} steps: the prefill and {args.decode} decode steps)")
    return trace


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
    arrays: dict[str, tuple[np.ndarray, str]] | None = None,
) -> dict[str, Any]:
    """Generate the IR and golden data for ``model`` into ``out``; returns the IR dict.

    Stages: import (frontend) -> form layers (scheme, fusion rules) -> name ->
    layer records -> compile (the plan; from the compile cache when it has it) ->
    capture every activation -> parameters and tensor records -> ``ir.json``,
    ``graph/``, ``manifest.json``. Everything is written into a hidden sibling
    folder that becomes ``out`` only when complete.

    ``options``: besides the plugins' own, ``debug`` (``DEBUG_LEVELS``), ``layers``
    (glob patterns of the layers whose outputs are written), ``cache`` (False: neither
    read nor write the compile cache). ``arrays``: input name -> (array, where it came from),
    the inputs ``inputs`` does not give.
    """
    progress = progress or Progress(enabled=False)
    options = dict(options or {})
    protect = [("the input file", Path(i.partition("=")[2] if "=" in i and not Path(i).exists() else i)) for i in inputs]
    setup = _Setup(host, model, out, opt_level, frontend, backend, serializer, quantizer, force, options, protect)
    fe, be, sers, folder, model_sha = setup.fe, setup.be, setup.sers, setup.folder, setup.model_sha

    # the weights wait on disk beside the output (where its partial folder goes), not in memory
    with spill.weights_on_disk(folder.final.parent):
        plan, values = prepare(host, model, setup.key, fe, be, list(inputs), opt_level, quantizer, seed, options,
                               progress, arrays)
        with folder:
            ir, files = write_output(host, plan, values, folder, model, model_sha, be, sers, options, command, progress)
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
            quantizer: str | None, seed: int, options: dict[str, Any], progress: Progress,
            given: dict[str, tuple[np.ndarray, str]] | None = None) -> tuple[Plan, list[np.ndarray]]:
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
        return plan, load_inputs(plan.inputs, inputs, seed, limit, given)

    progress.stage(f"import {model.name} ({fe.name} frontend)")
    with recording_reads() as reads:  # the files the import reads besides the model: the key's dependencies
        imported: ImportedModel = call_plugin(host.frontends, fe.name, "import", fe.load, model, options)
    if imported.dialect is None:
        imported.dialect = fe.quant_dialect
    check_inputs(imported.inputs, options.get("input_shapes") or {}, limit)
    arrays = load_inputs(imported.inputs, inputs, seed, limit, given)
    with recording_reads(reads):  # weights an import left on disk are read while compiling
        plan = build_plan(host, imported, be, quantizer, opt_level, limit, progress,
                          accumulate=options.get("accumulate"))
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


def run_many(host, model: Path, out: Path, samples_from: Path, jobs: int | None = None, opt_level: int = 3,
             frontend: str | None = None, backend: str = "generic", serializer=("json",), quantizer: str | None = None,
             force: bool = False, progress: Progress | None = None, options: dict[str, Any] | None = None,
             command: list[str] | None = None) -> list[str]:
    """``irgen run --inputs``: one complete output per sample under ``out/<sample>/``, with one
    import and compile, on ``jobs`` cores (``None``: all; see :func:`split_cores`), in worker
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
        workers, threads = split_cores(jobs, len(named))
        progress.stage(f"capture {len(named)} samples ({workers} worker{'s' if workers > 1 else ''}, "
                       f"{threads} kernel thread{'s' if threads > 1 else ''} each)")

        with folder:
            first = SampleFolder(folder.tmp / named[0])
            shared = SharedParams(plan, TensorWriter(first, be, host.backends, json.loads(json.dumps(plan.records)),
                                                      plan.static_shapes, bool(options.get("compress"))))
            quiet = Progress(enabled=False)

            def one(name: str) -> None:
                write_output(host, plan, arrays[name], SampleFolder(folder.tmp / name), model, model_sha, be, sers,
                             options, command, quiet, shared)

            in_workers(named, workers, threads, one, progress)
    progress.done(f"wrote {out} ({len(named)} samples, {len(plan.records)} layers each"
                  f"{', compiled model from the cache' if plan.from_cache else ''})")
    return named


