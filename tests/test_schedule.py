"""irgen's default CPU schedule (irgen.schedule) changes no value: every activation file
of a float ONNX CNN, its QDQ int8 form and a full-integer TFLite model is byte-identical
with the schedule on and off, the scheduled kernels really run parallel and vector
loops, and the capture still sees every kernel's output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from irgen import execute, schedule, share, target
from irgen.testing import models, run_model


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted((out / "activations").rglob("*")) if p.is_file()}


def _run(model: Path, x: Path, out: Path, monkeypatch, on: bool) -> tuple[dict[str, bytes], schedule.Stats, str]:
    monkeypatch.setattr(execute, "_CACHE", {})  # compile anew: no executable of an earlier test
    monkeypatch.setattr(schedule, "MIN_WORK", 0)  # the test models are small: schedule every kernel
    monkeypatch.setattr(schedule, "ENABLED", on)
    monkeypatch.delenv(schedule.ENV_OFF, raising=False)
    built = []
    real = execute.parallel_build.build

    def build(mod, *args, **kwargs):
        exe = real(mod, *args, **kwargs)
        built.append(exe)
        return exe

    monkeypatch.setattr(execute.parallel_build, "build", build)
    run_model(model, out, inputs=[x], force=True, args=["--no-cache"])
    monkeypatch.setattr(execute.parallel_build, "build", real)
    (exe,) = built
    llvm_ir = "\n".join(m.inspect_source("ll") + m.inspect_source("s") for m in exe.mod.imports if m.kind == "llvm")
    return _files(out), schedule.last, llvm_ir


def _compare(model: Path, x: Path, tmp_path: Path, monkeypatch) -> schedule.Stats:
    off, stats_off, ir_off = _run(model, x, tmp_path / "off", monkeypatch, on=False)
    on, stats_on, ir_on = _run(model, x, tmp_path / "on", monkeypatch, on=True)
    assert stats_off.scheduled == 0 and "TVMBackendParallelLaunch" not in ir_off
    assert stats_on.scheduled > 0 and stats_on.parallel > 0 and stats_on.vectorized > 0, stats_on
    assert stats_on.tiled > 0, stats_on  # the convolutions got register tiles
    assert "TVMBackendParallelLaunch" in ir_on  # parallel loops run on TVM's thread pool
    assert sorted(on) == sorted(off) and len(on) >= 5
    differ = [name for name in on if on[name] != off[name]]
    assert not differ, f"activation files differ with the schedule on: {differ}"
    return stats_on


@pytest.mark.parametrize("kind", ["float", "qdq"])
def test_this_cpu_and_the_generic_cpu_give_the_same_bytes(kind, tmp_path, monkeypatch):
    """Kernels compiled for this machine's CPU (AVX2 and wider, FMA off) at irgen's LLVM
    optimization level write the same activation files as for LLVM's generic x86-64 CPU at
    TVM's default -O3: golden data depends neither on the CPU nor on LLVM's level."""
    if "mcpu" not in target.spec():
        pytest.skip("this machine compiles for the generic CPU already")
    assert target.spec()["opt-level"] == target.LLVM_OPT_LEVEL != 3
    model = (models.float_onnx if kind == "float" else models.qdq_onnx)(tmp_path / f"{kind}.onnx")
    x = models.input_npy(tmp_path / "x.npy")
    cpu = target.spec()["mcpu"]
    host, _, ir_host = _run(model, x, tmp_path / "host", monkeypatch, on=True)
    monkeypatch.setenv(target.ENV_GENERIC, "1")
    monkeypatch.setattr(target, "LLVM_OPT_LEVEL", 3)
    assert target.spec() == {"kind": "llvm", "opt-level": 3}
    generic, _, ir_generic = _run(model, x, tmp_path / "generic", monkeypatch, on=True)
    assert f'"target-cpu"="{cpu}"' in ir_host and f'"target-cpu"="{cpu}"' not in ir_generic
    assert "%ymm" in ir_host and "%ymm" not in ir_generic  # 256-bit vectors on this CPU only
    assert "vfmadd" not in ir_host  # no fused multiply-add: each product and sum rounds
    assert sorted(host) == sorted(generic) and len(host) >= 5
    differ = [name for name in host if host[name] != generic[name]]
    assert not differ, f"activation files differ between this CPU and the generic one: {differ}"


def test_float_onnx_cnn_is_bit_identical(tmp_path, monkeypatch):
    model = models.float_onnx(tmp_path / "cnn.onnx")
    x = models.input_npy(tmp_path / "x.npy")
    _compare(model, x, tmp_path, monkeypatch)
    # and the values are ONNX Runtime's (the capture hands over the right tensors)
    ort = pytest.importorskip("onnxruntime")
    ref = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": np.load(x)})[0]
    got = [p for p in (tmp_path / "on" / "activations").rglob("*.npy") if p.stem.startswith("y") or "fc" in p.stem]
    assert got, sorted(p.name for p in (tmp_path / "on" / "activations").rglob("*"))
    np.testing.assert_allclose(np.load(got[0]).reshape(ref.shape), ref, rtol=1e-4, atol=1e-5)


def test_qdq_int8_onnx_is_bit_identical(tmp_path, monkeypatch):
    model = models.qdq_onnx(tmp_path / "cnn_qdq.onnx")
    x = models.input_npy(tmp_path / "x.npy")
    _compare(model, x, tmp_path, monkeypatch)


def test_tflite_int8_is_bit_identical(tmp_path, monkeypatch):
    pytest.importorskip("tensorflow")
    import tflite_models

    model, x = tflite_models.export("small_cnn", tmp_path, "int8")
    np.save(tmp_path / "x.npy", x)
    stats = _compare(model, tmp_path / "x.npy", tmp_path, monkeypatch)
    assert stats.inlined > 0  # the requantization chains became one loop nest each


@pytest.mark.parametrize("step", [schedule, share], ids=["schedule", "share"])
def test_env_switch_turns_it_off(step, monkeypatch):
    """``IRGEN_NO_SCHEDULE`` / ``IRGEN_NO_SHARE``: a true value turns the step off, another
    value on, unset leaves the module switch; the compile-cache key tells them apart."""
    monkeypatch.setattr(step, "ENABLED", True)
    monkeypatch.setenv(step.ENV_OFF, " Yes ")
    assert not step.enabled()
    monkeypatch.setenv(step.ENV_OFF, "0")
    assert step.enabled()
    monkeypatch.delenv(step.ENV_OFF)
    monkeypatch.setattr(step, "ENABLED", False)
    assert not step.enabled()
    monkeypatch.setattr(step, "ENABLED", True)
    assert step.key() != (monkeypatch.setenv(step.ENV_OFF, "1") or step.key())


def _misaligned(arr: np.ndarray) -> np.ndarray:
    """A copy of ``arr`` whose data starts 16 bytes past a 64-byte boundary (misaligned for AVX)."""
    raw = np.zeros(arr.nbytes + 128, np.uint8)
    start = next(k for k in range(0, 128, 4) if (raw.ctypes.data + k) % 64 == 16)
    out = raw[start:start + arr.nbytes].view(arr.dtype).reshape(arr.shape)
    out[...] = arr
    return out


def test_relax_vm_gets_aligned_inputs(tmp_path, monkeypatch):
    """The Relax VM (the executor's fallback) hands kernels 64-byte aligned inputs even when
    the caller's arrays are not: kernels compiled for AVX load whole vectors with aligned
    moves, and a misaligned input crashed the process (SIGSEGV; QDQ model at opt level 0)."""
    from irgen import vm

    model = models.qdq_onnx(tmp_path / "qdq.onnx")
    x = models.input_npy(tmp_path / "x.npy")
    run_model(model, tmp_path / "ref", inputs=[x], force=True, args=["--no-cache", "--opt-level", "0"])
    real = vm.run

    def misaligned_run(lib, inputs, kernels, on_output):
        inputs = [_misaligned(np.asarray(a)) for a in inputs]
        assert all(a.ctypes.data % 32 == 16 for a in inputs)
        return real(lib, inputs, kernels, on_output)

    monkeypatch.setattr(execute, "_CACHE", {})
    monkeypatch.setattr(execute, "program", lambda mod: None)  # the Relax VM runs main
    monkeypatch.setattr(vm, "run", misaligned_run)
    run_model(model, tmp_path / "vm", inputs=[x], force=True, args=["--no-cache", "--opt-level", "0"])
    assert _files(tmp_path / "vm") == _files(tmp_path / "ref")


@pytest.mark.parametrize("width, lanes, tile", [(16, 8, schedule.TILE_FLOAT), (14, 7, schedule.TILE_FLOAT),
                                                (28, 7, schedule.TILE_FLOAT), (13, 13, schedule.TILE_FLOAT // 2),
                                                (7, 7, schedule.TILE_FLOAT)])
def test_vectors_and_register_tiles_fit_the_vector_registers(width, lanes, tile, monkeypatch):
    """A float convolution's output row is cut into vectors of one register (8 lanes, or the
    largest divisor of the row up to 8 when it is 4 or more: 14 and 28 give 7), each with a
    register tile of TILE_FLOAT output channels; a row of 9-16 with no such divisor is one
    vector of two registers and gets half the tile. A whole row of 14 lanes x 8 outputs
    spilled, 3x slower on ResNet-18's 14x14 convolutions."""
    import tvm
    from tvm import te, topi

    monkeypatch.setattr(schedule, "MIN_WORK", 0)
    monkeypatch.setattr(schedule, "ENABLED", True)
    monkeypatch.delenv(schedule.ENV_OFF, raising=False)
    x = te.placeholder((1, 16, width, width), "float32", name="x")
    w = te.placeholder((64, 16, 3, 3), "float32", name="w")
    y = topi.nn.conv2d_nchw(x, w, stride=1, padding=1, dilation=1)
    stats = schedule.Stats()
    func = schedule.schedule_func(te.create_prim_func([x, w, y]), stats)
    assert func is not None and stats.tiled == 1 and stats.vectorized == 1, stats
    kinds: dict[str, list[int]] = {"vectorized": [], "unrolled": []}
    wanted = {tvm.tirx.ForKind.VECTORIZED: "vectorized", tvm.tirx.ForKind.UNROLLED: "unrolled"}

    def visit(node):
        if isinstance(node, tvm.tirx.For) and int(node.kind) in wanted:
            kinds[wanted[int(node.kind)]].append(int(node.extent))

    schedule._walk(func.body, visit)
    assert kinds == {"vectorized": [lanes], "unrolled": [tile]}, kinds
