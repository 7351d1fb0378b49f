"""The output folder: written whole or not at all, with a manifest of every file."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

from irgen.api import IrgenError


class OutputFolder:
    """Writes into a hidden sibling folder and renames it into place on success.

    Used as a context manager: an exception (or Ctrl-C) removes the partial
    folder, so OUT appears complete or not at all. An existing non-empty OUT
    is an error unless ``force``; it is replaced only once the new one is
    complete.
    """

    def __init__(self, out: Path, force: bool):
        self.out = out
        self.force = force
        if out.exists() and not out.is_dir():
            raise IrgenError(f"{out}: exists and is not a folder")
        if out.is_dir() and any(out.iterdir()) and not force:
            raise IrgenError(f"{out}: folder exists and is not empty (use --force to replace it)")
        parent = out.resolve().parent
        if not parent.is_dir():
            raise IrgenError(f"{out}: parent folder {parent} does not exist")
        self.tmp = parent / f".{out.name}.irgen-partial-{os.getpid()}"

    def __enter__(self) -> "OutputFolder":
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()
        return self

    def path(self, rel: str) -> Path:
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        final = self.out.resolve()
        trash = None
        if final.exists():
            trash = final.parent / f".{final.name}.irgen-old-{os.getpid()}"
            final.rename(trash)
        self.tmp.rename(final)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: OutputFolder, info: dict[str, Any]) -> Path:
    """``manifest.json``: every file with size and sha256, plus ``info``."""
    files = []
    for p in sorted(folder.tmp.rglob("*")):
        if p.is_file():
            files.append({"path": p.relative_to(folder.tmp).as_posix(), "size": p.stat().st_size, "sha256": sha256_file(p)})
    path = folder.path("manifest.json")
    path.write_text(json.dumps({**info, "files": files}, indent=1) + "\n")
    return path


class ParamsStreamWriter:
    """Writes ``tvm.runtime.save_param_dict``'s format one tensor at a time.

    The names come first in that format, so they are given up front; each
    tensor is appended as it is produced and memory does not grow with the
    number of tensors. ``tvm.runtime.load_param_dict`` reads the result.
    """

    _MAGIC = 0xF7E58D4F05049CB7

    def __init__(self, path: Path, names: list[str]):
        self.names = names
        self.count = 0
        self.f = open(path, "wb")
        self.f.write(struct.pack("<QQQ", self._MAGIC, 0, len(names)))
        for n in names:
            b = n.encode()
            self.f.write(struct.pack("<Q", len(b)) + b)
        self.f.write(struct.pack("<Q", len(names)))

    def add(self, name: str, tensor: Any) -> None:
        import tvm

        if self.count >= len(self.names) or self.names[self.count] != name:
            raise IrgenError(f"internal: debug tensor {name!r} out of order")
        blob = bytes(tvm.runtime.save_param_dict({"x": tensor}))
        self.f.write(blob[8 + 8 + 8 + 8 + 1 + 8:])
        self.count += 1

    def close(self) -> None:
        self.f.close()
        if self.count != len(self.names):
            raise IrgenError(f"internal: {len(self.names) - self.count} debug tensors were not produced")


class Progress:
    """Stage and layer progress on stderr: one live line on a terminal, plain lines otherwise."""

    def __init__(self, enabled: bool = True, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.live = enabled and self.stream.isatty()
        self.stages: list[str] = []
        self._last = ""

    def stage(self, text: str) -> None:
        if not self.enabled:
            return
        self.stages.append(text)
        self._emit(f"[{len(self.stages)}] {text}", final=True)

    def step(self, text: str, i: int, n: int) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * i / max(n, 1))
        line = f"    [{'#' * filled}{'.' * (width - filled)}] {i}/{n} {text}"
        if self.live:
            self._emit(line)
        elif i == n:
            self._emit(f"    {n}/{n} {text}", final=True)

    def _emit(self, line: str, final: bool = False) -> None:
        if self.live:
            pad = max(0, len(self._last) - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._last = line
            if final:
                self.stream.write("\n")
                self._last = ""
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self, text: str) -> None:
        if not self.enabled:
            return
        if self.live and self._last:
            self.stream.write("\n")
            self._last = ""
        self.stream.write(text + "\n")
        self.stream.flush()
