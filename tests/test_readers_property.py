"""Property-based tests (hypothesis) of the readers of an output folder: ``ir.json``
and ``manifest.json`` (:mod:`irgen.irfile`), and what ``irgen verify`` and
``irgen inspect`` do with what they read.

For arbitrary JSON values, arbitrary bytes and valid documents with one part
replaced by an arbitrary value, the readers (and ``inspect_output``,
``check_manifest``, ``verify_output``) raise nothing but
:class:`irgen.api.IrgenError`, and never open, stat or read a link in the
folder ``outside`` beside OUT, which the documents point at with ``../``,
absolute paths and symbolic links (every ``open`` is seen by an audit hook;
``os.stat``/``os.lstat``/``os.readlink`` are wrapped while a reader runs). Valid
documents come back unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from irgen.api import IrgenError
from irgen.irfile import read_ir, read_manifest, validate_ir, validate_manifest
from irgen.summary import inspect_output
from irgen.verify import check_manifest, verify_output

SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

ROOT = Path(tempfile.mkdtemp(prefix="irgen-readers-"))
OUT = ROOT / "out"
OUTSIDE = ROOT / "outside"
SECRET = OUTSIDE / "secret.txt"


@pytest.fixture(scope="module", autouse=True)
def folder():
    """OUT with two arrays, a FIFO, a sub-folder and links out of it; ``outside`` beside it."""
    OUTSIDE.mkdir(parents=True)
    SECRET.write_text("irgen must never read this\n")
    for sub in ("activations", "parameters"):
        (OUT / sub).mkdir(parents=True)
    np.save(OUT / "activations" / "a.npy", np.arange(6, dtype=np.float32).reshape(2, 3))
    np.save(OUT / "parameters" / "w.npy", np.ones((3,), np.int8))
    os.mkfifo(OUT / "activations" / "fifo.npy")
    (OUT / "link").symlink_to("../outside")
    (OUT / "activations" / "secret.npy").symlink_to(SECRET)
    (OUT / "activations" / "loop.npy").symlink_to("loop.npy")
    yield
    shutil.rmtree(ROOT, ignore_errors=True)


# ------------------------------------------------------------------ watching accesses

_SEEN: list[str] | None = None


def _audit(event: str, args) -> None:
    if _SEEN is not None and event in ("open", "os.listdir", "os.scandir") and args:
        path = args[0]
        if isinstance(path, (str, bytes, os.PathLike)):
            _SEEN.append(os.fsdecode(path))


sys.addaudithook(_audit)


@contextlib.contextmanager
def watched():
    """Record every path opened, listed, stat'ed or read as a link; fail on one in ``outside``."""
    global _SEEN
    seen: list[str] = []
    real = os.stat, os.lstat, os.readlink

    def wrap(fn):
        def inner(path, *a, **k):
            if isinstance(path, (str, bytes, os.PathLike)):
                seen.append(os.fsdecode(path))
            return fn(path, *a, **k)
        return inner

    os.stat, os.lstat, os.readlink = (wrap(f) for f in real)
    _SEEN = seen
    try:
        yield seen
    finally:
        _SEEN = None
        os.stat, os.lstat, os.readlink = real
    outside = [p for p in seen if os.path.abspath(p) == str(OUTSIDE) or os.path.abspath(p).startswith(f"{OUTSIDE}/")]
    assert not outside, f"touched outside OUT: {outside}"


def _reset(ir: bytes | None = None, manifest: bytes | None = None) -> None:
    for name, data in (("ir.json", ir), ("manifest.json", manifest)):
        path = OUT / name
        if path.exists():
            path.unlink()
        if data is not None:
            path.write_bytes(data)


def _only_irgen_errors(fn, *args, **kwargs):
    """``fn(...)``'s result, or None when it raised IrgenError (with a one-line message)."""
    try:
        return fn(*args, **kwargs)
    except IrgenError as err:
        assert str(err).strip()
        return None


# ------------------------------------------------------------------ strategies

FILES = ["activations/a.npy", "parameters/w.npy", "activations/missing.npy", "activations/fifo.npy",
         "activations/loop.npy", "activations", "ir.json"]
ESCAPES = ["../outside/secret.txt", str(SECRET), str(OUTSIDE), "link/secret.txt", "link", "activations/secret.npy",
           "activations/../../outside/secret.txt", "./../outside/secret.txt", "~/secret.txt", "..\\outside\\secret.txt",
           "activations/a.npy\x00", "", ".", "//outside/secret.txt"]
paths = st.sampled_from(FILES + ESCAPES) | st.text(max_size=12)

KEYS = ["layers", "inputs", "outputs", "name", "op", "shape", "dtype", "file", "params", "quant", "source", "fused_ops",
        "attrs", "results", "producer", "frontend", "model", "path", "sha256", "files", "size", "cwd",
        "frontend_options", "allow_pickle", "input_shapes", "model_class", "model_args", "calibration", "scheme",
        "kind", "nodes", "op_types", "tensors", "layout"]

leaves = (st.none() | st.booleans() | st.integers() | st.integers(-3, 10) | st.floats()
          | st.text(max_size=10) | paths)
json_values = st.recursive(
    leaves,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6),
                                                                      children, max_size=5),
    max_leaves=25,
)
finite_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=10,
)

names = st.text(min_size=1, max_size=8)
shapes = st.lists(st.integers(0, 4), max_size=3)
RELU = {"op": "relu", "relax_op": "relax.nn.relu", "attrs": {}, "args": ["input:0"]}


def _with_extra(strategy):
    """Valid records may carry fields the contract does not name (a serializer's own)."""
    return st.tuples(strategy, st.dictionaries(st.text(min_size=1, max_size=6).filter(lambda k: k not in KEYS),
                                               finite_values, max_size=2)).map(lambda t: {**t[1], **t[0]})


records = _with_extra(st.fixed_dictionaries(
    {"name": names, "shape": shapes, "dtype": st.sampled_from(["float32", "int8", "int32", None, "bogus"]),
     "file": st.none() | paths},
    optional={"layout": st.none() | st.text(max_size=4), "producer": st.none() | names}))
layers = _with_extra(st.fixed_dictionaries(
    {"name": names, "op": st.sampled_from(["relu", "conv2d", "dense", ""]),
     "inputs": st.lists(records, max_size=2), "outputs": st.lists(records, min_size=1, max_size=2),
     "params": st.dictionaries(st.sampled_from(["weight", "bias", "a b"]), records, max_size=2),
     "quant": st.none() | st.fixed_dictionaries({}, optional={"scheme": st.text(max_size=5),
                                                              "kind": st.sampled_from(["conv2d", "add", "x"])}),
     "fused_ops": st.sampled_from([[], [RELU]]),
     "attrs": st.just({}),
     "source": st.none() | st.fixed_dictionaries(
         {"outputs": st.lists(st.none() | names, max_size=2), "nodes": st.lists(names, max_size=2)})}))
irs = _with_extra(st.fixed_dictionaries(
    {"ir_version": st.just(1),
     "producer": st.fixed_dictionaries({"frontend": st.sampled_from(["onnx", "nope"]), "opt_level": st.integers(0, 4)}),
     "model": st.fixed_dictionaries({"path": st.text(max_size=10), "sha256": st.text(max_size=10)}),
     "inputs": st.lists(records, max_size=2), "outputs": st.lists(records, max_size=2),
     "layers": st.lists(layers, max_size=4, unique_by=lambda l: l["name"])}))
manifests = _with_extra(st.fixed_dictionaries(
    {"files": st.lists(st.fixed_dictionaries({"path": paths, "size": st.integers(0, 10 ** 6),
                                              "sha256": st.text(alphabet="0123456789abcdef", max_size=64)}),
                       max_size=6),
     "cwd": st.none() | st.text(max_size=10),
     "frontend_options": st.fixed_dictionaries({}, optional={
         "input_shapes": st.dictionaries(names, shapes, max_size=2), "model_class": st.text(min_size=1, max_size=8),
         "model_args": st.text(max_size=8) | st.dictionaries(st.text(max_size=3), finite_values, max_size=2),
         "calibration": st.text(min_size=1, max_size=8), "allow_pickle": st.booleans()})}))


def _nodes(doc, at=()):
    """Paths to every node of a JSON document below the top (not into fused_ops/attrs/quant
    contents, which the numpy reference executes: sizes there could ask for any memory)."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        yield at + (key,)
        if key not in ("fused_ops", "attrs", "quant"):
            yield from _nodes(value, at + (key,))


@st.composite
def mutated(draw, documents):
    """A valid document with one node replaced by an arbitrary JSON value, or deleted."""
    doc = draw(documents)
    nodes = list(_nodes(doc))
    if not nodes:
        return doc
    at = draw(st.sampled_from(nodes))
    parent = doc
    for key in at[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and draw(st.booleans()):
        del parent[at[-1]]
    else:
        parent[at[-1]] = draw(json_values)
    return doc


def _dump(doc) -> bytes:
    return json.dumps(doc, allow_nan=True).encode()


# ------------------------------------------------------------------ ir.json


@SETTINGS
@given(st.one_of(json_values, mutated(irs)))
def test_ir_reader_takes_any_json(doc):
    _reset(ir=_dump(doc))
    with watched():
        ir = _only_irgen_errors(read_ir, OUT)
        if ir is not None:
            _only_irgen_errors(inspect_output, OUT)
            result = _only_irgen_errors(verify_output, OUT, modes=("single", "entire"))
            if result is not None:
                assert result["summary"]["layers"] == len(ir["layers"])


@SETTINGS
@given(st.binary(max_size=200) | st.sampled_from([b"", b"\xff", b"9" * 5000, b"[" * 50_000, b'{"layers": [NaN]}',
                                                    b'{"layers": []}\x00', b'\xef\xbb\xbf{"layers": []}']))
def test_ir_reader_takes_any_bytes(data):
    _reset(ir=data)
    with watched():
        ir = _only_irgen_errors(read_ir, OUT)
        if ir is not None:
            _only_irgen_errors(inspect_output, OUT)


@SETTINGS
@given(irs)
def test_valid_ir_round_trips(doc):
    _reset(ir=_dump(doc))
    with watched():
        assert read_ir(OUT) == doc
    assert validate_ir(json.loads(_dump(doc))) == doc


def test_ir_errors_name_the_field():
    with pytest.raises(IrgenError, match=r"^x\.json: layers\[1\]\.outputs\[0\]\.shape: expected a list of non-negative"):
        validate_ir({"layers": [{"name": "a", "op": "relu", "outputs": [{"name": "t", "shape": [1]}]},
                                {"name": "b", "op": "relu", "outputs": [{"name": "t", "shape": [1.5]}]}]}, "x.json")
    with pytest.raises(IrgenError, match=r"layers\[0\]\.params\['a b'\]: expected an object"):
        validate_ir({"layers": [{"name": "a", "op": "relu", "outputs": [{"name": "t", "shape": []}],
                                 "params": {"a b": 3}}]})


# ------------------------------------------------------------------ manifest.json


@pytest.fixture(scope="module")
def ir_doc(folder):
    return {"layers": [{"name": "l", "op": "relu", "outputs": [{"name": "t", "shape": [2, 3], "dtype": "float32",
                                                                 "file": "activations/a.npy"}],
                        "params": {"weight": {"name": "w", "shape": [3], "dtype": "int8", "file": "parameters/w.npy"}}}]}


@SETTINGS
@given(st.one_of(json_values, mutated(manifests)))
def test_manifest_reader_takes_any_json(ir_doc, doc):
    _reset(ir=_dump(ir_doc), manifest=_dump(doc))
    with watched():
        manifest = _only_irgen_errors(read_manifest, OUT)
        if manifest is not None:
            problems = check_manifest(OUT, ir_doc, manifest)
            assert all(isinstance(p["message"], str) and p["check"] == "manifest" for p in problems)


@SETTINGS
@given(st.binary(max_size=200))
def test_manifest_reader_takes_any_bytes(ir_doc, data):
    _reset(ir=_dump(ir_doc), manifest=data)
    with watched():
        _only_irgen_errors(read_manifest, OUT)


@SETTINGS
@given(manifests)
def test_valid_manifest_round_trips_and_escapes_are_problems(ir_doc, doc):
    _reset(ir=_dump(ir_doc), manifest=_dump(doc))
    with watched():
        assert read_manifest(OUT) == doc
        problems = check_manifest(OUT, ir_doc, doc)
    assert validate_manifest(json.loads(_dump(doc))) == doc
    for entry in doc["files"]:
        if entry["path"] in ESCAPES[:8]:  # out of OUT: reported, never opened
            assert any(repr(entry["path"])[:200] in p["message"] for p in problems), (entry, problems)


def test_no_manifest_is_a_problem_not_an_error(ir_doc):
    _reset(ir=_dump(ir_doc))
    assert read_manifest(OUT) is None
    assert check_manifest(OUT, ir_doc, None) == [{"layer": None, "check": "manifest",
                                                  "message": "manifest.json is missing"}]
