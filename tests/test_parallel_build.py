"""irgen.parallel_build: the kernels compiled as several LLVM modules on threads and linked
into one library write the same bytes as one module, on every path a run takes (a cold run
that stores its plan, a warm run from the stored library, ``--no-cache``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from irgen import execute, parallel_build
from irgen.testing import models, run_model


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

    def build(mod, tgt):
        exe = real(mod, tgt)
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
