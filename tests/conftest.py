"""Shared fixtures, and the session-wide self-check of every output irgen writes.

Every ``irgen.pipeline.run`` in this process (``irgen.cli.main(["run", ...])``
and direct calls alike) is followed by ``irgen verify`` in ``single`` and
``entire`` modes on the fresh output folder: a run whose golden data the numpy
reference cannot reproduce (integer layers exactly) fails the test that made
it. ``IRGEN_TEST_VERIFY=0`` turns the check off; the time it took is printed
at the end of the session.

Every ``ir.json`` a test leaves under its ``tmp_path`` (also those written by
``irgen run`` in a child process) must validate against the IR's JSON Schema
(:mod:`irgen.schema`): the test fails naming the file and the violations. A
test that writes invalid ones on purpose says so with ``@pytest.mark.corrupts_ir``.
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest

if not os.environ.get("IRGEN_CACHE_DIR"):  # before irgen reads it; child processes inherit it
    import atexit
    import shutil
    import tempfile

    _SESSION_CACHE = tempfile.mkdtemp(prefix="irgen-test-cache-")
    os.environ["IRGEN_CACHE_DIR"] = _SESSION_CACHE
    atexit.register(shutil.rmtree, _SESSION_CACHE, True)

import irgen.pipeline  # noqa: E402
from irgen.verify import format_table, verify_output  # noqa: E402

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


def pytest_configure(config):
    config.addinivalue_line("markers", "corrupts_ir: the test writes invalid ir.json files on purpose "
                                       "(they are not checked against the IR schema)")


def _ir_files(root: Path):
    """Every regular ``ir.json`` below ``root`` (symbolic links are not followed)."""
    for folder, _, files in os.walk(root):
        path = Path(folder) / "ir.json"
        if "ir.json" in files and path.is_file() and not path.is_symlink():
            yield path


def _schema_violations(root: Path) -> list[str]:
    from irgen.schema import validate_ir

    found = []
    for path in _ir_files(root):
        try:
            problems = validate_ir(json.loads(path.read_bytes()))
        except ValueError as err:
            problems = [f"not JSON ({err})"]
        if problems:
            shown = "\n    ".join(problems[:10]) + (f"\n    ... and {len(problems) - 10} more" if len(problems) > 10 else "")
            found.append(f"{path}:\n    {shown}")
    return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """After a test that used ``tmp_path``: every ir.json it left there is valid against the schema."""
    result = yield
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if tmp is not None and item.get_closest_marker("corrupts_ir") is None:
        bad = _schema_violations(Path(tmp))
        if bad:
            pytest.fail("ir.json not valid against the IR schema (irgen/schemas/ir.schema.json):\n" + "\n".join(bad),
                        pytrace=False)
    return result


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
