"""Hostile input to ``irgen run`` that every frontend shares: the model path, input
files, input shapes, tensor sizes, the output folder, signals and plugins.

Each case asserts what ``tests/hostile.py`` says: exit code, one error line and
no traceback, no OUT and no partial folder, nothing outside OUT touched.
Frontend-specific corpora live in ``test_hostile_{onnx,tflite,torch}.py``.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from hostile import IRGEN, Sentinel, assert_refused, irgen, leftovers
from test_cli_errors import tiny_model

pytest.importorskip("onnx")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("m") / "tiny.onnx")


@pytest.fixture(scope="module")
def golden(tmp_path_factory, model) -> Path:
    """One finished output folder of ``model``."""
    out = tmp_path_factory.mktemp("g") / "out"
    proc = irgen("run", model, "-o", out, "--no-progress")
    assert proc.returncode == 0, proc.stderr
    return out


def _cli(capsys, *argv) -> tuple[int, str]:
    from irgen.cli import main

    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def _one_error(err: str, *names: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("irgen: error: "), err
    assert "Traceback" not in err
    for n in names:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ------------------------------------------------------------------ the model path


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "link-to-dev-zero", "link-loop", "dangling-link"])
def test_model_that_is_not_a_regular_file(tmp_path, kind) -> None:
    path = tmp_path / "model.onnx"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path = Path("/dev/zero")
    elif kind == "link-to-dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "link-loop":
        path.symlink_to(path)
    else:
        path.symlink_to(tmp_path / "gone.onnx")
    out = tmp_path / "out"
    proc = irgen("run", path, "-o", out, "--frontend", "onnx", "--no-progress", timeout=60)
    assert_refused(proc, out, str(path))


# ------------------------------------------------------------------ input files


def _npy_header(shape, descr="<f4") -> bytes:
    header = repr({"descr": descr, "fortran_order": False, "shape": tuple(shape)}).encode()
    header += b" " * (63 - (len(header) + 10) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header


@pytest.mark.parametrize("kind,words", [
    ("fifo", ["FIFO"]),
    ("pickle", ["pickle"]),
    ("huge-header", ["954", "GiB", "--max-tensor-bytes"]),
    ("truncated", ["truncated"]),
    ("bad-magic", ["not a plain .npy"]),
    ("nan", ["NaN/Inf", "'x'"]),
    ("inf", ["NaN/Inf", "'x'"]),
    ("dev-zero", ["character device"]),
    ("subarray-dtype", ["structured dtype"]),  # found by fuzz/fuzz_loaders.py (a ValueError escaped)
    ("structured-dtype", ["structured dtype"]),
])
def test_hostile_input_file(model, tmp_path, kind, words) -> None:
    from hostile import payload

    npy = tmp_path / f"{kind}.npy"
    marker = tmp_path / "PAYLOAD_RAN"
    if kind == "fifo":
        os.mkfifo(npy)
    elif kind == "pickle":
        np.save(npy, np.array([payload(marker)], dtype=object), allow_pickle=True)
    elif kind == "huge-header":  # 954 GiB announced, 128 bytes present
        npy.write_bytes(_npy_header((954, 1024, 1024, 256)) + b"\0" * 128)
    elif kind == "truncated":
        npy.write_bytes(_npy_header((1, 3, 8, 8)) + b"\0" * 100)
    elif kind == "bad-magic":
        npy.write_bytes(b"\x93NUMPZ" + b"\0" * 200)
    elif kind == "subarray-dtype":
        npy.write_bytes(_npy_header((1, 3, 8, 4), descr="2f4") + b"\0" * 4 * 192)
    elif kind == "structured-dtype":
        np.save(npy, np.zeros((1, 3, 8, 8), dtype=[("a", "<f2"), ("b", "<f2")]))
    elif kind in ("nan", "inf"):
        arr = np.zeros((1, 3, 8, 8), np.float32)
        arr[0, 1, 2, 3] = np.nan if kind == "nan" else np.inf
        np.save(npy, arr)
    else:
        npy = tmp_path / "zero.npy"
        npy.symlink_to("/dev/zero")
    out = tmp_path / "out"
    proc = irgen("run", model, "-o", out, "--input", npy, "--no-progress", timeout=60)
    line = assert_refused(proc, out, npy.name, *words)
    assert "Traceback" not in line
    assert not marker.exists()


# ------------------------------------------------------------------ shapes and sizes


@pytest.mark.parametrize("spec,words", [
    ("x=-1,3,8,8", ["non-negative"]),
    ("x=0,3,8,8", ["fixed shape [1, 3, 8, 8]"]),  # 0 is a size (an empty KV cache), not this input's
    ("x=1,3,a,8", ["NAME=D1,D2"]),
    ("x=1000000,1000000,3,8", ["--max-tensor-bytes", "TiB"]),
    ("nosuch=1,3,8,8", ["no input 'nosuch'", "x [1, 3, 8, 8]"]),
    ("x=2,3,8,8", ["fixed shape [1, 3, 8, 8]"]),
])
def test_bad_input_shape(model, tmp_path, capsys, spec, words) -> None:
    out = tmp_path / "out"
    code, err = _cli(capsys, "run", model, "-o", out, "--input-shape", spec, "--no-progress")
    assert code == 2
    _one_error(err, *words)
    assert not out.exists() and leftovers(out) == []


def test_max_tensor_bytes_refuses_before_compiling(model, tmp_path, capsys) -> None:
    """A model tensor over the limit is refused by name, before TVM compiles or allocates."""
    out = tmp_path / "out"
    code, err = _cli(capsys, "run", model, "-o", out, "--max-tensor-bytes", "512", "--no-progress")
    assert code == 2
    line = _one_error(err, "--max-tensor-bytes", "512 B")
    assert "tensor" in line or "input" in line
    code, err = _cli(capsys, "run", model, "-o", out, "--max-tensor-bytes", "lots", "--no-progress")
    assert code == 2 and "not a size" in err and "Traceback" not in err


# ------------------------------------------------------------------ the output folder


def test_out_that_holds_the_model_or_the_working_folder(model, tmp_path, capsys, monkeypatch) -> None:
    folder = tmp_path / "work"
    folder.mkdir()
    local = folder / "m.onnx"
    local.write_bytes(model.read_bytes())
    monkeypatch.chdir(folder)
    for out in (".", str(folder), str(tmp_path)):
        code, err = _cli(capsys, "run", local, "-o", out, "--force", "--no-progress")
        assert code == 2, err
        _one_error(err)
        assert local.read_bytes() == model.read_bytes()
    code, err = _cli(capsys, "run", local, "-o", "..", "--force", "--no-progress")
    assert code == 2
    assert local.is_file() and folder.is_dir()


def test_out_name_too_long_and_out_a_symlink_loop(model, tmp_path, capsys) -> None:
    long = tmp_path / ("o" * 300)
    code, err = _cli(capsys, "run", model, "-o", long, "--no-progress")
    assert code == 2
    _one_error(err, "too long")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    code, err = _cli(capsys, "run", model, "-o", loop, "--no-progress")
    assert code == 2
    _one_error(err, "loop")
    assert loop.is_symlink()
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, err = _cli(capsys, "run", model, "-o", afile, "--force", "--no-progress")
    assert code == 2 and afile.read_text() == "x"
    _one_error(err, "not a folder")


def _write_fails_after(monkeypatch, n: int, err: int) -> None:
    """Make the n-th array file written by the pipeline fail with ``err``."""
    import irgen.capture as capture

    real = capture.write_npy
    count = [0]

    def failing(path, arr):
        count[0] += 1
        if count[0] >= n:
            raise OSError(err, os.strerror(err), str(path))
        return real(path, arr)

    monkeypatch.setattr(capture, "write_npy", failing)


@pytest.mark.parametrize("force", [False, True])
def test_disk_full_leaves_the_old_output(model, golden, tmp_path, capsys, monkeypatch, force) -> None:
    out = tmp_path / "out"
    if force:
        import shutil

        shutil.copytree(golden, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} if force else {}
    _write_fails_after(monkeypatch, 3, errno.ENOSPC)
    argv = ["run", model, "-o", out, "--no-progress"] + (["--force"] if force else [])
    code, err = _cli(capsys, *argv)
    assert code == 2
    _one_error(err, str(out), "No space left on device")
    assert leftovers(out) == []
    if force:
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    else:
        assert not out.exists()


def test_read_only_parent(model, tmp_path, capsys, monkeypatch) -> None:
    import pathlib

    real = pathlib.Path.mkdir

    def mkdir(self, *a, **k):
        if ".irgen-partial-" in self.name:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    out = tmp_path / "ro" / "out"
    out.parent.mkdir()
    code, err = _cli(capsys, "run", model, "-o", out, "--no-progress")
    assert code == 2
    _one_error(err, str(out), "Permission denied")


@pytest.fixture
def small_fs(tmp_path):
    """A real 256 KiB tmpfs (root only; skipped where mounting is not allowed)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_real_disk_full_and_read_only(tmp_path, small_fs) -> None:
    big = tiny_model(tmp_path / "big.onnx", channels=64, hw=32)  # ~1 MiB of golden data
    out = small_fs / "out"
    proc = irgen("run", big, "-o", out, "--no-progress")
    assert_refused(proc, out, "No space left on device")
    assert list(small_fs.iterdir()) == []
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    proc = irgen("run", big, "-o", out, "--no-progress")
    assert_refused(proc, out, "Read-only file system")


# ------------------------------------------------------------------ signals and atomic output


def _start(model: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([*IRGEN, "run", str(model), "-o", str(out), *extra], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def _wait_for_stage(proc: subprocess.Popen, prefix: str) -> list[str]:
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith(prefix):
            return seen
    pytest.fail(f"irgen finished before stage {prefix!r}: {seen}")


def test_sigterm_cleans_up(tmp_path) -> None:
    model = tiny_model(tmp_path / "wide.onnx", channels=64, hw=96)
    out = tmp_path / "out"
    proc = _start(model, out)
    try:
        _wait_for_stage(proc, "[2]")
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 143, (code, rest)
    assert "Traceback" not in rest and rest.rstrip().endswith("irgen: terminated"), rest
    assert not out.exists() and leftovers(out) == []


def _verifies(out: Path) -> bool:
    proc = irgen("verify", out, "--mode", "single", "--no-report", "--no-progress")
    return proc.returncode == 0


@pytest.mark.slow  # irgen processes killed at random points; by default: the disk-full tests above and
# test_stale_partial_folder_of_a_dead_process_is_removed below (a dead run's leftovers)
def test_sigkill_at_random_points_leaves_a_verifiable_or_absent_output(tmp_path) -> None:
    """SIGKILL anywhere: OUT is complete (it verifies) or absent; the next run needs no --force
    and removes the dead run's hidden folder; with --force the old OUT survives whole."""
    model = tiny_model(tmp_path / "wide.onnx", channels=32, hw=64)
    rng = random.Random(9)
    t0 = time.monotonic()
    proc = subprocess.run([*IRGEN, "run", str(model), "-o", str(tmp_path / "timing"), "--no-progress"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    full = time.monotonic() - t0
    outcomes = {"absent": 0, "complete": 0}
    for i in range(6):
        out = tmp_path / f"out{i}"
        force = i % 2 == 1
        if force:  # an older complete OUT to be replaced
            assert irgen("run", model, "-o", out, "--no-progress").returncode == 0
        p = _start(model, out, "--no-progress", *(["--force"] if force else []))
        time.sleep(rng.uniform(0.3, full * 1.1))
        p.kill()
        p.wait()
        if force:
            assert out.is_dir(), "the old OUT vanished"
            assert _verifies(out)
            outcomes["complete"] += 1
            continue
        if out.exists():
            assert _verifies(out), f"kill {i}: OUT exists but does not verify"
            outcomes["complete"] += 1
        else:
            outcomes["absent"] += 1
            again = irgen("run", model, "-o", out, "--no-progress")
            assert again.returncode == 0, again.stderr
            assert _verifies(out)
        assert leftovers(out) == [], leftovers(out)
    assert sum(outcomes.values()) == 6


def test_stale_partial_folder_of_a_dead_process_is_removed(model, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".out.irgen-partial-{dead.pid}-1"
    (stale / "activations").mkdir(parents=True)
    (stale / "activations" / "half.npy").write_bytes(b"\x93NUMPY")
    live = tmp_path / f".out.irgen-partial-{os.getpid()}-0"  # this live process: left alone
    live.mkdir()
    code, err = _cli(capsys, "run", model, "-o", out, "--no-progress")
    assert code == 0, err
    assert not stale.exists() and live.is_dir()
    live.rmdir()


# ------------------------------------------------------------------ nothing outside OUT


def test_a_run_touches_nothing_outside_its_paths(model, tmp_path) -> None:
    """The whole run, watched: the sentinel folder beside OUT sees no open, read or write."""
    work = tmp_path / "work"
    work.mkdir()
    local = work / "m.onnx"
    local.write_bytes(model.read_bytes())
    with Sentinel(tmp_path / "outside") as s:
        proc = irgen("run", local, "-o", work / "out", "--no-progress", cwd=work)
        assert proc.returncode == 0, proc.stderr
        s.assert_untouched()
    files = [p for p in (work / "out").rglob("*") if p.is_file()]
    assert files and all(Path(os.path.realpath(p)).is_relative_to(work / "out") for p in files)
    manifest = json.loads((work / "out" / "manifest.json").read_text())
    assert {f["path"] for f in manifest["files"]} | {"manifest.json"} == {
        p.relative_to(work / "out").as_posix() for p in files}


# ------------------------------------------------------------------ plugins

HANGS = "import time\nwhile True:\n    time.sleep(0.05)\n"
SPINS = "while True:\n    pass\n"
EXITS = "import sys\nsys.exit(4)\n"
RAISES = "raise RuntimeError('broken plugin')\n"
REGISTER_RAISES = """
from irgen import hookimpl

@hookimpl
def irgen_register_serializers(register):
    raise ValueError('cannot register')
"""
SERIALIZER_RAISES = """
from irgen import hookimpl
from irgen.api import Serializer

def _write(ir, folder):
    raise ValueError('disk on fire')

@hookimpl
def irgen_register_serializers(register):
    register(Serializer(name='bad', write=_write))
"""


@pytest.mark.parametrize("name,source,words", [
    ("hangs", HANGS, ["did not finish within 2 s"]),
    ("spins", SPINS, ["did not finish within 2 s"]),
    ("exits", EXITS, ["SystemExit"]),
    ("raises", RAISES, ["broken plugin"]),
    ("register_raises", REGISTER_RAISES, ["cannot register"]),
])
def test_failing_plugins_are_named(tmp_path, plugin_file, name, source, words) -> None:
    path = plugin_file(name, source)
    env = {**os.environ, "IRGEN_PLUGIN_TIMEOUT": "2"}
    proc = irgen("--plugin", path, "plugins", env=env, timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    warn = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(warn) == 1 and warn[0].startswith(f"irgen: warning: plugin '{name}'"), proc.stderr
    for w in words:
        assert w in warn[0]
    proc = irgen("--plugin", path, "--strict-plugins", "plugins", env=env, timeout=60)
    assert_refused(proc, None, f"plugin '{name}'", *words)


def test_raising_serializer_is_named(model, tmp_path, plugin_file) -> None:
    path = plugin_file("badser", SERIALIZER_RAISES)
    out = tmp_path / "out"
    proc = irgen("run", model, "-o", out, "--plugin", path, "--serializer", "bad", "--no-progress")
    assert_refused(proc, out, "serializer 'bad'", "plugin 'badser'", "disk on fire")


def test_internal_error_is_one_line_and_traceback_on_request(model, tmp_path, monkeypatch, capsys) -> None:
    import irgen.compile as compile_

    def broken(*a, **k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(compile_, "layer_records", broken)
    out = tmp_path / "out"
    code, err = _cli(capsys, "run", model, "-o", out, "--no-progress")
    assert code == 3 and err.strip().splitlines() == [
        "irgen: internal error: ZeroDivisionError: a bug (IRGEN_TRACEBACK=1 shows where)"]
    assert not out.exists() and leftovers(out) == []
    monkeypatch.setenv("IRGEN_TRACEBACK", "1")
    with pytest.raises(ZeroDivisionError):
        _cli(capsys, "run", model, "-o", out, "--no-progress")


@pytest.mark.parametrize("kind", ["link-out", "fifo", "device-link"])
def test_folder_model_with_hostile_entries(tmp_path, kind) -> None:
    """A SavedModel folder is checked whole before any frontend reads a file of it."""
    model = tmp_path / "saved"
    (model / "variables").mkdir(parents=True)
    (model / "saved_model.pb").write_bytes(b"\x08\x01")
    with Sentinel(tmp_path / "outside") as s:
        bad = model / "variables" / "variables.data-00000-of-00001"
        if kind == "link-out":
            bad.symlink_to(s.secret)
        elif kind == "fifo":
            os.mkfifo(bad)
        else:
            bad.symlink_to("/dev/zero")
        out = tmp_path / "out"
        proc = irgen("run", model, "-o", out, "--no-progress", timeout=60)
        assert_refused(proc, out, "variables.data-00000-of-00001")
        s.assert_untouched()
