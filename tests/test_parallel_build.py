"""irgen.parallel_build: the kernels compiled as several LLVM modules on threads and linked
into one library write the same bytes as one module, on every path a run takes (a cold run
that stores its plan, a warm run from the stored library, ``--no-cache``); kernels that
irgen's executor runs are built without TVM's argument checks, and the executor checks
every argument itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import numpy as np

from irgen import execute, parallel_build
from irgen.testing import RunError, models, run_model

#: a line of TVM's compiled argument checks (an error message in every checked kernel)
TVM_CHECK = b"Mismatched type on argument #"


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes()
            for p in sorted(out.rglob("*")) if p.is_file() and p.name != "manifest.json"}


def test_parts_deal_every_kernel_once():
    funcs = {f"f{i}": i for i in range(7)}
    groups = parallel_build.parts(funcs, 3)
    assert [list(g) for g in groups] == [["f0", "f3", "f6"], ["f1", "f4"], ["f2", "f5"]]
    assert parallel_build.parts(funcs, 1) == [funcs]
    assert parallel_build.parts({"a": 1}, 4) == [{"a": 1}]
    assert parallel_build.parts({}, 2) == []


def test_workers_follow_the_cores_and_the_cap(monkeypatch):
    monkeypatch.delenv("IRGEN_BUILD_THREADS", raising=False)
    cores = parallel_build.workers()
    assert 1 <= cores <= parallel_build.MAX_PARTS
    monkeypatch.setenv("IRGEN_BUILD_THREADS", "1")
    assert parallel_build.workers() == 1


@pytest.mark.parametrize("kind", ["float", "qdq"])
def test_kernels_built_in_parts_write_the_same_bytes(kind, tmp_path, monkeypatch):
    model = (models.float_onnx if kind == "float" else models.qdq_onnx)(tmp_path / f"{kind}.onnx")
    x = models.input_npy(tmp_path / "x.npy")
    monkeypatch.setenv("IRGEN_CACHE_SIZE", "1G")
    built = []
    real = parallel_build.build

    def build(mod, tgt, **kwargs):
        exe = real(mod, tgt, **kwargs)
        built.append(sum(1 for m in exe.mod.imports if m.kind == "llvm"))
        return exe

    monkeypatch.setattr(parallel_build, "build", build)

    def run(name: str, parts: int, *args: str) -> dict[str, bytes]:
        monkeypatch.setattr(execute, "_CACHE", {})  # compile anew in this process
        monkeypatch.setattr(parallel_build, "workers", lambda: parts)
        monkeypatch.setenv("IRGEN_CACHE_DIR", str(tmp_path / f"cache{parts}"))
        run_model(model, tmp_path / name, inputs=[x], args=list(args))
        return _files(tmp_path / name)

    one = run("one", 1)
    assert built == [1]
    three = run("three", 3)  # a cold run: built in 3 modules, exported into the cache's model.so
    assert built == [1, 3]
    warm = run("warm", 3)  # from the cache: the stored library, no build
    assert built == [1, 3]
    jit = run("jit", 3, "--no-cache")  # the executable itself
    assert built == [1, 3, 3]
    assert len(one) > 10 and any(k.startswith("activations/") for k in one)
    for name, files in (("3 parts", three), ("3 parts, from the cache", warm), ("3 parts, --no-cache", jit)):
        assert sorted(files) == sorted(one), name
        differ = [k for k in one if one[k] != files[k]]
        assert not differ, f"{name}: files differ from one LLVM module's: {differ}"


def _cold(model: Path, x: Path, out: Path, cache: Path, monkeypatch) -> Path:
    """A cold run into ``cache``; the stored entry's folder."""
    monkeypatch.setattr(execute, "_CACHE", {})
    monkeypatch.setenv("IRGEN_CACHE_DIR", str(cache))
    monkeypatch.setenv("IRGEN_CACHE_SIZE", "1G")
    run_model(model, out, inputs=[x], force=True)
    (entry,) = [p for p in cache.iterdir() if (p / "plan.json").is_file()]
    return entry


def test_kernels_are_built_without_tvm_checks_only_when_irgen_checks(tmp_path, monkeypatch):
    """The stored library of a plan that irgen's executor runs holds no TVM argument check
    (smaller, and LLVM's time down by ~40%); a plan that the Relax VM runs keeps them; both
    write the same files."""
    model = models.qdq_onnx(tmp_path / "qdq.onnx")
    x = models.input_npy(tmp_path / "x.npy")
    entry = _cold(model, x, tmp_path / "program", tmp_path / "c1", monkeypatch)
    plan = json.loads((entry / "plan.json").read_text())
    assert plan["program"] is not None
    assert all(k["arg_types"] for k in plan["kernels"] if not k["callee"].startswith("vm.builtin"))
    assert TVM_CHECK not in (entry / "model.so").read_bytes()

    monkeypatch.setattr(execute, "program", lambda mod: None)  # the Relax VM's fallback runs main
    entry_vm = _cold(model, x, tmp_path / "vm", tmp_path / "c2", monkeypatch)
    assert json.loads((entry_vm / "plan.json").read_text())["program"] is None
    assert TVM_CHECK in (entry_vm / "model.so").read_bytes()
    program, vm = _files(tmp_path / "program"), _files(tmp_path / "vm")
    assert sorted(program) == sorted(vm) and not [k for k in program if program[k] != vm[k]]


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_a_changed_cache_array_stops_the_run_before_any_kernel_reads_it(change, tmp_path, monkeypatch):
    """A constant file of the compile cache replaced by one of another shape or dtype (the
    same number of bytes: nothing else notices) is refused by irgen's argument check with
    the kernel's name and both shapes, not read past its end by a kernel built unchecked."""
    model = models.qdq_onnx(tmp_path / "qdq.onnx")
    x = models.input_npy(tmp_path / "x.npy")
    entry = _cold(model, x, tmp_path / "out", tmp_path / "cache", monkeypatch)
    consts = sorted((entry / "arrays").glob("c*.npy"), key=lambda p: -p.stat().st_size)
    victim = consts[0]
    a = np.load(victim)
    assert a.size >= 4
    changed = a.reshape(-1)[: a.size // 2 * 2].reshape(2, -1) if change == "shape" else a.view(np.uint8)
    np.save(victim, changed, allow_pickle=False)
    monkeypatch.setattr(execute, "_CACHE", {})
    with pytest.raises(RunError) as err:
        run_model(model, tmp_path / "again", inputs=[x], force=True)
    msg = str(err.value)
    assert "kernel " in msg and "compiled for shape " + str(tuple(a.shape)) in msg and str(a.dtype) in msg, msg
    assert "--no-cache" in msg and not (tmp_path / "again").exists()
