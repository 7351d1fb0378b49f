"""Hostile ONNX models: every bad file is one ``IrgenError`` (CLI: exit 2, one line), never a
traceback, a hang, an allocation bomb or a read outside the model's folder.

Most cases call the frontend in this process (``irgen_onnx.prepare`` runs every check
before TVM's importer; ``load_onnx`` imports too); a few go through the ``irgen`` command
to show the user-visible result. Every hostile file is made by code here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hostile import Sentinel, assert_refused, irgen  # noqa: E402

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, external_data_helper, helper, numpy_helper  # noqa: E402

from irgen.api import IrgenError  # noqa: E402
from irgen.cli import main as irgen_main  # noqa: E402
from irgen_onnx import load_onnx, prepare  # noqa: E402

SAFE = re.compile(r"[A-Za-z0-9_.-]+")
OPSET = [helper.make_opsetid("", 13)]
MiB = 1 << 20


@pytest.fixture(autouse=True)
def no_hang():
    """Every case here finishes in seconds; a hang fails the test instead of the session."""
    def alarm(*_):
        raise TimeoutError("hung")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(240)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def save(model, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path


def conv_model(hw: int = 8, x_shape=None) -> onnx.ModelProto:
    """x[1,3,hw,hw] -> Conv(3->4, 3x3, pad 1) with w, b -> Relu -> y."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c"], ["y"], name="relu"),
        ],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape or [1, 3, hw, hw])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[w, b],
    )
    return helper.make_model(graph, opset_imports=OPSET)


def graph_model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes, "g",
        [vi(n, t, s) for n, t, s in inputs],
        [vi(n, t, s) for n, t, s in outputs],
        initializer=[numpy_helper.from_array(np.asarray(v), n) for n, v in inits],
    )
    return helper.make_model(graph, opset_imports=OPSET)


def refused(path: Path, *names: str, **options) -> str:
    """``prepare`` refuses ``path`` with one line naming each of ``names``."""
    with pytest.raises(IrgenError) as info:
        prepare(path, options)
    msg = str(info.value)
    assert msg.isprintable(), msg  # one line, control characters from the model escaped
    for name in names:
        assert name in msg, (name, msg)
    return msg


# ------------------------------------------------------------------ 1. external data


W_BYTES = 4 * 3 * 3 * 3 * 4


def external(folder: Path, location: str, *, offset=None, length=None, data: bytes | None = None,
             name: str = "model.onnx") -> Path:
    """conv_model with initializer 'w' stored as external data at ``location``
    (``data`` written to ``folder/location`` when given)."""
    m = conv_model()
    w = next(t for t in m.graph.initializer if t.name == "w")
    raw = w.raw_data
    folder.mkdir(parents=True, exist_ok=True)
    if data is not None:
        (folder / location).write_bytes(data if data != b"W" else raw)
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        if value is not None:
            entry = w.external_data.add()
            entry.key, entry.value = key, str(value)
    return save(m, folder / name)


def test_external_data_inside_the_folder_loads(tmp_path):
    ref = conv_model()
    path = external(tmp_path / "m", "w.bin", data=b"W")
    model, specs = prepare(path, {})
    got = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w"))
    np.testing.assert_array_equal(got, numpy_helper.to_array(ref.graph.initializer[0]))
    assert specs[0].name == "x" and specs[0].shape == (1, 3, 8, 8)
    # with an offset and an explicit length inside a bigger file
    path = external(tmp_path / "m2", "blob.bin", offset=16, length=W_BYTES,
                    data=b"\0" * 16 + ref.graph.initializer[0].raw_data + b"tail")
    got = numpy_helper.to_array(next(t for t in prepare(path, {})[0].graph.initializer if t.name == "w"))
    np.testing.assert_array_equal(got, numpy_helper.to_array(ref.graph.initializer[0]))


def test_external_data_paths_outside_are_refused_untouched(tmp_path):
    with Sentinel(tmp_path / "outside") as s:
        secret = s.secret
        models = tmp_path / "models"
        cases = [
            ("../outside/secret.txt", "outside the model's folder"),
            (str(secret), "outside the model's folder"),
            ("w\x00.bin", "not a plain relative path"),
            ("sub/../../outside/secret.txt", "outside the model's folder"),
            ("..\\outside\\secret.txt", "not a plain relative path"),
        ]
        for k, (loc, words) in enumerate(cases):
            path = external(models, loc, name=f"m{k}.onnx")
            refused(path, f"m{k}.onnx", "'w'", words)
        # a symlink in the model's folder that points outside
        (models / "link.bin").symlink_to(secret)
        refused(external(models, "link.bin", name="link.onnx"), "'w'", "link.bin", "outside the model's folder")
        # a symlinked folder
        (models / "linkdir").symlink_to(s.folder)
        refused(external(models, "linkdir/secret.txt", name="linkdir.onnx"), "'w'", "outside the model's folder")
        s.assert_untouched()


def test_external_data_not_a_regular_file(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    os.mkfifo(models / "fifo.bin")
    refused(external(models, "fifo.bin", name="fifo.onnx"), "'w'", "FIFO")
    (models / "zero.bin").symlink_to("/dev/zero")
    refused(external(models, "zero.bin", name="zero.onnx"), "'w'", "zero.bin")
    (models / "dir.bin").mkdir()
    refused(external(models, "dir.bin", name="dir.onnx"), "'w'", "folder")
    refused(external(models, "missing.bin", name="missing.onnx"), "'w'", "missing.bin", "no such file")


def test_external_data_offsets_and_lengths(tmp_path):
    m = tmp_path / "m"
    refused(external(m, "short.bin", data=b"x" * 100, name="a.onnx"), "'w'", "short.bin", "past the end", "100 bytes")
    refused(external(m, "w1.bin", data=b"W", offset=8, name="b.onnx"), "'w'", "offset 8", "past the end")
    refused(external(m, "w2.bin", data=b"W", length=W_BYTES - 4, name="c.onnx"), "'w'", f"length {W_BYTES - 4}",
            "does not match")
    refused(external(m, "w3.bin", data=b"W", length=W_BYTES + 4, name="d.onnx"), "'w'", "does not match")
    refused(external(m, "w4.bin", data=b"W", offset="-4", name="e.onnx"), "'w'", "offset '-4'", "integer")
    refused(external(m, "w5.bin", data=b"W", offset="abc", name="f.onnx"), "'w'", "offset 'abc'")
    refused(external(m, "w6.bin", data=b"W", offset="1" * 40, name="g.onnx"), "'w'", "offset")


def test_external_data_of_a_huge_tensor_is_refused_before_reading(tmp_path):
    m = conv_model()
    w = m.graph.initializer[0]
    del w.dims[:]
    w.dims.extend([1 << 20, 1 << 20, 3, 3])
    external_data_helper.set_external_data(w, location="w.bin")
    w.data_location = TensorProto.EXTERNAL
    w.ClearField("raw_data")
    (tmp_path / "w.bin").write_bytes(b"\0" * 64)
    path = save(m, tmp_path / "huge.onnx")
    refused(path, "'w'", "TiB", "--max-tensor-bytes")


def test_external_data_past_the_end_via_cli(tmp_path):
    """Was a traceback from onnx's loader ("external data longer than its file")."""
    path = external(tmp_path / "m", "w.bin", data=b"x" * 100)
    out = tmp_path / "out"
    assert_refused(irgen("run", path, "-o", out, "--no-progress"), out, "model.onnx", "'w'", "w.bin", "past the end")


# ------------------------------------------------------------------ 2. size bombs


def test_input_with_a_huge_declared_shape(tmp_path):
    path = save(conv_model(x_shape=[100000, 3, 1000, 1000]), tmp_path / "big_input.onnx")
    refused(path, "input 'x'", "over the limit", "(100000, 3, 1000, 1000)")


def test_input_shape_option_sizes_are_checked(tmp_path):
    path = save(conv_model(x_shape=["N", 3, 8, 8]), tmp_path / "open.onnx")
    refused(path, "input 'x'", "over the limit", input_shapes={"x": (1000000, 3, 8, 8)}, max_tensor_bytes=64 * MiB)
    assert prepare(path, {"input_shapes": {"x": (2, 3, 8, 8)}})[1][0].shape == (2, 3, 8, 8)


def _bomb(op: str) -> onnx.ModelProto:
    big = [1 << 16, 1 << 16, 16]  # 256 GiB of float32
    x = [("x", TensorProto.FLOAT, [1, 4])]
    y = [("y", TensorProto.FLOAT, None)]
    if op == "ConstantOfShape":
        return graph_model([helper.make_node("ConstantOfShape", ["s"], ["big"], name="cos"),
                            helper.make_node("ReduceSum", ["big", "ax"], ["r"], name="sum", keepdims=0),
                            helper.make_node("Add", ["x", "r"], ["y"], name="add")], x, y,
                           [("s", np.array(big, np.int64)), ("ax", np.array([0, 1, 2], np.int64))])
    if op == "ConstantOfShape-node":  # the shape from a Constant node
        return graph_model([helper.make_node("Constant", [], ["s"], value=numpy_helper.from_array(np.array(big, np.int64))),
                            helper.make_node("ConstantOfShape", ["s"], ["big"], name="cos"),
                            helper.make_node("ReduceMax", ["big"], ["r"], name="max", keepdims=0),
                            helper.make_node("Add", ["x", "r"], ["y"], name="add")], x, y)
    if op == "Expand":
        return graph_model([helper.make_node("Expand", ["x", "s"], ["big"], name="expand"),
                            helper.make_node("ReduceMax", ["big"], ["y"], name="max", keepdims=0)], x, y,
                           [("s", np.array([1 << 20, 1 << 14, 4], np.int64))])
    if op == "Tile":
        return graph_model([helper.make_node("Tile", ["x", "r"], ["big"], name="tile"),
                            helper.make_node("ReduceMax", ["big"], ["y"], name="max", keepdims=0)], x, y,
                           [("r", np.array([1 << 20, 1 << 16], np.int64))])
    if op == "Range":
        return graph_model([helper.make_node("Range", ["a", "b", "d"], ["big"], name="range"),
                            helper.make_node("ReduceMax", ["big"], ["r"], name="max", keepdims=0),
                            helper.make_node("Add", ["x", "r"], ["y"], name="add")], x, y,
                           [("a", np.array(0, np.int64)), ("b", np.array(1 << 40, np.int64)),
                            ("d", np.array(1, np.int64))])
    if op == "Range-zero":
        return graph_model([helper.make_node("Range", ["a", "b", "d"], ["big"], name="range"),
                            helper.make_node("ReduceMax", ["big"], ["r"], name="max", keepdims=0),
                            helper.make_node("Add", ["x", "r"], ["y"], name="add")], x, y,
                           [("a", np.array(0, np.int64)), ("b", np.array(10, np.int64)),
                            ("d", np.array(0, np.int64))])
    if op == "Resize":
        return graph_model([helper.make_node("Resize", ["x4", "", "sc"], ["big"], name="resize"),
                            helper.make_node("ReduceMax", ["big"], ["y"], name="max", keepdims=0)],
                           [("x4", TensorProto.FLOAT, [1, 1, 4, 4])], y,
                           [("sc", np.array([1, 1, 1 << 16, 1 << 16], np.float32))])
    raise AssertionError(op)


@pytest.mark.parametrize("op,words", [
    ("ConstantOfShape", ["'big'", "cos", "256.0 GiB"]),
    ("ConstantOfShape-node", ["'big'", "cos", "256.0 GiB"]),
    ("Expand", ["'big'", "expand", "over the limit"]),
    ("Tile", ["'big'", "tile", "over the limit"]),
    ("Range", ["'big'", "range", "over the limit"]),
    ("Range-zero", ["'big'", "range", "delta is 0"]),
    ("Resize", ["'big'", "resize", "over the limit"]),
])
def test_size_bombs_refused_before_import(tmp_path, op, words):
    path = save(_bomb(op), tmp_path / f"{op}.onnx")
    refused(path, *words)


def test_size_bombs_without_shape_inference(tmp_path, monkeypatch):
    """The direct checks alone catch ConstantOfShape/Expand/Tile/Range fed by constants."""
    from irgen_onnx import checks

    monkeypatch.setattr(checks, "infer", lambda skel, specs: None)
    for op in ("ConstantOfShape", "ConstantOfShape-node", "Expand", "Range", "Range-zero"):
        refused(save(_bomb(op), tmp_path / f"{op}.onnx"), "'big'")


def test_huge_initializer(tmp_path):
    m = conv_model()
    w = m.graph.initializer[0]
    del w.dims[:]
    w.dims.extend([1 << 30, 1 << 10])  # 4 TiB claimed, 432 bytes stored
    refused(save(m, tmp_path / "claims.onnx"), "initializer 'w'", "over the limit")
    # a real initializer over a lowered limit
    refused(save(conv_model(), tmp_path / "real.onnx"), "initializer 'w'", "over the limit", max_tensor_bytes=256)
    # data that does not match the shape
    m = conv_model()
    m.graph.initializer[0].raw_data = b"1234"
    refused(save(m, tmp_path / "short.onnx"), "initializer 'w'", "4 bytes", f"needs {W_BYTES}")
    m = conv_model()
    b = m.graph.initializer[1]
    b.ClearField("raw_data")
    b.float_data.extend([1.0, 2.0])
    refused(save(m, tmp_path / "typed.onnx"), "initializer 'b'", "2 values", "needs 4")


def test_size_bomb_via_cli(tmp_path):
    """Refused before TVM's importer, which would fold the ConstantOfShape into 256 GiB."""
    path = save(_bomb("ConstantOfShape"), tmp_path / "bomb.onnx")
    out = tmp_path / "out"
    assert_refused(irgen("run", path, "-o", out, "--no-progress", timeout=120), out, "'big'", "256.0 GiB",
                   "--max-tensor-bytes")


# ------------------------------------------------------------------ 3. If


def _if_model(cond) -> onnx.ModelProto:
    vi = helper.make_tensor_value_info
    # the branches use names that collide with the outer graph ("t" is outer too)
    then_g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["t"], name="then_relu"),
         helper.make_node("Mul", ["t", "k"], ["u"], name="then_mul")],
        "then", [], [vi("u", TensorProto.FLOAT, [1, 4])],
        initializer=[numpy_helper.from_array(np.full((1, 4), 3.0, np.float32), "k")])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["e"], name="else_neg")], "else", [],
                               [vi("e", TensorProto.FLOAT, [1, 4])])
    nodes = [helper.make_node("Sigmoid", ["x0"], ["x"], name="pre")]
    inits = []
    if cond == "dynamic":
        nodes += [helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
                  helper.make_node("Greater", ["s", "z"], ["c"], name="gt")]
        inits = [numpy_helper.from_array(np.array(0, np.float32), "z")]
    elif cond == "constant-node":
        nodes.append(helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(False))))
    else:
        inits = [numpy_helper.from_array(np.array([cond]), "c")]
    nodes += [helper.make_node("If", ["c"], ["y0"], name="if", then_branch=then_g, else_branch=else_g),
              helper.make_node("Add", ["y0", "x"], ["t"], name="post"),
              helper.make_node("Relu", ["t"], ["y"], name="last")]
    graph = helper.make_graph(nodes, "g", [vi("x0", TensorProto.FLOAT, [1, 4])], [vi("y", TensorProto.FLOAT, [1, 4])],
                              initializer=inits)
    m = helper.make_model(graph, opset_imports=OPSET)
    onnx.checker.check_model(m, full_check=True)
    return m


@pytest.mark.parametrize("cond", [True, "constant-node"])
def test_if_with_a_constant_condition_matches_onnxruntime(tmp_path, cond):
    ort = pytest.importorskip("onnxruntime")
    path = save(_if_model(cond), tmp_path / "if.onnx")
    x = np.linspace(-2, 2, 4, dtype=np.float32).reshape(1, 4)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    assert irgen_main(["run", str(path), "-o", str(out), "--input", str(tmp_path / "x.npy"), "--no-progress"]) == 0
    ir = json.loads((out / "ir.json").read_text())
    got = np.load(out / ir["outputs"][0]["file"])
    sess = ort.InferenceSession(path.read_bytes(), providers=["CPUExecutionProvider"])
    want = sess.run(["y"], {"x0": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not any(n.op_type == "If" for n in prepare(path, {})[0].graph.node)


def test_if_with_a_condition_computed_at_run_time_is_refused(tmp_path):
    path = save(_if_model("dynamic"), tmp_path / "if.onnx")
    refused(path, "'if'", "'c'", "computed at run time")


# ------------------------------------------------------------------ 4. SSA


def _gather_model(idx=None) -> onnx.ModelProto:
    """x[4,3] + d -> Gather(axis 0) by the constant indices ``idx``, or by input i[3] (None)."""
    inputs = [("x", TensorProto.FLOAT, [4, 3])]
    inits = [("d", np.arange(12, dtype=np.float32).reshape(4, 3))]
    if idx is None:
        inputs.append(("i", TensorProto.INT64, [3]))
    else:
        inits.append(("i", np.asarray(idx, np.int64)))
    nodes = [helper.make_node("Add", ["x", "d"], ["a"]), helper.make_node("Gather", ["a", "i"], ["y"], axis=0, name="pick")]
    return graph_model(nodes, inputs, [("y", TensorProto.FLOAT, [3, 3])], inits)


@pytest.mark.parametrize("idx, bad", [([0, 7, 1], 7), ([1, 2, 99], 99)])
def test_gather_of_constant_indices_out_of_range_is_refused(tmp_path, idx, bad):
    """TVM's gathers read an index out of range out of bounds (another buffer's bytes in the
    golden data); a constant one is refused, as onnxruntime refuses it."""
    path = save(_gather_model(idx), tmp_path / "g.onnx")
    np.save(tmp_path / "x.npy", np.zeros((4, 3), np.float32))
    out = tmp_path / "out"
    assert_refused(irgen("run", path, "-o", out, "--input", tmp_path / "x.npy", "--no-progress"), out,
                   "'pick' (Gather)", f"index {bad} is out of range for an axis of size 4")


def test_gather_of_computed_indices_stays_inside_the_tensor(tmp_path):
    """Indices given at run time: in range (negative ones too) the values equal onnxruntime's;
    out of range, where the run read other memory or crashed (exit -11), they are wrapped."""
    ort = pytest.importorskip("onnxruntime")
    path = save(_gather_model(), tmp_path / "g.onnx")
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    np.save(tmp_path / "x.npy", x)
    table = x + np.arange(12, dtype=np.float32).reshape(4, 3)
    sess = ort.InferenceSession(path.read_bytes(), providers=["CPUExecutionProvider"])
    for k, idx in enumerate([[0, -1, 2], [3, -4, 1], [100000, -7, 2]]):
        i = np.asarray(idx, np.int64)
        np.save(tmp_path / f"i{k}.npy", i)
        out = tmp_path / f"out{k}"
        proc = irgen("run", path, "-o", out, "--input", f"x={tmp_path / 'x.npy'}", "--input", f"i={tmp_path / f'i{k}.npy'}",
                     "--no-progress")
        assert proc.returncode == 0, proc.stderr
        ir = json.loads((out / "ir.json").read_text())
        got = np.load(out / ir["outputs"][0]["file"])
        np.testing.assert_array_equal(got, np.take(table, i, axis=0, mode="wrap"))
        if k < 2:
            np.testing.assert_array_equal(got, sess.run(["y"], {"x": x, "i": i})[0])


def test_two_nodes_writing_one_tensor(tmp_path):
    m = conv_model()
    m.graph.node.append(helper.make_node("Sigmoid", ["c"], ["y"], name="second"))
    refused(save(m, tmp_path / "twice.onnx"), "'y'", "'relu'", "'second'", "two nodes")


@pytest.mark.parametrize("target,what", [("x", "a graph input"), ("w", "an initializer")])
def test_node_output_shadowing_an_input_or_initializer(tmp_path, target, what):
    m = conv_model()
    m.graph.node.append(helper.make_node("Sigmoid", ["y"], [target], name="shadow"))
    refused(save(m, tmp_path / "shadow.onnx"), f"'{target}'", "'shadow'", what)


def test_subgraph_shadowing_an_outer_name(tmp_path):
    m = _if_model(True)
    then_g = next(a.g for a in m.graph.node[1].attribute if a.name == "then_branch")
    then_g.node[1].output[0] = "x"  # the branch writes the outer 'x'
    then_g.output[0].name = "x"
    refused(save(m, tmp_path / "sub.onnx"), "'x'", "then_mul", "enclosing graph")


# ------------------------------------------------------------------ 5. --input-shape


@pytest.mark.parametrize("shapes,words", [
    ({"y": (1, 3, 8, 8)}, ["--input-shape y=1,3,8,8", "no input 'y'", "inputs: x [1, 3, 8, 8]"]),
    ({"x": (2, 3, 8, 8)}, ["--input-shape x=2,3,8,8", "input 'x' has the fixed shape [1, 3, 8, 8]"]),
    ({"x": (1, 3, 8)}, ["--input-shape x=1,3,8", "rank 4"]),
    ({"x": (0, 3, 8, 8)}, ["--input-shape x=0,3,8,8", "input 'x' has the fixed shape [1, 3, 8, 8]"]),
    ({"x": (-1, 3, 8, 8)}, ["--input-shape x=-1,3,8,8", "non-negative"]),
])
def test_input_shape_option_is_checked(tmp_path, shapes, words):
    path = save(conv_model(), tmp_path / "fixed.onnx")
    refused(path, *words, input_shapes=shapes)


def test_input_shape_option_sets_only_open_dims(tmp_path):
    path = save(conv_model(x_shape=["N", 3, 0, 0]), tmp_path / "open.onnx")
    refused(path, "input 'x'", "open dimension")
    assert prepare(path, {"input_shapes": {"x": (2, 3, 5, 6)}})[1][0].shape == (2, 3, 5, 6)
    refused(path, "[N, 3, ?, ?]", "dimension 1 is fixed at 3", input_shapes={"x": (2, 4, 5, 6)})
    refused(path, "no input 'w'", "inputs: x [N, 3, ?, ?]", input_shapes={"w": (4, 3, 3, 3)})


def test_input_shape_unknown_name_via_cli(tmp_path):
    path = save(conv_model(), tmp_path / "fixed.onnx")
    out = tmp_path / "out"
    assert_refused(irgen("run", path, "-o", out, "--input-shape", "y=1,3,8,8", "--no-progress"), out,
                   "--input-shape y=1,3,8,8: the model has no input 'y' (inputs: x [1, 3, 8, 8])")


# ------------------------------------------------------------------ 6. corrupt files and absurd fields


def _either(path: Path, options=None) -> str:
    """load_onnx on ``path``: "ok" or "refused" (a one-line IrgenError); anything else fails."""
    try:
        load_onnx(path, options or {})
    except IrgenError as err:
        assert str(err).isprintable() and str(err), repr(err)
        return "refused"
    return "ok"


def test_truncated_and_bit_flipped_files(tmp_path):
    data = conv_model().SerializeToString()
    n = len(data)
    offsets = [1, 7, n // 5, n // 3, n // 2, n - 20, n - 1]
    results = {}
    for k in offsets:  # truncated
        path = tmp_path / f"cut{k}.onnx"
        path.write_bytes(data[:k])
        results[path.name] = _either(path)
    (tmp_path / "empty.onnx").write_bytes(b"")
    (tmp_path / "one.onnx").write_bytes(b"\x08")
    for name in ("empty.onnx", "one.onnx"):
        results[name] = _either(tmp_path / name)
    rng = np.random.default_rng(7)
    for k in [0, 2, 5, 20, n // 4, n // 2, n - 30, n - 3]:  # bit flips
        for bit in (0, 7):
            flipped = bytearray(data)
            flipped[k] ^= 1 << bit
            path = tmp_path / f"flip{k}_{bit}.onnx"
            path.write_bytes(bytes(flipped))
            results[path.name] = _either(path)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    results[junk.name] = _either(junk)
    assert results["empty.onnx"] == results["one.onnx"] == results["junk.onnx"] == "refused"
    assert results[f"cut{n // 2}.onnx"] == "refused"
    assert "refused" in results.values()


def test_bit_flipped_files_via_cli(tmp_path):
    data = conv_model().SerializeToString()
    for k in (3, len(data) // 2):
        bad = bytearray(data)
        bad[k] ^= 0xFF
        path = tmp_path / f"flip{k}.onnx"
        path.write_bytes(bytes(bad))
        out = tmp_path / f"out{k}"
        proc = irgen("run", path, "-o", out, "--no-progress", timeout=120)
        assert "Traceback" not in proc.stderr, proc.stderr
        if proc.returncode != 0:
            assert_refused(proc, out, path.name)


@pytest.mark.parametrize("how,words", [
    ("arity", ["Relu", "input size 2"]),
    ("missing-attr", ["Cast", "to"]),
    ("unknown-attr", ["bogus"]),
    ("dangling", ["'nowhere'"]),
    ("input-dtype", ["input 'x'", "element type"]),
    ("init-dtype", ["initializer 'b'", "element type"]),
    ("cast-dtype", ["'cast' (Cast)", "attribute 'to'", "unknown element type (99)"]),
    ("sparse", ["sparse"]),
    ("no-nodes", ["no nodes"]),
    ("unsupported", ["unsupported ops", "NoSuchOp"]),
    ("op-type-control", ["unsupported ops", "No\\nSuch\\x1bOp"]),
    ("ssa-op-type-control", ["'y'", "(R\\n\\x04lu)", "'relu2'"]),
])
def test_malformed_graphs(tmp_path, how, words):
    m = conv_model()
    g = m.graph
    if how == "arity":
        g.node[1].input.append("x")
    elif how == "missing-attr":
        g.node.append(helper.make_node("Cast", ["y"], ["z"], name="cast"))
        g.output[0].name = "z"
    elif how == "unknown-attr":
        g.node[0].attribute.append(helper.make_attribute("bogus", 3))
    elif how == "dangling":
        g.node[1].input[0] = "nowhere"
    elif how == "input-dtype":
        g.input[0].type.tensor_type.elem_type = 99
    elif how == "init-dtype":
        g.initializer[1].data_type = 99
    elif how == "cast-dtype":
        g.node.append(helper.make_node("Cast", ["y"], ["z"], name="cast", to=99))
        g.output[0].name = "z"
    elif how == "sparse":
        values = numpy_helper.from_array(np.array([1.0], np.float32), "s")
        indices = numpy_helper.from_array(np.array([0], np.int64), "s_i")
        g.sparse_initializer.append(helper.make_sparse_tensor(values, indices, [4]))
    elif how == "no-nodes":
        del g.node[:]
    elif how == "unsupported":
        g.node.append(helper.make_node("NoSuchOp", ["y"], ["z"], name="nope"))
    elif how == "op-type-control":  # a message quoting the model stays one line, control characters escaped
        g.node.append(helper.make_node("No\nSuch\x1bOp", ["y"], ["z"], name="nope"))
    elif how == "ssa-op-type-control":
        g.node.append(helper.make_node("R\n\x04lu", ["c"], ["y"], name="relu2"))
    path = save(m, tmp_path / f"{how}.onnx")
    with pytest.raises(IrgenError) as info:
        load_onnx(path, {})
    msg = str(info.value)
    assert msg.isprintable() and path.name in msg, msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("where", ["node-name", "tensor-name", "graph-name", "attribute"])
def test_names_that_are_not_utf8(tmp_path, where):
    """protobuf parses such strings unchecked (upb hands back bytes); refused, not a UnicodeDecodeError."""
    m = conv_model()
    if where == "node-name":
        m.graph.node[1].name = "QQQQ"
    elif where == "tensor-name":
        m.graph.node[0].output[0] = m.graph.node[1].input[0] = "QQQQ"
    elif where == "graph-name":
        m.graph.name = "QQQQ"
    else:
        m.graph.node[0].attribute.append(helper.make_attribute("auto_pad", "QQQQ"))
    data = m.SerializeToString()
    assert data.count(b"QQQQ") >= 1
    path = tmp_path / f"{where}.onnx"
    path.write_bytes(data.replace(b"QQQQ", b"Q\x8bQ\xff"))
    if where == "attribute":  # an attribute's s is bytes: no UTF-8 promise, the checker judges the value
        assert _either(path) == "refused"
    else:
        refused(path, f"{where}.onnx", "not UTF-8")


def _names_model() -> onnx.ModelProto:
    long = "n" * 10000
    n = {"in": "../x", "w": "con", "b": "a/b", "c": "X", "d": "x", "e": "a_b", "f": "bad\x00\x01\n\tname",
         "g": "AUX", "w2": "nul.txt", "y": long}
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n[k])
             for k, s in (("w", (4, 4)), ("b", (4,)), ("w2", (4, 4)))]
    nodes = [
        helper.make_node("MatMul", [n["in"], n["w"]], [n["c"]], name=long),
        helper.make_node("Add", [n["c"], n["b"]], [n["d"]], name="x\x00y"),
        helper.make_node("Relu", [n["d"]], [n["e"]], name="con"),
        helper.make_node("MatMul", [n["e"], n["w2"]], [n["f"]], name="../../etc/passwd"),
        helper.make_node("Sigmoid", [n["f"]], [n["g"]], name="CON"),
        helper.make_node("Add", [n["g"], n["c"]], [n["y"]], name="a/b"),
    ]
    vi = helper.make_tensor_value_info
    g = helper.make_graph(nodes, "g\x00" + long, [vi(n["in"], TensorProto.FLOAT, [1, 4])],
                          [vi(n["y"], TensorProto.FLOAT, [1, 4])], initializer=inits)
    return helper.make_model(g, opset_imports=OPSET)


def test_absurd_names_stay_inside_out(tmp_path):
    """10k-character names, NUL and control characters, ../x, con/CON/AUX, X vs x, a/b vs a_b."""
    with Sentinel(tmp_path / "outside") as s:
        path = save(_names_model(), tmp_path / "m" / "names.onnx")
        out = tmp_path / "o" / "out"
        out.parent.mkdir()
        assert irgen_main(["run", str(path), "-o", str(out), "--no-progress"]) == 0
        s.assert_untouched()
    seen = set()
    files = [p for p in out.rglob("*")]
    assert any(p.suffix == ".npy" for p in files)
    for p in files:
        rel = p.relative_to(out)
        assert not p.is_symlink(), rel
        assert os.path.realpath(p).startswith(os.path.realpath(out) + os.sep), rel
        for part in rel.parts:
            assert SAFE.fullmatch(part) and part not in (".", ".."), rel
            assert part.split(".")[0].lower() not in {"con", "aux", "nul", "prn"}, rel
        assert str(rel).lower() not in seen, rel
        seen.add(str(rel).lower())
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]


def test_importer_error_via_cli_is_one_line(tmp_path):
    """An error inside TVM's importer (a shape mismatch no earlier check sees): one line, and
    no "BlockBuilder destroyed with remaining blocks!" logged when the process ends."""
    path = save(conv_model(x_shape=[1, 5, 8, 8]), tmp_path / "channels.onnx")
    out = tmp_path / "out"
    line = assert_refused(irgen("run", path, "-o", out, "--no-progress", timeout=120), out, "channels.onnx",
                          "'conv' (Conv)")
    assert "channel" in line


# ------------------------------------------------------------------ 7. the model path itself


def test_model_path_not_a_regular_file(tmp_path):
    fifo = tmp_path / "fifo.onnx"
    os.mkfifo(fifo)
    refused(fifo, "fifo.onnx", "FIFO")
    zero = tmp_path / "zero.onnx"
    zero.symlink_to("/dev/zero")
    refused(zero, "zero.onnx", "character device")
    refused(Path("/dev/zero"), "/dev/zero", "character device")
    (tmp_path / "dir.onnx").mkdir()
    refused(tmp_path / "dir.onnx", "dir.onnx", "folder")


def test_model_fifo_via_cli(tmp_path):
    fifo = tmp_path / "fifo.onnx"
    os.mkfifo(fifo)
    out = tmp_path / "out"
    assert_refused(irgen("run", fifo, "-o", out, "--no-progress", timeout=120), out, "fifo.onnx", "FIFO")
