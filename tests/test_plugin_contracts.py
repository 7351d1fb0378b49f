"""What a backend and a serializer own (issue 12): a backend's data format both ways,
and serializers that write beside the canonical ``ir.json``.

- A backend that writes raw little-endian ``.bin`` files gives ``read_tensor``; ``irgen
  verify`` reads its files with it and passes. A backend with a writer and no reader is
  refused at registration; without the plugin, or with a reader that returns the wrong
  shape, verify says which backend wrote the files instead of crashing in ``np.load``.
- ``--serializer`` is repeatable; ``ir.json`` is always written, and a serializer that
  writes over it (or over any file irgen wrote) is an error naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from irgen.cli import main as irgen_main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_cnn.onnx"

BIN_BACKEND = """
    from pathlib import Path

    import numpy as np
    import irgen_generic
    from irgen import hookimpl
    from irgen.api import Backend


    def write(stem, arr):
        path = Path(str(stem) + ".bin")
        arr = np.ascontiguousarray(arr)
        arr.astype(arr.dtype.newbyteorder("<")).tofile(path)
        return path


    def read(path, record):
        dtype = np.dtype(record["dtype"])
        return np.fromfile(path, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(record["shape"])


    def read_wrong(path, record):
        return read(path, record).ravel()


    @hookimpl
    def irgen_register_backends(register):
        register(Backend(name="bin-npu", fusion_rules=irgen_generic.RULES, write_tensor=write, read_tensor=read))
        register(Backend(name="bin-flat", fusion_rules=irgen_generic.RULES, write_tensor=write, read_tensor=read_wrong))
"""

SERIALIZERS = """
    from irgen import hookimpl
    from irgen.api import Serializer


    def csv(ir, out):
        path = out / "layers.csv"
        path.write_text("".join(f"{l['name']},{l['op']}\\n" for l in ir["layers"]))
        return [path]


    def over_ir(ir, out):
        (out / "ir.json").write_text("{}")
        return []


    def over_manifest_silently(ir, out):
        (out / "graph" / "model.relax.txt").write_text("replaced")
        return []


    @hookimpl
    def irgen_register_serializers(register):
        register(Serializer("csv", csv, "layer names and ops"))
        register(Serializer("over-ir", over_ir, "writes ir.json"))
        register(Serializer("over-graph", over_manifest_silently, "rewrites a file irgen wrote"))
"""


def _run(plugin: Path, out: Path, *args: str) -> int:
    return irgen_main(["--plugin", str(plugin), "run", str(EXAMPLE), "-o", str(out), "--no-progress", *args])


def _verify(capsys, out: Path, *plugin: str) -> tuple[int, dict | None, str]:
    capsys.readouterr()
    code = irgen_main([*plugin, "verify", str(out), "--json", "--no-progress", "--no-report"])
    cap = capsys.readouterr()
    return code, (json.loads(cap.out) if cap.out.strip() else None), cap.err


def test_backend_files_read_back_by_the_backend(tmp_path, plugin_file, capsys):
    plugin = plugin_file("bin_npu", BIN_BACKEND)
    out = tmp_path / "out"
    assert _run(plugin, out, "--backend", "bin-npu") == 0
    ir = json.loads((out / "ir.json").read_text())
    files = [t["file"] for l in ir["layers"] for t in [*l["inputs"], *l["outputs"], *l["params"].values()]]
    assert files and all(f.endswith(".bin") for f in files)
    # the raw bytes are the values irgen computed: the same run with .npy files
    ref = tmp_path / "npy"
    assert irgen_main(["run", str(EXAMPLE), "-o", str(ref), "--no-progress"]) == 0
    for rec in ir["layers"][-1]["outputs"]:
        raw = np.fromfile(out / rec["file"], dtype=np.dtype(rec["dtype"]).newbyteorder("<")).reshape(rec["shape"])
        np.testing.assert_array_equal(raw, np.load(ref / rec["file"].replace(".bin", ".npy")))
    code, result, err = _verify(capsys, out, "--plugin", str(plugin))
    assert code == 0 and result["passed"] and result["source"]["ran"], (err, result and result["problems"])
    assert result["summary"]["passed"] == len(ir["layers"])


def test_backend_that_writes_files_it_cannot_read_is_refused(tmp_path, plugin_file, capsys):
    plugin = plugin_file("writer_only", BIN_BACKEND.replace("def irgen_register_backends(register):", """\
def irgen_register_backends(register):
        register(Backend(name="bin-writer", fusion_rules=irgen_generic.RULES, write_tensor=write))"""))
    capsys.readouterr()
    assert irgen_main(["--plugin", str(plugin), "plugins"]) == 0
    err = capsys.readouterr().err
    assert "backend 'bin-writer' writes its own data files (write_tensor) but cannot read them back" in err, err


@pytest.mark.parametrize("backend,plugin_given,message", [
    ("bin-npu", False, "backend 'bin-npu', which wrote it, is not installed"),
    ("bin-flat", True, "backend 'bin-flat' read back float32["),
])
def test_backend_files_that_cannot_be_read_back_are_a_clear_error(backend, plugin_given, message, tmp_path,
                                                                  plugin_file, capsys, monkeypatch):
    import conftest
    import irgen.pipeline

    monkeypatch.setattr(irgen.pipeline, "run", conftest._run)  # no self-check: verify is what is tested
    plugin = plugin_file("bin_npu", BIN_BACKEND)
    out = tmp_path / "out"
    assert _run(plugin, out, "--backend", backend) == 0
    code, _, err = _verify(capsys, out, *(["--plugin", str(plugin)] if plugin_given else []))
    assert code == 2 and message in err and "Traceback" not in err, err


def test_serializers_repeat_and_write_beside_ir_json(tmp_path, plugin_file, capsys):
    plugin = plugin_file("sers", SERIALIZERS)
    out = tmp_path / "out"
    assert _run(plugin, out, "--serializer", "csv", "--serializer", "json") == 0
    ir = json.loads((out / "ir.json").read_text())
    assert ir["producer"]["serializers"] == ["csv", "json"]
    rows = (out / "layers.csv").read_text().splitlines()
    assert rows == [f"{l['name']},{l['op']}" for l in ir["layers"]]
    manifest = json.loads((out / "manifest.json").read_text())
    assert "layers.csv" in json.dumps(manifest)
    # only a serializer of its own: ir.json is still written, and verify reads it
    out2 = tmp_path / "csv-only"
    assert _run(plugin, out2, "--serializer", "csv") == 0
    assert (out2 / "ir.json").is_file() and (out2 / "layers.csv").is_file()
    code, result, _ = _verify(capsys, out2)
    assert code == 0 and result["passed"]


@pytest.mark.parametrize("name,what", [("over-ir", "ir.json"), ("over-graph", "graph/model.relax.txt")])
def test_serializer_that_writes_over_irgen_files_is_refused(name, what, tmp_path, plugin_file, capsys):
    plugin = plugin_file("sers", SERIALIZERS)
    out = tmp_path / "out"
    capsys.readouterr()
    assert _run(plugin, out, "--serializer", name) == 2
    err = capsys.readouterr().err
    assert f"serializer {name!r} wrote over {what}" in err, err
    assert not out.exists()  # nothing half-written


CONSTRAINED_BACKEND = """
    import irgen_generic
    from irgen import hookimpl
    from irgen.api import Backend


    MAX_KERNEL, CHANNELS, DENSE_DTYPE = 1, 16, "int8"


    def check_layer(layer):
        broken = []
        if layer["op"] == "conv2d":
            kh, kw = layer["params"]["weight"]["shape"][2:]
            if max(kh, kw) > MAX_KERNEL:
                broken.append(f"kernel {kh}x{kw}: at most {MAX_KERNEL}x{MAX_KERNEL}")
            channels = layer["outputs"][0]["shape"][1]
            if channels % CHANNELS:
                broken.append(f"{channels} output channels: a multiple of {CHANNELS}")
        if layer["op"] == "dense" and layer["inputs"][0]["dtype"] != DENSE_DTYPE:
            broken.append(f"dense on {layer['inputs'][0]['dtype']}: {DENSE_DTYPE} only")
        return broken


    @hookimpl
    def irgen_register_backends(register):
        register(Backend(name="tiny-npu", fusion_rules=irgen_generic.RULES, check_layer=check_layer))
        register(Backend(name="nhwc-npu", fusion_rules=irgen_generic.RULES, layout="NHWC"))
        register(Backend(name="broken-check", fusion_rules=irgen_generic.RULES, check_layer=lambda layer: "no"))
"""


@pytest.mark.parametrize("backend,expected", [
    ("tiny-npu", ["conv1_Conv (conv2d): kernel 3x3: at most 1x1; 8 output channels: a multiple of 16",
                  "(dense): dense on float32: int8 only"]),
    ("nhwc-npu", ["conv1_Conv (conv2d): activations in NCHW, the backend takes NHWC"]),
    ("broken-check", ["check_layer must return a list of sentences"]),
])
def test_backend_constraints_refuse_a_model_before_compiling(backend, expected, tmp_path, plugin_file, capsys,
                                                             monkeypatch):
    import irgen.execute

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled a model the backend refuses")

    monkeypatch.setattr(irgen.execute, "lower", no_compile)
    plugin = plugin_file("constrained", CONSTRAINED_BACKEND)
    out = tmp_path / "out"
    capsys.readouterr()
    assert _run(plugin, out, "--backend", backend) == 2
    err = capsys.readouterr().err
    for e in expected:
        assert e in err, err
    assert "Traceback" not in err and not out.exists()
    if backend == "tiny-npu":  # every conv2d layer of the model, at once
        assert "cannot run 5 layer(s)" in err, err
        assert err.count("at most 1x1") == 3 and err.count("output channels: a multiple of 16") == 3, err


def test_backend_constraints_that_hold_let_the_model_run(tmp_path, plugin_file):
    plugin = plugin_file("constrained", CONSTRAINED_BACKEND.replace(
        'MAX_KERNEL, CHANNELS, DENSE_DTYPE = 1, 16, "int8"', 'MAX_KERNEL, CHANNELS, DENSE_DTYPE = 3, 4, "float32"'))
    assert _run(plugin, tmp_path / "out", "--backend", "tiny-npu") == 0


DIALECT_FRONTEND = """
    from irgen import hookimpl
    from irgen.plugin import Frontend
    import irgen_onnx


    @hookimpl
    def irgen_register_frontends(register):
        # another file type whose graphs are ONNX QDQ: the schemes know it by its dialect
        register(Frontend(name="onnx-copy", suffixes=(".qonnx",), load=irgen_onnx.load_onnx,
                          runner=irgen_onnx.source_runner, quant_dialect=DIALECT))
"""


@pytest.mark.parametrize("dialect", ["onnx-qdq", None])
def test_schemes_detect_the_dialect_a_frontend_declares(dialect, tmp_path, plugin_file, capsys):
    """A frontend that is not 'onnx' but declares the 'onnx-qdq' dialect gets its int8 graphs
    realized by the qdq scheme; without a dialect no scheme claims them."""
    import shutil
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_qdq import quantized

    model = quantized("small_cnn", False, "s8", tmp_path)
    copy = shutil.copy(model, tmp_path / "model.qonnx")
    plugin = plugin_file("dialect_frontend", DIALECT_FRONTEND.replace("DIALECT", repr(dialect)))
    out = tmp_path / "out"
    capsys.readouterr()
    code = irgen_main(["--plugin", str(plugin), "run", str(copy), "-o", str(out), "--no-progress"])
    err = capsys.readouterr().err
    if dialect is None:
        assert code == 2 and not out.exists() and "Traceback" not in err, err
        return
    assert code == 0, err
    ir = json.loads((out / "ir.json").read_text())
    assert ir["producer"]["frontend"] == "onnx-copy" and ir["producer"]["quantizer"] == "qdq"
    assert any(l["quant"] and l["quant"]["scheme"] == "qdq" for l in ir["layers"])


BARE_SCHEME = """
    import irgen_qdq
    from irgen.plugin import Quantizer, hookimpl

    SCHEME = "bare-qdq"


    @hookimpl
    def irgen_register_quantizers(register):
        register(Quantizer(name=SCHEME, detect=lambda qg: False,
                           realize=lambda qg: irgen_qdq.realize(qg, scheme=SCHEME),
                           recompute={k: irgen_qdq.RECOMPUTE[k] for k in ("*", "integer")} if WITH_RECOMPUTE else {}))
"""


@pytest.mark.parametrize("with_recompute", [True, False])
def test_a_scheme_owns_its_recompute(with_recompute, tmp_path, plugin_file, capsys, monkeypatch):
    """verify asks the quantizer a layer's record names for its numpy recompute (irgen knows no
    scheme by name): a scheme that gives one (``Quantizer.recompute``) has its layers recomputed
    from their quant records; one that gives none is checked with fused_ops alone, and verify
    says which layers."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_qdq import quantized

    scheme = f"bare-qdq-{with_recompute}".lower()
    model = quantized("small_cnn", False, "s8", tmp_path)
    plugin = str(plugin_file(f"bare_{with_recompute}".lower(), BARE_SCHEME.replace("WITH_RECOMPUTE", str(with_recompute))
                             .replace('"bare-qdq"', repr(scheme))))
    out = tmp_path / "out"
    assert irgen_main(["--plugin", plugin, "run", str(model), "-o", str(out), "--quantizer", scheme,
                       "--no-progress"]) == 0
    code, result, err = _verify(capsys, out, "--plugin", plugin)
    assert code == 0 and result["passed"], (err, result and result["problems"])
    fused_only = [n for n in result["notes"] if "checked with their fused_ops alone" in n]
    if with_recompute:
        assert not fused_only, result["notes"]
    else:
        assert fused_only and f"scheme {scheme!r} registers no recompute" in fused_only[0], result["notes"]


CONV_POOL_BACKEND = """
    from irgen.plugin import Backend, FusionRule, hookimpl

    @hookimpl
    def irgen_register_backends(register):
        register(Backend(name="conv-pool", fusion_rules=[
            FusionRule("conv_pool", frozenset({"relax.nn.conv2d"}), (frozenset({"relax.nn.max_pool2d"}),)),
        ]))
"""


def test_backend_fusion_rules_apply_to_quantized_layers(tmp_path, plugin_file, capsys):
    """A backend rule conv2d -> max_pool2d merges a QDQ conv layer with the int8 max pool after
    it: one layer whose output is the pool's, whose ``quant`` is the conv's requantization with
    ``fused_after`` naming the pool's ops; verify (numpy recompute, chain, onnxruntime) passes,
    and the recompute really runs the pool after the scheme's conv arithmetic."""
    from irgen import quant
    from irgen.testing.models import qdq_onnx

    model = qdq_onnx(tmp_path / "q.onnx")
    plugin = plugin_file("convpool", CONV_POOL_BACKEND)
    out = tmp_path / "out"
    assert irgen_main(["--plugin", str(plugin), "run", str(model), "-o", str(out), "--no-progress",
                       "--backend", "conv-pool"]) == 0
    ir = json.loads((out / "ir.json").read_text())
    layers = {l["name"]: l for l in ir["layers"]}
    assert "pool1" not in layers and len(ir["layers"]) == 8  # 9 without the rule
    conv1 = layers["conv1"]
    assert conv1["op"] == "conv2d" and conv1["quant"]["kind"] == "conv2d" and conv1["quant"]["fused_after"] == 1
    assert conv1["fused_ops"][-1]["relax_op"] == "relax.nn.max_pool2d" and conv1["outputs"][0]["shape"] == [1, 8, 4, 4]
    assert "pool1" in conv1["source"]["nodes"] and conv1["attrs"]["activation"]["op"] == "clip"

    def load(rec):
        return np.load(out / rec["file"])

    params = {role: load(p) for role, p in conv1["params"].items()}
    got = quant.recompute(conv1, [load(conv1["inputs"][0])], params)
    assert np.array_equal(got, load(conv1["outputs"][0]))
    without = quant.recompute({**conv1, "quant": {k: v for k, v in conv1["quant"].items() if k != "fused_after"},
                               "fused_ops": conv1["fused_ops"][:-1], "results": [f"op:{len(conv1['fused_ops']) - 2}"]},
                              [load(conv1["inputs"][0])], params)
    assert without.shape == (1, 8, 8, 8)  # the conv alone: the pool is what fused_after adds

    code, result, err = _verify(capsys, out, "--plugin", str(plugin))
    assert code == 0, err
    assert result["passed"] and {c for row in result["layers"] for c in row["checks"]} == {"single", "entire", "source"}
    row = next(r for r in result["layers"] if r["name"] == "conv1")
    assert row["checks"]["source"]["max_lsb"] == 0 and row["checks"]["single"]["max_lsb"] == 0
