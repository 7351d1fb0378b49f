"""irgen's environment variables (``IRGEN_*``), each read by one typed parser.

A value that is not what its variable expects is one :class:`irgen.api.IrgenError` line
naming the variable, the value (cut to :data:`SHOWN` characters) and what is expected;
an unset or empty variable gives the default. The parsers:

* :func:`switch`: a boolean (``1``, ``true``, ``yes``, ``on`` / ``0``, ``false``, ``no``,
  ``off``, any case); :func:`turned_off` for the ``IRGEN_NO_*`` switches of the compile steps;
* :func:`positive_int`: a whole number from 1 up;
* :func:`seconds`: a finite number of seconds from 0 up;
* :func:`size`: a byte count such as ``500M``, ``2G`` or ``0`` (units as ``--max-tensor-bytes``).

:data:`VARIABLES` lists every variable with its parser; the CLI checks them all before any
command runs (:func:`check_all`), so a bad value is refused even by a command that never
reads it. ``IRGEN_CACHE_DIR`` (a folder) and ``IRGEN_BLOCK_PLUGINS`` (plugin names,
comma-separated) take any text.
"""

from __future__ import annotations

import math
import os
from typing import Callable

from irgen.api import IrgenError
from irgen.safeio import byte_count

#: the values that turn a switch on (any case, surrounding spaces ignored)
TRUE = frozenset({"1", "true", "yes", "on"})
#: the values that turn a switch off
FALSE = frozenset({"0", "false", "no", "off"})
#: at most this many characters of a bad value are shown
SHOWN = 60
#: the largest number of seconds :func:`seconds` takes (about 31 years; timers overflow beyond)
MAX_SECONDS = 1e9


def _value(name: str) -> str | None:
    """``$name`` without surrounding spaces; None when unset or empty."""
    text = os.environ.get(name, "").strip()
    return text or None


def _refuse(name: str, text: str, expected: str) -> IrgenError:
    """The one-line error for ``name=text`` (the value cut and quoted on one line)."""
    shown = repr(text[:SHOWN] + ("..." if len(text) > SHOWN else ""))
    return IrgenError(f"environment variable {name}={shown}: expected {expected}")


def switch(name: str, default: bool = False) -> bool:
    """``$name`` as a boolean switch; ``default`` when unset or empty."""
    text = _value(name)
    if text is None:
        return default
    if text.lower() in TRUE:
        return True
    if text.lower() in FALSE:
        return False
    raise _refuse(name, text, "1, true, yes or on (or 0, false, no, off)")


def turned_off(env: str, default_on: bool) -> bool:
    """Whether the step that the switch ``env`` turns off is off: ``env`` true turns it off,
    false turns it on, and unset leaves ``default_on`` (a module switch) to decide."""
    return switch(env, not default_on)


def positive_int(name: str, default: int | None = None) -> int | None:
    """``$name`` as a whole number from 1 up; ``default`` when unset or empty."""
    text = _value(name)
    if text is None:
        return default
    if not (text.isascii() and text.isdigit() and len(text) <= 18 and int(text) > 0):
        raise _refuse(name, text, "a whole number from 1 up")
    return int(text)


def seconds(name: str, default: float) -> float:
    """``$name`` as a number of seconds from 0 to :data:`MAX_SECONDS`; ``default`` when unset or empty."""
    text = _value(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_SECONDS:  # NaN and infinities fail too
        raise _refuse(name, text, f"a number of seconds from 0 to {MAX_SECONDS:.0f}")
    return value


def size(name: str, default: int) -> int:
    """``$name`` as a byte count from 0 up (``500M``, ``2G``, ``1.5GiB``, ``0``; K, M, G are
    powers of 1024, KB, MB, GB powers of 1000); ``default`` when unset or empty."""
    text = _value(name)
    if text is None:
        return default
    try:
        return byte_count(text)
    except ValueError:
        raise _refuse(name, text, "a size in bytes such as 500M, 2G or 0") from None


#: every variable irgen reads, with the parse the code that reads it uses
VARIABLES: dict[str, Callable[[str], object]] = {
    "IRGEN_BUILD_THREADS": positive_int,
    "IRGEN_CACHE_SIZE": lambda name: size(name, 0),
    "IRGEN_GENERIC_CPU": switch,
    "IRGEN_NO_SCHEDULE": switch,
    "IRGEN_NO_SHARE": switch,
    "IRGEN_NO_SPILL": switch,
    "IRGEN_PLUGIN_TIMEOUT": lambda name: seconds(name, 0.0),
    "IRGEN_PLUGINS_STRICT": switch,
    "IRGEN_SCHEDULE_DEBUG": switch,
    "IRGEN_TRACEBACK": switch,
}


def check_all() -> None:
    """Parse every variable of :data:`VARIABLES` that is set: the first bad one is an IrgenError."""
    for name, parse in VARIABLES.items():
        parse(name)
