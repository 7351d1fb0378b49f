"""Shared pieces of the hostile-input tests (``tests/test_hostile_*.py``).

A hostile case runs the real ``irgen`` command in a child process and asserts
what a user and an attacker care about:

- the exit code (2 for bad input) and exactly one ``irgen: error:`` line on
  stderr, no traceback;
- nothing written outside OUT and no partial folder left beside it;
- nothing opened outside the paths the user gave: a :class:`Sentinel` folder
  outside OUT is watched with Linux inotify for any open, read or write;
- no payload ran: pickles in the corpus carry :func:`payload`, which would
  create a marker file, and the marker must not exist.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

IRGEN = [sys.executable, "-m", "irgen"]
ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}


def irgen(*argv, cwd=None, timeout=300, env=None) -> subprocess.CompletedProcess:
    """``irgen ARGV...`` in a child process, no stdin; its output captured."""
    return subprocess.run([*IRGEN, *map(str, argv)], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, stdin=subprocess.DEVNULL, env=env or ENV)


#: runs ARGV as its child (address space capped at CAP bytes unless 0, killed after TIMEOUT
#: seconds), passes on the child's output, and writes its exit code, peak RSS and seconds to REPORT
_MEASURE = """import json, resource, subprocess, sys, time
report, cap, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
def limit():
    if cap:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
t0 = time.perf_counter()
try:
    code = subprocess.run(sys.argv[4:], stdin=subprocess.DEVNULL, timeout=timeout, preexec_fn=limit).returncode
except subprocess.TimeoutExpired:
    code = None
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
open(report, "w").write(json.dumps({"code": code, "peak": peak, "seconds": seconds}))
"""


def measured(*argv, cap: int = 0, timeout: float = 300) -> tuple[subprocess.CompletedProcess, int, float]:
    """``irgen ARGV...`` as the child of a fresh small process, its address space capped at
    ``cap`` bytes (0: not capped): the result, the child's peak resident memory in bytes, and
    its seconds (exit code None: killed after ``timeout``). The child of this test process
    would count this process's memory too: Linux folds the memory of the image a child
    replaces at ``exec`` (a copy of its parent) into its peak."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "report.json"
        proc = subprocess.run([sys.executable, "-c", _MEASURE, str(report), str(cap), str(timeout), *IRGEN,
                               *map(str, argv)], capture_output=True, text=True, stdin=subprocess.DEVNULL, env=ENV,
                              timeout=timeout + 60)
        r = json.loads(report.read_text())
    return subprocess.CompletedProcess([*IRGEN, *argv], r["code"], proc.stdout, proc.stderr), r["peak"], r["seconds"]


def leftovers(out: Path) -> list[str]:
    """Hidden partial/old folders irgen left beside OUT."""
    parent = Path(out).parent
    if not parent.is_dir():
        return []
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{Path(out).name}.irgen-"))


def assert_refused(proc: subprocess.CompletedProcess, out: Path | None = None, *names: str,
                   code: int = 2) -> str:
    """Exit ``code``, exactly one stderr line ``irgen: error: ...`` naming each of ``names``,
    no traceback, and (when ``out`` is given) no OUT and no partial folder."""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("irgen: error: "), line
    for name in names:
        assert name in line, (name, line)
    if out is not None:
        assert not Path(out).exists(), f"{out} was created"
        assert leftovers(out) == [], leftovers(out)
    return line


# ------------------------------------------------------------------ payloads


class _Payload:
    """Unpickling this runs ``exec`` of code that creates ``marker``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        code = f"open({self.marker!r}, 'w').write('payload ran')"
        return (exec, (code,))


def payload(marker: Path) -> object:
    """An object whose unpickling creates ``marker`` (the proof that code ran)."""
    return _Payload(marker)


def payload_pickle(marker: Path, protocol: int = 2) -> bytes:
    return pickle.dumps(payload(marker), protocol=protocol)


# ------------------------------------------------------------------ watching a folder

_IN_ACCESS, _IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE, _IN_OPEN = 0x1, 0x2, 0x4, 0x8, 0x20
_IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x40, 0x80, 0x100, 0x200
_MASK = (_IN_ACCESS | _IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_OPEN | _IN_MOVED_FROM | _IN_MOVED_TO
         | _IN_CREATE | _IN_DELETE)
_IN_NONBLOCK = 0o4000


class Sentinel:
    """A folder outside OUT holding ``secret.txt``, watched for any access.

    ``with Sentinel(tmp_path / "outside") as s: ...`` then ``s.events()`` lists
    the (file name, event mask) pairs seen; ``s.assert_untouched()`` fails on
    any open, read, write, create or delete inside the folder.
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.secret = self.folder / "secret.txt"
        self.secret.write_text("sentinel: irgen must never read this\n")
        self._libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._fd = -1
        self._seen: list[tuple[str, int]] = []

    def __enter__(self) -> "Sentinel":
        self._fd = self._libc.inotify_init1(_IN_NONBLOCK)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if self._libc.inotify_add_watch(self._fd, str(self.folder).encode(), _MASK) < 0:
            raise OSError(ctypes.get_errno(), "inotify_add_watch")
        return self

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return
            i = 0
            while i + 16 <= len(data):
                _wd, mask, _cookie, length = struct.unpack_from("iIII", data, i)
                name = data[i + 16:i + 16 + length].split(b"\0", 1)[0].decode(errors="replace")
                self._seen.append((name, mask))
                i += 16 + length

    def events(self) -> list[tuple[str, int]]:
        self._drain()
        return list(self._seen)

    def assert_untouched(self) -> None:
        ev = self.events()
        assert not ev, f"irgen touched {self.folder}: {ev}"

    def __exit__(self, *exc) -> None:
        if self._fd >= 0:
            self._drain()
            os.close(self._fd)
            self._fd = -1
