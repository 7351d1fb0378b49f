"""The compile cache: a model's compiled plan, kept in a user cache folder so that a
second ``irgen run`` of the same model skips import, layer forming and compile.

An entry is keyed by everything that shapes the plan: the model's bytes (sha256), the
frontend, backend, scheme and opt level, the options of every plugin, the versions
of irgen, TVM and Python, and a digest of irgen's and every installed plugin's code
(an edited checkout never reuses a stale compile). It holds ``plan.json``, the
parameter arrays and the kernels' constants as ``.npy`` (read without pickle, each
when needed: ``irgen.plan.Stored``) and the exported library (the kernels, without
the weights when irgen's executor runs the plan).

* Folder: ``$IRGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/irgen``, else ``~/.cache/irgen``.
* Size: ``$IRGEN_CACHE_SIZE`` bytes (suffixes K, M, G; default 2G); the least recently
  used entries are removed after each store. ``0`` turns the cache off.
* ``irgen run --no-cache`` neither reads nor writes it.

An entry appears complete or not at all (written into a temporary folder, renamed into
place); an unreadable entry is removed and compiled anew. The cache never changes a
golden value: a cached run writes the same bytes as a fresh one (tested).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from irgen.api import IrgenError
from irgen.plan import PLAN_FORMAT, Plan

DEFAULT_SIZE = 2 << 30

#: options that never change the plan (where and how the output is written)
_NOT_PLAN = {"output", "force", "seed", "no_progress", "input", "verify", "cache", "debug", "layers", "inputs", "compress",
             "jobs", "max_lsb", "atol", "rtol", "min_cosine", "allow_unsupported", "plugin", "serializer"}


def folder() -> Path:
    """The cache folder (not created)."""
    if os.environ.get("IRGEN_CACHE_DIR"):
        return Path(os.environ["IRGEN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "irgen"


def size_limit() -> int:
    """``$IRGEN_CACHE_SIZE`` in bytes (``DEFAULT_SIZE`` when unset)."""
    text = os.environ.get("IRGEN_CACHE_SIZE", "").strip()
    if not text:
        return DEFAULT_SIZE
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1].upper(), 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise IrgenError(f"IRGEN_CACHE_SIZE={text!r}: expected a size such as 500M or 2G") from None


def _code_digest(host) -> str:
    """sha256 over the source files of irgen and of every plugin module the host loaded."""
    from irgen.pipeline import _tvm_version

    mods = {"irgen": sys.modules["irgen"]}
    for plugin in host.pm.get_plugins():
        name = getattr(plugin, "__name__", None)
        if not isinstance(name, str) or not hasattr(plugin, "__file__"):  # an object: its class's module
            plugin = sys.modules.get(type(plugin).__module__)
            name = getattr(plugin, "__name__", None)
        if isinstance(name, str):
            top = name.split(".")[0]
            mods.setdefault(top, sys.modules.get(top, plugin))
    h = hashlib.sha256(f"{_tvm_version()} {sys.version} {PLAN_FORMAT}".encode())
    for top, mod in sorted(mods.items()):
        files = [Path(mod.__file__)] if getattr(mod, "__file__", None) else []
        if files and files[0].name == "__init__.py":
            files = sorted(files[0].parent.rglob("*.py"))
        for f in files:
            h.update(f"{top}:{f.name}:".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def plan_key(host, model_sha: str, frontend: str, backend: str, quantizer: str | None, opt_level: int,
             options: dict[str, Any]) -> str | None:
    """The entry name for this compile, or None when the cache is off."""
    if size_limit() <= 0:
        return None
    from irgen import schedule, share, target
    from irgen.pipeline import sha256_path

    registered = dict(host.options.items())
    opts = {}
    for k, v in sorted(options.items()):
        if k in _NOT_PLAN or v in (None, False, [], {}):
            continue
        opt = registered.get(k)
        if opt is not None and opt.kind == "path" and Path(v).exists():
            v = {"path": str(Path(v).resolve()), "sha256": sha256_path(Path(v))}  # its content shapes the plan
        opts[k] = v if isinstance(v, (str, int, float, bool)) else repr(v)
    doc = {"model": model_sha, "frontend": frontend, "backend": backend, "quantizer": quantizer,
           "opt_level": opt_level, "options": opts, "code": _code_digest(host), "schedule": schedule.key(),
           "share": share.key(), "target": target.key()}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


def load(key: str) -> Plan | None:
    """The plan stored under ``key``, or None (a missing or broken entry)."""
    entry = folder() / key
    if not (entry / "plan.json").is_file():
        return None
    try:
        plan = Plan.load(entry)
    except IrgenError:
        shutil.rmtree(entry, ignore_errors=True)
        return None
    try:
        os.utime(entry)  # recently used
    except OSError:
        pass
    return plan


def library(key: str) -> Path | None:
    """The kernel library of the entry ``key`` (None: not stored, or trimmed away); its
    arrays are in ``arrays/`` beside it."""
    path = folder() / key / "model.so"
    return path if path.is_file() else None


def store(key: str, plan: Plan) -> bool:
    """Keep ``plan`` under ``key``, then trim the cache to its size; whether it was stored.
    A cache that cannot be written (read-only, full disk) costs the speed-up, never the
    run: a warning."""
    root = folder()
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        try:
            plan.save(tmp / "e")
            final = root / key
            if final.exists():
                shutil.rmtree(final, ignore_errors=True)
            (tmp / "e").rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        trim(size_limit())
        return (root / key / "plan.json").is_file()
    except OSError as err:
        print(f"irgen: warning: compile cache {root}: not stored ({err})", file=sys.stderr)
        return False


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def trim(limit: int) -> None:
    """Remove the least recently used entries until the cache holds at most ``limit`` bytes
    (and stale temporary folders of stores that were interrupted)."""
    root = folder()
    if not root.is_dir():
        return
    now = time.time()
    entries = []
    for p in root.iterdir():
        if p.name.startswith("."):
            if p.is_dir() and now - p.stat().st_mtime > 3600:
                shutil.rmtree(p, ignore_errors=True)
            continue
        if p.is_dir():
            entries.append((p.stat().st_mtime, _size(p), p))
    total = sum(s for _, s, _ in entries)
    for _, size, p in sorted(entries, key=lambda e: e[0]):
        if total <= limit:
            break
        shutil.rmtree(p, ignore_errors=True)
        total -= size
