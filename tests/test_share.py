"""Kernels that differ only in their constants share one compiled function (irgen.share),
and no value changes: every activation file of a QDQ chain, a full-integer TFLite chain and a
float ONNX chain is byte-identical with sharing on and off, the shared kernels agree with the
source runtime, and a plan read back from the compile cache runs the shared functions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from irgen import execute, share
from irgen.testing import models, run_model, verify


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted((out / "activations").rglob("*")) if p.is_file()}


def _run(model: Path, x: Path, out: Path, monkeypatch, on: bool, args=("--no-cache",)) -> tuple[dict, share.Stats, int]:
    """Activation files, what sharing did, and how many PrimFuncs LLVM compiled."""
    monkeypatch.setattr(execute, "_CACHE", {})  # compile anew: no executable of an earlier test
    monkeypatch.setattr(share, "ENABLED", on)
    monkeypatch.delenv(share.ENV_OFF, raising=False)
    compiled = []
    real = execute.parallel_build.build

    def build(mod, *a, **kw):
        import tvm

        compiled.append(sum(isinstance(f, tvm.tirx.PrimFunc) for f in mod.functions.values()))
        return real(mod, *a, **kw)

    monkeypatch.setattr(execute.parallel_build, "build", build)
    run_model(model, out, inputs=[x], force=True, args=list(args))
    monkeypatch.setattr(execute.parallel_build, "build", real)
    return _files(out), share.stats, (compiled or [0])[0]


def _compare(model: Path, x: Path, tmp_path: Path, monkeypatch) -> share.Stats:
    off, stats_off, n_off = _run(model, x, tmp_path / "off", monkeypatch, on=False)
    on, stats_on, n_on = _run(model, x, tmp_path / "on", monkeypatch, on=True)
    assert stats_off.groups == 0
    assert stats_on.groups > 0 and stats_on.removed > 0, stats_on
    assert n_on == n_off - stats_on.removed, (n_on, n_off, stats_on)
    assert sorted(on) == sorted(off) and len(on) >= 5
    differ = [name for name in on if on[name] != off[name]]
    assert not differ, f"activation files differ with sharing on: {differ}"
    return stats_on


def _chain_onnx(path: Path) -> Path:
    """conv 3->8, then four 3x3 convs 8->8 of one shape (relu, clip 0..6, none, relu) each
    with a residual add, GAP, dense: twins in all but their (quantization) constants."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)

    def init(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    n = helper.make_node
    inits = [init("w0", (8, 3, 3, 3)), init("b0", (8,)), init("wf", (4, 8)), init("bf", (4,)),
             numpy_helper.from_array(np.array(0.0, np.float32), "lo"), numpy_helper.from_array(np.array(6.0, np.float32), "hi")]
    nodes = [n("Conv", ["x", "w0", "b0"], ["h0"], pads=[1, 1, 1, 1], name="conv0")]
    h = "h0"
    for k, act in enumerate(["relu", "clip", None, "relu"], start=1):
        inits += [init(f"w{k}", (8, 8, 3, 3)), init(f"b{k}", (8,))]
        nodes.append(n("Conv", [h, f"w{k}", f"b{k}"], [f"c{k}"], pads=[1, 1, 1, 1], name=f"conv{k}"))
        c = f"c{k}"
        if act == "relu":
            nodes.append(n("Relu", [c], [f"r{k}"], name=f"relu{k}"))
            c = f"r{k}"
        elif act == "clip":
            nodes.append(n("Clip", [c, "lo", "hi"], [f"r{k}"], name=f"clip{k}"))
            c = f"r{k}"
        nodes.append(n("Add", [h, c], [f"h{k}"], name=f"add{k}"))
        h = f"h{k}"
    nodes += [n("GlobalAveragePool", [h], ["g"], name="gap"), n("Flatten", ["g"], ["f"], name="flat"),
              n("Gemm", ["f", "wf", "bf"], ["y"], transB=1, name="fc")]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(models.SHAPE))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_qdq_chain_shares_kernels_and_keeps_every_byte(tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    model = models.quantize_qdq(_chain_onnx(tmp_path / "chain.onnx"), tmp_path / "chain_qdq.onnx")
    x = models.input_npy(tmp_path / "x.npy")
    stats = _compare(model, x, tmp_path, monkeypatch)
    assert stats.lifted > 0  # the twins' scales and clip bounds differ: they became parameters
    # the shared kernels compute what ONNX Runtime computes, layer by layer
    verify(tmp_path / "on", modes=("single", "entire", "source"), check=True)


def test_a_plan_from_the_cache_runs_the_shared_functions(tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    model = models.quantize_qdq(_chain_onnx(tmp_path / "chain.onnx"), tmp_path / "chain_qdq.onnx")
    x = models.input_npy(tmp_path / "x.npy")
    monkeypatch.setenv("IRGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("IRGEN_CACHE_SIZE", "1G")  # the suite turns the cache off
    cold, stats, _ = _run(model, x, tmp_path / "cold", monkeypatch, on=True, args=())
    assert stats.removed > 0
    warm, _, n_warm = _run(model, x, tmp_path / "warm", monkeypatch, on=True, args=())
    assert n_warm == 0  # nothing compiled: the plan came from the cache
    assert cold == warm
    import json

    (entry,) = [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]
    kernels = json.loads((entry / "plan.json").read_text())["kernels"]
    shared = [k for k in kernels if k["symbol"] != k["callee"]]
    assert shared and all(k["callee"].startswith("layer_") for k in shared)
    # the debug graph names a call after its own layer and runs the shared function
    dump = json.loads((tmp_path / "warm" / "debug" / "_tvmdbg_graph_dump.json").read_text())
    calls = {node["name"]: node["attrs"]["func_name"] for node in dump["nodes"] if node["op"] == "tvm_op"}
    assert any(not name.startswith(func) for name, func in calls.items())


def test_tflite_int8_chain_shares_kernels_and_keeps_every_byte(tmp_path, monkeypatch):
    pytest.importorskip("tensorflow")
    import tflite_models
    from layercheck import assert_layers_equal

    model, x = tflite_models.export("conv_chain", tmp_path, "int8")
    np.save(tmp_path / "x.npy", x)
    stats = _compare(model, tmp_path / "x.npy", tmp_path, monkeypatch)
    assert stats.lifted > 0
    import json

    ir = json.loads((tmp_path / "on" / "ir.json").read_text())
    assert assert_layers_equal(tmp_path / "on", ir, tflite_models.tflite_reference(model, x), "shared") >= 8


def test_float_chain_keeps_every_byte(tmp_path, monkeypatch):
    """Float twins that differ in a clip bound (Clip 0..6 and 0..4 after convolutions of one
    shape) share one function: the same bytes, ONNX Runtime's values."""
    ort = pytest.importorskip("onnxruntime")
    import onnx
    from onnx import numpy_helper

    path = _chain_onnx(tmp_path / "chain.onnx")
    m = onnx.load(str(path))
    for node in m.graph.node:  # relu -> clip 0..4: a float constant that differs between twins
        if node.op_type == "Relu":
            node.op_type, node.input[:] = "Clip", [node.input[0], "lo", "hi4"]
    m.graph.initializer.append(numpy_helper.from_array(np.array(4.0, np.float32), "hi4"))
    onnx.save(m, str(path))
    x = models.input_npy(tmp_path / "x.npy")
    stats = _compare(path, x, tmp_path, monkeypatch)
    assert stats.lifted > 0
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": np.load(x)})[0]
    ir = run_model(path, tmp_path / "again", inputs=[x], force=True, args=["--no-cache"])
    y = next(o for o in ir["outputs"] if o["name"] == "y")
    np.testing.assert_allclose(np.load(tmp_path / "again" / y["file"]), ref, rtol=1e-4, atol=1e-5)


def test_indices_and_conditions_keep_their_immediates():
    """Only constants in stored values become parameters: not an index, not a condition, and
    not the arguments of a call that is not plain math."""
    import tvm
    from tvm import te

    a = te.placeholder((6,), "float32", name="A")
    c = te.compute((5,), lambda i: tvm.tirx.if_then_else(i > 2, a[i + 1] * tvm.tirx.const(2.5, "float32"),
                                                         tvm.tirx.const(-1.0, "float32")), name="C")
    func = te.create_prim_func([a, c])
    lifter = share._Lifter(None)
    out = lifter.run(func, 1)
    assert lifter.values == [("float32", 2.5), ("float32", -1.0)]
    text = out.script()
    assert "k0: T.Buffer((), \"float32\"), k1: T.Buffer((), \"float32\"), C: T.Buffer((5,)" in text
    assert "2 < v_i" in text and "A[v_i + 1]" in text  # the condition and the index as they were
    assert "T.float32(2.5)" not in text and "T.reads(A[v_i + 1], k0[()], k1[()])" in text
    only = share._Lifter({1}).run(func, 1).script()  # a chosen position only
    assert "T.float32(2.5)" in only and "T.float32(-1.0)" not in only

