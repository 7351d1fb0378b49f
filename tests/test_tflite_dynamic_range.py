"""TFLite dynamic-range quantization (``optimizations=[Optimize.DEFAULT]``, no representative
dataset): float activations, int8 weights per output channel, TFLite's hybrid kernels.

TVM's importer refuses such models; irgen builds each hybrid CONV_2D, DEPTHWISE_CONV_2D and
FULLY_CONNECTED as TFLite computes it (``irgen_tensorflow.hybrid``): the float input quantized
at run time per batch (per row for FULLY_CONNECTED), an int32 accumulation, the float rescale.
The golden data must equal the TFLite interpreter's reference kernels bit for bit, layer by
layer, on seeded inputs and on inputs that hit the quantization's corner cases (exact rounding
ties, an all-zero tensor, values far apart).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tflite_models
from irgen.cli import main as irgen_main
from irgen.pipeline import run
from irgen.plugins import PluginHost

pytest.importorskip("tensorflow")


@pytest.fixture(scope="module")
def host():
    return PluginHost().load()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hybrid")
    path, x = tflite_models.export("hybrid_cnn", folder, "dynamic")
    return path, x, folder


def _inputs(x: np.ndarray) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    out = [x, np.abs(x) * 3, rng.standard_normal(x.shape).astype(np.float32) * 100, np.zeros_like(x)]
    tied = x.copy()
    # values on a grid: many products x * (1 / scale) land on (or one float32 step beside) a half
    tied.reshape(-1)[::3] = np.round(tied.reshape(-1)[::3] * 8) / 8 + np.float32(1 / 16)
    out.append(tied)
    spiky = x.copy()
    spiky.reshape(-1)[7] = 1e4  # one value far from the rest: most quantize to the zero point
    out.append(spiky)
    return out


def test_every_layer_equals_the_interpreter(model, host):
    path, x, folder = model
    hybrid_layers = 0
    for k, xin in enumerate(_inputs(x)):
        np.save(folder / f"x{k}.npy", xin)
        out = folder / f"out{k}"
        run(host, path, out, inputs=[str(folder / f"x{k}.npy")], opt_level=3 if k % 2 == 0 else 0)
        ir = json.loads((out / "ir.json").read_text())
        ref = tflite_models.tflite_reference(path, xin)
        for layer in ir["layers"]:
            weights = [p for p in (layer.get("params") or {}).values() if p["dtype"] == "int8"]
            hybrid_layers += bool(weights)
            for rec, src in zip(layer["outputs"], layer["source"]["outputs"], strict=True):
                got = np.load(out / rec["file"])
                assert got.dtype == np.float32
                np.testing.assert_array_equal(got, ref[src], err_msg=f"input {k}: {layer['name']} ({layer['op']})")
    assert hybrid_layers == len(_inputs(x)) * 8  # 3 convs, 2 depthwise, 3 dense in each run


def test_layers_are_named_by_their_op_and_keep_int8_weights(model, host):
    path, x, folder = model
    np.save(folder / "xa.npy", x)
    out = folder / "outa"
    run(host, path, out, inputs=[str(folder / "xa.npy")])
    ir = json.loads((out / "ir.json").read_text())
    ops = {layer["op"] for layer in ir["layers"] if any(p["dtype"] == "int8" for p in layer["params"].values())}
    assert ops == {"conv2d", "depthwise_conv2d", "dense"}, ops
    dw = next(layer for layer in ir["layers"] if layer["op"] == "depthwise_conv2d")
    assert dw["attrs"]["activation"]["op"] in ("relu", "clip")


def test_verify_passes_against_the_interpreter(model, host, capsys):
    path, x, folder = model
    np.save(folder / "xv.npy", x)
    out = folder / "outv"
    run(host, path, out, inputs=[str(folder / "xv.npy")])
    capsys.readouterr()
    code = irgen_main(["verify", str(out), "--no-progress", "--no-report", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["passed"], r.get("problems")
    assert r["source"]["ran"] and "reference kernels" in r["source"]["runtime"]
    rows = [row["checks"]["source"] for row in r["layers"]]
    assert rows and all(m["status"] == "pass" and m["exact"] for m in rows), rows


def test_an_int8_embedding_table_is_gathered_then_dequantized(tmp_path, host):
    """The converter quantizes a large embedding table to int8 (GATHER of the int8 table, then a
    DEQUANTIZE; TVM refused the quantized GATHER) and the Dense after it is a hybrid
    FULLY_CONNECTED on 6 token rows, each quantized on its own: every layer equals the interpreter."""
    import tensorflow as tf

    tf.keras.utils.set_random_seed(3)
    tokens = tf.keras.layers.Input((6,), batch_size=1, dtype="int32", name="tokens")
    e = tf.keras.layers.Embedding(100, 64, name="embed")(tokens)
    model = tf.keras.Model(tokens, tf.keras.layers.Dense(64, name="fc")(e))
    conv = tf.lite.TFLiteConverter.from_keras_model(model)
    conv.optimizations = [tf.lite.Optimize.DEFAULT]
    path = tmp_path / "embed.tflite"
    path.write_bytes(conv.convert())
    ids = np.array([[3, 97, 0, 42, 42, 7]], np.int32)
    np.save(tmp_path / "ids.npy", ids)
    run(host, path, tmp_path / "out", inputs=[str(tmp_path / "ids.npy")])
    ir = json.loads((tmp_path / "out" / "ir.json").read_text())
    ref = tflite_models.tflite_reference(path, ids)
    ops = [layer["op"] for layer in ir["layers"]]
    assert "dequantize" in ops and "dense" in ops, ops
    for layer in ir["layers"]:
        for rec, src in zip(layer["outputs"], layer["source"]["outputs"], strict=True):
            np.testing.assert_array_equal(np.load(tmp_path / "out" / rec["file"]), ref[src], err_msg=layer["name"])


@pytest.mark.slow  # test_every_layer_equals_the_interpreter covers the fully connected layers by default
def test_symmetric_input_quantization_of_fully_connected(model, host, tmp_path):
    """A FULLY_CONNECTED without ``asymmetric_quantize_inputs`` (older converters wrote it so; the
    flag is flipped in the flatbuffer here) quantizes each row symmetrically:
    ``range = max(|min|, |max|)``, ``q = round(x * (127 / range))`` in [-127, 127]. Every layer
    equals the interpreter."""
    import flatbuffers
    from tensorflow.lite.python import schema_py_generated as schema

    path, x, _ = model
    m = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(path.read_bytes(), 0))
    flipped = 0
    for op in m.subgraphs[0].operators:
        if isinstance(op.builtinOptions, schema.FullyConnectedOptionsT):
            op.builtinOptions.asymmetricQuantizeInputs = False
            flipped += 1
    assert flipped == 3
    b = flatbuffers.Builder(1024)
    b.Finish(m.Pack(b), file_identifier=b"TFL3")
    sym = tmp_path / "symmetric.tflite"
    sym.write_bytes(bytes(b.Output()))
    for k, xin in enumerate(_inputs(x)[:4]):
        np.save(tmp_path / f"x{k}.npy", xin)
        out = tmp_path / f"out{k}"
        run(host, sym, out, inputs=[str(tmp_path / f"x{k}.npy")])
        ir = json.loads((out / "ir.json").read_text())
        ref = tflite_models.tflite_reference(sym, xin)
        for layer in ir["layers"]:
            src = layer["source"]["outputs"][0]
            np.testing.assert_array_equal(np.load(out / layer["outputs"][0]["file"]), ref[src], err_msg=layer["name"])


def test_per_tensor_fully_connected_weights(tmp_path, host):
    """One weight scale per tensor (``_experimental_disable_per_channel``): TFLite folds it into
    each row's scale, irgen broadcasts it per channel; the product is the same, bit for bit."""
    import tensorflow as tf

    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((32,), batch_size=1), tf.keras.layers.Dense(64, activation="relu"),
                                 tf.keras.layers.Dense(48)])
    conv = tf.lite.TFLiteConverter.from_keras_model(model)
    conv.optimizations = [tf.lite.Optimize.DEFAULT]
    conv._experimental_disable_per_channel = True
    path = tmp_path / "fc_per_tensor.tflite"
    path.write_bytes(conv.convert())
    rng = np.random.default_rng(0)
    for k in range(4):
        x = rng.standard_normal((1, 32)).astype(np.float32) * (k + 1)
        np.save(tmp_path / f"x{k}.npy", x)
        out = tmp_path / f"out{k}"
        run(host, path, out, inputs=[str(tmp_path / f"x{k}.npy")])
        ir = json.loads((out / "ir.json").read_text())
        ref = tflite_models.tflite_reference(path, x)
        assert [layer["op"] for layer in ir["layers"]] == ["dense", "dense"]
        for layer in ir["layers"]:
            w = next(p for p in layer["params"].values() if p["dtype"] == "int8")
            assert len(w["shape"]) == 2  # the int8 weight matrix itself
            src = layer["source"]["outputs"][0]
            np.testing.assert_array_equal(np.load(out / layer["outputs"][0]["file"]), ref[src], err_msg=layer["name"])
