"""The golden-data files of the ``npu-int8`` backend, written and read back.

Every tensor is written three times, each holding the same physical array
(:mod:`irgen_npu_int8.layout`), element after element in C order:

* ``NAME.bin``: raw little-endian values in the tensor's dtype, no header;
* ``NAME.hex``: text for Verilog's ``$readmemh``: one word per line, lower-case
  hexadecimal, most significant digit first, no prefix and no comments. A word
  is ``hex_word_bits`` wide (8, 16, 32 or 64), or as wide as the element when the
  element is wider (an int32 bias is written in 32-bit words even with 8-bit
  words). Signed integers are in two's complement, **sign-extended** to the word
  (int8 -6 in 16-bit words is ``fffa``); unsigned integers are zero-extended;
  floats are their IEEE 754 bit pattern in a word exactly as wide as the float;
* ``NAME.npy``: the same array for numpy (little-endian).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from irgen.plugin import IrgenError

_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def word_bits(dtype, width: int, what: str = "a tensor") -> int:
    """The hex word width a tensor of ``dtype`` is written in, for the configured ``width``;
    a dtype no word holds (not an integer, boolean or float, or over 64 bits) is refused,
    naming the tensor (``what``)."""
    dtype = np.dtype(dtype)
    bits = dtype.itemsize * 8
    if dtype.kind not in "iubf" or bits > 64:
        raise IrgenError(f"npu-int8: {what} of dtype {dtype}: no .hex encoding (integers, booleans and floats "
                         "of at most 64 bits)")
    return bits if dtype.kind == "f" else max(width, bits)


def write_bin(path: Path, arr: np.ndarray) -> None:
    np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False).tofile(path)


def read_bin(path: Path, dtype, shape, byte_order: str = "little") -> np.ndarray:
    dtype = np.dtype(dtype)
    data = np.fromfile(path, dtype=dtype.newbyteorder("<" if byte_order == "little" else ">"))
    count = int(np.prod(shape, dtype=np.int64))
    if data.size != count:
        raise IrgenError(f"{path}: {data.size} {dtype} values, the storage shape {list(shape)} needs {count}")
    return data.reshape(shape).astype(dtype)


def _words(arr: np.ndarray, bits: int) -> np.ndarray:
    """The words of ``arr`` (C order) as uint64, ``bits`` wide (two's complement, sign-extended)."""
    a = np.ascontiguousarray(arr).reshape(-1)
    if a.dtype.kind == "f":
        a = a.view(np.dtype(f"<u{a.dtype.itemsize}"))
    if a.dtype.kind == "b":
        a = a.astype(np.uint8)
    if a.dtype.kind == "i":
        words = a.astype(np.int64).view(np.uint64)  # sign-extended to 64 bits
    else:
        words = a.astype(np.uint64)
    if bits < 64:
        words = words & np.uint64((1 << bits) - 1)
    return words


def encode_hex(arr: np.ndarray, bits: int) -> bytes:
    """The ``$readmemh`` text of ``arr`` in ``bits``-wide words (see the module docstring)."""
    digits = bits // 4
    words = _words(arr, bits)
    shifts = np.arange(digits - 1, -1, -1, dtype=np.uint64) * np.uint64(4)
    nibbles = (words[:, None] >> shifts[None, :]) & np.uint64(0xF)
    text = np.empty((words.size, digits + 1), dtype=np.uint8)
    text[:, :digits] = _DIGITS[nibbles.astype(np.intp)]
    text[:, digits] = ord("\n")
    return text.tobytes()


def decode_hex(text: bytes, dtype, shape, bits: int) -> np.ndarray:
    """The array a ``.hex`` text holds (``dtype``, ``shape``), refusing a word that is not
    the sign-extension (or zero-extension) of a value of ``dtype``."""
    dtype = np.dtype(dtype)
    digits = bits // 4
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.frombuffer(text, dtype=np.uint8)
    if raw.size != count * (digits + 1):
        raise IrgenError(f"hex text: {raw.size} bytes, {count} words of {digits} digits and a newline need "
                         f"{count * (digits + 1)}")
    raw = raw.reshape(count, digits + 1)
    if not np.all(raw[:, digits] == ord("\n")):
        raise IrgenError(f"hex text: a line is not {digits} hexadecimal digits")
    lower = raw[:, :digits] | 0x20  # 'A'-'F' -> 'a'-'f'
    value = np.where((lower >= ord("0")) & (lower <= ord("9")), lower - ord("0"),
                     np.where((lower >= ord("a")) & (lower <= ord("f")), lower - ord("a") + 10, 255))
    if np.any(value == 255):
        raise IrgenError("hex text: a character that is not a hexadecimal digit")
    words = np.zeros(count, dtype=np.uint64)
    for k in range(digits):
        words = (words << np.uint64(4)) | value[:, k].astype(np.uint64)
    if dtype.kind == "f":
        return words.astype(np.dtype(f"u{dtype.itemsize}")).view(dtype).reshape(shape)
    if dtype.kind == "i":
        signed = words.view(np.int64) if bits == 64 else (
            words.astype(np.int64) - ((words >> np.uint64(bits - 1)).astype(np.int64) << bits))
        info = np.iinfo(dtype)
        if signed.size and (signed.min() < info.min or signed.max() > info.max):
            raise IrgenError(f"hex text: a {bits}-bit word is not a sign-extended {dtype} value")
        return signed.astype(dtype).reshape(shape)
    top = np.iinfo(dtype).max if dtype.kind == "u" else 1
    if words.size and words.max() > np.uint64(top):
        raise IrgenError(f"hex text: a {bits}-bit word is not a {dtype} value")
    return words.astype(dtype).reshape(shape)


def write_hex(path: Path, arr: np.ndarray, bits: int) -> None:
    Path(path).write_bytes(encode_hex(arr, bits))


def read_hex(path: Path, dtype, shape, bits: int) -> np.ndarray:
    return decode_hex(Path(path).read_bytes(), dtype, shape, bits)
