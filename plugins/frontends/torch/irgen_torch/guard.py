"""While torch reads an untrusted file: no unpickling, no code, no logged tracebacks.

:func:`no_code_from_file` is the second layer behind :mod:`irgen_torch.archive`:
whatever torch's loader tries to unpickle while it is active is forced through
torch's weights-only unpickler (plain tensors and containers only), and the
ways torch has to run code from a file raise :class:`irgen.plugin.IrgenError`
naming the file and, when it can be told, the archive member:

- ``torch.load`` (``torch.serialization.load``) always runs with
  ``weights_only=True``, whatever its caller asked for, and
  ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`` is set (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
  removed) for code that holds a reference to the original function;
- ``pickle.load``, ``pickle.loads`` and ``pickle.Unpickler`` refuse;
- ``torch._C._pickle_load_obj`` (TorchScript objects) and
  ``torch._C._aoti.AOTIModelPackageLoader`` (compiled shared libraries) refuse;
- ``sympy.sympify`` refuses a string that is not a plain sympy expression
  (it would ``eval`` it).

Everything is put back when the block ends; a lock keeps two loads in one
process from interleaving their patches.

:func:`quiet_torch` silences what torch logs or warns while it loads (a
truncated archive makes ``torch.export.load`` log a dozen-line traceback
before it raises) and keeps the exceptions it logged, so the one-line error
can name the real cause.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

from irgen.plugin import IrgenError

from .archive import TRUST, Archive, check_sym_expr, one_line, unpickler_reason

_LOCK = threading.RLock()


class PickledDataError(IrgenError):
    """torch's weights-only loader refused a pickle: it holds more than plain tensors."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class _Swallow:
    """Stands in for a torch module's logger: prints nothing, keeps the exceptions it is given."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def _log(self, *args: Any, exc_info: Any = None, **kwargs: Any) -> None:
        err = None
        if exc_info is True:
            err = sys.exc_info()[1]
        elif isinstance(exc_info, BaseException):
            err = exc_info
        elif isinstance(exc_info, tuple) and len(exc_info) == 3:
            err = exc_info[1]
        if err is not None:
            self.errors.append(err)

    debug = info = warning = warn = error = critical = _log

    def exception(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("exc_info", True)
        self._log(*args, **kwargs)

    def log(self, level: int, *args: Any, **kwargs: Any) -> None:
        self._log(*args, **kwargs)

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802  the logging API's name
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(logging.getLogger("irgen.torch.quiet"), name)


def _torch_loggers() -> list[tuple[Any, str]]:
    """(module, attribute) of the loggers torch's .pt2 loading code logs through."""
    import importlib

    out = []
    for mod_name, attr in (("torch.export", "log"), ("torch.export.pt2_archive._package", "logger"),
                           ("torch._export.serde.serialize", "log"), ("torch.serialization", "logger")):
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001  a torch without it
            continue
        if isinstance(getattr(mod, attr, None), logging.Logger):
            out.append((mod, attr))
    return out


@contextmanager
def quiet_torch() -> Iterator[_Swallow]:
    """No log record, no warning printed while torch loads; the logged exceptions kept."""
    swallow = _Swallow()
    with _LOCK:
        saved = [(mod, attr, getattr(mod, attr)) for mod, attr in _torch_loggers()]
        previous = logging.root.manager.disable
        try:
            for mod, attr, _ in saved:
                setattr(mod, attr, swallow)
            logging.disable(logging.CRITICAL)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield swallow
        finally:
            for mod, attr, value in saved:
                setattr(mod, attr, value)
            logging.disable(previous)


def _what(archive: Archive | None, data: Any) -> str:
    if isinstance(data, io.BytesIO):
        data = data.getvalue()
    if isinstance(data, (bytes, bytearray, memoryview)) and archive is not None:
        name = archive.name_of(bytes(data))
        if name:
            return f"archive member {name!r}"
        return "an archive member"
    return ""


@contextmanager
def no_code_from_file(where: str, archive: Archive | None = None) -> Iterator[None]:
    """Inside this block nothing torch reads may be unpickled beyond plain tensors, and no
    code from the file may run; see the module documentation."""
    import pickle

    import sympy
    import torch
    import torch.serialization

    real_load = torch.serialization.load
    real_sympify = sympy.sympify

    def prefix(what: str) -> str:
        return f"{where}: {what}" if what else where

    def weights_only_load(f, map_location=None, pickle_module=None, *, weights_only=None, mmap=None, **kwargs):
        what = _what(archive, f)
        try:
            return real_load(f, map_location=map_location, weights_only=True)
        except IrgenError:
            raise
        except pickle.UnpicklingError as err:
            first = unpickler_reason(err)
            raise PickledDataError(f"{prefix(what)} holds pickled data the weights-only loader refuses ({first}); "
                                   f"unpickling it would run code from the file: {TRUST}", first) from None
        except Exception as err:  # noqa: BLE001  a corrupt payload: RuntimeError, EOFError, ...
            raise IrgenError(f"{prefix(what)}: not a readable torch.save payload "
                             f"({type(err).__name__}: {one_line(err)})") from None

    def refuse_pickle(*args, **kwargs):
        data = args[0] if args else None
        what = _what(archive, data) or (getattr(data, "name", "") and f"{getattr(data, 'name')!r}") or ""
        raise IrgenError(f"{prefix(what)} holds a pickled Python object; unpickling it would run code from "
                         f"the file: {TRUST}")

    class RefusingUnpickler(pickle.Unpickler):
        def __init__(self, *args, **kwargs):
            refuse_pickle(*args)

    def refuse_compiled(*args, **kwargs):
        raise IrgenError(f"{where}: holds AOTInductor compiled code, which torch would load and run: {TRUST}")

    def checked_sympify(a, *args, **kwargs):
        if isinstance(a, str):
            why = check_sym_expr(a)
            if why:
                raise IrgenError(f"{where}: a symbolic expression {a[:60]!r} is not plain sympy ({why}); torch "
                                 f"would evaluate it as Python code: {TRUST}")
        return real_sympify(a, *args, **kwargs)

    patches: list[tuple[Any, str, Any]] = [
        (torch, "load", weights_only_load),
        (torch.serialization, "load", weights_only_load),
        (pickle, "load", refuse_pickle),
        (pickle, "loads", refuse_pickle),
        (pickle, "Unpickler", RefusingUnpickler),
        (sympy, "sympify", checked_sympify),
    ]
    if hasattr(torch._C, "_pickle_load_obj"):
        patches.append((torch._C, "_pickle_load_obj", refuse_pickle))
    aoti = getattr(torch._C, "_aoti", None)
    if aoti is not None and hasattr(aoti, "AOTIModelPackageLoader"):
        patches.append((aoti, "AOTIModelPackageLoader", refuse_compiled))

    env = {"TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": None}
    with _LOCK:
        saved = []
        saved_env = {k: os.environ.get(k) for k in env}
        try:
            for obj, name, new in patches:
                saved.append((obj, name, getattr(obj, name)))
                setattr(obj, name, new)
            _set_env(env)
            yield
        finally:
            for obj, name, old in reversed(saved):
                setattr(obj, name, old)
            _set_env(saved_env)


def _set_env(values: dict[str, str | None]) -> None:
    """Set each variable; ``None`` removes it."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
