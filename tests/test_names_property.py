"""Property-based tests (hypothesis) for what turns untrusted names and data into files:
the name sanitizer, ``SafeNames``, ``safeio.inside``, and the data writers
(``.npy`` through the pipeline's writer and ``safeio.load_npy``, the streamed
``output_tensors.params``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from irgen.api import IrgenError
from irgen.names import SafeNames, identifier, sanitize

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SAFE = re.compile(r"[A-Za-z0-9_.-]+")
RESERVED = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(1, 10)), *(f"lpt{i}" for i in range(1, 10))}

# names as attackers write them: separators, dots, NUL and control characters,
# unicode, Windows device names, very long ones
hostile_text = st.one_of(
    st.text(max_size=400),
    st.text(alphabet=st.sampled_from(list("./\\\x00\n\r\t:*?\"<>|~ aA")), max_size=40),
    st.sampled_from(["..", ".", "../x", "/etc/passwd", "a/b", "CON", "con.txt", "Nul", "LPT1.npy", "", " ",
                     "x" * 10_000, "\x00", "é" * 300, "a\x00b"]),
)


@SETTINGS
@given(hostile_text)
def test_sanitize_gives_one_safe_path_component(name: str) -> None:
    s = sanitize(name)
    assert SAFE.fullmatch(s), s
    assert s not in (".", "..") and not s.startswith(".")
    assert len(s.encode()) <= 100
    assert s.split(".")[0].lower() not in RESERVED
    assert sanitize(name) == s  # deterministic


@SETTINGS
@given(st.lists(hostile_text, max_size=60))
def test_safe_names_are_unique_case_insensitively_and_stable(names: list[str]) -> None:
    namer = SafeNames()
    given_names = {n: namer(n) for n in names}
    values = list(given_names.values())
    assert len({v.lower() for v in values}) == len(values)
    for n, v in given_names.items():
        assert namer(n) == v
        assert SAFE.fullmatch(v)
    fresh = namer.fresh(names[0]) if names else None
    if fresh is not None:
        assert fresh.lower() not in {v.lower() for v in values}


@SETTINGS
@given(hostile_text)
def test_identifier_is_a_python_identifier(name: str) -> None:
    ident = identifier(name)
    assert ident.isidentifier() and ident.isascii()


@SETTINGS
@given(st.lists(hostile_text, min_size=1, max_size=20))
def test_sanitized_names_stay_inside_the_folder(tmp_path: Path, names: list[str]) -> None:
    root = tmp_path / "out"
    root.mkdir(exist_ok=True)
    namer = SafeNames()
    for n in names:
        p = root / "activations" / namer(n)
        assert Path(os.path.normpath(p)).parent == root / "activations"


# ------------------------------------------------------------------ safeio.inside


@SETTINGS
@given(st.one_of(hostile_text, st.lists(st.sampled_from(["..", ".", "a", "b", "", "/", "link", "out"]),
                                         max_size=8).map("/".join)))
def test_inside_never_leaves_the_folder(tmp_path: Path, rel: str) -> None:
    from irgen.safeio import inside

    root = tmp_path / "out"
    (root / "a").mkdir(parents=True, exist_ok=True)
    link = root / "link"
    if not link.is_symlink():
        link.symlink_to(tmp_path)  # a link that leads out of OUT
    try:
        target = inside(root, rel, "file")
    except IrgenError as err:
        assert "\n" not in str(err)
        return
    real_root = Path(os.path.realpath(root))
    assert target == real_root or real_root in target.parents


# ------------------------------------------------------------------ data writers

dtypes = st.sampled_from(["float32", "float64", "float16", "int8", "uint8", "int16", "int32", "int64", "bool"])
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


@st.composite
def arrays(draw):
    dtype = np.dtype(draw(dtypes))
    shape = draw(shapes)
    n = int(np.prod(shape)) if shape else 1
    raw = draw(st.binary(min_size=n * dtype.itemsize, max_size=n * dtype.itemsize))
    arr = np.frombuffer(raw, dtype=np.uint8).view(dtype).reshape(shape) if n else np.zeros(shape, dtype)
    if dtype == np.bool_:
        arr = arr.view(np.uint8) % 2 == 1
    if draw(st.booleans()) and arr.ndim >= 2:
        arr = np.asfortranarray(arr)
    return arr


@SETTINGS
@given(arrays())
def test_npy_writer_and_reader_round_trip(tmp_path: Path, arr: np.ndarray) -> None:
    from irgen.capture import write_npy as _write_npy
    from irgen.safeio import load_npy

    path = _write_npy(tmp_path / "t", arr)
    back = load_npy(path, "tensor")
    assert back.dtype == arr.dtype and back.shape == arr.shape
    assert back.tobytes() == np.ascontiguousarray(arr).tobytes()
    assert np.load(path, allow_pickle=False).tobytes() == back.tobytes()


@SETTINGS
@given(arrays(), st.integers(0, 200), st.integers(0, 255))
def test_npy_reader_on_damaged_files_raises_only_irgen_errors(tmp_path: Path, arr, cut: int, flip: int) -> None:
    from irgen.capture import write_npy as _write_npy
    from irgen.safeio import load_npy

    data = bytearray(_write_npy(tmp_path / "t", arr).read_bytes())
    if data:
        data[cut % len(data)] ^= flip
    bad = tmp_path / "bad.npy"
    bad.write_bytes(bytes(data[: len(data) - cut % 7]))
    try:
        back = load_npy(bad, "tensor", limit=1 << 20)
    except IrgenError as err:
        assert "\n" not in str(err)
    else:
        assert isinstance(back, np.ndarray) and not back.dtype.hasobject


names_for_params = st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=6, unique=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names_for_params, st.data())
def test_params_stream_writer_reads_back_with_tvm(tmp_path: Path, names: list[str], data) -> None:
    tvm = pytest.importorskip("tvm")
    from irgen.output import ParamsStreamWriter

    # TVM's own save_param_dict/load_param_dict cannot round-trip an empty tensor: not drawn
    values = {n: data.draw(arrays().filter(lambda a: a.dtype != np.bool_ and a.size > 0)) for n in names}
    path = tmp_path / "output_tensors.params"
    writer = ParamsStreamWriter(path, names)
    for n in names:
        writer.add(n, tvm.runtime.tensor(np.array(values[n], order="C")))
    writer.close()
    loaded = tvm.runtime.load_param_dict(path.read_bytes())
    assert list(loaded) == names
    for n in names:
        got = loaded[n].numpy()
        assert got.dtype == values[n].dtype and got.shape == values[n].shape
        assert got.tobytes() == np.array(values[n], order="C").tobytes()
