"""The ``npu-int8`` backend (plugins/backends/npu-int8) on a small int8 ONNX QDQ model.

The model (conv 3->10, depthwise conv, max pool, conv 10->12, global average pool,
dense 12->5) has channel counts that are not multiples of 16, so padding shows.

- ``irgen run --backend npu-int8`` then ``irgen verify`` (single, entire and the
  onnxruntime source check) pass, reading the backend's ``.bin`` files (a changed
  byte in one makes verify fail);
- every tensor's ``.bin`` and ``.hex`` decode to exactly its ``.npy`` and encoding the
  ``.npy`` gives them back byte for byte (hex written here independently, with
  Python's ``format``), for int8, int32 and float32 tensors and 8/16/32-bit words;
- the ``.npy`` files are the generic backend's arrays of the same run, transposed
  (activations NHWC, weights OHWI, dense OI, biases one per channel) and padded with
  zeros to 16 channels, the padding recorded in ``ir.json``;
- ``manifest.json`` lists every file with its sha256 (recomputed here), and every
  data file with the tensor, dtype, shape, layout and byte order of its content;
- the ``npu-int8-header`` C header compiles with ``cc``, and a program reading it
  prints the layers and physical shapes ``ir.json`` records;
- a model with a 9x9 kernel and a float dense layer is refused before anything is
  compiled, naming both layers and what they break;
- ``--npu-channel-multiple`` and ``--npu-hex-width`` change the padding and the hex words;
- ``irgen backends show npu-int8`` prints the table of ops and constraints.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from irgen.cli import main as irgen_main  # noqa: E402
from irgen.plugin import TensorInfo  # noqa: E402
from irgen_npu_int8 import formats, settings, store  # noqa: E402

SHAPE = (1, 3, 8, 8)
CHANNELS = 10  # conv1 and the depthwise conv: padded to 16
MULTIPLE = 16


def _float_model(path: Path, k3: int = 3) -> Path:
    """conv 3->10 + relu, depthwise 3x3 + relu, max pool, conv 10->12 (k3 x k3), global
    average pool, flatten, dense 12->5."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def init(name, shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    n = helper.make_node
    nodes = [
        n("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"), n("Relu", ["c1"], ["r1"], name="relu1"),
        n("Conv", ["r1", "wd", "bd"], ["c2"], pads=[1, 1, 1, 1], group=CHANNELS, name="dw"),
        n("Relu", ["c2"], ["r2"], name="relu2"),
        n("MaxPool", ["r2"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="pool1"),
        n("Conv", ["p1", "w3", "b3"], ["c3"], pads=[k3 // 2] * 4, name="conv3"),
        n("GlobalAveragePool", ["c3"], ["g"], name="gap"), n("Flatten", ["g"], ["f"], name="flat"),
        n("Gemm", ["f", "wf", "bf"], ["y"], transB=1, name="fc"),
    ]
    graph = helper.make_graph(
        nodes, "npu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])],
        [init("w1", (CHANNELS, 3, 3, 3)), init("b1", (CHANNELS,)), init("wd", (CHANNELS, 1, 3, 3)),
         init("bd", (CHANNELS,)), init("w3", (12, CHANNELS, k3, k3)), init("b3", (12,)), init("wf", (5, 12)),
         init("bf", (5,))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _quantize(src: Path, dst: Path, op_types: list[str] | None = None) -> Path:
    from irgen.testing.models import quantize_qdq

    return quantize_qdq(src, dst, op_types_to_quantize=op_types)


def _run(model: Path, out: Path, *args: str) -> int:
    return irgen_main(["run", str(model), "-o", str(out), "--no-progress", *args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The int8 model through npu-int8 (with its header serializer) and through generic, same input."""
    tmp = tmp_path_factory.mktemp("npu_int8")
    model = _quantize(_float_model(tmp / "float.onnx"), tmp / "int8.onnx")
    npu, generic = tmp / "npu", tmp / "generic"
    assert _run(model, npu, "--backend", "npu-int8", "--serializer", "npu-int8-header") == 0
    assert _run(model, generic, "--backend", "generic") == 0
    return {"model": model, "npu": npu, "generic": generic, "tmp": tmp}


def _ir(out: Path) -> dict:
    return json.loads((out / "ir.json").read_text())


def _records(ir: dict):
    """(key, record) of every tensor record, a tensor once (its first record)."""
    seen = set()
    for key in ("inputs", "outputs"):
        for rec in ir[key]:
            if rec["name"] not in seen:
                seen.add(rec["name"])
                yield rec["name"], rec
    for layer in ir["layers"]:
        for rec in [*layer["inputs"], *layer["outputs"], *layer["params"].values()]:
            if rec["name"] not in seen:
                seen.add(rec["name"])
                yield rec["name"], rec


def _files(out: Path, rec: dict) -> dict[str, Path]:
    paths = [rec["file"], *rec["storage"]["files"]]
    return {Path(p).suffix: out / p for p in paths}


# ------------------------------------------------------------------ run + verify


def test_verify_passes_reading_the_backend_files(runs, tmp_path, capsys):
    npu = runs["npu"]
    capsys.readouterr()
    assert irgen_main(["verify", str(npu), "--json", "--no-progress", "--no-report"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] and result["source"]["ran"] and len(result["layers"]) == 9, result["summary"]
    for layer in result["layers"]:  # every layer checked by the numpy recompute and against onnxruntime
        assert layer["status"] == "pass" and set(layer["checks"]) == {"single", "entire", "source"}, layer["name"]
        assert all(c["status"] == "pass" for c in layer["checks"].values()), layer["name"]
    ir = _ir(npu)
    recs = dict(_records(ir))
    assert recs and all(r["file"].endswith(".bin") and set(_files(npu, r)) == {".bin", ".hex", ".npy"}
                        for r in recs.values())
    # verify reads the .bin: changed bytes of a conv weight (manifest entry dropped) fail its layer
    bad = tmp_path / "bad"
    shutil.copytree(npu, bad)
    w = bad / "parameters" / "conv3.weight.bin"
    data = bytearray(w.read_bytes())
    data[:90] = bytes(b ^ 0x40 for b in data[:90])  # the first output channel's 3x3x10 weights
    w.write_bytes(bytes(data))
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["files"] = [f for f in manifest["files"] if f["path"] != "parameters/conv3.weight.bin"]
    (bad / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert irgen_main(["verify", str(bad), "--json", "--no-progress", "--no-report", "--mode", "single"]) == 1
    failed = {layer["name"] for layer in json.loads(capsys.readouterr().out)["layers"] if layer["status"] != "pass"}
    assert failed == {"conv3"}, failed


# ------------------------------------------------------------------ bin / hex / npy


def _hex_by_hand(arr: np.ndarray, bits: int) -> str:
    """$readmemh text written with Python's int formatting: two's complement in ``bits``."""
    if arr.dtype.kind == "f":
        arr = arr.view(f"<u{arr.dtype.itemsize}")
    return "".join(f"{int(v) & ((1 << bits) - 1):0{bits // 4}x}\n" for v in arr.reshape(-1))


def _unhex_by_hand(text: str, bits: int, dtype) -> np.ndarray:
    words = [int(line, 16) for line in text.splitlines()]
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return np.array(words, dtype=f"<u{dtype.itemsize}").view(dtype)
    return np.array([w - (1 << bits) if w >> (bits - 1) else w for w in words], dtype=np.int64).astype(dtype)


def _check_files(files: dict[str, Path], bits: int) -> np.ndarray:
    npy = np.load(files[".npy"])
    # encode: the .npy's values give the .bin's bytes and the .hex's text exactly
    assert files[".bin"].read_bytes() == npy.astype(npy.dtype.newbyteorder("<")).tobytes()
    text = files[".hex"].read_text()
    assert text == _hex_by_hand(npy, bits)
    # decode: the .bin and the .hex read back to the .npy's values
    back_bin = np.frombuffer(files[".bin"].read_bytes(), dtype=npy.dtype.newbyteorder("<")).reshape(npy.shape)
    back_hex = _unhex_by_hand(text, bits, npy.dtype).reshape(npy.shape)
    assert np.array_equal(back_bin, npy) and np.array_equal(back_hex.view(np.uint8), npy.view(np.uint8))
    assert all(len(line) == bits // 4 for line in text.splitlines())
    return npy


def test_bin_and_hex_are_the_npy_both_ways(runs):
    npu = runs["npu"]
    dtypes = set()
    for _, rec in _records(_ir(npu)):
        st = rec["storage"]
        npy = _check_files(_files(npu, rec), st["word_bits"])
        assert list(npy.shape) == st["shape"] and str(npy.dtype) == st["dtype"] == rec["dtype"]
        # the default word is 8 bits, widened to the element when it is wider
        assert st["word_bits"] == max(8, npy.dtype.itemsize * 8)
        dtypes.add(rec["dtype"])
        # read_tensor gives the logical array from each of the three files
        logical = [store.read_tensor(p, rec) for p in _files(npu, rec).values()]
        assert all(list(a.shape) == rec["shape"] and np.array_equal(a, logical[0]) for a in logical)
    assert dtypes == {"int8", "int32", "float32"}


@pytest.mark.parametrize("bits", [8, 16, 32])
def test_hex_word_widths(runs, tmp_path, bits):
    """int8 words sign-extended (-6 in 16 bits is fffa), int32 biases in 32-bit words at the least."""
    gen = runs["generic"]
    ir = _ir(gen)
    conv = next(layer for layer in ir["layers"] if layer["name"] == "conv1")
    act = conv["outputs"][0]
    cases = [
        (TensorInfo(name="w", kind="parameter", shape=(), dtype="", layout="OIHW", role="weight", op="conv2d"),
         np.load(gen / conv["params"]["weight"]["file"])),
        (TensorInfo(name="b", kind="parameter", shape=(), dtype="", role="bias", op="conv2d"),
         np.load(gen / conv["params"]["bias"]["file"])),
        (TensorInfo(name="a", kind="activation", shape=(), dtype="", layout="NCHW", op="conv2d"),
         np.load(gen / act["file"])),
        (TensorInfo(name="s", kind="activation", shape=(), dtype="", layout=None), np.array([-6, 5, -128, 127], np.int8)),
    ]
    config = settings.Settings(hex_word_bits=bits)
    for info, arr in cases:
        stored = store.store_tensor(tmp_path / info.name, arr, info, config)
        files = {p.suffix: p for p in [stored.file, *stored.extra_files]}
        want = max(bits, arr.dtype.itemsize * 8)
        assert stored.storage["word_bits"] == want == stored.extra_files[files[".hex"]]["word_bits"]
        _check_files(files, want)
        assert np.any(arr < 0)  # negative values: the sign extension is exercised
        rec = {"shape": list(arr.shape), "dtype": str(arr.dtype), "storage": stored.storage}
        for p in files.values():
            assert np.array_equal(store.read_tensor(p, rec), arr)
    assert (tmp_path / "s.hex").read_text().split() == [f"{v & ((1 << bits) - 1):0{bits // 4}x}"
                                                        for v in (-6, 5, -128, 127)]
    if bits == 16:
        assert (tmp_path / "s.hex").read_text() == "fffa\n0005\nff80\n007f\n"


def test_run_options_set_the_channel_multiple_and_word_width(runs, tmp_path, capsys):
    """--npu-channel-multiple 4 --npu-hex-width 16: ten channels padded to twelve, int8 in
    16-bit words, int32 in 32-bit ones; verify still passes (the conftest wrapper runs it).
    An invalid width is refused before the model is read."""
    out = tmp_path / "out"
    assert _run(runs["model"], out, "--backend", "npu-int8", "--npu-channel-multiple", "4", "--npu-hex-width", "16") == 0
    ir = _ir(out)
    conv1 = next(layer for layer in ir["layers"] if layer["name"] == "conv1")
    assert conv1["outputs"][0]["storage"]["shape"] == [1, 8, 8, 12]
    assert conv1["outputs"][0]["storage"]["padding"] == {"C": [0, 2]}
    assert conv1["params"]["weight"]["storage"]["shape"] == [12, 3, 3, 3]
    for _, rec in _records(ir):
        bits = {"int8": 16, "int32": 32, "float32": 32}[rec["dtype"]]
        assert rec["storage"]["word_bits"] == bits and rec["storage"]["channel_multiple"] == 4
        _check_files(_files(out, rec), bits)
    capsys.readouterr()
    assert _run(runs["model"], tmp_path / "bad", "--backend", "npu-int8", "--npu-hex-width", "12") == 2
    assert "npu-int8: hex word width 12: one of 8, 16, 32, 64 bits" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_hex_reader_refuses_words_that_are_not_sign_extended():
    with pytest.raises(Exception, match="not a sign-extended int8"):
        formats.decode_hex(b"00fa\n", np.int8, (1,), 16)
    assert formats.decode_hex(b"FFFA\n", np.int8, (1,), 16).tolist() == [-6]


# ------------------------------------------------------------------ layout and padding


def _pad(a: np.ndarray, axis: int) -> np.ndarray:
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, -a.shape[axis] % MULTIPLE)
    return np.pad(a, widths)


def test_layouts_and_zero_padding_recorded(runs):
    npu, gen = runs["npu"], runs["generic"]
    ir, gir = _ir(npu), _ir(gen)
    logical = {name: np.load(gen / rec["file"]) for name, rec in _records(gir)}
    checked = set()
    for name, rec in _records(ir):
        st, phys = rec["storage"], np.load(_files(npu, rec)[".npy"])
        ref = logical[name]
        assert rec["shape"] == list(ref.shape) and rec["dtype"] == str(ref.dtype)  # the record stays logical
        if rec["layout"] == "NCHW":
            assert st["layout"] == "NHWC" and st["padding"] == {"C": [0, -ref.shape[1] % MULTIPLE]}
            assert np.array_equal(phys, _pad(ref.transpose(0, 2, 3, 1), 3))
            assert not phys[..., ref.shape[1]:].any()
            checked.add("NCHW")
        elif rec["layout"] == "NC":
            assert st["layout"] == "NC" and np.array_equal(phys, _pad(ref, 1))
            checked.add("NC")
        elif rec["layout"] == "OIHW":
            assert st["layout"] == "OHWI" and st["padding"] == {"O": [0, -ref.shape[0] % MULTIPLE]}
            assert np.array_equal(phys, _pad(ref.transpose(0, 2, 3, 1), 0))
            assert not phys[ref.shape[0]:].any()
            checked.add("depthwise" if ref.shape[1] == 1 else "OIHW")
        elif rec["layout"] == "IO":
            assert st["layout"] == "OI" and np.array_equal(phys, _pad(ref.T, 0))
            checked.add("IO")
        elif name.endswith(".bias"):
            assert st["layout"] == "O" and np.array_equal(phys, _pad(ref.reshape(-1), 0))
            checked.add("bias")
        else:  # the float model input: no op states its layout
            assert st["layout"] is None and st["padding"] == {} and np.array_equal(phys, ref)
            checked.add("as is")
    assert checked == {"NCHW", "NC", "OIHW", "depthwise", "IO", "bias", "as is"}, checked
    # ten channels padded to sixteen, recorded on the layer's records
    conv1 = next(layer for layer in ir["layers"] if layer["name"] == "conv1")
    assert conv1["outputs"][0]["storage"]["shape"] == [1, 8, 8, 16]
    assert conv1["params"]["weight"]["storage"] == {
        **conv1["params"]["weight"]["storage"], "layout": "OHWI", "shape": [16, 3, 3, 3], "padding": {"O": [0, 6]},
        "channel_multiple": 16}
    dw = next(layer for layer in ir["layers"] if layer["op"] == "depthwise_conv2d")
    assert dw["params"]["weight"]["storage"]["shape"] == [16, 3, 3, 1]  # OHWI with I = 1


def test_channel_multiple_setting(tmp_path):
    arr = np.arange(2 * 10 * 3 * 3, dtype=np.int8).reshape(2, 10, 3, 3)
    info = TensorInfo(name="a", kind="activation", shape=arr.shape, dtype="int8", layout="NCHW", op="conv2d")
    for multiple, padded in ((8, 16), (5, 10), (1, 10), (32, 32)):
        stored = store.store_tensor(tmp_path / f"a{multiple}", arr, info, settings.Settings(channel_multiple=multiple))
        assert stored.storage["shape"] == [2, 3, 3, padded]
        rec = {"shape": list(arr.shape), "dtype": "int8", "storage": stored.storage}
        assert np.array_equal(store.read_tensor(stored.file, rec), arr)


# ------------------------------------------------------------------ manifest


def test_manifest_lists_every_file_with_its_content(runs):
    npu = runs["npu"]
    manifest = json.loads((npu / "manifest.json").read_text())
    entries = {f["path"]: f for f in manifest["files"]}
    on_disk = {p.relative_to(npu).as_posix() for p in npu.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(entries) == on_disk
    for path, f in entries.items():
        assert f["sha256"] == hashlib.sha256((npu / path).read_bytes()).hexdigest(), path
        assert f["size"] == (npu / path).stat().st_size
    n = 0
    for name, rec in _records(_ir(npu)):
        st = rec["storage"]
        for suffix, p in _files(npu, rec).items():
            f = entries[p.relative_to(npu).as_posix()]
            assert (f["tensor"], f["dtype"], f["shape"], f["layout"]) == (name, st["dtype"], st["shape"], st["layout"])
            assert f["byte_order"] == ("big" if suffix == ".hex" else "little")
            if suffix == ".hex":
                assert f["format"] == "readmemh" and f["word_bits"] == st["word_bits"]
            n += 1
    assert n == 3 * len(dict(_records(_ir(npu))))
    # the generic backend's .npy files get the same fields: their logical content
    gen = runs["generic"]
    gentries = {f["path"]: f for f in json.loads((gen / "manifest.json").read_text())["files"]}
    for name, rec in _records(_ir(gen)):
        f = gentries[rec["file"]]
        assert (f["tensor"], f["dtype"], f["shape"], f["layout"], f["byte_order"]) == \
            (name, rec["dtype"], rec["shape"], rec["layout"], "little")


# ------------------------------------------------------------------ the C header


MAIN_C = r"""
#include <stdio.h>
#include "npu_int8_layers.h"

static void tensor(const char *what, const npu_tensor_t *t) {
    printf("%s %s %s %s %lld %u", what, t->name, t->dtype, t->layout ? t->layout : "-", (long long)t->channels,
           t->rank);
    for (uint32_t d = 0; d < t->rank; ++d) printf(" %lld", (long long)t->dims[d]);
    printf(" %s %s %u\n", t->file ? t->file : "-", t->hex_file ? t->hex_file : "-", t->hex_word_bits);
}

int main(void) {
    printf("%d\n", NPU_N_LAYERS);
    for (int i = 0; i < NPU_N_LAYERS; ++i) {
        const npu_layer_t *l = &npu_layers[i];
        printf("layer %s %s %d %u %u %u %u\n", l->name, l->op_name, (int)l->op, l->kernel[0], l->kernel[1],
               l->strides[0], l->groups);
        for (uint32_t k = 0; k < l->n_outputs; ++k) tensor("out", &l->outputs[k]);
        if (l->weight) tensor("weight", l->weight);
        if (l->bias) tensor("bias", l->bias);
    }
    return 0;
}
"""


def _header_program(out: Path, tmp: Path) -> list[str]:
    """What a C program that includes OUT's npu_int8_layers.h prints (compiled with cc, warnings as errors)."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (cc)")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "main.c").write_text(MAIN_C)
    exe = tmp / "main"
    build = subprocess.run([cc, "-std=c99", "-Wall", "-Werror", "-I", str(out), "-o", str(exe), str(tmp / "main.c")],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()


def test_header_compiles_and_matches_the_ir(runs, tmp_path):
    npu = runs["npu"]
    got = _header_program(npu, tmp_path)

    def tensor(what, t):
        st = t["storage"]
        channels = -1
        if st["padding"]:
            (letter, (_, after)), = st["padding"].items()
            channels = st["shape"][st["layout"].index(letter)] - after
        hexf = next(f for f in st["files"] if f.endswith(".hex"))
        return " ".join([what, t["name"], t["dtype"], st["layout"] or "-", str(channels), str(len(st["shape"])),
                         *map(str, st["shape"]), t["file"], hexf, str(st["word_bits"])])

    ir = _ir(npu)
    want = [str(len(ir["layers"]))]
    ops = {"conv2d": 1, "depthwise_conv2d": 2, "dense": 3, "max_pool2d": 4, "global_avg_pool2d": 6, "flatten": 11,
           "quantize": 13, "dequantize": 14}
    for layer in ir["layers"]:
        a = layer["attrs"]
        kernel = [0, 0]
        if "weight" in layer["params"] and layer["op"] != "dense":
            kernel = layer["params"]["weight"]["shape"][2:]
        elif "pool_size" in a:
            kernel = a["pool_size"]
        want.append(f"layer {layer['name']} {layer['op']} {ops[layer['op']]} {kernel[0]} {kernel[1]} "
                    f"{(a.get('strides') or [0])[0]} {a.get('groups') or 0}")
        want += [tensor("out", t) for t in layer["outputs"]]
        want += [tensor(role, layer["params"][role]) for role in ("weight", "bias") if role in layer["params"]]
    assert got == want
    assert "layer conv1 conv2d 1 3 3 1 1" in got and "layer pool1 max_pool2d 4 2 2 2 0" in got


def _parse_header(out: Path) -> list[dict]:
    """The layers of OUT's header, as the compiled program reads them: name, op, output shapes."""
    layers = []
    for line in _header_program(out, out.parent / (out.name + "_cc")):
        kind, *rest = line.split()
        if kind == "layer":
            layers.append({"name": rest[0], "op": rest[1], "outputs": []})
        elif kind == "out":
            rank = int(rest[4])
            layers[-1]["outputs"].append({"shape": [int(d) for d in rest[5:5 + rank]]})
    return layers


def test_conformance(tmp_path):
    """irgen.testing's conformance checks: the backend's files read back to the generic backend's
    values on its QDQ model (and verify passes); the header, written from a generic run, parses
    back (through cc) to ir.json's layers and output shapes."""
    from irgen.testing import conformance, models

    got = conformance.check_backend("npu-int8", models.qdq_onnx(tmp_path / "q.onnx"), tmp=tmp_path / "backend")
    assert got["files"] > 10 and got["suffixes"] == [".bin"], got
    got = conformance.check_serializer("npu-int8-header", _parse_header, tmp=tmp_path / "serializer")
    assert got["layers"] > 5 and any(str(f).endswith("npu_int8_layers.h") for f in got["files"]), got


# ------------------------------------------------------------------ constraints


def test_a_model_outside_the_table_is_refused_before_compiling(runs, capsys, monkeypatch):
    import irgen.execute

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled a model the backend refuses")

    tmp = runs["tmp"]
    # conv3 has a 9x9 kernel; flatten and the dense layer stay float (Flatten and Gemm not quantized)
    model = _quantize(_float_model(tmp / "float9.onnx", k3=9), tmp / "int8_9x9.onnx",
                      op_types=["Conv", "MaxPool", "GlobalAveragePool", "Relu"])
    monkeypatch.setattr(irgen.execute, "lower", no_compile)
    out = tmp / "refused"
    capsys.readouterr()
    assert _run(model, out, "--backend", "npu-int8") == 2
    err = capsys.readouterr().err
    assert "backend 'npu-int8' cannot run 3 layer(s) of this model" in err, err
    assert "conv3 (conv2d): kernel 9x9: at most 7x7 " in err, err
    assert "flat (flatten): a float layer (float32): int8 activations only " in err, err
    assert "fc (dense): a float layer (float32): int8 activations only; weight is float32: int8 only; " \
           "bias is float32: int32 only" in err, err
    assert "Traceback" not in err and not out.exists()


# ------------------------------------------------------------------ irgen backends


def test_backends_list_and_show(capsys):
    capsys.readouterr()
    assert irgen_main(["backends"]) == 0
    listing = capsys.readouterr().out
    assert any(line.split()[:4] == ["npu-int8", "npu-int8", "any", "own"] for line in listing.splitlines()), listing
    assert irgen_main(["backends", "show", "npu-int8"]) == 0
    out = capsys.readouterr().out
    for line in ["backend npu-int8 (plugin npu-int8)", "data files: the backend's own (store_tensor",
                 "per-layer check: check_layer, before compiling"]:
        assert line in out, out
    rows = {line.split("  ")[0]: " ".join(line.split()) for line in out.splitlines()}
    assert "kernel 1x1 to 7x7, stride 1 to 2, dilation 1, groups 1" in rows["conv2d"]
    assert "channel multiplier 1" in rows["depthwise_conv2d"]
    assert "float32 input, int8 output" in rows["quantize"]
    assert irgen_main(["backends", "show", "generic"]) == 0
    assert "constraints table: none" in capsys.readouterr().out
    assert irgen_main(["backends", "show", "no-such"]) == 2
    assert "unknown backend 'no-such'" in capsys.readouterr().err
