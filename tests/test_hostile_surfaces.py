"""Hostile input to irgen's smaller surfaces, found by trying them: ``irgen run --inputs``
(decompression bombs, samples that collide), serializers that would have to truncate,
the modes of the files irgen writes under a strict umask, and ``IRGEN_*`` variables.

Each case runs the real ``irgen`` in a child process and asserts what ``tests/hostile.py``
says: exit code 2, one ``irgen: error:`` line naming the culprit, no OUT and no partial
folder. A bomb's child must also stay under :data:`PEAK_RSS` of memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from hostile import ENV, IRGEN, assert_refused, irgen, measured

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "tiny_cnn.onnx"  # one input 'x', float32 (1, 3, 32, 32)
SHAPE = (1, 3, 32, 32)
#: the most memory a child running a bomb may take (irgen itself, TVM loaded: about 210 MiB)
PEAK_RSS = 300 << 20

pytest.importorskip("onnx")

def _npy_bytes(arr: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def _npy_header(shape: tuple[int, ...], dtype: str = "<f4") -> bytes:
    """The ``.npy`` header of an array of ``shape`` and ``dtype``, without its data."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buf.getvalue()


def _deflated(path: Path, name: str, head: bytes, zeros: int) -> None:
    """A ``.npz`` whose member ``name`` is ``head`` then ``zeros`` MiB of zero bytes, deflated
    as they are written (never all in memory): some KiB per hundred MiB."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        with zf.open(name, "w", force_zip64=True) as f:
            f.write(head)
            chunk = bytes(1 << 20)
            for _ in range(zeros):
                f.write(chunk)


# ------------------------------------------------------------------ irgen run --inputs


@pytest.mark.parametrize("case", ["wrong-shape", "longer-than-its-header"])
def test_inputs_npz_bomb_is_refused_in_bounded_memory(tmp_path, case):
    """A small ``.npz`` whose member expands to hundreds of MiB: refused from its header
    (a shape the model does not take) or after one byte more than its header declares,
    never decompressed whole."""
    bomb = tmp_path / "bomb.npz"
    if case == "wrong-shape":  # 384 MiB of float32 zeros, declared honestly
        _deflated(bomb, "a.npy", _npy_header((1, 3, 8192, 4096)), 384)
        words = ["array 'a'", "shape (1, 3, 8192, 4096) does not match input 'x'"]
    else:  # the right header and data, then 384 MiB more
        _deflated(bomb, "a.npy", _npy_bytes(np.ones(SHAPE, np.float32)), 384)
        words = ["array 'a'", "more data than its header declares"]
    assert bomb.stat().st_size < 2 << 20
    out = tmp_path / "out"
    proc, peak, _ = measured("run", MODEL, "-o", out, "--inputs", bomb, "--no-progress")
    assert_refused(proc, out, *words)
    assert peak < PEAK_RSS, f"irgen took {peak >> 20} MiB on a {bomb.stat().st_size >> 10} KiB .npz"


def test_inputs_total_size_is_bounded_before_reading(tmp_path):
    """Many right-shaped samples: their total is checked from the headers against
    4 x --max-tensor-bytes, and the error says how to raise it."""
    x = np.zeros(SHAPE, np.float32)  # 12 KiB each, 100 of them: 1.2 MiB
    np.savez_compressed(tmp_path / "many.npz", **{f"s{i:03d}": x for i in range(100)})
    out = tmp_path / "out"
    proc = irgen("run", MODEL, "-o", out, "--inputs", tmp_path / "many.npz", "--max-tensor-bytes", "200K",
                 "--no-progress")
    assert_refused(proc, out, "over the limit of 800.0 KiB for all samples together", "raise --max-tensor-bytes")


@pytest.mark.parametrize("case", ["npz-members", "npz-sanitized", "folder-npy-npz", "folder-case"])
def test_inputs_two_samples_of_one_name_are_refused(tmp_path, case):
    """Two members or files that would be one sample (one output folder) are refused,
    naming both, instead of one silently replacing the other."""
    x = np.zeros(SHAPE, np.float32)
    src = tmp_path / "in"
    src.mkdir()
    if case == "npz-members":
        src = tmp_path / "in.npz"
        with zipfile.ZipFile(src, "w") as zf:
            zf.writestr("a.npy", _npy_bytes(x))
            zf.writestr("a", _npy_bytes(x + 1))
        words = ["'a.npy'", "'a'"]
    elif case == "npz-sanitized":
        src = tmp_path / "in.npz"
        np.savez(src, **{"a b": x, "a_b": x + 1})
        words = ["array 'a b'", "array 'a_b'"]
    elif case == "folder-npy-npz":
        np.save(src / "s.npy", x)
        np.savez(src / "s.npz", x=x + 1)
        words = ["'s.npy'", "'s.npz'"]
    else:
        np.save(src / "S.npy", x)
        np.save(src / "s.npy", x + 1)
        words = ["'S.npy'", "'s.npy'"]
    out = tmp_path / "out"
    proc = irgen("run", MODEL, "-o", out, "--inputs", src, "--no-progress")
    assert_refused(proc, out, *words)


# ------------------------------------------------------------------ IRGEN_* variables


@pytest.mark.parametrize("name,value", [
    ("IRGEN_CACHE_SIZE", "inf"),
    ("IRGEN_CACHE_SIZE", "-1"),
    ("IRGEN_BUILD_THREADS", "0"),
    ("IRGEN_BUILD_THREADS", "four"),
    ("IRGEN_PLUGIN_TIMEOUT", "nan"),
    ("IRGEN_PLUGIN_TIMEOUT", "inf"),
    ("IRGEN_NO_SHARE", "maybe"),
    ("IRGEN_NO_SCHEDULE", "2"),
    ("IRGEN_GENERIC_CPU", "yes please"),
    ("IRGEN_TRACEBACK", "sometimes"),
    pytest.param("IRGEN_SCHEDULE_DEBUG", "x" * 5000, id="IRGEN_SCHEDULE_DEBUG-long"),
])
def test_bad_environment_variable_is_one_error_line(tmp_path, name, value):
    out = tmp_path / "out"
    proc = irgen("run", MODEL, "-o", out, "--no-progress", env={**ENV, name: value})
    line = assert_refused(proc, out, f"{name}=", value[:40], "expected")
    assert len(line) < 300, line  # the value is cut


def test_environment_parsers():
    from irgen import envflags, parallel_build, plugins
    from irgen.api import IrgenError

    env = {"A": " 2G ", "B": "0", "C": "1.5", "D": "On", "E": "off", "F": "12"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        assert envflags.size("A", 1) == 2 << 30 and envflags.size("B", 1) == 0 and envflags.size("UNSET_X", 7) == 7
        assert envflags.seconds("C", 60.0) == 1.5 and envflags.seconds("UNSET_X", 60.0) == 60.0
        assert envflags.switch("D") is True and envflags.switch("E", True) is False
        assert envflags.positive_int("F") == 12 and envflags.positive_int("UNSET_X") is None
        assert envflags.turned_off("D", True) and not envflags.turned_off("E", False)
        mp.setenv("IRGEN_BUILD_THREADS", "1")
        assert parallel_build.workers() == 1
        for name, value, call in [("IRGEN_BUILD_THREADS", "1.5", parallel_build.workers),
                                  ("IRGEN_PLUGIN_TIMEOUT", "-3", plugins._timeout_seconds)]:
            mp.setenv(name, value)
            with pytest.raises(IrgenError, match=f"{name}='{value}': expected"):
                call()


# ------------------------------------------------------------------ file modes


def _modes(root: Path) -> dict[str, int]:
    """The permission bits of every file and folder under ``root``, by relative path."""
    found = {".": root.stat().st_mode & 0o777}
    for p in root.rglob("*"):
        found[p.relative_to(root).as_posix()] = p.lstat().st_mode & 0o777
    return found


@pytest.mark.parametrize("mask", [0o077, 0o002])
def test_every_file_irgen_writes_follows_the_umask(tmp_path, mask):
    """``irgen run`` (one input and ``--inputs``), ``irgen verify`` (its HTML report) and
    ``irgen new-plugin`` under ``umask``: files ``0o666 & ~umask``, folders ``0o777 & ~umask``."""
    work, samples = tmp_path / "w", tmp_path / "in"
    work.mkdir()
    samples.mkdir()
    np.save(samples / "s1.npy", np.ones(SHAPE, np.float32))

    def child(*argv) -> None:
        proc = subprocess.run([*IRGEN, *map(str, argv)], capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL, env=ENV, preexec_fn=lambda: os.umask(mask))
        assert proc.returncode == 0, proc.stderr

    child("run", MODEL, "-o", work / "out", "--no-progress")
    child("verify", work / "out", "--mode", "single", "--no-progress")
    child("run", MODEL, "-o", work / "many", "--inputs", samples, "--no-progress")
    child("new-plugin", "backend", "acme", "-o", work / "plugin")
    assert (work / "out.report.html").is_file() and (work / "plugin").is_dir()
    wrong = {rel: oct(mode) for rel, mode in _modes(work).items()
             if rel != "." and mode != (0o777 if (work / rel).is_dir() else 0o666) & ~mask}
    assert not wrong, f"under umask {mask:03o}: {wrong}"


# ------------------------------------------------------------------ serializers and backends never truncate


def _relu_model(path: Path, shape: list[int], output: str = "y") -> Path:
    """An ONNX model ``x -> Relu -> output`` of ``shape``, float32."""
    from onnx import TensorProto, helper, save

    graph = helper.make_graph([helper.make_node("Relu", ["x"], [output])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(output, TensorProto.FLOAT, shape)])
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return path


@pytest.mark.parametrize("case", ["rank-9-header", "long-name-header", "long-name-compress"])
def test_a_tensor_a_writer_cannot_describe_is_refused(tmp_path, case):
    """The C header's descriptor holds 8 dimensions and C string literals of 4095
    characters; a zip entry (``--compress``) a name of 65535 bytes: a tensor beyond is one
    error naming it and the limit, and OUT is not written (before: the header kept the
    first 8 dimensions without a word; the long name was an internal error)."""
    long = "\u00e9" * 12000  # 24000 bytes in UTF-8, 72000 percent-encoded
    if case == "rank-9-header":
        model = _relu_model(tmp_path / "m.onnx", [1, 1, 1, 1, 1, 1, 1, 2, 3])
        args, words = ["--serializer", "npu-int8-header"], ["tensor 'x'", "rank 9", "8 dimensions", "NPU_MAX_RANK"]
    elif case == "long-name-header":
        model = _relu_model(tmp_path / "m.onnx", [1, 4], long)
        args, words = ["--serializer", "npu-int8-header"], ["tensor '\u00e9\u00e9", "24000 bytes", "4095"]
    else:
        model = _relu_model(tmp_path / "m.onnx", [1, 4], long)
        args, words = ["--compress"], ["tensor '\u00e9\u00e9", "72004 bytes", "65535"]
    out = tmp_path / "out"
    proc = irgen("run", model, "-o", out, "--no-progress", *args)
    line = assert_refused(proc, out, *words)
    assert len(line) < 400, line


@pytest.mark.parametrize("dtype", ["complex64", "longdouble"])
def test_npu_int8_refuses_a_dtype_its_hex_cannot_hold_before_writing(tmp_path, dtype):
    pytest.importorskip("irgen_npu_int8")
    from irgen.api import IrgenError, TensorInfo
    from irgen_npu_int8 import store

    arr = np.zeros((2, 3), dtype)
    if arr.dtype.kind == "f" and arr.dtype.itemsize * 8 <= 64:
        pytest.skip(f"{dtype} is {arr.dtype.itemsize * 8} bits here")
    info = TensorInfo(name="odd", kind="activation", shape=(2, 3), dtype=str(arr.dtype))
    with pytest.raises(IrgenError, match=f"tensor 'odd' of dtype {arr.dtype}: no .hex encoding"):
        store.store_tensor(tmp_path / "odd", arr, info)
    assert list(tmp_path.iterdir()) == []  # not one of .bin, .hex, .npy
