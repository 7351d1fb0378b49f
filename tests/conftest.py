"""Shared fixtures, and the session-wide self-check of every output irgen writes.

Every ``irgen.pipeline.run`` in this process (``irgen.cli.main(["run", ...])``
and direct calls alike) is followed by ``irgen verify`` in ``single`` and
``entire`` modes on the fresh output folder: a run whose golden data the numpy
reference cannot reproduce (integer layers exactly) fails the test that made
it. ``IRGEN_TEST_VERIFY=0`` turns the check off; the time it took is printed
at the end of the session.
"""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest

import irgen.pipeline
from irgen.verify import format_table, verify_output

_run = irgen.pipeline.run
VERIFIED = {"outputs": 0, "seconds": 0.0}


def _run_and_verify(host, model, out, *args, **kwargs):
    ir = _run(host, model, out, *args, **kwargs)
    t0 = time.perf_counter()
    result = verify_output(out, modes=("single", "entire"), host=host)  # the run's backend reads its files
    VERIFIED["outputs"] += 1
    VERIFIED["seconds"] += time.perf_counter() - t0
    assert result["passed"], f"irgen verify failed on {out} (from {model}):\n{format_table(result)}"
    return ir


if os.environ.get("IRGEN_TEST_VERIFY", "1") != "0":
    # before the test modules are imported, so `from irgen.pipeline import run` gets the wrapper too
    irgen.pipeline.run = _run_and_verify


def pytest_terminal_summary(terminalreporter):
    if VERIFIED["outputs"]:
        terminalreporter.write_line(
            f"irgen verify (single, entire) on {VERIFIED['outputs']} generated outputs: {VERIFIED['seconds']:.1f} s"
        )


@pytest.fixture
def plugin_file(tmp_path: Path) -> Callable[[str, str], Path]:
    """Write a plugin module: ``plugin_file("myplugin", source)`` -> ``tmp_path/myplugin.py``."""

    def write(name: str, source: str) -> Path:
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        return path

    return write
