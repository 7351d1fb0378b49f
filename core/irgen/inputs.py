"""The model inputs of a run: ``--input-shape`` parsed, ``--input`` files and ``--inputs`` samples read
and checked against the model's inputs (shape, dtype, size) before any array is made, and
seeded random data where none is given."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from irgen.api import InputSpec, IrgenError
from irgen.names import sanitize
from irgen.safeio import (check_tensor_size, DEFAULT_MAX_TENSOR_BYTES, human_bytes, load_npy, load_npz, npy_header,
                          npz_headers)



def _float_dtype(name: str) -> np.dtype:
    """numpy's dtype of a float type name; bfloat16 is ml_dtypes' (numpy has none)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)

def parse_input_shapes(specs: list[str], limit: int | None = None) -> dict[str, tuple[int, ...]]:
    """``--input-shape NAME=D1,D2,...`` values; every dimension a non-negative integer, and the
    element count within ``limit`` bytes even at one byte per element."""
    shapes = {}
    for spec in specs:
        name, sep, dims = spec.rpartition("=")
        try:
            if not sep or not name:
                raise ValueError
            shape = tuple(int(d) for d in dims.split(","))
        except ValueError:
            raise IrgenError(f"--input-shape {spec!r}: expected NAME=D1,D2,...") from None
        if any(d < 0 for d in shape):
            raise IrgenError(f"--input-shape {spec!r}: every dimension must be a non-negative integer (0: an empty tensor, such as an empty KV cache)")
        if name in shapes:
            raise IrgenError(f"--input-shape {spec!r}: input {name!r} is given twice")
        check_tensor_size(f"--input-shape {name}", shape, "int8", limit)
        shapes[name] = shape
    return shapes


def check_inputs(specs: list[InputSpec], shapes: dict[str, tuple[int, ...]], limit: int | None) -> None:
    """Every ``--input-shape`` names an input of the model and was honoured; every input fits ``limit``."""
    declared = {s.name: s for s in specs}
    listing = ", ".join(f"{s.name} {list(s.shape)}" for s in specs) or "none"
    for name, shape in shapes.items():
        if name not in declared:
            raise IrgenError(f"--input-shape {name}=...: the model has no input {name!r} (inputs: {listing})")
        if tuple(declared[name].shape) != tuple(shape):
            raise IrgenError(f"--input-shape {name}={','.join(map(str, shape))}: input {name!r} has the fixed "
                             f"shape {list(declared[name].shape)}")
    for s in specs:
        check_tensor_size(f"input {s.name!r}", s.shape, s.dtype, limit)


def quantize_input(x: np.ndarray, spec: InputSpec) -> np.ndarray:
    """A float input file for an integer input that has a scale and zero point: quantized
    the way a user does before calling the source runtime (ties to even, clipped)."""
    scale, zero_point = spec.quantization
    info = np.iinfo(spec.dtype)
    q = np.round(x.astype(np.float64) / float(scale)) + int(zero_point)
    return np.clip(q, info.min, info.max).astype(spec.dtype)


def load_inputs(specs: list[InputSpec], given: list[str], seed: int,
                limit: int | None = DEFAULT_MAX_TENSOR_BYTES,
                arrays: dict[str, tuple[np.ndarray, str]] | None = None) -> list[np.ndarray]:
    """The model's input arrays: from ``--input`` files (or ``arrays``: input name ->
    (array, where it came from)), else seeded random data."""
    files: dict[str, Path] = {}
    for item in given:
        name, sep, file = item.partition("=")
        if sep and not Path(item).exists():
            if name not in {s.name for s in specs}:
                raise IrgenError(f"--input {item!r}: the model has no input {name!r} (inputs: {', '.join(s.name for s in specs)})")
            files[name] = Path(file)
        else:
            if len(specs) != 1:
                raise IrgenError(f"--input {item!r}: the model has {len(specs)} inputs; give NAME=FILE for each")
            files[specs[0].name] = Path(item)
    rng = np.random.default_rng(seed)
    out = []
    for s in specs:
        if s.name in files:
            out.append(_checked_input(load_npy(files[s.name], "--input", limit), s, f"--input {files[s.name]}"))
        elif arrays and s.name in arrays:
            out.append(_checked_input(arrays[s.name][0], s, arrays[s.name][1]))
        elif s.dtype == "bfloat16" or np.issubdtype(np.dtype(s.dtype), np.floating):
            out.append(rng.random(s.shape, dtype=np.float32).astype(_float_dtype(s.dtype)))
        elif np.issubdtype(np.dtype(s.dtype), np.integer):
            info = np.iinfo(s.dtype)
            out.append(rng.integers(max(info.min, -128), min(info.max, 127), s.shape, endpoint=True).astype(s.dtype))
        elif s.dtype == "bool":
            out.append(rng.random(s.shape) < 0.5)
        else:
            raise IrgenError(f"input {s.name!r}: cannot generate data of dtype {s.dtype}; give --input")
    return out


def _check_form(shape: tuple[int, ...], dtype: np.dtype, s: InputSpec, what: str) -> None:
    """Data of ``shape`` and ``dtype`` can be input ``s``: its shape, and its dtype or a float
    one for an integer input that has a scale (quantized on reading: :func:`quantize_input`)."""
    if tuple(shape) != tuple(s.shape):
        raise IrgenError(f"{what}: shape {tuple(shape)} does not match input {s.name!r} shape {tuple(s.shape)}")
    bf16_bits = s.dtype == "bfloat16" and dtype.kind == "V" and dtype.itemsize == 2  # '<V2' in a .npy header
    if str(dtype) != s.dtype and not bf16_bits and not (
            s.quantization and dtype.kind == "f" and np.dtype(s.dtype).kind in "iu"):
        raise IrgenError(f"{what}: dtype {dtype} does not match input {s.name!r} dtype {s.dtype}")


def _checked_input(arr: np.ndarray, s: InputSpec, what: str) -> np.ndarray:
    """``arr`` as input ``s``: its shape, its dtype (a float array quantized for an integer
    input that has a scale), finite values; C order, 0-d kept 0-d."""
    if s.dtype == "bfloat16" and arr.dtype.kind == "V" and arr.dtype.itemsize == 2 and arr.dtype.fields is None:
        arr = arr.view(_float_dtype("bfloat16"))  # np.save writes ml_dtypes' bfloat16 as '<V2'
    _check_form(arr.shape, arr.dtype, s, what)
    if str(arr.dtype) != s.dtype and np.isfinite(arr).all():
        arr = quantize_input(arr, s)
    if str(arr.dtype) != s.dtype:
        raise IrgenError(f"{what}: dtype {arr.dtype} does not match input {s.name!r} dtype {s.dtype}")
    if (arr.dtype.kind in "fc" or arr.dtype.name == "bfloat16") and not np.isfinite(arr).all():
        bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
        raise IrgenError(
            f"{what}: input {s.name!r} holds {bad} NaN/Inf values; TVM's kernels and the source "
            f"runtimes treat them differently (max, min, relu, pooling), so such golden data would not "
            f"match: give finite input")
    return np.array(arr, order="C")


#: the samples of ``irgen run --inputs`` may hold this many times ``--max-tensor-bytes`` together
SAMPLES_TOTAL_FACTOR = 4


#: one sample's arrays before their data is read: input name -> (file, array name in a
#: ``.npz`` or None for a ``.npy``, the array's header)
_Headers = dict[str, tuple[Path, "str | None", Any]]


def read_samples(source: Path, specs: list[InputSpec], limit: int | None
                 ) -> list[tuple[str, dict[str, tuple[np.ndarray, str]]]]:
    """``--inputs``: (sample name, input name -> (array, where it came from)) per sample,
    sorted by name.

    A folder holds one sample per ``.npy`` file (a one-input model) or per ``.npz`` file
    (its arrays named after the model's inputs); a ``.npz`` file holds one sample per
    array (a one-input model). Every array's header is read and checked against its input
    (shape, dtype) first, and the samples' total size against ``SAMPLES_TOTAL_FACTOR``
    times ``limit``, before any data is read or decompressed; two samples that would be
    written to one folder are refused."""
    samples = _sample_headers(source, specs, limit)
    _check_samples(source, samples, specs, limit)
    arrays: dict[tuple[Path, str | None], np.ndarray] = {}
    for file in sorted({f for _, headers in samples for f, _, _ in headers.values()}):
        wanted = {a: h for _, headers in samples for f, a, h in headers.values() if f == file}
        if None in wanted:
            arrays[(file, None)] = load_npy(file, "--inputs", limit, expect=wanted[None])
        else:
            arrays.update(((file, a), arr) for a, arr in load_npz(file, "--inputs", limit, expect=wanted).items())
    return [(name, {i: (arrays[(f, a)], _sample_where(f, a)) for i, (f, a, _) in headers.items()})
            for name, headers in samples]


def _sample_where(file: Path, array: str | None) -> str:
    return f"--inputs {file}" + ("" if array is None else f" array {array!r:.100}")


def _sample_headers(source: Path, specs: list[InputSpec], limit: int | None) -> list[tuple[str, _Headers]]:
    """(sample name, its arrays' headers) per sample of ``--inputs``, sorted by name; no data read."""
    names = [s.name for s in specs]
    if source.is_dir():
        files = sorted(p for p in source.iterdir() if p.suffix in (".npy", ".npz") and not p.name.startswith("."))
        if not files:
            raise IrgenError(f"--inputs {source}: no .npy or .npz files")
        samples: list[tuple[str, _Headers]] = []
        for p in files:
            if p.suffix == ".npy":
                if len(specs) != 1:
                    raise IrgenError(f"--inputs {p}: the model has {len(specs)} inputs ({', '.join(names)}); give "
                                     "one .npz per sample with an array named after each")
                samples.append((p.stem, {names[0]: (p, None, npy_header(p, "--inputs", limit))}))
                continue
            headers = npz_headers(p, "--inputs", limit, names)
            lacking = [n for n in names if n not in headers]
            if lacking:
                raise IrgenError(f"--inputs {p}: no array named {lacking[0]!r} (the model's inputs: {', '.join(names)})")
            samples.append((p.stem, {n: (p, n, headers[n]) for n in names}))
        return samples
    if source.suffix != ".npz":
        raise IrgenError(f"--inputs {source}: expected a folder of .npy/.npz samples or one .npz file")
    if len(specs) != 1:
        raise IrgenError(f"--inputs {source}: one .npz of samples needs a one-input model (it has {len(specs)})")
    headers = npz_headers(source, "--inputs", limit)
    if not headers:
        raise IrgenError(f"--inputs {source}: the .npz holds no arrays")
    return [(k, {names[0]: (source, k, headers[k])}) for k in sorted(headers)]


def _check_samples(source: Path, samples: list[tuple[str, _Headers]], specs: list[InputSpec],
                   limit: int | None) -> None:
    """Every array fits its input (as :func:`load_inputs` checks one), the samples together
    fit ``SAMPLES_TOTAL_FACTOR * limit`` bytes, and no two share an output folder."""
    bound = None if limit is None else SAMPLES_TOTAL_FACTOR * limit
    total, folders = 0, {}
    by_name = {s.name: s for s in specs}
    for k, (name, headers) in enumerate(samples):
        file = next(iter(headers.values()))[0]
        origin = f"{file.name!r:.100}" if source.is_dir() else f"array {name!r:.100}"
        stem = sanitize(name)
        if stem.lower() in folders:  # the output folder OUT/<stem> (case-folding file systems too)
            raise IrgenError(f"--inputs {source}: {folders[stem.lower()]} and {origin} would both be the "
                             f"sample folder {stem!r:.100}; rename one")
        folders[stem.lower()] = origin
        for i, (file, array, h) in headers.items():
            _check_form(h.shape, h.dtype, by_name[i], _sample_where(file, array))
            total += h.nbytes
        if bound is not None and total > bound:
            raise IrgenError(f"--inputs {source}: the first {k + 1} of {len(samples)} samples already hold "
                             f"{human_bytes(total)}, over the limit of {human_bytes(bound)} for all samples together "
                             f"({SAMPLES_TOTAL_FACTOR} x --max-tensor-bytes); raise --max-tensor-bytes if this is "
                             "meant, or give the samples to several runs")
