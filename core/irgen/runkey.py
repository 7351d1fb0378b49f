"""What determines a run's output, as one key: the compile cache's entry name and the
sweep's resume fingerprint.

A key has two parts.

* :func:`plan_key`, known before the model is read: the model's bytes (a folder's files
  with their names, sizes and content), the frontend, backend, scheme and opt level,
  every option of ``irgen run`` and of every plugin that can change a value (a file or
  folder option by its content, a folder's files by name, order and content), every
  ``IRGEN_*`` variable that can change a value and the few of other programs that do
  (:data:`THIRD_PARTY_ENV`), the source of irgen and of every loaded
  plugin, the compile steps' own settings (schedule, kernel sharing, target CPU), and the
  versions of Python and of every installed distribution (TVM, onnx, torch, tensorflow,
  keras, numpy, ml_dtypes, ... : every library that reads or converts a model).
* :func:`dependencies`, known once the model is imported: the files the import read
  besides the model (an ONNX model's external data; every file a frontend opens through
  :func:`irgen.safeio.open_regular` is seen) and the Python code it ran to build the graph
  (a ``--model-class`` module and the local modules it uses, by name, path and content).
  A cache entry keeps them and is used only while :func:`stale` finds none changed.

``key.json`` in a cache entry and ``manifest.json``'s ``key`` record both; ``irgen cache``
shows them, and a run that finds its entry stale says which input changed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import sysconfig
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from irgen.api import IrgenError
from irgen.safeio import open_regular, regular_tree

#: the layout of the key document; another format never matches
KEY_FORMAT = 1

#: options that are keyed on their own (the model, frontend, backend, scheme, opt level) or never
#: change an output's values (where and how it is written, what is checked afterwards); every
#: other option, a plugin's included, is part of the key
NOT_KEYED_OPTIONS = frozenset({
    "model", "frontend", "backend", "quantizer", "opt_level", "output", "force", "seed", "no_progress", "input", "verify", "cache", "debug", "layers", "inputs",
    "compress", "jobs", "max_lsb", "max_ulp", "atol", "rtol", "min_cosine", "allow_unsupported", "plugin", "serializer",
    "strict_plugins",
})

#: ``IRGEN_*`` variables that never change a value (where the cache is and its size,
#: diagnostics, timeouts, how many threads compile); every other one set is keyed
NOT_KEYED_ENV = frozenset({
    "IRGEN_CACHE_DIR", "IRGEN_CACHE_SIZE", "IRGEN_TRACEBACK", "IRGEN_PLUGIN_TIMEOUT", "IRGEN_BUILD_THREADS",
    "IRGEN_SCHEDULE_DEBUG", "IRGEN_PLUGINS_STRICT", "IRGEN_NO_SPILL",
})

#: other programs' variables that change what a frontend's library computes (TensorFlow's oneDNN
#: kernels round differently while a Keras model is calibrated; Keras's backend and config folder)
THIRD_PARTY_ENV = ("TF_ENABLE_ONEDNN_OPTS", "TF_USE_LEGACY_KERAS", "KERAS_BACKEND", "KERAS_HOME")

_CHUNK = 1 << 20


# --------------------------------------------------------------------------- paths


@dataclass(frozen=True)
class PathDigest:
    """A model file or folder by content. ``sha256``: a file's own sha256 (what ``sha256sum``
    prints); a folder's, over its files' relative names, sizes and sha256s in name order.
    ``files``: (relative name, size, sha256) per file (a single file: name ``""``)."""

    sha256: str
    files: tuple[tuple[str, int, str], ...]

    def record(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "files": [list(f) for f in self.files]}


def sha256_file(path: Path | str, what: str = "file") -> tuple[int, str]:
    """(size, sha256) of a regular file, read in chunks (never a FIFO or a device)."""
    h = hashlib.sha256()
    size = 0
    with open_regular(path, what) as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def digest_path(path: Path, what: str = "model") -> PathDigest:
    """The :class:`PathDigest` of a file or of a folder's regular files (links refused by
    :func:`irgen.safeio.regular_tree`)."""
    if not path.is_dir():
        size, sha = sha256_file(path, what)
        return PathDigest(sha, (("", size, sha),))
    files = []
    for p in regular_tree(path, f"{what} folder"):
        size, sha = sha256_file(p, what)
        files.append((p.relative_to(path).as_posix(), size, sha))
    files.sort()
    return PathDigest(hashlib.sha256(json.dumps(files).encode()).hexdigest(), tuple(files))


# --------------------------------------------------------------------------- the plan key


@dataclass(frozen=True)
class PlanKey:
    """What a compile is keyed on (``doc``, JSON), its digest (the cache entry's name), and the
    paths whose content it holds (a file the import reads inside them is no dependency)."""

    doc: dict[str, Any]
    paths: tuple[Path, ...] = ()
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        text = json.dumps(self.doc, sort_keys=True, default=str)
        object.__setattr__(self, "doc", json.loads(text))  # as key.json holds it (tuples are lists)
        object.__setattr__(self, "digest", hashlib.sha256(text.encode()).hexdigest()[:32])


def distributions() -> list[str]:
    """Every installed distribution as ``name-version`` (its ``.dist-info`` or ``.egg-info``
    folder on ``sys.path``): a listing, no metadata file read. A path inside an installed
    package (a library's own vendored folder, e.g. Ray's workers') is not listed."""
    found = set()
    installed = _roots(stdlib=False)
    for entry in sys.path:
        real = os.path.realpath(entry or ".")
        if any(real.startswith(r + os.sep) for r in installed):
            continue
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        found.update(n.rsplit(".", 1)[0] for n in names if n.endswith((".dist-info", ".egg-info")))
    return sorted(found)


def keyed_environment() -> dict[str, str]:
    """The variables set that can change a value: ``IRGEN_*`` and :data:`THIRD_PARTY_ENV`."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith("IRGEN_") and k not in NOT_KEYED_ENV or k in THIRD_PARTY_ENV}


def keyed_options(host, options: dict[str, Any]) -> tuple[dict[str, Any], list[Path]]:
    """The options that can change a value, as JSON (a plugin's file or folder option by its
    :class:`PathDigest`), and the paths so keyed."""
    registered = dict(host.options.items())
    keyed: dict[str, Any] = {}
    paths = []
    for name, value in sorted(options.items()):
        if name in NOT_KEYED_OPTIONS or value in (None, False, [], {}):
            continue
        opt = registered.get(name)
        if opt is not None and opt.kind == "path":
            path = Path(value)
            if path.exists():
                keyed[name] = {"path": str(path.resolve()), **digest_path(path, opt.flag).record()}
                paths.append(path.resolve())
                continue
        keyed[name] = json.loads(json.dumps(value, default=repr))
    return keyed, paths


@functools.lru_cache(maxsize=8)
def code_digest(host) -> str:
    """sha256 over the source files of irgen and of every plugin module the host loaded (once
    per host: the code this process runs is the code it imported)."""
    mods = {"irgen": sys.modules["irgen"]}
    for plugin in host.pm.get_plugins():
        name = getattr(plugin, "__name__", None)
        if not isinstance(name, str) or not hasattr(plugin, "__file__"):  # an object: its class's module
            plugin = sys.modules.get(type(plugin).__module__)
            name = getattr(plugin, "__name__", None)
        if isinstance(name, str):
            top = name.split(".")[0]
            mods.setdefault(top, sys.modules.get(top, plugin))
    h = hashlib.sha256()
    for top, mod in sorted(mods.items()):
        files = [Path(mod.__file__)] if getattr(mod, "__file__", None) else []
        if files and files[0].name == "__init__.py":
            files = sorted(files[0].parent.rglob("*.py"))
        for f in files:
            h.update(f"{top}:{f.relative_to(files[0].parent).as_posix()}:".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def plan_key(host, model: Path, digest: PathDigest, frontend: str, backend: str, quantizer: str | None,
             opt_level: int, options: dict[str, Any], compile_settings: dict[str, Any]) -> PlanKey:
    """The key of compiling ``model`` (its ``digest``) with these choices; ``compile_settings``:
    what the compile steps themselves depend on (schedule, sharing, target, plan format)."""
    opts, paths = keyed_options(host, options)
    doc = {
        "format": KEY_FORMAT,
        "model": {"path": str(model.resolve()), **digest.record()},
        "frontend": frontend, "backend": backend, "quantizer": quantizer, "opt_level": opt_level,
        "options": opts,
        "environment": keyed_environment(),
        "code": code_digest(host),
        "compile": compile_settings,
        "versions": {"python": sys.version, "distributions": distributions()},
    }
    return PlanKey(doc, (model.resolve(), *paths))


def differences(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted names of the fields where two key documents differ (a list's items by value)."""
    out = []
    for k in sorted(set(a) | set(b), key=str):
        x, y = a.get(k), b.get(k)
        if x == y:
            continue
        if isinstance(x, dict) and isinstance(y, dict):
            out += differences(x, y, f"{prefix}{k}.")
        elif isinstance(x, list) and isinstance(y, list) and k == "distributions":
            changed = sorted(set(x) ^ set(y))
            out += [f"{prefix}{k}: {d}" for d in changed] if len(changed) <= 4 else \
                [f"{prefix}{k}: {len(changed)} differ ({', '.join(changed[:2])}, ...)"]
        else:
            out.append(f"{prefix}{k}")
    return out


# --------------------------------------------------------------------------- dependencies


def _roots(stdlib: bool = True) -> list[str]:
    """Where installed (and, with ``stdlib``, standard-library) code lives: not a user's local module."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in (("stdlib", "platstdlib") if stdlib else ()) + ("purelib", "platlib") if k in paths}
    roots.update(p for p in sys.path if p.endswith(("site-packages", "dist-packages")))
    return sorted(os.path.realpath(r) for r in roots)


def _local_file(module: types.ModuleType, roots: list[str]) -> str | None:
    origin = getattr(module, "__file__", None)
    if not isinstance(origin, str) or not origin.endswith(".py"):
        return None
    real = os.path.realpath(origin)
    if any(real == r or real.startswith(r + os.sep) for r in roots):
        return None
    top = module.__name__.split(".")[0]
    if top == "irgen" or top.startswith("irgen_"):  # irgen's and its plugins' code: in the code digest
        return None
    return real


def local_modules(seeds: Iterable[str]) -> tuple[str, ...]:
    """The modules named in ``seeds`` that are local code (not the standard library or an
    installed distribution) and, transitively, the local modules their globals refer to
    (imported modules, and the modules of imported functions and classes): the code a
    ``--model-class`` or a pickled model runs. Sorted names."""
    roots = _roots()
    todo = [s for s in seeds if s in sys.modules]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        mod = sys.modules.get(name)
        if name in seen or mod is None or _local_file(mod, roots) is None:
            continue
        seen.add(name)
        for value in list(vars(mod).values()):
            ref = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
            if isinstance(ref, str) and ref not in seen:
                todo.append(ref)
        if "." in name:
            todo.append(name.rsplit(".", 1)[0])  # a package's __init__ runs too
    return tuple(sorted(seen))


def locate(name: str) -> Path | None:
    """The source file ``import name`` would load, found without running any code (the
    current folder searched last, as the torch frontend's ``--model-class`` does)."""
    from importlib.machinery import PathFinder

    search: list[str] | None = list(sys.path)
    if "" not in search and os.getcwd() not in search:
        search.append(os.getcwd())
    parts = name.split(".")
    spec = None
    for i in range(len(parts)):
        spec = PathFinder.find_spec(".".join(parts[:i + 1]), search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
    origin = getattr(spec, "origin", None)
    return Path(origin).resolve() if origin and getattr(spec, "has_location", False) else None


def dependencies(reads: Iterable[Path], code: Iterable[str], keyed: Iterable[Path]) -> list[dict[str, Any]]:
    """What an import depended on besides its key: each file read outside the ``keyed`` paths
    (``file``, ``size``, ``sha256``), and each module of ``code`` (``module`` too)."""
    keyed = [Path(p) for p in keyed]
    out = []
    for p in sorted({Path(p).resolve() for p in reads}):
        if any(p == k or k in p.parents for k in keyed):
            continue
        size, sha = sha256_file(p, "dependency")
        out.append({"file": str(p), "size": size, "sha256": sha})
    for name in sorted(set(code)):
        mod = sys.modules.get(name)
        origin = getattr(mod, "__file__", None)
        if not origin:
            continue
        path = Path(origin).resolve()
        size, sha = sha256_file(path, f"module {name}")
        out.append({"module": name, "file": str(path), "size": size, "sha256": sha})
    return out


def stale(depends: Any, model: Path) -> str | None:
    """Why recorded dependencies no longer hold (a file changed or went, a module is now found
    elsewhere or changed), or None when all hold. The record may come from an untrusted folder:
    nothing is read but a file in the model's folder (where an import's data files are) or a
    module's source where Python finds that module now; a record of another shape is stale."""
    if not isinstance(depends, list) or not all(isinstance(d, dict) for d in depends):
        return "the recorded dependencies are not a list of records"
    model = model.resolve()
    folder = model if model.is_dir() else model.parent
    for dep in depends:
        if not isinstance(dep.get("file"), str) or not isinstance(dep.get("sha256"), str):
            return "a recorded dependency names no file or digest"
        path = Path(dep["file"])
        if "module" in dep:
            found = locate(str(dep["module"]))
            if found != path:
                return f"module {str(dep['module'])[:80]} is now {found or 'not found'} (was {str(path)[:200]})"
        elif folder not in path.parents:
            return f"a recorded dependency is outside the model's folder ({str(path)[:200]})"
        try:
            size, sha = sha256_file(path, "dependency")
        except IrgenError:
            return f"{path} is gone or unreadable"
        if (size, sha) != (dep.get("size"), dep["sha256"]):
            return f"{path} changed"
    return None
