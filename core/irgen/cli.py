"""The ``irgen`` command line.

``irgen [--plugin X]... [--strict-plugins] {plugins,run,verify,compare,extract,inspect,schema,...} ...``;
the global options are also accepted after the subcommand. Only ``irgen run``
imports the pipeline (and with it TVM); ``irgen verify`` imports a source
runtime only for its ``source`` check: ``irgen --help`` and ``irgen plugins``
stay fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from irgen import envflags, lean_import
from irgen.api import IrgenError
from irgen.cliargs import build_parser, load_host, parse_args  # noqa: F401  (build_parser: re-exported)
from irgen.irfile import output_folders, read_ir
from irgen.output import Progress
from irgen.plugins import PluginHost
from irgen.safeio import DEFAULT_MAX_TENSOR_BYTES, human_bytes
from irgen.schema import schema_text


def cmd_plugins(args: argparse.Namespace) -> int:
    rows = load_host(args).describe()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no plugins loaded")
        return 0
    table = [("NAME", "VERSION", "SOURCE", "STATUS", "KINDS", "HOOKS")]
    table += [
        (r["name"], r["version"] or "-", r["source"], r["status"],
         ", ".join(r["kinds"]) or "-", ", ".join(r["hooks"]) or "-")
        for r in rows
    ]
    _print_columns(table)
    # what each plugin registers, by kind and name (irgen run --frontend/--quantizer/--backend/--serializer NAME)
    order = list(PluginHost().registries)
    objects = [("KIND", "NAME", "PLUGIN", "DESCRIPTION")]
    objects += sorted(((kind, name, r["name"], (r.get("descriptions") or {}).get(kind, {}).get(name) or "-")
                       for r in rows for kind, names in r["registered"].items() for name in names),
                      key=lambda o: (order.index(o[0]) if o[0] in order else len(order), o[1]))
    if len(objects) > 1:
        _print_columns(objects)
    for r in rows:
        if r["error"]:
            print(f"{r['name']}: {r['error']}")
    return 0


def _print_columns(table: list[tuple[str, ...]]) -> None:
    """Rows of cells, left-aligned in columns two spaces apart (the last cell as it is)."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])


def cmd_run(args: argparse.Namespace) -> int:
    host = load_host(args)
    from irgen import pipeline  # imports TVM

    code = int(pipeline.run_cli(args, host))
    if code == 0 and args.verify:
        outs = output_folders(args.output)  # with --inputs: every sample's folder
        failed = [out for out in outs if not run_verify(args, out, modes=None, model=args.model)["passed"]]
        for out in failed:
            print(f"irgen: verification of {out} failed (the output is kept)", file=sys.stderr)
        return 1 if failed else 0
    return code


def _thresholds(args: argparse.Namespace):
    from irgen.verify import Thresholds

    return Thresholds(max_lsb=args.max_lsb, max_ulp=args.max_ulp, atol=args.atol, rtol=args.rtol,
                      min_cosine=args.min_cosine,
                      allow_unsupported=args.allow_unsupported)


def run_verify(args: argparse.Namespace, out: Path, modes: list[str] | None, model: Path | None,
               as_json: bool = False, report: Path | None = None, quiet: bool = False) -> dict[str, Any]:
    """Verify ``out`` and print the table (or JSON; ``quiet``: neither); ``modes`` None: all that can run.

    The report is written atomically (a temporary file renamed over ``report``), so a
    symbolic link planted at that path is replaced, never followed."""
    from irgen.verify import format_table

    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # runtimes that print (TensorFlow) keep stdout for the result
        result = _verify_quietly(args, out, modes, model)
    if as_json:
        print(json.dumps(result, indent=1))
    elif not quiet:
        print(format_table(result, getattr(args, "limit", None)))
    if report is not None:
        from irgen.report import write_report  # a large module: only when a report is written

        try:
            path = write_report(result, report)
        except OSError as err:
            raise IrgenError(f"cannot write the report {report}: {err.strerror or _one_line(err)}") from None
        if not args.no_progress:
            print(f"wrote {path}", file=sys.stderr)
    return result


def _verify_quietly(args: argparse.Namespace, out: Path, modes: list[str] | None, model: Path | None) -> dict[str, Any]:
    from irgen.verify import MODES, verify_output

    read_ir(out)  # a missing or malformed OUT: one error before plugins and runtimes load
    progress = Progress(enabled=not args.no_progress)
    limit = getattr(args, "max_tensor_bytes", None) or DEFAULT_MAX_TENSOR_BYTES
    optional = modes is None or "all" in modes
    modes = list(MODES) if optional else list(modes)
    # The source check takes nothing that runs code from OUT's manifest: allow_pickle (and the
    # consent to import a recorded --model-class) only from this command line. `irgen run --verify`
    # passes the run's own frontend options: the user typed them.
    host = load_host(args) if "source" in modes else None
    options = given = None
    if getattr(args, "command", None) == "run":
        from irgen.inputs import parse_input_shapes

        options = {"input_shapes": parse_input_shapes(args.input_shape or [], limit)}
        options.update({n: getattr(args, n, None) for n, opt in load_host(args).options.items() if opt.record})
    elif host is not None:  # plugin options given to `irgen verify` itself replace the recorded ones
        given = {n: getattr(args, n) for n, opt in host.options.items()
                 if "verify" in opt.commands and getattr(args, n, None) not in (None, False)}
    result = verify_output(out, modes=modes, thresholds=_thresholds(args), model=model, progress=progress,
                           source_optional=optional, allow_pickle=bool(getattr(args, "allow_pickle", False)),
                           frontend_options=options, given_options=given, max_tensor_bytes=limit,
                           host=host, plugins=args.plugin or [],
                           strict=args.strict_plugins)
    for note in result.get("notes") or []:
        print(f"irgen: note: {_one_line(note)}", file=sys.stderr)
    return result


def _default_report(out: Path) -> Path:
    """OUT.report.html beside OUT (OUT as given, '.' and trailing parts resolved without links)."""
    import os

    plain = Path(os.path.abspath(out))
    return plain.parent / f"{plain.name}.report.html"


def cmd_verify(args: argparse.Namespace) -> int:
    """``irgen verify OUT``; an ``irgen run --inputs`` output: every sample, each with its report
    beside its folder; exit 1 when one fails."""
    folders = output_folders(args.out)
    if len(folders) > 1 and args.report:
        raise IrgenError(f"--report: {args.out} holds {len(folders)} samples; each gets its own report beside "
                         "its folder (leave --report out, or verify one sample folder)")
    if len(folders) == 1 and folders[0] == Path(args.out):
        report = None if args.no_report else args.report or _default_report(args.out)
        return 0 if run_verify(args, args.out, args.mode, args.model, as_json=args.json, report=report)["passed"] else 1
    results = {}
    for folder in folders:
        if not args.json:
            print(f"== sample {folder.name} ==")
        results[folder.name] = run_verify(args, folder, args.mode, args.model, report=None if args.no_report
                                          else _default_report(folder), quiet=args.json)
    failed = [name for name, r in results.items() if not r["passed"]]
    if args.json:
        print(json.dumps({"passed": not failed, "samples": results}, indent=1))
    else:
        print(f"{len(folders)} samples: {len(folders) - len(failed)} passed, {len(failed)} failed"
              + (f" ({', '.join(failed[:10])}{', ...' if len(failed) > 10 else ''})" if failed else ""))
    return 1 if failed else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """``irgen inspect OUT``; an ``irgen run --inputs`` output: every sample."""
    from irgen.summary import format_inspect, inspect_output

    folders = output_folders(args.out)
    infos = [inspect_output(folder) for folder in folders]
    if len(folders) == 1 and folders[0] == Path(args.out):
        print(json.dumps(infos[0], indent=1) if args.json else format_inspect(infos[0]))
    elif args.json:
        print(json.dumps({"samples": {f.name: info for f, info in zip(folders, infos)}}, indent=1))
    else:
        print("\n\n".join(f"== sample {f.name} ==\n{format_inspect(info)}" for f, info in zip(folders, infos)))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    """``irgen sweep``: every job of the spec (:mod:`irgen.sweep`); exit 1 when a job failed."""
    import contextlib

    from irgen.sweep import format_summary, sweep

    if args.jobs is not None and args.jobs < 1:
        raise IrgenError(f"-j {args.jobs}: must be 1 or more")
    if args.max_jobs is not None and args.max_jobs < 1:
        raise IrgenError(f"--max-jobs {args.max_jobs}: must be 1 or more")
    with contextlib.redirect_stdout(sys.stderr):  # Ray prints its workers' deaths to stdout; it holds the summary
        summary = sweep(args.spec, args.output, ray=args.ray, workers=args.jobs, force=args.force,
                        plugins=args.plugin, strict_plugins=args.strict_plugins, host=load_host(args),
                        progress=Progress(enabled=not args.no_progress), max_jobs=args.max_jobs)
    print(json.dumps(summary, indent=1) if args.json else format_summary(summary))
    return 1 if summary["counts"]["failed"] else 0


def cmd_compare(args: argparse.Namespace) -> int:
    """``irgen compare OUT DUMP``: exit 0 when every tensor the dump holds matches, 1 when one differs."""
    from irgen.compare import compare_dump, format_compare
    from irgen.comparators import Thresholds

    extract = args.extract_failing
    if extract is not None and extract.exists() and any(extract.iterdir()) and not args.force:
        raise IrgenError(f"--extract-failing {extract}: folder exists and is not empty (use --force to replace it)")
    progress = Progress(enabled=not args.no_progress)
    result = compare_dump(args.out, args.dump, mapping=args.map, thresholds=Thresholds(atol=args.atol, rtol=args.rtol),
                          max_ulp=args.max_ulp, tile=args.tile, host=load_host(args),
                          max_tensor_bytes=args.max_tensor_bytes, progress=progress, extract=extract)
    samples = result.get("samples")
    if args.json:
        print(json.dumps(result, indent=1))
    elif samples is None:
        print(format_compare(result, args.limit))
    else:
        for name, r in samples.items():
            print(f"== sample {name} ==\n" + (format_compare(r, args.limit) if "summary" in r else "; ".join(r["notes"])))
    if not args.no_report:
        _compare_reports(args, result, progress)
    return 0 if result["passed"] else 1


def _compare_reports(args: argparse.Namespace, result: dict, progress) -> None:
    """The HTML report(s): DUMP.compare.html (or --report), one beside each sample's dump folder."""
    samples = result.get("samples")
    if samples is not None and args.report:
        raise IrgenError(f"--report: {args.out} holds {len(samples)} samples; each gets its own report beside its "
                         "dump folder (leave --report out)")
    todo = [(result, args.report or _default_report(args.dump).with_name(f"{Path(args.dump).name}.compare.html"))] \
        if samples is None else [(r, _default_report(Path(r["dump"])).with_name(f"{Path(r['dump']).name}.compare.html"))
                                 for r in samples.values() if "summary" in r]
    from irgen.compare_report import write_compare_report  # a large module: only when a report is written

    for r, path in todo:
        try:
            written = write_compare_report(r, path)
        except OSError as err:
            raise IrgenError(f"cannot write the report {path}: {err.strerror or _one_line(err)}") from None
        progress.done(f"wrote {written}")


def cmd_extract(args: argparse.Namespace) -> int:
    """``irgen extract OUT --layer NAME -o DIR``."""
    from irgen.extract import extract_layer

    path = extract_layer(args.out, args.layer, args.output, host=load_host(args), force=args.force,
                         limit=args.max_tensor_bytes)
    print(f"wrote {path}: layer {args.layer!r:.100} of {args.out} (irgen verify {path} --mode single checks it)")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    """``irgen cache``: see :mod:`irgen.cachetool`; ``verify`` exits 1 when an entry differs."""
    from irgen import cachetool

    if (args.name is not None) != (args.action == "show"):
        raise IrgenError("irgen cache show NAME: a name goes with show, and only there")
    if args.sample is not None and (args.action != "verify" or args.sample < 1):
        raise IrgenError("--sample N: with 'irgen cache verify', N at least 1")
    if args.action == "clear":
        from irgen.cache import clear, folder

        count, freed = clear()
        print(f"removed {count} entries ({human_bytes(freed)}) from {folder()}")
        return 0
    if args.action == "verify":
        rows = cachetool.verify(load_host(args), args.sample, Progress(enabled=not args.no_progress))
        differs = [r for r in rows if r["status"] in ("differs", "error")]
        print(json.dumps(rows, indent=1) if args.json else
              "\n".join(f"{r['status']:<12} {r['name']}  {r['model']}"
                        f"{'  ' + ', '.join(r['files'][:5]) if r.get('files') else ''}"
                        f"{'  (' + r['detail'] + ')' if r.get('detail') else ''}" for r in rows) or "no entries")
        return 1 if differs else 0
    value = {"info": cachetool.info, "list": cachetool.listing}.get(args.action)
    result = value() if value else cachetool.show(args.name)
    if args.json or args.action == "show":
        print(json.dumps(result, indent=1))
    elif args.action == "info":
        print(cachetool.format_info(result))
    else:
        table = [("NAME", "MODEL", "FRONTEND", "QUANTIZER", "BACKEND", "O", "SIZE", "USED")]
        table += [(r["name"][:12], str(r["model"]), str(r["frontend"]), str(r["quantizer"] or "-"), str(r["backend"]),
                   str(r["opt_level"]), human_bytes(r["size"]), r["used"]) for r in result]
        _print_columns(table) if result else print("no entries")
    return 0


def cmd_new_plugin(args: argparse.Namespace) -> int:
    """Write a plugin project from irgen's templates (:mod:`irgen.scaffold`)."""
    from irgen.scaffold import new_plugin, tokens

    path = new_plugin(args.kind, args.name, args.output)
    values = tokens(args.kind, args.name)
    print(f"wrote {path}: the {args.kind} plugin {args.name!r} (package {values['PACKAGE']}); next:\n"
          f"  pip install -e {path}   # then 'irgen plugins' lists it\n"
          f"  cd {path} && pytest     # its tests, on irgen.testing")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    """The JSON Schema (draft 2020-12) of ``ir.json``, as the package ships it."""
    sys.stdout.write(schema_text())
    return 0


def cmd_backends(args: argparse.Namespace) -> int:
    """``irgen backends``: every backend; ``irgen backends show NAME``: what one backend states
    (layout, data files, fusion rules, supported ops, its table of constraints)."""
    host = load_host(args)
    reg = host.backends
    if args.action is None:
        if args.name is not None:
            raise IrgenError(f"irgen backends {args.name}: did you mean 'irgen backends show {args.name}'?")
        table = [("NAME", "PLUGIN", "LAYOUT", "DATA FILES", "DESCRIPTION")]
        for name, be in reg.items():
            data = "own (store_tensor)" if be.store_tensor else "own (write_tensor)" if be.write_tensor else ".npy"
            table.append((name, reg.owner(name), be.layout or "any", data, be.description or "-"))
        _print_columns(table)
        return 0
    if args.name is None:
        raise IrgenError("irgen backends show: which backend? (irgen backends lists them)")
    be = reg.get(args.name)
    print(f"backend {be.name} (plugin {reg.owner(be.name)})")
    if be.description:
        print(f"  {be.description}")
    print(f"activation layout: {be.layout or 'any (as the model states it)'}")
    print("data files: " + ("the backend's own (store_tensor; read back with read_tensor)" if be.store_tensor else
                            "the backend's own (write_tensor; read back with read_tensor)" if be.write_tensor else
                            ".npy"))
    print("fusion rules (anchor, then followers absorbed in order):")
    for rule in be.fusion_rules:
        steps = [" | ".join(sorted(rule.anchor))] + [f"[{' | '.join(sorted(f))}]" for f in rule.followers]
        print(f"  {rule.name}: {' -> '.join(steps)}" + (f" (layer op {rule.op})" if rule.op else ""))
    print("supported ops: " + (", ".join(sorted(be.supported_ops)) if be.supported_ops is not None else
                               "any (not limited by supported_ops)"))
    print("per-layer check: " + ("check_layer, before compiling" if be.check_layer else "none"))
    if be.constraints:
        print()
        _print_columns([("OP", "CONSTRAINT"), *((str(what), str(rule)) for what, rule in be.constraints)])
    else:
        print("constraints table: none (the backend states no table)")
    return 0


def _one_line(message: Any) -> str:
    return " ".join(str(message).split())


class _Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP) arrived: unwinds like Ctrl-C, so the partial output is removed."""


class _SignalWatch:
    """Notes which stop signal arrived, then raises as Python's default SIGINT handler does.

    SIGINT raises KeyboardInterrupt; SIGTERM and SIGHUP raise :class:`_Terminated`
    (a KeyboardInterrupt too), so every ``with OutputFolder`` removes its
    partial folder on the way out. TVM's C++ code checks for signals and turns
    the exception raised inside it into a bare ``RuntimeError``; ``seen`` tells
    ``main`` that such an error was really the signal.
    """

    _SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")

    def __init__(self) -> None:
        self.seen: int | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> "_SignalWatch":
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self
        for name in self._SIGNALS:
            num = getattr(signal, name, None)
            if num is None:
                continue
            current = signal.getsignal(num)
            if current in (signal.default_int_handler, signal.SIG_DFL):
                self.previous[num] = signal.signal(num, self._handler)
        return self

    def _handler(self, signum, frame) -> None:
        import signal

        self.seen = signum
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise _Terminated

    @property
    def exit_code(self) -> int:
        return 128 + (self.seen or 2)

    def __exit__(self, *exc: Any) -> None:
        import signal

        for num, handler in self.previous.items():
            signal.signal(num, handler)


def _stopped(watch: _SignalWatch) -> int:
    import signal

    print("irgen: interrupted" if watch.seen in (None, signal.SIGINT) else "irgen: terminated", file=sys.stderr)
    return watch.exit_code


def _traceback_wanted() -> bool:
    """``IRGEN_TRACEBACK`` is on (a bad value, refused up front by :func:`main`, counts as off)."""
    try:
        return envflags.switch("IRGEN_TRACEBACK")
    except IrgenError:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (2 for a user error, 130/143 when interrupted/terminated,
    3 for an internal error). ``IRGEN_TRACEBACK=1`` prints the traceback of any error; every
    ``IRGEN_*`` variable is checked first (``irgen.envflags``)."""
    lean_import.install()  # TVM without torch unless a model needs it
    lean_import.unpin_threads()  # before any kernel, FoldConstant's included, makes a pool
    watch = _SignalWatch()
    try:
        with watch:
            envflags.check_all()
            args = parse_args(argv)
            return int(COMMANDS[args.command](args))
    except IrgenError as exc:
        if watch.seen:
            return _stopped(watch)
        if _traceback_wanted():
            import traceback

            traceback.print_exc()
        print(f"irgen: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _stopped(watch)
    except BrokenPipeError:  # `irgen inspect OUT | head`: the reader left; stop quietly, as cat does
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141
    except SystemExit as exc:  # argparse: --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except OSError as exc:  # the file system said no (permissions, space, names): one line
        if watch.seen:
            return _stopped(watch)
        if _traceback_wanted():
            raise
        where = f": {exc.filename}" if exc.filename else ""
        print(f"irgen: error: {exc.strerror or _one_line(exc)}{where}", file=sys.stderr)
        return 2
    except MemoryError:
        print("irgen: error: out of memory (lower --max-tensor-bytes to refuse such models up front)", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001  a bug: one line, the traceback on request
        if watch.seen:  # a stop signal surfaced as another error (e.g. from inside TVM)
            return _stopped(watch)
        if _traceback_wanted():
            raise
        print(f"irgen: internal error: {type(exc).__name__}: {_one_line(exc)[:500]} "
              f"(IRGEN_TRACEBACK=1 shows where)", file=sys.stderr)
        return 3


if __name__ == "__main__":
    raise SystemExit(main())


#: the function of each subcommand (:data:`irgen.cliargs.COMMAND_PARSERS` builds its parser)
COMMANDS = {
    "plugins": cmd_plugins, "run": cmd_run, "verify": cmd_verify, "inspect": cmd_inspect, "schema": cmd_schema,
    "backends": cmd_backends, "new-plugin": cmd_new_plugin, "sweep": cmd_sweep, "cache": cmd_cache,
    "compare": cmd_compare, "extract": cmd_extract,
}
