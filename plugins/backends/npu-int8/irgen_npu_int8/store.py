"""Writing a tensor as the NPU reads it (``Backend.store_tensor``) and reading it back
(``Backend.read_tensor``), with :mod:`.layout` and :mod:`.formats`.

The record's ``file`` is the ``.bin``; the ``.hex`` and ``.npy`` are its extra files,
listed in ``storage.files`` and in ``manifest.json`` (the hex with ``format``
``readmemh``, ``word_bits``, ``encoding``, and ``byte_order`` ``big``: the digits of a
word, most significant first).
``read_tensor`` reads any of the three back as the logical array.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from irgen.plugin import IrgenError, StoredTensor, TensorInfo

from . import formats, layout, settings


#: how a hex word holds an element, by numpy dtype kind (manifest.json's ``encoding``)
ENCODING = {
    "i": "two's complement, sign-extended to the word",
    "u": "unsigned, zero-extended to the word",
    "b": "0 or 1, zero-extended to the word",
    "f": "IEEE 754 bit pattern",
}


def _with_suffix(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)  # the name may hold dots: never with_suffix


def store_tensor(path: Path, array, info: TensorInfo, config: settings.Settings | None = None) -> StoredTensor:
    config = config or settings.current
    phys, storage = layout.to_physical(np.asarray(array), layout.plan(info.kind, tuple(info.shape), info.layout,
                                                                    info.role, info.op), config.channel_multiple)
    bits = formats.word_bits(phys.dtype, config.hex_word_bits, f"tensor {info.name!r:.100}")  # before any file
    main, hex_path, npy_path = (_with_suffix(path, s) for s in (".bin", ".hex", ".npy"))
    formats.write_bin(main, phys)
    formats.write_hex(hex_path, phys, bits)
    np.save(npy_path, phys.astype(phys.dtype.newbyteorder("<"), copy=False), allow_pickle=False)
    storage.update(byte_order="little", word_bits=bits)
    return StoredTensor(
        file=main,
        extra_files={
            # byte_order of a hex word: its digits, most significant first ($readmemh)
            hex_path: {"format": "readmemh", "word_bits": bits, "byte_order": "big",
                       "encoding": ENCODING[phys.dtype.kind]},
            npy_path: {},
        },
        storage=storage,
    )


def read_physical(path: Path, record: dict) -> np.ndarray:
    """The physical array (the record's ``storage`` shape and dtype) of a ``.bin``, ``.hex`` or
    ``.npy`` file: what the NPU holds in memory, padding included. A ``.bin`` is read in the
    storage's ``byte_order`` (little-endian unless it says ``big``); a ``.hex`` in its
    ``word_bits`` (default: as ``irgen run`` would write the dtype)."""
    storage = record.get("storage")
    if not isinstance(storage, dict):
        raise IrgenError(f"{path}: the record has no storage (not written by npu-int8)")
    dtype, shape = np.dtype(storage["dtype"]), [int(d) for d in storage["shape"]]
    suffix = Path(path).suffix
    if suffix == ".bin":
        phys = formats.read_bin(path, dtype, shape, storage.get("byte_order") or "little")
    elif suffix == ".hex":
        bits = storage.get("word_bits") or formats.word_bits(dtype, settings.current.hex_word_bits)
        phys = formats.read_hex(path, dtype, shape, int(bits))
    elif suffix == ".npy":
        phys = np.load(path, allow_pickle=False)
        if phys.dtype != dtype or list(phys.shape) != shape:
            raise IrgenError(f"{path}: {phys.dtype}{list(phys.shape)}, the storage says {dtype}{shape}")
    else:
        raise IrgenError(f"{path}: not a .bin, .hex or .npy file of npu-int8")
    return phys


def read_tensor(path: Path, record: dict) -> np.ndarray:
    """The logical array of the tensor ``record`` describes, from its ``.bin``, ``.hex`` or ``.npy``."""
    phys = read_physical(path, record)
    return layout.to_logical(phys, record["storage"], record["shape"], record["dtype"])
