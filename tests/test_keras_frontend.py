"""The ``keras`` frontend: Keras files and SavedModel folders, converted to TFLite in-process.

Float: the model output matches Keras (``model(x)``) within 1e-4 and every
layer's output matches the TFLite interpreter (BUILTIN_REF) running the same
conversion, done here in the test. Int8 with ``--calibration``: every layer and
the output equal the interpreter bit for bit (the test converts with the same
calibration files and settings). Errors: an op TFLite builtins cannot express,
a Lambda layer, corrupt files, bad calibration folders; each gives exit code 2,
one ``irgen: error:`` line and no OUT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tflite")
pytest.importorskip("tensorflow")
sys.path.insert(0, str(Path(__file__).parent))
import tflite_models  # noqa: E402
from layercheck import assert_layers_match, assert_user_error  # noqa: E402

from irgen.cli import main as irgen_main  # noqa: E402

N_CALIB = 16


def _irgen(args: list[str]) -> int:
    return irgen_main(["run", *args, "--no-progress"])


def _convert(path: Path, calib: list[np.ndarray] | None = None) -> bytes:
    """What the frontend does, done independently here."""
    tf = tflite_models._tf()
    if path.is_dir():
        conv = tf.lite.TFLiteConverter.from_saved_model(str(path))
    else:
        conv = tf.lite.TFLiteConverter.from_keras_model(tf.keras.models.load_model(str(path), compile=False))
    if calib is not None:
        def rep():
            for s in calib:
                yield [s]

        conv.optimizations = [tf.lite.Optimize.DEFAULT]
        conv.representative_dataset = rep
        conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        conv.inference_input_type = tf.int8
        conv.inference_output_type = tf.int8
    return conv.convert()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{(name, kind): (path, keras model, input shape)} for kind in keras, h5, savedmodel."""
    d = tmp_path_factory.mktemp("keras_models")
    out = {}
    for name in ("small_cnn", "mlp"):
        model, shape = tflite_models.build(name)
        model.save(d / f"{name}.keras")
        model.save(d / f"{name}.h5")
        model.export(str(d / f"{name}_saved"), verbose=False)
        for kind, p in (("keras", d / f"{name}.keras"), ("h5", d / f"{name}.h5"), ("savedmodel", d / f"{name}_saved")):
            out[(name, kind)] = (p, model, shape)
    return out


FLOAT_CASES = [("small_cnn", "keras"), ("small_cnn", "savedmodel"), ("mlp", "keras"), ("mlp", "h5"), ("mlp", "savedmodel")]


@pytest.fixture(scope="module", params=FLOAT_CASES, ids=[f"{n}-{k}" for n, k in FLOAT_CASES])
def float_run(request, saved, tmp_path_factory):
    name, kind = request.param
    path, model, shape = saved[(name, kind)]
    d = tmp_path_factory.mktemp(f"float_{name}_{kind}")
    x = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    np.save(d / "x.npy", x)
    out = d / "out"
    assert _irgen([str(path), "-o", str(out), "--input", str(d / "x.npy")]) == 0
    tfl = d / "ref.tflite"
    tfl.write_bytes(_convert(path))
    return {"out": out, "ir": json.loads((out / "ir.json").read_text()), "x": x, "model": model,
            "ref": tflite_models.tflite_reference(tfl, x), "kind": kind}


def test_float_output_matches_keras(float_run):
    ir, out = float_run["ir"], float_run["out"]
    assert ir["producer"]["frontend"] == "keras" and ir["producer"]["quantizer"] in (None, "none")
    got = np.load(out / ir["outputs"][0]["file"])
    exp = np.asarray(float_run["model"](float_run["x"]))
    assert got.shape == exp.shape and got.dtype == np.float32
    diff = float(np.max(np.abs(got - exp)))
    assert diff <= 1e-4, diff
    print(f"\n{float_run['kind']}: max |irgen - keras| = {diff:.3g}")


def test_float_every_layer_matches_interpreter(float_run):
    ir, out, ref = float_run["ir"], float_run["out"], float_run["ref"]
    assert ir["layers"]
    assert_layers_match(out, ir, ref, float_run["kind"])
    if float_run["kind"] != "savedmodel":  # Keras layer names survive in the TFLite tensor names
        names = " ".join(s for layer in ir["layers"] for s in layer["source"]["outputs"])
        layer_names = {"small_cnn": ("conv1", "dw1", "residual", "concat"), "mlp": ("fc1", "fc2")}
        assert any(n in names for n in layer_names["small_cnn" if "conv" in names else "mlp"]), names


INT8_CASES = [("small_cnn", "keras"), ("small_cnn", "savedmodel"), ("mlp", "h5")]


@pytest.mark.parametrize("name,kind", INT8_CASES, ids=[f"{n}-{k}" for n, k in INT8_CASES])
def test_int8_with_calibration_is_bit_exact(saved, tmp_path, name, kind):
    path, _, shape = saved[(name, kind)]
    calib_dir = tmp_path / "calib"
    calib_dir.mkdir()
    samples = []
    for k in range(N_CALIB):
        s = np.random.default_rng(500 + k).standard_normal(shape).astype(np.float32)
        np.save(calib_dir / f"s{k:02d}.npy", s)
        samples.append(s)
    tfl = tmp_path / "ref_int8.tflite"
    tfl.write_bytes(_convert(path, samples))
    tf = tflite_models._tf()
    scale, zp = tf.lite.Interpreter(model_path=str(tfl)).get_input_details()[0]["quantization"]
    xf = np.random.default_rng(9).standard_normal(shape).astype(np.float32)
    x = np.clip(np.round(xf / scale) + zp, -128, 127).astype(np.int8)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    assert _irgen([str(path), "-o", str(out), "--input", str(tmp_path / "x.npy"), "--calibration", str(calib_dir)]) == 0
    ir = json.loads((out / "ir.json").read_text())
    assert ir["producer"]["frontend"] == "keras" and ir["producer"]["quantizer"] == "tflite-int8"
    assert ir["inputs"][0]["dtype"] == "int8"
    ref = tflite_models.tflite_reference(tfl, x)
    for layer in ir["layers"]:
        for rec, src in zip(layer["outputs"], layer["source"]["outputs"], strict=True):
            np.testing.assert_array_equal(np.load(out / rec["file"]), ref[src], err_msg=layer["name"])
    rec = ir["outputs"][0]
    got = np.load(out / rec["file"])
    assert got.dtype == np.int8
    np.testing.assert_array_equal(got, ref[rec["name"]])


# ---------------------------------------------------------------- errors


def test_op_tflite_cannot_convert(tmp_path, capsys):
    tf = tflite_models._tf()
    L = tf.keras.layers
    x = L.Input((16,), batch_size=1, dtype="int32", name="ids")
    model = tf.keras.Model(x, L.Hashing(8, name="hash")(x))  # AsString + StringToHashBucketFast: Flex only
    p = tmp_path / "hashing.keras"
    model.save(p)
    line = assert_user_error(_irgen, capsys, [str(p), "-o", str(tmp_path / "out")], tmp_path / "out",
                              "hashing.keras", "SELECT_TF_OPS")
    assert "AsString" in line and "StringToHashBucketFast" in line


def test_lambda_layer_is_refused(tmp_path, capsys):
    tf = tflite_models._tf()
    L = tf.keras.layers
    x = L.Input((4,), batch_size=1, name="x")
    model = tf.keras.Model(x, L.Lambda(lambda t: t * 2.0, name="double")(L.Dense(4, name="fc")(x)))
    for suffix in (".keras", ".h5"):
        p = tmp_path / f"lam{suffix}"
        model.save(p)
        assert_user_error(_irgen, capsys, [str(p), "-o", str(tmp_path / "out")], tmp_path / "out", p.name, "Lambda", "'double'")


def test_corrupt_files(tmp_path, capsys):
    junk = np.random.default_rng(0).bytes(512)
    for name in ("bad.keras", "bad.h5"):
        (tmp_path / name).write_bytes(junk)
        assert_user_error(_irgen, capsys, [str(tmp_path / name), "-o", str(tmp_path / "out")], tmp_path / "out", name)
    sm = tmp_path / "bad_saved"
    sm.mkdir()
    (sm / "saved_model.pb").write_bytes(junk)
    assert_user_error(_irgen, capsys, [str(sm), "-o", str(tmp_path / "out")], tmp_path / "out", "bad_saved", "SavedModel")


def test_bad_calibration_folders(saved, tmp_path, capsys):
    path, _, shape = saved[("mlp", "keras")]
    out = tmp_path / "out"
    args = [str(path), "-o", str(out), "--calibration"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_user_error(_irgen, capsys, args + [str(empty)], out, "--calibration", "no .npy files")
    assert_user_error(_irgen, capsys, args + [str(tmp_path / "missing")], out, "--calibration", "not a folder")
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    np.save(wrong / "a.npy", np.zeros((1, 5), np.float32))
    assert_user_error(_irgen, capsys, args + [str(wrong)], out, "a.npy", "shape (1, 5)")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    np.save(pickled / "p.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert_user_error(_irgen, capsys, args + [str(pickled)], out, "p.npy", "pickle")
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "g.npy").write_bytes(b"not an npy file at all")
    assert_user_error(_irgen, capsys, args + [str(garbage)], out, "g.npy")


def test_calibration_with_tflite_file_is_refused(tmp_path, capsys):
    path, _ = tflite_models.export("mlp", tmp_path, "float")
    (tmp_path / "c").mkdir()
    assert_user_error(_irgen, capsys, [str(path), "-o", str(tmp_path / "out"), "--calibration", str(tmp_path / "c")],
                       tmp_path / "out", "--calibration")


@pytest.mark.slow  # 20-30 s; by default, test_int8_with_calibration_is_bit_exact on smaller models
def test_keras_applications_mobilenet_v2_int8_is_bit_exact(tmp_path):
    """A real architecture, not one written for these tests: ``keras.applications``
    MobileNetV2 (alpha 0.35, 48x48, seeded weights and batch-norm statistics;
    ZeroPadding2D, strided depthwise convs, ReLU6, residual adds, global pooling,
    dense) converted to int8 with ``--calibration``: every layer equals the TFLite
    interpreter's reference kernels bit for bit. (Its softmax is left out: the
    reference interpreter aborts preparing a softmax whose input scale, from
    random weights, is tiny.)"""
    tf = tflite_models._tf()
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.applications.MobileNetV2(input_shape=(48, 48, 3), alpha=0.35, weights=None, classes=10,
                                              classifier_activation=None)
    rng = np.random.default_rng(0)
    for w in model.weights:
        if "moving_variance" in w.path:
            w.assign(rng.uniform(0.5, 1.5, w.shape).astype(np.float32))
        elif "moving_mean" in w.path:
            w.assign(rng.uniform(-0.2, 0.2, w.shape).astype(np.float32))
    path = tmp_path / "mobilenet_v2.keras"
    model.save(path)
    calib_dir = tmp_path / "calib"
    calib_dir.mkdir()
    samples = [np.random.default_rng(700 + k).uniform(-1, 1, (1, 48, 48, 3)).astype(np.float32) for k in range(8)]
    for k, s in enumerate(samples):
        np.save(calib_dir / f"s{k}.npy", s[0])
    tfl = tmp_path / "ref_int8.tflite"
    tfl.write_bytes(_convert(path, samples))
    scale, zp = tf.lite.Interpreter(model_path=str(tfl)).get_input_details()[0]["quantization"]
    xf = np.random.default_rng(11).uniform(-1, 1, (1, 48, 48, 3)).astype(np.float32)
    x = np.clip(np.round(xf / scale) + zp, -128, 127).astype(np.int8)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    assert _irgen([str(path), "-o", str(out), "--input", str(tmp_path / "x.npy"), "--calibration", str(calib_dir)]) == 0
    ir = json.loads((out / "ir.json").read_text())
    assert ir["producer"]["quantizer"] == "tflite-int8" and len(ir["layers"]) > 60
    ops = {layer["op"] for layer in ir["layers"]}
    assert {"conv2d", "depthwise_conv2d", "add", "dense"} <= ops, ops
    ref = tflite_models.tflite_reference(tfl, x)
    compared = 0
    for layer in ir["layers"]:
        for rec, src in zip(layer["outputs"], layer["source"]["outputs"], strict=True):
            got = np.load(out / rec["file"])
            assert got.dtype == np.int8
            np.testing.assert_array_equal(got, ref[src], err_msg=layer["name"])
            compared += got.size
    print(f"\nMobileNetV2 int8: {len(ir['layers'])} layers, {compared} values equal to the reference interpreter")


def test_recurrent_keras_model_with_an_open_batch(tmp_path):
    """A ``.keras`` model with stacked LSTMs and an open batch (``Input((steps, features))``, as
    Keras' examples write it): TFLite's converter cannot lower the loops of such a model
    ("TensorListReserve ... requires element_shape to be static"); the frontend converts it at
    batch 1, and the golden output equals Keras' own ``model(x)``."""
    tf = tflite_models._tf()
    tf.keras.utils.set_random_seed(3)
    model = tf.keras.Sequential([tf.keras.Input((6, 5)), tf.keras.layers.LSTM(8, return_sequences=True),
                                 tf.keras.layers.LSTM(8), tf.keras.layers.Dense(3)])
    path = tmp_path / "stacked.keras"
    model.save(path)
    with pytest.raises(Exception, match="element_shape"):  # the converter alone, as irgen found it
        tf.lite.TFLiteConverter.from_keras_model(model).convert()
    x = np.random.default_rng(5).standard_normal((1, 6, 5)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    assert _irgen([str(path), "-o", str(out), "--input", str(tmp_path / "x.npy")]) == 0
    ir = json.loads((out / "ir.json").read_text())
    golden = np.load(out / ir["outputs"][0]["file"])
    np.testing.assert_allclose(golden, model(x).numpy(), rtol=1e-4, atol=1e-5)
    steps = {l["name"].split(".")[0] + "." + l["name"].split(".")[1] for l in ir["layers"] if l["name"].startswith("WHILE_")}
    assert len(steps) == 2 * 6, sorted(steps)  # both loops unrolled: a layer group per step
