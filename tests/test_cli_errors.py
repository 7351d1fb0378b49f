"""Bad input: exit code 2, one ``irgen: error:`` line naming the culprit, no
traceback, and nothing left behind (neither OUT nor a hidden partial folder)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

IRGEN = [sys.executable, "-m", "irgen"]


def tiny_model(path: Path, channels: int = 4, hw: int = 8) -> Path:
    """x[1,3,hw,hw] -> Conv(3->channels, 3x3, pad 1) -> Relu -> y."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((channels, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "b")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["y"], name="relu"),
        ],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, hw, hw])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, hw, hw])],
        initializer=[w, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("m") / "tiny.onnx")


def irgen(*argv, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([*IRGEN, *map(str, argv)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.irgen-"))


def assert_user_error(proc: subprocess.CompletedProcess, out: Path, *names: str) -> str:
    """Exit 2, exactly one stderr line ``irgen: error: ...`` naming every ``names``."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("irgen: error: "), line
    assert "Traceback" not in proc.stderr
    for name in names:
        assert name in line, (name, line)
    assert not out.exists(), f"{out} was created"
    assert leftovers(out) == []
    return line


def test_missing_model_file(tmp_path) -> None:
    out = tmp_path / "out"
    proc = irgen("run", tmp_path / "nope.onnx", "-o", out, "--no-progress")
    assert_user_error(proc, out, "nope.onnx")


@pytest.mark.parametrize("kind", ["truncated", "random"])
def test_corrupt_onnx(model, tmp_path, kind) -> None:
    data = model.read_bytes()
    bad = tmp_path / f"{kind}.onnx"
    if kind == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    else:
        bad.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    out = tmp_path / "out"
    proc = irgen("run", bad, "-o", out, "--no-progress")
    assert_user_error(proc, out, bad.name)


def test_unsupported_ops_are_all_listed(tmp_path) -> None:
    graph = helper.make_graph(
        [
            helper.make_node("FooBar", ["x"], ["t"], name="foo"),
            helper.make_node("BazQux", ["t"], ["y"], name="baz"),
        ],
        "made_up",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    path = tmp_path / "madeup.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)
    out = tmp_path / "out"
    proc = irgen("run", path, "-o", out, "--no-progress")
    assert_user_error(proc, out, "FooBar", "BazQux")


def _bad_input(tmp_path: Path, how: str) -> Path:
    path = tmp_path / f"{how}.npy"
    if how == "shape":
        np.save(path, np.zeros((1, 3, 4, 4), np.float32))
    elif how == "dtype":
        np.save(path, np.zeros((1, 3, 8, 8), np.float64))
    else:
        np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    return path


@pytest.mark.parametrize("how,words", [
    ("shape", ["shape", "(1, 3, 4, 4)", "'x'"]),
    ("dtype", ["dtype", "float64", "'x'"]),
    ("pickle", ["pickle"]),
])
def test_bad_input_file(model, tmp_path, how, words) -> None:
    npy = _bad_input(tmp_path, how)
    out = tmp_path / "out"
    proc = irgen("run", model, "-o", out, "--input", npy, "--no-progress")
    line = assert_user_error(proc, out, npy.name)
    for w in words:
        assert w in line.lower() if w.islower() else w in line, (w, line)


def test_input_with_unknown_name(model, tmp_path) -> None:
    npy = tmp_path / "x.npy"
    np.save(npy, np.zeros((1, 3, 8, 8), np.float32))
    out = tmp_path / "out"
    proc = irgen("run", model, "-o", out, "--input", f"nosuch={npy}", "--no-progress")
    assert_user_error(proc, out, "nosuch", "inputs: x")


def test_existing_output_needs_force(model, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = irgen("run", model, "-o", out, "--no-progress")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("irgen: error: ") and str(out) in lines[0]
    assert "--force" in lines[0]
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine"
    assert leftovers(out) == []

    proc = irgen("run", model, "-o", out, "--force", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert not (out / "keep.txt").exists()
    assert (out / "ir.json").is_file() and (out / "manifest.json").is_file()
    assert leftovers(out) == []


def test_interrupt_leaves_nothing(tmp_path) -> None:
    """SIGINT during the run: exit 130 and no OUT, no partial folder."""
    model = tiny_model(tmp_path / "wide.onnx", channels=64, hw=96)
    out = tmp_path / "out"
    proc = subprocess.Popen([*IRGEN, "run", str(model), "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    deadline = time.monotonic() + 240
    try:
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("[2]") or line.startswith("[4] run"):
                break
            assert time.monotonic() < deadline, seen
        else:
            pytest.fail(f"irgen finished before a stage line: {seen}")
        os.kill(proc.pid, signal.SIGINT)
        rest = proc.stderr.read()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code == 0:
        pytest.skip("irgen finished before SIGINT arrived")
    assert code == 130, (code, "".join(seen) + rest)
    assert "Traceback" not in rest, rest
    assert rest.rstrip().endswith("irgen: interrupted"), rest
    assert not out.exists()
    assert leftovers(out) == []


def test_interrupt_turned_into_other_error_still_exits_130(monkeypatch, capsys) -> None:
    """TVM's C++ turns Ctrl-C into a bare RuntimeError; the CLI still reports an interrupt."""
    from irgen.cli import main
    from irgen.plugins import PluginHost

    def load(self, **kwargs):
        try:
            # to this thread (os.kill may hand it to a thread of a pool an earlier test started, and
            # this one sleeps on), unblocked here whatever a library did to the mask
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            raise RuntimeError from None  # what tvm_ffi raises
        raise AssertionError("SIGINT did not arrive")

    monkeypatch.setattr(PluginHost, "load", load)
    # Python's own handler, also where the suite was started in the background (a shell's `cmd &`
    # starts it with SIGINT ignored, and Python then keeps it ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert main(["plugins"]) == 130
        assert capsys.readouterr().err == "irgen: interrupted\n"
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


BACKEND_PLUGIN = """
from irgen import hookimpl
from irgen.api import Backend
from irgen_generic import RULES


@hookimpl
def irgen_register_backends(register):
    register(Backend("nhwc-only", RULES, layout="NHWC"))
    register(Backend("pool-only", RULES, supported_ops=frozenset({"max_pool2d"})))
"""


def test_backend_layout_and_supported_ops_are_checked(model, tmp_path, plugin_file) -> None:
    plugin = plugin_file("strict_backends", BACKEND_PLUGIN)
    out = tmp_path / "out"
    proc = irgen("run", str(model), "-o", str(out), "--plugin", str(plugin), "--backend", "nhwc-only", "--no-progress")
    assert_user_error(proc, out, "nhwc-only", "NHWC", "NCHW")
    proc = irgen("run", str(model), "-o", str(out), "--plugin", str(plugin), "--backend", "pool-only", "--no-progress")
    assert_user_error(proc, out, "pool-only", "unsupported ops: conv2d")


def test_external_data_outside_the_model_folder_is_refused(tmp_path) -> None:
    """Model files are untrusted: an initializer pointing outside the model's folder is an error."""
    from onnx import external_data_helper

    src = tiny_model(tmp_path / "src.onnx")
    m = onnx.load(str(src))
    w = next(t for t in m.graph.initializer if t.name == "w")
    external_data_helper.set_external_data(w, location="../../../etc/passwd")
    w.data_location = onnx.TensorProto.EXTERNAL
    w.ClearField("raw_data")
    w.ClearField("float_data")
    evil = tmp_path / "models" / "evil.onnx"
    evil.parent.mkdir()
    with open(evil, "wb") as f:
        f.write(m.SerializeToString())
    out = tmp_path / "out"
    proc = irgen("run", str(evil), "-o", str(out), "--no-progress")
    assert_user_error(proc, out, "evil.onnx", "'w'", "outside the model's folder")
