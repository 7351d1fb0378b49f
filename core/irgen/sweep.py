"""``irgen sweep SPEC -o OUT``: many ``irgen run`` jobs (models × inputs × opt levels × schemes).

A spec (YAML, or JSON) names the job set::

    models: [resnet18.onnx, mobilenet.onnx]   # relative to the spec file
    inputs: samples/                          # .npy files, or folders of them (sorted)
    seeds: [0, 1]                             # and/or generated inputs
    opt_levels: [3]                           # default [3]
    schemes: [null, NAME]                     # quantizer names; null: detected (default [null])
    backend: generic                          # default generic

Every combination is one job, written to ``OUT/<model>/<input or seedN>/O<level>/<scheme or auto>/``
exactly as ``irgen run MODEL -o THAT --input X --opt-level L [--quantizer S] ...`` writes it
(the job runs that command line, in a worker process: :func:`run_job`).

One scheduler loop (:func:`_schedule`) feeds the jobs to an executor: a local process
pool (:class:`PoolExecutor`, ``-j N`` single-worker spawn pools, so a worker that dies
names its job) or a Ray cluster (:class:`RayExecutor`, ``--ray ADDRESS``; ``local``
starts a local instance). A failed job (an error, or its worker died) is tried once
more, then reported, and the others go on. ``OUT/sweep.json`` records every finished
job (written atomically after each), so a sweep run again with the same spec skips the
jobs already done; a different spec for the same OUT is refused unless ``force``.

Specs and sweep folders may be hostile. A spec is bounded before it is expanded: YAML
aliases are refused (no "billion laughs"), nesting and the number of values are limited
(:data:`MAX_SPEC_DEPTH`, :data:`MAX_SPEC_VALUES`), and the number of jobs is counted from
the list lengths (an ``inputs`` folder listed no further than fits) and refused past
``max_jobs`` (``--max-jobs``) before any job is built. Every message names a value of the
spec cut to a bounded length (:func:`_shown`). Inside OUT nothing is followed: a symbolic
link on the way from OUT down to a job folder, at ``OUT/sweep.json`` or at the record's
temporary file is refused (before any job runs, and again in the worker just before the
job writes), so a job writes and deletes only inside OUT. OUT itself, named by the user,
may be a link.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import json
import os
import re
import reprlib
import stat
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from irgen.api import IrgenError
from irgen.cliargs import build_parser
from irgen.names import SafeNames
from irgen.output import Progress
from irgen.plugins import _is_file_spec, PluginHost
from irgen.runkey import digest_path, stale
from irgen.safeio import read_bytes, read_json

#: how often a job is tried before it is reported failed
ATTEMPTS = 2
#: the format of ``OUT/sweep.json``
SWEEP_FORMAT = 1
RECORD = "sweep.json"
_SPEC_KEYS = ("models", "inputs", "seeds", "opt_levels", "schemes", "backend")
#: the most jobs a spec may expand to unless ``max_jobs`` (``--max-jobs``) says otherwise
MAX_JOBS = 10_000
#: the most values (mapping keys and list items count) a spec may hold, and how deep it may nest
MAX_SPEC_VALUES = 100_000
MAX_SPEC_DEPTH = 16
#: a scheme or backend name: also a folder name (the scheme's) and a command-line value
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 160
_REPR.maxlong = 40
_REPR.maxlevel = 2
_REPR.maxlist = _REPR.maxdict = 4


def _shown(value: Any) -> str:
    """A value of the spec (or a path made of one) for a message: its repr, cut in length and
    nesting (:mod:`reprlib`), so a hostile value is never repeated whole."""
    return _REPR.repr(str(value) if isinstance(value, Path) else value)


# --------------------------------------------------------------------------- the spec

@dataclass(frozen=True)
class Job:
    """One ``irgen run``: ``key`` is its output folder relative to OUT."""

    key: str
    model: str
    sample: str | None  # an input .npy file, or None for a generated input (``seed``)
    seed: int
    opt_level: int
    scheme: str | None
    backend: str
    out: str
    plugins: tuple[str, ...] = ()
    strict_plugins: bool = False

    def argv(self) -> list[str]:
        """The ``irgen`` command line of the job (without ``irgen``)."""
        argv = ["run", self.model, "-o", self.out, "--opt-level", str(self.opt_level), "--backend", self.backend]
        argv += ["--input", self.sample] if self.sample is not None else ["--seed", str(self.seed)]
        if self.scheme is not None:
            argv += ["--quantizer", self.scheme]
        argv += ["--force", "--no-progress"]
        for p in self.plugins:
            argv += ["--plugin", p]
        if self.strict_plugins:
            argv.append("--strict-plugins")
        return argv

    def payload(self) -> dict[str, Any]:
        """What a worker gets (plain data: it crosses process and machine boundaries); ``root`` is OUT."""
        root = Path(self.out).parents[self.key.count("/")]
        return {"key": self.key, "out": self.out, "root": str(root), "argv": self.argv()}


def _list(spec: dict, key: str, default: list, kind: type | tuple) -> list:
    value = spec.get(key, default)
    if value is None or isinstance(value, (str, int)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not value:
        raise IrgenError(f"sweep spec: '{key}' must be a non-empty list")
    for v in value:
        if not isinstance(v, kind) or isinstance(v, bool):
            raise IrgenError(f"sweep spec: '{key}' holds {_shown(v)}, "
                             f"not {getattr(kind, '__name__', 'a name or null')}")
    return value


class _TooBig(Exception):
    """A spec refused for its shape (an alias, too deep, too many values): the message says which."""


class _Budget:
    """Counts a spec's values as they are read: refused past :data:`MAX_SPEC_VALUES` or nested
    deeper than :data:`MAX_SPEC_DEPTH` (the top mapping is depth 1)."""

    def __init__(self) -> None:
        self.values = 0

    def take(self, depth: int) -> None:
        self.values += 1
        if self.values > MAX_SPEC_VALUES:
            raise _TooBig(f"more than {MAX_SPEC_VALUES} values; a sweep spec lists models, inputs, seeds, "
                          "opt levels and schemes")
        if depth > MAX_SPEC_DEPTH:
            raise _TooBig(f"nested deeper than {MAX_SPEC_DEPTH} levels")


class _SpecLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses any alias before it is expanded (a few hundred bytes of
    aliases expand to billions of values) and counts the values (:class:`_Budget`) while
    composing: nothing past a limit is built."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.depth = 0
        self.budget = _Budget()

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise _TooBig(f"a YAML alias at line {mark.line + 1}, column {mark.column + 1}; a sweep spec "
                          "may not use anchors and aliases: write the values out")
        self.depth += 1
        try:
            self.budget.take(self.depth)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _check_shape(spec: Any) -> None:
    """The limits :class:`_SpecLoader` applies to YAML, applied to a spec parsed from JSON."""
    budget = _Budget()
    stack = [(spec, 1)]
    while stack:
        value, depth = stack.pop()
        budget.take(depth)
        items = [*value, *value.values()] if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack += [(v, depth + 1) for v in items]


def read_spec(path: Path) -> dict[str, Any]:
    """The spec file as a dict (YAML; a ``.json`` file as JSON), its shape bounded and its keys checked."""
    text = read_bytes(path, "sweep spec", limit=1 << 20).decode("utf-8", "replace")
    try:
        if path.suffix.lower() == ".json":
            spec = json.loads(text)
            _check_shape(spec)
        else:
            spec = yaml.load(text, Loader=_SpecLoader)  # noqa: S506  a SafeLoader
    except _TooBig as err:
        raise IrgenError(f"{path}: not a valid sweep spec ({err})") from None
    except RecursionError:
        raise IrgenError(f"{path}: not a valid sweep spec (nested deeper than {MAX_SPEC_DEPTH} levels)") from None
    except Exception as err:  # noqa: BLE001  yaml.YAMLError / JSONDecodeError: one message
        raise IrgenError(f"{path}: not a valid sweep spec ({' '.join(str(err).split())[:300]})") from None
    if not isinstance(spec, dict):
        raise IrgenError(f"{path}: a sweep spec is a mapping (models, inputs, seeds, opt_levels, schemes, backend)")
    unknown = [k for k in spec if k not in _SPEC_KEYS]  # in the spec's order: keys of any type
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise IrgenError(f"{path}: unknown key(s) {', '.join(map(_shown, unknown[:5]))}{more} "
                         f"(known: {', '.join(_SPEC_KEYS)})")
    if "models" not in spec:
        raise IrgenError(f"{path}: the spec names no models")
    return spec


def _plain_name(what: str, name: str) -> None:
    """A scheme or backend name as a plain name: it becomes a folder name and a command-line value."""
    if not _PLAIN_NAME.fullmatch(name):
        raise IrgenError(f"sweep spec: {what} {_shown(name)} is not a plain name "
                         "(a letter or digit, then letters, digits, '_', '.' or '-'; at most 100)")


def _spec_path(base: Path, entry: str, what: str) -> tuple[Path, os.stat_result]:
    """A path of the spec (relative to ``base``), resolved, and its ``stat``; one bounded message
    when it cannot be used."""
    try:
        path = Path(os.path.realpath(base / entry))  # not Path.resolve: a link loop is an OSError here
        return path, os.stat(path)
    except FileNotFoundError:
        raise IrgenError(f"sweep spec: {what} {_shown(entry)}: no such file or folder") from None
    except (OSError, ValueError) as err:  # ENAMETOOLONG, ELOOP, EACCES; an embedded NUL
        reason = getattr(err, "strerror", None) or _shown(str(err))
        raise IrgenError(f"sweep spec: {what} {_shown(entry)}: cannot use it ({reason})") from None


def _too_many(jobs: int, limit: int, exact: bool = True) -> IrgenError:
    """The spec expands to ``jobs`` jobs (not ``exact``: at least that many, the rest not counted)."""
    return IrgenError(f"sweep spec: {'' if exact else 'at least '}{jobs} jobs, more than the limit of {limit} "
                      "(raise it with --max-jobs N)")


def _npy_files(folder: Path, entry: str, room: int) -> list[Path]:
    """The .npy files of an ``inputs`` folder, sorted; listing stops past ``room`` of them."""
    files: list[Path] = []
    try:
        with os.scandir(folder) as it:
            for e in it:
                if Path(e.name).suffix == ".npy" and e.is_file():
                    files.append(folder / e.name)
                    if len(files) > room:
                        break
    except OSError as err:
        raise IrgenError(f"sweep spec: input folder {_shown(entry)}: cannot list it ({err.strerror})") from None
    if not files:
        raise IrgenError(f"sweep spec: input folder {_shown(entry)} holds no .npy files")
    return sorted(files)


def _samples(spec: dict, base: Path, per_sample: int, max_jobs: int) -> list[tuple[str | None, int]]:
    """(input file, seed) per sample: the ``inputs`` files (folders: their .npy files, sorted),
    then the ``seeds``; neither given: seed 0, as ``irgen run`` does. Each sample is
    ``per_sample`` jobs: past ``max_jobs`` refused, and folders are listed no further."""
    entries = _list(spec, "inputs", [], str) if "inputs" in spec else []
    seeds = _list(spec, "seeds", [0], int) if "seeds" in spec or not entries else []
    least = per_sample * (len(entries) + len(seeds))  # every input entry is one sample at least
    if least > max_jobs:
        raise _too_many(least, max_jobs, exact=not entries)
    room = max_jobs // per_sample - len(seeds)  # input files that fit
    files: list[Path] = []
    for entry in entries:
        p, st = _spec_path(base, entry, "input")
        if stat.S_ISDIR(st.st_mode):
            files += _npy_files(p, entry, room - len(files))
        elif stat.S_ISREG(st.st_mode):
            files.append(p)
        else:
            raise IrgenError(f"sweep spec: input {_shown(entry)}: not a file or folder")
        if len(files) > room:
            raise _too_many(per_sample * (len(files) + len(seeds)), max_jobs, exact=False)
    return [(str(f), 0) for f in files] + [(None, s) for s in seeds]


def expand(spec: dict[str, Any], base: Path, out: Path, plugins: list[str] = (),
           strict_plugins: bool = False, max_jobs: int = MAX_JOBS) -> list[Job]:
    """The jobs of ``spec`` (paths relative to ``base``), in order: models, samples, opt levels, schemes.
    More than ``max_jobs`` is refused from the list lengths, before any job is built."""
    entries = _list(spec, "models", [], str)
    levels = _list(spec, "opt_levels", [3], int)
    bad = [lv for lv in levels if lv not in range(5)]
    if bad:
        raise IrgenError(f"sweep spec: opt level {_shown(bad[0])} is not 0..4")
    schemes = _list(spec, "schemes", [None], (str, type(None)))
    for scheme in schemes:
        if scheme is not None:
            _plain_name("scheme", scheme)
    backend = spec.get("backend", "generic")
    if not isinstance(backend, str):
        raise IrgenError("sweep spec: 'backend' must be a name")
    _plain_name("backend", backend)
    per_sample = len(entries) * len(levels) * len(schemes)
    samples = _samples(spec, base, per_sample, max_jobs)
    models = [_spec_path(base, m, "model") for m in entries]
    plugins = tuple(str(Path(p).resolve()) if _is_file_spec(p) and not p.startswith("no:") else p for p in plugins)
    model_names = SafeNames()
    model_names(RECORD)  # never a model folder of that name
    sample_names = SafeNames()
    samples = [(f, s, sample_names(Path(f).stem if f else f"seed{s}")) for f, s in samples]
    jobs = []
    for m, st in models:
        mname = model_names(m.stem if stat.S_ISREG(st.st_mode) else m.name)
        for f, seed, sname in samples:
            for level in levels:
                for scheme in schemes:
                    key = f"{mname}/{sname}/O{level}/{scheme or 'auto'}"
                    jobs.append(Job(key, str(m), f, seed, level, scheme, backend, str(out / key), plugins,
                                    strict_plugins))
    if len({j.key for j in jobs}) != len(jobs):
        raise IrgenError("sweep spec: a scheme or opt level is listed twice")
    return jobs


class _Fingerprints:
    """Each job's resume fingerprint: its command line (without OUT), its input's content, and
    the compile key ``irgen run`` computes for it (:func:`irgen.pipeline.run_key`: the model's
    files, every keyed option and variable, the code and library versions). A finished job is
    kept while its fingerprint is unchanged and the dependencies its output's manifest records
    (external data, model code: :func:`irgen.runkey.stale`) still hold."""

    def __init__(self, host) -> None:
        self.host = host
        self.parser = build_parser(host)
        self.digests: dict[str, Any] = {}

    def _digest(self, path: str):
        if path not in self.digests:
            self.digests[path] = digest_path(Path(path))
        return self.digests[path]

    def __call__(self, job: Job) -> str:
        from irgen import pipeline

        args = self.parser.parse_args(job.argv())
        key = pipeline.run_key(self.host, Path(job.model), args.opt_level, args.frontend, args.backend,
                               args.quantizer, pipeline.run_options(args), self._digest(job.model))
        argv = [a for a in job.argv() if a != job.out]
        data = [argv, key.digest, self._digest(job.sample).sha256 if job.sample else None]
        return hashlib.sha256(json.dumps(data).encode()).hexdigest()


def _still_holds(job: Job) -> bool:
    """The dependencies the job's ``manifest.json`` records (read bounded: OUT is untrusted) hold."""

    try:
        keyed = read_json(Path(job.out) / "manifest.json", "manifest.json", limit=64 << 20).get("key")
    except (IrgenError, AttributeError):
        return False
    return isinstance(keyed, dict) and stale(keyed.get("depends"), Path(job.model)) is None


# --------------------------------------------------------------------------- the job

def run_job(payload: dict[str, Any]) -> dict[str, Any]:
    """Run one job (:meth:`Job.payload`) in this process: ``irgen run`` with its command line.

    Never raises for a job that fails: returns ``ok`` False and the error, so every
    executor reports failures the same way (a worker that dies is the executor's to report).
    """
    t0 = time.perf_counter()
    try:
        _job_folder(Path(payload["root"]), payload["key"], make=True)  # checked again just before it writes
        layers = _run_irgen(payload["argv"], Path(payload["out"]))
        return {"ok": True, "seconds": time.perf_counter() - t0, "layers": layers, "error": None}
    except Exception as exc:  # noqa: BLE001  a job's failure is a result, reported in the summary
        return {"ok": False, "seconds": time.perf_counter() - t0, "layers": None,
                "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}"}
    except SystemExit as exc:  # argparse refused the command line
        return {"ok": False, "seconds": time.perf_counter() - t0, "layers": None,
                "error": f"irgen run refused the command line (exit {exc.code})"}


def _run_irgen(argv: list[str], out: Path) -> int:
    """``irgen run`` (argv) through the CLI's own parsing and :func:`irgen.pipeline.run_cli`, so a
    job's options and files are those of the same command typed by hand; returns the layer count.
    The folders above ``out`` exist (:func:`_job_folder`)."""
    from irgen import cliargs, pipeline

    args = cliargs.parse_args(argv)
    saved = sys.argv
    sys.argv = ["irgen", *argv]  # run_cli records sys.argv as the output's command (manifest.json)
    try:
        pipeline.run_cli(args, args.host)
    finally:
        sys.argv = saved
    return len(read_json(out / "ir.json", "ir.json")["layers"])


# --------------------------------------------------------------------------- executors

class WorkerDied(Exception):
    """The process running a job ended without a result (killed, crashed)."""


class PoolExecutor:
    """Local worker processes: ``slots`` single-worker :class:`ProcessPoolExecutor` s (spawned,
    never forked after TVM is loaded). A worker that dies breaks only its own pool, so the job
    it ran is the one charged; that pool is made anew and the other running jobs go on."""

    def __init__(self, slots: int):
        import multiprocessing

        self.capacity = max(1, slots)
        self.ctx = multiprocessing.get_context("spawn")
        self.pools: list[cf.ProcessPoolExecutor | None] = [None] * self.capacity
        self.busy: dict[cf.Future, int] = {}
        self.describe = f"process pool ({self.capacity} worker{'s' * (self.capacity > 1)})"

    def submit(self, payload: dict[str, Any]) -> cf.Future:
        slot = next(i for i in range(self.capacity) if i not in self.busy.values())
        if self.pools[slot] is None:
            self.pools[slot] = cf.ProcessPoolExecutor(max_workers=1, mp_context=self.ctx)
        fut = self.pools[slot].submit(run_job, payload)
        self.busy[fut] = slot
        return fut

    def wait(self, handles: list, timeout: float) -> list:
        done, _ = cf.wait(handles, timeout=timeout, return_when=cf.FIRST_COMPLETED)
        return list(done)

    def result(self, handle: cf.Future) -> dict[str, Any]:
        slot = self.busy.pop(handle)
        try:
            return handle.result()
        except cf.process.BrokenProcessPool as err:
            self.pools[slot].shutdown(wait=False, cancel_futures=True)
            self.pools[slot] = None
            raise WorkerDied(f"worker process died ({' '.join(str(err).split())})") from None

    def close(self, cancel: list = ()) -> None:
        """Stop the workers; with jobs still running (``cancel``: an interruption) do not wait for them."""
        for pool in self.pools:
            if pool is not None:
                pool.shutdown(wait=not cancel, cancel_futures=True)


class RayExecutor:
    """Jobs as Ray tasks (one CPU each, never retried by Ray: the scheduler counts attempts).
    ``address``: a cluster (``ray.init(address=...)``), ``local`` for a new local instance;
    an already initialized Ray (e.g. a test's) is used as it is and left running."""

    def __init__(self, address: str, slots: int | None):
        try:
            import ray
        except ImportError:
            raise IrgenError("--ray needs Ray: pip install 'irgen[ray]'") from None
        self.ray = ray
        self.owned = not ray.is_initialized()
        if self.owned:
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                      "configure_logging": False}
            if address == "local" and slots:
                kwargs["num_cpus"] = slots
            ray.init(address=address, **kwargs)
        self.task = ray.remote(num_cpus=1, max_retries=0)(run_job)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.capacity = max(1, slots or cpus)
        self.describe = f"Ray {address} ({cpus} CPUs, {self.capacity} at a time)"

    def submit(self, payload: dict[str, Any]):
        return self.task.remote(payload)

    def wait(self, handles: list, timeout: float) -> list:
        done, _ = self.ray.wait(handles, num_returns=1, timeout=timeout)
        return done

    def result(self, handle) -> dict[str, Any]:
        from ray import exceptions

        try:
            return self.ray.get(handle)
        except (exceptions.WorkerCrashedError, exceptions.NodeDiedError, exceptions.OutOfMemoryError) as err:
            raise WorkerDied(f"Ray worker died ({type(err).__name__})") from None
        except exceptions.RayError as err:
            return {"ok": False, "seconds": 0.0, "layers": None,
                    "error": f"{type(err).__name__}: {' '.join(str(err).split())[:500]}"}

    def close(self, cancel: list = ()) -> None:
        for ref in cancel:
            self.ray.cancel(ref, force=True)
        if self.owned:
            self.ray.shutdown()


# --------------------------------------------------------------------------- the sweep

def _complete(folder: Path) -> bool:
    """irgen's output folder appears only when complete; its manifest is written last."""
    return (folder / "ir.json").is_file() and (folder / "manifest.json").is_file()


def _refuse_link(path: Path) -> os.stat_result | None:
    """``lstat`` of a path inside OUT (None: not there); a symbolic link is refused, never followed."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(st.st_mode):
        raise IrgenError(f"{path}: a symbolic link inside the sweep folder; irgen sweep never follows one "
                         "(remove it, or sweep into another folder)")
    return st


def _job_folder(root: Path, key: str, make: bool) -> None:
    """``root/key`` (OUT and a job's key), checked from OUT down: a link on the way or at the job
    folder is refused, anything else but a folder too. ``make``: the folders above the job folder
    are made, one at a time (the job makes its own); else the check stops where nothing is."""
    parts = key.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise IrgenError(f"sweep: job folder {_shown(key)} would not be inside {root}")
    path = root
    for i, part in enumerate(parts):
        path = path / part
        st = _refuse_link(path)
        if st is None:
            if not make or i == len(parts) - 1:
                break
            with contextlib.suppress(FileExistsError):
                os.mkdir(path)
            st = _refuse_link(path)
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise IrgenError(f"{path}: inside the sweep folder, and not a folder")


def _check_out(out: Path, jobs: list[Job]) -> None:
    """Before any job runs: OUT is a folder (or not there yet), and no link stands at ``OUT/sweep.json``,
    at the record's temporary file or on the way from OUT down to any job folder."""
    if out.exists() and not out.is_dir():
        raise IrgenError(f"{out}: exists and is not a folder")
    for path in (out / RECORD, _record_tmp(out)):
        _refuse_link(path)
    for job in jobs:
        _job_folder(out, job.key, make=False)


def _record_tmp(out: Path) -> Path:
    return out / f".{RECORD}.{os.getpid()}.tmp"


def _write_record(out: Path, state: dict[str, Any]) -> None:
    """``OUT/sweep.json`` replaced atomically (a temporary file renamed over it). The temporary file
    is made new (``O_EXCL``): a link there is refused, a file left there removed, never written through."""
    tmp = _record_tmp(out)
    if _refuse_link(tmp) is not None:
        os.unlink(tmp)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    with os.fdopen(os.open(tmp, flags, 0o666), "w") as f:
        f.write(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, out / RECORD)


def _load_record(out: Path, spec_hash: str, force: bool, max_jobs: int) -> dict[str, Any]:
    """The job records of an earlier sweep into ``out`` with the same spec (empty for a new OUT).
    The file is read up to a size that ``max_jobs`` records take (the memory of parsing it bounded),
    and a record that is not a mapping of the fields a record has is dropped (its job runs again)."""
    path = out / RECORD
    if not path.exists():
        if out.is_dir() and any(out.iterdir()) and not force:
            raise IrgenError(f"{out}: folder exists, is not empty and holds no {RECORD} "
                             "(use --force to sweep into it anyway)")
        return {}
    try:
        old = read_json(path, RECORD, limit=(1 << 20) + 512 * max_jobs)
        jobs = old["jobs"]
        same = old.get("spec_sha256") == spec_hash
    except (IrgenError, KeyError, TypeError):
        if not force:
            raise IrgenError(f"{path}: not a sweep record irgen can read (use --force to start over)") from None
        return {}
    if not same and not force:
        raise IrgenError(f"{out}: an earlier sweep with a different spec wrote it (use --force to sweep "
                         "this spec into it: jobs whose command line, model and input are unchanged are kept)")
    return {k: v for k, v in jobs.items() if _valid_record(v)} if isinstance(jobs, dict) else {}


#: a job record's fields and the types each may hold (a record otherwise is dropped: its job runs again)
_RECORD_FIELDS = {"status": str, "attempts": int, "seconds": (int, float, type(None)), "layers": (int, type(None)),
                  "output": str, "error": (str, type(None)), "fingerprint": str}


def _valid_record(rec: Any) -> bool:
    return isinstance(rec, dict) and all(isinstance(rec.get(k), t) for k, t in _RECORD_FIELDS.items()) \
        and rec["status"] in ("ok", "failed")


def _schedule(executor, todo: list[tuple[Job, str]], finish: Callable[[Job, str, dict, int], None],
              tick: Callable[[int], None]) -> None:
    """The one scheduler loop: keep ``executor.capacity`` jobs running; a failed attempt (an
    error or a dead worker) goes back to the queue until the job has had :data:`ATTEMPTS`;
    ``finish(job, fingerprint, result, attempts)`` is called once per job."""
    pending = deque(todo)
    attempts: dict[str, int] = {}
    running: dict[Any, tuple[Job, str]] = {}
    try:
        while pending or running:
            while pending and len(running) < executor.capacity:
                job, fp = pending.popleft()
                attempts[job.key] = attempts.get(job.key, 0) + 1
                running[executor.submit(job.payload())] = (job, fp)
            tick(len(running))
            for handle in executor.wait(list(running), timeout=1.0):
                job, fp = running.pop(handle)
                try:
                    result = executor.result(handle)
                except WorkerDied as err:
                    result = {"ok": False, "seconds": None, "layers": None, "error": str(err)}
                if not result["ok"] and attempts[job.key] < ATTEMPTS:
                    pending.append((job, fp))
                else:
                    finish(job, fp, result, attempts[job.key])
    finally:
        executor.close(cancel=list(running))


def _host(plugins, strict: bool):
    return PluginHost().load(extra=list(plugins), strict=strict)


def sweep(spec_path: Path, out: Path, ray: str | None = None, workers: int | None = None, force: bool = False,
          plugins: list[str] = (), strict_plugins: bool = False, host=None, progress=None,
          max_jobs: int | None = None) -> dict[str, Any]:
    """Run the sweep of ``spec_path`` into ``out``; returns the summary (also kept in ``OUT/sweep.json``).
    A spec of more than ``max_jobs`` jobs (default :data:`MAX_JOBS`) is refused."""
    progress = progress or Progress(enabled=False)
    spec_path = Path(spec_path)
    spec = read_spec(spec_path)
    out = Path(os.path.abspath(out))
    max_jobs = MAX_JOBS if max_jobs is None else max_jobs
    jobs = expand(spec, spec_path.resolve().parent, out, plugins, strict_plugins, max_jobs)
    if host is not None:  # names the workers would only fail on, refused up front
        for scheme in {j.scheme for j in jobs} - {None}:
            host.quantizers.get(scheme)
        host.backends.get(jobs[0].backend)
    identity = [[j.key if a == j.out else a for a in j.argv()] for j in jobs]  # OUT may move
    spec_hash = hashlib.sha256(json.dumps(identity).encode()).hexdigest()
    _check_out(out, jobs)
    records = _load_record(out, spec_hash, force, max_jobs)
    out.mkdir(parents=True, exist_ok=True)

    fingerprint = _Fingerprints(host if host is not None else _host(plugins, strict_plugins))
    todo, reused = [], set()
    for job in jobs:
        fp = fingerprint(job)
        rec = records.get(job.key)
        if rec and rec.get("status") == "ok" and rec.get("fingerprint") == fp and _complete(Path(job.out)) \
                and _still_holds(job):
            reused.add(job.key)
        else:
            todo.append((job, fp))
    keys = {j.key for j in jobs}
    records = {k: v for k, v in records.items() if k in keys}
    state = {"format": SWEEP_FORMAT, "spec": str(spec_path.resolve()), "spec_sha256": spec_hash, "jobs": records}
    counts = {"ok": 0, "failed": 0}
    t0 = time.perf_counter()
    last = [""]

    def finish(job: Job, fp: str, result: dict, n: int) -> None:
        status = "ok" if result["ok"] else "failed"
        counts[status] += 1
        records[job.key] = {"status": status, "attempts": n, "seconds": _round(result["seconds"]),
                            "layers": result["layers"], "output": job.key, "error": result["error"],
                            "fingerprint": fp}
        state["jobs"] = {j.key: records[j.key] for j in jobs if j.key in records}  # in the spec's order
        _write_record(out, state)
        last[0] = f"{job.key} {status}"

    def tick(running: int) -> None:
        done = counts["ok"] + counts["failed"]
        progress.step(f"jobs: {counts['ok']} ok, {counts['failed']} failed, {running} running"
                      + (f"; last {last[0]}" if last[0] else ""), done, len(todo))

    if todo:
        executor = RayExecutor(ray, workers) if ray else PoolExecutor(workers or os.cpu_count() or 1)
        where = executor.describe
        progress.stage(f"sweep {len(todo)} job(s) on {where}" + (f"; {len(reused)} done earlier" if reused else ""))
        _schedule(executor, todo, finish, tick)
        tick(0)
    else:
        where = None
    summary = _summary(jobs, records, reused, out, where, time.perf_counter() - t0)
    state["summary"] = summary
    _write_record(out, state)
    progress.done(f"swept {len(jobs)} job(s) into {out}: {summary['counts']['ok']} ok, "
                  f"{summary['counts']['failed']} failed")
    return summary


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def _summary(jobs: list[Job], records: dict, reused: set, out: Path, where: str | None, seconds: float) -> dict:
    rows = []
    for job in jobs:
        rec = records[job.key]
        rows.append({"job": job.key, "status": rec["status"], "reused": job.key in reused,
                     "attempts": rec["attempts"], "seconds": rec["seconds"], "layers": rec["layers"],
                     "output": rec["output"], "error": rec["error"]})
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "failed")}
    counts["reused"] = len(reused)
    return {"out": str(out), "executor": where, "seconds": _round(seconds), "counts": counts, "jobs": rows}


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a table: job, status, attempts, seconds, layers; then each failure's error."""
    table = [("job", "status", "attempts", "seconds", "layers")]
    for r in summary["jobs"]:
        status = r["status"] + (" (earlier)" if r["reused"] else "")
        secs = "" if r["seconds"] is None else f"{r['seconds']:.2f}"
        table.append((r["job"], status, str(r["attempts"]), secs, "" if r["layers"] is None else str(r["layers"])))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    c = summary["counts"]
    lines.append(f"{len(summary['jobs'])} job(s): {c['ok']} ok ({c['reused']} done earlier), {c['failed']} failed"
                 + (f"; {summary['seconds']:.1f} s on {summary['executor']}" if summary["executor"] else ""))
    lines += [f"failed {r['job']}: {r['error']}" for r in summary["jobs"] if r["status"] == "failed"]
    return "\n".join(lines)
