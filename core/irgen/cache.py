"""The compile cache: a model's compiled plan, kept in a user cache folder so that a
second ``irgen run`` of the same model skips import, layer forming and compile.

An entry is keyed by everything that determines the plan (:mod:`irgen.runkey`: the
model's files by name and content, every option and ``IRGEN_*`` variable that can change
a value, irgen's and every plugin's code, the versions of Python and of every installed
distribution) and is used only while the files and code its import read besides the
model (external data, a ``--model-class`` module) are unchanged. It holds ``key.json``
(what it was keyed on, those dependencies, the run that made it), ``plan.json``, the
parameter arrays and the kernels' constants as ``.npy`` (read without pickle, each
when needed: ``irgen.plan.Stored``) and the exported library (the kernels, without
the weights when irgen's executor runs the plan).

* Folder: ``$IRGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/irgen``, else ``~/.cache/irgen``.
* Size: ``$IRGEN_CACHE_SIZE`` bytes (suffixes K, M, G; default 2G); the least recently
  used entries are removed after each store. ``0`` turns the cache off.
* ``irgen run --no-cache`` neither reads nor writes it.

An entry appears complete or not at all (written into a temporary folder, renamed into
place); an unreadable or stale entry is removed and compiled anew. The cache never changes a
golden value: a cached run writes the same bytes as a fresh one (tested).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from irgen import envflags, runkey
from irgen.api import IrgenError
from irgen.plan import Plan
from irgen.runkey import KEY_FORMAT, PlanKey
from irgen.safeio import read_json

#: in an entry: what it was keyed on, its import's dependencies and the run that made it
KEY_FILE = "key.json"

DEFAULT_SIZE = 2 << 30


def folder() -> Path:
    """The cache folder (not created)."""
    if os.environ.get("IRGEN_CACHE_DIR"):
        return Path(os.environ["IRGEN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "irgen"


def size_limit() -> int:
    """``$IRGEN_CACHE_SIZE`` in bytes (``DEFAULT_SIZE`` when unset; 0 turns the cache off)."""
    return envflags.size("IRGEN_CACHE_SIZE", DEFAULT_SIZE)


def enabled() -> bool:
    """Whether the cache is on (``$IRGEN_CACHE_SIZE`` is not 0)."""
    return size_limit() > 0


def load(key: PlanKey) -> tuple[Plan | None, str | None]:
    """The plan stored under ``key`` and None, or None and why none is used (nothing stored,
    with what a near entry of the same model was keyed on differently; or the entry is stale:
    a file or module its import read has changed since, and the entry is removed)."""
    entry = folder() / key.digest
    if not (entry / "plan.json").is_file():
        return None, _near_miss(key)
    try:
        recorded = read_json(entry / KEY_FILE, "compile cache key")
        depends = recorded["depends"]
        why = runkey.stale(depends, Path(key.doc["model"]["path"]))
        if why is None:
            plan = Plan.load(entry)
    except (IrgenError, KeyError, TypeError) as err:
        shutil.rmtree(entry, ignore_errors=True)
        return None, f"an unreadable entry was removed ({' '.join(str(err).split())[:200]})"
    if why is not None:
        shutil.rmtree(entry, ignore_errors=True)
        return None, f"the stored compile is stale ({why}): compiling again"
    plan.keyed = {"key": key.digest, "depends": depends}
    try:
        os.utime(entry)  # recently used
    except OSError:
        pass
    return plan, None


def _near_miss(key: PlanKey) -> str | None:
    """What the newest entry of the same model was keyed on differently, or None."""
    best = None
    for recorded in entries():
        doc = recorded.get("key") or {}
        if (doc.get("model") or {}).get("path") == key.doc["model"]["path"]:
            if best is None or recorded["used"] > best["used"]:
                best = recorded
    if best is None:
        return None
    changed = runkey.differences(best["key"], key.doc)
    shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
    return f"not stored; the entry for this model was keyed on another {shown}" if changed else None


def entries() -> list[dict[str, Any]]:
    """Every complete entry's ``key.json`` with its ``name``, ``size`` (bytes) and ``used``
    (last use, seconds since the epoch), most recently used first."""
    root = folder()
    found = []
    if not root.is_dir():
        return found
    for p in root.iterdir():
        if p.name.startswith(".") or not (p / "plan.json").is_file():
            continue
        try:
            recorded = read_json(p / KEY_FILE, "compile cache key")
        except IrgenError:
            recorded = {}
        if isinstance(recorded, dict):
            found.append({**recorded, "name": p.name, "size": _size(p), "used": p.stat().st_mtime})
    return sorted(found, key=lambda e: -e["used"])


def library(key: PlanKey) -> Path | None:
    """The kernel library of the entry ``key`` (None: not stored, or trimmed away); its
    arrays are in ``arrays/`` beside it."""
    path = folder() / key.digest / "model.so"
    return path if path.is_file() else None


def store(key: PlanKey, plan: Plan, request: dict[str, Any]) -> bool:
    """Keep ``plan`` under ``key`` with ``key.json`` (what it was keyed on, the dependencies
    its import read, and ``request``: the run that made it, for ``irgen cache verify``), then
    trim the cache to its size; whether it was stored. A cache that cannot be written
    (read-only, full disk) costs the speed-up, never the run: a warning."""
    root = folder()
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key.digest}.", dir=root))
        try:
            plan.save(tmp / "e")
            recorded = {"format": KEY_FORMAT, "key": key.doc, "depends": plan.keyed["depends"], "request": request}
            (tmp / "e" / KEY_FILE).write_text(json.dumps(recorded, indent=1, default=str) + "\n")
            final = root / key.digest
            if final.exists():
                shutil.rmtree(final, ignore_errors=True)
            (tmp / "e").rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        trim(size_limit())
        return (root / key.digest / "plan.json").is_file()
    except OSError as err:
        print(f"irgen: warning: compile cache {root}: not stored ({err})", file=sys.stderr)
        return False


def clear() -> tuple[int, int]:
    """Remove every entry (and leftover temporary folder); (entries removed, bytes freed)."""
    root = folder()
    count = freed = 0
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and not p.is_symlink():
                count += not p.name.startswith(".")
                freed += _size(p)
                shutil.rmtree(p, ignore_errors=True)
    return count, freed


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
