"""The output folder: written whole or not at all, with a manifest of every file."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

from irgen.api import IrgenError


_PARTIAL = ".irgen-partial-"
_NAME_ROOM = 60  # bytes the hidden sibling's name adds to OUT's name


def _process_tag(pid: int) -> str | None:
    """``PID-STARTTIME`` of a live process (Linux), so a reused PID is not taken for the old one."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return f"{pid}-{int(fields[19])}"
    except (OSError, IndexError, ValueError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return f"{pid}-0"


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


class OutputFolder:
    """Writes into a hidden sibling folder and puts it in place on success.

    Used as a context manager: an exception, Ctrl-C or SIGTERM removes the
    partial folder, so OUT appears complete or not at all. An existing
    non-empty OUT is an error unless ``force``; it is replaced only once the
    new one is complete, by one atomic exchange of the two folders (Linux), so
    at every instant OUT is either the old folder or the new one. After a
    SIGKILL the hidden folder stays behind; the next run on the same OUT
    removes the hidden folders of processes that no longer run.

    ``protect`` lists paths OUT must not contain (the model, the input files,
    the current folder): replacing OUT would delete them.
    """

    def __init__(self, out: Path, force: bool, protect: list[tuple[str, Path]] = ()):
        self.out = Path(out)
        self.force = force
        name = self.out.name
        if not name or name in (".", ".."):
            raise IrgenError(f"{out}: not a folder name to write into; name a new folder, e.g. -o {out}/irgen-out")
        if os.path.islink(self.out):
            try:
                os.stat(self.out)
            except OSError as err:
                raise IrgenError(f"{out}: a symbolic link that leads nowhere ({err.strerror})") from None
        final = Path(os.path.realpath(self.out))
        for what, path in protect:
            if path is not None and _contains(final, Path(path)):
                raise IrgenError(f"{out}: the output folder would contain {what} {path}; "
                                 f"irgen replaces OUT whole, so choose a folder that does not hold it")
        try:
            st = os.stat(final)
        except FileNotFoundError:
            st = None
        except OSError as err:
            raise IrgenError(f"{out}: cannot use as the output folder ({err.strerror})") from None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise IrgenError(f"{out}: exists and is not a folder")
        if st is not None and any(os.scandir(final)) and not force:
            raise IrgenError(f"{out}: folder exists and is not empty (use --force to replace it)")
        parent = final.parent
        if not parent.is_dir():
            raise IrgenError(f"{out}: parent folder {parent} does not exist")
        try:
            name_max = os.pathconf(parent, "PC_NAME_MAX")
        except (OSError, ValueError):
            name_max = 255
        if len(os.fsencode(final.name)) > name_max:
            raise IrgenError(f"{out}: the folder name is {len(os.fsencode(final.name))} bytes, "
                             f"longer than this file system allows ({name_max})")
        self.final = final
        self.stem = f".{final.name[: max(1, name_max - _NAME_ROOM)]}{_PARTIAL}"
        tag = _process_tag(os.getpid()) or str(os.getpid())
        self.tmp = parent / f"{self.stem}{tag}"

    def remove_stale(self) -> list[Path]:
        """Remove hidden partial folders of OUT left by irgen processes that no longer run."""
        removed = []
        try:
            entries = list(os.scandir(self.final.parent))
        except OSError:
            return removed
        for entry in entries:
            if not entry.name.startswith(self.stem) or not entry.is_dir(follow_symlinks=False):
                continue
            tag = entry.name[len(self.stem):]
            pid, _, rest = tag.partition("-")
            start = rest.split("-")[0]
            if not pid.isdigit():
                continue
            alive = _process_tag(int(pid))
            started = alive.split("-")[1] if alive else None
            if alive is None or (start not in ("", "0") and started not in ("0", start)):  # dead, or PID reused
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
        return removed

    def __enter__(self) -> "OutputFolder":
        self.remove_stale()
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        try:
            self.tmp.mkdir()
        except OSError as err:
            raise IrgenError(f"{self.out}: cannot create the output folder in {self.final.parent} ({err.strerror})") from None
        return self

    def path(self, rel: str) -> Path:
        p = self.tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if isinstance(exc, OSError):
                where = f" ({exc.filename})" if exc.filename else ""
                raise IrgenError(f"{self.out}: writing the output failed: {exc.strerror or exc}{where}; "
                                 f"nothing was written{' and the old folder is kept' if self.final.exists() else ''}") from None
            return
        try:
            self._put_in_place()
        except OSError as err:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise IrgenError(f"{self.out}: cannot put the output in place ({err.strerror or err})") from None

    def _put_in_place(self) -> None:
        final = self.final
        if final.exists():
            if _exchange(self.tmp, final):  # tmp now holds the old folder
                shutil.rmtree(self.tmp, ignore_errors=True)
                return
            trash = final.parent / f"{self.stem}{self.tmp.name[len(self.stem):]}-old"
            final.rename(trash)
            self.tmp.rename(final)
            shutil.rmtree(trash, ignore_errors=True)
            return
        self.tmp.rename(final)


def umask() -> int:
    """The process's umask, read without changing it where Linux tells it (``/proc/self/status``;
    setting it to read it would, for an instant, leave other threads' new files open to all)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a new file gets from ``open``: ``0o666`` less the umask. A file made with
    ``tempfile.mkstemp`` (``0o600``) is given it before it is put in place."""
    return 0o666 & ~umask()


def folder_mode() -> int:
    """The mode a new folder gets from ``mkdir``: ``0o777`` less the umask (for one made with
    ``tempfile.mkdtemp``, ``0o700``, before it is put in place)."""
    return 0o777 & ~umask()


def _contains(folder: Path, path: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it (after resolving links)."""
    p = Path(os.path.realpath(path))
    return p == folder or folder in p.parents


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_identity(st: os.stat_result) -> tuple[int, ...]:
    """The same file (a hard link of it too), unchanged: device, inode, size, modification time."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def write_manifest(folder: OutputFolder, info: dict[str, Any], data_files: dict[str, dict[str, Any]] | None = None,
                   known: dict[tuple[int, ...], str] | None = None) -> Path:
    """``manifest.json``: every file with size and sha256, plus ``info``; a tensor's data
    file also with what ``data_files`` says of its content (``tensor``, ``dtype``,
    ``shape``, ``layout``, ``byte_order``, ...), keyed by its path relative to OUT.
    ``known``: the sha256 of files hashed before, by :func:`file_identity` (the parameter
    files ``irgen run --inputs`` links into every sample's folder: hashed once)."""
    files = []
    for p in sorted(folder.tmp.rglob("*")):
        if p.is_file():
            rel = p.relative_to(folder.tmp).as_posix()
            extra = {k: v for k, v in (data_files or {}).get(rel, {}).items() if k not in ("path", "size", "sha256")}
            st = p.stat()
            digest = (known or {}).get(file_identity(st)) or sha256_file(p)
            files.append({"path": rel, "size": st.st_size, "sha256": digest, **extra})
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
