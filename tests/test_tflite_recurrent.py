"""Keras recurrent layers through the ``tflite`` frontend: the converter's ``WHILE`` loops unrolled.

Keras 3's ``LSTM``, ``GRU``, ``SimpleRNN`` and ``Bidirectional`` convert to a ``WHILE`` whose
condition compares counters with constants (:mod:`irgen_tensorflow.loops`). Every model's
output, and every layer whose source tensor the TFLite interpreter exposes (the loop's results,
the graph around it), equals the interpreter's reference kernels within float rounding; each
iteration's operators are layers of their own, and ``irgen verify`` passes (single, entire,
source). A loop whose condition reads data, or longer than the unroll limit, is refused by name.

Full-integer int8 is not tested: TF 2.21's converter crashes (a segmentation fault in its
calibrator, ``optimize/calibrator.py _feed_tensors``) on these loops, so there is no int8
loop to import (docs/layer-ops.md).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tflite")
pytest.importorskip("tensorflow")
sys.path.insert(0, str(Path(__file__).parent))
import tflite_models  # noqa: E402
from layercheck import assert_user_error  # noqa: E402

from irgen.cli import main as irgen_main  # noqa: E402

STEPS, FEATURES, UNITS = 5, 4, 8

#: (id, layer kind, return_sequences, bidirectional)
CASES = [("lstm-seq", "LSTM", True, False), ("lstm-last", "LSTM", False, False), ("gru-seq", "GRU", True, False),
         ("rnn-last", "SimpleRNN", False, False), ("bilstm-seq", "LSTM", True, True)]


def _keras_model(tf, kind: str, sequences: bool, bidirectional: bool):
    L = tf.keras.layers
    tf.keras.utils.set_random_seed(tflite_models.SEED)
    x = L.Input((STEPS, FEATURES), batch_size=1, name="x")
    layer = getattr(L, kind)(UNITS, return_sequences=sequences, name="rnn")
    y = (L.Bidirectional(layer, name="bi") if bidirectional else layer)(x)
    model = tf.keras.Model(x, y)
    rng = np.random.default_rng(tflite_models.SEED)
    for w in model.weights:  # biases not zero (Keras initializes them to zero)
        w.assign(rng.normal(0.0, 0.5, size=tuple(w.shape)).astype(np.float32))
    return model


def _convert(model_path: Path, kind: str, sequences: bool, bidirectional: bool) -> Path:
    tf = tflite_models._tf()
    data = tf.lite.TFLiteConverter.from_keras_model(_keras_model(tf, kind, sequences, bidirectional)).convert()
    model_path.write_bytes(data)
    return model_path


def _run(args: list[str]) -> int:
    return irgen_main(["run", *args, "--no-progress"])


#: the default suite runs an LSTM and a GRU with their full sequences; the other forms are slow
#: (each case converts, runs and verifies a model: 5-8 s)
DEFAULT_CASES = ("lstm-seq", "gru-seq")


@pytest.fixture(scope="module", ids=[c[0] for c in CASES],
                params=[pytest.param(c, marks=[] if c[0] in DEFAULT_CASES else [pytest.mark.slow]) for c in CASES])
def case(request, tmp_path_factory):
    name, kind, sequences, bidirectional = request.param
    d = tmp_path_factory.mktemp(name)
    path = _convert(d / f"{name}.tflite", kind, sequences, bidirectional)
    x = np.random.default_rng(tflite_models.SEED + 100).standard_normal((1, STEPS, FEATURES)).astype(np.float32)
    np.save(d / "x.npy", x)
    out = d / "out"
    assert _run([str(path), "-o", str(out), "--input", str(d / "x.npy")]) == 0
    return {"name": name, "path": path, "out": out, "ir": json.loads((out / "ir.json").read_text()),
            "ref": tflite_models.tflite_reference(path, x), "loops": 2 if bidirectional else 1}


def _ops(path: Path) -> set[str]:
    import tflite
    from tflite.BuiltinOperator import BuiltinOperator

    names = {v: k for k, v in vars(BuiltinOperator).items() if not k.startswith("_")}
    model = tflite.Model.GetRootAsModel(path.read_bytes(), 0)
    sg = model.Subgraphs(0)
    codes = [model.OperatorCodes(sg.Operators(i).OpcodeIndex()).BuiltinCode() for i in range(sg.OperatorsLength())]
    return {names[c] for c in codes}


def test_output_equals_the_interpreter(case):
    assert "WHILE" in _ops(case["path"])  # the converter wrote a loop, not fused ops
    ir, out, ref = case["ir"], case["out"], case["ref"]
    for rec in ir["outputs"]:
        got, exp = np.load(out / rec["file"]), ref[rec["name"]]
        assert got.shape == exp.shape and got.dtype == exp.dtype
        np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6, err_msg=rec["name"])
        print(f"\n{case['name']}: output {got.shape}, max |irgen - TFLite| = {np.abs(got - exp).max():.3g}")


def test_every_iteration_is_layers_and_observable_ones_match(case):
    ir, out, ref = case["ir"], case["out"], case["ref"]
    steps: dict[str, set[int]] = {}
    seen = 0
    for layer in ir["layers"]:
        node = layer["source"]["nodes"][0]
        if ".t" in node:  # WHILE_<k>.t<t>.<OP>_<i>
            loop, rest = node.split(".t", 1)
            steps.setdefault(loop, set()).add(int(rest.split(".")[0]))
        for rec, src in zip(layer["outputs"], layer["source"]["outputs"]):
            if src in ref:  # the main graph's tensors (the loop's results among them)
                np.testing.assert_allclose(np.load(out / rec["file"]), ref[src], rtol=1e-5, atol=1e-6, err_msg=src)
                seen += 1
            else:
                assert "@WHILE_" in src, src  # a body tensor of one iteration
    assert len(steps) == case["loops"] and all(s == set(range(STEPS)) for s in steps.values()), steps
    assert seen >= 2


@pytest.mark.slow  # test_verify_compares_every_loop_body_layer_with_the_interpreter verifies these models too
def test_verify_passes(case, capsys):
    capsys.readouterr()
    code = irgen_main(["verify", str(case["out"]), "--no-progress", "--no-report", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["passed"], r.get("problems")
    assert r["source"]["ran"]
    checks = [row["checks"] for row in r["layers"]]
    assert all(c["single"]["status"] == "pass" and c["entire"]["status"] == "pass" for c in checks)
    assert sum(1 for c in checks if c["source"]["status"] == "pass") >= 2  # the loop's results, the output


def _data_dependent_loop(tf, path: Path) -> Path:
    """x doubled while its sum is below 100: the trip count depends on the input."""

    @tf.function(input_signature=[tf.TensorSpec((1, 4), tf.float32)])
    def f(x):
        return tf.while_loop(lambda v: tf.reduce_sum(v) < 100.0, lambda v: (v * 2.0,), [x])[0]

    conv = tf.lite.TFLiteConverter.from_concrete_functions([f.get_concrete_function()], f)
    path.write_bytes(conv.convert())
    return path


def test_a_loop_whose_condition_reads_data_is_refused(tmp_path, capsys):
    path = _data_dependent_loop(tflite_models._tf(), tmp_path / "loop.tflite")
    assert "WHILE" in _ops(path)
    np.save(tmp_path / "x.npy", np.ones((1, 4), np.float32))
    assert_user_error(_run, capsys, [str(path), "-o", str(tmp_path / "out"), "--input", str(tmp_path / "x.npy")],
                      tmp_path / "out", "WHILE", "does not fold to a constant", "trip count is static")


def test_a_loop_longer_than_the_unroll_limit_is_refused(tmp_path, capsys, monkeypatch):
    import irgen.plugin

    path = _convert(tmp_path / "gru.tflite", "GRU", False, False)
    monkeypatch.setattr(irgen.plugin, "MAX_RECURRENT_STEPS", STEPS - 1, raising=False)
    assert_user_error(_run, capsys, [str(path), "-o", str(tmp_path / "out")], tmp_path / "out",
                      "WHILE_", f"more than {STEPS - 1} iterations")


# ---------------------------------------------------------------- fused recurrent ops (tf_keras' converter)


def _fused_model(path: Path, kind: str, time_major: bool = False, cifg: bool = False) -> Path:
    """A flatbuffer holding one UNIDIRECTIONAL_SEQUENCE_LSTM (``kind`` "lstm") or _RNN ("rnn")
    with seeded float weights and zero variable states, as tf_keras' converter writes them
    (Keras 3 writes a WHILE loop; no converter in this environment writes these ops).
    ``cifg``: no input gate weights (a coupled input-forget LSTM)."""
    from tensorflow.lite.python import schema_py_generated as S
    from tensorflow.lite.tools import flatbuffer_utils

    rng = np.random.default_rng(tflite_models.SEED)
    model, sg = S.ModelT(), S.SubGraphT()
    model.version, model.buffers, sg.tensors, sg.name = 3, [S.BufferT()], [], "main"

    def tensor(name, shape, data=None, variable=False) -> int:
        t, b = S.TensorT(), S.BufferT()
        t.name, t.shape, t.type, t.isVariable = name, list(shape), S.TensorType.FLOAT32, variable
        if data is not None:
            b.data = np.asarray(data, np.float32).tobytes()
        model.buffers.append(b)
        t.buffer = len(model.buffers) - 1
        sg.tensors.append(t)
        return len(sg.tensors) - 1

    seq = (STEPS, 1, FEATURES) if time_major else (1, STEPS, FEATURES)
    x = tensor("x", seq)
    h = tensor("h_state", (1, UNITS), variable=True)
    if kind == "lstm":
        gates = "fco" if cifg else "ifco"
        w = {g: tensor(f"w_{g}", (UNITS, FEATURES), rng.normal(0, .5, (UNITS, FEATURES))) for g in gates}
        r = {g: tensor(f"r_{g}", (UNITS, UNITS), rng.normal(0, .5, (UNITS, UNITS))) for g in gates}
        b = [tensor(f"b_{g}", (UNITS,), rng.normal(0, .5, (UNITS,))) for g in "ifco"]
        c = tensor("c_state", (1, UNITS), variable=True)
        inputs = [x, *(w.get(g, -1) for g in "ifco"), *(r.get(g, -1) for g in "ifco"), -1, -1, -1, *b, -1, -1, h, c,
                  -1, -1, -1, -1]
        options, code = S.UnidirectionalSequenceLSTMOptionsT(), S.BuiltinOperator.UNIDIRECTIONAL_SEQUENCE_LSTM
        op_options = S.BuiltinOptions.UnidirectionalSequenceLSTMOptions
    else:
        inputs = [x, tensor("w", (UNITS, FEATURES), rng.normal(0, .5, (UNITS, FEATURES))),
                  tensor("r", (UNITS, UNITS), rng.normal(0, .5, (UNITS, UNITS))),
                  tensor("b", (UNITS,), rng.normal(0, .5, (UNITS,))), h]
        options, code = S.SequenceRNNOptionsT(), S.BuiltinOperator.UNIDIRECTIONAL_SEQUENCE_RNN
        op_options = S.BuiltinOptions.SequenceRNNOptions
    options.fusedActivationFunction, options.timeMajor = S.ActivationFunctionType.TANH, time_major
    y = tensor("y", (STEPS, 1, UNITS) if time_major else (1, STEPS, UNITS))
    op = S.OperatorT()
    op.opcodeIndex, op.inputs, op.outputs = 0, inputs, [y]
    op.builtinOptionsType, op.builtinOptions = op_options, options
    sg.operators, sg.inputs, sg.outputs = [op], [x], [y]
    oc = S.OperatorCodeT()
    oc.builtinCode, oc.deprecatedBuiltinCode, oc.version = code, code, 1
    model.operatorCodes, model.subgraphs = [oc], [sg]
    path.write_bytes(bytes(flatbuffer_utils.convert_object_to_bytearray(model)))
    return path


@pytest.mark.parametrize("kind,time_major", [("lstm", False), pytest.param("lstm", True, marks=pytest.mark.slow),
                                             pytest.param("rnn", False, marks=pytest.mark.slow)],
                         ids=["lstm", "lstm-time-major", "rnn"])
def test_fused_sequence_op_steps_equal_the_interpreter(tmp_path, capsys, kind, time_major):
    path = _fused_model(tmp_path / f"{kind}.tflite", kind, time_major)
    shape = (STEPS, 1, FEATURES) if time_major else (1, STEPS, FEATURES)
    x = np.random.default_rng(tflite_models.SEED + 100).standard_normal(shape).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "out"
    assert _run([str(path), "-o", str(out), "--input", str(tmp_path / "x.npy")]) == 0
    ir = json.loads((out / "ir.json").read_text())
    cells = [layer for layer in ir["layers"] if layer["op"] == kind]
    node = f"UNIDIRECTIONAL_SEQUENCE_{kind.upper()}_0"
    assert [c["name"] for c in cells] == [f"{node}.forward.t{t}" for t in range(STEPS)]
    (rec,) = ir["outputs"]
    got, exp = np.load(out / rec["file"]), tflite_models.tflite_reference(path, x)[rec["name"]]
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)
    # each step's h is the output's row t
    for t, c in enumerate(cells):
        h = np.load(out / c["outputs"][0]["file"])
        np.testing.assert_allclose(h, exp[t] if time_major else exp[:, t], rtol=1e-5, atol=1e-6)
    capsys.readouterr()
    code = irgen_main(["verify", str(out), "--no-progress", "--no-report", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["passed"], r.get("problems")
    assert [row["checks"]["source"]["status"] for row in r["layers"] if row["name"] == rec["producer"]] == ["pass"]
    print(f"\nfused {kind}{' time major' if time_major else ''}: max |irgen - TFLite| = {np.abs(got - exp).max():.3g}")


def test_a_coupled_input_forget_lstm_is_refused(tmp_path, capsys):
    path = _fused_model(tmp_path / "cifg.tflite", "lstm", cifg=True)
    assert_user_error(_run, capsys, [str(path), "-o", str(tmp_path / "out")], tmp_path / "out",
                      "UNIDIRECTIONAL_SEQUENCE_LSTM_0", "input weights", "coupled input-forget")


def test_calibrating_a_recurrent_keras_model_is_refused_before_the_converter_crashes(tmp_path, capsys):
    """TF 2.21's calibrator dies with a segmentation fault on the WHILE loop (it would take irgen
    with it): ``--calibration`` on a recurrent layer is refused, naming the layer."""
    tf = tflite_models._tf()
    path = tmp_path / "gru.keras"
    _keras_model(tf, "GRU", True, False).save(path)
    cal = tmp_path / "cal"
    cal.mkdir()
    np.save(cal / "a.npy", np.zeros((1, STEPS, FEATURES), np.float32))
    assert_user_error(_run, capsys, [str(path), "-o", str(tmp_path / "out"), "--calibration", str(cal)],
                      tmp_path / "out", "'rnn' (GRU)", "WHILE loop", "without --calibration")


@pytest.mark.parametrize("body", [0, 99], ids=["main-graph", "missing"])
def test_a_loop_body_that_is_no_subgraph_it_can_run_is_refused(tmp_path, capsys, body):
    """A WHILE whose body is the main graph (it would recurse) or no subgraph at all."""
    from tensorflow.lite.tools import flatbuffer_utils

    path = _data_dependent_loop(tflite_models._tf(), tmp_path / "loop.tflite")
    model = flatbuffer_utils.read_model(str(path))
    (op,) = model.subgraphs[0].operators
    op.builtinOptions.bodySubgraphIndex = body
    flatbuffer_utils.write_model(model, str(path))
    assert_user_error(_run, capsys, [str(path), "-o", str(tmp_path / "out")], tmp_path / "out", "loop.tflite",
                      "op WHILE_0 (WHILE)", f"body subgraph {body} is not a subgraph it can run")


# ---------------------------------------------------------------- the trip count, computed before converting

_BOOL_OPS = {"LESS", "LESS_EQUAL", "GREATER", "GREATER_EQUAL", "EQUAL", "NOT_EQUAL", "LOGICAL_AND", "LOGICAL_OR",
             "LOGICAL_NOT"}


def _loop_model(path: Path, start: dict[str, int], cond: list, body: list, nxt: list[str], muls: int = 1) -> Path:
    """A WHILE over int32 counters ``start`` (name -> value at entry) and x (float32 [1, 4]).
    ``cond`` and ``body`` are operators ``(code, operands, output)`` on the counters (an operand is
    a name or an int32 constant), the condition the last ``cond`` output; ``nxt`` names each
    counter's next value. The body doubles x (``muls`` MULs, the others by 1): the loop's result
    is x * 2**trips."""
    from tensorflow.lite.python import schema_py_generated as S
    from tensorflow.lite.tools import flatbuffer_utils

    model, codes = S.ModelT(), {}
    model.version, model.buffers, model.operatorCodes, model.subgraphs = 3, [S.BufferT()], [], []

    def operator(sg, code, ins, outs, options=None):
        if code not in codes:
            oc = S.OperatorCodeT()
            oc.builtinCode = getattr(S.BuiltinOperator, code)
            oc.deprecatedBuiltinCode, oc.version = min(oc.builtinCode, 127), 1
            model.operatorCodes.append(oc)
            codes[code] = len(model.operatorCodes) - 1
        op = S.OperatorT()
        op.opcodeIndex, op.inputs, op.outputs = codes[code], list(ins), list(outs)
        if options is not None:
            op.builtinOptionsType, op.builtinOptions = options
        sg.operators.append(op)

    def graph(name):
        sg, names = S.SubGraphT(), {}
        sg.name, sg.tensors, sg.operators = name, [], []
        model.subgraphs.append(sg)

        def tensor(tname, ttype=S.TensorType.INT32, shape=(), data=None) -> int:
            t, b = S.TensorT(), S.BufferT()
            t.name, t.type, t.shape = tname, ttype, list(shape)
            if data is not None:
                b.data = np.asarray(data).tobytes()
            model.buffers.append(b)
            t.buffer = len(model.buffers) - 1
            sg.tensors.append(t)
            names[tname] = len(sg.tensors) - 1
            return names[tname]

        def operand(v) -> int:
            return names[v] if isinstance(v, str) else tensor(f"c{len(sg.tensors)}", data=np.int32(v))

        def ops(spec):
            for code, args, out in spec:
                ins = [operand(a) for a in args]
                operator(sg, code, ins, [tensor(out, S.TensorType.BOOL if code in _BOOL_OPS else S.TensorType.INT32)])

        return sg, tensor, operand, ops, names

    counters = list(start)
    main, tensor, operand, _, _ = graph("main")
    x = tensor("x", S.TensorType.FLOAT32, (1, 4))
    outs = [tensor(f"{c}_out") for c in counters] + [tensor("y", S.TensorType.FLOAT32, (1, 4))]
    options = S.WhileOptionsT()
    options.condSubgraphIndex, options.bodySubgraphIndex = 1, 2
    operator(main, "WHILE", [operand(int(start[c])) for c in counters] + [x], outs,
             (S.BuiltinOptions.WhileOptions, options))
    main.inputs, main.outputs = [x], [outs[-1]]
    for name, spec in (("cond", cond), ("body", body)):
        sg, tensor, operand, ops, names = graph(name)
        sg.inputs = [tensor(c) for c in counters] + [tensor("x", S.TensorType.FLOAT32, (1, 4))]
        ops(spec)
        if name == "cond":
            sg.outputs = [names[cond[-1][2]]]
        else:
            prev = names["x"]
            for k in range(muls):
                factor = tensor(f"f{k}", S.TensorType.FLOAT32, (), np.float32(1.0 if k else 2.0))
                operator(sg, "MUL", [prev, factor], [tensor(f"x{k + 2}", S.TensorType.FLOAT32, (1, 4))])
                prev = len(sg.tensors) - 1
            names["x2"] = prev
            sg.outputs = [names[n] for n in nxt] + [names["x2"]]
    path.write_bytes(bytes(flatbuffer_utils.convert_object_to_bytearray(model)))
    return path


def _counter(limit: int, step: int = 1) -> tuple:
    """i from 0 by ``step`` while i < ``limit``."""
    return {"i": 0}, [("LESS", ["i", limit], "go")], [("ADD", ["i", step], "i2")], ["i2"]


#: MULs a refused loop's body converts an iteration (without the count first, a loop that runs to
#: the unroll limit took 4.4 s with one, 20 s with 16)
_HEAVY = 16


#: loops whose trip count takes TFLite's integer semantics: int32 wrapping around; DIV rounding
#: toward zero, FLOOR_DIV and FLOOR_MOD toward minus infinity, on negative values (the guard n < 40
#: keeps the interpreter from running forever if irgen got a count wrong)
_COUNTED = {
    "wrap-around": ({"i": 2**31 - 3, "n": 0},
                    [("GREATER", ["i", 0], "a"), ("LESS", ["n", 40], "b"), ("LOGICAL_AND", ["a", "b"], "go")],
                    [("ADD", ["i", 1], "i2"), ("ADD", ["n", 1], "n2")], ["i2", "n2"]),
    "div-mod": ({"n": 0, "j": 1},
                [("NOT_EQUAL", ["j", 0], "a"), ("LESS", ["n", 40], "b"), ("LOGICAL_AND", ["a", "b"], "go")],
                [("MUL", ["j", -5], "a"), ("ADD", ["a", -31], "b"), ("DIV", ["b", 3], "c"), ("SUB", ["b", "c"], "d"),
                 ("FLOOR_MOD", ["d", 19], "j2"), ("ADD", ["n", 1], "n2")], ["n2", "j2"]),
    "floor-div": ({"i": -40},
                  [("FLOOR_DIV", ["i", 6], "f"), ("DIV", ["i", 6], "t"), ("NOT_EQUAL", ["f", "t"], "ne"),
                   ("LESS", ["i", 0], "neg"), ("LOGICAL_NOT", ["neg"], "pos"), ("LOGICAL_OR", ["ne", "pos"], "a"),
                   ("LESS", ["i", 30], "b"), ("LOGICAL_AND", ["a", "b"], "go")],
                  [("ADD", ["i", 7], "i2")], ["i2"]),
}


@pytest.mark.parametrize("name", sorted(_COUNTED))
def test_a_counted_loop_runs_as_often_as_in_the_interpreter(tmp_path, name):
    path = _loop_model(tmp_path / f"{name}.tflite", *_COUNTED[name])
    x = np.ones((1, 4), np.float32)
    np.save(tmp_path / "x.npy", x)
    ref = tflite_models.tflite_reference(path, x)["y"]
    trips = int(np.log2(ref[0, 0]))
    assert 3 <= trips < 40 and np.array_equal(ref, x * 2.0**trips)  # ended by the counters, not the guard
    out = tmp_path / "out"
    assert _run([str(path), "-o", str(out), "--input", str(tmp_path / "x.npy")]) == 0
    ir = json.loads((out / "ir.json").read_text())
    mul = len(_COUNTED[name][2])  # the body's MUL comes after its counter operators
    assert [layer["name"] for layer in ir["layers"]] == [f"WHILE_0.t{t}.MUL_{mul}" for t in range(trips)]
    np.testing.assert_array_equal(np.load(out / ir["outputs"][0]["file"]), ref)
    print(f"\n{name}: {trips} iterations, as the interpreter")


def _refused_at_once(capsys, path: Path, out: Path, *needles: str) -> float:
    t0 = time.perf_counter()
    assert_user_error(_run, capsys, [str(path), "-o", str(out)], out, *needles)
    seconds = time.perf_counter() - t0
    assert seconds < 10, seconds
    return seconds


@pytest.mark.parametrize("limit,step", [(10**9, 1), (10, 0)], ids=["limit-1e9", "adds-0"])
def test_a_loop_that_runs_past_the_unroll_limit_is_refused_at_once(tmp_path, capsys, limit, step):
    """Converting each iteration's body until the limit stopped it took 20 s (6 minutes for a GRU's
    body); the counters alone take microseconds an iteration."""
    from irgen.plugin import MAX_RECURRENT_STEPS

    path = _loop_model(tmp_path / "loop.tflite", *_counter(limit, step), muls=_HEAVY)
    s = _refused_at_once(capsys, path, tmp_path / "out", "op WHILE_0 (WHILE)",
                         f"more than {MAX_RECURRENT_STEPS} iterations")
    print(f"\nrefused in {s:.2f} s")


def test_one_iteration_over_the_unroll_limit_is_refused_at_once(tmp_path, capsys):
    from irgen.plugin import MAX_RECURRENT_STEPS

    path = _loop_model(tmp_path / "loop.tflite", *_counter(MAX_RECURRENT_STEPS + 1), muls=_HEAVY)
    _refused_at_once(capsys, path, tmp_path / "out", "op WHILE_0 (WHILE)",
                     f"more than {MAX_RECURRENT_STEPS} iterations")


def test_a_keras_loop_whose_time_index_never_advances_is_refused_at_once(tmp_path, capsys):
    """The GRU's loop with its limit raised to 10**9 and its time index adding 0: every iteration
    reads a valid time step, so only the unroll limit ends it (it took six minutes)."""
    from tensorflow.lite.python import schema_py_generated as S
    from tensorflow.lite.tools import flatbuffer_utils

    from irgen.plugin import MAX_RECURRENT_STEPS

    path = _convert(tmp_path / "gru.tflite", "GRU", True, False)
    model = flatbuffer_utils.read_model(str(path))
    cond, body = model.subgraphs[1], model.subgraphs[2]

    def ops(sg, name):
        return [op for op in sg.operators
                if model.operatorCodes[op.opcodeIndex].builtinCode == getattr(S.BuiltinOperator, name)]

    less = ops(cond, "LESS")[0]  # both counters' LESS read the same limit
    model.buffers[cond.tensors[less.inputs[1]].buffer].data = np.int32(10**9).tobytes()
    t, b = S.TensorT(), S.BufferT()
    t.name, t.type, t.shape, b.data = b"zero", S.TensorType.INT32, [], np.int32(0).tobytes()
    model.buffers.append(b)
    t.buffer = len(model.buffers) - 1
    body.tensors.append(t)
    index = ops(body, "GATHER")[0].inputs[1]  # the time index, and the ADD that advances it
    (add,) = [op for op in ops(body, "ADD") if op.inputs[0] == index]
    add.inputs[1] = len(body.tensors) - 1
    flatbuffer_utils.write_model(model, str(path))
    _refused_at_once(capsys, path, tmp_path / "out", "(WHILE)", f"more than {MAX_RECURRENT_STEPS} iterations")


def test_counting_that_takes_too_many_evaluations_is_refused(tmp_path, capsys, monkeypatch):
    from irgen_tensorflow import trip_count

    monkeypatch.setattr(trip_count, "MAX_EVALUATIONS", 50)
    path = _loop_model(tmp_path / "loop.tflite", *_counter(100))
    assert_user_error(_run, capsys, [str(path), "-o", str(tmp_path / "out")], tmp_path / "out", "op WHILE_0 (WHILE)",
                      "more than 50 operator evaluations", "2 an iteration")


def test_a_converted_condition_that_disagrees_with_the_count_is_refused(tmp_path, capsys, monkeypatch):
    """The conversion checks the converted condition against the count before every iteration."""
    from irgen_tensorflow import trip_count

    monkeypatch.setitem(trip_count.KERNELS, "ADD", lambda op, a, b: a + 2 * b)  # a count of 3, not 5
    path = _loop_model(tmp_path / "loop.tflite", *_counter(5))
    assert_user_error(_run, capsys, [str(path), "-o", str(tmp_path / "out")], tmp_path / "out", "op WHILE_0 (WHILE)",
                      "its converted condition continues the loop after 3 iterations", "counters give 3 iterations")


@pytest.mark.parametrize("reads,why", [("x", "'x', a FLOAT32 tensor"), ("k", "'k', which is neither a constant")],
                         ids=["a-float", "no-value"])
def test_a_condition_the_counters_cannot_give_is_refused_by_what_it_reads(tmp_path, capsys, reads, why):
    start, cond, body, nxt = _counter(5)
    cond = [("CAST", ["x"], "c"), ("LESS", ["i", "c"], "go")] if reads == "x" else cond
    path = _loop_model(tmp_path / "loop.tflite", start, cond, body, nxt)
    if reads == "k":  # a tensor no operator writes and no buffer holds
        from tensorflow.lite.python import schema_py_generated as S
        from tensorflow.lite.tools import flatbuffer_utils

        model = flatbuffer_utils.read_model(str(path))
        sg = model.subgraphs[1]
        t = S.TensorT()
        t.name, t.type, t.shape, t.buffer = b"k", S.TensorType.INT32, [], 0
        sg.tensors.append(t)
        sg.operators[0].inputs[1] = len(sg.tensors) - 1
        flatbuffer_utils.write_model(model, str(path))
    assert_user_error(_run, capsys, [str(path), "-o", str(tmp_path / "out")], tmp_path / "out", "op WHILE_0 (WHILE)",
                      "does not fold to a constant", why)


# ---------------------------------------------------------------- loop-body tensors in the source check
# (irgen_tensorflow.loop_states: the interpreter run once per iteration, the loop stopped after it)


def _body_layers(rows) -> list[dict]:
    return [row for row in rows if ".t" in row["name"] and row["name"].startswith("WHILE_")]


def test_verify_compares_every_loop_body_layer_with_the_interpreter(case, capsys):
    capsys.readouterr()
    code = irgen_main(["verify", str(case["out"]), "--no-progress", "--no-report", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["passed"], r.get("problems")
    body = _body_layers(r["layers"])
    assert len(body) >= STEPS * case["loops"]
    status = {row["name"]: row["checks"]["source"]["status"] for row in body}
    assert set(status.values()) == {"pass"}, {k: v for k, v in status.items() if v != "pass"}
    print(f"\n{case['name']}: {len(body)} loop-body layers compared with the interpreter")


def _loop_h(path: Path) -> tuple[int, str, str]:
    """The main graph's WHILE (op index), its body's h result (loop value 3 of Keras' LSTM and
    GRU loops), the model's output."""
    import tflite

    model = tflite.Model.GetRootAsModel(path.read_bytes(), 0)
    main = model.Subgraphs(0)
    for k in range(main.OperatorsLength()):
        op = main.Operators(k)
        if op.BuiltinOptionsType() == tflite.BuiltinOptions.WhileOptions:
            options = tflite.WhileOptions()
            options.Init(op.BuiltinOptions().Bytes, op.BuiltinOptions().Pos)
            body = model.Subgraphs(options.BodySubgraphIndex())
            return k, body.Tensors(body.Outputs(3)).Name().decode(), main.Tensors(main.Outputs(0)).Name().decode()
    raise AssertionError("no WHILE")


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_each_iterations_h_is_the_interpreters_output_row(tmp_path, kind):
    """The runner's per-iteration h (read from runs stopped after t + 1 iterations) is row t of the
    sequence the interpreter's own full run returns."""
    from irgen_tensorflow import interpreter_runner

    path = _convert(tmp_path / f"{kind}.tflite", kind, True, False)
    x = np.random.default_rng(tflite_models.SEED + 7).standard_normal((1, STEPS, FEATURES)).astype(np.float32)
    k, h, output = _loop_h(path)
    seq = tflite_models.tflite_reference(path, x)[output]  # the interpreter's [1, STEPS, UNITS] sequence
    assert seq.shape == (1, STEPS, UNITS)
    names = [f"{h}@WHILE_{k}.t{t}" for t in range(STEPS)]
    got = interpreter_runner(path.read_bytes(), "test")({"x": x}, names)
    assert sorted(got) == sorted(names)
    for t, name in enumerate(names):
        assert np.array_equal(got[name].reshape(UNITS), seq[0, t]), (t, got[name], seq[0, t])
    assert not np.array_equal(got[names[0]], got[names[-1]])


def test_a_loop_it_cannot_stop_is_left_out(tmp_path):
    """A loop whose condition reads data: no bound to patch, so its body tensors stay missing."""
    import tflite

    from irgen_tensorflow import interpreter_runner

    path = _data_dependent_loop(tflite_models._tf(), tmp_path / "loop.tflite")
    model = tflite.Model.GetRootAsModel(path.read_bytes(), 0)
    (op,) = [model.Subgraphs(0).Operators(i) for i in range(model.Subgraphs(0).OperatorsLength())]
    options = tflite.WhileOptions()
    options.Init(op.BuiltinOptions().Bytes, op.BuiltinOptions().Pos)
    body = model.Subgraphs(options.BodySubgraphIndex())
    names = [f"{body.Tensors(body.Outputs(j)).Name().decode()}@WHILE_0.t0" for j in range(body.OutputsLength())]
    got = interpreter_runner(path.read_bytes(), "test")({"x": np.ones((1, 4), np.float32)}, names)
    assert got == {}


@pytest.mark.slow  # 6 s; the default suite converts a recurrent .keras in test_keras_frontend
def test_the_keras_frontend_runner_gives_the_loop_body_tensors(tmp_path, capsys):
    """Two stacked LSTMs and a classifier head, through the keras frontend: the second loop's
    iterations read while the first one runs to its end."""
    tf = tflite_models._tf()
    L = tf.keras.layers
    tf.keras.utils.set_random_seed(tflite_models.SEED)
    path = tmp_path / "lstm.keras"
    tf.keras.Sequential([L.Input((STEPS, FEATURES), batch_size=1), L.LSTM(UNITS, return_sequences=True),
                         L.LSTM(UNITS), L.Dense(3, activation="softmax")]).save(path)
    out = tmp_path / "out"
    assert _run([str(path), "-o", str(out)]) == 0
    capsys.readouterr()
    code = irgen_main(["verify", str(out), "--no-progress", "--no-report", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["passed"], r.get("problems")
    body = _body_layers(r["layers"])
    assert {row["name"].split(".")[0] for row in body} == {"WHILE_1", "WHILE_2"}
    assert {row["checks"]["source"]["status"] for row in body} == {"pass"}, \
        [row["name"] for row in body if row["checks"]["source"]["status"] != "pass"]
