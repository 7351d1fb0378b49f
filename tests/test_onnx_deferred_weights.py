"""Large ONNX weights are read when TVM's import converts them, not held twice.

``prepare`` (the path ``irgen run`` takes) leaves the raw data of every top-level
initializer over ``DEFER_BYTES`` in its file (the model file itself, or its external data
file) and reads it when it is converted: the parsed model never holds the weights. These
tests check that what is read is what a plain ``onnx.load`` gives, byte for byte, that a
model cannot point irgen's own bookkeeping at another file, and that a run of such a model
agrees with onnxruntime.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from irgen.api import IrgenError  # noqa: E402
from irgen.cli import main as irgen_main  # noqa: E402
from irgen_onnx import loader, prepare, wire  # noqa: E402

OPSET = [helper.make_opsetid("", 13)]
BIG = loader.DEFER_BYTES


def _conv_chain(n: int = 3, channels: int = 64) -> onnx.ModelProto:
    """x[1,C,8,8] -> n x (Conv CxCx3x3 + bias, Relu): each weight 147 KiB, over DEFER_BYTES."""
    rng = np.random.default_rng(7)
    nodes, inits, x = [], [], "x"
    for k in range(n):
        w = (rng.standard_normal((channels, channels, 3, 3)) * 0.05).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{k}"),
                  numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), f"b{k}")]
        nodes += [helper.make_node("Conv", [x, f"w{k}", f"b{k}"], [f"c{k}"], name=f"conv{k}", pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{k}"], [f"r{k}"], name=f"relu{k}")]
        x = f"r{k}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, 8, 8])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=OPSET)


def _mixed() -> onnx.ModelProto:
    """A graph (never run) whose initializers cover the element types and storage forms."""
    rng = np.random.default_rng(3)
    n = BIG + 1000
    inits = [
        numpy_helper.from_array(rng.standard_normal(n // 4 + 1).astype(np.float32), "f32"),
        numpy_helper.from_array(rng.standard_normal((3, n // 6)).astype(np.float16), "f16"),
        numpy_helper.from_array(rng.integers(-128, 128, n, dtype=np.int8), "i8"),
        numpy_helper.from_array(rng.integers(0, 256, n, dtype=np.uint8), "u8"),
        numpy_helper.from_array(rng.integers(-(2**40), 2**40, n // 8, dtype=np.int64), "i64"),
        numpy_helper.from_array(rng.integers(0, 2, n).astype(bool), "flags"),
        numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "small"),
        numpy_helper.from_array(np.array(2.5, np.float32), "scalar"),
    ]
    bf16 = helper.make_tensor("bf16", TensorProto.BFLOAT16, [n // 2],
                              (rng.integers(0, 1 << 16, n // 2, dtype=np.uint16)).tobytes(), raw=True)
    i4 = helper.make_tensor("i4", TensorProto.INT4, [2 * n], rng.integers(0, 256, n, dtype=np.uint8).tobytes(), raw=True)
    floats = helper.make_tensor("typed", TensorProto.FLOAT, [n // 4], rng.standard_normal(n // 4).tolist())  # float_data
    inits += [bf16, i4, floats]
    big_const = numpy_helper.from_array(rng.standard_normal(n // 4).astype(np.float32), "kept")
    nodes = [helper.make_node("Constant", [], ["k"], name="const", value=big_const),
             helper.make_node("Identity", ["x"], ["y"], name="id")]
    graph = helper.make_graph(nodes, "mixed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _deferred_load(path: Path):
    model = loader.read_model(path, defer=True)
    loader.load_external_data(model, path, None, defer=True)
    return model


def _materialized(model) -> bytes:
    """``model`` serialized with every deferred tensor's data put back as raw data."""
    for t in model.graph.initializer:
        if loader.deferred(t) is not None:
            raw = loader.tensor_array(t)
            if t.data_type in (TensorProto.BFLOAT16, TensorProto.INT4):
                raw = _raw_from_file(t)
            t.raw_data = np.ascontiguousarray(raw).tobytes()
            del t.external_data[:]
            t.ClearField("data_location")
    return model.SerializeToString()


def _raw_from_file(t) -> bytes:
    info = loader.deferred(t)
    return Path(info["irgen_file"]).read_bytes()[int(info["offset"]):][: int(info["length"])]


def test_deferred_read_gives_what_onnx_load_gives(tmp_path):
    path = tmp_path / "mixed.onnx"
    path.write_bytes(_mixed().SerializeToString())
    full = onnx.load(str(path))
    model = _deferred_load(path)
    by_name = {t.name: t for t in model.graph.initializer}
    deferred = {name for name, t in by_name.items() if loader.deferred(t) is not None}
    # every initializer over DEFER_BYTES in raw data, and nothing else, stayed in the file
    assert deferred == {"f32", "f16", "i8", "u8", "i64", "flags", "bf16", "i4"}
    assert not any(by_name[n].HasField("raw_data") for n in deferred)
    assert model.graph.node[0].attribute[0].t.HasField("raw_data")  # a Constant node's tensor is kept
    for t in full.graph.initializer:
        want, got = numpy_helper.to_array(t), loader.tensor_array(by_name[t.name])
        assert got.dtype == want.dtype and got.shape == want.shape, t.name
        assert got.tobytes() == want.tobytes(), t.name  # bit for bit (random bfloat16 bits hold NaNs)
    # the rest of the model is untouched: put the data back and it is the same message
    assert _materialized(model) == full.SerializeToString()


def test_packed_dims_and_the_scan_falls_back_on_what_it_does_not_read(tmp_path):
    # dims written packed (proto2 writes them unpacked; other writers may not)
    data = np.arange(BIG // 4 + 7, dtype=np.float32)
    tensor = (wire._len_field(1, wire._varint_bytes(len(data))) + wire._varint_bytes(2 << 3) + wire._varint_bytes(1)
              + wire._len_field(8, b"packed") + wire._len_field(9, data.tobytes()))
    base = _mixed()
    graph = base.graph.SerializeToString() + wire._len_field(5, tensor)
    base.ClearField("graph")
    path = tmp_path / "packed.onnx"
    path.write_bytes(base.SerializeToString() + wire._len_field(7, graph))
    model = _deferred_load(path)
    t = next(t for t in model.graph.initializer if t.name == "packed")
    assert loader.deferred(t) is not None
    np.testing.assert_array_equal(loader.tensor_array(t), data)
    # a file the scan cannot read (two graph fields, which protobuf merges) is parsed whole
    with open(path, "rb") as f:
        assert wire.stripped_model(f.fileno(), path.stat().st_size, BIG, loader.data_bytes) is not None
    twice = tmp_path / "twice.onnx"
    twice.write_bytes(path.read_bytes() + wire._len_field(7, b""))
    with open(twice, "rb") as f:
        assert wire.stripped_model(f.fileno(), twice.stat().st_size, BIG, loader.data_bytes) is None
    model = _deferred_load(twice)
    assert not any(loader.deferred(t) for t in model.graph.initializer)
    np.testing.assert_array_equal(
        loader.tensor_array(next(t for t in model.graph.initializer if t.name == "packed")), data)


def test_damaged_big_files_give_the_errors_of_a_plain_read(tmp_path):
    good = _conv_chain(1).SerializeToString()
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(good[: len(good) // 2])  # ends inside a weight's raw data
    with pytest.raises(IrgenError, match="not a readable ONNX model"):
        prepare(cut, {})
    # a weight whose raw data does not match its shape stays in the model: the usual message
    m = _conv_chain(1)
    w = m.graph.initializer[0]
    w.raw_data = w.raw_data + b"\0" * 8
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(m.SerializeToString())
    with pytest.raises(IrgenError, match=r"'w0' has 147464 bytes of data; its shape \(64, 64, 3, 3\) \(float\) needs 147456"):
        prepare(bad, {})


def test_a_deferred_tensor_whose_file_shrank_is_refused(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(_conv_chain(1).SerializeToString())
    model, _ = prepare(path, {})
    w = next(t for t in model.graph.initializer if t.name == "w0")
    assert loader.deferred(w) is not None and not w.HasField("raw_data")
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(IrgenError, match="no longer holds"):
        loader.tensor_array(w)


def test_external_data_over_the_threshold_is_deferred_and_checked_again(tmp_path):
    m = _conv_chain(1)
    ref = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    w = next(t for t in m.graph.initializer if t.name == "w0")
    (tmp_path / "w.bin").write_bytes(b"\0" * 8 + w.raw_data)
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "w.bin"), ("offset", "8")):
        e = w.external_data.add()
        e.key, e.value = k, v
    path = tmp_path / "ext.onnx"
    path.write_bytes(m.SerializeToString())
    model, _ = prepare(path, {})
    got = next(t for t in model.graph.initializer if t.name == "w0")
    info = loader.deferred(got)
    assert info is not None and info["irgen_location"] == "w.bin" and not got.HasField("raw_data")
    np.testing.assert_array_equal(loader.tensor_array(got), ref["w0"])
    # the location is resolved inside the model's folder again when the data is read
    (tmp_path / "w.bin").unlink()
    (tmp_path / "w.bin").symlink_to("/etc/hostname")
    with pytest.raises(IrgenError, match="outside the model's folder"):
        loader.tensor_array(got)
    # onnxruntime's path (not deferred) reads it with the model, as before
    (tmp_path / "w.bin").unlink()
    (tmp_path / "w.bin").write_bytes(b"\0" * 8 + numpy_helper.from_array(ref["w0"]).raw_data)
    full, _ = prepare(path, {}, for_tvm=False)
    t = next(t for t in full.graph.initializer if t.name == "w0")
    assert loader.deferred(t) is None and t.HasField("raw_data")


@pytest.mark.parametrize("entries", [
    {"irgen_file": "/etc/passwd", "offset": "0", "length": "16"},
    {"location": "w.bin", "irgen_base": "/", "irgen_location": "etc/passwd"},
    {"location": "w.bin", "irgen_self_0123456789abcdef01234567": "1"},
])
def test_a_model_cannot_use_irgens_own_external_data_entries(tmp_path, entries):
    m = _conv_chain(1)
    w = next(t for t in m.graph.initializer if t.name == "w0")
    (tmp_path / "w.bin").write_bytes(w.raw_data)
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for k, v in entries.items():
        e = w.external_data.add()
        e.key, e.value = k, v
    path = tmp_path / "m.onnx"
    path.write_bytes(m.SerializeToString())
    with pytest.raises(IrgenError, match="is reserved"):
        prepare(path, {})


def test_prepared_model_holds_no_weight_data_and_a_run_agrees_with_onnxruntime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "chain.onnx"
    path.write_bytes(_conv_chain(3).SerializeToString())
    model, _ = prepare(path, {})
    weights = [t for t in model.graph.initializer if t.name.startswith("w")]
    assert len(weights) == 3 and all(loader.deferred(t) is not None and not t.HasField("raw_data") for t in weights)
    assert model.ByteSize() < BIG  # the parsed model is its structure, not its weights

    x = np.random.default_rng(1).standard_normal((1, 64, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    assert irgen_main(["run", str(path), "-o", str(out), "--input", f"x={tmp_path / 'x.npy'}", "--no-cache"]) == 0
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": x})[0]
    ir = json.loads((out / "ir.json").read_text())
    got = np.load(out / ir["layers"][-1]["outputs"][0]["file"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # the weights written as parameters are the model's, bit for bit
    full = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    convs = [layer for layer in ir["layers"] if layer["op"] == "conv2d"]
    assert len(convs) == 3
    for k, layer in enumerate(convs):
        np.testing.assert_array_equal(np.load(out / layer["params"]["weight"]["file"]), full[f"w{k}"])
