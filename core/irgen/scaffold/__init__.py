"""``irgen new-plugin KIND NAME``: write a working plugin project from the templates here.

``templates/common/`` holds ``pyproject.toml`` and ``README.md``, ``templates/<kind>/``
the package (``package/`` becomes ``irgen_<name>/``) and its tests; every file ends
in ``.tmpl`` and its ``{{KEY}}`` tokens are replaced (:func:`tokens`). The project is
written into a hidden sibling folder and renamed into place when complete, so an
error leaves nothing half-written; an existing target is refused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from irgen.api import IrgenError
from irgen.output import folder_mode

KINDS = ("frontend", "quantizer", "backend", "serializer")
#: a plugin name: lowercase letters and digits, words joined by single '-' or '_'
NAME_RE = re.compile(r"[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*")
MAX_NAME = 40


def _about(kind: str) -> dict[str, str]:
    """The ``{{KEY}}`` values that describe a ``kind`` project (``SUMMARY``, ``USAGE``, ``DETAILS``,
    ``CHECK``, ``DEPENDENCIES``: its ``pyproject.toml``'s other requirements), from the
    ``about.json`` beside the kind's templates."""
    path = resources.files("irgen.scaffold") / "templates" / kind / "about.json"
    return json.loads(path.read_text(encoding="utf-8"))


def check_name(name: str) -> str:
    """``name`` if it is a safe plugin name (it becomes a package, a distribution and a
    registered name); otherwise an IrgenError saying what a name may hold."""
    if not isinstance(name, str) or len(name) > MAX_NAME or not NAME_RE.fullmatch(name):
        raise IrgenError(f"plugin name {str(name)[:60]!r}: use lowercase letters and digits, words joined by single "
                         f"'-' or '_', starting with a letter, at most {MAX_NAME} characters (e.g. acme-npu)")
    return name


def tokens(kind: str, name: str) -> dict[str, str]:
    """The ``{{KEY}}`` values of the templates for plugin ``name`` of ``kind``."""
    from irgen import __version__
    from irgen.plugin import API_VERSION

    ident = name.replace("-", "_")
    base = {"NAME": name, "IDENT": ident, "PACKAGE": f"irgen_{ident}", "DIST": f"irgen-{name}", "KIND": kind,
            "IRGEN_VERSION": __version__, "API_MAJOR": API_VERSION.split(".")[0], "SUFFIX": f".{name}.json"}
    about = {k: _fill(v, base) for k, v in _about(kind).items()}
    return {**base, **about}


def _fill(text: str, values: dict[str, str]) -> str:
    def one(m: re.Match) -> str:
        return values[m.group(1)] if m.group(1) in values else m.group(0)

    return re.sub(r"\{\{([A-Z_]+)\}\}", one, text)


def _templates(kind: str):
    """(path in the project, template text) of every file of a ``kind`` project."""
    root = resources.files("irgen.scaffold") / "templates"
    for sub in ("common", kind):
        stack = [(root / sub, "")]
        while stack:
            folder, rel = stack.pop()
            for entry in sorted(folder.iterdir(), key=lambda e: e.name):
                if entry.is_dir():
                    stack.append((entry, f"{rel}{entry.name}/"))
                elif entry.name.endswith(".tmpl"):
                    yield rel + entry.name.removesuffix(".tmpl"), entry.read_text(encoding="utf-8")


def new_plugin(kind: str, name: str, dest: str | Path | None = None) -> Path:
    """Write a ``kind`` plugin project named ``name`` into ``dest`` (default ``./irgen-NAME``),
    which must not exist; returns its path."""
    if kind not in KINDS:
        raise IrgenError(f"unknown plugin kind {kind!r} (choose from {', '.join(KINDS)})")
    values = tokens(kind, check_name(name))
    target = Path(dest) if dest is not None else Path(values["DIST"])
    if os.path.lexists(target):
        raise IrgenError(f"{target} already exists: give a new folder with -o DIR")
    parent = target.absolute().parent
    if not parent.is_dir():
        raise IrgenError(f"{parent}: no such folder")
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=parent))
    try:
        for rel, text in _templates(kind):
            path = tmp / rel.replace("package/", values["PACKAGE"] + "/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(_fill(text, values), encoding="utf-8")
        os.chmod(tmp, folder_mode())  # mkdtemp's 0700 -> what mkdir would give
        if os.path.lexists(target):  # appeared meanwhile
            raise IrgenError(f"{target} already exists: give a new folder with -o DIR")
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
