"""A run's weights kept on disk while it compiles: memory flat in the number of layers.

A frontend makes each large constant of the model with :func:`weight_tensor` (public as
``irgen.plugin.weight_tensor``). While a run has a weight file open (:func:`weights_on_disk`,
which ``irgen run`` opens in the output folder's parent, where it writes its partial
output anyway), the array is appended to that file and the TVM tensor is a read-only
use of the file's pages (a private mapping, never written): what the import reads from
the model does not stay in memory, and nothing changes for the code that reads the tensor.

The kernel brings a mapped page in when something reads it (a structural hash, a kernel,
the writing of a parameter file); :func:`release` gives back the pages of the arrays just
read (``madvise(MADV_DONTNEED)``: the next read brings them in again from the file), so
that the weights are never all resident at once. The file is unnamed (``O_TMPFILE``, or
removed as soon as it is made): nothing is left behind, even after a crash. Without an
open weight file (the Python API, ``irgen verify``, ``IRGEN_NO_SPILL=1``), or where the file
cannot be made, :func:`weight_tensor` is ``tvm.runtime.tensor``.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from irgen.envflags import turned_off

#: arrays smaller than this stay in memory (scales, zero points, biases, shapes)
MIN_BYTES = 1 << 16
#: set to 1 to keep every weight in memory (:func:`weights_on_disk` opens no file)
ENV_OFF = "IRGEN_NO_SPILL"
ENABLED = True
#: every array starts on a page, so each is mapped on its own and 64-byte aligned
_PAGE = mmap.PAGESIZE


class WeightFile:
    """An unnamed file in ``folder`` that arrays are appended to and mapped back from."""

    def __init__(self, folder: Path):
        self._lock = threading.Lock()
        self._fd = _unnamed_file(Path(folder))
        self._end = 0
        self._starts: list[int] = []  # mapped addresses, sorted -> (end, mmap)
        self._maps: dict[int, tuple[int, mmap.mmap]] = {}
        self.bytes = 0

    def array(self, arr: np.ndarray) -> np.ndarray:
        """``arr``'s values as an array on the file's pages (C order, aligned)."""
        arr = np.asarray(arr)
        with self._lock:
            off = self._end
            at = off
            for block in _c_order_blocks(arr):
                view = memoryview(block.reshape(-1).view(np.uint8))
                done = 0
                while done < block.nbytes:
                    done += os.pwrite(self._fd, view[done:], at + done)
                at += block.nbytes
            self._end = off + -(-arr.nbytes // _PAGE) * _PAGE
            # a private writable mapping: numpy exports it through DLPack (a read-only one it
            # will not); nothing writes into a weight, and a page is only ever read from the file
            m = mmap.mmap(self._fd, arr.nbytes, flags=mmap.MAP_PRIVATE,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=off)
            out = np.frombuffer(m, dtype=arr.dtype).reshape(arr.shape)
            start = out.ctypes.data
            _read_only(start, arr.nbytes)
            bisect.insort(self._starts, start)
            self._maps[start] = (start + arr.nbytes, m)
            self.bytes += arr.nbytes
        return out  # no page of it is ours yet: pwrite went to the page cache, not the mapping

    def release(self, address: int) -> bool:
        """Give back the resident pages of the array holding ``address``; False if none does."""
        with self._lock:
            k = bisect.bisect_right(self._starts, address) - 1
            if k < 0:
                return False
            start = self._starts[k]
            end, m = self._maps[start]
        if address >= end:
            return False
        m.madvise(mmap.MADV_DONTNEED)
        return True

    def release_all(self) -> None:
        with self._lock:
            maps = [m for _, m in self._maps.values()]
        for m in maps:
            m.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Close the file; the arrays made stay readable (a mapping keeps its file)."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            self._starts, self._maps = [], {}


#: a view that is not contiguous (a transposed weight) is written this many bytes at a time
_BLOCK_BYTES = 8 << 20


def _c_order_blocks(arr: np.ndarray) -> Iterator[np.ndarray]:
    """``arr``'s values in C order as contiguous arrays: itself when it is contiguous, else
    copies of a few of its rows at a time (never a whole copy of a large weight in memory)."""
    if arr.flags.c_contiguous or arr.ndim < 2:
        yield np.ascontiguousarray(arr)
        return
    rows = max(1, _BLOCK_BYTES // max(1, arr[0].nbytes))
    for i in range(0, arr.shape[0], rows):
        yield np.ascontiguousarray(arr[i:i + rows])


def _read_only(address: int, nbytes: int) -> None:
    """Make the pages at ``address`` read-only: a write into a weight would otherwise be lost
    silently the next time its pages are given back (it would crash instead)."""
    import ctypes

    global _mprotect
    if _mprotect is None:
        _mprotect = ctypes.CDLL(None, use_errno=True).mprotect
        _mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _mprotect.restype = ctypes.c_int
    if _mprotect(address, -(-nbytes // _PAGE) * _PAGE, mmap.PROT_READ) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed on a weight's pages")


_mprotect = None


def _unnamed_file(folder: Path) -> int:
    flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
    tmpfile = getattr(os, "O_TMPFILE", None)
    if tmpfile is not None:
        try:
            return os.open(folder, flags | tmpfile, 0o600)
        except OSError:
            pass  # a file system without unnamed files: a named one, removed at once
    import tempfile

    fd, name = tempfile.mkstemp(prefix=".irgen-weights-", dir=folder)
    os.unlink(name)
    return fd


_active: WeightFile | None = None
#: what numpy hands TVM through DLPack as it is
_DLPACK_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                            "float16", "float32", "float64"})


@contextlib.contextmanager
def weights_on_disk(folder: Path) -> Iterator[WeightFile | None]:
    """Within the block, :func:`weight_tensor` keeps large arrays in an unnamed file in
    ``folder`` (None when one cannot be made there: the weights stay in memory)."""
    global _active

    wf = None
    if not turned_off(ENV_OFF, ENABLED):
        try:
            wf = WeightFile(folder)
        except OSError:
            pass
    previous, _active = _active, wf
    try:
        yield wf
    finally:
        _active = previous
        if wf is not None:
            wf.close()


def active() -> bool:
    """Whether large weights go to a weight file now."""
    return _active is not None


def weight_tensor(arr: np.ndarray):
    """A TVM tensor of ``arr``'s values: on the run's weight file when one is open and the
    array is at least :data:`MIN_BYTES`, else in memory (``tvm.runtime.tensor``)."""
    import tvm

    wf = _active
    arr = np.asarray(arr)
    if wf is None or arr.nbytes < MIN_BYTES or arr.dtype.name not in _DLPACK_DTYPES or not arr.dtype.isnative:
        return tvm.runtime.tensor(arr)  # (bfloat16, float8 and the like: TVM's own conversion)
    return tvm.runtime.from_dlpack(wf.array(arr))


def _address(value: Any) -> int | None:
    if isinstance(value, np.ndarray):
        return value.ctypes.data if value.size else None
    if not hasattr(value, "__dlpack__"):  # a Relax constant: its tensor
        value = getattr(value, "value", None)
    if hasattr(value, "__dlpack__"):
        try:
            a = np.from_dlpack(value)
        except (TypeError, ValueError, BufferError, RuntimeError):
            return None
        return a.ctypes.data if a.size else None
    return None


def release(*values: Any) -> None:
    """Give back the resident pages of these arrays, TVM tensors or Relax constants when
    they are on the weight file (anything else is passed over)."""
    wf = _active
    if wf is None:
        return
    for v in values:
        a = _address(v)
        if a is not None:
            wf.release(a)


def release_all() -> None:
    """Give back every resident page of the weight file."""
    if _active is not None:
        _active.release_all()
