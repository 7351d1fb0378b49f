"""Hostile input to irgen's smaller surfaces, found by trying them: ``IRGEN_*`` variables.

Each case runs the real ``irgen`` in a child process and asserts what ``tests/hostile.py``
says: exit code 2, one ``irgen: error:`` line naming the culprit, no OUT and no partial
folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hostile import ENV, assert_refused, irgen

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "tiny_cnn.onnx"  # one input 'x', float32 (1, 3, 32, 32)

pytest.importorskip("onnx")

# ------------------------------------------------------------------ IRGEN_* variables


@pytest.mark.parametrize("name,value", [
    ("IRGEN_CACHE_SIZE", "inf"),
    ("IRGEN_CACHE_SIZE", "-1"),
    ("IRGEN_BUILD_THREADS", "0"),
    ("IRGEN_BUILD_THREADS", "four"),
    ("IRGEN_PLUGIN_TIMEOUT", "nan"),
    ("IRGEN_PLUGIN_TIMEOUT", "inf"),
    ("IRGEN_NO_SHARE", "maybe"),
    ("IRGEN_NO_SCHEDULE", "2"),
    ("IRGEN_GENERIC_CPU", "yes please"),
    ("IRGEN_TRACEBACK", "sometimes"),
    pytest.param("IRGEN_SCHEDULE_DEBUG", "x" * 5000, id="IRGEN_SCHEDULE_DEBUG-long"),
])
def test_bad_environment_variable_is_one_error_line(tmp_path, name, value):
    out = tmp_path / "out"
    proc = irgen("run", MODEL, "-o", out, "--no-progress", env={**ENV, name: value})
    line = assert_refused(proc, out, f"{name}=", value[:40], "expected")
    assert len(line) < 300, line  # the value is cut


def test_environment_parsers():
    from irgen import envflags, parallel_build, plugins
    from irgen.api import IrgenError

    env = {"A": " 2G ", "B": "0", "C": "1.5", "D": "On", "E": "off", "F": "12"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        assert envflags.size("A", 1) == 2 << 30 and envflags.size("B", 1) == 0 and envflags.size("UNSET_X", 7) == 7
        assert envflags.seconds("C", 60.0) == 1.5 and envflags.seconds("UNSET_X", 60.0) == 60.0
        assert envflags.switch("D") is True and envflags.switch("E", True) is False
        assert envflags.positive_int("F") == 12 and envflags.positive_int("UNSET_X") is None
        assert envflags.turned_off("D", True) and not envflags.turned_off("E", False)
        mp.setenv("IRGEN_BUILD_THREADS", "1")
        assert parallel_build.workers() == 1
        for name, value, call in [("IRGEN_BUILD_THREADS", "1.5", parallel_build.workers),
                                  ("IRGEN_PLUGIN_TIMEOUT", "-3", plugins._timeout_seconds)]:
            mp.setenv(name, value)
            with pytest.raises(IrgenError, match=f"{name}='{value}': expected"):
                call()
