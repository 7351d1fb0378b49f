"""Shared fixtures."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Callable

import pytest


@pytest.fixture
def plugin_file(tmp_path: Path) -> Callable[[str, str], Path]:
    """Write a plugin module: ``plugin_file("myplugin", source)`` -> ``tmp_path/myplugin.py``."""

    def write(name: str, source: str) -> Path:
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        return path

    return write
