"""The source runtime as a runner: the model OUT was generated from, found again and checked
(:func:`resolve_source`: the recorded path or ``--model``, its sha256, the options the run
recorded, none of which runs code without ``--allow-pickle``), and run by its frontend's
source runner in a child process (:func:`isolated_source_runner`), yielding tensors by
name. ``irgen verify``'s source check compares them with the golden data."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from irgen.api import IrgenError, OPTION_KINDS
from irgen.irfile import read_manifest
from irgen.plugins import PluginHost
from irgen.runkey import digest_path
from irgen.runners import one_line
from irgen.safeio import check_tensor_size, DEFAULT_MAX_TENSOR_BYTES, file_or_folder, regular_tree


@dataclass
class SourceModel:
    """What the source check runs: the frontend, the model and the frontend options,
    plus notes for the user and whether the model's sha256 is the one in ``ir.json``
    (None: ``ir.json`` records none)."""

    frontend: Any
    path: Path
    options: dict[str, Any]
    notes: list[str]
    sha256_matches: bool | None = None


def model_sha256(path: Path) -> str:
    """The sha256 ``irgen run`` records for a model (:func:`irgen.runkey.digest_path`: a file's
    bytes, or a folder's files by name, size and content), without importing TVM."""
    return digest_path(path, "source model").sha256


def _manifest_options(manifest: dict | None, path: Path, allow_pickle: bool, limit: int | None,
                      notes: list[str], registered: Any = None) -> dict[str, Any]:
    """The options recorded in ``manifest.json``, taken only as far as they are safe.

    The manifest is untrusted: ``allow_pickle`` is never taken from it (the source
    check unpickles only with ``--allow-pickle`` on the verify command line), and a
    plugin option registered with ``runs_code`` (``--model-class``: importing a module
    runs its code) is used only with that same consent. ``input_shapes`` are checked
    against the tensor size limit; a ``path`` option must name a file or a folder of
    regular files, and using it is noted; a value of the wrong type, or an option no
    installed plugin registers, is refused (``registered``: the host's option registry)."""
    rec = (manifest or {}).get("frontend_options") or {}
    opts: dict[str, Any] = {}
    if rec.get("allow_pickle") and not allow_pickle:
        raise IrgenError(f"source check: OUT was generated with --allow-pickle (the model {path.name} is a pickled "
                         f"module, and unpickling it runs code from the file); pass --allow-pickle to irgen verify "
                         f"only if you trust that file")
    if rec.get("input_shapes"):
        for name, dims in rec["input_shapes"].items():
            check_tensor_size(f"manifest.json: input {name!r:.100}", dims, "float32", limit)
        opts["input_shapes"] = {k: tuple(v) for k, v in rec["input_shapes"].items()}
    known = dict(registered.items()) if registered is not None else {}
    plugin_keys = sorted(k for k in rec if k not in ("allow_pickle", "input_shapes"))
    unknown = [repr(k)[:60] for k in plugin_keys if k not in known]
    if unknown:
        raise IrgenError(f"source check: manifest.json records option(s) {', '.join(unknown[:10])}, which no "
                         "installed plugin registers (install the plugin, or give it with --plugin)")
    for key in plugin_keys:
        opts[key] = _recorded_option(known[key], rec[key], allow_pickle, notes)
    return opts


#: the JSON types a recorded option value of each kind may have
_RECORDED_TYPES = {"text": (str,), "int": (int,), "float": (int, float), "flag": (bool,), "json": (dict, str),
                   "path": (str,)}


def _recorded_option(opt: Any, value: Any, allow_pickle: bool, notes: list[str]) -> Any:
    """One plugin option's value from ``manifest.json``, checked by its kind (see :func:`_manifest_options`)."""
    where = f"{opt.flag} {value!r:.100} (recorded in manifest.json)"
    if not isinstance(value, _RECORDED_TYPES[opt.kind]) or (isinstance(value, bool) and opt.kind != "flag"):
        raise IrgenError(f"source check: manifest.json records {opt.flag} as {type(value).__name__}, "
                         f"expected {OPTION_KINDS[opt.kind]}")
    if opt.runs_code and not allow_pickle:
        raise IrgenError(f"source check: manifest.json names {opt.flag} {value!r:.100}, and using it runs that "
                         f"code; pass --allow-pickle to irgen verify only if you trust OUT and its model")
    if opt.kind == "path":
        value = Path(value)
        if file_or_folder(value, f"source check: {where}").is_dir():
            regular_tree(value, f"source check: {where}")
        notes.append(f"source check: {where}")
    return value


def resolve_source(out: Path, ir: dict, model: Path | None = None, host=None, *, manifest: Any = ...,
                   allow_pickle: bool = False, options: dict[str, Any] | None = None,
                   given: dict[str, Any] | None = None,
                   max_tensor_bytes: int | None = DEFAULT_MAX_TENSOR_BYTES) -> SourceModel:
    """The model ``out`` was generated from, its frontend and options, checked without loading it;
    raises IrgenError when it is not there or may not be run.

    ``model``: a model the user named (``--model``); otherwise the path recorded in
    ``ir.json`` (relative to the recorded ``cwd``), which is used only when its sha256
    is the one ``ir.json`` records. ``options``: frontend options the user gave
    (``irgen run --verify``), used as they are; None: the ones recorded in
    ``manifest.json``, as far as :func:`_manifest_options` allows; ``given``: plugin
    options the user gave ``irgen verify``, which replace recorded ones. ``allow_pickle``
    comes from the command line only."""
    if manifest is ...:
        manifest = read_manifest(out)
    notes: list[str] = []
    if model is not None:
        path = Path(model)
    else:
        recorded = (ir.get("model") or {}).get("path")
        if not recorded:
            raise IrgenError("source check: ir.json records no model path (give the model with --model PATH)")
        path = Path(recorded)
        cwd = (manifest or {}).get("cwd")
        if not path.is_absolute() and cwd and not os.path.lexists(path):
            path = Path(cwd) / path
    try:
        file_or_folder(path, "source check: model")
    except IrgenError as err:
        raise IrgenError(f"{one_line(err)} (give its path with --model PATH)") from None
    want = (ir.get("model") or {}).get("sha256")
    matches = None
    if want:
        matches = model_sha256(path) == want
    if model is None and not matches:
        why = "its sha256 differs from the one ir.json records" if want else "ir.json records no sha256 to check it by"
        raise IrgenError(f"source check: model {path} is not known to be the file OUT was generated from ({why}); "
                         f"give that model with --model PATH")
    host = host or PluginHost().load()
    name = (ir.get("producer") or {}).get("frontend")
    if not name:
        raise IrgenError("source check: ir.json records no frontend (producer.frontend)")
    if name not in host.frontends.names():
        raise IrgenError(f"source check: frontend {name!r:.100} is not installed")
    if options is None:
        opts = _manifest_options(manifest, path, allow_pickle, max_tensor_bytes, notes, host.options)
    else:
        opts = {k: v for k, v in options.items() if v is not None}
    opts.update(given or {})
    opts["allow_pickle"] = bool(allow_pickle)
    opts["max_tensor_bytes"] = max_tensor_bytes
    return SourceModel(host.frontends.get(name), path, opts, notes, matches)


def source_runner_for(out: Path, ir: dict, model: Path | None = None, host=None, **kwargs) -> tuple[Callable, Path]:
    """The source runtime of the model ``out`` was generated from, in this process;
    raises IrgenError when unavailable (``kwargs``: see :func:`resolve_source`)."""
    src = resolve_source(out, ir, model, host, **kwargs)
    return WithItems(src.frontend.source_runner(src.path, src.options)), src.path


_ITEM = re.compile(r"^(.+)\[(\s*-?[0-9]*\s*(?::\s*-?[0-9]*\s*)?(?:,\s*-?[0-9]*\s*(?::\s*-?[0-9]*\s*)?)*)\]$")


def source_item(name: str) -> tuple[str, tuple] | None:
    """``(tensor, index)`` of a source tensor name that selects part of a tensor, ``NAME[i, j]``
    or with slices ``NAME[:, t, a:b]`` (integers and ``start:stop``, one per leading axis;
    a recurrent step's state is one step of a tensor of every step's, ``<node>:h[0, 1, 3]``),
    else None."""
    m = _ITEM.match(name)
    if m is None:
        return None
    index: list[int | slice] = []
    for part in m.group(2).split(","):
        lo, colon, hi = (p.strip() for p in part.partition(":"))
        if not colon and not lo:
            return None
        index.append(slice(int(lo) if lo else None, int(hi) if hi else None) if colon else int(lo))
    return m.group(1), tuple(index)


class WithItems:
    """A source runner that also gives the tensors named ``NAME[index]`` (:func:`source_item`)
    the runtime does not give under that name: the runtime's ``NAME``, indexed. Its attributes
    are the runner's (``runtime``, ``kernels``, ``exact``, ``max_lsb``, ``fallback``)."""

    def __init__(self, runner: Callable):
        self._runner = runner

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def __call__(self, feeds: dict[str, Any], wanted: list[str]) -> dict[str, Any]:
        import numpy as np

        items = {w: it for w in wanted if (it := source_item(w)) is not None}
        bases = sorted({base for base, _ in items.values()} - set(wanted))
        values = self._runner(feeds, [*wanted, *bases])
        for w, (base, index) in items.items():
            if w not in values and base in values:
                try:
                    values[w] = np.asarray(values[base])[index]
                except IndexError:  # not an item of that tensor: not given
                    continue
        keep = set(wanted)
        return {k: v for k, v in values.items() if k in keep}


def _source_child(conn, frontend: str, model: str, options: dict, plugins: list[str], strict: bool, feeds,
                  wanted) -> None:
    """Body of the process :func:`isolated_source_runner` starts: it runs the model the
    parent resolved and checked, with the options the parent decided (it reads nothing
    from OUT itself)."""
    try:
        t0 = time.perf_counter()
        host = PluginHost().load(extra=plugins, strict=strict)
        runner = WithItems(host.frontends.get(frontend).source_runner(Path(model), options))
        t1 = time.perf_counter()
        # before running: what runs, and the options to retry with should it crash (see isolated_source_runner)
        conn.send(("runner", _describe(runner), getattr(runner, "fallback", None)))
        values = runner(feeds, wanted)
        conn.send(("ok", values, {"load": round(t1 - t0, 3), "run": round(time.perf_counter() - t1, 3)},
                   _describe(runner)))  # again: a runner may learn what ran (its kernels) while running
    except Exception as err:  # noqa: BLE001  reported by the parent, one line
        conn.send(("error", str(err) if isinstance(err, IrgenError) else f"source check: {type(err).__name__}: {err}"))
    finally:
        conn.close()


def _describe(runner: Callable) -> dict[str, Any]:
    """A source runner's ``runtime`` (e.g. the name of an interpreter), ``kernels`` (e.g.
    "reference kernels") and ``exact`` (its integer kernels are the arithmetic the scheme
    reproduces, so an integer layer must equal them to the last bit) and ``max_lsb`` (an int: the
    LSB its kernels may differ from that arithmetic by, when they are of another), attributes a
    frontend may set on the callable it returns."""
    out: dict[str, Any] = {k: str(getattr(runner, k)) for k in ("runtime", "kernels") if getattr(runner, k, None)}
    out["exact"] = bool(getattr(runner, "exact", False))
    own = getattr(runner, "max_lsb", None)
    if isinstance(own, int) and not isinstance(own, bool):
        out["max_lsb"] = own
    return out


def isolated_source_runner(out: Path, ir: dict, model: Path | None = None, host=None,
                           plugins: list[str] | tuple = (), strict: bool = False,
                           **kwargs) -> tuple[Callable, SourceModel]:
    """Like :func:`source_runner_for`, but the runtime runs in a child process, so a
    runtime that aborts or crashes on a model (some interpreters do on some models)
    becomes an IrgenError naming the signal instead of ending ``irgen``. Returns
    (runner, the :class:`SourceModel` it runs).

    A frontend's runner may name other options to retry with when it crashes (its
    ``fallback`` attribute, a dict merged into the options: a runtime's builtin optimized
    kernels when its reference kernels abort); the check then runs once more with them.
    After a call, the runner's ``runtime`` attribute says what ran, e.g. "<interpreter>
    (builtin optimized kernels; reference kernels crashed: signal SIGABRT)", its ``exact``
    whether those are the kernels the golden data reproduces bit for bit, and its
    ``seconds`` how long the child took to ``load`` the model into the runtime (imports
    included) and to ``run`` it for every wanted tensor."""
    import multiprocessing
    import signal

    src = resolve_source(out, ir, model, host, **kwargs)
    frontend, path = src.frontend, src.path

    def once(options: dict[str, Any], feeds: dict[str, Any], wanted: list[str]) -> tuple[str, Any, dict, Any]:
        """One child: (status "ok", "error" or "crashed"; the values, the message or how it
        crashed; what ran; the runner's fallback options)."""
        ctx = multiprocessing.get_context("spawn")  # no fork: the parent may hold TVM's or torch's threads
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_source_child, daemon=True,
                            args=(send, frontend.name, str(path), options, list(plugins), strict, feeds,
                                  list(wanted)))
        child.start()
        send.close()
        what: dict[str, Any] = {}
        fallback = None
        try:
            msg = recv.recv()
            if msg[0] == "runner":  # the runner is built; now it runs
                what, fallback = msg[1], msg[2]
                msg = recv.recv()
            status, payload = msg[:2]
            if len(msg) > 2:
                what["seconds"] = msg[2]
            if len(msg) > 3:
                what.update(msg[3])
        except EOFError:
            child.join()
            code = child.exitcode
            status = "crashed"
            payload = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        finally:
            recv.close()
        child.join()
        return status, payload, what, fallback

    def run(feeds: dict[str, Any], wanted: list[str]) -> dict[str, Any]:
        status, payload, what, fallback = once(src.options, feeds, wanted)
        crashed = None
        if status == "crashed" and isinstance(fallback, dict) and fallback:
            crashed = (what.get("kernels") or "its first kernels", payload)
            status, payload, what, _ = once({**src.options, **fallback}, feeds, wanted)
        if status == "crashed":
            first = f" (and with {crashed[0]}: {crashed[1]})" if crashed else ""
            raise IrgenError(f"source check: the {frontend.name} frontend's runtime crashed ({payload}){first} "
                             f"running {path.name}; the single and entire checks do not depend on it")
        if status == "error":
            raise IrgenError(payload)
        kernels = what.get("kernels")
        if crashed:
            kernels = f"{kernels or 'fallback kernels'}; {crashed[0]} crashed: {crashed[1]}"
        runtime = what.get("runtime") or f"the {frontend.name} frontend's runtime"
        run.runtime = f"{runtime} ({kernels})" if kernels else runtime
        run.seconds = what.get("seconds")
        run.exact = bool(what.get("exact")) and not crashed
        run.max_lsb = what.get("max_lsb")
        return payload

    run.start = lambda feeds, wanted: started(run, feeds, wanted)
    return run, src


def started(run: Callable, feeds: dict[str, Any], wanted: list[str]) -> Callable[[], Any]:
    """``run(feeds, wanted)`` begun now on a daemon thread (its work is in the child process
    it starts, so it overlaps the caller's own checks on another core); the returned function
    waits for it and returns its result or raises its error. A daemon thread: an interrupted
    verify exits at once, and multiprocessing ends the daemon child."""
    import threading

    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = run(feeds, wanted)
        except BaseException as err:  # noqa: BLE001  handed to the caller of wait()
            box["error"] = err

    thread = threading.Thread(target=work, name="irgen-source-check", daemon=True)
    thread.start()

    def wait() -> Any:
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    return wait


def load_host(plugins, strict: bool):
    """The installed plugins and ``plugins`` (``--plugin``), loaded."""
    return PluginHost().load(extra=list(plugins), strict=strict)
