"""Turn untrusted model names into safe, unique file names.

Model files come from anywhere: a tensor may be called ``../x``, ``a/b``,
``con`` or be 300 characters long. Every name that becomes a file name goes
through :class:`SafeNames`, which keeps names readable, unique (case-
insensitively, for case-folding file systems) and inside the output folder.
"""

from __future__ import annotations

import hashlib
import re

_WINDOWS_RESERVED = {
    "con", "prn", "aux", "nul",
    *(f"com{i}" for i in range(1, 10)),
    *(f"lpt{i}" for i in range(1, 10)),
}
_MAX_LEN = 100


def sanitize(name: str) -> str:
    """One path component made of ``[A-Za-z0-9_.-]``, never empty, ``.`` or ``..``."""
    s = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._")
    if not s:
        s = "t"
    if s.split(".")[0].lower() in _WINDOWS_RESERVED:
        s = "_" + s
    if len(s) > _MAX_LEN:
        digest = hashlib.sha256(name.encode()).hexdigest()[:12]
        s = s[: _MAX_LEN - 13] + "_" + digest
    return s


def identifier(name: str) -> str:
    """A valid Python/TVMScript identifier derived from ``name``."""
    s = re.sub(r"[^A-Za-z0-9_]+", "_", name).strip("_")
    if not s:
        s = "t"
    if s[0].isdigit():
        s = "t" + s
    return s[:_MAX_LEN]


class SafeNames:
    """Hands out unique sanitized names; the same source name gets the same result."""

    def __init__(self, transform=sanitize):
        self._transform = transform
        self._given: dict[str, str] = {}
        self._taken: set[str] = set()

    def __call__(self, name: str) -> str:
        if name in self._given:
            return self._given[name]
        return self._new(name)

    def fresh(self, name: str) -> str:
        """A name never handed out before, even when ``name`` was seen already."""
        return self._new(name) if name in self._given else self(name)

    def _new(self, name: str) -> str:
        base = self._transform(name)
        candidate, k = base, 1
        while candidate.lower() in self._taken:
            candidate = f"{base}_{k}"
            k += 1
        self._taken.add(candidate.lower())
        self._given.setdefault(name, candidate)
        return candidate
