"""Reading untrusted files safely: regular files only, paths kept inside a folder,
sizes checked before anything is allocated.

Everything irgen reads comes from outside: the model, its input files, and an
output folder that ``irgen verify``/``irgen inspect`` are pointed at (whose
``ir.json`` and ``manifest.json`` may have been edited by anyone). The rules:

- only regular files are opened (a FIFO would block ``open`` forever, a device
  such as ``/dev/zero`` never ends); a file is opened non-blocking and checked
  again with ``fstat`` after opening, so a file swapped for a FIFO in between
  cannot block either;
- a path taken *out of* a file (a manifest entry, a tensor record's ``file``)
  must be relative, without ``..``, and must resolve inside its folder;
  nothing outside is opened or stat'ed;
- a tensor's size is checked against a limit (``--max-tensor-bytes``) before
  it is allocated, and against the file's own size before it is read.

Plugins use these helpers through ``irgen.safeio``; every failure is an
:class:`irgen.api.IrgenError` with one line naming the file or tensor.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Iterable, Iterator

from irgen.api import IrgenError

#: default for ``--max-tensor-bytes``: no single tensor (input, constant,
#: activation, file read back) may hold more than this
DEFAULT_MAX_TENSOR_BYTES = 2 << 30
#: the largest JSON file (ir.json, manifest.json) irgen reads back
MAX_JSON_BYTES = 256 << 20
#: the largest zip directory (the list of members) of a ``.npz`` irgen reads: some 100,000 arrays
MAX_NPZ_DIRECTORY = 16 << 20
#: the longest member name a zip entry holds, in bytes
MAX_ZIP_NAME = 0xFFFF
#: array data is read in pieces of this many bytes (a compressed member is never expanded further)
_CHUNK = 1 << 20

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000 ** 2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000 ** 3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000 ** 4,
          "tib": 1 << 40}


def byte_count(text: str) -> int:
    """``"512M"``, ``"2GiB"``, ``"0"``, ``"1.5k"`` -> a byte count, exact (no float rounding or
    overflow); ``ValueError`` for anything else (``inf``, ``-1``, ``1e9``, an unknown unit)."""
    from fractions import Fraction

    m = re.fullmatch(r"\s*(\d{1,30}(?:\.\d{1,30})?)\s*([A-Za-z]{0,3})\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {str(text)[:40]!r} (e.g. 512M, 2G, 1000000)")
    return int(Fraction(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_bytes(text: str) -> int:
    """``"512M"``, ``"2GiB"``, ``"1000000"`` -> a positive byte count (argparse type)."""
    value = byte_count(text)
    if value <= 0:
        raise ValueError(f"not a positive size: {str(text)[:40]!r}")
    return value


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def itemsize(dtype: Any) -> int:
    import numpy as np

    try:
        return max(1, (dtype if isinstance(dtype, np.dtype) else np.dtype(str(dtype))).itemsize)
    except (TypeError, ValueError):
        return 8  # an unknown dtype: count it as the widest


def tensor_bytes(shape: Iterable[Any], dtype: Any = "float32") -> int:
    """Bytes of a dense tensor; exact with Python ints (no overflow)."""
    return math.prod(int(d) for d in shape) * itemsize(dtype)


def check_tensor_size(what: str, shape: Iterable[Any], dtype: Any, limit: int | None) -> None:
    """Refuse a tensor over ``limit`` bytes before it is made, naming it and its size.

    ``what`` names the tensor, e.g. ``"input 'x'"`` or ``"tensor 'y' (ConstantOfShape)"``.
    A negative dimension is refused too."""
    shape = [int(d) for d in shape]
    if any(d < 0 for d in shape):
        raise IrgenError(f"{what}: negative dimension in shape {tuple(shape)}")
    if limit is None:
        return
    size = tensor_bytes(shape, dtype)
    if size > limit:
        raise IrgenError(
            f"{what} would hold {human_bytes(size)} (shape {tuple(shape)}, {dtype}), over the limit of "
            f"{human_bytes(limit)}; raise it with --max-tensor-bytes if this is meant"
        )


# ------------------------------------------------------------------ files


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def _stat(path: Path, what: str) -> os.stat_result:
    try:
        return os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise IrgenError(f"{what} {path}: a symbolic link to nothing") from None
        raise IrgenError(f"{what} {path}: no such file") from None
    except OSError as err:  # ELOOP (symlink loop), ENAMETOOLONG, EACCES, ...
        raise IrgenError(f"{what} {path}: cannot read ({err.strerror or err})") from None


def regular_file(path: Path | str, what: str = "file") -> Path:
    """``path`` if it is (a link to) a regular file, else one clear error."""
    path = Path(path)
    st = _stat(path, what)
    if not stat.S_ISREG(st.st_mode):
        raise IrgenError(f"{what} {path}: {_kind(st.st_mode)}, not a regular file")
    return path


def file_or_folder(path: Path | str, what: str = "model") -> Path:
    """A model may be a file or a folder (a SavedModel): anything else is refused."""
    path = Path(path)
    st = _stat(path, what)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise IrgenError(f"{what} {path}: {_kind(st.st_mode)}, not a regular file or folder")
    return path


def regular_tree(folder: Path | str, what: str = "model folder", max_entries: int = 100_000) -> list[Path]:
    """The files of a folder model (a SavedModel), all checked before any is read.

    Every entry must be a regular file or a folder; a link must lead to one of
    those inside ``folder``. Returns the files, sorted, for hashing."""
    root = Path(folder)
    real_root = Path(os.path.realpath(root))
    files: list[Path] = []
    count = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in sorted(dirnames) + sorted(filenames):
            count += 1
            if count > max_entries:
                raise IrgenError(f"{what} {root}: more than {max_entries} entries")
            p = Path(dirpath) / name
            if os.path.islink(p):
                target = Path(os.path.realpath(p))
                if target != real_root and real_root not in target.parents:
                    raise IrgenError(f"{what} {root}: {p.relative_to(root)} is a link that leads outside the folder")
            try:
                st = os.stat(p)
            except OSError as err:
                raise IrgenError(f"{what} {root}: {p.relative_to(root)}: {err.strerror or err}") from None
            if stat.S_ISREG(st.st_mode):
                if name in filenames or os.path.islink(p):
                    files.append(p)
            elif not stat.S_ISDIR(st.st_mode):
                raise IrgenError(f"{what} {root}: {p.relative_to(root)} is {_kind(st.st_mode)}, not a regular file")
    return sorted(files)


#: the set :func:`recording_reads` collects opened files into (None: not recording)
_READS: contextvars.ContextVar[set[Path] | None] = contextvars.ContextVar("irgen_reads", default=None)


@contextlib.contextmanager
def recording_reads(into: set[Path] | None = None) -> Iterator[set[Path]]:
    """Every file :func:`open_regular` opens inside the block, as a resolved path, added to
    ``into`` (or a new set): what an import read, for the compile cache's key."""
    reads = set() if into is None else into
    token = _READS.set(reads)
    try:
        yield reads
    finally:
        _READS.reset(token)


def open_regular(path: Path | str, what: str = "file"):
    """Open a regular file for binary reading without ever blocking.

    The file is opened with ``O_NONBLOCK`` (a FIFO put in its place after the
    check opens at once instead of waiting for a writer) and checked with
    ``fstat`` on the open descriptor. Inside :func:`recording_reads` the file is
    recorded."""
    path = regular_file(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise IrgenError(f"{what} {path}: cannot open ({err.strerror or err})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise IrgenError(f"{what} {path}: {_kind(st.st_mode)}, not a regular file")
    os.set_blocking(fd, True)
    reads = _READS.get()
    if reads is not None:
        reads.add(Path(os.path.realpath(path)))
    return os.fdopen(fd, "rb")


def read_bytes(path: Path | str, what: str = "file", limit: int | None = None) -> bytes:
    """The whole of a regular file, refusing one over ``limit`` bytes."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if limit is not None and size > limit:
            raise IrgenError(f"{what} {path}: {human_bytes(size)}, over the limit of {human_bytes(limit)}")
        return f.read() if limit is None else f.read(limit + 1)


def read_json(path: Path | str, what: str, limit: int = MAX_JSON_BYTES) -> Any:
    """A JSON document from a regular file; one clear error when it is not one."""
    data = read_bytes(path, what, limit)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise IrgenError(f"{what} {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise IrgenError(f"{what} {path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    except RecursionError:
        raise IrgenError(f"{what} {path}: not valid JSON (nested too deeply)") from None
    except ValueError as err:  # an integer of more than sys.get_int_max_str_digits() digits
        raise IrgenError(f"{what} {path}: not valid JSON ({' '.join(str(err).split())[:120]})") from None


# ------------------------------------------------------------------ paths inside a folder


def inside(root: Path | str, rel: Any, what: str = "path", folder: str = "the output folder") -> Path:
    """``root/rel`` for a path taken out of a file in ``root``; refuses an escape.

    ``rel`` must be a non-empty relative POSIX path without ``..``, NUL or a
    backslash, and ``root/rel`` must resolve (following symlinks) inside
    ``root`` (``folder`` names it in messages). Nothing is opened or stat'ed outside ``root``: the lexical checks
    come first, then the path is resolved one component at a time from
    ``root``, and a symbolic link whose target leaves ``root`` is refused from
    its text (``readlink``), before anything at the target is looked at."""
    if not isinstance(rel, str) or not rel:
        raise IrgenError(f"{what}: expected a relative file path, got {rel!r:.80}")
    if "\x00" in rel or "\\" in rel:
        raise IrgenError(f"{what} {rel!r:.200}: not a plain relative path")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or rel.startswith("~"):
        raise IrgenError(f"{what} {rel!r:.200}: points outside {folder}")
    root_real = os.path.realpath(root)
    return Path(_resolve_inside(root_real, list(pure.parts), f"{what} {rel!r:.200}", folder))


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _resolve_inside(root: str, parts: list[str], what: str, folder: str = "the output folder") -> str:
    """``root`` joined with ``parts``, symbolic links resolved as the kernel would, as long
    as every step stays inside ``root`` (else IrgenError); only paths inside ``root`` are
    passed to ``lstat``/``readlink``."""
    escape = IrgenError(f"{what}: a link that points outside {folder}")
    current, pending, hops = root, list(parts), 0
    while pending:
        name = pending.pop(0)
        if name in ("", "."):
            continue
        if name == "..":  # only from a link's target: applied to the resolved folder
            current = os.path.dirname(current)
            if not _within(current, root):
                raise escape
            continue
        candidate = os.path.join(current, name)
        try:
            st = os.lstat(candidate)
        except OSError:  # not there (or not a folder): the rest stays as written
            rest = os.path.normpath(os.path.join(candidate, *pending))
            if not _within(rest, root):
                raise escape from None
            return rest
        if not stat.S_ISLNK(st.st_mode):
            current = candidate
            continue
        hops += 1
        if hops > 40:  # a loop: leave it to the open, which fails with ELOOP
            return os.path.join(candidate, *pending)
        try:
            target = os.readlink(candidate)
        except OSError:
            return os.path.join(candidate, *pending)
        tparts = list(PurePosixPath(target).parts)
        if os.path.isabs(target):
            norm = os.path.normpath(target)
            if ".." in tparts or not _within(norm, root):
                raise escape
            current, tparts = root, list(PurePosixPath(os.path.relpath(norm, root)).parts)
        pending = tparts + pending
    return current


@dataclass(frozen=True)
class NpyHeader:
    """What a ``.npy`` header declares: the shape, a plain numeric dtype, Fortran order."""

    shape: tuple[int, ...]
    dtype: Any
    fortran: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the data that follows the header (exact: Python ints)."""
        return math.prod(self.shape) * self.dtype.itemsize


def npy_header(path: Path | str, what: str = "array", limit: int | None = DEFAULT_MAX_TENSOR_BYTES) -> NpyHeader:
    """The header of a plain ``.npy`` file, checked as :func:`load_npy` checks it; no data is read."""
    with open_regular(path, what) as f:
        header = _read_header(f, f"{what} {path}")
        _check_header(header, f, os.fstat(f.fileno()).st_size, f"{what} {path}", limit)
        return header


def load_npy(path: Path | str, what: str = "array", limit: int | None = DEFAULT_MAX_TENSOR_BYTES,
             expect: NpyHeader | None = None):
    """A plain ``.npy`` array: no pickle, size checked from the header first.

    The header is read and checked (dtype without Python objects, size under
    ``limit``, data no longer than the file; ``expect``: the header :func:`npy_header`
    read earlier, unchanged) before the data is allocated."""
    with open_regular(path, what) as f:
        return _read_npy(f, os.fstat(f.fileno()).st_size, f"{what} {path}", limit, expect)


def _npz_members(f, path: Path | str, what: str) -> tuple[Any, dict[str, Any]]:
    """The ``ZipFile`` of the open ``.npz`` file ``f`` and its members by array name (the
    member's name without ``.npy``); a central directory over :data:`MAX_NPZ_DIRECTORY`
    bytes, or two members of one name (``a.npy`` and ``a``), are refused."""
    import zipfile

    try:
        end = zipfile._EndRecData(f) if hasattr(zipfile, "_EndRecData") else None  # what ZipFile reads first
        if end and end[zipfile._ECD_SIZE] > MAX_NPZ_DIRECTORY:
            raise IrgenError(f"{what} {path}: a zip directory of {human_bytes(end[zipfile._ECD_SIZE])}, over the "
                             f"{human_bytes(MAX_NPZ_DIRECTORY)} irgen reads (too many arrays in one .npz)")
        zf = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
        raise IrgenError(f"{what} {path}: not a .npz file ({' '.join(str(err).split())[:200]})") from None
    members: dict[str, Any] = {}
    for info in zf.infolist():
        if info.is_dir():
            continue
        name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
        if name in members:
            raise IrgenError(f"{what} {path}: members {members[name].filename!r:.100} and {info.filename!r:.100} are "
                             f"both array {name!r:.100}; give each array one member")
        members[name] = info
    return zf, members


def _npz_read(path: Path | str, what: str, names: Iterable[str] | None, read) -> dict[str, Any]:
    """``read(stream, name, info, where)`` of the members named ``names`` (None: every member) of
    the ``.npz`` file ``path``, by array name; a name it lacks is left out."""
    import zipfile

    with open_regular(path, what) as f:
        zf, members = _npz_members(f, path, what)
        out = {}
        for name in (members if names is None else [n for n in names if n in members]):
            where = f"{what} {path} array {name!r:.100}"
            try:
                with zf.open(members[name]) as m:
                    out[name] = read(m, name, members[name], where)
            except (zipfile.BadZipFile, OSError, RuntimeError, NotImplementedError, EOFError) as err:
                raise IrgenError(f"{where}: unreadable ({' '.join(str(err).split())[:200]})") from None
        return out


def npz_headers(path: Path | str, what: str = "arrays", limit: int | None = DEFAULT_MAX_TENSOR_BYTES,
                names: Iterable[str] | None = None) -> dict[str, NpyHeader]:
    """The headers of the arrays ``names`` (None: all) of a ``.npz`` file, by name, each checked
    as :func:`load_npy` checks one; only the first bytes of each member are decompressed."""
    def header(m, name: str, info, where: str) -> NpyHeader:
        h = _read_header(m, where)
        _check_header(h, m, info.file_size, where, limit)
        return h

    return _npz_read(path, what, names, header)


def load_npz(path: Path | str, what: str = "arrays", limit: int | None = DEFAULT_MAX_TENSOR_BYTES,
             expect: dict[str, NpyHeader] | None = None) -> dict:
    """The arrays of a ``.npz`` file by name (``expect``: only those, each with the header
    :func:`npz_headers` read earlier), each read as :func:`load_npy` reads a file (no
    pickle, size checked from its header before its data is decompressed); a member that
    holds more data than its header declares is refused after one byte more."""
    def array(m, name: str, info, where: str):
        return _read_npy(m, info.file_size, where, limit, None if expect is None else expect[name], exact=True)

    return _npz_read(path, what, None if expect is None else list(expect), array)


def npz_member(name: str) -> str:
    """The member of a tensor named ``name`` in an ``.npz`` file irgen writes (``--compress``):
    the name percent-encoded (no ``/``, no leading dot), plus ``.npy``; a name whose member
    name would not fit a zip entry (:data:`MAX_ZIP_NAME` bytes) is refused."""
    from urllib.parse import quote

    member = quote(name, safe="").replace(".", "%2E") + ".npy"
    if len(member) > MAX_ZIP_NAME:
        raise IrgenError(f"tensor {name!r:.100}: its .npz member name would be {len(member)} bytes, over the "
                         f"{MAX_ZIP_NAME} a zip entry holds; run without --compress")
    return member


def load_npz_member(path: Path | str, name: str, what: str = "array",
                    limit: int | None = DEFAULT_MAX_TENSOR_BYTES):
    """Tensor ``name`` of a ``.npz`` file irgen wrote (member :func:`npz_member`), read as
    :func:`load_npy` reads a file (and refused when it holds more than its header declares)."""
    import zipfile

    member = npz_member(name)
    with open_regular(path, what) as f:
        zf, _ = _npz_members(f, path, what)
        try:
            info = zf.getinfo(member)
            with zf.open(info) as m:
                return _read_npy(m, info.file_size, f"{what} {path} member {member}", limit, exact=True)
        except KeyError:
            raise IrgenError(f"{what} {path}: holds no member {member}") from None
        except (zipfile.BadZipFile, OSError, RuntimeError, NotImplementedError, EOFError) as err:
            raise IrgenError(f"{what} {path}: not a readable .npz file ({err})") from None


def _read_header(f, what: str) -> NpyHeader:
    """The ``.npy`` header at ``f``'s position: a plain numeric dtype (no objects, no fields)."""
    from numpy.lib import format as npformat

    try:
        version = npformat.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = npformat.read_array_header_1_0(f, max_header_size=10000)
        elif version == (2, 0):
            shape, fortran, dtype = npformat.read_array_header_2_0(f, max_header_size=10000)
        else:  # 3.0 (utf-8 field names) and unknown versions: numpy's own reader decides
            shape, fortran, dtype = _header_reader()(f, version, max_header_size=10000)
    except Exception as err:  # noqa: BLE001  numpy's header parser raises many kinds (even tokenize.TokenError)
        raise IrgenError(f"{what}: not a plain .npy array ({' '.join(str(err).split())[:200]})") from None
    if dtype.hasobject:
        raise IrgenError(f"{what}: holds Python objects (a pickle); only plain numeric arrays are read")
    if dtype.fields is not None or dtype.subdtype is not None:
        raise IrgenError(f"{what}: a structured dtype ({dtype}); only plain numeric arrays are read")
    return NpyHeader(tuple(int(d) for d in shape), dtype, bool(fortran))


def _check_header(header: NpyHeader, f, file_size: int, what: str, limit: int | None) -> None:
    """``header``'s tensor within ``limit`` and its data within the ``file_size`` bytes of ``f``."""
    check_tensor_size(what, header.shape, header.dtype, limit)
    if f.tell() + header.nbytes > file_size:
        raise IrgenError(f"{what}: truncated ({file_size - f.tell()} bytes of data, the header says {header.nbytes})")


def _read_npy(f, file_size: int, what: str, limit: int | None, expect: NpyHeader | None = None,
              exact: bool = False):
    """The array at ``f``: its header checked (``expect``: equal to it), then exactly its
    data read (``exact``: and nothing after it)."""
    header = _read_header(f, what)
    if expect is not None and header != expect:
        raise IrgenError(f"{what}: changed while being read (its header said {expect.dtype}{list(expect.shape)}, "
                         f"now {header.dtype}{list(header.shape)})")
    _check_header(header, f, file_size, what, limit)
    try:
        return _read_data(f, header, what, exact)
    except (ValueError, OSError) as err:
        raise IrgenError(f"{what}: not a plain .npy array ({' '.join(str(err).split())[:200]})") from None


def _header_reader():
    try:
        from numpy.lib._format_impl import _read_array_header
    except ImportError:  # numpy 1.x
        from numpy.lib.format import _read_array_header
    return _read_array_header


def _read_data(f, header: NpyHeader, what: str, exact: bool):
    """The array ``header`` declares, read from ``f`` in chunks straight into it (never more
    than :data:`_CHUNK` bytes besides it); ``exact``: the stream must end there."""
    import numpy as np

    arr = np.empty(header.shape[::-1] if header.fortran else header.shape, header.dtype)  # owns its memory
    view, got = memoryview(arr.reshape(-1).view(np.uint8)), 0
    while got < header.nbytes:
        n = f.readinto(view[got:got + _CHUNK])
        if not n:
            raise IrgenError(f"{what}: truncated ({got} bytes of data, the header says {header.nbytes})")
        got += n
    if exact and f.read(1):
        raise IrgenError(f"{what}: holds more data than its header declares ({header.dtype}{list(header.shape)}, "
                         f"{header.nbytes} bytes); refused without reading the rest")
    return arr.transpose() if header.fortran else arr  # Fortran order as stored: the reverse shape, transposed
