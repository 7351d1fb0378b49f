"""irgen's built-in IR serializer: ``ir.json`` (registered as ``json``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from irgen.api import Serializer
from irgen.hookspecs import hookimpl


def write_json(ir: dict[str, Any], out_dir: Path) -> list[Path]:
    path = out_dir / "ir.json"
    path.write_text(json.dumps(ir, indent=1, allow_nan=False) + "\n")
    return [path]


@hookimpl
def irgen_register_serializers(register):
    register(Serializer("json", write_json, "the custom IR as ir.json, the format verify and inspect read (irgen schema prints its JSON Schema)"))
