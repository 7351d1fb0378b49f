"""Hostile TensorFlow models: ``.tflite`` flatbuffers, ``.keras``/``.h5`` files and
SavedModel folders built to break the ``tflite`` and ``keras`` frontends.

Every bad model must end in one :class:`IrgenError` (the CLI: exit 2, one
``irgen: error:`` line naming the file, tensor or op), never a traceback, a
hang, TensorFlow's log lines on stderr, code run from the file, or a file read
that the user did not name. Most cases call the frontends' load functions in
this process (fast, TensorFlow is already imported to build the models); a
handful run the real ``irgen`` command (:mod:`hostile`).

Every hostile file is made here by code: models from :mod:`tflite_models`,
then edited with TFLite's flatbuffer object API, truncated, bit-flipped or
re-zipped.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import zipfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tflite")
pytest.importorskip("tensorflow")
sys.path.insert(0, str(Path(__file__).parent))
import hostile  # noqa: E402
import tflite_models  # noqa: E402

from irgen.api import ImportedModel, IrgenError  # noqa: E402
from irgen_tensorflow import load_tflite, source_runner  # noqa: E402
from irgen_tensorflow import keras_frontend  # noqa: E402

LIMIT = 2 << 30
OPTS = {"max_tensor_bytes": LIMIT}


@contextmanager
def deadline(seconds: int = 60):
    """Fail (instead of hanging the suite) when the body blocks, e.g. opening a FIFO."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s (blocked?)")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def refused(load, path: Path, options: dict | None = None, *names: str) -> str:
    """``load(path, options)`` raises one one-line IrgenError naming each of ``names``."""
    with deadline(), pytest.raises(IrgenError) as info:
        load(path, dict(OPTS if options is None else options))
    msg = str(info.value)
    assert "\n" not in msg, msg
    for name in names:
        assert name in msg, (name, msg)
    return msg


def outcome(load, path: Path, options: dict | None = None) -> str:
    """"ok" (a clean import) or the one-line IrgenError; anything else fails the test."""
    with deadline():
        try:
            result = load(path, dict(OPTS if options is None else options))
        except IrgenError as err:
            msg = str(err)
            assert "\n" not in msg, msg
            return msg
    assert isinstance(result, ImportedModel)
    return "ok"


# ---------------------------------------------------------------- models


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A float MLP and CNN as .tflite; the MLP as .keras and .h5."""
    d = tmp_path_factory.mktemp("hostile_tf")
    models = {name: tflite_models.export(name, d, "float")[0] for name in ("mlp", "small_cnn")}
    tf = tflite_models._tf()
    tf.keras.utils.set_random_seed(0)
    model, _ = tflite_models.mlp(tf)
    for suffix in (".keras", ".h5"):
        model.save(d / f"mlp{suffix}")
        models[suffix] = d / f"mlp{suffix}"
    return models


def _schema():
    from tensorflow.lite.python import schema_py_generated as schema

    return schema


def edited(src: Path, dst: Path, edit) -> Path:
    """``src`` unpacked with the flatbuffer object API, ``edit(model_t)``, packed to ``dst``."""
    import flatbuffers

    schema = _schema()
    m = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(src.read_bytes(), 0))
    edit(m)
    b = flatbuffers.Builder(1024)
    b.Finish(m.Pack(b), file_identifier=b"TFL3")
    dst.write_bytes(bytes(b.Output()))
    return dst


def _first_op(m):
    return m.subgraphs[0].operators[0]


def _activation(m) -> int:
    """Index of a tensor computed by an operator (not an input, not a constant)."""
    return int(_first_op(m).outputs[0])


# ---------------------------------------------------------------- .tflite: bytes


def test_truncated_tflite_is_one_error(built, tmp_path):
    src = built["mlp"].read_bytes()
    n = len(src)
    for cut in (0, 4, 8, 10, 16, 64, n // 3, n // 2, n - 64, n - 1):
        p = tmp_path / f"cut{cut}.tflite"
        p.write_bytes(src[:cut])
        refused(load_tflite, p, None, str(p), "not a readable TFLite model")


def test_bit_flipped_tflite_is_an_error_or_a_clean_import(built, tmp_path):
    """Single bit flips across the file: the root offset, the identifier, the
    tables near the end, weights in the middle. Each one is a clean import or
    one IrgenError naming the file (a flipped weight is still a valid model)."""
    src = built["small_cnn"].read_bytes()
    n = len(src)
    results = {}
    for off in (0, 1, 5, 20, n // 4, n // 2, n - 400, n - 200, n - 100, n - 40, n - 12, n - 3):
        for bit in (0, 6):
            flipped = bytearray(src)
            flipped[off] ^= 1 << bit
            p = tmp_path / f"flip{off}_{bit}.tflite"
            p.write_bytes(bytes(flipped))
            results[(off, bit)] = r = outcome(load_tflite, p)
            assert r == "ok" or str(p) in r or "tflite frontend (" in r, r
    assert "ok" in results.values(), results  # flipped weights still import
    assert set(results.values()) != {"ok"}, results  # flipped structure does not
    assert "not a readable TFLite model" in results[(5, 0)]  # the identifier


def test_random_garbage_after_a_valid_header(built, tmp_path):
    """The first 64 bytes of a model (root offset, identifier, the model table's
    vtable) followed by noise: every offset in the tables points into noise."""
    head = built["mlp"].read_bytes()[:64]
    rng = np.random.default_rng(9)
    for k in range(8):
        p = tmp_path / f"noise{k}.tflite"
        p.write_bytes(head + rng.bytes(int(rng.integers(16, 4000))))
        refused(load_tflite, p, None, str(p))


# ---------------------------------------------------------------- .tflite: fields


def test_buffer_offset_past_the_end(built, tmp_path):
    def edit(m):
        k = next(i for i, b in enumerate(m.buffers) if b.data is not None and len(b.data))
        m.buffers[k].offset, m.buffers[k].size = 1 << 40, 4096

    p = edited(built["mlp"], tmp_path / "far_buffer.tflite", edit)
    refused(load_tflite, p, None, str(p), "past the end of the file")


def test_buffer_stored_outside_the_flatbuffer_is_refused(built, tmp_path):
    """A buffer with offset/size inside the file (a model over 2 GB): TVM's importer
    reads only inline data, so it is refused by name instead of imported as zeros."""
    def edit(m):
        k = m.subgraphs[0].tensors[int(_first_op(m).inputs[1])].buffer
        m.buffers[k].data, m.buffers[k].offset, m.buffers[k].size = None, 8, 16

    p = edited(built["mlp"], tmp_path / "external_buffer.tflite", edit)
    refused(load_tflite, p, None, str(p), "outside the flatbuffer")


def test_huge_tensor_shape_is_refused_before_import(built, tmp_path):
    def edit(m):
        m.subgraphs[0].tensors[_activation(m)].shape = [1 << 20, 1 << 20, 64]

    p = edited(built["mlp"], tmp_path / "huge.tflite", edit)
    msg = refused(load_tflite, p, None, str(p), "--max-tensor-bytes", "over the limit")
    assert "tensor '" in msg and "(1048576, 1048576, 64)" in msg


def test_max_tensor_bytes_applies_to_a_valid_model(built):
    """The same check with a small limit: the largest weight of the MLP (64x32 float32)."""
    msg = refused(load_tflite, built["mlp"], {"max_tensor_bytes": 4096}, "tensor '", "over the limit of 4.0 KiB")
    assert outcome(load_tflite, built["mlp"], {"max_tensor_bytes": 1 << 20}) == "ok", msg


def test_negative_dimension(built, tmp_path):
    def edit(m):
        m.subgraphs[0].tensors[_activation(m)].shape = [-3, 64]

    p = edited(built["mlp"], tmp_path / "negative.tflite", edit)
    refused(load_tflite, p, None, str(p), "negative dimension", "(-3, 64)")


@pytest.mark.parametrize("case", ["op_input", "op_output", "graph_input", "graph_output", "opcode", "buffer",
                                  "no_subgraph", "short_constant", "name_not_utf8"])
def test_index_out_of_range(built, tmp_path, case):
    """Indices the reader would follow into unrelated bytes are refused by name."""
    def edit(m):
        sg, op = m.subgraphs[0], _first_op(m)
        if case == "op_input":
            op.inputs = [999, *op.inputs[1:]]
        elif case == "op_output":
            op.outputs = [len(sg.tensors), *op.outputs[1:]]
        elif case == "graph_input":
            sg.inputs = [12345]
        elif case == "graph_output":
            sg.outputs = [-7]
        elif case == "opcode":
            op.opcodeIndex = 77
        elif case == "buffer":
            sg.tensors[int(op.inputs[1])].buffer = 4242
        elif case == "no_subgraph":
            m.subgraphs = []
        elif case == "short_constant":
            b = m.buffers[sg.tensors[int(op.inputs[1])].buffer]
            b.data = b.data[:10]
        elif case == "name_not_utf8":
            sg.tensors[_activation(m)].name = b"\xff\xfeweird"

    expect = {"op_input": "tensor index 999 out of range", "op_output": "out of range",
              "graph_input": "tensor index 12345 out of range", "graph_output": "tensor index -7 out of range",
              "opcode": "operator code index 77 out of range", "buffer": "buffer index 4242 out of range",
              "no_subgraph": "no subgraph", "short_constant": "its buffer holds 10 bytes",
              "name_not_utf8": "not UTF-8"}[case]
    p = edited(built["mlp"], tmp_path / f"{case}.tflite", edit)
    refused(load_tflite, p, None, str(p), "not a readable TFLite model", expect)


def test_reader_error_inside_tvms_importer(built, monkeypatch):
    """A read past the end that only TVM's importer makes (an option table field
    here): still one "not a readable TFLite model" error naming the file and the op."""
    import flatbuffers
    from tflite.FullyConnectedOptions import FullyConnectedOptions

    def out_of_bounds(self):
        return self._tab.Get(flatbuffers.number_types.Int8Flags, len(self._tab.Bytes) + 7)

    monkeypatch.setattr(FullyConnectedOptions, "FusedActivationFunction", out_of_bounds)
    refused(load_tflite, built["mlp"], None, str(built["mlp"]), "not a readable TFLite model", "FULLY_CONNECTED_")


# ---------------------------------------------------------------- --input-shape


def test_input_shape_must_match_a_fixed_tflite_input(built):
    tfl = built["mlp"]
    sg = _schema().Model.GetRootAsModel(tfl.read_bytes(), 0).Subgraphs(0)
    inp = sg.Tensors(sg.Inputs(0)).Name().decode()
    msg = refused(load_tflite, tfl, {**OPTS, "input_shapes": {"nope": (1, 32)}}, "--input-shape nope",
                  "no input 'nope'", repr(inp), "(1, 32)")
    refused(load_tflite, tfl, {**OPTS, "input_shapes": {inp: (1, 5)}}, repr(inp), "fixed shape (1, 32)")
    refused(load_tflite, tfl, {**OPTS, "input_shapes": {inp: (1, 32, 1)}}, repr(inp), "fixed shape (1, 32)")
    assert outcome(load_tflite, tfl, {**OPTS, "input_shapes": {inp: (1, 32)}}) == "ok", msg


def test_input_shape_sets_only_open_dimensions(tmp_path):
    """A model converted with an open batch (shape signature -1): the batch may be
    set, the feature dimension may not."""
    tf = tflite_models._tf()
    L = tf.keras.layers
    x = L.Input((8,), name="x")
    p = tmp_path / "open_batch.tflite"
    p.write_bytes(tf.lite.TFLiteConverter.from_keras_model(tf.keras.Model(x, L.Dense(4, name="fc")(x))).convert())
    sg = _schema().Model.GetRootAsModel(p.read_bytes(), 0).Subgraphs(0)
    inp = sg.Tensors(sg.Inputs(0)).Name().decode()
    with deadline():
        imported = load_tflite(p, {**OPTS, "input_shapes": {inp: (3, 8)}})
    assert imported.inputs[0].shape == (3, 8)
    refused(load_tflite, p, {**OPTS, "input_shapes": {inp: (3, 7)}}, repr(inp), "(-1, 8)", "-1 dimensions")
    refused(load_tflite, p, {**OPTS, "input_shapes": {inp: (1 << 30, 8)}}, repr(inp), "over the limit")


# ---------------------------------------------------------------- paths that are not files


@pytest.fixture
def specials(tmp_path):
    """FIFOs, a device and links to them, named like models."""
    d = tmp_path / "specials"
    d.mkdir()
    for name in ("fifo.tflite", "fifo.keras", "fifo.h5"):
        os.mkfifo(d / name)
    (d / "zero.tflite").symlink_to("/dev/zero")
    (d / "zero.keras").symlink_to("/dev/zero")
    (d / "link.tflite").symlink_to(d / "fifo.tflite")
    (d / "dangling.h5").symlink_to(d / "nothing")
    return d


def test_fifo_and_device_models_are_refused_without_blocking(specials):
    for name in ("fifo.tflite", "zero.tflite", "link.tflite"):
        refused(load_tflite, specials / name, None, name)
        with deadline(), pytest.raises(IrgenError, match="not a regular file"):
            source_runner(specials / name, dict(OPTS))  # irgen verify's TFLite interpreter
    for name in ("fifo.keras", "fifo.h5", "zero.keras", "dangling.h5"):
        refused(keras_frontend.load_keras, specials / name, None, name)
        with deadline(), pytest.raises(IrgenError):
            keras_frontend.source_runner(specials / name, dict(OPTS))
    assert "FIFO" in refused(load_tflite, specials / "fifo.tflite")
    assert "character device" in refused(load_tflite, specials / "zero.tflite")


def test_saved_model_folder_must_hold_regular_files_inside_it(tmp_path):
    """Checked before TensorFlow opens anything: ``saved_model.pb`` a regular file,
    no FIFO inside, no link leading out of the folder (the target is never opened)."""
    outside = tmp_path / "outside"
    with hostile.Sentinel(outside) as sentinel:
        cases = {}
        for case in ("pb_fifo", "fifo_inside", "link_out", "pb_missing"):
            sm = tmp_path / case
            (sm / "variables").mkdir(parents=True)
            if case == "pb_fifo":
                os.mkfifo(sm / "saved_model.pb")
            elif case != "pb_missing":
                (sm / "saved_model.pb").write_bytes(b"\x08\x01")
            if case == "fifo_inside":
                os.mkfifo(sm / "variables" / "variables.index")
            if case == "link_out":
                (sm / "variables" / "variables.index").symlink_to(sentinel.secret)
            cases[case] = refused(keras_frontend.load_keras, sm, None, case)
        sentinel.assert_untouched()
    assert "saved_model.pb" in cases["pb_fifo"] and "FIFO" in cases["pb_fifo"]
    assert "variables.index" in cases["fifo_inside"] and "FIFO" in cases["fifo_inside"]
    assert "variables.index" in cases["link_out"] and "outside the folder" in cases["link_out"]
    assert "no such file" in cases["pb_missing"]


def test_calibration_files_are_read_safely(built, tmp_path):
    keras_path = built[".keras"]
    cases = {}
    for case in ("fifo", "pickle", "too_big", "truncated"):
        d = tmp_path / case
        d.mkdir()
        if case == "fifo":
            os.mkfifo(d / "s0.npy")
        elif case == "pickle":
            marker = tmp_path / "pickle_ran"
            np.save(d / "s0.npy", np.array([hostile.payload(marker)], dtype=object), allow_pickle=True)
        elif case == "too_big":  # 256 KiB, over a limit that the model's own tensors (8 KiB at most) are under
            np.save(d / "s0.npy", np.zeros((1, 1 << 16), np.float32))
        elif case == "truncated":
            np.save(d / "s0.npy", np.zeros((1, 32), np.float32))
            data = (d / "s0.npy").read_bytes()
            (d / "s0.npy").write_bytes(data[:-20])
        limit = 64 << 10 if case == "too_big" else LIMIT
        cases[case] = refused(keras_frontend.load_keras, keras_path,
                              {"max_tensor_bytes": limit, "calibration": str(d)}, "s0.npy")
    assert not (tmp_path / "pickle_ran").exists()
    assert "FIFO" in cases["fifo"]
    assert "pickle" in cases["pickle"]
    assert "over the limit" in cases["too_big"]
    assert "truncated" in cases["truncated"]


# ---------------------------------------------------------------- .keras / .h5: code in the file


def _lambda_model(tf, marker: Path):
    """A model whose Lambda layer would create ``marker`` when its code runs (the
    code is built from a string so its bytecode carries the path as a constant)."""
    L = tf.keras.layers
    x = L.Input((4,), batch_size=1, name="x")
    evil = eval(f"lambda t: (open({str(marker)!r}, 'w'), t)[1]")  # noqa: S307  test payload
    return tf.keras.Model(x, L.Lambda(evil, name="evil")(L.Dense(4, name="fc")(x)))


@pytest.mark.parametrize("suffix", [".keras", ".h5"])
def test_lambda_layer_never_runs(tmp_path, suffix):
    tf = tflite_models._tf()
    marker = tmp_path / f"lambda_ran{suffix}"
    model = _lambda_model(tf, marker)
    path = tmp_path / f"lambda{suffix}"
    model.save(path)
    marker.unlink()  # building the model above ran the lambda once: start clean
    refused(keras_frontend.load_keras, path, None, str(path), "Lambda", "'evil'")
    with pytest.raises(IrgenError, match="Lambda"):
        keras_frontend.source_runner(path, dict(OPTS))  # irgen verify's path
    assert not marker.exists(), "code from the model file ran"


def _rezip(src: Path, dst: Path, edit_config=None, extra: dict | None = None,
           compression=zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(src) as z:
        members = {i.filename: z.read(i.filename) for i in z.infolist()}
    if edit_config is not None:
        cfg = json.loads(members["config.json"])
        edit_config(cfg)
        members["config.json"] = json.dumps(cfg).encode()
    members.update(extra or {})
    with zipfile.ZipFile(dst, "w", compression=compression) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return dst


def _layers(cfg):
    return cfg["config"]["layers"]


def _layer(cfg, name):
    return next(layer for layer in _layers(cfg) if layer["config"].get("name") == name)


def test_keras_config_that_would_run_or_read_code_is_refused(built, tmp_path):
    """Edited ``config.json``: a layer class from another module, a serialized
    ``__lambda__`` activation, a TFSMLayer (loads a SavedModel from a path in the
    config), a vocabulary read from a file."""
    src = built[".keras"]

    def custom(cfg):
        _layer(cfg, "fc1")["module"] = "evil_module"

    def lambda_activation(cfg):
        _layer(cfg, "fc1")["config"]["activation"] = {
            "module": "builtins", "class_name": "__lambda__", "config": {"code": "AAAA", "defaults": None,
                                                                        "closure": None}}

    def tfsm(cfg):
        layer = _layer(cfg, "fc2")
        layer["class_name"] = "TFSMLayer"
        layer["config"]["filepath"] = str(tmp_path / "outside_saved_model")

    def vocabulary(cfg):
        _layer(cfg, "fc2")["config"]["vocabulary"] = "/etc/passwd"

    expect = {custom: "custom class", lambda_activation: "lambda", tfsm: "TFSMLayer", vocabulary: "/etc/passwd"}
    for edit, needle in expect.items():
        p = _rezip(src, tmp_path / f"{edit.__name__}.keras", edit)
        refused(keras_frontend.load_keras, p, None, str(p), needle)
    with zipfile.ZipFile(src) as z:  # nested 100000 deep: no RecursionError traceback
        text = z.read("config.json").decode()
    deep = text.replace('"name": "fc2"', '"note": ' + "[" * 100_000 + "]" * 100_000 + ', "name": "fc2"', 1)
    assert deep != text
    p = _rezip(src, tmp_path / "deep.keras", extra={"config.json": deep.encode()})
    refused(keras_frontend.load_keras, p, None, str(p), "not a readable .keras file")


def test_keras_config_with_a_huge_weight_is_refused_before_allocation(built, tmp_path):
    """``units`` raised to 10**9 in the config: Keras would initialize a 119 GiB
    kernel before reading the stored weights; irgen builds the model without
    allocating and refuses it by weight name."""
    def huge(cfg):
        _layer(cfg, "fc3")["config"]["units"] = 10 ** 9

    p = _rezip(built[".keras"], tmp_path / "huge.keras", huge)
    refused(keras_frontend.load_keras, p, None, str(p), "'fc3/kernel'", "over the limit")


def test_keras_zip_bomb_is_refused(built, tmp_path):
    p = _rezip(built[".keras"], tmp_path / "bomb.keras", extra={"assets/pad.bin": bytes(16 << 20)},
               compression=zipfile.ZIP_DEFLATED)
    refused(keras_frontend.load_keras, p, None, str(p), "assets/pad.bin", "zip bomb")


# ---------------------------------------------------------------- .keras / .h5: bytes


@pytest.mark.parametrize("suffix", [".keras", ".h5"])
def test_truncated_and_bit_flipped_keras_files(built, tmp_path, suffix):
    src = built[suffix].read_bytes()
    n = len(src)
    offsets = (0, 40, n // 4, n // 2, n - 100, n - 10)
    cases = {"empty": b"", "ten": src[:10]}
    for off in offsets:
        cases[f"cut{off}"] = src[:off]
        cases[f"flip{off}"] = src[:off] + bytes([src[off] ^ 0x24]) + src[off + 1:]
    results = {}
    for name, data in cases.items():
        p = tmp_path / f"{name}{suffix}"
        p.write_bytes(data)
        results[name] = r = outcome(keras_frontend.load_keras, p)
        assert r == "ok" or str(p) in r or f"({p.name})" in r, r
    for name in ("empty", "ten", *(f"cut{o}" for o in offsets)):
        assert results[name] != "ok", (name, results[name])


# ---------------------------------------------------------------- the command


def test_cli_hostile_tensorflow_models(built, tmp_path, specials):
    """The real command on a few of the cases above, side by side: exit 2, one
    ``irgen: error:`` line (no TensorFlow or TVM log lines, no traceback), no
    OUT, no hang, no marker."""
    import subprocess

    src = built["mlp"].read_bytes()
    truncated = tmp_path / "truncated.tflite"
    truncated.write_bytes(src[: len(src) // 2])
    oob = edited(built["mlp"], tmp_path / "bad_opcode.tflite", lambda m: setattr(_first_op(m), "opcodeIndex", 77))
    flipped = tmp_path / "flipped.keras"
    k = built[".keras"].read_bytes()
    flipped.write_bytes(k[: len(k) // 2] + bytes([k[len(k) // 2] ^ 1]) + k[len(k) // 2 + 1:])
    tf = tflite_models._tf()
    marker = tmp_path / "cli_lambda_ran"
    lam = tmp_path / "lambda.keras"
    _lambda_model(tf, marker).save(lam)
    marker.unlink()
    cases = [
        (truncated, ("truncated.tflite", "not a readable TFLite model")),
        (oob, ("bad_opcode.tflite", "operator code index 77")),
        (flipped, ("flipped.keras",)),
        (lam, ("lambda.keras", "Lambda")),
        (specials / "fifo.tflite", ("fifo.tflite", "FIFO")),
    ]
    procs = []
    for k, (model, _) in enumerate(cases):
        out = tmp_path / f"out{k}"
        procs.append((out, subprocess.Popen([*hostile.IRGEN, "run", str(model), "-o", str(out), "--no-progress"],
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                            stdin=subprocess.DEVNULL, env=hostile.ENV)))
    for (out, proc), (_, names) in zip(procs, cases):
        try:
            stdout, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        hostile.assert_refused(done, out, *names)
    assert not marker.exists()
