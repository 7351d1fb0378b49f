"""The ``irgen`` command line's parsers: every subcommand and option, the options plugins
register, and the two-step parse (``--plugin`` first, as pytest does). :mod:`irgen.cli`
runs the commands; :mod:`irgen.sweep` parses a job's command line with these too."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from irgen import __version__
from irgen.api import IrgenError
from irgen.plugins import PluginHost
from irgen.safeio import DEFAULT_MAX_TENSOR_BYTES, parse_bytes


def _add_plugin_options(parser: argparse.ArgumentParser, suffix: str = "") -> None:
    """The global options; ``suffix`` keeps the copies after a subcommand apart."""
    parser.add_argument(
        "--plugin", "-p", action="append", default=[], dest="plugin" + suffix,
        metavar="MODULE_OR_FILE",
        help="load a plugin module or .py file; 'no:NAME' blocks plugin NAME (repeatable)",
    )
    parser.add_argument(
        "--strict-plugins", action="store_true", dest="strict_plugins" + suffix,
        help="a plugin that fails to load is an error (also IRGEN_PLUGINS_STRICT=1)",
    )


def build_parser(host: PluginHost | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``host``, the options its plugins register too. The
    subcommand is ``args.command``; :data:`COMMAND_PARSERS` builds each."""
    parser = argparse.ArgumentParser(
        prog="irgen", description="Turn NN models into a custom IR and golden data with TVM."
    )
    parser.add_argument("--version", action="version", version=f"irgen {__version__}")
    _add_plugin_options(parser)
    after = argparse.ArgumentParser(add_help=False)
    _add_plugin_options(after, suffix="_after")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    built = {name: make(commands, after) for name, make in COMMAND_PARSERS.items()}
    if host is not None:
        _add_registered_options(host, {"run": built["run"], "verify": built["verify"]})
    return parser


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


#: how an :class:`irgen.api.Option` of each kind is parsed
_OPTION_TYPES = {"text": str, "int": int, "float": float, "json": _json_object, "path": Path}


def _add_registered_options(host: PluginHost, parsers: dict[str, argparse.ArgumentParser]) -> None:
    """Every option the plugins register (``irgen_register_options``), under its plugin's heading."""
    groups: dict[tuple[str, str], Any] = {}
    for name, opt in host.options.items():
        owner = host.options.owner(name)
        for command in opt.commands:
            key = (command, opt.group or f"plugin {owner}")
            if key not in groups:
                groups[key] = parsers[command].add_argument_group(key[1])
            # `irgen verify` takes a plugin option only to replace the recorded value: no default there
            default = argparse.SUPPRESS if command == "verify" else opt.default
            kwargs: dict[str, Any] = {"dest": name, "help": opt.help}
            if opt.kind == "flag":
                kwargs.update(action="store_true", default=default if command == "verify" else bool(opt.default))
            else:
                kwargs.update(type=_OPTION_TYPES[opt.kind], default=default, metavar=opt.metavar or opt.kind.upper())
            try:
                groups[key].add_argument(opt.flag, **kwargs)
            except argparse.ArgumentError as err:
                raise IrgenError(f"plugin '{owner}' registers option {opt.flag}, which irgen {command} already "
                                 f"has ({err.message})") from None


class _PreParser(argparse.ArgumentParser):
    def error(self, message: str):  # the full parser reports it, with the right usage line
        raise ValueError(message)


def _plugin_args(argv: Sequence[str] | None) -> tuple[list[str], bool]:
    """``--plugin`` and ``--strict-plugins`` from anywhere in ``argv``: read first, because
    the plugins they load may add options to the command line."""
    pre = _PreParser(prog="irgen", add_help=False)
    _add_plugin_options(pre)
    try:
        known, _ = pre.parse_known_args(argv)
    except ValueError:
        return [], False
    return known.plugin, known.strict_plugins


def _max_bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_limit_option(parser) -> None:
    parser.add_argument("--max-tensor-bytes", type=_max_bytes, default=DEFAULT_MAX_TENSOR_BYTES, metavar="SIZE",
                        help="refuse any single tensor (input, constant, activation, file read back) larger than "
                             "SIZE, e.g. 512M, 8G (default: 2G)")


def _add_threshold_options(group) -> None:
    group.add_argument("--max-lsb", type=int, default=1, metavar="N",
                       help="integer tensors vs the source runtime: largest allowed difference in LSB (default: 1)")
    group.add_argument("--max-ulp", type=int, default=4, metavar="N",
                       help="float16/bfloat16 layers vs the source runtime, recomputed from its inputs: largest "
                            "allowed difference in ulp, of the element or of the tensor's peak (default: 4)")
    group.add_argument("--atol", type=float, default=1e-5, metavar="X",
                       help="float tensors: absolute tolerance (default: 1e-5; scaled by max(1, max|golden|) in entire and source)")
    group.add_argument("--rtol", type=float, default=1e-4, metavar="X", help="float tensors: relative tolerance (default: 1e-4)")
    group.add_argument("--min-cosine", type=float, default=None, metavar="X",
                       help="float tensors: smallest allowed cosine similarity (default: none)")
    group.add_argument("--allow-unsupported", action="store_true",
                       help="layers the numpy reference cannot run do not fail verification (they are still listed)")


def _plugins_parser(commands, after: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``irgen plugins``."""
    listing = commands.add_parser(
        "plugins", parents=[after], help="list loaded plugins, their versions and hooks"
    )
    listing.add_argument("--json", action="store_true", help="print a JSON list")
    return listing


def _run_parser(commands, after: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``irgen run``."""
    run = commands.add_parser(
        "run", parents=[after], help="write the IR and golden data of MODEL into OUT"
    )
    run.add_argument("model", type=Path, metavar="MODEL", help="model file or SavedModel folder")
    run.add_argument("-o", "--output", type=Path, required=True, metavar="OUT",
                     help="output folder")
    run.add_argument("--input", action="append", default=[], metavar="SPEC",
                     help="model input data: x.npy (one input) or NAME=x.npy (repeatable); "
                          "default: seeded random data")
    run.add_argument("--input-shape", action="append", default=[], metavar="NAME=DIMS",
                     help="shape for an input the model leaves open, e.g. x=1,3,224,224 (repeatable)")
    run.add_argument("--opt-level", type=int, choices=range(5), default=3,
                     help="TVM optimization level (default: 3)")
    run.add_argument("--accumulate", choices=["fp32", "fp16", "bf16"], default=None,
                     help="float16/bfloat16 layers: the type convolutions and matrix products accumulate in "
                          "(default: fp32, what the source runtimes do; fp16: float16, every product, partial sum "
                          "and op result rounded to float16; bf16: bfloat16, exact products, every partial sum and op "
                          "result rounded to bfloat16)")
    run.add_argument("--frontend", default=None, help="frontend name (default: by file type)")
    run.add_argument("--backend", default="generic", help="backend name (default: generic)")
    run.add_argument("--serializer", action="append", default=None, metavar="NAME",
                     help="also write the IR with this serializer, beside ir.json (repeatable; "
                          "ir.json, the canonical IR, is always written)")
    run.add_argument("--quantizer", default=None, metavar="NAME",
                     help="quantization-fusion scheme (default: detected from the model)")
    run.add_argument("--force", action="store_true", help="replace an existing OUT")
    _add_limit_option(run)
    run.add_argument("--seed", type=int, default=0, help="seed for generated inputs (default: 0)")
    run.add_argument("--no-progress", action="store_true", help="no progress output")
    run.add_argument("--debug", choices=("none", "layers", "all"), default="layers",
                     help="what debug/ holds: none; layers (default): the executed kernel graph; all: also every "
                          "kernel's output (the graph executor's dump)")
    run.add_argument("--layers", action="append", default=[], metavar="PATTERN",
                     help="write the outputs of the layers whose name matches this glob only (repeatable; the "
                          "model's outputs are always written)")
    run.add_argument("--compress", action="store_true",
                     help="store the tensors as one compressed .npz per layer (its outputs in activations/, its "
                          "parameters in parameters/), each under its tensor name; irgen verify reads them")
    run.add_argument("--inputs", type=Path, default=None, metavar="DIR",
                     help="many samples: a folder of .npy files (one per sample, sorted) or .npz files (one per "
                          "sample, an array per model input), or one .npz (an array per sample); writes OUT/<sample>/ "
                          "for each with one import and compile")
    run.add_argument("--decode", type=int, default=None, metavar="N",
                     help="an LLM generation trace: the prefill over the prompt (--input input_ids=FILE, or "
                          "--input-shape input_ids=B,P) and N greedy decode steps against the KV cache, each a "
                          "complete output in OUT/step_NNN fed by the golden data of the step before")
    run.add_argument("-j", "--jobs", type=int, default=None, metavar="N",
                     help="with --inputs: the cores to use, a worker process each, one sample at a time "
                          "(default: every core; $TVM_NUM_THREADS sets each worker's kernel threads)")
    run.add_argument("--no-cache", action="store_true",
                     help="neither read nor write the compile cache ($IRGEN_CACHE_DIR, default ~/.cache/irgen)")
    run.add_argument("--allow-pickle", action="store_true",
                     help="allow pickled data: a .pth holding a whole module, the pickled parts of a .pt2 "
                          "archive; unpickling RUNS ARBITRARY CODE from the file; only for files you trust")
    run.add_argument("--verify", action="store_true",
                     help="run 'irgen verify' on OUT right after writing it (exit 1 when it fails; OUT is kept)")
    _add_threshold_options(run.add_argument_group("--verify thresholds"))
    return run


def _verify_parser(commands, after: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``irgen verify``."""
    verify = commands.add_parser(
        "verify", parents=[after],
        help="check OUT: rerun its layers in numpy (single, entire) and the model in its own runtime (source)",
    )
    verify.add_argument("out", type=Path, metavar="OUT", help="output folder of 'irgen run'")
    verify.add_argument("--mode", choices=("single", "entire", "source", "all"), action="append", default=None,
                        help="check to run (repeatable; default: all, source only when the model and its runtime are there)")
    verify.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    verify.add_argument("--report", type=Path, default=None, metavar="PATH",
                        help="write the HTML report to PATH (default: OUT.report.html next to OUT)")
    verify.add_argument("--no-report", action="store_true", help="write no HTML report")
    verify.add_argument("--model", type=Path, default=None, metavar="PATH",
                        help="the source model, when it is no longer at the path recorded in ir.json")
    verify.add_argument("--limit", type=int, default=None, metavar="N", help="show only the N worst layers")
    verify.add_argument("--no-progress", action="store_true", help="no progress output")
    verify.add_argument("--allow-pickle", action="store_true",
                        help="the source check may unpickle the model (a .pth holding a whole module) and import "
                             "the --model-class recorded in manifest.json: both RUN ARBITRARY CODE; a manifest's "
                             "own allow_pickle is never trusted")
    _add_limit_option(verify)
    _add_threshold_options(verify)
    return verify


def _inspect_parser(commands, after: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``irgen inspect``."""
    inspect = commands.add_parser("inspect", parents=[after], help="summarize the IR in OUT")
    inspect.add_argument("out", type=Path, metavar="OUT", help="output folder of 'irgen run'")
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")
    _add_limit_option(inspect)
    return inspect


def _schema_parser(commands, after: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``irgen schema``."""
    schema = commands.add_parser("schema", parents=[after], help="print the JSON Schema of ir.json")
    return schema


def _backends_parser(commands, after: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``irgen backends``."""
    backends = commands.add_parser("backends", parents=[after],
                                   help="list the backends; 'backends show NAME': one backend's ops and constraints")
    backends.add_argument("action", nargs="?", choices=("show",), metavar="show", help="show one backend")
    backends.add_argument("name", nargs="?", metavar="NAME", help="the backend to show")
    return backends


def _new_plugin_parser(commands, after: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``irgen new-plugin``."""
    new_plugin = commands.add_parser(
        "new-plugin", parents=[after], help="write a working plugin project (package, entry point, test) to start from")
    new_plugin.add_argument("kind", choices=("frontend", "quantizer", "backend", "serializer"), metavar="KIND",
                            help="frontend, quantizer, backend or serializer")
    new_plugin.add_argument("name", metavar="NAME", help="the plugin's name, e.g. acme-npu (package irgen_acme_npu)")
    new_plugin.add_argument("-o", "--output", type=Path, default=None, metavar="DIR",
                            help="the project folder to create (default: ./irgen-NAME); it must not exist")
    return new_plugin


def _sweep_parser(commands, after: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``irgen sweep``."""
    sweep = commands.add_parser(
        "sweep", parents=[after],
        help="run every job of a SPEC file (models x inputs x opt levels x schemes) on a process pool or a Ray cluster")
    sweep.add_argument("spec", type=Path, metavar="SPEC",
                       help="YAML (or .json) with models, inputs and/or seeds, opt_levels, schemes, backend")
    sweep.add_argument("-o", "--output", type=Path, required=True, metavar="OUT",
                       help="sweep folder: OUT/<model>/<input>/O<level>/<scheme>/ per job, OUT/sweep.json")
    sweep.add_argument("--ray", default=None, metavar="ADDRESS",
                       help="run the jobs on this Ray cluster ('local': start a local Ray instance; "
                            "'auto': the one RAY_ADDRESS or 'ray start' names); default: local worker processes")
    sweep.add_argument("-j", "--jobs", type=int, default=None, metavar="N",
                       help="jobs at a time (default: the CPU count, or the cluster's CPUs with --ray)")
    sweep.add_argument("--force", action="store_true",
                       help="sweep into an OUT written by a different spec (unchanged jobs are kept)")
    sweep.add_argument("--max-jobs", type=int, default=None, metavar="N",
                       help="refuse a spec of more than N jobs, before any is built (default 10000)")
    sweep.add_argument("--no-progress", action="store_true", help="no progress output")
    sweep.add_argument("--json", action="store_true", help="print the summary as JSON instead of the table")
    return sweep


def _cache_parser(commands, after: argparse.ArgumentParser) -> argparse.ArgumentParser:
    cache = commands.add_parser(
        "cache", parents=[after],
        help="the compile cache: where it is and its size (info), its entries (list, show NAME), clear, "
             "verify (recompute entries without it and compare)")
    cache.add_argument("action", nargs="?", default="info", choices=("info", "list", "show", "clear", "verify"),
                       metavar="ACTION", help="info (default), list, show NAME, clear, or verify")
    cache.add_argument("name", nargs="?", metavar="NAME", help="with show: the entry (its name or a prefix)")
    cache.add_argument("--sample", type=int, default=None, metavar="N",
                       help="with verify: the N most recently used entries (default: all)")
    cache.add_argument("--json", action="store_true", help="print JSON")
    cache.add_argument("--no-progress", action="store_true", help="no progress output")
    return cache


def _tile(text: str) -> tuple[int, int]:
    rows, sep, cols = text.lower().partition("x")
    if not sep or not rows.isdigit() or not cols.isdigit() or int(rows) < 1 or int(cols) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected ROWSxCOLS, e.g. 8x8")
    return int(rows), int(cols)


def _compare_parser(commands, after: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``irgen compare`` (:mod:`irgen.compare`)."""
    compare = commands.add_parser(
        "compare", parents=[after],
        help="compare a device's per-layer dump with OUT's golden data: the first locally wrong layer, and why")
    compare.add_argument("out", type=Path, metavar="OUT", help="output folder of 'irgen run'")
    compare.add_argument("dump", type=Path, metavar="DUMP",
                         help="the device's dump: laid out like OUT (the same file paths and formats) unless --map says")
    compare.add_argument("--map", type=Path, default=None, metavar="FILE",
                         help="YAML or JSON: the dump's file names, dtype, shape, layout, byte order, channel padding "
                              "per tensor (see docs/compare.md)")
    compare.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    compare.add_argument("--report", type=Path, default=None, metavar="PATH",
                         help="write the HTML report to PATH (default: DUMP.compare.html next to DUMP)")
    compare.add_argument("--no-report", action="store_true", help="write no HTML report")
    compare.add_argument("--limit", type=int, default=None, metavar="N", help="list only the first N layers that differ")
    compare.add_argument("--atol", type=float, default=1e-5, metavar="X",
                         help="float tensors: absolute tolerance, scaled by max(1, max|golden|) (default: 1e-5)")
    compare.add_argument("--rtol", type=float, default=1e-4, metavar="X", help="float tensors: relative tolerance (default: 1e-4)")
    compare.add_argument("--max-ulp", type=int, default=None, metavar="N",
                         help="float tensors: values at most N units in the last place apart also match (default: none)")
    compare.add_argument("--tile", type=_tile, default=None, metavar="HxW",
                         help="say which HxW tiles of a wrong output differ (default: the backend's own tile, if any)")
    compare.add_argument("--extract-failing", type=Path, default=None, metavar="DIR",
                         help="write the first locally wrong layer's test vector, with the device's inputs, to DIR")
    compare.add_argument("--force", action="store_true", help="with --extract-failing: replace an existing DIR")
    compare.add_argument("--no-progress", action="store_true", help="no progress output")
    _add_limit_option(compare)
    return compare


def _extract_parser(commands, after: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``irgen extract`` (:mod:`irgen.extract`)."""
    extract = commands.add_parser("extract", parents=[after],
                                  help="write one layer of OUT as a self-contained test vector (an output folder of one layer)")
    extract.add_argument("out", type=Path, metavar="OUT", help="output folder of 'irgen run'")
    extract.add_argument("--layer", required=True, metavar="NAME", help="the layer's name in ir.json")
    extract.add_argument("-o", "--output", type=Path, required=True, metavar="DIR", help="the folder to write")
    extract.add_argument("--force", action="store_true", help="replace an existing DIR")
    _add_limit_option(extract)
    return extract


#: each subcommand's parser, in ``--help`` order (``args.command`` names the one given)
COMMAND_PARSERS = {
    "plugins": _plugins_parser, "run": _run_parser, "verify": _verify_parser, "inspect": _inspect_parser,
    "schema": _schema_parser, "backends": _backends_parser, "new-plugin": _new_plugin_parser,
    "sweep": _sweep_parser, "cache": _cache_parser, "compare": _compare_parser, "extract": _extract_parser,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` in two steps, as pytest does: ``--plugin``/``--strict-plugins`` first,
    to load the plugins, then the whole command line with the options they register.
    The global options given after the subcommand are merged; ``args.host`` is the loaded
    plugin host."""
    plugins, strict = _plugin_args(sys.argv[1:] if argv is None else argv)
    host = PluginHost().load(extra=plugins, strict=strict)
    args = build_parser(host).parse_args(argv)
    args.plugin = args.plugin + args.plugin_after
    args.strict_plugins = args.strict_plugins or args.strict_plugins_after
    del args.plugin_after, args.strict_plugins_after
    args.host = host
    return args


def load_host(args: argparse.Namespace) -> PluginHost:
    """The plugin host :func:`parse_args` loaded (or a new one for a namespace built elsewhere)."""
    host = getattr(args, "host", None)
    return host if host is not None else PluginHost().load(extra=args.plugin, strict=args.strict_plugins)
