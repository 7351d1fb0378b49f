"""TFLite/Keras gaps found on the keras.applications zoo, each on a small seeded
Keras model compared with the TFLite interpreter through ``irgen run`` and
``irgen verify`` (single, entire and source: the source check must run):

* a model with several outputs (float and full int8) at opt level 3 and 0: the
  output tuple is not a layer;
* STRIDED_SLICE with ellipsis and new-axis masks (the converter canonicalizes
  them away, so the flatbuffer's slice options are rewritten to a mask form
  of the same slice), on int8 and float tensors;
* FULLY_CONNECTED on a 3-D int8 tensor (keep_num_dims, a Dense on [1, T, C]):
  the ``dense`` record carries its requant and recomputes exactly;
* int8 ADD and MUL whose operands are one tensor (``x + x``, NASNetMobile): the
  record maps its operands to the layer's one input and recomputes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tflite_models
from irgen.pipeline import run
from irgen.plugins import PluginHost
from irgen.verify import format_table, verify_output


@pytest.fixture(scope="module")
def host():
    return PluginHost().load()


def _run_verify(host, path, x, folder, opt_level=3):
    """irgen run, then verify (single, entire, source: the TFLite interpreter's
    reference kernels, in this process); every layer is compared with the source."""
    from irgen_tensorflow import interpreter_runner

    np.save(folder / "x.npy", x)
    out = folder / f"out{opt_level}"
    run(host, path, out, inputs=[str(folder / "x.npy")], opt_level=opt_level)
    result = verify_output(out, host=host, source_runner=interpreter_runner(path.read_bytes(), str(path)))
    assert result["passed"], format_table(result)
    assert result["source"]["ran"], result["source"]
    compared = [row for row in result["layers"] if row["checks"].get("source", {}).get("status") == "pass"]
    assert len(compared) == len(result["layers"]), format_table(result)
    return json.loads((out / "ir.json").read_text()), out


def zoo_ops(tf):
    """Three outputs: two strided slices (rewritten below into mask forms of
    themselves), Dense layers on a [1, T, C] tensor, and ``c * c``, ``c + c``
    (one tensor read by both operands: NASNetMobile)."""
    L = tf.keras.layers
    x = L.Input((6, 8, 4), batch_size=1, name="x")
    c = L.Conv2D(4, 1, activation="relu")(x)
    a = L.Conv2D(4, 1)(L.Lambda(lambda t: t[:, 1:5, :, ::2])(c))  # -> [1, 4, 8, 2]
    b = L.Conv2D(3, 1)(L.Lambda(lambda t: t[:, 2:3, :, ::2])(L.Multiply()([c, c])))  # -> [1, 1, 8, 2]
    t = L.Dense(6, activation="relu")(L.Reshape((48, 4))(L.Add()([c, c])))  # FULLY_CONNECTED, keep_num_dims
    return tf.keras.Model(x, [a, b, L.Add()([L.Dense(4)(t), L.Reshape((48, 4))(x)])]), (1, 6, 8, 4)


#: a slice's output shape -> its mask form:
#: (begin, end, strides, begin_mask, end_mask, ellipsis_mask, new_axis_mask, shrink_mask)
MASK_FORMS = {
    (1, 4, 8, 2): ([0, 1, 0, 0], [0, 5, 0, 0], [1, 1, 1, 2], 0b1001, 0b1001, 0b0100, 0, 0),  # [:, 1:5, ..., ::2]
    (1, 1, 8, 2): ([0, 0, 2, 0, 0], [0, 0, 3, 0, 0], [1, 1, 1, 1, 2], 0b11001, 0b11001, 0, 0b00010, 0b00100),
    # [:, newaxis, 2, :, ::2]
}


def _rewrite_slices(path) -> int:
    """Each STRIDED_SLICE of the model gets the mask form of its slice (new begin,
    end, strides tensors and options); returns the number rewritten."""
    from tensorflow.lite.python import schema_py_generated as schema
    from tensorflow.lite.tools import flatbuffer_utils

    model = flatbuffer_utils.read_model(str(path))
    sg = model.subgraphs[0]
    done = 0
    for op in sg.operators:
        code = model.operatorCodes[op.opcodeIndex]
        if max(code.builtinCode, code.deprecatedBuiltinCode) != schema.BuiltinOperator.STRIDED_SLICE:
            continue
        form = MASK_FORMS.get(tuple(int(d) for d in sg.tensors[op.outputs[0]].shape))
        if form is None:  # not one of the model's two slices
            continue
        for k, values in enumerate(form[:3]):
            buf = schema.BufferT()
            buf.data = np.frombuffer(np.asarray(values, np.int32).tobytes(), np.uint8)
            model.buffers.append(buf)
            t = schema.TensorT()
            t.shape, t.type, t.buffer = [len(values)], schema.TensorType.INT32, len(model.buffers) - 1
            t.name = f"mask_form_{done}_{k}".encode()
            sg.tensors.append(t)
            op.inputs[1 + k] = len(sg.tensors) - 1
        o = op.builtinOptions
        o.beginMask, o.endMask, o.ellipsisMask, o.newAxisMask, o.shrinkAxisMask = form[3:]
        done += 1
    flatbuffer_utils.write_model(model, str(path))
    return done


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tflite_models.BUILDERS["zoo_ops"] = zoo_ops
    made = {}
    for quant in ("int8", "float"):
        folder = tmp_path_factory.mktemp(f"zoo_ops_{quant}")
        path, x = tflite_models.export("zoo_ops", folder, quant)
        tf = tflite_models._tf()
        ops = {o["op_name"] for o in tf.lite.Interpreter(model_path=str(path))._get_ops_details()}
        assert {"STRIDED_SLICE", "FULLY_CONNECTED", "MUL", "ADD"} <= ops, ops
        before = tflite_models.tflite_reference(path, x)
        assert _rewrite_slices(path) == 2
        after = tflite_models.tflite_reference(path, x)
        for name in tflite_models.output_names(path):  # the mask forms slice the same values
            np.testing.assert_array_equal(after[name], before[name])
        made[quant] = (path, x, after)
    return made


@pytest.mark.parametrize("quant,opt_level", [("int8", 3), pytest.param("int8", 0, marks=pytest.mark.slow),
                                             ("float", 3)])
def test_outputs_slices_and_tokens_dense(quant, opt_level, models, tmp_path, host):
    path, x, ref = models[quant]
    ir, out = _run_verify(host, path, x, tmp_path, opt_level)
    # several outputs: each equals the interpreter's, no layer for the output tuple
    assert len(ir["outputs"]) == 3
    for o in ir["outputs"]:
        got = np.load(out / o["file"])
        if quant == "int8":
            np.testing.assert_array_equal(got, ref[o["name"]])
        else:
            np.testing.assert_allclose(got, ref[o["name"]], rtol=1e-5, atol=1e-5)
    # both mask-form slices are layers of their own, compared with the interpreter
    names = [layer["name"] for layer in ir["layers"]]
    assert sum(n.startswith("STRIDED_SLICE") for n in names) == 2, names
    if quant == "int8":
        # FULLY_CONNECTED on [1, 48, 6] (keep_num_dims): a dense record with its per-channel requant on the last axis
        dense = [layer for layer in ir["layers"] if layer["quant"]["kind"] == "dense"]
        assert len(dense) == 2, [(layer["name"], layer["quant"]["kind"]) for layer in ir["layers"]]
        for layer in dense:  # the converter moves the first Dense before the reshape (4-D)
            rq, shape = layer["quant"]["requant"], layer["outputs"][0]["shape"]
            assert rq["axis"] == len(shape) - 1 and len(rq["multiplier"]) == shape[-1]
        assert [1, 48, 4] in [layer["outputs"][0]["shape"] for layer in dense]
        # x * x and x + x: one layer input read by both operands, recomputed from the record
        same = [layer for layer in ir["layers"] if layer["quant"].get("operands") == [0, 0]]
        assert {layer["quant"]["kind"] for layer in same} == {"add", "mul"}
        assert all(len(layer["inputs"]) == 1 for layer in same)
