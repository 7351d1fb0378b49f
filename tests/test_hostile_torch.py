"""Hostile ``.pt2`` / ``.pth`` files: the torch frontend refuses them with one line, runs nothing.

Every file is made here: a tiny model is exported with ``torch.export`` and
saved with ``torch.export.save``, then its zip is rewritten so that torch's own
loader would run a payload (:func:`hostile.payload`, which creates a marker
file) or allocate without bound:

- pickles torch unpickles with ``weights_only=False``: a weight or constant
  marked ``use_pickle``, the sample inputs, the legacy ``data/weights/model.pt``
  and ``data/constants/model.pt``, the pre-2.7 archive layout, an
  ``opaque_obj_`` constant (``pickle.loads``);
- a symbolic size whose ``expr_str`` torch hands to ``sympy.sympify`` (``eval``);
- AOTInductor code, duplicate member names, a zip bomb, declared shapes and
  member sizes over ``--max-tensor-bytes``, truncation and bit flips, FIFOs and
  devices, ``--input-shape`` that does not fit the program.

Each payload is first shown to run under plain ``torch.export.load`` (so the
corpus really is hostile), then ``irgen run`` must refuse it without running it.
Both of the frontend's layers are tested on their own: the archive inspection
(``irgen_torch.archive``) and the guard around ``torch.export.load``
(``irgen_torch.guard``), with the inspection switched off.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("irgen_torch")

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import hostile  # noqa: E402

import irgen_torch  # noqa: E402
import irgen_torch.archive as archive  # noqa: E402
from irgen.api import IrgenError  # noqa: E402
from irgen_torch.loader import load_pt2, load_pth  # noqa: E402

ENV = {**hostile.ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}


# ------------------------------------------------------------------ building files


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.register_buffer("k", torch.full((4, 1, 1), 0.5))

    def forward(self, x):
        return torch.relu(self.conv(x)) * self.k + torch.tensor(2.0)  # the tensor becomes a lifted constant


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("torch_base")
    torch.manual_seed(0)
    ep = torch.export.export(Tiny().eval(), (torch.zeros(1, 3, 8, 8),))
    torch.export.save(ep, str(d / "clean.pt2"))
    import torch_classes

    torch.manual_seed(1)
    torch.save(torch_classes.Net().state_dict(), d / "clean.pth")
    return d


def members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {i.filename: z.read(i.filename) for i in z.infolist()}


def write_zip(path: Path, mem: dict[str, bytes], deflate: set[str] = frozenset()) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in mem.items():
            z.writestr(name, data, zipfile.ZIP_DEFLATED if name in deflate else zipfile.ZIP_STORED)
    return path


def prefix(mem: dict[str, bytes]) -> str:
    return next(iter(mem)).split("/", 1)[0] + "/"


def edit_json(mem, record: str, fn) -> None:
    name = prefix(mem) + record
    doc = json.loads(mem[name])
    fn(doc)
    mem[name] = json.dumps(doc).encode()


def _pickled_weight(mem, blob):
    def fn(doc):
        meta = doc["config"]["conv.weight"]
        meta["use_pickle"] = True
        mem[prefix(mem) + "data/weights/" + meta["path_name"]] = blob
    edit_json(mem, "data/weights/model_weights_config.json", fn)


def _pickled_constant(mem, blob):
    def fn(doc):
        (meta,) = doc["config"].values()
        meta["use_pickle"] = True
        mem[prefix(mem) + "data/constants/" + meta["path_name"]] = blob
    edit_json(mem, "data/constants/model_constants_config.json", fn)


def _object_constant(kind):
    def build(mem, blob):
        def fn(doc):
            doc["config"]["obj"] = {"path_name": f"{kind}0", "is_param": False, "use_pickle": True, "tensor_meta": None}
        edit_json(mem, "data/constants/model_constants_config.json", fn)
        mem[prefix(mem) + f"data/constants/{kind}0"] = blob
    return build


def _sample_inputs(mem, blob):
    mem[prefix(mem) + "data/sample_inputs/model.pt"] = blob


def _legacy_weights(mem, blob):
    mem[prefix(mem) + "data/weights/model.pt"] = blob


def _legacy_constants(mem, blob):
    mem[prefix(mem) + "data/constants/model.pt"] = blob


def _odd_program_name(mem, blob):
    """torch takes any record under models/ for a program and cuts 5 characters off its name:
    models/evil12345 is program "evil", with its own sample inputs."""
    p = prefix(mem)
    mem[p + "models/evil12345"] = mem[p + "models/model.json"]
    mem[p + "data/weights/evil_weights_config.json"] = mem[p + "data/weights/model_weights_config.json"]
    mem[p + "data/constants/evil_constants_config.json"] = mem[p + "data/constants/model_constants_config.json"]
    mem[p + "data/sample_inputs/evil.pt"] = blob


def _legacy_layout(mem, blob):
    """The pre-2.7 layout torch.export.load still falls back to."""
    program = mem[prefix(mem) + "models/model.json"]
    mem.clear()
    mem.update({"version": b"8.20", "serialized_exported_program.json": program, "serialized_state_dict.pt": b"",
                "serialized_constants.pt": b"", "serialized_example_inputs.pt": blob})


def _sympy_expr(marker: Path):
    def build(mem, _blob):
        code = f"__import__('builtins').open({str(marker)!r}, 'w').close() or 1"

        def fn(doc):
            tv = doc["graph_module"]["graph"]["tensor_values"]
            tv[next(iter(tv))]["sizes"][0] = {"as_expr": {"expr_str": code, "hint": {"as_int": 4}}}
        edit_json(mem, "models/model.json", fn)
    return build


def hostile_pt2(base: Path, dst: Path, build, marker: Path) -> Path:
    mem = members(base / "clean.pt2")
    build(mem, hostile.payload_pickle(marker))
    return write_zip(dst, mem)


# case -> (builder, torch runs the payload through: "pickle" or "eval")
PAYLOAD_CASES = {
    "pickled-weight": _pickled_weight,
    "pickled-constant": _pickled_constant,
    "sample-inputs": _sample_inputs,
    "legacy-weights": _legacy_weights,
    "legacy-constants": _legacy_constants,
    "opaque-object": _object_constant("opaque_obj_"),
    "odd-program-name": _odd_program_name,
    "legacy-layout": _legacy_layout,
    "sympy-expr": None,  # built per marker
}


def build_case(name: str, base: Path, d: Path) -> tuple[Path, Path]:
    marker = d / f"{name}.marker"
    builder = PAYLOAD_CASES[name] or _sympy_expr(marker)
    return hostile_pt2(base, d / f"{name}.pt2", builder, marker), marker


def irgen_batch(runs: list[list[str]], cwd: Path, parallel: int = 2, timeout: int = 300):
    """Several ``irgen`` commands, a few at a time; the CompletedProcess of each."""
    results: list[subprocess.CompletedProcess | None] = [None] * len(runs)
    pending = list(enumerate(runs))
    active: list[tuple[int, subprocess.Popen]] = []
    while pending or active:
        while pending and len(active) < parallel:
            i, argv = pending.pop(0)
            p = subprocess.Popen([*hostile.IRGEN, *map(str, argv)], cwd=cwd, env=ENV, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            active.append((i, p))
        i, p = active.pop(0)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise AssertionError(f"irgen {runs[i]} hung for {timeout} s")
        results[i] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    return results


def expect_refused(fn, *needles: str) -> str:
    with pytest.raises(IrgenError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


# ------------------------------------------------------------------ payloads


def test_corpus_runs_payloads_under_plain_torch(base, tmp_path):
    """The corpus is really hostile: torch.export.load itself runs each payload."""
    for name in PAYLOAD_CASES:
        path, marker = build_case(name, base, tmp_path)
        try:
            torch.export.load(str(path))
        except Exception:  # noqa: BLE001  the rest of the file need not make sense
            pass
        assert marker.exists(), f"{name}: torch did not run the payload; the case tests nothing"


@pytest.mark.slow  # 12 irgen processes, each importing torch; by default each payload is refused in-process
def test_payloads_refused_by_irgen_run(base, tmp_path):
    """Each hostile .pt2 (and pickled .pth): exit 2, one line naming the file, no payload run."""
    cases = {name: build_case(name, base, tmp_path) for name in PAYLOAD_CASES}
    marker = tmp_path / "pth.marker"
    torch.save({"w": hostile.payload(marker)}, tmp_path / "zip-module.pth")
    (tmp_path / "raw-module.pth").write_bytes(hostile.payload_pickle(marker))
    runs, names = [], []
    for name, (path, _) in cases.items():
        runs.append(["run", path, "-o", tmp_path / f"out-{name}", "--no-progress"])
        names.append(path.name)
    for pth in ("zip-module.pth", "raw-module.pth"):
        runs.append(["run", pth, "-o", tmp_path / f"out-{pth}", "--model-class", "torch_classes:Net",
                     "--input-shape", "x=1,3,8,8", "--no-progress"])
        names.append(pth)
    runs.append(["run", base / "clean.pt2", "-o", tmp_path / "out-clean", "--no-progress"])
    *refused, clean = irgen_batch(runs, tmp_path)
    for proc, argv, name in zip(refused, runs, names):
        line = hostile.assert_refused(proc, argv[3], name)
        assert "--allow-pickle" in line, line
    for name, (_, m) in cases.items():
        assert not m.exists(), f"{name}: the payload ran"
    assert not marker.exists(), ".pth: the payload ran"
    assert clean.returncode == 0, clean.stderr
    assert (tmp_path / "out-clean" / "ir.json").is_file()


@pytest.mark.parametrize("name", list(PAYLOAD_CASES))
def test_inspection_names_the_member(base, tmp_path, name):
    path, marker = build_case(name, base, tmp_path)
    msg = expect_refused(lambda: load_pt2(path, {}), str(path), "--allow-pickle")
    member = {"pickled-weight": "data/weights/weight_0", "pickled-constant": "data/constants/tensor_0",
              "sample-inputs": "data/sample_inputs/model.pt", "legacy-weights": "data/weights/model.pt",
              "legacy-constants": "data/constants/model.pt", "opaque-object": "data/constants/opaque_obj_0",
              "legacy-layout": "serialized_example_inputs.pt", "sympy-expr": "models/model.json",
              "odd-program-name": "data/sample_inputs/evil.pt"}[name]
    assert member in msg, msg
    assert not marker.exists()


@pytest.mark.parametrize("name", list(PAYLOAD_CASES))
def test_guard_alone_stops_payloads(base, tmp_path, monkeypatch, name):
    """With the archive inspection switched off, the guard around torch.export.load still
    refuses every payload, and puts torch.load, pickle and sympy back afterwards."""
    import sympy

    monkeypatch.setattr(archive, "check_pickle", lambda *a, **k: None)
    monkeypatch.setattr(archive, "check_program_json", lambda *a, **k: None)
    before = (torch.load, torch.serialization.load, pickle.load, pickle.loads, pickle.Unpickler, sympy.sympify,
              os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD"))
    path, marker = build_case(name, base, tmp_path)
    msg = expect_refused(lambda: load_pt2(path, {}), str(path), "--allow-pickle")
    assert not marker.exists(), f"{name}: the payload ran"
    if name != "sympy-expr":
        assert "pickled" in msg, msg
    after = (torch.load, torch.serialization.load, pickle.load, pickle.loads, pickle.Unpickler, sympy.sympify,
             os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD"))
    assert after == before


def test_custom_object_and_aoti_refused(base, tmp_path):
    mem = members(base / "clean.pt2")
    _object_constant("custom_obj_")(mem, b"\x80\x02}q\x00.")
    msg = expect_refused(lambda: load_pt2(write_zip(tmp_path / "custom.pt2", mem), {}), "custom_obj_0", "--allow-pickle")
    assert "pickled Python object" in msg
    mem = members(base / "clean.pt2")
    mem[prefix(mem) + "data/aotinductor/model/model.so"] = b"\x7fELF" + b"\0" * 60
    expect_refused(lambda: load_pt2(write_zip(tmp_path / "aoti.pt2", mem), {}), "data/aotinductor/model/model.so",
                   "AOTInductor")


def test_plain_tensor_pickles_still_load(base, tmp_path):
    """A use_pickle weight that holds a plain tensor passes the weights-only loader, with or
    without --allow-pickle; so do clean sample inputs."""
    ref = torch.export.load(str(base / "clean.pt2"))
    weight = ref.state_dict["conv.weight"].detach().clone()
    buf = io.BytesIO()
    torch.save(torch.nn.Parameter(weight), buf)
    path = hostile_pt2(base, tmp_path / "plain.pt2", lambda mem, _: _pickled_weight(mem, buf.getvalue()),
                       tmp_path / "unused")
    for allow in (False, True):
        ep = load_pt2(path, {"allow_pickle": allow})
        assert torch.equal(ep.state_dict["conv.weight"].detach(), weight)


def test_guards_code_is_dropped(base, tmp_path):
    """guards_code is Python source ExportedProgram.module() would exec: irgen drops it."""
    marker = tmp_path / "guard.marker"
    mem = members(base / "clean.pt2")
    edit_json(mem, "models/model.json",
              lambda doc: doc.update(guards_code=[f"__import__('builtins').open({str(marker)!r}, 'w').close() or True"]))
    ep = load_pt2(write_zip(tmp_path / "guards.pt2", mem), {})
    assert ep._guards_code == []
    ep.module()
    assert not marker.exists()


def test_symbolic_expressions():
    ok = ["Symbol('s0', integer=True, positive=True)", "Add(Mul(Integer(2), Symbol('s77', integer=True)), Integer(1))",
          "Max(1, s0)", "FloorDiv(s0, 2) + 1", "Float('0.5', precision=53)", "Pow(Symbol('s0', integer=True), Integer(2))",
          "Eq(s0, 4)", "true"]
    bad = ["__import__('os')", "s0.__class__", "exec(chr(49))", "Integer(10)**Integer(10**12)",
           "Pow(Integer(10), Integer(999999999))", "Symbol(\"x\")", "[s0]", "lambda: 1", "s0; s1",
           "Float('1', precision=99999999)", "getattr(s0, 'x')"]
    for text in ok:
        assert archive.check_sym_expr(text) is None, text
    for text in bad:
        assert archive.check_sym_expr(text) is not None, text


# ------------------------------------------------------------------ structure and sizes


def test_duplicate_and_case_colliding_members(base, tmp_path):
    mem = members(base / "clean.pt2")
    name = prefix(mem) + "data/sample_inputs/model.pt"
    path = write_zip(tmp_path / "dup.pt2", mem)
    with zipfile.ZipFile(path, "a") as z, pytest.warns(UserWarning):
        z.writestr(name, hostile.payload_pickle(tmp_path / "dup.marker"))
    expect_refused(lambda: load_pt2(path, {}), "appears twice")
    mem[name.upper().replace(prefix(mem).upper(), prefix(mem))] = b"x"
    expect_refused(lambda: load_pt2(write_zip(tmp_path / "case.pt2", mem), {}), "appears twice")


def test_zip_bomb_refused(base, tmp_path):
    mem = members(base / "clean.pt2")
    mem[prefix(mem) + "extra/bomb.txt"] = bytes(64 << 20)
    path = write_zip(tmp_path / "bomb.pt2", mem, deflate={prefix(mem) + "extra/bomb.txt"})
    assert path.stat().st_size < 1 << 20
    expect_refused(lambda: load_pt2(path, {}), "extra/bomb.txt", "zip bomb")


def test_declared_sizes_refused(base, tmp_path):
    # an empty weight record with a huge declared shape: torch would torch.zeros() it
    mem = members(base / "clean.pt2")

    def fn(doc):
        meta = doc["config"]["conv.weight"]
        meta["tensor_meta"]["sizes"] = [{"as_int": 1 << 20}, {"as_int": 1 << 20}, {"as_int": 3}, {"as_int": 3}]
        mem[prefix(mem) + "data/weights/" + meta["path_name"]] = b""
    edit_json(mem, "data/weights/model_weights_config.json", fn)
    path = write_zip(tmp_path / "huge.pt2", mem)
    expect_refused(lambda: load_pt2(path, {"max_tensor_bytes": 1 << 30}), "weight 'conv.weight'", "--max-tensor-bytes")
    # a member over the limit
    expect_refused(lambda: load_pt2(base / "clean.pt2", {"max_tensor_bytes": 100}), "data/weights/weight_0",
                   "--max-tensor-bytes")
    # a stored member whose central directory claims more than it holds
    mem = members(base / "clean.pt2")
    path = write_zip(tmp_path / "lies.pt2", mem)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(prefix(mem) + "data/weights/weight_0")
    cd = data.find(b"PK\x01\x02")  # the central directory entry of weight_0
    while data[cd + 46:cd + 46 + len(info.filename)] != info.filename.encode():
        cd = data.find(b"PK\x01\x02", cd + 4)
    data[cd + 24:cd + 28] = (1 << 31).to_bytes(4, "little")  # uncompressed size
    path.write_bytes(bytes(data))
    expect_refused(lambda: load_pt2(path, {}), "data/weights/weight_0")
    # the same limits inside a zip .pth
    expect_refused(lambda: load_pth(base / "clean.pth", {"max_tensor_bytes": 64, "model_class": "torch_classes:Net",
                                                         "input_shapes": {"x": (1, 3, 8, 8)}}), "--max-tensor-bytes")


# ------------------------------------------------------------------ damaged files


def _damaged(data: bytes):
    n = len(data)
    yield "empty", b""
    yield "100 bytes", data[:100]
    for frac in (0.1, 0.3, 0.5, 0.7, 0.9):
        yield f"cut at {frac}", data[:int(n * frac)]
        flipped = bytearray(data)
        flipped[int(n * frac)] ^= 0x5A
        yield f"flip at {frac}", bytes(flipped)


@pytest.mark.parametrize("suffix", [".pt2", ".pth"])
def test_truncated_and_flipped(base, tmp_path, capfd, suffix):
    """Each damaged file: one IrgenError or (a flip that leaves it valid) a normal load; no
    other exception, nothing printed by torch."""
    data = (base / f"clean{suffix}").read_bytes()
    opts = {"model_class": "torch_classes:Net", "input_shapes": {"x": (1, 3, 8, 8)}}
    outcomes = {}
    for label, blob in _damaged(data):
        path = tmp_path / f"{label.replace(' ', '_')}{suffix}"
        path.write_bytes(blob)
        try:
            irgen_torch.load_torch(path, opts)
            outcomes[label] = "ok"
        except IrgenError as err:
            assert "\n" not in str(err) and str(path) in str(err), str(err)
            outcomes[label] = "refused"
        captured = capfd.readouterr()
        assert captured.err == "" and captured.out == "", (label, captured.err[-2000:])
    assert all(outcomes[k] == "refused" for k in outcomes if not k.startswith("flip")), outcomes


def test_damaged_files_on_the_command_line(base, tmp_path):
    """Through the CLI: one stderr line, nothing logged by torch (whose loader logs a dozen-line
    traceback for an archive it fails on), no hang."""
    pt2, pth = (base / "clean.pt2").read_bytes(), (base / "clean.pth").read_bytes()
    (tmp_path / "cut.pt2").write_bytes(pt2[:len(pt2) // 2])
    (tmp_path / "cut.pth").write_bytes(pth[:len(pth) // 2])
    # a weight shape bigger than its record: torch.export.load fails on it, and used to log a
    # dozen-line traceback before raising a vague error of its own
    mem = members(base / "clean.pt2")
    edit_json(mem, "data/weights/model_weights_config.json",
              lambda doc: doc["config"]["conv.weight"]["tensor_meta"]["sizes"].__setitem__(3, {"as_int": 4}))
    write_zip(tmp_path / "strided.pt2", mem)
    # a local header torch's zip reader would read differently from Python's directory
    bad = bytearray(pt2)
    bad[0:4] = b"XX\x03\x04"
    (tmp_path / "header.pt2").write_bytes(bytes(bad))
    names = {"cut.pt2": "truncated", "cut.pth": "cut.pth", "strided.pt2": "out of bounds", "header.pt2": "disagree"}
    runs = [["run", n, "-o", tmp_path / f"out-{n}", "--no-progress", "--model-class", "torch_classes:Net",
             "--input-shape", "x=1,3,8,8"] if n.endswith(".pth") else ["run", n, "-o", tmp_path / f"out-{n}", "--no-progress"]
            for n in names]
    for proc, argv, (name, needle) in zip(irgen_batch(runs, tmp_path), runs, names.items()):
        hostile.assert_refused(proc, argv[3], name, needle)


# ------------------------------------------------------------------ paths and options


def test_fifo_and_devices_refused_before_torch_opens(base, tmp_path):
    fifo = tmp_path / "model.pt2"
    os.mkfifo(fifo)
    link = tmp_path / "zero.pt2"
    link.symlink_to("/dev/zero")
    (tmp_path / "fifo.pth").symlink_to(fifo)
    for path, kind in ((fifo, "FIFO"), (link, "character device"), (tmp_path / "fifo.pth", "FIFO")):
        for fn in (lambda: irgen_torch.load_torch(path, {}), lambda: irgen_torch.source_runner(path, {})):
            result: list[BaseException | None] = []

            def call():
                try:
                    fn()
                    result.append(None)
                except BaseException as err:  # noqa: BLE001
                    result.append(err)

            t = threading.Thread(target=call, daemon=True)
            t.start()
            t.join(30)
            assert not t.is_alive(), f"{path}: blocked"
            assert isinstance(result[0], IrgenError), result
            assert kind in str(result[0]) and str(path) in str(result[0]), str(result[0])


def test_input_shape_must_fit_the_program(base, tmp_path):
    clean = base / "clean.pt2"
    expect_refused(lambda: irgen_torch.load_torch(clean, {"input_shapes": {"x": (1, 3, 9, 9)}}),
                   "--input-shape x=1,3,9,9: the model's input 'x' has the fixed shape (1, 3, 8, 8)")
    expect_refused(lambda: irgen_torch.load_torch(clean, {"input_shapes": {"y": (1, 3, 8, 8)}}),
                   "--input-shape y=1,3,8,8", "no input 'y'", "'x' (1, 3, 8, 8)")
    assert irgen_torch.load_torch(clean, {"input_shapes": {"x": (1, 3, 8, 8)}}).inputs[0].shape == (1, 3, 8, 8)
    proc = hostile.irgen("run", clean, "-o", tmp_path / "out", "--input-shape", "x=2,3,8,8", "--no-progress", cwd=tmp_path)
    hostile.assert_refused(proc, tmp_path / "out", "--input-shape x=2,3,8,8", "(1, 3, 8, 8)")
