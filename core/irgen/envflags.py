"""Environment switches of irgen's compile steps (``IRGEN_NO_SCHEDULE``, ``IRGEN_NO_SHARE``, ...)."""

from __future__ import annotations

import os

#: the values that turn a switch on (any case, surrounding spaces ignored)
TRUE = frozenset({"1", "true", "yes", "on"})


def turned_off(env: str, default_on: bool) -> bool:
    """Whether the step that the variable ``env`` turns off is off: ``env`` set to a true
    value (1, true, yes, on) turns it off, any other value set turns it on, and unset
    leaves ``default_on`` (a module switch) to decide."""
    value = os.environ.get(env, "").strip().lower()
    if value:
        return value in TRUE
    return not default_on
