"""Issue 14: the compile cache, lean output (``--debug``, ``--layers``), many inputs
(``--inputs``, ``-j``) and TVM without torch. Every output is compared byte for byte
with a plain ``irgen run`` of the same model and input, and checked by ``irgen verify``
(its source check runs onnxruntime)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from irgen.cli import main
from irgen.verify import verify_output
from layercheck import output_files

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "tiny_cnn.onnx"
SHAPE = (1, 3, 32, 32)


def _run(*argv: str) -> None:
    assert main(["run", str(MODEL), "--no-progress", *argv]) == 0


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("IRGEN_CACHE_DIR", str(folder))
    monkeypatch.setenv("IRGEN_CACHE_SIZE", "1G")
    return folder


def test_cached_run_writes_the_same_bytes(tmp_path, cache, capsys, monkeypatch):
    from irgen import execute

    monkeypatch.setattr(execute, "_CACHE", {})  # a compile of its own, not one an earlier test left in this process
    _run("-o", str(tmp_path / "fresh"), "--debug", "all")
    entries = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and (entries[0] / "model.so").is_file() and (entries[0] / "plan.json").is_file()
    capsys.readouterr()
    assert main(["run", str(MODEL), "-o", str(tmp_path / "warm"), "--debug", "all"]) == 0
    assert "compiled model from the cache" in capsys.readouterr().err
    _run("-o", str(tmp_path / "uncached"), "--debug", "all", "--no-cache")
    fresh = output_files(tmp_path / "fresh")
    assert "debug/output_tensors.params" in fresh
    assert output_files(tmp_path / "warm") == fresh
    assert output_files(tmp_path / "uncached") == fresh
    assert verify_output(tmp_path / "warm", modes=("single", "entire", "source"))["passed"]
    # a kernel's weight constant is its layer's weight parameter: one file in the entry
    plan = json.loads((entries[0] / "plan.json").read_text())
    param_files = {f for roles in plan["params"] for f in roles.values()}
    weights = {roles["weight"] for roles in plan["params"] if "weight" in roles}
    assert weights and weights <= set(plan["consts"]) <= param_files | set(plan["consts"])
    stored = sorted(p.name for p in (entries[0] / "arrays").iterdir())
    assert stored == sorted(param_files | set(plan["consts"]))


def _split_model(path: Path) -> Path:
    """conv (weights), a three-way split (one kernel, three outputs), relu/sigmoid, concat, a
    reshape (a view), transpose, mean, dense; a second model output is a view of a split piece."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def init(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    n = helper.make_node
    nodes = [n("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             n("Split", ["c1"], ["s0", "s1", "s2"], axis=1, name="split"),
             n("Relu", ["s0"], ["r0"], name="relu0"), n("Sigmoid", ["s1"], ["g1"], name="sig1"),
             n("Concat", ["r0", "g1", "s2"], ["cat"], axis=1, name="cat"),
             n("Reshape", ["cat", "shape"], ["rs"], name="reshape"),
             n("Transpose", ["rs"], ["tr"], perm=[0, 2, 1], name="transpose"),
             n("ReduceMean", ["tr"], ["m"], axes=[1], keepdims=0, name="mean"),
             n("Gemm", ["m", "wf", "bf"], ["y"], transB=1, name="fc"), n("Flatten", ["s2"], ["y2"], name="flat")]
    graph = helper.make_graph(
        nodes, "split", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5]),
         helper.make_tensor_value_info("y2", TensorProto.FLOAT, [1, 256])],
        [init("w1", (12, 3, 3, 3)), init("b1", (12,)), numpy_helper.from_array(np.array([1, 12, 64], np.int64), "shape"),
         init("wf", (5, 12)), init("bf", (5,))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _entries(cache: Path) -> list[Path]:
    return [p for p in cache.iterdir() if not p.name.startswith(".")]


@pytest.mark.parametrize("kind", ["split", "qdq"])
@pytest.mark.parametrize("opt", [0, 3])
def test_warm_run_streams_weights_and_writes_the_same_bytes(tmp_path, cache, monkeypatch, kind, opt):
    """A run from the cache reads each kernel's constants from the entry's files just before
    the kernel (irgen's executor, no Relax VM) and writes the bytes of a run that never saw
    the cache, and of the VM fallback; the library holds no weights."""
    from irgen import execute, plan as plan_mod, vm
    from irgen.testing import models

    model = _split_model(tmp_path / "split.onnx") if kind == "split" else models.qdq_onnx(tmp_path / "qdq.onnx")
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(5).standard_normal((1, 3, 8, 8)).astype(np.float32))

    def run(out: str, *extra: str) -> dict[str, bytes]:
        assert main(["run", str(model), "-o", str(tmp_path / out), "--input", str(x), "--opt-level", str(opt),
                     "--debug", "all", "--no-progress", *extra]) == 0
        return output_files(tmp_path / out)

    fresh = run("fresh", "--no-cache")
    assert run("cold") == fresh
    (entry,) = _entries(cache)
    doc = json.loads((entry / "plan.json").read_text())
    assert doc["program"] is not None
    assert any(len(k["outputs"]) > 1 for k in doc["kernels"]) or kind != "split"  # a multi-output kernel
    assert any(k["callee"] == "vm.builtin.reshape" for k in doc["kernels"])  # a view
    biggest = max((entry / "arrays").glob("c*.npy"), key=lambda f: f.stat().st_size)
    assert np.load(biggest).tobytes() not in (entry / "model.so").read_bytes()  # weights are not in the library
    loaded = plan_mod.Plan.load(entry)  # reads no array up front
    assert all(isinstance(v, plan_mod.Stored) for v in [*loaded.consts, *(a for p in loaded.params for a in p.values())])

    real, seen = vm.run_program, {"alive": 0, "loads": 0}

    def tracked(lib, program, kernels, inputs, const, on_output):
        import weakref

        refs = []

        def load(i):
            arr = const(i)
            refs.append(weakref.ref(arr))
            seen["loads"] += 1
            return arr

        def out(ki, j, tensor):
            seen["alive"] = max(seen["alive"], sum(r() is not None for r in refs))
            on_output(ki, j, tensor)

        return real(lib, program, kernels, inputs, load, out)

    monkeypatch.setattr(vm, "run_program", tracked)
    assert run("warm") == fresh
    assert seen["loads"] >= len(doc["consts"]) and seen["alive"] == 0  # no weight outlives its kernel call
    assert verify_output(tmp_path / "warm", modes=("single", "entire"))["passed"]
    # the Relax VM (the fallback for a main the executor cannot run) writes the same bytes
    monkeypatch.setattr(execute, "_CACHE", {})
    monkeypatch.setattr(execute, "program", lambda mod: None)
    assert run("vm", "--no-cache") == fresh


def test_cache_key_and_damaged_entries(tmp_path, cache, capsys):
    _run("-o", str(tmp_path / "a"))
    _run("-o", str(tmp_path / "b"), "--opt-level", "1")  # another opt level: another entry
    entries = sorted(p for p in cache.iterdir() if not p.name.startswith("."))
    assert len(entries) == 2
    for e in entries:  # a damaged entry is compiled anew, not trusted
        (e / "plan.json").write_text("{not json")
    capsys.readouterr()
    assert main(["run", str(MODEL), "-o", str(tmp_path / "c")]) == 0
    assert "from the cache" not in capsys.readouterr().err
    assert output_files(tmp_path / "c") == output_files(tmp_path / "a")
    capsys.readouterr()
    assert main(["run", str(MODEL), "-o", str(tmp_path / "d")]) == 0
    assert "compiled model from the cache" in capsys.readouterr().err


def test_cache_size_bound(tmp_path, cache, monkeypatch):
    from irgen import cache as cache_mod

    for level in (0, 1, 2):
        _run("-o", str(tmp_path / f"o{level}"), "--opt-level", str(level))
    entries = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 3
    sizes = {p: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) for p in entries}
    oldest = min(entries, key=lambda p: p.stat().st_mtime)
    cache_mod.trim(sum(sizes.values()) - 1)
    left = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert oldest not in left and len(left) == 2
    monkeypatch.setenv("IRGEN_CACHE_SIZE", "0")  # off: nothing stored
    _run("-o", str(tmp_path / "off"), "--opt-level", "3")
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 2


def test_debug_levels(tmp_path):
    for level in ("none", "layers", "all"):
        _run("-o", str(tmp_path / level), "--debug", level)
    assert not (tmp_path / "none" / "debug").exists()
    assert sorted(p.name for p in (tmp_path / "layers" / "debug").iterdir()) == ["_tvmdbg_graph_dump.json"]
    assert (tmp_path / "all" / "debug" / "output_tensors.params").is_file()
    # apart from debug/ the three outputs are the same
    strip = {lvl: {k: v for k, v in output_files(tmp_path / lvl).items() if not k.startswith(("debug/", "manifest"))}
             for lvl in ("none", "layers", "all")}
    assert strip["none"] == strip["layers"] == strip["all"]


def test_layers_subset(tmp_path):
    _run("-o", str(tmp_path / "all"))
    _run("-o", str(tmp_path / "sub"), "--layers", "conv*")
    ir = json.loads((tmp_path / "sub" / "ir.json").read_text())
    written = {l["name"] for l in ir["layers"] if l["outputs"][0]["file"]}
    chosen = {l["name"] for l in ir["layers"] if l["name"].startswith("conv")}
    model_out = {o["producer"] for o in ir["outputs"]}
    assert chosen and written == chosen | model_out
    full = output_files(tmp_path / "all")
    for name, data in output_files(tmp_path / "sub").items():
        if name.startswith(("activations/", "parameters/")):
            assert full[name] == data  # the same file names and bytes as the full run
    result = verify_output(tmp_path / "sub", modes=("single", "entire", "source"))
    assert result["passed"]
    statuses = {(l["name"], mode): m["status"] for l in result["layers"] for mode, m in l["checks"].items() if m}
    for name in written:
        assert statuses[(name, "source")] == "pass"
    for name in {l["name"] for l in ir["layers"]} - written:
        assert statuses[(name, "single")] == "missing"


def _samples(folder: Path, n: int) -> list[Path]:
    folder.mkdir()
    rng = np.random.default_rng(7)
    paths = []
    for k in range(n):
        paths.append(folder / f"s{k:02d}.npy")
        np.save(paths[-1], rng.standard_normal(SHAPE).astype(np.float32))
    return paths


def test_inputs_in_workers_match_single_runs(tmp_path):
    paths = _samples(tmp_path / "in", 5)
    proc = subprocess.run([sys.executable, "-m", "irgen", "run", str(MODEL), "-o", str(tmp_path / "many"),
                           "--inputs", str(tmp_path / "in"), "-j", "2"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "5/5 samples" in proc.stderr
    assert "Traceback" not in proc.stderr  # workers exit (or are stopped) quietly
    assert sorted(p.name for p in (tmp_path / "many").iterdir()) == [p.stem for p in paths]
    for p in paths[::2]:
        _run("-o", str(tmp_path / f"one_{p.stem}"), "--input", str(p))
        assert output_files(tmp_path / "many" / p.stem) == output_files(tmp_path / f"one_{p.stem}")
    # the parameter files are shared, not copied
    w = sorted((tmp_path / "many" / "s00" / "parameters").iterdir())[0]
    assert os.stat(w).st_nlink == 5 and os.path.samefile(w, tmp_path / "many" / "s04" / "parameters" / w.name)
    assert verify_output(tmp_path / "many" / "s03", modes=("single", "entire", "source"))["passed"]


def _tvm_threads() -> int:
    """The size of the calling thread's TVM thread pool."""
    import tvm_ffi

    return int(tvm_ffi.get_global_func("runtime.NumThreads")())


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
def test_inputs_workers_run_kernels_on_their_share_of_the_cores(tmp_path, monkeypatch):
    """Each worker's kernels run on a TVM thread pool of its own with the threads it was given,
    whatever pool the parent's thread made before the fork; the split is the cores over the
    workers unless TVM_NUM_THREADS says otherwise."""
    from irgen import vm, workers
    from irgen.output import Progress

    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    assert vm.use_threads(1) == 1 == _tvm_threads()  # this thread's pool: one thread, kept for its life

    def work(name: str) -> None:
        (tmp_path / name).write_text(f"{os.getpid()} {_tvm_threads()} {os.environ['TVM_NUM_THREADS']}")

    names = [f"s{k}" for k in range(6)]
    workers.in_workers(names, 2, 2, work, Progress(enabled=False))
    seen = [(tmp_path / n).read_text().split() for n in names]
    assert {(threads, env) for _, threads, env in seen} == {("2", "2")}
    assert os.getpid() not in {int(pid) for pid, _, _ in seen} and len({pid for pid, _, _ in seen}) <= 2
    assert _tvm_threads() == 1  # the parent's pool is untouched

    monkeypatch.delenv("TVM_NUM_THREADS")
    cores = len(os.sched_getaffinity(0))
    # -j N: N cores, a worker each; fewer samples than cores: the workers share out the rest
    assert [workers.split_cores(j, 64) for j in (1, 2, 3)] == [(1, 1), (2, 1), (3, 1)]
    assert workers.split_cores(None, 64) == (cores, 1)
    assert workers.split_cores(None, 1) == (1, cores)
    assert workers.split_cores(4, 2) == (2, 2) and workers.split_cores(5, 2) == (2, 2)
    monkeypatch.setenv("TVM_NUM_THREADS", "3")
    assert workers.split_cores(2, 64) == (2, 3) and workers.split_cores(2, 1) == (1, 3)


def test_inputs_after_parallel_kernels_in_the_parent(tmp_path):
    """A process whose thread ran parallel kernels (its TVM pool has worker threads, which a
    forked child does not inherit) then runs many inputs in two workers of two threads: the
    workers do not wait forever on the lost threads, and write what single runs write."""
    paths = _samples(tmp_path / "in", 3)
    code = (
        "import os, sys; os.environ['TVM_NUM_THREADS'] = '2'\n"
        "from irgen.cli import main\n"
        f"assert main(['run', {str(MODEL)!r}, '-o', {str(tmp_path / 'one')!r}, '--input', {str(paths[1])!r}, "
        "'--no-progress']) == 0\n"
        "import tvm_ffi; assert tvm_ffi.get_global_func('runtime.NumThreads')() == 2\n"
        f"assert main(['run', {str(MODEL)!r}, '-o', {str(tmp_path / 'many')!r}, '--inputs', "
        f"{str(tmp_path / 'in')!r}, '-j', '2', '--no-progress']) == 0\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert output_files(tmp_path / "many" / paths[1].stem) == output_files(tmp_path / "one")


def _multi_output_qdq(folder: Path) -> Path:
    """irgen.testing.models' QDQ CNN with two more outputs (the residual add and the pooled
    features), quantized by ONNX Runtime."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from irgen.testing import models

    src = models.float_onnx(folder / "float.onnx")
    m = onnx.load(str(src))
    m.graph.output.extend([helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 8, 4, 4]),
                           helper.make_tensor_value_info("g", TensorProto.FLOAT, [1, 8, 1, 1])])
    onnx.save(m, str(folder / "float3.onnx"))
    return models.quantize_qdq(folder / "float3.onnx", folder / "qdq3.onnx")


def test_inputs_two_workers_write_what_one_writes_on_a_multi_output_qdq_model(tmp_path):
    from irgen.testing import models

    model = _multi_output_qdq(tmp_path)
    (tmp_path / "in").mkdir()
    for k in range(4):
        models.input_npy(tmp_path / "in" / f"x{k}.npy", seed=k)
    for j in ("1", "2"):
        assert main(["run", str(model), "-o", str(tmp_path / f"j{j}"), "--inputs", str(tmp_path / "in"), "-j", j,
                     "--no-progress"]) == 0
    ir = json.loads((tmp_path / "j2" / "x3" / "ir.json").read_text())
    assert len(ir["outputs"]) == 3 and ir["layers"]
    for k in range(4):
        assert output_files(tmp_path / "j1" / f"x{k}") == output_files(tmp_path / "j2" / f"x{k}")
    assert main(["run", str(model), "-o", str(tmp_path / "one"), "--input", str(tmp_path / "in" / "x2.npy"),
                 "--no-progress"]) == 0
    assert output_files(tmp_path / "one") == output_files(tmp_path / "j2" / "x2")
    assert verify_output(tmp_path / "j2" / "x2", modes=("single", "source"))["passed"]  # against onnxruntime


def test_inputs_failing_worker(tmp_path, monkeypatch, capsys):
    """A sample that fails in a worker is named, a worker that dies is reported, the other
    worker stops, and no output (nor a hidden partial folder) is left."""
    from irgen import pipeline

    _samples(tmp_path / "in", 6)
    real = pipeline.write_output

    def failing(host, plan, arrays, folder, *args, **kwargs):
        if folder.tmp.name == "s03" and not os.environ.get("DIE"):
            raise OSError(28, "No space left on device")
        if folder.tmp.name == "s04" and os.environ.get("DIE"):
            os._exit(9)
        return real(host, plan, arrays, folder, *args, **kwargs)

    monkeypatch.setattr(pipeline, "write_output", failing)  # the workers are forked: they have it too
    for die, message in (("", "sample 's03': OSError: [Errno 28] No space left on device"),
                         ("1", "a worker process died (exit code 9)")):
        monkeypatch.setenv("DIE", die)
        capsys.readouterr()
        assert main(["run", str(MODEL), "-o", str(tmp_path / "out"), "--inputs", str(tmp_path / "in"), "-j", "2",
                     "--no-progress"]) == 2
        assert message in capsys.readouterr().err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_inputs_from_one_npz(tmp_path, capsys):
    rng = np.random.default_rng(3)
    arrays = {"b": rng.standard_normal(SHAPE).astype(np.float32), "a": rng.standard_normal(SHAPE).astype(np.float32)}
    np.savez(tmp_path / "x.npz", **arrays)
    capsys.readouterr()
    _run("-o", str(tmp_path / "many"), "--inputs", str(tmp_path / "x.npz"), "--verify")
    verdicts = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("PASS:", "FAIL:"))]
    assert len(verdicts) == 2 and all(v.startswith("PASS:") for v in verdicts)  # --verify checks every sample
    assert sorted(p.name for p in (tmp_path / "many").iterdir()) == ["a", "b"]
    for k, arr in arrays.items():
        ir = json.loads((tmp_path / "many" / k / "ir.json").read_text())
        got = np.load(tmp_path / "many" / k / ir["inputs"][0]["file"])
        assert np.array_equal(got, arr)


def test_inputs_errors(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    bad = tmp_path / "bad"
    bad.mkdir()
    np.save(bad / "a.npy", np.zeros(SHAPE, np.float32))
    np.save(bad / "b.npy", np.zeros((1, 3, 8, 8), np.float32))
    np.save(tmp_path / "x.npy", np.zeros(SHAPE, np.float32))
    cases = [
        (["--inputs", str(tmp_path / "empty")], "no .npy or .npz files"),
        (["--inputs", str(bad)], "does not match input"),
        (["--inputs", str(bad), "--input", str(tmp_path / "x.npy")], "not both"),
        (["-j", "2"], "only with --inputs"),
    ]
    for args, message in cases:
        capsys.readouterr()
        assert main(["run", str(MODEL), "-o", str(tmp_path / "out"), "--no-progress", *args]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "out").exists()  # nothing half-written


def test_tvm_without_torch_unless_needed(tmp_path):
    """The CLI imports TVM without torch (1-1.5 s of every run); torch imported later still
    reaches tvm_ffi's converters."""
    code = (
        "import sys; from irgen.cli import main\n"
        f"assert main(['run', {str(MODEL)!r}, '-o', {str(tmp_path / 'o')!r}, '--no-progress']) == 0\n"
        "assert 'tvm' in sys.modules and 'torch' not in sys.modules, 'torch was imported'\n"
        "import torch, tvm, tvm_ffi._convert\n"
        "assert tvm_ffi._convert.torch is torch\n"
        "t = tvm.runtime.from_dlpack(torch.arange(6, dtype=torch.float32))\n"
        "assert t.numpy().tolist() == [0, 1, 2, 3, 4, 5]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


#: every function each of TVM's ``_ffi_api`` modules gets, as JSON (run in a child: a fresh import)
_FFI_API_SCRIPT = """
import json, os, sys
if sys.argv[1] == "lean":
    from irgen import lean_import
    lean_import.install()
import tvm, tvm.relax, tvm.relax.frontend.onnx, tvm_ffi.registry
assert tvm_ffi.registry.list_global_func_names.__module__ == "tvm_ffi.registry", "the kept list outlived the import"
apis = {n: sorted(k for k in vars(m) if not k.startswith("__")) for n, m in sys.modules.items()
        if n.endswith("_ffi_api") and m is not None and not n.startswith("tvm.runtime.disco.")}
print(json.dumps({"autoload": os.environ.get("TVM_DEVICE_BACKEND_AUTOLOAD"), "apis": apis,
                  "disco": repr(tvm.runtime.disco)}))
"""


def test_lean_tvm_import_gives_tvm_the_same_functions():
    """The lean import (the name list kept while ``tvm`` imports, no GPU backend hooks, no
    attempt at the distributed runtime) leaves every ``_ffi_api`` module of TVM with the
    functions a plain ``import tvm`` gives it, and ``tvm.runtime.disco`` None as a plain
    import does (its import fails there); tvm_ffi's own lister is back afterwards; a user's
    TVM_DEVICE_BACKEND_AUTOLOAD wins."""
    env = {k: v for k, v in os.environ.items() if k != "TVM_DEVICE_BACKEND_AUTOLOAD"}

    def apis(mode: str, **extra: str) -> dict:
        proc = subprocess.run([sys.executable, "-c", _FFI_API_SCRIPT, mode], capture_output=True, text=True,
                              env={**env, **extra})
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.splitlines()[-1])

    plain, lean = apis("plain"), apis("lean")
    assert plain["autoload"] is None and lean["autoload"] == "0"
    assert len(lean["apis"]) > 20 and sum(map(len, lean["apis"].values())) > 1000
    assert lean["apis"] == plain["apis"]
    assert lean["disco"] == plain["disco"] == "None"
    assert apis("lean", TVM_DEVICE_BACKEND_AUTOLOAD="1")["autoload"] == "1"


def test_compressed_storage(tmp_path):
    from irgen.testing import read_tensor

    _run("-o", str(tmp_path / "npy"))
    _run("-o", str(tmp_path / "npz"), "--compress")
    plain = json.loads((tmp_path / "npy" / "ir.json").read_text())
    packed = json.loads((tmp_path / "npz" / "ir.json").read_text())
    files = {p.relative_to(tmp_path / "npz").as_posix() for p in (tmp_path / "npz").rglob("*.np?")}
    assert files and all(f.endswith(".npz") for f in files)
    n_layers = len(packed["layers"])
    assert len([f for f in files if f.startswith("parameters/")]) == len([l for l in packed["layers"] if l["params"]])
    assert len([f for f in files if f.startswith("activations/")]) == n_layers + len(packed["inputs"])

    def tensors(ir):
        for t in ir["inputs"]:
            yield t
        for l in ir["layers"]:
            yield from l["outputs"]
            yield from l["params"].values()

    for a, b in zip(tensors(plain), tensors(packed), strict=True):
        x, y = read_tensor(tmp_path / "npy", a), read_tensor(tmp_path / "npz", b)
        assert a["name"] == b["name"] and x.dtype == y.dtype and x.tobytes() == y.tobytes()
    assert verify_output(tmp_path / "npz", modes=("single", "entire", "source"))["passed"]
    # a changed member is caught (manifest checksum)
    target = tmp_path / "npz" / packed["layers"][0]["outputs"][0]["file"]
    import zipfile

    with zipfile.ZipFile(target, "a") as zf:
        zf.writestr("extra.npy", b"x")
    assert not verify_output(tmp_path / "npz", modes=("single",))["passed"]


def test_data_movement_folded_in_numpy_as_tvm_folds_it():
    """Reshapes and transposes of constants are folded in numpy (TVM's FoldConstant compiles a
    kernel for each): after FoldConstant the module is the one FoldConstant alone gives."""
    import tvm
    from tvm import relax
    from tvm.script import relax as R

    from irgen.graph import fold_data_movement, main_bindings

    w = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    b = np.arange(6, dtype=np.int8)

    @tvm.script.ir_module
    class Mod:
        @R.function
        def main(x: R.Tensor((4, 6), "float32"), y: R.Tensor((1, 6, 1), "int8")):
            with R.dataflow():
                t = R.permute_dims(R.const(w), [2, 0, 1])
                r = R.reshape(t, R.shape([4, 6]))
                e = R.expand_dims(R.squeeze(R.reshape(R.const(b), R.shape([1, 6, 1])), [0]), [0])
                out = R.add(x, r)
                out2 = R.add(y, e)
                R.output(out, out2)
            return (out, out2)

    folded = fold_data_movement(Mod)
    calls = [bd.op for bd in main_bindings(folded)[1] if isinstance(bd.value, relax.Call)]
    assert calls.count("relax.add") == 2 and len(calls) == 2  # every data-movement op became a constant
    tvm.ir.assert_structural_equal(relax.transform.FoldConstant()(folded), relax.transform.FoldConstant()(Mod))


def test_a_cached_run_never_imports_tvm(tmp_path, cache):
    """A run whose plan is in the cache runs the stored library through tvm_ffi alone: nothing
    on its path (the cache key, the compile target's CPU included) imports the tvm package."""
    _run("-o", str(tmp_path / "cold"))
    code = (
        "import sys; from irgen.cli import main\n"
        f"assert main(['run', {str(MODEL)!r}, '-o', {str(tmp_path / 'warm')!r}, '--no-progress']) == 0\n"
        "print(sorted(m for m in sys.modules if m == 'tvm' or m.startswith('tvm.')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
    assert output_files(tmp_path / "warm") == output_files(tmp_path / "cold")


def test_workers_are_not_pinned_to_one_core(tmp_path, cache):
    """TVM binds a one-thread pool's caller to core 0; irgen asks it not to (TVM_BIND_THREADS=0),
    or the -j workers of --inputs (one kernel thread each on a 2-core machine) all ran on core 0,
    one at a time: every worker's kernel thread keeps the cores the process was given."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: nothing to pin away from")
    samples = tmp_path / "samples"
    samples.mkdir()
    rng = np.random.default_rng(3)
    for k in range(4):
        np.save(samples / f"s{k}.npy", rng.random(SHAPE, dtype=np.float32))
    log = tmp_path / "affinity.txt"
    code = (
        "import os; from irgen import pipeline; from irgen.cli import main\n"
        "real = pipeline.write_output\n"
        "def spy(*args, **kwargs):\n"
        "    out = real(*args, **kwargs)  # the sample's kernels ran on this thread\n"
        f"    open({str(log)!r}, 'a').write(repr(sorted(os.sched_getaffinity(0))) + '\\n')\n"
        "    return out\n"
        "pipeline.write_output = spy\n"
        f"raise SystemExit(main(['run', {str(MODEL)!r}, '--inputs', {str(samples)!r}, '-j', '2', "
        f"'-o', {str(tmp_path / 'out')!r}, '--no-progress']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_BIND_THREADS", "TVM_NUM_THREADS")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    seen = log.read_text().splitlines()
    assert len(seen) == 4 and all(line == repr(cores) for line in seen), seen
