"""A checked ``.tflite`` flatbuffer read the way the TFLite interpreter reads it, where the
``tflite`` package (and TVM's importer on it) reads it otherwise: :func:`as_interpreted`.

- **Data stored after the flatbuffer.** TFLite's schema lets a buffer keep its bytes
  outside the flatbuffer, at ``offset`` from the start of the file, ``size`` bytes long:
  the format for models over 2 GB (a flatbuffer cannot address more), which Google's
  ai-edge-quantizer writes for every model it quantizes. The interpreter takes a buffer's
  inline ``data`` when it has one, else its ``offset``/``size`` when the offset is over 1
  (``InterpreterBuilder::ParseTensors``); buffer 0 never holds data. The ``tflite`` package
  knows only inline data: such a buffer reads as empty and its tensor would import as a
  model input. Here ``Buffers(i)`` serves those bytes, a view of the file already in memory
  (no copy); :func:`irgen_tensorflow.tflite_check.check_model` found each inside the file
  and of the size its tensor's shape says first.
- **Operator codes.** An operator code has two fields, ``deprecated_builtin_code`` (int8)
  and ``builtin_code`` (int32); the interpreter's op is the larger of the two
  (``schema_utils.cc``, ``GetBuiltinCode``). The ``tflite`` package returns the deprecated
  field for every op below ``PLACEHOLDER_FOR_GREATER_OP_CODES`` (127), which is right only
  when a writer sets both, as TensorFlow's converter does. ai-edge-quantizer writes the
  operator codes it adds (its ``DEQUANTIZE``) with ``builtin_code`` alone, so the package
  reads 0, ``ADD`` ("cannot import op ADD_109 (ADD): input tensors length should be 2").
  Here ``BuiltinCode()`` is the interpreter's.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def _classes() -> tuple[type, type, type]:
    """(buffer, operator code, model) classes over ``tflite``'s, built on first use (``tflite``
    is imported only then)."""
    import flatbuffers
    import numpy as np
    import tflite

    class OutsideBuffer(tflite.Buffer):
        """A buffer whose data lies at ``offset`` in the file: read as if it were inline."""

        __slots__ = ("_file", "_offset", "_size")

        def __init__(self, inner, file: Any, offset: int, size: int):
            self._tab = inner._tab
            self._file, self._offset, self._size = file, offset, size

        def Data(self, j):  # noqa: N802  (tflite's names)
            return self._file[self._offset + j] if 0 <= j < self._size else 0

        def DataAsNumpy(self):  # noqa: N802
            return np.frombuffer(self._file, np.uint8, count=self._size, offset=self._offset)

        def DataLength(self):  # noqa: N802
            return self._size

        def DataIsNone(self):  # noqa: N802
            return False

    class InterpretedOperatorCode(tflite.OperatorCode):
        """An operator code whose ``BuiltinCode()`` is the interpreter's (the larger field)."""

        __slots__ = ()

        def BuiltinCode(self):  # noqa: N802
            o = flatbuffers.number_types.UOffsetTFlags.py_type(self._tab.Offset(10))
            code = self._tab.Get(flatbuffers.number_types.Int32Flags, o + self._tab.Pos) if o else 0
            return max(int(code), int(self.DeprecatedBuiltinCode()))

    class InterpretedModel(tflite.Model):
        """A ``tflite.Model`` read as the interpreter reads it (see the module text)."""

        __slots__ = ("_outside",)

        def Buffers(self, j):  # noqa: N802
            b = super().Buffers(j)
            where = self._outside.get(int(j))
            if b is None or where is None:
                return b
            return OutsideBuffer(b, self._tab.Bytes, *where)

        def OperatorCodes(self, j):  # noqa: N802
            oc = super().OperatorCodes(j)
            if oc is None:
                return oc
            ours = InterpretedOperatorCode()
            ours.Init(oc._tab.Bytes, oc._tab.Pos)
            return ours

    return OutsideBuffer, InterpretedOperatorCode, InterpretedModel


def as_interpreted(buf: bytes, outside: dict[int, tuple[int, int]]):
    """The ``tflite.Model`` of the checked flatbuffer ``buf`` (the whole file), read as the
    interpreter reads it: the buffers in ``outside`` (index -> (offset, size), checked) from
    the file, and each operator code's builtin code as the larger of its two fields."""
    import tflite

    root = tflite.Model.GetRootAsModel(buf, 0)
    model = _classes()[2]()
    model.Init(root._tab.Bytes, root._tab.Pos)
    model._outside = dict(outside)
    return model
