"""``irgen compare`` and ``irgen extract``: a device's dump against the golden data, and what is wrong.

Each hardware-bug signature is injected into a dump a simulated device writes
(:mod:`device_sim`: every layer computed from the device's own earlier values, so the
layers after a fault are right but differ, inherited) for real models the suite builds:
an ONNX QDQ model (``test_qdq.quantized``), a full-integer TFLite model with the generic
and the npu-int8 backend, and the float ``examples/tiny_cnn.onnx``. compare must name the
faulty layer as ``first_local`` and the right ``code``; an identical dump, a dump whose
only error is inherited (the device's model input differs) or random, and a partial dump
must get no code. The default run covers one model per backend and number kind; the whole
matrix is ``slow``. :data:`TABLE` collects signature x model -> diagnosed, printed at the end.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from device_sim import Memory, accumulator, multiplier, padded_input, requantized, write_dump  # noqa: E402
from irgen.cli import main as irgen_main  # noqa: E402
from irgen.compare import compare_dump, compare_output  # noqa: E402
from irgen.dumpmap import Physical  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TABLE: dict[tuple[str, str], bool] = {}


def _run(model: Path, out: Path, *args) -> Path:
    assert irgen_main(["run", str(model), "-o", str(out), "--no-progress", *map(str, args)]) == 0
    return out


@pytest.fixture(scope="module")
def qdq(tmp_path_factory) -> Path:
    pytest.importorskip("onnxruntime")
    from test_qdq import quantized

    d = tmp_path_factory.mktemp("qdq")
    return _run(quantized("small_cnn", True, "s8", d), d / "out")


def _tflite(tmp_path_factory, *args) -> Path:
    pytest.importorskip("tensorflow")
    import tflite_models

    d = tmp_path_factory.mktemp("tflite")
    path, x = tflite_models.export("small_cnn", d, "int8")
    np.save(d / "x.npy", x)
    return _run(path, d / "out", "--input", d / "x.npy", *args)


@pytest.fixture(scope="module")
def tfl(tmp_path_factory) -> Path:
    return _tflite(tmp_path_factory)


@pytest.fixture(scope="module")
def npu(tmp_path_factory) -> Path:
    return _tflite(tmp_path_factory, "--backend", "npu-int8")


@pytest.fixture(scope="module")
def flt(tmp_path_factory) -> Path:
    return _run(ROOT / "examples" / "tiny_cnn.onnx", tmp_path_factory.mktemp("float") / "out")


# ------------------------------------------------------------------ the faults, as a device would make them


def _memory(ctx, fn) -> Memory:
    """The output as stored (layout, padding), changed by ``fn`` in memory."""
    phys = ctx.physical().to_physical(ctx.outputs[0])
    return Memory([np.ascontiguousarray(fn(phys)).reshape(phys.shape)])


def layout(ctx):
    """The output written with its channel axis moved (NCHW <-> NHWC)."""
    letters = ctx.physical().layout or ctx.layer["outputs"][0]["layout"]
    return _memory(ctx, lambda p: p.transpose((0, 2, 3, 1) if letters == "NCHW" else (0, 3, 1, 2)))


def byte_order(ctx):
    return _memory(ctx, lambda p: p.byteswap() if p.dtype.itemsize > 1 else p.reshape(-1, 4)[:, ::-1])


def offset(ctx):
    def shift(p):
        f = p.reshape(-1).copy()
        f[1:] = f[:-1]
        return f
    return _memory(ctx, shift)


def stale(ctx):
    """Another layer's golden output of the same shape, else zeros."""
    rec = ctx.layer["outputs"][0]
    for name, other in ctx.golden.records.items():
        if name != rec["name"] and other.get("producer") not in (None, "input") and other["shape"] == rec["shape"] \
                and other["dtype"] == rec["dtype"]:
            return [ctx.golden.get(name)]
    return [np.zeros_like(ctx.outputs[0])]


def channel_padding(ctx):
    def fill(p):
        logical = ctx.outputs[0].shape[ctx.layer["outputs"][0]["layout"].index("C")]
        p = p.copy()
        p[..., logical:] = 5
        return p
    return _memory(ctx, fill)


def dense_channels(ctx):
    """npu-int8's own signature: each position's channels written without the padding."""
    def dense(p):
        c = ctx.outputs[0].shape[-1]
        flat = np.zeros(p.size, p.dtype)
        flat[:p[..., :c].size] = p[..., :c].reshape(-1)
        return flat
    return _memory(ctx, dense)


def border(ctx):
    """The convolution padded with 0 (integers: not the input zero point) or 1.0 (floats)."""
    return padded_input(ctx, 0 if ctx.inputs[0].dtype.kind in "iu" else 1.0)


def clamp(ctx):
    """Integers: the activation clamps 20 LSB below the layer's top; floats: the relu is missing."""
    if ctx.outputs[0].dtype.kind == "f":
        return [np.asarray(ctx.run(layer={**ctx.layer, "results": [f"op:{len(ctx.layer['fused_ops']) - 2}"]})[0])]
    y = ctx.outputs[0]
    return [np.clip(y, y.min(), y.max() - 20)]


def bias(ctx):
    if ctx.outputs[0].dtype.kind == "f":
        return ctx.run(params={**ctx.params, "bias": np.zeros_like(ctx.params["bias"])})
    acc = accumulator(ctx)
    b = ctx.params["bias"].astype(np.int64).reshape(multiplier(ctx, acc).shape)
    return requantized(ctx, acc=acc - b)


def shift(ctx):
    if ctx.outputs[0].dtype.kind == "f":
        return [ctx.outputs[0] * np.float32(2)]
    acc = accumulator(ctx)
    return requantized(ctx, acc=acc, mult=multiplier(ctx, acc) * 2)


def per_channel(ctx):
    acc = accumulator(ctx)
    m = multiplier(ctx, acc)
    return requantized(ctx, acc=acc, mult=np.full_like(m, m.flat[0]))


def accumulator16(ctx):
    acc = accumulator(ctx)
    return requantized(ctx, acc=np.mod(acc + (1 << 15), 1 << 16) - (1 << 15))


FAULTS = {
    "layout": layout, "byte_order": byte_order, "offset": offset, "stale": stale, "border": border, "clamp": clamp,
    "bias": bias, "shift": shift, "rounding": lambda ctx: requantized(ctx, rnd=np.floor),
    "saturation": lambda ctx: requantized(ctx, wrap=True), "zero_point": lambda ctx: requantized(ctx, zp=0),
    "per_channel": per_channel, "accumulator": accumulator16, "channel_padding": channel_padding,
}
INTEGER_ONLY = ("rounding", "saturation", "zero_point", "per_channel", "accumulator")
#: a memory fault in a padded storage also leaves data in the padding: a true second finding
ALSO = {"layout": {"channel_padding"}, "offset": {"channel_padding"}}
#: model -> (the layer faults go into, {code: another layer for that code})
TARGETS = {
    "qdq": ("c2_Conv", {"saturation": "c1_Conv"}),
    "tflite": ("CONV_2D_0", {"rounding": "CONV_2D_6"}),
    "npu-int8": ("CONV_2D_0", {"rounding": "CONV_2D_6"}),
    "float": ("left_Conv", {}),
}
#: the default run: one case per code, on models that together cover both backends and number kinds
QUICK = {"layout": "npu-int8", "byte_order": "float", "offset": "qdq", "stale": "float", "border": "qdq",
         "clamp": "float", "bias": "tflite", "shift": "qdq", "rounding": "qdq", "saturation": "npu-int8",
         "zero_point": "tflite", "per_channel": "npu-int8", "accumulator": "qdq", "channel_padding": "npu-int8"}


def _cases():
    for model in TARGETS:
        for code in FAULTS:
            if (code in INTEGER_ONLY and model == "float") or (code == "channel_padding" and model != "npu-int8"):
                continue
            marks = () if QUICK[code] == model else (pytest.mark.slow,)
            yield pytest.param(model, code, marks=marks, id=f"{code}-{model}")


def _diagnosed(result: dict, layer: str) -> list[str]:
    row = next(r for r in result["layers"] if r["name"] == layer)
    return [d["code"] for d in row["diagnosis"]]


@pytest.mark.parametrize("model,code", list(_cases()))
def test_signature_is_diagnosed(model, code, request, tmp_path):
    out = request.getfixturevalue({"qdq": "qdq", "tflite": "tfl", "npu-int8": "npu", "float": "flt"}[model])
    layer = TARGETS[model][1].get(code, TARGETS[model][0])
    write_dump(out, tmp_path / "dump", {layer: FAULTS[code]})
    result = compare_output(out, tmp_path / "dump")
    codes = _diagnosed(result, layer)
    TABLE[(code, model)] = result["first_local"] == layer and code in codes
    assert not result["passed"] and result["first_local"] == layer, [
        (r["name"], r["origin"]) for r in result["layers"] if r["status"] == "differs"]
    assert codes[:1] == [code] and set(codes[1:]) <= (ALSO.get(code, set()) if model == "npu-int8" else set()), \
        next(r["diagnosis"] for r in result["layers"] if r["name"] == layer)
    later = [r for r in result["layers"] if r["index"] > result["layers"][0]["index"] and r["name"] != layer]
    assert all(r["origin"] != "local" and not r["diagnosis"] for r in later), [r["name"] for r in later if r["diagnosis"]]


def test_npu_int8_registers_its_own_signature(npu, tmp_path):
    """The backend's signature (irgen_register_signatures) names the bug, code channel_padding."""
    write_dump(npu, tmp_path / "dump", {"CONV_2D_0": dense_channels})
    result = compare_output(npu, tmp_path / "dump")
    row = next(r for r in result["layers"] if r["name"] == "CONV_2D_0")
    assert result["first_local"] == "CONV_2D_0" and row["diagnosis"][0]["code"] == "channel_padding"
    assert "without the padding" in row["diagnosis"][0]["detail"], row["diagnosis"]


# ------------------------------------------------------------------ no false code


@pytest.mark.parametrize("fixture", ["qdq", "flt", pytest.param("npu", marks=pytest.mark.slow)])
def test_identical_inherited_random_and_partial_dumps_get_no_code(fixture, request, tmp_path):
    out = request.getfixturevalue(fixture)
    ir = json.loads((out / "ir.json").read_text())
    write_dump(out, tmp_path / "same")
    same = compare_output(out, tmp_path / "same")
    assert same["passed"] and same["first_local"] is None and not any(r["diagnosis"] for r in same["layers"])

    x = ir["inputs"][0]
    golden = np.load(out / x["file"]) if x["file"].endswith(".npy") else None
    if golden is not None:  # the device was given another input: every difference is inherited
        other = (golden[..., ::-1].copy() if golden.dtype.kind == "f" else
                 np.clip(golden.astype(int) + 3, -128, 127).astype(golden.dtype))
        write_dump(out, tmp_path / "input", inputs={x["name"]: other})
        inherited = compare_output(out, tmp_path / "input")
        assert not inherited["passed"] and inherited["first_local"] is None
        assert all(r["origin"] in (None, "inherited") and not r["diagnosis"] for r in inherited["layers"])

    target = ir["layers"][2]["name"]

    def noise(ctx):
        y = ctx.outputs[0].copy()
        rng = np.random.default_rng(1)
        at = rng.choice(y.size, min(25, y.size // 2), replace=False)
        y.flat[at] = (y.flat[at] + rng.integers(1, 40, at.size)).astype(y.dtype) if y.dtype.kind in "iu" \
            else y.flat[at] + rng.standard_normal(at.size).astype(y.dtype)
        return [y]

    write_dump(out, tmp_path / "noise", {target: noise})
    random = compare_output(out, tmp_path / "noise")
    assert random["first_local"] == target and not any(r["diagnosis"] for r in random["layers"]), [
        (r["name"], r["diagnosis"]) for r in random["layers"] if r["diagnosis"]]

    kept = {l["name"] for l in ir["layers"][::2]}
    write_dump(out, tmp_path / "partial", skip={l["name"] for l in ir["layers"]} - kept)
    partial = compare_output(out, tmp_path / "partial")
    assert partial["passed"] and partial["summary"]["missing"] == len(ir["layers"]) - len(kept)
    assert not any(r["diagnosis"] for r in partial["layers"])


def test_partial_dump_with_a_fault_recomputes_from_golden_inputs(qdq, tmp_path):
    """The layer before the faulty one is not in the dump: its golden output stands in."""
    write_dump(qdq, tmp_path / "dump", {"c2_Conv": FAULTS["rounding"]}, skip={"c1_Conv"})
    result = compare_output(qdq, tmp_path / "dump")
    assert result["first_local"] == "c2_Conv" and _diagnosed(result, "c2_Conv") == ["rounding"]


# ------------------------------------------------------------------ dumps in other forms


def test_map_reads_a_dump_in_the_devices_own_naming_and_layout(qdq, tmp_path):
    """A device writing raw big-endian... int8 NHWC files, channels padded to 16, named by layer index."""
    ir = json.loads((qdq / "ir.json").read_text())
    write_dump(qdq, tmp_path / "sim", {"c2_Conv": FAULTS["shift"]})
    dev = tmp_path / "device"
    (dev / "dumps").mkdir(parents=True)
    for i, layer in enumerate(ir["layers"]):
        rec = layer["outputs"][0]
        value = np.load(tmp_path / "sim" / rec["file"])
        if rec.get("layout") == "NCHW":
            value = Physical("NCHW", "NHWC", (("C", 0, -rec["shape"][1] % 16),)).to_physical(value)
        value.astype(value.dtype.newbyteorder(">")).tofile(dev / "dumps" / f"{i:03d}_{layer['name'].replace('/', '_')}.raw")
    mapping = tmp_path / "device.yaml"
    mapping.write_text("files: 'dumps/{index:03d}_{layer}.raw'\n"
                       "defaults: {format: raw, layout: NHWC, byte_order: big, channel_multiple: 16}\n"
                       "tensors:\n"
                       f"  {ir['layers'][-1]['name']}: {{layout: NC, channel_multiple: 1}}\n"
                       f"  {ir['layers'][-2]['name']}: {{layout: NC, channel_multiple: 1}}\n"
                       f"  {ir['layers'][-4]['name']}: {{layout: NC, channel_multiple: 1}}\n"
                       f"  {ir['layers'][-3]['name']}: {{layout: NC, channel_multiple: 1}}\n")
    result = compare_output(qdq, dev, mapping=mapping)
    assert result["first_local"] == "c2_Conv" and _diagnosed(result, "c2_Conv") == ["shift"], result["notes"]
    assert result["summary"]["missing"] == 0, [(r["name"], r["outputs"][0]["message"]) for r in result["layers"]
                                               if r["status"] == "missing"]


def test_npu_int8_dump_is_read_by_the_backends_reader(npu, tmp_path):
    """The .bin files of an npu-int8 dump, NHWC and padded, and its .hex through --map."""
    ir = json.loads((npu / "ir.json").read_text())
    write_dump(npu, tmp_path / "dump")
    assert compare_output(npu, tmp_path / "dump")["passed"]
    target = ir["layers"][0]
    write_dump(npu, tmp_path / "dump", {target["name"]: FAULTS["channel_padding"]})
    hexes = tmp_path / "hexes"
    shutil.copytree(npu, hexes)  # the OUT's own .hex files, one of them the faulty device's
    rec = target["outputs"][0]
    hex_file = rec["storage"]["files"][0]
    from irgen_npu_int8 import formats

    phys = np.fromfile(tmp_path / "dump" / rec["file"], np.int8).reshape(rec["storage"]["shape"])
    formats.write_hex(hexes / hex_file, phys, 8)
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"tensors": {rec["name"]: {"file": hex_file, "format": "npu-int8", "layout": "NHWC",
                                                             "channel_multiple": 16}}}))
    result = compare_output(npu, hexes, mapping=mapping)
    assert result["first_local"] == target["name"] and _diagnosed(result, target["name"]) == ["channel_padding"]


# ------------------------------------------------------------------ the command


def test_cli_exit_codes_json_report_and_extract(qdq, tmp_path, capsys):
    write_dump(qdq, tmp_path / "same")
    assert irgen_main(["compare", str(qdq), str(tmp_path / "same"), "--no-progress"]) == 0
    assert (tmp_path / "same.compare.html").is_file()
    write_dump(qdq, tmp_path / "dump", {"c2_Conv": FAULTS["zero_point"]})
    capsys.readouterr()
    code = irgen_main(["compare", str(qdq), str(tmp_path / "dump"), "--json", "--no-progress", "--report",
                       str(tmp_path / "r.html"), "--extract-failing", str(tmp_path / "vector"), "--tile", "4x4"])
    result = json.loads(capsys.readouterr().out)
    assert code == 1 and result["passed"] is False and result["first_local"] == "c2_Conv"
    row = next(r for r in result["layers"] if r["name"] == "c2_Conv")
    assert {"name", "status", "mismatches", "max_lsb", "origin", "diagnosis"} <= set(row)
    assert row["status"] == "differs" and row["origin"] == "local" and row["diagnosis"][0]["code"] == "zero_point"
    assert row["where"]["tiles"]["size"] == [4, 4] and row["where"]["channels"]["count"] >= 1
    html = (tmp_path / "r.html").read_text()
    assert 'id="diagnosis"' in html and "zero_point" in html and 'id="heat-' in html
    vector = json.loads((tmp_path / "vector" / "ir.json").read_text())
    assert [l["name"] for l in vector["layers"]] == ["c2_Conv"]
    assert irgen_main(["verify", str(tmp_path / "vector"), "--mode", "single", "--no-report", "--no-progress"]) == 0
    device = list((tmp_path / "vector" / "device").iterdir())
    assert len(device) == 1 and not np.array_equal(np.load(device[0]), np.load(tmp_path / "vector" / vector["outputs"][0]["file"]))
    capsys.readouterr()
    assert irgen_main(["compare", str(qdq), str(tmp_path / "nowhere"), "--no-progress"]) == 2
    assert capsys.readouterr().err.startswith("irgen: error: ")


def test_extract_writes_a_self_contained_vector_with_the_c_header(npu, tmp_path):
    ir = json.loads((npu / "ir.json").read_text())
    name = ir["layers"][0]["name"]
    assert irgen_main(["run", str(Path(ir["model"]["path"])), "-o", str(tmp_path / "out"), "--no-progress",
                       "--backend", "npu-int8", "--serializer", "npu-int8-header", "--input",
                       str(npu.parent / "x.npy")]) == 0
    assert irgen_main(["extract", str(tmp_path / "out"), "--layer", name, "-o", str(tmp_path / "vec")]) == 0
    vec = tmp_path / "vec"
    assert (vec / "npu_int8_layers.h").is_file() and "NPU_N_LAYERS 1" in (vec / "npu_int8_layers.h").read_text()
    rec = json.loads((vec / "ir.json").read_text())["layers"][0]
    for r in [*rec["inputs"], *rec["outputs"], *rec["params"].values()]:
        assert (vec / r["file"]).is_file() and all((vec / f).is_file() for f in r["storage"]["files"])
    assert irgen_main(["verify", str(vec), "--mode", "single", "--no-report", "--no-progress"]) == 0
    assert irgen_main(["extract", str(tmp_path / "out"), "--layer", "nope", "-o", str(tmp_path / "v2")]) == 2


def test_dump_paths_are_confined(qdq, tmp_path, capsys):
    write_dump(qdq, tmp_path / "dump")
    outside = tmp_path / "secret.npy"
    np.save(outside, np.zeros(3))
    mapping = tmp_path / "map.yaml"
    mapping.write_text("tensors:\n  c2_Conv: {file: ../secret.npy}\n")
    assert irgen_main(["compare", str(qdq), str(tmp_path / "dump"), "--map", str(mapping), "--no-progress",
                       "--no-report"]) == 2
    assert "points outside the dump folder" in capsys.readouterr().err
    link = tmp_path / "dump" / json.loads((qdq / "ir.json").read_text())["layers"][1]["outputs"][0]["file"]
    link.unlink()
    link.symlink_to(outside)
    assert irgen_main(["compare", str(qdq), str(tmp_path / "dump"), "--no-progress", "--no-report"]) == 2
    mapping.write_text("tensors: {c2_Conv: {file: x.raw, dtype: object}}\n")
    assert irgen_main(["compare", str(qdq), str(tmp_path / "dump"), "--map", str(mapping), "--no-progress"]) == 2
    assert "not a numeric dtype" in capsys.readouterr().err


def test_plugin_signature_and_reader(qdq, tmp_path, plugin_file):
    """irgen_register_signatures and irgen_register_dump_readers: a third-party signature runs
    before the core's, and a reader named in --map reads the dump."""
    path = plugin_file("acme_compare", '''
        import numpy as np
        from irgen.plugin import DumpReader, Signature, hookimpl

        def inverted(m):
            return "every bit inverted" if m.explains(~m.to_physical(m.expected)) else None

        def read(path, record):
            return np.frombuffer(path.read_bytes()[4:], np.int8).reshape(record["storage"]["shape"])

        @hookimpl
        def irgen_register_signatures(register):
            register(Signature(name="acme-inverted", code="stale", check=inverted))

        @hookimpl
        def irgen_register_dump_readers(register):
            register(DumpReader(name="acme", read=read))
    ''')
    from irgen.plugins import PluginHost

    host = PluginHost().load(extra=[str(path)])
    write_dump(qdq, tmp_path / "dump", {"c2_Conv": lambda ctx: [~ctx.outputs[0]]})
    rec = next(l for l in json.loads((qdq / "ir.json").read_text())["layers"] if l["name"] == "c2_Conv")["outputs"][0]
    value = np.load(tmp_path / "dump" / rec["file"])
    (tmp_path / "dump" / "c2.acme").write_bytes(b"ACME" + value.tobytes())
    (tmp_path / "map.yaml").write_text("tensors:\n  c2_Conv: {file: c2.acme, format: acme}\n")
    result = compare_output(qdq, tmp_path / "dump", mapping=tmp_path / "map.yaml", host=host)
    row = next(r for r in result["layers"] if r["name"] == "c2_Conv")
    assert result["first_local"] == "c2_Conv" and row["diagnosis"] == [{"code": "stale", "detail": "every bit inverted"}]
    assert row["outputs"][0]["file"] == "c2.acme"


@pytest.mark.slow
def test_samples_compare_one_by_one_and_another_samples_output_is_stale(tmp_path):
    d = tmp_path
    (d / "in").mkdir()
    for k in range(3):
        np.save(d / "in" / f"s{k}.npy", np.random.default_rng(k).standard_normal((1, 3, 32, 32)).astype(np.float32))
    out = _run(ROOT / "examples" / "tiny_cnn.onnx", d / "out", "--inputs", d / "in")
    samples = sorted(p.name for p in out.iterdir() if (p / "ir.json").is_file())
    for s in samples:
        write_dump(out / s, d / "dump" / s)
    other = np.load(out / samples[0] / json.loads((out / samples[0] / "ir.json").read_text())["layers"][2]["outputs"][0]["file"])
    write_dump(out / samples[1], d / "dump" / samples[1], {"left_Conv": lambda ctx: [other]})
    result = compare_dump(out, d / "dump")
    assert not result["passed"] and result["first_local"] == {"sample": samples[1], "layer": "left_Conv"}
    assert result["samples"][samples[0]]["passed"] and result["samples"][samples[2]]["passed"]
    row = next(r for r in result["samples"][samples[1]]["layers"] if r["name"] == "left_Conv")
    assert row["diagnosis"][0]["code"] == "stale" and samples[0] in row["diagnosis"][0]["detail"]


def test_zz_print_the_table(capsys):
    """signature x model -> diagnosed, for the cases this run covered (the slow ones with -m slow)."""
    if not TABLE:
        pytest.skip("no signature case ran")
    models = list(TARGETS)
    lines = ["signature        " + "  ".join(f"{m:>9}" for m in models)]
    for code in FAULTS:
        cells = [("yes" if TABLE[(code, m)] else "NO") if (code, m) in TABLE else "-" for m in models]
        lines.append(f"{code:<16} " + "  ".join(f"{c:>9}" for c in cells))
    with capsys.disabled():
        print("\n" + "\n".join(lines))
