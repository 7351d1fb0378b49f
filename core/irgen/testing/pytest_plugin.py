"""irgen's pytest plugin (entry point ``pytest11``: loaded by every pytest run where irgen is installed).

Fixtures:

* ``irgen_plugin(plugin, name=None)``: register a plugin (a module or object with
  ``@hookimpl`` functions) for this test only; returns a loaded
  :class:`irgen.plugins.PluginHost` that has it. Every host loaded during the test
  (``irgen run`` / ``irgen verify`` through :func:`irgen.testing.run_model`,
  :func:`irgen.testing.verify`, :mod:`irgen.testing.conformance`) has it too. After the
  test it is gone, with the recomputes it registered.
* ``irgen_host``: a loaded host of the installed plugins (and those registered by
  ``irgen_plugin`` before it is requested).

The compile cache (:mod:`irgen.cache`) is off in a pytest session unless
``IRGEN_CACHE_SIZE`` is set: a plugin registered for one test must never meet a plan
compiled with another test's plugin of the same name.

This module imports nothing heavy: it is imported by every pytest session.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

import pytest


def pytest_configure(config) -> None:
    os.environ.setdefault("IRGEN_CACHE_SIZE", "0")  # children (irgen run in a subprocess) inherit it


@pytest.fixture
def irgen_plugin() -> Iterator[Callable[..., Any]]:
    """``irgen_plugin(plugin, name=None) -> PluginHost``: ``plugin`` is part of irgen for this test."""
    from irgen.testing import plugin_name, registered

    with contextlib.ExitStack() as stack:
        def register(plugin: Any, name: str | None = None) -> Any:
            return stack.enter_context(registered(plugin, names=[name or plugin_name(plugin)]))

        yield register


@pytest.fixture
def irgen_host() -> Any:
    """A loaded :class:`irgen.plugins.PluginHost` (installed plugins and the test's registered ones)."""
    from irgen.testing import plugin_host

    return plugin_host()
