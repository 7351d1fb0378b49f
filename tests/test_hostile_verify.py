"""Hostile output folders given to ``irgen verify`` and ``irgen inspect``.

An output folder is untrusted: anyone may have edited its ``ir.json``,
``manifest.json`` and data files. One real folder is generated per module and
copied for each case, then mutated. Each case asserts, on the real command in a
child process:

- malformed input: exit 2 and one ``irgen: error:`` line naming the file and
  the JSON path of the bad field (or the bad file), no traceback;
- a path out of OUT (``../``, absolute, a symbolic link): never opened; verify
  reports it and FAILs (exit 1), inspect refuses (exit 2); a watched
  :class:`hostile.Sentinel` folder beside OUT sees no access;
- nothing runs from the folder: a pickled model or a ``--model-class`` named by
  ``manifest.json`` is not loaded without ``--allow-pickle`` on the verify
  command line (the payload's marker file must not appear).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from hostile import ENV, Sentinel, assert_refused, irgen, payload_pickle

pytest.importorskip("onnx")
# the cases write invalid ir.json files on purpose: not checked against the IR schema (tests/conftest.py)
pytestmark = pytest.mark.corrupts_ir

TESTS = Path(__file__).parent
EXAMPLE = TESTS.parent / "examples" / "tiny_cnn.onnx"
SECRET = "../outside/secret.txt"  # from OUT: the sentinel's file


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    """One finished output folder of the 10-layer example model."""
    out = tmp_path_factory.mktemp("golden") / "out"
    proc = irgen("run", EXAMPLE, "-o", out, "--no-progress")
    assert proc.returncode == 0, proc.stderr
    return out


class Case:
    """A copy of the golden folder at ``root/out`` beside a watched ``root/outside``."""

    def __init__(self, golden: Path, root: Path):
        self.golden, self.root = golden, root
        self.out = root / "out"
        shutil.copytree(golden, self.out, symlinks=True)
        self.sentinel = Sentinel(root / "outside")

    def ir(self) -> dict:
        return json.loads((self.out / "ir.json").read_text())

    def manifest(self) -> dict:
        return json.loads((self.out / "manifest.json").read_text())

    def write(self, name: str, doc) -> None:
        (self.out / name).write_text(json.dumps(doc))

    def run(self, *argv, timeout: int = 120, **kw):
        """``irgen ARGV`` with the sentinel watched; asserts it saw nothing."""
        with self.sentinel as s:
            proc = irgen(*argv, timeout=timeout, **kw)
            s.assert_untouched()
        assert self.sentinel.secret.read_text().startswith("sentinel:")
        return proc

    def verify(self, *argv, **kw):
        return self.run("verify", self.out, "--no-progress", "--no-report", *argv, **kw)

    def inspect(self, *argv, **kw):
        return self.run("inspect", self.out, *argv, **kw)


@pytest.fixture
def case(golden, tmp_path) -> Case:
    return Case(golden, tmp_path)


def _reseal(out: Path, *names: str) -> None:
    """Record the current size and sha256 of ``names`` in manifest.json (an attacker
    edits both; the manifest only proves the files are the ones it lists)."""
    manifest = json.loads((out / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["path"] in names:
            data = (out / entry["path"]).read_bytes()
            entry["size"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest))


def _no_traceback(proc) -> None:
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr


def _failed(proc, *needles: str) -> str:
    """verify's FAIL: exit 1, the table's verdict, each needle in the output, no error line."""
    _no_traceback(proc)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "irgen: error" not in proc.stderr, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("FAIL: "), proc.stdout
    for n in needles:
        assert n in proc.stdout, (n, proc.stdout)
    return proc.stdout


# ------------------------------------------------------------------ malformed ir.json


def _ir_layer3(field, value):
    def edit(ir):
        if value is _DELETE:
            del ir["layers"][3][field]
        else:
            ir["layers"][3][field] = value
        return ir
    return edit


_DELETE = object()


def _set(path: list, value):
    def edit(ir):
        obj = ir
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value
        return ir
    return edit


IR_CASES = {
    # id: (new ir.json: bytes, or a function of the parsed one; what the error line names)
    "invalid_json": (b'{"layers": [', ["ir.json", "not valid JSON"]),
    "not_utf8": (b'{"layers": ["\xff\xfe"]}', ["ir.json", "not UTF-8"]),
    "huge_integer": (b'{"layers": [' + b"9" * 5000 + b"]}", ["ir.json", "not valid JSON"]),
    "nested_deeply": (b"[" * 100_000 + b"]" * 100_000, ["ir.json", "nested too deeply"]),
    "not_an_object": (b"[1, 2]", ["ir.json", "expected a JSON object"]),
    "no_layers": (b'{"inputs": []}', ["ir.json", "layers: missing"]),
    "layers_not_a_list": (_set(["layers"], {"a": 1}), ["ir.json: layers: expected a list"]),
    "layer_not_an_object": (_set(["layers", 3], "conv"), ["ir.json: layers[3]: expected an object"]),
    "layer_without_name": (_ir_layer3("name", _DELETE), ["ir.json: layers[3].name: expected a non-empty string"]),
    "layer_without_op": (_ir_layer3("op", _DELETE), ["ir.json: layers[3].op: expected a string"]),
    "duplicate_layer_name": (lambda ir: _set(["layers", 3, "name"], ir["layers"][2]["name"])(ir),
                             ["ir.json: layers[3].name:", "layers[2]"]),
    "outputs_not_a_list": (_ir_layer3("outputs", {"0": 1}), ["ir.json: layers[3].outputs: expected a list"]),
    "no_outputs": (_ir_layer3("outputs", []), ["ir.json: layers[3].outputs: expected at least one"]),
    "record_not_an_object": (_set(["layers", 3, "outputs", 0], "y.npy"),
                             ["ir.json: layers[3].outputs[0]: expected an object"]),
    "record_file_a_number": (_set(["layers", 0, "params", "weight", "file"], 7),
                             ["ir.json: layers[0].params.weight.file: expected a string"]),
    "shape_of_strings": (_set(["layers", 3, "outputs", 0, "shape"], [1, "8", 4]),
                         ["ir.json: layers[3].outputs[0].shape: expected a list of non-negative integers"]),
    "shape_negative": (_set(["inputs", 0, "shape"], [1, -3, 32, 32]),
                       ["ir.json: inputs[0].shape: expected a list of non-negative integers"]),
    "shape_a_number": (_set(["layers", 1, "inputs", 0, "shape"], 12),
                       ["ir.json: layers[1].inputs[0].shape: expected a list"]),
    "params_a_list": (_ir_layer3("params", [1]), ["ir.json: layers[3].params: expected an object"]),
    "quant_a_string": (_ir_layer3("quant", "int8"), ["ir.json: layers[3].quant: expected an object"]),
    "source_outputs_numbers": (_set(["layers", 3, "source", "outputs"], [1]),
                               ["ir.json: layers[3].source.outputs[0]: expected a string"]),
    "producer_a_list": (_set(["producer"], ["onnx"]), ["ir.json: producer: expected an object"]),
}


@pytest.mark.parametrize("name", sorted(IR_CASES))
def test_malformed_ir_json(case, name):
    new, needles = IR_CASES[name]
    data = new if isinstance(new, bytes) else json.dumps(new(case.ir())).encode()
    (case.out / "ir.json").write_bytes(data)
    for proc in (case.verify(), case.inspect("--json")):
        assert_refused(proc, None, *needles)


# ------------------------------------------------------------------ malformed manifest.json


def _files(i, key, value):
    def edit(m):
        m["files"][i][key] = value
        return m
    return edit


MANIFEST_CASES = {
    "invalid_json": (b"{", ["manifest.json", "not valid JSON"]),
    "not_an_object": (b'"files"', ["manifest.json", "expected a JSON object"]),
    "no_files": (lambda m: {k: v for k, v in m.items() if k != "files"}, ["manifest.json: files: missing"]),
    "files_not_a_list": (_set(["files"], "ir.json"), ["manifest.json: files: expected a list"]),
    "entry_not_an_object": (_set(["files", 2], "ir.json"), ["manifest.json: files[2]: expected an object"]),
    "size_a_string": (_files(1, "size", "12"), ["manifest.json: files[1].size: expected a non-negative integer"]),
    "size_negative": (_files(1, "size", -1), ["manifest.json: files[1].size"]),
    "sha256_a_number": (_files(0, "sha256", 1234), ["manifest.json: files[0].sha256: expected a string"]),
    "path_a_list": (_files(0, "path", ["ir.json"]), ["manifest.json: files[0].path: expected a string"]),
    "allow_pickle_a_string": (_set(["frontend_options"], {"allow_pickle": "yes"}),
                              ["manifest.json: frontend_options.allow_pickle: expected true or false"]),
    "input_shapes_strings": (_set(["frontend_options"], {"input_shapes": {"x": "1,3,32,32"}}),
                             ["manifest.json: frontend_options.input_shapes.x: expected a list"]),
}


@pytest.mark.parametrize("name", sorted(MANIFEST_CASES))
def test_malformed_manifest_json(case, name):
    new, needles = MANIFEST_CASES[name]
    data = new if isinstance(new, bytes) else json.dumps(new(case.manifest())).encode()
    (case.out / "manifest.json").write_bytes(data)
    assert_refused(case.verify(), None, *needles)
    assert case.inspect().returncode == 0  # inspect does not read the manifest


# ------------------------------------------------------------------ paths out of OUT


def test_manifest_paths_out_of_out_are_reported_never_opened(case):
    """``../``, absolute and symbolic-link entries: problems in the table (FAIL), and the
    sentinel folder the entries point at sees no open, read or stat-and-hash."""
    m = case.manifest()
    (case.out / "activations" / "link.npy").symlink_to(case.sentinel.secret)
    m["files"] += [{"path": SECRET, "size": 38, "sha256": "0" * 64},
                   {"path": str(case.sentinel.secret), "size": 38, "sha256": "0" * 64},
                   {"path": "activations/../../outside/secret.txt", "size": 38, "sha256": "0" * 64},
                   {"path": "activations/link.npy", "size": 38, "sha256": "0" * 64}]
    case.write("manifest.json", m)
    stdout = _failed(case.verify("--mode", "single"), f"manifest.json: files[{len(m['files']) - 4}].path")
    assert stdout.count(": points outside the output folder") == 3, stdout
    assert "a link that points outside the output folder" in stdout


def test_ir_paths_out_of_out(case):
    """A tensor record's ``file`` out of OUT: verify fails that layer and never opens the
    file; inspect refuses the folder (it would have added the file's size)."""
    ir = case.ir()
    victim = ir["layers"][3]
    out_name = victim["outputs"][0]["name"]
    for layer in ir["layers"]:  # the producer's output record and its consumers' input records
        for rec in layer["inputs"] + layer["outputs"]:
            if rec["name"] == out_name:
                rec["file"] = SECRET
    ir["layers"][0]["params"]["weight"]["file"] = str(case.sentinel.secret)
    case.write("ir.json", ir)
    _reseal(case.out, "ir.json")
    stdout = _failed(case.verify("--mode", "single", "--mode", "entire"),
                     f"layers[3].outputs[0].file '{SECRET}': points outside the output folder",
                     "layers[0].params.weight.file")
    failing = {line.split()[0] for line in stdout.splitlines() if line.endswith("FAIL")}
    consumers = {l["name"] for l in ir["layers"] if any(r["name"] == out_name for r in l["inputs"])}
    assert failing == {ir["layers"][0]["name"], victim["name"]} | consumers, stdout
    for proc in (case.inspect(), case.inspect("--json")):
        assert_refused(proc, None, "ir.json", "points outside the output folder")


def test_symlinked_files_out_of_out(case):
    """An activation file and ir.json itself replaced by links to a file outside OUT."""
    ir = case.ir()
    act = case.out / ir["layers"][2]["outputs"][0]["file"]
    act.unlink()
    act.symlink_to(case.sentinel.secret)
    _failed(case.verify("--mode", "single"), "a link that points outside the output folder")
    assert_refused(case.inspect(), None, "a link that points outside the output folder")
    (case.out / "ir.json").unlink()
    (case.out / "ir.json").symlink_to(case.sentinel.secret)
    for proc in (case.verify(), case.inspect()):
        assert_refused(proc, None, "ir.json", "a link that points outside the output folder")


def test_model_input_file_out_of_out(case):
    """The model input's record points out of OUT: the chained and source checks cannot
    run (noted), verify fails, the file is never read."""
    ir = case.ir()
    for rec in [ir["inputs"][0]] + [r for l in ir["layers"] for r in l["inputs"] if r["name"] == ir["inputs"][0]["name"]]:
        rec["file"] = SECRET
    case.write("ir.json", ir)
    _reseal(case.out, "ir.json")
    proc = case.verify()
    _failed(proc, "inputs[0].file")
    assert "entire check skipped" in proc.stderr and "source check skipped" in proc.stderr, proc.stderr


def test_control_characters_in_names_do_not_reach_the_terminal(case):
    """A layer name and op with an escape sequence and a newline: shown escaped in both tables."""
    ir = case.ir()
    ir["layers"][0]["name"] = "evil\x1b[2J\nname"
    ir["layers"][1]["op"] = "op\x07\r"
    case.write("ir.json", ir)
    for proc in (case.verify("--mode", "single"), case.inspect()):
        _no_traceback(proc)
        assert "\x1b" not in proc.stdout and "\x07" not in proc.stdout and "\r" not in proc.stdout, proc.stdout
        assert "evil\\x1b[2J\\nname" in proc.stdout and "op\\x07\\r" in proc.stdout, proc.stdout


# ------------------------------------------------------------------ hostile data files


def _npy_header(shape, descr="<f4") -> bytes:
    header = repr({"descr": descr, "fortran_order": False, "shape": tuple(shape)}).encode()
    header += b" " * (63 - (len(header) + 10) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header


def test_hostile_npy_files(case):
    """Pickles, a huge header, truncation, a non-numeric dtype: one error line naming the
    tensor and the file, the payload never runs."""
    ir = case.ir()
    rec = ir["layers"][4]["outputs"][0]
    path = case.out / rec["file"]
    marker = case.root / "marker"
    objects = np.empty(2, dtype=object)
    objects[0] = payload_pickle(marker)
    corpus = {
        "pickle": (payload_pickle(marker), "not a plain .npy array"),
        "object_array": (None, "holds Python objects"),
        "huge_header": (_npy_header([1 << 20, 1 << 20, 1 << 10]), "over the limit"),
        "truncated": (path.read_bytes()[:-7], "truncated"),
        "strings": (_npy_header([2], "<U3") + "abcdef".encode("utf-32-le"), "not a numeric tensor"),
        "empty": (b"", "not a plain .npy array"),
    }
    for kind, (data, needle) in corpus.items():
        if data is None:
            with open(path, "wb") as f:
                np.save(f, objects, allow_pickle=True)
        else:
            path.write_bytes(data)
        assert_refused(case.verify("--mode", "single"), None, rec["name"], rec["file"], needle)
        assert not marker.exists(), kind
    # a plain file over --max-tensor-bytes
    shutil.copy(case.golden / rec["file"], path)
    assert_refused(case.verify("--mode", "single", "--max-tensor-bytes", "1K"), None, "tensor 'x' (ir.json: ",
                   "over the limit of 1.0 KiB", "--max-tensor-bytes")


def test_fifo_and_symlink_loop_do_not_block(case):
    """An activation file that is a FIFO (opening it for reading would wait for a writer
    forever) or a symbolic-link loop: one error line, at once."""
    ir = case.ir()
    rec = ir["layers"][1]["outputs"][0]
    path = case.out / rec["file"]
    path.unlink()
    os.mkfifo(path)
    assert_refused(case.verify("--mode", "single", timeout=60), None, rec["file"], "a FIFO")
    assert_refused(case.inspect(timeout=60), None, rec["file"], "not a regular file")
    path.unlink()
    path.symlink_to(path.name)  # a link to itself
    assert_refused(case.verify("--mode", "single", timeout=60), None, rec["file"], "symbolic links")
    # manifest.json a FIFO
    (case.out / "manifest.json").unlink()
    os.mkfifo(case.out / "manifest.json")
    assert_refused(case.verify("--mode", "single", timeout=60), None, "manifest.json", "a FIFO")


@pytest.mark.parametrize("what", ["missing", "a_file", "symlink_loop", "dangling_link", "ir_json_a_folder"])
def test_out_itself(tmp_path, golden, what):
    out = tmp_path / "out"
    if what == "a_file":
        out.write_text("not a folder")
    elif what == "symlink_loop":
        out.symlink_to(out.name)
    elif what == "dangling_link":
        out.symlink_to(tmp_path / "nowhere")
    elif what == "ir_json_a_folder":
        shutil.copytree(golden, out)
        (out / "ir.json").unlink()
        (out / "ir.json").mkdir()
    needle = {"missing": "no ir.json", "a_file": "not a folder", "symlink_loop": "symbolic links",
              "dangling_link": "a symbolic link to nothing", "ir_json_a_folder": "a folder, not a regular file"}[what]
    for cmd in ("verify", "inspect"):
        proc = irgen(cmd, out, *(["--no-progress"] if cmd == "verify" else []), timeout=60)
        assert_refused(proc, None, str(out), needle)
    assert not list(tmp_path.glob("*.report.html"))


# ------------------------------------------------------------------ the HTML report


def test_default_report_replaces_a_planted_link(case):
    """``OUT.report.html`` planted as a link to a file elsewhere: the report replaces the
    link (a new file, renamed over it), the link's target is never written."""
    report = case.root / "out.report.html"
    report.symlink_to(case.sentinel.secret)
    proc = case.run("verify", case.out, "--no-progress", "--mode", "single")
    _no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    assert not report.is_symlink() and report.read_text().startswith("<!DOCTYPE html>")
    assert not [p for p in case.root.iterdir() if p.name.endswith(".tmp")]
    # a report path that cannot be written: one error line
    proc = case.run("verify", case.out, "--no-progress", "--mode", "single", "--report", case.root / "no" / "r.html")
    assert_refused(proc, None, "cannot write the report", "r.html")


# ------------------------------------------------------------------ nothing runs from OUT


@pytest.fixture(scope="module")
def pth_golden(tmp_path_factory) -> tuple[Path, Path]:
    """(model, OUT) of a .pth state dict with --model-class (recorded in manifest.json)."""
    pytest.importorskip("torch")
    d = tmp_path_factory.mktemp("pth")
    code = (f"import sys, torch; sys.path.insert(0, {str(TESTS)!r}); import torch_classes; torch.manual_seed(0); "
            f"torch.save(torch_classes.Net(width=6).state_dict(), {str(d / 'net.pth')!r})")
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    env = {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), ENV.get("PYTHONPATH")]))}
    proc = irgen("run", d / "net.pth", "-o", d / "out", "--no-progress", "--model-class", "torch_classes:Net",
                 "--model-args", '{"width": 6}', "--input-shape", "x=1,3,8,8", env=env)
    assert proc.returncode == 0, proc.stderr
    return d / "net.pth", d / "out"


def test_manifest_allow_pickle_is_not_trusted(pth_golden, tmp_path):
    """The model file is replaced by a pickle payload, ir.json's sha256 edited to match it
    and the manifest says allow_pickle: verify does not unpickle it without
    --allow-pickle on its own command line."""
    _, golden = pth_golden
    case = Case(golden, tmp_path)
    marker = tmp_path / "marker"
    evil = tmp_path / "evil.pth"
    evil.write_bytes(payload_pickle(marker))
    ir = case.ir()
    ir["model"] = {"path": str(evil), "sha256": hashlib.sha256(evil.read_bytes()).hexdigest()}
    case.write("ir.json", ir)
    _reseal(case.out, "ir.json")
    m = case.manifest()
    m["frontend_options"]["allow_pickle"] = True
    case.write("manifest.json", m)

    proc = case.verify()  # all checks: the source check is skipped, with the reason
    _no_traceback(proc)
    assert proc.returncode == 0, proc.stderr
    assert "source check skipped" in proc.stderr and "--allow-pickle" in proc.stderr, proc.stderr
    assert not marker.exists()
    assert_refused(case.verify("--mode", "source"), None, "--allow-pickle", "evil.pth")
    assert not marker.exists()

    # the recorded model is not the file ir.json's sha256 names: not run even with --allow-pickle
    ir["model"]["sha256"] = "0" * 64
    case.write("ir.json", ir)
    assert_refused(case.verify("--mode", "source", "--allow-pickle"), None, "evil.pth", "sha256 differs")
    assert not marker.exists()

    # the control: the user's own --allow-pickle on a matching file does unpickle (the marker proves it)
    ir["model"]["sha256"] = hashlib.sha256(evil.read_bytes()).hexdigest()
    case.write("ir.json", ir)
    case.verify("--mode", "source", "--allow-pickle")
    assert marker.exists()


def test_manifest_model_class_is_not_imported(pth_golden, tmp_path):
    """manifest.json names a --model-class whose module sits in OUT, and verify runs in OUT:
    the module is imported only with --allow-pickle."""
    _, golden = pth_golden
    case = Case(golden, tmp_path)
    marker = tmp_path / "marker"
    (case.out / "evil_mod.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    m = case.manifest()
    m["frontend_options"]["model_class"] = "evil_mod:Net"
    case.write("manifest.json", m)

    proc = case.run("verify", ".", "--no-progress", "--no-report", cwd=case.out)
    _no_traceback(proc)
    assert proc.returncode == 0 and "source check skipped" in proc.stderr and "evil_mod:Net" in proc.stderr, proc.stderr
    assert not marker.exists()
    assert_refused(case.run("verify", ".", "--no-progress", "--no-report", "--mode", "source", cwd=case.out), None,
                   "--model-class 'evil_mod:Net'", "--allow-pickle")
    assert not marker.exists()
    # the control: with the user's consent the recorded class is imported (from the current folder)
    case.run("verify", ".", "--no-progress", "--no-report", "--mode", "source", "--allow-pickle", cwd=case.out)
    assert marker.exists()
