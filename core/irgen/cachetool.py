"""``irgen cache``: where the compile cache is, what it holds, clearing it, and checking that
its entries still give what a fresh compile gives.

``irgen cache verify`` takes entries (the most recently used first, ``--sample N`` of
them) and, for each that the current installation still reaches (its key is what a run
with the same request computes now), runs the model twice into a temporary folder: once
from the entry, once with ``--no-cache``; every file of the two outputs must be equal
(``manifest.json`` too, but for the command line and working folder). An entry the
installation no longer reaches (another version, option or model content) is listed with
what differs and never used.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from irgen import cache, runkey
from irgen.api import IrgenError
from irgen.safeio import human_bytes


def info() -> dict[str, Any]:
    """The cache's folder, size limit, entries and bytes."""
    found = cache.entries()
    return {"folder": str(cache.folder()), "limit": cache.size_limit(), "enabled": cache.enabled(),
            "entries": len(found), "bytes": sum(e["size"] for e in found)}


def listing() -> list[dict[str, Any]]:
    """One row per entry: name, model, frontend, quantizer, backend, opt level, size, last use."""
    rows = []
    for e in cache.entries():
        key = e.get("key") or {}
        rows.append({"name": e["name"], "model": (key.get("model") or {}).get("path"),
                     "frontend": key.get("frontend"), "quantizer": key.get("quantizer"),
                     "backend": key.get("backend"), "opt_level": key.get("opt_level"),
                     "depends": len(e.get("depends") or []), "size": e["size"],
                     "used": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["used"]))})
    return rows


def show(name: str) -> dict[str, Any]:
    """The ``key.json`` of entry ``name``: what it was keyed on, its dependencies, its request."""
    for e in cache.entries():
        if e["name"] == name or (len(name) >= 6 and e["name"].startswith(name)):
            return {k: v for k, v in e.items() if k != "used"}
    raise IrgenError(f"irgen cache show {name[:40]!r}: no such entry in {cache.folder()} (irgen cache list)")


def verify(host, sample: int | None = None, progress=None) -> list[dict[str, Any]]:
    """Recompute entries without the cache; one result per entry: ``name``, ``model`` and
    ``status`` (``same``, ``differs`` with ``files``, ``unreachable`` or ``error`` with
    ``detail``)."""
    chosen = cache.entries()[:sample] if sample else cache.entries()
    results = []
    for n, e in enumerate(chosen, 1):
        if progress is not None:
            progress.stage(f"entry {n}/{len(chosen)}: {e['name']} ({(e.get('request') or {}).get('model')})")
        results.append({"name": e["name"], "model": (e.get("request") or {}).get("model"), **_verify_entry(host, e)})
    return results


def _verify_entry(host, entry: dict[str, Any]) -> dict[str, Any]:
    from irgen import pipeline

    request = entry.get("request")
    if not isinstance(request, dict) or "model" not in request:
        return {"status": "error", "detail": "the entry records no request (made by an older irgen)"}
    model = Path(request["model"])
    options = dict(request.get("options") or {})
    try:
        key = pipeline.run_key(host, model, request["opt_level"], request["frontend"], request["backend"],
                               request["quantizer"], options)
    except IrgenError as err:
        return {"status": "unreachable", "detail": str(err)}
    if key.digest != entry["name"]:
        changed = runkey.differences(entry.get("key") or {}, key.doc)
        return {"status": "unreachable", "detail": "keyed on another " + ", ".join(changed[:6])}
    tmp = Path(tempfile.mkdtemp(prefix="irgen-cache-verify-"))
    try:
        outs = {}
        for label, use in (("cached", True), ("fresh", False)):
            outs[label] = tmp / label
            pipeline.run(host, model, outs[label], opt_level=request["opt_level"], frontend=request["frontend"],
                         backend=request["backend"], quantizer=request["quantizer"],
                         options={**options, "cache": use, "debug": "all"})
        differ = _differing_files(outs["cached"], outs["fresh"])
    except IrgenError as err:
        return {"status": "error", "detail": str(err)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"status": "differs", "files": differ} if differ else {"status": "same"}


def _differing_files(a: Path, b: Path) -> list[str]:
    """The relative paths whose bytes differ (or that only one folder has); ``manifest.json``
    compared without the command line and working folder."""
    def files(root: Path) -> dict[str, bytes]:
        out = {}
        for p in sorted(root.rglob("*")):
            if p.is_file() and not p.is_symlink():
                data = p.read_bytes()
                if p.name == "manifest.json":
                    doc = json.loads(data)
                    doc.pop("command", None), doc.pop("cwd", None)
                    data = json.dumps(doc, sort_keys=True).encode()
                out[p.relative_to(root).as_posix()] = data
        return out

    fa, fb = files(a), files(b)
    return sorted(k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k))


def format_info(d: dict[str, Any]) -> str:
    state = "on" if d["enabled"] else "off (IRGEN_CACHE_SIZE=0)"
    return (f"folder:  {d['folder']}\nstate:   {state}\nlimit:   {human_bytes(d['limit'])}\n"
            f"entries: {d['entries']} ({human_bytes(d['bytes'])})")
