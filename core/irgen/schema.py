"""The JSON Schema of ``ir.json`` (draft 2020-12), shipped in the package.

``irgen schema`` prints it; ``irgen verify`` and ``irgen inspect`` check an
output folder's IR against it before they use it (:func:`check_ir`).

``ir_version`` follows semantic versioning (``MAJOR.MINOR.PATCH``, a string;
docs/ir-changelog.md lists the versions). A reader takes any IR of its major
version up to its own minor version; the integer ``1`` that irgen wrote before
the version was a string is read as ``1.0.0``.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from irgen.api import IrgenError

__all__ = ["SCHEMA_RESOURCE", "MAX_REPORTED", "schema", "schema_text", "ir_version", "validate_ir", "check_ir"]

#: where the schema lives in the package
SCHEMA_RESOURCE = ("schemas", "ir.schema.json")
#: how many violations an error names
MAX_REPORTED = 10

_SEMVER = re.compile(r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\Z")
_MESSAGE_CHARS = 200


def schema_text() -> str:
    """The schema, as the package ships it (JSON text)."""
    from importlib.resources import files

    return files("irgen").joinpath(*SCHEMA_RESOURCE).read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def _schema() -> dict[str, Any]:
    return json.loads(schema_text())


def schema() -> dict[str, Any]:
    """The schema of ``ir.json`` (a fresh copy: the caller may change it)."""
    return json.loads(json.dumps(_schema()))


def _version_of(value: Any) -> tuple[int, int, int] | None:
    if value == 1 and type(value) is int:  # irgen wrote the integer 1 before ir_version was semver
        return 1, 0, 0
    m = _SEMVER.match(value) if isinstance(value, str) else None
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def ir_version(ir: dict[str, Any]) -> str | None:
    """``ir_version`` of a parsed ``ir.json`` as ``MAJOR.MINOR.PATCH`` (the old integer 1 is
    ``1.0.0``); None when it is missing or not a version."""
    v = _version_of(ir.get("ir_version")) if isinstance(ir, dict) else None
    return ".".join(map(str, v)) if v else None


#: the version of the IR ``ir.json`` is written in: semver (docs/ir-changelog.md); its schema is
#: ``irgen/schemas/ir.schema.json``
IR_VERSION = "2.8.0"

#: older major versions this irgen still reads (major -> newest minor): an IR 1.x file
#: differs from 2.0 only in a layer's ``bias`` shape (the broadcast one), and its
#: ``fused_ops`` read it as it is, so verify and inspect take it as it is
OLDER_READABLE = {1: 1}


def _current() -> tuple[int, int, int]:
    return _version_of(IR_VERSION)


def _path(err) -> str:
    """The JSON path of a violation as irgen writes paths (``layers[3].outputs[0].shape``)."""
    return err.json_path.removeprefix("$").removeprefix(".")


def _message(err) -> str:
    msg = " ".join(err.message.split())
    return msg if len(msg) <= _MESSAGE_CHARS else msg[: _MESSAGE_CHARS - 3] + "..."


def validate_ir(ir: Any) -> list[str]:
    """Every violation of the schema in the parsed ``ir.json`` ``ir``, as ``PATH: message``
    (PATH empty for the document itself), sorted by path; [] when it is valid.

    An IR of another major version, or of a newer minor version than this irgen
    writes, is one violation of ``ir_version`` (its records are not checked)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    current = _current()
    version = _version_of(ir.get("ir_version")) if isinstance(ir, dict) else None
    readable = {**OLDER_READABLE, current[0]: current[1]}
    if version is not None and (version[0] not in readable or version[1] > readable[version[0]]):
        return [f"ir_version: {ir['ir_version']!r:.40} is not readable by this irgen, which reads IR "
                f"{', '.join(f'{m}.0.0 to {m}.{n}.x' for m, n in sorted(readable.items()))} (a newer irgen may read it)"]
    found = []
    for err in Draft202012Validator(_schema()).iter_errors(ir):
        if err.context:  # anyOf: an alternative of the instance's type says what is wrong
            err = best_match([c for c in err.context if c.validator != "type"] or err.context)
        found.append((list(err.absolute_path), _path(err), _message(err)))
    found.sort(key=lambda f: [(0, k) if isinstance(k, int) else (1, k) for k in f[0]])
    return [f"{path}: {msg}" if path else msg for _, path, msg in found]


def check_ir(ir: Any, where: str) -> dict[str, Any]:
    """``ir`` if it is valid against the schema; else one IrgenError naming ``where`` and
    the first :data:`MAX_REPORTED` violations (JSON path and message)."""
    problems = validate_ir(ir)
    if not problems:
        return ir
    shown = "; ".join(problems[:MAX_REPORTED])
    more = f"; and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
    n = len(problems)
    raise IrgenError(f"{where}: not a valid irgen IR ({n} violation{'s' if n > 1 else ''} of its schema, "
                     f"which `irgen schema` prints): {shown}{more}")
